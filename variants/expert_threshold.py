"""``expert_threshold``: Expert-Threshold routing (arXiv:2603.11535) as a Mixture-of-Depths router.

Expert-Threshold (ET) routing gives each expert of a mixture of experts a threshold, an exponential
moving average estimated from the global token distribution; in training *and* at inference a
token goes to an expert iff its score exceeds that threshold, so the rule is causal by
construction, needs no auxiliary loss, and balances the load (the paper's abstract). Here the one
"expert" is the routed block:

- score r = w·x + b (the linear router of Raposo et al. 2024, eq. 1);
- threshold θ: an EMA over training steps of the capacity quantile of r, the k-th largest score
  of the step's batch with k = max(1, ⌊C·B·T⌋) (B·T: all the step's tokens, so the estimate is of
  the global token distribution, not per sequence); the EMA's rate is 1/n for the n-th step, then
  ``momentum`` (unbiased from the start, as ``RunningMean``);
- a token is processed iff r ≥ θ, in training (the batched forward) and in decoding alike: the
  decision reads the token's own score and a buffer, so nothing leaks from later tokens and the
  causal routing mode *is* the training rule (up to the k_max slot cap below);
- output x + sigmoid(r − θ)·delta: the router's LM gradient runs through the processed tokens'
  weights (a token just above the threshold gets half its delta, a confident one nearly all);
- no auxiliary loss: θ follows the scores, so the share cannot collapse the way ``threshold``'s did.

θ is state the training forward reads: it moves once per step, through the per-step hook
(``Router.set_step`` ← ``GPT.set_step``), from the step's quantiles averaged over micro-batches and
data-parallel ranks (``StepMean``), and the final calibration (``calibrate_causal_rules``) does not
reset it (it is not a ``RunningMean``: resetting it would change the top-k model itself). Every
forward of a step reads the θ of the steps before; θ starts at 0 (the rule r ≥ 0, token choice)
until the first step's estimate.

Execution and FLOPs as ``token_choice``/``threshold`` (``VariableCountRouter``): k_max =
min(T, ⌈slack·k⌉) slots per sequence, the highest logits among them processed when above the
threshold, the overflow beyond k_max dropped (and logged); training FLOPs count the slots,
decode FLOPs the realised share.

Option ``controller`` (``BudgetController``, LongCat-Flash's budget control): the EMA lags scores
that drift; the controller adds a bias b to r − θ, b += controller_gain · σ · (C − share) after each
step, as for ``token_choice`` and ``threshold`` (without their warm start: θ's first update is one).
Linearised, the EMA (rate m) and the controller (loop gain g = controller_gain · σ · the density of
the scores at θ) have poles of product (1 − m)(1 − g): stable where the logit variants' loop is.
Off by default: the EMA alone holds the share (the point of the method).

Checked against the paper's text (arXiv:2603.11535 §3, read from the PDF its authors ship in
MasterGodzilla/Expert-Threshold-Routing @534360c, ``paper/2603.11535v1.pdf``): eq. 6 routes iff r > c
in training and inference; Algorithm 1 moves c ← βc + (1 − β)·(the batch's k-th largest logit),
k = N/E, once per training batch. modbench's own here: one threshold per routed layer (MoD's one
expert) rather than per expert, the quantile over the step's B·T tokens averaged over its
micro-batches, the EMA's rate (1/n, then ``momentum`` 0.3, where the paper's β = 0.999 is a rate of
0.001), r ≥ θ for r > c, the sigmoid(r − θ) weighting (the paper gates with sigmoid(r), §4.1), θ = 0
before the first estimate, and the slots. The paper also trains by expert choice for its first 4,000
steps (§3 "Warmup") and its code bias-corrects the EMA: that recipe is ``expert_threshold_released``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from .base import Provenance, StepMean, VariantConfig, check_interval
from .registry import register_variant
from .token_choice import VariableCountRouter, check_controller


@dataclass(frozen=True)
class ExpertThresholdConfig(VariantConfig):
    # The EMA's rate once 1/n falls below it (a window of ~3 steps). At 0.05 it lagged the drifting scores
    # of a 145-step CPU run: shares of 0.01-0.05 at C = 0.125 until step ~120 (0.3: within [C/2, 2C] from ~step 40).
    momentum: float = 0.3
    slack: float = 2.0  # k_max = min(T, ⌈slack · k⌉) slots per sequence, k = max(1, ⌊C·T⌋)
    # Budget controller (base.BudgetController): a bias on r − θ, b += controller_gain · σ · (C − share) per step.
    controller: bool = False
    controller_gain: float = 4.0

    def __post_init__(self) -> None:
        check_interval(self, "momentum", "(0, 1]")
        check_interval(self, "slack", "[1, 64]")
        check_controller(self.controller_gain)


class ExpertThreshold(nn.Module):
    """θ: the EMA over training steps of the step's capacity quantile of the scores."""

    rank_equal = True  # updated once per step from the rank-averaged quantiles

    def __init__(self, momentum: float) -> None:
        super().__init__()
        self.momentum = momentum
        self.register_buffer("value", torch.zeros(()))
        self.register_buffer("steps", torch.zeros(()))  # updates so far
        self.quantile = StepMean()  # the capacity quantile of each training forward's scores

    @torch.no_grad()
    def observe(self, scores: Tensor, capacity: float) -> None:
        """The k-th largest of the forward's B·T scores, k = max(1, ⌊C·B·T⌋) (a static k: no host sync)."""
        flat = scores.detach().float().flatten()
        k = min(flat.numel(), max(1, math.floor(capacity * flat.numel() + 1e-6)))
        self.quantile.add(torch.topk(flat, k, sorted=False).values.amin())

    @torch.no_grad()
    def step(self) -> None:
        q, seen = self.quantile.take()
        steps = self.steps + seen.to(self.steps.dtype)
        rate = torch.clamp(1.0 / steps.clamp_min(1), min=self.momentum)
        self.value.copy_(torch.where(seen, torch.lerp(self.value, q, rate), self.value))
        self.steps.copy_(steps)


class ExpertThresholdRouter(VariableCountRouter):
    """Process iff r >= θ (EMA of the capacity quantile of r), train and decode alike; delta × sigmoid(r − θ)."""

    def __init__(self, d_model: int, config: ExpertThresholdConfig) -> None:
        super().__init__(d_model, config)
        self.theta = ExpertThreshold(config.momentum)

    def decision_logit(self, scores: Tensor) -> Tensor:
        # r − θ (+ the controller's bias): sigmoid(r − θ) >= 0.5 is r >= θ.
        return super().decision_logit(scores - self.theta.value.to(scores.dtype))

    def observe_step(self, scores: Tensor, wanting: Tensor, capacity: float) -> None:
        self.theta.observe(scores, capacity)
        super().observe_step(scores, wanting, capacity)

    def controller_terms(self, scores: Tensor, capacity: float) -> tuple[Tensor, None]:
        scale, _ = super().controller_terms(scores, capacity)
        return scale, None  # no warm start: θ's first update (rate 1) already puts the share at C

    def set_step(self, step: int) -> None:
        self.theta.step()
        super().set_step(step)

    def state_stats(self) -> dict[str, Tensor]:
        return {**super().state_stats(), "threshold": self.theta.value.detach().clone()}

    def selected_weight(self, p: Tensor, valid: Tensor) -> Tensor:
        return p  # sigmoid(r − θ (+ b)): the router's LM gradient

    def causal_weight(self, x: Tensor, decide: Tensor) -> Tensor:
        return self.probability(x)

    def load_losses(self, p: Tensor, capacity: float) -> dict[str, Tensor]:
        return {}  # none: θ holds the share


register_variant("expert_threshold", ExpertThresholdRouter, config=ExpertThresholdConfig,
                 source="Expert-Threshold routing (arXiv:2603.11535)",
                 # The paper's rule (an EMA threshold from the global token distribution, the same rule in
                 # training and inference, no auxiliary loss: abstract, §3 eq. 6, Algorithm 1), without its
                 # warm-up; the EMA's rate and the sigmoid(r − θ) gate are ours (the released recipe:
                 # expert_threshold_released).
                 provenance=Provenance("paper's recipe", "modbench's own", "paper",
                                       (("Expert-Threshold routing (arXiv:2603.11535) abstract, §3 (eq. 6, Algorithm 1)",
                                         "paper's text"),)))
