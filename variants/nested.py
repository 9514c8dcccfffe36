"""``nested``: hierarchical filtering without weight sharing, over a stack of distinct layers.

What it borrows: the hierarchical filtering of Mixture-of-Recursions' expert-choice routing (Bae et
al. 2025, arXiv:2507.10524 §2.2): each routed layer keeps its top-k only among the tokens the
previous routed layer kept, so the active set shrinks monotonically with depth, and the output is
weighted by α·sigmoid(r). What it is not: MoR itself. MoR applies one *shared* block N_R times and
routes per recursion step; here the "steps" are the routed layers of an ordinary stack, each with
its own weights (no sharing), its aux BCE runs over all tokens (MoR's over the step's candidates),
and it has no router z-loss and no router temperature. MoR's router on a recursive model is the
``mor`` variant (``ModelConfig.recursion``); ``nested`` is the control that isolates the filtering.
With one capacity for every layer the nesting selects the previous layer's set again; give the
layers a decaying capacity (``capacity_first`` in the routing config, e.g. 0.5 → 0.125) so each
layer keeps fewer.

Causal rule: r > 0 (trained by an auxiliary BCE towards the layer's own top-k membership, as
``sigmoid``) *and* processed by the previous routed layer — nested at decode time as well.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .base import LinearRouter, PositiveScoreRule, Provenance, Routing, VariantConfig, check_interval, check_nonnegative
from .registry import register_variant


@dataclass(frozen=True)
class NestedConfig(VariantConfig):
    alpha: float = 1.0  # output weight α·sigmoid(r)
    aux_weight: float = 0.01  # BCE of r against the layer's top-k membership (the causal rule r > 0)

    def __post_init__(self) -> None:
        check_interval(self, "alpha", "(0, 10]")
        check_nonnegative(self, "aux_weight")


class NestedRouter(PositiveScoreRule, LinearRouter):
    """Top-k only among the tokens the previous routed layer processed; delta × α·sigmoid(r).

    Causal rule: r > 0 (``PositiveScoreRule``, its aux BCE on the unmasked r) and processed by the
    previous routed layer."""

    scope = "block"

    def score(self, x: Tensor) -> Tensor:
        """r = w·x + b; inside ``route`` with a previous layer, tokens it skipped get r − 10⁴."""
        scores = self.scorer(x)
        if self._previous is not None:
            scores = torch.where(self._previous, scores, scores - 1e4)
        return scores

    def route(self, x: Tensor, k: int, previous: Tensor | None = None) -> Routing:
        if previous is None:
            return super().route(x, k)
        # Tokens the previous routed layer skipped cannot be chosen: their score drops below every
        # other (k never exceeds the previous layer's count when capacities decay; if it does, the
        # extra slots go to the best of the skipped tokens rather than failing).
        self._previous = previous
        try:
            return super().route(x, k, previous)
        finally:
            self._previous = None

    _previous: Tensor | None = None  # set only while ``route`` runs

    def mix_weight(self, selected_scores: Tensor, scores: Tensor) -> Tensor:
        return self.config.alpha * torch.sigmoid(self._raw(selected_scores))

    def causal_weight(self, x: Tensor, decide: Tensor) -> Tensor:
        return self.config.alpha * torch.sigmoid(self.scorer(x))

    @staticmethod
    def _raw(scores: Tensor) -> Tensor:
        # undo the −1e4 of skipped tokens (selected only when k exceeds the previous count)
        return torch.where(scores < -5e3, scores + 1e4, scores)

    def aux_losses(self, x: Tensor, scores: Tensor, index: Tensor) -> dict[str, Tensor]:
        return super().aux_losses(x, self._raw(scores), index)

    def decide_causal_given(self, x: Tensor, previous: Tensor | None) -> Tensor:
        decide = self.decide_causal(x)
        return decide if previous is None else decide & previous


register_variant("nested", NestedRouter, config=NestedConfig,
                 source="Mixture-of-Recursions, Bae et al. 2025 (arXiv:2507.10524) §2.2, expert-choice routing",
                 # MoR nests over recursion steps of one shared block; here over the routed layers of a stack. Its
                 # code's "aux_loss" sampling is BCE on r with the decision sigmoid(r) >= 0.5, i.e. r >= 0.
                 provenance=Provenance("paper's recipe", "paper", "paper's recipe",
                                       (("Mixture-of-Recursions §2.2", "secondary"),
                                        ("raymin0223/mixture_of_recursions expert_choice_router.py", "released code"))))
