"""``linear_softmax``: linear router, block delta weighted by a softmax over the selection.

Source: the blog "Mixture of Depth is Vibe" (code: joey00072/ohara): r = w·x, top-k of r, and the processed
tokens' delta multiplied by softmax of their router logits over the k selected tokens, which
puts the router in the gradient path. The softmax normalises across the sequence, so a
token's weight depends on later tokens: the recipe is not causal (the blog says so and keeps
it). Decoding therefore uses the blog's auxiliary router — a small MLP on the detached hidden
state trained with BCE against top-k membership (Raposo et al. 2024 §3.5) — as the causal
rule: process when its logit > 0.

Causal weight (``causal_weight``): the softmax weight exp(r_i) / Σ_{j∈S} exp(r_j) needs the
logits of every selected token, later ones included. Its causal stand-in keeps the
numerator and replaces the normaliser by its training-time average: exp(r_i − log Ẑ), with
log Ẑ a running mean of logsumexp over the selected logits seen in training forwards, and
capped at 1 (a softmax weight never exceeds 1). Why not 1/k or the aux predictor's sigmoid:
the LM was trained on deltas scaled by ≈ 1/k *and* ranked by the token's own logit; a
constant 1/k drops the ranking, and the predictor's probability (≈ 0.5–1) is k times too
large. Log Ẑ grows with k = C·T, so it is calibrated for the training sequence length.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .base import (LinearRouter, Provenance, RunningMean, VariantConfig, check_interval, check_nonnegative,
                   topk_membership)
from .linear_router import AuxPredictor
from .registry import register_variant


@dataclass(frozen=True)
class LinearSoftmaxConfig(VariantConfig):
    aux_hidden: int = 0  # hidden width of the auxiliary predictor; 0 means d_model // 2 (as in the blog)
    aux_weight: float = 1.0  # its BCE loss only trains the predictor (input detached)
    calibration_momentum: float = 0.01  # EMA rate of the causal weight's normaliser

    def __post_init__(self) -> None:
        check_nonnegative(self, "aux_hidden", "aux_weight")
        check_interval(self, "calibration_momentum", "(0, 1]")


class LinearSoftmaxRouter(LinearRouter):
    """Linear router; delta × softmax of the selected logits (non-causal); aux MLP predictor."""

    scope = "block"

    def __init__(self, d_model: int, config: LinearSoftmaxConfig) -> None:
        super().__init__(d_model, config)
        self.aux = AuxPredictor(d_model, config.aux_hidden or max(1, d_model // 2))
        self.log_norm = RunningMean(config.calibration_momentum)  # log Ẑ of the softmax

    def mix_weight(self, selected_scores: Tensor, scores: Tensor) -> Tensor:
        return torch.softmax(selected_scores, dim=-1)

    def aux_losses(self, x: Tensor, scores: Tensor, index: Tensor) -> dict[str, Tensor]:
        return {"aux_router_bce": self.aux.loss(x, topk_membership(scores, index))}

    def aux_weights(self, step: int) -> dict[str, float]:
        return {"aux_router_bce": self.config.aux_weight}

    def observe(self, scores: Tensor, topk_values: Tensor) -> None:
        self.log_norm.update(torch.logsumexp(topk_values.detach().float(), dim=-1))

    def decide_causal(self, x: Tensor) -> Tensor:
        return self.aux(x) > 0

    def causal_weight(self, x: Tensor, decide: Tensor) -> Tensor:
        return torch.exp(self.score(x).float() - self.log_norm.value).clamp(max=1.0)

    def flops_per_token(self, d_model: int) -> tuple[float, float]:
        f, b = super().flops_per_token(d_model)
        af, ab = self.aux.flops(d_model)
        return f + af, b + ab


register_variant("linear_softmax", LinearSoftmaxRouter, config=LinearSoftmaxConfig, source="'Mixture of Depth is Vibe' blog (joey00072/ohara): linear router, softmax weights, aux router",
                 # The blog's code trains the aux router but leaves inference a TODO: deciding by its logit > 0
                 # and the causal stand-in for the softmax weight are ours.
                 provenance=Provenance("paper", "paper", "paper's recipe",
                                       (("joey00072/ohara experiments/mixture_of_depth", "released code"),)))
