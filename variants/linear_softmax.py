"""``linear_softmax``: linear router, block delta weighted by a softmax over the selection.

Source: seed 002 ("Mixture of Depth is Vibe"): r = w·x, top-k of r, and the processed
tokens' delta multiplied by softmax of their router logits over the k selected tokens, which
puts the router in the gradient path. The softmax normalises across the sequence, so a
token's weight depends on later tokens: the recipe is not causal (seed 002 says so and keeps
it). Decoding therefore uses seed 002's auxiliary router — a small MLP on the detached hidden
state trained with BCE against top-k membership (Raposo et al. 2024 §3.5) — as the causal
rule: process when its logit > 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .base import Router, VariantConfig, topk_membership
from .linear_router import AuxPredictor, LinearScorer
from .registry import register_variant


@dataclass(frozen=True)
class LinearSoftmaxConfig(VariantConfig):
    aux_hidden: int = 0  # hidden width of the auxiliary predictor; 0 means d_model // 2 (seed 002)
    aux_weight: float = 1.0  # its BCE loss only trains the predictor (input detached)

    def __post_init__(self) -> None:
        if self.aux_hidden < 0:
            raise ValueError(f"aux_hidden must be >= 0, got {self.aux_hidden}")
        if self.aux_weight < 0:
            raise ValueError(f"aux_weight must be >= 0, got {self.aux_weight}")


class LinearSoftmaxRouter(Router):
    scope = "block"

    def __init__(self, d_model: int, config: LinearSoftmaxConfig) -> None:
        super().__init__(config)
        self.scorer = LinearScorer(d_model)
        self.aux = AuxPredictor(d_model, config.aux_hidden or max(1, d_model // 2))

    def score(self, x: Tensor) -> Tensor:
        return self.scorer(x)

    def mix_weight(self, selected_scores: Tensor, scores: Tensor) -> Tensor:
        return torch.softmax(selected_scores, dim=-1)

    def aux_losses(self, x: Tensor, scores: Tensor, index: Tensor) -> dict[str, Tensor]:
        return {"aux_router_bce": self.aux.loss(x, topk_membership(scores, index))}

    def aux_weights(self, step: int) -> dict[str, float]:
        return {"aux_router_bce": self.config.aux_weight}

    def decide_causal(self, x: Tensor) -> Tensor:
        return self.aux(x) > 0

    def flops_per_token(self, d_model: int) -> tuple[float, float]:
        f, b = LinearScorer.flops(d_model)
        af, ab = self.aux.flops(d_model)
        return f + af, b + ab


@register_variant("linear_softmax", config=LinearSoftmaxConfig, source="seed 002 (linear router, softmax weights, aux router)")
def build_linear_softmax(d_model: int, config: LinearSoftmaxConfig) -> LinearSoftmaxRouter:
    """Linear router; delta × softmax of the selected logits (non-causal); aux MLP predictor."""
    return LinearSoftmaxRouter(d_model, config)
