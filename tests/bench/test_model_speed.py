"""Speed of a full training step (forward + backward + AdamW) of a routed GPT vs the dense one.

GPT depth 4, d = 256 (4 heads of 64), the ``alternate`` pattern (D M D M: Raposo et al.
2024 §3.4), every routed variant × C ∈ {0.125, 0.25, 0.5, 1.0} × T ∈ {512, 2048}; small
batches (B = 4 at T = 512, B = 1 at T = 2048: 2 048 tokens a step) so the CI run stays short.
On CUDA: d = 1024 (8 heads of 128) and 16 384 tokens a step (B = 32 at T = 512, 8 at T = 2048),
bf16 autocast, compiled: a GPU step of 2 048 tokens at d = 256 times kernel launches.
At C = 1.0 GPT builds plain blocks (no router), so those entries time the dense model again:
their ratio to the dense entry is the measurement noise of the run.

``analytic_flops`` is ``model.flop_report(T).total × B`` (causal, forward +
backward, head included; the optimizer's O(parameters) update is not counted), and
``dense_flops`` the same for the dense GPT of the same shape. The bar (reported by
``modbench.bench.table``, not asserted): alternate, C = 0.125 reaches ≥ 85 % of the
theoretical speed-up dense_flops / analytic_flops.
"""

from __future__ import annotations

import pytest
import torch

from modbench import variants
from modbench.config.model import RoutingConfig
from modbench.model.gpt import GPT, RoutedBlock
from modbench.config.patterns import pattern_string
from modbench.bench.profile_block import bench_config, train_step

ROUTED = [v for v in variants.list_variants() if variants.build_router(v, 8).scope != "none"]
BATCH = {512: 4, 2048: 1}
CUDA_BATCH = {512: 32, 2048: 8}
CAPACITIES = (0.125, 0.25, 0.5, 1.0)
PATTERN = "alternate"
DEPTH = 4
MAX_SEQ_LEN = 2048
AUX_STEP = 10**6  # aux-loss weights past any warm-up: the step pays for every aux loss
# Seconds per entry when benchmarking; a routed entry's rounds include its dense reference.
BUDGET_S = {"cpu": 4.0, "cuda": 1.0}
MIN_ROUNDS = 4  # a CPU round is ~1 s here (routed step + dense step)


def _model(cfg, routing: RoutingConfig, device: str) -> GPT:
    torch.manual_seed(0)
    return GPT(cfg, routing).to(device).train()


def _train_step(model: GPT, idx: torch.Tensor, targets: torch.Tensor, device: str):
    """The timed closure (``modbench.bench.profile_block.train_step``): bf16 autocast and compiled on CUDA."""
    cuda = device == "cuda"
    return train_step(model, idx, targets, forward=torch.compile(model, fullgraph=True) if cuda else None,
                      autocast=torch.bfloat16 if cuda else None, aux_step=AUX_STEP)


def _cases():
    # dense, the variants, dense again (see test_block_speed._cases)
    for T in BATCH:
        yield pytest.param("dense", 1.0, T, 0, id=f"T{T}-dense")
        for v in ROUTED:
            for c in CAPACITIES:
                yield pytest.param(v, c, T, 0, id=f"T{T}-{v}-C{c}")
        yield pytest.param("dense", 1.0, T, 1, id=f"T{T}-dense-again")


@pytest.mark.parametrize("variant,capacity,seq_len,repeat", list(_cases()))
def test_model_train_step(variant, capacity, seq_len, repeat, device, run_bench):
    if run_bench.disabled and (repeat or (capacity == 1.0 and variant != "dense")):
        # Not worth a CI call: at C = 1.0 GPT builds exactly the dense model
        # (tests/test_routed_block.py checks that); these entries only time the noise.
        pytest.skip("a duplicate of the dense model, timed only when benchmarking")
    B, T = (CUDA_BATCH if device == "cuda" else BATCH)[seq_len], seq_len
    cfg = bench_config(max_seq_len=MAX_SEQ_LEN, depth=DEPTH, device=device)
    model = _model(cfg, RoutingConfig(variant, capacity=capacity, pattern=PATTERN), device)
    with torch.device("meta"):
        dense_ref = GPT(cfg)  # FLOPs only
    flops, dense_flops = model.flop_report(T), dense_ref.flop_report(T)
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, cfg.vocab_size, (B, T), generator=g).to(device)
    targets = torch.randint(0, cfg.vocab_size, (B, T), generator=g).to(device)
    step = _train_step(model, idx, targets, device)

    def dense_reference():  # built only when benchmarking
        return _train_step(_model(cfg, RoutingConfig("dense", capacity=1.0), device), idx, targets, device)

    before = model.head.weight.detach().clone()
    losses: list[torch.Tensor] = []

    def recorded_step() -> torch.Tensor:  # benchmarking repeats the step on one batch: keep the first loss
        loss = step()
        losses.append(loss)
        return loss

    run_bench(
        recorded_step, kind="model", seq_len=T, device=device,
        budget_s=BUDGET_S[device], reference=None if variant == "dense" else dense_reference,
        min_rounds=MIN_ROUNDS,
        extra_info=dict(
            variant=variant, capacity=capacity, batch=B, repeat=repeat, depth=DEPTH, d_model=cfg.width,
            pattern=PATTERN, layers=pattern_string(model.routed_flags),
            k=next((layer.capacity.k(T) for layer in model.layers if isinstance(layer, RoutedBlock)), T),
            analytic_flops=flops.total * B, dense_flops=dense_flops.total * B,
            flop_ratio=flops.total / dense_flops.total, tokens=B * T,
            tokens_processed=B * sum(flops.tokens_processed),
            flop_convention="causal, forward + backward, head included, optimizer excluded",
            optimizer="AdamW", dtype="bf16-autocast" if device == "cuda" else "fp32", compiled=device == "cuda",
        ),
    )

    # The correctness half. The first step's loss is the untrained model's (≈ ln 256 = 5.55); a
    # benchmark's later rounds repeat the step on the same batch, which a d = 1024 model memorises
    # (measured on an H200: 0.22 after ~100 rounds), so those only have to stay finite.
    assert 4.0 < losses[0].item() < 7.0
    assert all(torch.isfinite(loss) for loss in losses)
    no_grad = [n for n, p in model.named_parameters() if p.grad is None or not torch.isfinite(p.grad).all()]
    assert no_grad == [], f"parameters without a finite gradient: {no_grad}"
    assert not torch.equal(model.head.weight.detach(), before), "the optimizer step changed nothing"
    routed = sum(model.routed_flags)
    assert routed == (0 if capacity == 1.0 or variant == "dense" else DEPTH // 2)
    if routed and model.routers[0].variable_count:  # k_max slots reach T at C = 0.5 (slack 2): dense plus routers
        # (plus a token-local skip's update, computed for every token by the batched forward: dtrnet's bypass)
        local = sum(3 * 4 * cfg.width**2 * T for r in model.routers if r.mixing.skip == "local")
        assert flops.total - local < 1.05 * dense_flops.total
    elif routed:
        assert flops.total < dense_flops.total
    else:
        assert flops.total == dense_flops.total
