"""The dense-layer ladder (``modbench.bench.dense_layer``, issue 38 item 3) compares like with like.

Its rows are only an attribution if each step is the last one plus one feature: the steps that
claim modbench's arithmetic must give modbench's ``DenseLayer`` output, every step must run the
same matmuls (FlopCounterMode), and the RoPE change must keep q and k in the activations' dtype
under autocast while leaving fp32 runs bit for bit unchanged.
"""

from __future__ import annotations

import json

import torch
from torch.utils.flop_counter import FlopCounterMode

from modbench.bench import dense_layer
from modbench.bench.profile_block import block_inputs
from modbench.config.model import ModelConfig
from modbench.model.gpt import apply_rope, rope_tables

CFG = ModelConfig(depth=1, n_embd=64, head_dim=16, max_seq_len=32)


def test_rope_steps_are_modbench_arithmetic_and_the_reference_is_not():
    ladder = dense_layer.build_ladder(CFG)
    x, _, cos, sin = block_inputs(CFG, 2, 32)
    with torch.no_grad():
        out = {step: fn(x, cos, sin) for step, fn in ladder.items()}
    # fp32: the rotation's dtype changes nothing, and the ladder's last step is DenseLayer's arithmetic.
    assert torch.equal(out["+ rope fp32"], out["+ rope"])
    torch.testing.assert_close(out["+ rope"], out["modbench"], rtol=1e-6, atol=1e-6)
    assert not torch.allclose(out["+ rmsnorm"], out["+ rope"], atol=1e-3)  # RoPE is really on in step 3
    assert not torch.allclose(out["reference"], out["+ rmsnorm"], atol=1e-3)  # and LayerNorm really differs


def test_every_step_runs_the_same_matmuls():
    ladder = dense_layer.build_ladder(CFG)
    x, _, cos, sin = block_inputs(CFG, 2, 32)
    flops = {}
    for step, fn in ladder.items():
        with FlopCounterMode(display=False) as counter:
            fn(x, cos, sin).sum().backward()
        flops[step] = counter.get_total_flops()
    assert len(set(flops.values())) == 1, flops


def test_rope_keeps_the_activations_dtype_under_autocast():
    cos, sin = rope_tables(16, 8, 10000.0)
    q = torch.randn(1, 2, 16, 8).bfloat16()
    assert apply_rope(q, cos, sin).dtype == torch.bfloat16  # fp32 tables used to promote q to fp32
    reference = dense_layer.rotate(q.float(), cos, sin)  # the rotation in fp32, rounded once
    torch.testing.assert_close(apply_rope(q, cos, sin).float(), reference, rtol=2e-2, atol=2e-2)
    q32 = q.float()
    assert torch.equal(apply_rope(q32, cos, sin), dense_layer.rotate(q32, cos, sin))  # fp32: bit for bit


def test_main_writes_every_step_and_refuses_bad_input(tmp_path, capsys):
    path = tmp_path / "dense.json"
    assert dense_layer.main(["--batch", "1", "--seq-len", "32", "--rounds", "1", "--json", str(path)]) == 0
    data = json.loads(path.read_text())
    assert [r["step"] for r in data["rows"]] == list(dense_layer.STEPS)
    assert data["rows"][0]["ratio"] == 1.0 and all(r["median_ms"] > 0 for r in data["rows"])
    assert "| modbench |" in capsys.readouterr().out
    assert dense_layer.main(["--rounds", "0"]) == 2
    assert "--rounds must be >= 1" in capsys.readouterr().err
