"""A layer's own ``flops`` (what the benchmarks use) is a one-layer GPT's ``flop_report`` minus its head."""

from __future__ import annotations

import pytest
import torch

from modbench import variants
from modbench.config.model import ModelConfig, RoutingConfig
from modbench.model.flops import attention_flops
from modbench.model.gpt import GPT
from modbench.bench.profile_block import bench_config, build_block

ROUTED = [v for v in variants.list_variants() if variants.build_router(v, 8).scope != "none"]


def _one_layer_gpt_minus_head(variant: str, capacity: float, T: int, causal: bool) -> float:
    cfg = ModelConfig(depth=1, n_embd=256, head_dim=64, max_seq_len=2048)
    with torch.device("meta"):
        m = GPT(cfg, RoutingConfig(variant, capacity=capacity, pattern="all"))
    r = m.flop_report(T, causal=causal)
    return r.total - 3 * r.breakdown["head"]  # the head's matmul: forward + 2× backward


@pytest.mark.parametrize("variant", ["dense", *ROUTED])
@pytest.mark.parametrize("capacity", [0.125, 0.5])
@pytest.mark.parametrize("causal", [True, False])
def test_block_flops_equal_one_layer_model_flops_minus_head(variant, capacity, causal):
    T = 1024
    with torch.device("meta"):
        layer = build_block(variant, capacity, bench_config())
    assert layer.flops(T, causal=causal).total == pytest.approx(
        _one_layer_gpt_minus_head(variant, capacity, T, causal), rel=1e-12
    )


def test_bar_point_flop_ratio_by_hand():
    """T = 1024, C = 0.125, d = 256, sigmoid: k = 128; the linear router costs 2d forward,
    4d backward per token on all T tokens."""
    d, T, k = 256, 1024, 128
    with torch.device("meta"):
        routed = build_block("sigmoid", 0.125, bench_config())
        dense = build_block("dense", 1.0, bench_config())
    dense_fwd = 24 * d * d * T + attention_flops(d, T, causal=True)
    routed_fwd = 24 * d * d * k + attention_flops(d, k, causal=True)
    assert dense.flops(T).total == 3 * dense_fwd
    assert routed.flops(T).total == 3 * routed_fwd + 6 * d * T
    ratio = routed.flops(T).total / dense.flops(T).total
    assert ratio == pytest.approx(0.0979, abs=5e-4)  # the "FLOP limit about 0.10"
