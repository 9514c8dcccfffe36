"""Model FLOPs utilisation of the dense training step (the issue's baseline bar: MFU ≥ 40 %).

CUDA only: dense GPT, depth 12, d ∈ {1024, 2048} (heads of 128, FlashAttention's best shape on
Hopper), T ∈ {2048, 4096}, 16 384 tokens a step (B = 8 at T = 2048, B = 4 at T = 4096), bf16
autocast, ``torch.compile`` — the step the trainer runs (``modbench.run.train``: forward, LM
loss, backward, gradient clipping, its own ``build_optimizer``; the training loop itself is not
timed, so that the step is all the benchmark measures).

    MFU = achieved FLOP/s / peak FLOP/s,  achieved = analytic training FLOPs per step / step time

(Chowdhery et al. 2022, PaLM, appendix B). The analytic FLOPs are the model's own count
(``GPT.flop_report(T).total × B``: causal attention, forward + backward, head included,
optimizer excluded), the same number the trainer's ``perf/mfu`` uses; PaLM counts attention
over the full T × T, recorded as ``mfu_noncausal`` (higher by the masked half of attention). The
peak is the dense bf16 tensor-core peak of ``modbench.run.step_metrics.peak_flops`` (H100 SXM:
989e12). ``modbench.bench.table`` computes MFU from the JSON (``analytic_flops``, the statistic,
``peak_flops``) and reports the bar. On CPU, ``test_mfu_arithmetic`` checks that arithmetic
against the trainer's formula on one tiny, real step.
"""

from __future__ import annotations

import time

import pytest
import torch

from modbench.bench import table as bench_table
from modbench.config.model import ModelConfig
from modbench.config.run import RunConfig, TrainConfig
from modbench.model.gpt import GPT
from modbench.run import step_metrics
from modbench.run.step_metrics import peak_flops
from modbench.run.train import build_optimizer

DEPTH = 12
HEAD_DIM = 128
TOKENS_PER_STEP = 16_384
SHAPES = [(d, T) for d in (1024, 2048) for T in (2048, 4096)]
BUDGET_S = 2.0  # seconds per entry when benchmarking


def _config(d_model: int, seq_len: int, depth: int = DEPTH, head_dim: int = HEAD_DIM) -> ModelConfig:
    return ModelConfig(depth=depth, n_embd=d_model, head_dim=head_dim, max_seq_len=seq_len)


def _train_step(model: GPT, idx: torch.Tensor, targets: torch.Tensor, device: str):
    """The timed closure: the trainer's step (one micro-batch). Gradients are reset first, so
    after a call they are there to check."""
    cuda = device == "cuda"
    opt = build_optimizer(model, RunConfig(model=model.cfg, train=TrainConfig(seq_len=idx.shape[1])))
    forward = torch.compile(model) if cuda else model

    def step() -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device, dtype=torch.bfloat16, enabled=cuda):
            out = forward(idx, targets)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), TrainConfig().grad_clip)
        opt.step()
        return out.loss.detach()

    return step


def _batch(cfg: ModelConfig, B: int, T: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, cfg.vocab_size, (B, T), generator=g)
    targets = torch.randint(0, cfg.vocab_size, (B, T), generator=g)
    return idx.to(device), targets.to(device)


def _check_step(model: GPT, loss: torch.Tensor, before: torch.Tensor) -> None:
    """One step of a freshly initialised model on random bytes: a sane loss, finite gradients
    everywhere, and the optimizer moved the weights."""
    assert torch.isfinite(loss) and 4.0 < loss.item() < 7.0  # ≈ ln 256 = 5.55 at init
    bad = [n for n, p in model.named_parameters() if p.grad is None or not torch.isfinite(p.grad).all()]
    assert bad == [], f"parameters without a finite gradient: {bad}"
    assert not torch.equal(model.head.weight.detach(), before), "the optimizer step changed nothing"


def test_mfu_arithmetic(monkeypatch):
    """MFU of one real (tiny, CPU) step, three ways that must agree: by hand, by the table's
    ``mfu`` (what the benchmark reports) and by the trainer's ``perf/mfu`` step metric, with
    the H100's peak from the ``peak_flops`` table."""
    B, T = 2, 32
    cfg = _config(64, T, depth=2, head_dim=32)
    torch.manual_seed(0)
    model = GPT(cfg).train()
    step = _train_step(model, *_batch(cfg, B, T, "cpu"), "cpu")
    before = model.head.weight.detach().clone()
    t0 = time.perf_counter()
    loss = step()
    seconds = time.perf_counter() - t0
    _check_step(model, loss, before)

    # peak_flops reads the CUDA device's name: an H100's, without a GPU.
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *_: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(step_metrics, "peak_memory_mb", lambda _device: 0.0)
    gpu = torch.device("cuda")
    peak = peak_flops(gpu)
    assert peak == 989e12  # dense bf16 tensor-core peak of the H100 SXM

    flops_per_step = model.flop_report(T).total * B
    assert flops_per_step == pytest.approx(model.flops_per_token(T) * B * T, rel=1e-12)
    by_hand = flops_per_step / seconds / peak
    assert bench_table.mfu(flops_per_step, seconds, peak) == pytest.approx(by_hand, rel=1e-12)

    # The trainer's metric over a window of one step of B·T tokens taking `seconds`.
    run = type("Run", (), dict(tokens_per_step=B * T, flops_per_token=model.flops_per_token(T), step=1, device=gpu,
                               model=model, cfg=RunConfig(model=cfg, train=TrainConfig(seq_len=T))))
    window = step_metrics.Window(steps=1, seconds=seconds, loss=loss.item(), aux={}, grad_norm=0.0, route_stats=[])
    assert step_metrics._perf_metrics(run, window)["perf/mfu"] == pytest.approx(by_hand, rel=1e-9)

    # And the table row of an entry as test_dense_train_step_mfu records it.
    entry = dict(name="mfu", extra_info=dict(kind="mfu", variant="dense", capacity=1.0, seq_len=T, batch=B, device="cuda",
                                              dtype="bf16-autocast", d_model=cfg.width, analytic_flops=flops_per_step,
                                              peak_flops=peak),
                 stats=dict(min=seconds, median=seconds, mean=seconds, rounds=1))
    row = bench_table.table({"benchmarks": [entry]}).iloc[0]
    assert row.mfu == pytest.approx(by_hand, rel=1e-12)
    assert row.bar.startswith("MISSED")  # a 2-layer d = 64 model on a CPU is nowhere near an H100's peak


@pytest.mark.parametrize("d_model,seq_len", SHAPES, ids=[f"d{d}-T{T}" for d, T in SHAPES])
def test_dense_train_step_mfu(d_model, seq_len, device, run_bench, benchmark):
    if device != "cuda":
        pytest.skip("MFU is measured against a GPU's bf16 peak (CUDA only; test_mfu_arithmetic checks the sums)")
    T, B = seq_len, TOKENS_PER_STEP // seq_len
    cfg = _config(d_model, T)
    torch.manual_seed(0)
    with torch.device(device):
        model = GPT(cfg).train()
    idx, targets = _batch(cfg, B, T, device)
    step = _train_step(model, idx, targets, device)
    flops = model.flop_report(T).total * B
    flops_noncausal = model.flop_report(T, causal=False).total * B
    peak = peak_flops(torch.device(device))  # None on a GPU the table does not know: no MFU then
    before = model.head.weight.detach().clone()
    first: list[torch.Tensor] = []

    def recorded_step() -> torch.Tensor:  # the untrained model's loss is the first call's
        loss = step()
        if not first:
            first.append(loss)
        return loss

    loss = run_bench(
        recorded_step, kind="mfu", seq_len=T, device=device, budget_s=BUDGET_S,
        extra_info=dict(
            variant="dense", capacity=1.0, batch=B, depth=DEPTH, d_model=d_model, head_dim=HEAD_DIM, tokens=B * T,
            params=model.num_params(), analytic_flops=flops, analytic_flops_noncausal=flops_noncausal,
            flops_per_token=model.flops_per_token(T), peak_flops=peak, gpu=torch.cuda.get_device_name(),
            flop_convention="causal, forward + backward, head included, optimizer excluded",
            optimizer="AdamW (fused=False) + grad clip 1.0", dtype="bf16-autocast", compiled=True,
        ),
    )
    _check_step(model, first[0], before)
    assert torch.isfinite(loss)  # the last benchmark round's (repeated steps on one batch lower it)
    if not run_bench.disabled and peak:
        t = benchmark.stats.stats.min
        benchmark.extra_info.update(
            achieved_flops_per_s=flops / t, mfu=bench_table.mfu(flops, t, peak),
            mfu_noncausal=bench_table.mfu(flops_noncausal, t, peak),
        )
