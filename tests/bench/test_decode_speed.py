"""Speed of KV-cached decoding (``modbench.model.decode.generate``): every variant's tokens/s vs dense.

Entries: every registered routed variant at C = 0.125 with the pattern ``fixed:1,1`` (every
middle layer routed), ``sigmoid`` also with ``alternate`` (D M D M …), and the dense GPT of the
same shape, each at batch 1, 8 and 64. A prompt of ``PROMPT`` tokens is prefilled, then ``NEW``
tokens are sampled one at a time. What a round counts is the *decode steps* alone
(``Generation.seconds − prefill_seconds``: B·(NEW − 1) tokens, each from one KV-cached step):
that is what MoD's decode-time saving is about, and what the FLOP ratio and the roofline limit
describe. The routed prefill runs every prompt token through every layer in one masked pass
(``Decoder._routed``) and saves nothing; pytest-benchmark's statistics keep the wall time of the
whole call, so the table also shows end-to-end tokens/s. Every round of a routed entry is its
dense reference's call and then its own, adjacent (tests/bench/conftest.py, ``run_bench``), and
the table reports the median of the per-round time ratios.

Shapes. Benchmarking on CPU: d = 512, depth 8 (8 heads of 64), prompt 32 + 32 new tokens, fp32,
2 threads (``MODBENCH_BENCH_THREADS``, tests/bench/conftest.py) — a width where compute matters. On CUDA: d = 1024, depth 12, bf16 weights, prompt 64 +
128. The untimed CI run (``--benchmark-disable``) uses a tiny CPU model (d = 64, depth 6, prompt
8 + 24) and checks the same things in a fraction of a second per entry.

Why the routers are calibrated: decoding routes each token by the variant's causal rule, which a
trained router's auxiliary loss or threshold calibration makes hold for a fraction ≈ C of the
tokens (Raposo et al. 2024 §3.5); an untrained router would time some other capacity. So the
routers are first calibrated as training ends (``calibrate_causal_rules``), then each routed
layer, in order, gets its rule's cut moved so that it processes C of the tokens of random
sequences (``calibrate_to_capacity``, ``modbench.bench.decode_calibration``), and the test asserts the realised share is ≈ C.

The roofline column (``modbench.bench.decode_roofline``): per step and layer time = max(FLOPs /
peak, bytes / bandwidth), a routed layer reading its weights only when some sequence of the batch
processes the token, peak and bandwidth measured on the machine once per session.

Which decoder: what ``generate`` runs by default (``step="auto"``): on the CPU the dynamic decoder
(its shapes change every step: the cache grows, the subset of sequences that process a token
varies, and it skips their work), on CUDA the static step replayed from a CUDA graph
(``modbench.model.static_decode``; the capture is excluded from the time, ``Generation.setup_seconds``),
recorded as ``extra_info["step"]``. ``modbench.bench.gpu_decode`` times every decoder side by side.
bf16 *weights* on CUDA rather than autocast: the KV cache takes the weights' dtype.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor

from modbench import variants
from modbench.bench import decode_roofline
from modbench.bench.decode_calibration import move_cuts_to_capacity
from modbench.config.model import ModelConfig, RoutingConfig
from modbench.config.patterns import pattern_string
from modbench.model.decode import Generation, generate
from modbench.model.gpt import GPT
from modbench.model.sizing import decode_flops_per_token
from modbench.run.causal_eval import calibrate_causal_rules

CAPACITY = 0.125
BATCHES = (1, 8, 64)
ROUTED = [v for v in variants.list_variants() if variants.get_variant(v).scope != "none"]
# Routed variants this table cannot time faithfully, each with the reason (the suite still checks that
# every other registered variant has its entries).
NOT_TIMED = {
    "mor": "Mixture-of-Recursions routes the steps of a recursive model (model.recursion) at per-step capacities "
           "(routing.capacities); in a vanilla fixed:1,1 model at one constant C its hierarchical filtering makes "
           "every later layer take all of the first layer's tokens (measured: the same share in all 6 routed "
           "layers), so the entry would time one router, not MoR",
    "mor_token_choice": "MoR's token-choice router chooses each token's depth once, by an argmax over the steps at the "
                        "first routed layer; the per-step shares follow from that choice, and there is no cut per layer "
                        "for the suite's calibration to move to C, so the entry could not be timed at C",
}
ENTRIES = [(v, "fixed:1,1") for v in ROUTED if v not in NOT_TIMED] + [("sigmoid", "alternate")]
# Per device (and "cpu-ci": the untimed CI run): (d_model, depth, head_dim), prompt and new tokens.
SHAPE = {"cpu": (512, 8, 64), "cpu-ci": (64, 6, 32), "cuda": (1024, 12, 64)}
PROMPT = {"cpu": 32, "cpu-ci": 8, "cuda": 64}
NEW = {"cpu": 32, "cpu-ci": 24, "cuda": 128}
CALIBRATION_BATCH = 8  # random sequences of the full context that set the routers' cuts
BUDGET_S = {"cpu": 1.0, "cuda": 2.0}  # seconds per entry when benchmarking (pairs included)
MIN_ROUNDS = 3  # each round is a whole generation: NEW steps averaged already


def _size(device: str, benchmarking: bool) -> str:
    return device if device == "cuda" or benchmarking else "cpu-ci"


def _config(size: str) -> ModelConfig:
    d, depth, head_dim = SHAPE[size]
    return ModelConfig(depth=depth, n_embd=d, head_dim=head_dim, max_seq_len=PROMPT[size] + NEW[size])


def _routing(variant: str, pattern: str | None) -> RoutingConfig:
    if variant == "dense":
        return RoutingConfig("dense", capacity=1.0)
    return RoutingConfig(variant, capacity=CAPACITY, pattern=pattern)


# --- calibration to C -------------------------------------------------------------------------
@torch.no_grad()
def calibrate_to_capacity(model: GPT, idx: Tensor, capacity: float, steps: int = 40) -> None:
    """Calibrate the causal rules as training ends (``calibrate_causal_rules``), then move each
    routed layer's cut, layer by layer in order, so that it processes ``capacity`` of the tokens of
    ``idx`` in causal mode (``modbench.bench.decode_calibration``)."""
    calibrate_causal_rules(model, [idx])
    move_cuts_to_capacity(model, idx, capacity, steps)


# --- the benchmark -------------------------------------------------------------------------------
def _model(cfg: ModelConfig, variant: str, pattern: str | None, device: str) -> GPT:
    """The GPT to decode, on ``device`` (bf16 weights on CUDA), routers calibrated to C."""
    torch.manual_seed(0)
    with torch.device(device):
        model = GPT(cfg, _routing(variant, pattern))
    if device == "cuda":
        model = model.to(torch.bfloat16)
    model.eval()
    if model.routers:
        g = torch.Generator().manual_seed(2)
        idx = torch.randint(0, cfg.vocab_size, (CALIBRATION_BATCH, cfg.max_seq_len), generator=g).to(device)
        calibrate_to_capacity(model, idx, CAPACITY)
    return model


def _decode(model: GPT, prompt: Tensor, new_tokens: int):
    """The timed closure: one whole KV-cached generation (prefill + ``new_tokens`` steps)."""

    def run() -> Generation:
        return generate(model, prompt, new_tokens, mode="causal", temperature=1.0, seed=3)

    return run


def _decode_seconds(gen: Generation) -> float:
    """What a round counts: the decode steps alone."""
    return gen.seconds - gen.prefill_seconds


@pytest.fixture(scope="session")
def machine() -> decode_roofline.Machine:
    """Peak FLOP/s and bandwidth of this machine at the benchmark's thread count (measured once,
    first asked for inside a test, after conftest's autouse fixture has set the threads)."""
    return decode_roofline.measure_machine()


def _cases():
    for B in BATCHES:
        yield pytest.param("dense", None, B, id=f"B{B}-dense")
        for v, p in ENTRIES:
            yield pytest.param(v, p, B, id=f"B{B}-{v}-C{CAPACITY}-{p.replace(':', '').replace(',', '_')}")


def _skip_tolerance(decisions: int) -> float:
    """How far the realised skipped fraction may lie from 1 − C: 4 binomial standard errors of
    ``decisions`` routing decisions plus 0.05 for the shift between the calibration tokens
    (random) and the decoded ones (sampled from the model)."""
    return 0.05 + 4.0 * math.sqrt(CAPACITY * (1 - CAPACITY) / max(decisions, 1))


def test_every_routed_variant_has_a_decode_entry():
    assert {v for v, _ in ENTRIES} | set(NOT_TIMED) == set(ROUTED) and len(ROUTED) >= 10
    assert not set(NOT_TIMED) & {v for v, _ in ENTRIES} and all(len(why) > 40 for why in NOT_TIMED.values())
    assert {"token_choice", "threshold", "mode_staged", "mode_integrated"} <= set(ROUTED)


@pytest.mark.parametrize("variant,pattern,batch", list(_cases()))
def test_decode_tokens_per_s(variant, pattern, batch, device, run_bench, benchmark, request):
    size = _size(device, not run_bench.disabled)
    if size == "cuda" and variant != "sigmoid" and variant != "dense":
        pytest.skip("on CUDA the suite times sigmoid's two patterns (make gpu-bench); every variant on CPU")
    cfg = _config(size)
    P, N, B = PROMPT[size], NEW[size], batch
    T = P + N
    model = _model(cfg, variant, pattern, device)
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, cfg.vocab_size, (B, P), generator=g).to(device)
    routing = _routing(variant, pattern)
    dense_fpt = decode_flops_per_token(cfg, _routing("dense", None), T, 1.0)
    routed = variant != "dense"

    def dense_reference():  # built only when benchmarking: the dense GPT of the same shape
        return _decode(_model(cfg, "dense", None, device), prompt, N)

    gen = run_bench(
        _decode(model, prompt, N), kind="decode", seq_len=T, device=device,
        budget_s=BUDGET_S[device], reference=dense_reference if routed else None, min_rounds=MIN_ROUNDS,
        seconds_of=_decode_seconds,
        extra_info=dict(
            variant=variant, capacity=CAPACITY if routed else 1.0, pattern=pattern or "-",
            layers=pattern_string(model.routed_flags), batch=B, depth=cfg.layers, d_model=cfg.width,
            prompt=P, new_tokens=N, tokens=B * N, decode_tokens=B * (N - 1),
            time_counted="decode steps only (prefill excluded)",
            flop_ratio_nominal=decode_flops_per_token(cfg, routing, T, CAPACITY if routed else 1.0) / dense_fpt,
            flop_convention="forward only, causal, head included, per token over the whole context",
            dtype="bf16" if device == "cuda" else "fp32", compiled=False,
            gpu=torch.cuda.get_device_name() if device == "cuda" else None,
        ),
    )

    # The correctness half: the generation one call makes, benchmarked or not.
    assert gen.tokens.shape == (B, P + N) and gen.new_tokens.shape == (B, N)
    assert torch.equal(gen.tokens[:, :P].cpu(), prompt.cpu()), "the prompt must come back unchanged"
    assert 0 <= int(gen.new_tokens.min()) and int(gen.new_tokens.max()) < cfg.vocab_size
    assert 0 < gen.prefill_seconds < gen.seconds and math.isfinite(gen.decode_tokens_per_s)
    n_routed = sum(model.routed_flags)
    if not routed:
        assert n_routed == 0 and gen.skipped_fraction == 0.0 and gen.processed_shares == []
        share = 1.0
    else:
        assert model.routed_flags == routing.routed_layers(cfg.layers) and n_routed >= cfg.layers // 2
        assert len(gen.processed_shares) == n_routed
        # Every fed token (prompt and all but the last new one) meets every routed layer once.
        decisions = B * (P + N - 1) * n_routed
        tol = _skip_tolerance(decisions)
        assert abs(gen.skipped_fraction - (1 - CAPACITY)) <= tol, (
            f"routed layers skipped {gen.skipped_fraction:.3f} of the tokens, expected {1 - CAPACITY} ± {tol:.3f}"
        )
        share = 1 - gen.skipped_fraction
        assert decode_flops_per_token(cfg, routing, T, share) < dense_fpt
    assert gen.step == ("graph" if device == "cuda" else "dynamic")
    benchmark.extra_info.update(
        step=gen.step, skipped_fraction=gen.skipped_fraction, realised_share=share, layer_shares=gen.processed_shares,
        flop_ratio=decode_flops_per_token(cfg, routing, T, share) / dense_fpt,
    )
    # Logits stay finite through prefill and decoding (a short generation that keeps them).
    check = generate(model, prompt, 2, temperature=0, return_logits=True)
    assert check.logits.shape == (B, P + 1, cfg.vocab_size) and torch.isfinite(check.logits).all()
    if not run_bench.disabled and device == "cpu":  # (the roofline's machine is measured on the CPU)
        _record_roofline(benchmark, request.getfixturevalue("machine"), model, gen, P + N / 2, device)


def _record_roofline(benchmark, machine, model: GPT, gen: Generation, context: float,
                     device: str) -> None:
    """The attainable speed-up at this batch (``decode_roofline``) and the machine it assumes."""
    B = gen.tokens.shape[0]
    width = 2 if device == "cuda" else 4
    dense_costs, routed_costs = decode_roofline.dense_and_routed_costs(model, context, gen.processed_shares,
                                                                       bytes_per_value=width)
    benchmark.extra_info.update(
        roofline_speedup=decode_roofline.speedup_limit(dense_costs, routed_costs, B, machine),
        roofline_dense_step_s=decode_roofline.step_time(dense_costs, B, machine),
        roofline_step_s=decode_roofline.step_time(routed_costs, B, machine),
        peak_flops=machine.peak_flops, bandwidth=machine.bandwidth, roofline_context=context,
    )
