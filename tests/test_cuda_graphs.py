"""CUDA-graph capture mechanics (``modbench.model.cuda_graphs``):

- a torch without CUDA graph conditional nodes is named (``branch_capture_missing``) and the "-cond"
  steps refuse in one line before anything is captured (``require_if_else_node``);
- without CUDA, ``warm_up`` runs its function in place, ``eager_piece`` stands in for a piece's capture,
  and ``uncached_autocast`` keeps the autocast in force without its cast cache.

The captures themselves need CUDA: tests/test_static_decode.py's CUDA-only tests replay the static
decoder's graphs, conditional nodes and split pieces against its eager step.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch

from modbench.errors import ModbenchError
from modbench.model.cuda_graphs import (GRAPH_WARMUP, branch_capture_missing, eager_piece, require_if_else_node,
                                        uncached_autocast, warm_up)


def test_a_torch_without_cuda_graph_conditional_nodes_is_named_before_any_capture(monkeypatch):
    """torch 2.11 (the lent GPU machine's) has no ``cudagraph_conditional_nodes`` and no
    ``CUDAGraph.begin_capture_to_if_node``: "graph-cond" and "compile-cond" cannot run there, and the
    decoder says so with the torch version and the steps that can, before it captures or compiles anything
    (make gpu-decode-bench marks those cells "n/a" with the same words)."""
    monkeypatch.setitem(sys.modules, "torch._higher_order_ops.cudagraph_conditional_nodes",
                        types.ModuleType("cudagraph_conditional_nodes"))  # (as torch 2.13 has it)
    monkeypatch.setattr(torch.cuda.CUDAGraph, "begin_capture_to_if_node", lambda *a: None, raising=False)
    assert branch_capture_missing() == ""  # the module, and a CUDAGraph that has the method
    monkeypatch.delattr(torch.cuda.CUDAGraph, "begin_capture_to_if_node")
    assert "cannot capture to a CUDA graph conditional node" in branch_capture_missing()
    monkeypatch.setitem(sys.modules, "torch._higher_order_ops.cudagraph_conditional_nodes", None)  # import fails
    why = branch_capture_missing()
    assert why == f"torch {torch.__version__} has no CUDA graph conditional nodes (no if_else_node)"
    with pytest.raises(ModbenchError, match=r"no CUDA graph conditional nodes.*expected decode step 'graph' or 'compile'"):
        require_if_else_node()


def test_warm_up_eager_piece_and_uncached_autocast_without_cuda():
    """On a CPU ``warm_up`` runs its function ``times`` (``GRAPH_WARMUP`` by default); ``eager_piece`` runs a
    piece once, as a capture records it, and returns it as its replay; ``uncached_autocast`` is no autocast
    where none is in force, else the same autocast without its cast cache."""
    cpu = torch.device("cpu")
    calls = []
    warm_up(lambda: calls.append("warm"), cpu)
    warm_up(lambda: calls.append("again"), cpu, times=1)
    assert calls == ["warm"] * GRAPH_WARMUP + ["again"]
    calls.clear()
    replay = eager_piece(lambda: calls.append("piece"))
    assert calls == ["piece"]
    replay()
    assert calls == ["piece", "piece"]
    with uncached_autocast(cpu):
        assert not torch.is_autocast_enabled("cpu")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.is_autocast_cache_enabled()
        with uncached_autocast(cpu):
            assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
            assert not torch.is_autocast_cache_enabled()
