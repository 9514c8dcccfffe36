"""Speed of one routed block, forward + backward, against the dense block with its weights.

Matrix: every routed variant × C ∈ {0.125, 0.25, 0.5, 1.0} × T ∈ {512, 2048}, plus the
issue's bar point T = 1024 (B = 8) at C ∈ {0.125, 0.5}; one dense reference per T.
d = 256 (4 heads of 64), fp32, 2 threads on CPU; on CUDA d = 1024 (8 heads of 128: a d = 256
block is too small for a GPU's time to be its FLOPs), bf16 autocast, compiled. Batch: B = 8 at T = 512 and 1024, B = 4 at
T = 2048 (8 192 tokens a batch, like the bar point T = 1024, B = 8; at B = 2 a C = 0.125 block
multiplies only 512-row matrices, whose lower FLOP rate, not the routing, then dominates the
time ratio), recorded in extra_info.

At C = 1.0 this times a ``RoutedBlock`` with k = T — the cost of the routing machinery
when it saves nothing (GPT itself builds plain blocks at C = 1.0; see test_model_speed).

``extra_info``: variant, capacity, seq_len, batch, k, router_scope, analytic_flops (forward
+ backward of the batch, causal convention, each layer's ``flops``),
dense_flops, flop_ratio, tokens, tokens_processed, device, dtype, compiled.
``python -m modbench.bench.table`` turns the JSON into time ratio vs FLOP ratio.
"""

from __future__ import annotations

import pytest
import torch

from modbench import variants
from modbench.model.gpt import DenseLayer, RoutedBlock
from modbench.bench.profile_block import bench_config, block_inputs, build_block, fwd_bwd

ROUTED = [v for v in variants.list_variants() if variants.build_router(v, 8).scope != "none"]
BATCH = {512: 8, 1024: 8, 2048: 4}
# On CUDA 65 536 tokens a batch: on an H200 (torch 2.11) a compiled block's forward + backward costs
# about 1.9 ms of host time (launches, guards, autograd) whatever its size, and at B = 4, T = 2048 the
# C = 0.125 block's kernels take a fraction of that, so the ratio timed the host (0.994 vs a FLOP
# ratio of 0.109); 8x the tokens puts the dense block's GPU time (~15 ms) well above that floor.
CUDA_BATCH = {512: 128, 1024: 64, 2048: 32}
CAPACITIES = {512: (0.125, 0.25, 0.5, 1.0), 1024: (0.125, 0.5), 2048: (0.125, 0.25, 0.5, 1.0)}
MAX_SEQ_LEN = 2048
# Seconds per entry when benchmarking; a routed entry's rounds include its dense reference.
BUDGET_S = {"cpu": 3.0, "cuda": 1.0}


def _cases():
    # Per T: the dense reference first, then the variants, then the dense reference again
    # (timed only when benchmarking): modbench.bench.table takes the better of the two, so
    # a burst of load on a shared machine during one dense run cannot flatter every ratio.
    for T in BATCH:
        yield pytest.param("dense", 1.0, T, 0, id=f"T{T}-dense")
        for v in ROUTED:
            for c in CAPACITIES[T]:
                yield pytest.param(v, c, T, 0, id=f"T{T}-{v}-C{c}")
        yield pytest.param("dense", 1.0, T, 1, id=f"T{T}-dense-again")


def test_matrix_covers_every_routed_variant():
    assert {"norm", "linear_softmax", "sigmoid", "learned_temperature", "mlp_skip", "random", "nested", "token_choice",
            "threshold", "pmod", "mode_staged"} <= set(ROUTED)


@pytest.mark.parametrize("variant,capacity,seq_len,repeat", list(_cases()))
def test_block_fwd_bwd(variant, capacity, seq_len, repeat, device, run_bench):
    if repeat and run_bench.disabled:
        pytest.skip("a second dense reference is timed only when benchmarking")
    B, T = (CUDA_BATCH if device == "cuda" else BATCH)[seq_len], seq_len
    cfg = bench_config(max_seq_len=MAX_SEQ_LEN, device=device)
    layer = build_block(variant, capacity, cfg).to(device)
    x, grad, cos, sin = block_inputs(cfg, B, T, device)
    with torch.device("meta"):
        dense_ref = DenseLayer(cfg)  # FLOPs only: no memory, no init cost
    fl, dense_fl = layer.flops(T), dense_ref.flops(T)
    k = fl.tokens_processed
    router_scope = layer.router.scope if isinstance(layer, RoutedBlock) else "none"

    cuda = device == "cuda"
    autocast = torch.bfloat16 if cuda else None

    def timed_step(module):
        return torch.compile(module, fullgraph=True) if cuda else module

    step = fwd_bwd(timed_step(layer), x, grad, cos, sin, autocast=autocast)

    def dense_reference():  # built only when benchmarking: the same weights, its own inputs
        dense = build_block("dense", 1.0, cfg).to(device)
        return fwd_bwd(timed_step(dense), *block_inputs(cfg, B, T, device), autocast=autocast)

    out = run_bench(
        step, kind="block", seq_len=T, device=device,
        budget_s=BUDGET_S[device], reference=None if variant == "dense" else dense_reference,
        extra_info=dict(
            variant=variant, capacity=capacity, batch=B, repeat=repeat, k=k, router_scope=router_scope,
            d_model=cfg.width, analytic_flops=fl.total * B, dense_flops=dense_fl.total * B,
            flop_ratio=fl.total / dense_fl.total, tokens=B * T, tokens_processed=B * k,
            flop_convention="causal, forward + backward (2x forward per matmul), router's own backward",
            dtype="bf16-autocast" if cuda else "fp32", compiled=cuda,
        ),
    )

    # The correctness half: one full-size call must be right, benchmarked or not.
    assert out.shape == (B, T, cfg.width)
    assert torch.isfinite(out).all()
    assert x.grad is not None and x.grad.shape == x.shape and torch.isfinite(x.grad).all()
    no_grad = [n for n, p in layer.named_parameters() if p.grad is None or not torch.isfinite(p.grad).all()]
    assert no_grad == [], f"parameters without a finite gradient: {no_grad}"
    router = layer.router if isinstance(layer, RoutedBlock) else None
    variable = router is not None and router.variable_count
    scales_skipped = router is not None and router.skip_scale(x.detach()) is not None  # p-MoD writes every row
    if router_scope != "mlp" and not scales_skipped:  # attention writes every token under mlp_skip
        changed = (out.detach() != x.detach()).any(-1).sum(-1)
        if variable:  # token choice / threshold: what the rule decided, within the k_max slots
            assert all(0 < c <= k for c in changed.tolist()), "a routed block writes at most its k_max slots"
        else:
            assert changed.tolist() == [k] * B, "a routed block must write exactly its k tokens"
    if variant != "dense":
        # k_max = slack·C·T slots reach T at C = 0.5 with the default slack 2: as dense, plus the router, and plus
        # a token-local skip's update (dtrnet's bypass: 2·2d² a token, ×3 with its backward), which the batched
        # forward computes for every token
        local = 3 * 4 * cfg.width**2 * T if router is not None and router.mixing.skip == "local" else 0
        assert 0 < (fl.total - local) / dense_fl.total < (1.05 if capacity == 1.0 or variable else 1.0)
