"""``amod``: parameter-free routing by the attention a token receives in the previous layer.

Source: A-MoD, Gadhikar et al. 2024, "Attention Is All You Need For Mixture-of-Depths Routing"
(arXiv:2412.20875; checked: the abstract and §1 of v1): the router of layer ℓ is the existing
attention map of layer ℓ−1 — a token's score is the attention it receives there — with no
trainable parameters, top-k as in MoD. The paper routes bidirectional ViTs; the exact formula of
its method section (head averaging, whether the block's output is scaled) could not be checked
here, so what follows is this benchmark's causal-decoder definition, stated in full.

Training (top-k, non-causal like every expert-choice variant). With aₕ the softmax attention map
of layer ℓ−1 (detached), averaged over heads, a = (1/H) Σₕ aₕ, and nᵢ the number of keys query i
sees (i + 1 in a causal layer), the score of token j is

    received(j) = Σ_{i ⪰ j} nᵢ · a_{i,j} / #{i : i sees j},

the attention j receives averaged over the queries that see it, each row scaled by nᵢ so that
uniform attention scores every token 1 (without the scaling the causal mask would favour early
tokens, whose column sums run over more queries). When layer ℓ−1 is itself routed, its attention
ran among the tokens it processed (at their own positions); the others received nothing and score
0, so the selection nests in ℓ−1's (with one capacity for consecutive routed layers it picks the
same set again: route alternate layers, as the paper's D M D M, or decay the capacity). A layer
with no previous layer (layer 0, e.g. pattern "all") falls back to the parameter-free ‖x‖₂
(exactly ``norm``).

Decode time (causal rule). When token t arrives only query t has seen it, so its causal score is
the one term of received(t) available then, nₜ · a_{t,t} (its own attention weight in layer ℓ−1
relative to uniform; nₜ counts the tokens ℓ−1 processed up to t, and a token ℓ−1 skipped scores
0). The rule is that score ≥ a threshold calibrated in training forwards on the per-sequence k-th
largest causal score (``QuantileThreshold``), so the realised share is about C. It uses only
layer ℓ−1's attention row of token t (keys ≤ t): no leak, and the KV-cached decoder computes the
same number from its cache.

Mixing: unweighted (x + delta). The score is detached and the router has no parameters, so a
weight would carry no learning signal (the reason MoD scales by r) and would rescale the delta by
an unbounded attention ratio.

Cost: layer ℓ−1 materialises its L × L attention scores once more (2·d·L² FLOPs per sequence,
forward only), counted in that layer's ``router`` FLOPs; the paper reuses the kernel's map, which
a fused attention kernel does not return.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .base import Mixing, Provenance, QuantileThreshold, Router, Routing
from .norm import NormConfig
from .registry import register_variant


@dataclass(frozen=True)
class AmodConfig(NormConfig):
    """The same one option as ``norm`` (the causal threshold's EMA rate; norm is also the fallback)."""


def _summary(previous: object):
    """The previous layer's ``AttentionSummary``, or None (no previous layer: the ‖x‖ fallback)."""
    return previous if hasattr(previous, "self_weight") else None


class AmodRouter(Router):
    scope = "block"
    mixing = Mixing(weight="none")  # x + Δ
    reads_attention = True

    def __init__(self, config: AmodConfig) -> None:
        super().__init__(config)
        self.threshold = QuantileThreshold(config.calibration_momentum)

    _source = None  # the previous layer's AttentionSummary, set only while ``route`` runs

    def score(self, x: Tensor) -> Tensor:
        """received(j) of the previous layer inside ``route``; ‖x‖₂ without a previous layer."""
        if self._source is not None:
            return self._source.received
        return torch.linalg.vector_norm(x, dim=-1)

    def route(self, x: Tensor, k: int, previous: object = None) -> Routing:
        self._source = _summary(previous)
        try:
            return super().route(x, k, previous)
        finally:
            self._source = None

    def observe(self, scores: Tensor, topk_values: Tensor) -> None:
        causal = scores if self._source is None else self._source.self_weight
        k = topk_values.shape[-1]
        self.threshold.update(torch.topk(causal, k, dim=-1, sorted=False).values.amin(-1))

    def decide_causal(self, x: Tensor) -> Tensor:
        return self.threshold(torch.linalg.vector_norm(x, dim=-1))

    def decide_causal_given(self, x: Tensor, previous: object) -> Tensor:
        source = _summary(previous)
        return self.decide_causal(x) if source is None else self.threshold(source.self_weight)

    def flops_per_token(self, d_model: int) -> tuple[float, float]:
        # With a previous layer the score is that layer's attention, counted there (2·d·L² per
        # sequence); without one, the norm: square and sum.
        return (0.0, 0.0) if self.attention_source else (2.0 * d_model, 0.0)


@register_variant("amod", config=AmodConfig,
                  source="A-MoD, Gadhikar et al. 2024 (arXiv:2412.20875), attention routing (abstract, §1); causal version here",
                  # Only the abstract was read: the score's exact formula, the (absent) weighting and the causal
                  # rule are this benchmark's definitions for a causal decoder.
                  provenance=Provenance("paper's recipe", "modbench's own", "modbench's own",
                                        (("A-MoD abstract", "paper's text"), ("A-MoD method section", "secondary"))))
def build_amod(d_model: int, config: AmodConfig) -> AmodRouter:
    """Parameter-free: score = attention received in the previous layer (causal rule: own weight), unweighted."""
    return AmodRouter(config)
