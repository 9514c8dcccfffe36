"""Analytic FLOPs of a (routed) GPT.

Conventions (the same for every variant, so ratios are comparable):

- A matmul of (m × n) by (n × p) costs 2·m·n·p FLOPs (one multiply and one add per MAC).
- Per token and layer, the projections cost 2·(4d² + 2·r·d²): qkv 3d², output d², and the
  MLP's two r·d² matrices (r = mlp_ratio).
- Attention scores and the weighted sum cost 2·d per (query, key) pair each, 4·d in all.
  Causal attention over L tokens has L(L+1)/2 pairs — what a causal kernel such as flash
  attention computes — so it costs 2·d·L(L+1). ``causal=False`` counts the full L² pairs,
  which is what an unmasked matmul computes (and what ``FlopCounterMode`` sees on the math
  SDPA path); tests cross-check that convention.
- A routed layer processes k = capacity.k(T) tokens: projections at k, attention at k pairs
  ((k(k+1)/2 causal), plus its router on all T tokens (the router's own count, auxiliary
  predictors included). ``mlp_skip`` keeps attention at T and the MLP at k.
- Backward costs 2× forward for every matmul (input and weight gradients); routers report
  their own backward (a detached auxiliary predictor needs weight gradients only).
- Embedding lookups, norms, RoPE, softmax, GELU, top-k, sort, gather and scatter count as
  zero: they are memory-bound and negligible in FLOPs (not in time — see tests/bench).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from modbench.model.gpt import GPT


def projection_flops(d: int, mlp_ratio: int, tokens: int) -> tuple[float, float]:
    """(attention projections, MLP) forward FLOPs for ``tokens`` tokens."""
    return 2.0 * 4 * d * d * tokens, 2.0 * 2 * mlp_ratio * d * d * tokens


def attention_flops(d: int, length: int, causal: bool) -> float:
    """Forward FLOPs of QKᵀ and A·V over a sequence of ``length`` tokens (all heads)."""
    pairs = length * (length + 1) / 2 if causal else float(length * length)
    return 4.0 * d * pairs


@dataclass
class FlopReport:
    seq_len: int
    forward: float  # per sequence
    backward: float  # per sequence
    breakdown: dict[str, float] = field(default_factory=dict)  # forward, per sequence
    tokens_processed: list[int] = field(default_factory=list)  # per layer

    @property
    def total(self) -> float:
        return self.forward + self.backward

    @property
    def per_token(self) -> float:
        return self.total / self.seq_len


def model_flops(model: "GPT", seq_len: int, *, causal: bool = True, backward: bool = True) -> FlopReport:
    from modbench.model.gpt import RoutedBlock  # local import: model imports this module

    cfg = model.cfg
    d, T = cfg.width, seq_len
    parts = {"attn_proj": 0.0, "attn_scores": 0.0, "mlp": 0.0, "router": 0.0, "head": 0.0}
    router_bwd = 0.0
    processed: list[int] = []
    for layer in model.layers:
        if isinstance(layer, RoutedBlock):
            k = layer.capacity.k(T)
            rf, rb = layer.router.flops_per_token(d)
            parts["router"] += rf * T
            router_bwd += rb * T
            attn_tokens = T if layer.router.scope == "mlp" else k
            mlp_tokens = k
        else:
            k = attn_tokens = mlp_tokens = T
        processed.append(k)
        proj_attn, _ = projection_flops(d, cfg.mlp_ratio, attn_tokens)
        _, proj_mlp = projection_flops(d, cfg.mlp_ratio, mlp_tokens)
        parts["attn_proj"] += proj_attn
        parts["mlp"] += proj_mlp
        parts["attn_scores"] += attention_flops(d, attn_tokens, causal)
    parts["head"] = 2.0 * d * cfg.vocab_size * T
    fwd = sum(parts.values())
    bwd = 2.0 * (fwd - parts["router"]) + router_bwd if backward else 0.0
    return FlopReport(T, fwd, bwd, parts, processed)
