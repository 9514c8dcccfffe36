"""CUDA-graph capture mechanics: the warm-up on a side stream, the capture of a step or of a split step's
piece, and torch's capture of a branch as CUDA graph conditional nodes (or why this torch has none).

A module of its own because two decoders capture with it: the static decoder
(``modbench.model.static_decode.StaticDecoder``: its "graph" runner, the "-cond" steps' conditional nodes
and the "-split" steps' pieces) and the benchmark's reference decoder (``modbench.bench.reference_decoder``,
issue 38's yardstick), which thus needs nothing of the routed model's decoder. Nothing here knows a model:
each function takes the step, or the piece, it captures as a function.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from contextlib import nullcontext

import torch
from torch import Tensor

from modbench.errors import ModbenchError

GRAPH_WARMUP = 2  # eager steps on a side stream before a CUDA graph capture (lazy cuBLAS/SDPA setup)
COMPILE_WARMUP = 3  # compiled steps before timing: compile, then Inductor's CUDA graph warm-up and recording


def uncached_autocast(device: torch.device):
    """The autocast in force, without its cast cache, for a CUDA graph capture: a cached cast made
    outside the capture would be read by the graph as a plain tensor (and freed when the caller's
    autocast exits), so every cast must happen inside it (as torch.cuda.graph's notes ask)."""
    if not torch.is_autocast_enabled(device.type):
        return nullcontext()
    return torch.autocast(device.type, dtype=torch.get_autocast_dtype(device.type), cache_enabled=False)


def capture_cuda_graph(step: Callable[[Tensor], Tensor], idx: Tensor, warmup: int = GRAPH_WARMUP, *,
                       warming: Callable = nullcontext, capturing: Callable = nullcontext) -> tuple:
    """(graph, output): ``step(idx)`` captured in a ``torch.cuda.CUDAGraph``, after ``warmup`` eager calls
    on a side stream (as ``torch.cuda.graphs`` asks: lazy cuBLAS and SDPA set-up happen outside the
    capture), each phase inside its context (``warming()``, ``capturing()``). Replay after copying the
    next input into ``idx``; the output tensor is overwritten by each replay."""
    with warming():
        warm_up(lambda: step(idx), idx.device, warmup)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), capturing():
        out = step(idx)
    return graph, out


def warm_up(run: Callable[[], None], device: torch.device, times: int = GRAPH_WARMUP) -> None:
    """``run()`` ``times`` before a capture, on CUDA on a side stream (as ``torch.cuda.graphs`` asks: lazy cuBLAS
    and SDPA set-up happen outside the capture), the current stream waiting for it after."""
    if device.type != "cuda":
        for _ in range(times):
            run()
        return
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(times):
            run()
    torch.cuda.current_stream(device).wait_stream(side)


def cuda_graph_piece(piece: Callable[[], None]) -> Callable[[], None]:
    """A split step's piece (``modbench.model.static_decode.StepSpec.split``) captured in a CUDA graph of its
    own (its own memory pool, so that whatever it leaves alive stays put whichever branch replays later);
    returns its replay. The piece's warm-up ran before (``StaticDecoder._capture_pieces``)."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        piece()
    return graph.replay


def eager_piece(piece: Callable[[], None]) -> Callable[[], None]:
    """A split step's piece "captured" without CUDA: run now (as a capture records it) and again at each
    replay. It rehearses everything of the split steps but the CUDA graphs on a CPU: tests, and the decode
    bench's dry run (``modbench.bench.gpu_decode``)."""
    piece()
    return piece


def branch_capture_missing() -> str:
    """Why this torch cannot capture a branch in a CUDA graph (``modbench.model.static_decode.BRANCH_CAPTURE_STEPS``
    on CUDA), or "" when it can. That needs torch's ``if_else_node`` and the ``CUDAGraph`` methods it calls
    (``begin_capture_to_if_node``); torch 2.11, the lent GPU machine's, has neither (read on 2026-11-27 in
    its CUDA build: ``torch._higher_order_ops`` has no ``cudagraph_conditional_nodes``), so there the
    "-cond" steps can branch on the host only ("static-cond")."""
    try:
        importlib.import_module("torch._higher_order_ops.cudagraph_conditional_nodes")
    except ImportError:
        return f"torch {torch.__version__} has no CUDA graph conditional nodes (no if_else_node)"
    if not hasattr(torch.cuda.CUDAGraph, "begin_capture_to_if_node"):
        return f"torch {torch.__version__} cannot capture to a CUDA graph conditional node (a build without CUDA?)"
    return ""


def require_if_else_node() -> Callable:
    """torch's capture of a branch as CUDA graph conditional nodes (``if_else_node(pred, true_fn,
    false_fn, operands)``, what Inductor's CUDA-graph trees run a ``torch.cond`` with); a torch
    without it cannot run the "-cond" steps in a CUDA graph: a ``ModbenchError`` says why
    (``branch_capture_missing``)."""
    why = branch_capture_missing()
    if why:
        raise ModbenchError(f"{why}: cannot capture a branch in a CUDA graph; expected decode step 'graph' or "
                            "'compile' (or 'static-cond', which branches on the host)")
    from torch._higher_order_ops.cudagraph_conditional_nodes import if_else_node

    return if_else_node
