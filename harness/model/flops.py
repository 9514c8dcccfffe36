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
  predictors included). ``mlp_skip`` keeps attention at T and the MLP at k; a scope "attention"
  router (``dtrnet``) runs attention at k and the MLP at T. A variable-count
  router (``token_choice``, ``threshold``) runs k_max = min(T, ⌈slack·k⌉) slots in the batched
  forward, and those are what is counted; decoding runs exactly the tokens its rule processes, so
  its decode cost at a realised share is a fixed-count router's at that share
  (``modbench.model.sizing.decode_flops_per_token``).
- A token-local update (``Mixing(skip="local")``, DTRNet's bypass: a token's attention with itself
  alone, W_O·W_V·norm(x)) costs the value and output projections, 2·2d² per token it runs on,
  counted in ``attn_proj``: every token in the batched forward (static shapes: it is computed for all
  and kept for the skipped), the T − k skipped ones at decode time.
- A layer whose attention the next router reads (``amod``) materialises its full L × L score
  matrix once more for that router: 2·d·L² FLOPs, counted in its ``router`` part, no backward
  (the scores are detached).
- Recursive KV sharing (``ModelConfig.kv_sharing``, Mixture-of-Recursions arXiv:2507.10524 §2.3): a
  later step of the shared block projects q and the output only, 2·2d² per token (its K/V are step
  0's), and its n queries attend to step 0's L keys: n·L pairs (``causal=False``), n·(L+1)/2 causal —
  exact when the queries are the keys (a dense step), the mean over queries placed like the keys
  otherwise (a query sees the keys up to its position).
- Backward costs 2× forward for every matmul (input and weight gradients); routers report
  their own backward (a detached auxiliary predictor needs weight gradients only).
- Embedding lookups, norms, RoPE, softmax, GELU, top-k, sort, gather and scatter count as
  zero: they are memory-bound and negligible in FLOPs (not in time — see tests/bench).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field


def projection_flops(d: int, mlp_ratio: int, tokens: int, *, kv: bool = True) -> tuple[float, float]:
    """(attention projections, MLP) forward FLOPs for ``tokens`` tokens; ``kv=False``: q and the output
    projection only (a step that reads shared keys and values)."""
    return 2.0 * (4 if kv else 2) * d * d * tokens, 2.0 * 2 * mlp_ratio * d * d * tokens


def attention_flops(d: int, length: int, causal: bool, keys: int | None = None) -> float:
    """Forward FLOPs of QKᵀ and A·V for ``length`` queries over their own keys (all heads), or over
    ``keys`` shared keys of another step (see the module doc)."""
    if keys is None:
        pairs = length * (length + 1) / 2 if causal else float(length * length)
    else:
        pairs = length * (keys + 1) / 2 if causal else float(length * keys)
    return 4.0 * d * pairs


@dataclass(frozen=True)
class LayerFlops:
    """One layer's analytic FLOPs over one sequence: forward by part, and backward."""

    parts: dict[str, float]  # forward, by part: attn_proj, attn_scores, mlp, router, head
    backward: float
    tokens_processed: int

    @property
    def forward(self) -> float:
        return sum(self.parts.values())

    @property
    def total(self) -> float:
        return self.forward + self.backward


def block_flops(d: int, mlp_ratio: int, *, attn_tokens: int, mlp_tokens: int, causal: bool,
                router: tuple[float, float] = (0.0, 0.0), seq_len: int | None = None,
                mlp_gate: tuple[float, float] = (0.0, 0.0), attention_summary: bool = False,
                shared_keys: int | None = None, local_tokens: int = 0) -> LayerFlops:
    """A pre-norm block whose attention sees ``attn_tokens`` and whose MLP sees ``mlp_tokens``.

    ``router`` is the (forward, backward) FLOPs per token of a router that scores all
    ``seq_len`` tokens; ``mlp_gate`` those of a mixture-of-experts gate on each MLP token (a
    top-1 mixture runs one expert per token: one MLP's FLOPs). ``attention_summary``: the next
    router reads this block's attention, which costs its L × L scores again (forward only).
    ``shared_keys``: recursive KV sharing's later step, its attention over that many keys of step 0 and
    no K/V projection. ``local_tokens``: tokens that get the token-local update W_O·W_V·norm(x) (2·2d² each).
    Backward is 2× forward for the matmuls plus the router's and the gate's own backward.
    """
    proj_attn, _ = projection_flops(d, mlp_ratio, attn_tokens, kv=shared_keys is None)
    proj_attn += 2.0 * 2 * d * d * local_tokens
    _, proj_mlp = projection_flops(d, mlp_ratio, mlp_tokens)
    T = seq_len if seq_len is not None else attn_tokens
    parts = {"attn_proj": proj_attn, "attn_scores": attention_flops(d, attn_tokens, causal, shared_keys),
             "mlp": proj_mlp + mlp_gate[0] * mlp_tokens, "router": router[0] * T}
    if attention_summary:
        parts["router"] += 2.0 * d * attn_tokens * attn_tokens
    matmuls = parts["attn_proj"] + parts["attn_scores"] + proj_mlp
    return LayerFlops(parts, 2.0 * matmuls + router[1] * T + mlp_gate[1] * mlp_tokens, min(attn_tokens, mlp_tokens))


def head_flops(d: int, vocab_size: int, seq_len: int) -> LayerFlops:
    """The output projection to the vocabulary."""
    fwd = 2.0 * d * vocab_size * seq_len
    return LayerFlops({"head": fwd}, 2.0 * fwd, seq_len)


@dataclass
class FlopReport:
    seq_len: int
    forward: float  # per sequence
    backward: float  # per sequence
    breakdown: dict[str, float] = field(default_factory=dict)  # forward, per sequence
    tokens_processed: list[int] = field(default_factory=list)  # per transformer layer

    @property
    def total(self) -> float:
        return self.forward + self.backward

    @property
    def per_token(self) -> float:
        return self.total / self.seq_len

    @classmethod
    def from_layers(cls, seq_len: int, layers: Iterable[LayerFlops], head: LayerFlops, *,
                    backward: bool = True) -> "FlopReport":
        """The sum over the transformer layers and the head (what ``GPT.flop_report`` returns)."""
        layers = list(layers)
        parts = {"attn_proj": 0.0, "attn_scores": 0.0, "mlp": 0.0, "router": 0.0, "head": 0.0}
        for layer in [*layers, head]:
            for name, value in layer.parts.items():
                parts[name] += value
        bwd = sum(layer.backward for layer in [*layers, head]) if backward else 0.0
        return cls(seq_len, sum(parts.values()), bwd, parts, [layer.tokens_processed for layer in layers])
