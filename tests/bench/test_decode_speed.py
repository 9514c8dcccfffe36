"""Speed of KV-cached decoding (``modbench.model.decode.generate``): routed vs dense tokens/s.

The issue's point (CUDA): GPT d = 1024, depth 12 (16 heads of 64), weights in bf16, batch
1, 8 and 64; the ``sigmoid`` variant at C = 0.125 with the patterns ``alternate`` (D M D M …:
6 of 12 layers routed) and ``fixed:1,1`` (every middle layer routed: 10 of 12), each against
the dense GPT of the same shape. A prompt of ``PROMPT`` tokens is prefilled, then ``NEW``
tokens are sampled one at a time; the timed closure is one whole ``generate`` call (prefill
included), so tokens/s = B · NEW / time and a routed entry's speed-up over dense is
1 / ``paired_time_ratio`` (both generate the same number of tokens). The bar (reported by
``modbench.bench.table``, not asserted): fixed:1,1 at C = 0.125 and B = 64 reaches
≥ 1.5 × the dense tokens/s.

On CPU a tiny model (d = 64, depth 6: alternate routes 3 layers, fixed:1,1 four) and short
sequences keep the untimed CI run to a fraction of a second per entry; it checks the same
things.

Why the routers are calibrated: decoding routes each token by the variant's causal rule, for
``sigmoid`` r > 0, which its auxiliary BCE loss trains to hold exactly for top-k members
(Raposo et al. 2024 §3.5), i.e. for a fraction ≈ C of the tokens. An untrained router fires on
about half of them, which would time a C ≈ 0.5 model; so each router's bias is set to minus the
(1 − C) quantile of its scores on random tokens (``calibrate_to_capacity``), the state a trained
router ends in, and the test asserts the realised skipped fraction is ≈ 1 − C.

Why not ``torch.compile``: the decoder's shapes change every step (the cache grows, the subset
of sequences that process a token varies) and it reads the routing decisions on the host once
per routed layer and step; this times what ``modbench generate`` runs. bf16 *weights* rather
than autocast: the KV cache takes the weights' dtype, and an fp32 cache under autocast would be
cast to bf16 in full at every step.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor

from modbench.config.model import ModelConfig, RoutingConfig
from modbench.config.patterns import pattern_string
from modbench.model.decode import Generation, generate
from modbench.model.gpt import GPT, RoutedBlock
from modbench.model.sizing import decode_flops_per_token

VARIANT = "sigmoid"
CAPACITY = 0.125
PATTERNS = ("alternate", "fixed:1,1")
BATCHES = (1, 8, 64)
# The model and sequence sizes per device: (d_model, depth, head_dim), prompt and new tokens.
SHAPE = {"cpu": (64, 6, 32), "cuda": (1024, 12, 64)}
PROMPT = {"cpu": 8, "cuda": 64}
NEW = {"cpu": 24, "cuda": 128}
CALIBRATION_BATCH = 16  # random sequences of the full context that set the routers' biases
BUDGET_S = {"cpu": 2.0, "cuda": 2.0}  # seconds per entry when benchmarking (pairs included)
MIN_ROUNDS = 3  # each round is a whole generation: NEW steps averaged already


def _config(device: str) -> ModelConfig:
    d, depth, head_dim = SHAPE[device]
    return ModelConfig(depth=depth, n_embd=d, head_dim=head_dim, max_seq_len=PROMPT[device] + NEW[device])


def _routing(pattern: str | None) -> RoutingConfig:
    if pattern is None:
        return RoutingConfig("dense", capacity=1.0)
    return RoutingConfig(VARIANT, capacity=CAPACITY, pattern=pattern)


@torch.no_grad()
def calibrate_to_capacity(model: GPT, idx: Tensor, capacity: float) -> None:
    """Shift each sigmoid router's bias so that its causal rule r > 0 holds for ≈ ``capacity``
    of the tokens of ``idx`` (see the module docstring).

    Layer by layer, in causal routing mode: a layer's bias changes its output (the delta is
    weighted by sigmoid(r)), hence what every later router scores.
    """
    for layer in model.layers:
        if not isinstance(layer, RoutedBlock):
            continue
        scorer = layer.router.scorer  # sigmoid: a LinearScorer, r = w·x + b
        seen: list[Tensor] = []
        hook = scorer.register_forward_hook(lambda _m, _i, out: seen.append(out.detach().float().flatten()))
        try:
            model(idx, routing_mode="causal")
        finally:
            hook.remove()
        scorer.proj.bias -= torch.quantile(seen[0], 1.0 - capacity).to(scorer.proj.bias.dtype)


def _model(cfg: ModelConfig, pattern: str | None, device: str) -> GPT:
    """The GPT to decode, on ``device`` (bf16 weights on CUDA), routers calibrated to C."""
    torch.manual_seed(0)
    with torch.device(device):
        model = GPT(cfg, _routing(pattern))
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


def _cases():
    # Per batch: the dense model first, then the two routed patterns (as in test_block_speed).
    for B in BATCHES:
        yield pytest.param(None, B, id=f"B{B}-dense")
        for p in PATTERNS:
            yield pytest.param(p, B, id=f"B{B}-{VARIANT}-C{CAPACITY}-{p.replace(':', '').replace(',', '_')}")


def _skip_tolerance(decisions: int) -> float:
    """How far the realised skipped fraction may lie from 1 − C: 4 binomial standard errors of
    ``decisions`` routing decisions plus 0.05 for the shift between the calibration tokens
    (random) and the decoded ones (sampled from the model)."""
    return 0.05 + 4.0 * math.sqrt(CAPACITY * (1 - CAPACITY) / max(decisions, 1))


@pytest.mark.parametrize("pattern,batch", list(_cases()))
def test_decode_tokens_per_s(pattern, batch, device, run_bench, benchmark):
    cfg = _config(device)
    P, N, B = PROMPT[device], NEW[device], batch
    T = P + N
    model = _model(cfg, pattern, device)
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, cfg.vocab_size, (B, P), generator=g).to(device)
    routing = _routing(pattern)
    dense_fpt = decode_flops_per_token(cfg, _routing(None), T, 1.0)
    nominal_fpt = decode_flops_per_token(cfg, routing, T, CAPACITY if pattern else 1.0)

    def dense_reference():  # built only when benchmarking: the dense GPT of the same shape
        return _decode(_model(cfg, None, device), prompt, N)

    gen = run_bench(
        _decode(model, prompt, N), kind="decode", seq_len=T, device=device,
        budget_s=BUDGET_S[device], reference=None if pattern is None else dense_reference, min_rounds=MIN_ROUNDS,
        extra_info=dict(
            variant="dense" if pattern is None else VARIANT, capacity=1.0 if pattern is None else CAPACITY,
            pattern=pattern or "-", layers=pattern_string(model.routed_flags), batch=B, depth=cfg.layers,
            d_model=cfg.width, prompt=P, new_tokens=N, tokens=B * N,
            flop_ratio=nominal_fpt / dense_fpt, flop_ratio_nominal=nominal_fpt / dense_fpt,
            flop_convention="forward only, causal, head included, per token over the whole context",
            dtype="bf16" if device == "cuda" else "fp32", compiled=False,
            gpu=torch.cuda.get_device_name() if device == "cuda" else None,
        ),
    )

    # The correctness half: the generation one call makes, benchmarked or not.
    assert gen.tokens.shape == (B, P + N) and gen.new_tokens.shape == (B, N)
    assert torch.equal(gen.tokens[:, :P].cpu(), prompt.cpu()), "the prompt must come back unchanged"
    assert 0 <= int(gen.new_tokens.min()) and int(gen.new_tokens.max()) < cfg.vocab_size
    assert gen.seconds > 0 and math.isfinite(gen.tokens_per_s)
    routed = sum(model.routed_flags)
    if pattern is None:
        assert routed == 0 and gen.skipped_fraction == 0.0
    else:
        assert model.routed_flags == _routing(pattern).routed_layers(cfg.layers) and routed >= cfg.layers // 2
        # Every fed token (prompt and all but the last new one) meets every routed layer once.
        decisions = B * (P + N - 1) * routed
        tol = _skip_tolerance(decisions)
        assert abs(gen.skipped_fraction - (1 - CAPACITY)) <= tol, (
            f"routed layers skipped {gen.skipped_fraction:.3f} of the tokens, expected {1 - CAPACITY} ± {tol:.3f}"
        )
        realised_fpt = decode_flops_per_token(cfg, routing, T, 1 - gen.skipped_fraction)
        benchmark.extra_info.update(skipped_fraction=gen.skipped_fraction, flop_ratio=realised_fpt / dense_fpt)
        assert realised_fpt < dense_fpt
    # Logits stay finite through prefill and decoding (a short generation that keeps them).
    check = generate(model, prompt, 2, temperature=0, return_logits=True)
    assert check.logits.shape == (B, P + 1, cfg.vocab_size) and torch.isfinite(check.logits).all()
    t = benchmark.stats.stats.min if not run_bench.disabled else gen.seconds
    benchmark.extra_info["tokens_per_s"] = B * N / t
