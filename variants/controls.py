"""The reference points every study needs: ``dense`` and the random-routing controls.

Random controls (what a learned router must beat to have learned anything):

- ``random``: k uniformly random tokens per routed layer, delta added unweighted.
- ``random_gated``: random selection, but the delta is weighted by a learned gate
  sigmoid(w·x), the gate of ``sigmoid`` (Raposo et al. 2024 §3.4). It separates what the
  *selection* contributes from what the *gate* contributes: ``sigmoid`` vs ``random_gated``
  differ in the selection only. (``norm`` has no gate, so ``random`` is its control.)
- ``random_mlp``: random selection at scope "mlp" (attention on every token, the MLP on the
  selected ones, delta weighted by the same learned gate), the control of ``mlp_skip``.

``dense`` is the baseline transformer: every layer processes every token (the model builds
plain blocks; no router exists). ``random`` keeps k uniformly random tokens per routed layer
(a control: a learned router that cannot beat chance has learned nothing useful). Its
randomness comes from torch's global generator, so a seed fixes it.

Causal rule of ``random``: a fixed random hyperplane. The token is processed when its
hidden state, normalised, projects onto a fixed random unit vector above a threshold: the
k-th largest projection, averaged over the final calibration pass of training
(``modbench.model.decode.calibrate_causal_rules``: only then, so training steps pay nothing for
it); before any calibration, the (1 − C)-quantile of N(0, 1/d), the projection's
distribution for isotropic states. It is deterministic (the same token state always gets the
same decision, so causal-mode forwards are reproducible and a perturbation after t cannot
change anything at ≤ t), continuous in the state (a cached decode whose state differs from
the full forward by float rounding makes the same decisions, which a hash of the state's
bits would not), and content-blind (the direction is random, not learned). The direction
comes from a private generator with a fixed seed, so it does not shift the initialisation
RNG, and it is not saved (it is rebuilt identically).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import Tensor

from .base import Mixing, Provenance, QuantileThreshold, Router, Routing, VariantConfig
from .linear_router import LinearScorer
from .registry import register_variant


@dataclass(frozen=True)
class DenseConfig(VariantConfig):
    pass


class DenseRouter(Router):
    """Marks layers as unrouted; the model never calls it."""

    scope = "none"
    mixing = Mixing(weight="none")

    def score(self, x: Tensor) -> Tensor:
        return torch.ones(x.shape[:-1], device=x.device, dtype=x.dtype)

    def decide_causal(self, x: Tensor) -> Tensor:
        return torch.ones(x.shape[:-1], device=x.device, dtype=torch.bool)


@register_variant("dense", config=DenseConfig, source="baseline (Vaswani et al. 2017; no routing)", role="baseline")
def build_dense(d_model: int, config: DenseConfig) -> DenseRouter:
    """The dense baseline: every token through every layer."""
    return DenseRouter(config)


@dataclass(frozen=True)
class RandomConfig(VariantConfig):
    pass


class RandomRouter(Router):
    scope = "block"
    mixing = Mixing(weight="none")  # x + Δ
    DIRECTION_SEED = 20240402  # the causal rule's hyperplane; fixed, independent of the run seed

    def __init__(self, config: RandomConfig, d_model: int) -> None:
        super().__init__(config)
        self.register_buffer("fraction", torch.ones(()))
        g = torch.Generator().manual_seed(self.DIRECTION_SEED)
        self.register_buffer("direction", F.normalize(torch.randn(d_model, generator=g), dim=0), persistent=False)
        self.threshold = QuantileThreshold()  # the mean over the calibration pass only

    def project(self, x: Tensor) -> Tensor:
        return F.normalize(x.float(), dim=-1) @ self.direction.float()

    def route(self, x: Tensor, k: int, previous: Tensor | None = None) -> Routing:
        routing = super().route(x, k, previous)
        if self.calibrating:
            self.threshold.update(torch.topk(self.project(x), k, dim=-1).values.amin(-1))
        return routing

    def score(self, x: Tensor) -> Tensor:
        return torch.rand(x.shape[:-1], device=x.device)

    def observe(self, scores: Tensor, topk_values: Tensor) -> None:
        self.fraction.fill_(topk_values.shape[-1] / scores.shape[-1])

    def decide_causal(self, x: Tensor) -> Tensor:
        z = self.project(x)
        # Uncalibrated: P(z > τ) = fraction for z ~ N(0, 1/d) (fraction 1 → τ = −inf).
        prior = torch.special.ndtri(1.0 - self.fraction) / math.sqrt(x.shape[-1])
        tau = torch.where(self.threshold.count > 0, self.threshold.value, prior)
        return z >= tau


@register_variant("random", config=RandomConfig, source="control (uniform random top-k)", role="control", control_of="norm",
                  provenance=Provenance("modbench's own", "modbench's own", "modbench's own"))
def build_random(d_model: int, config: RandomConfig) -> RandomRouter:
    """Control: k uniformly random tokens per routed layer, unweighted."""
    return RandomRouter(config, d_model)


class RandomGatedRouter(RandomRouter):
    """Random selection; the delta of a selected token is weighted by sigmoid(w·x)."""

    mixing = Mixing(weight="block")  # x + sigmoid(w·x)·Δ

    def __init__(self, config: RandomConfig, d_model: int) -> None:
        super().__init__(config, d_model)
        self.gate = LinearScorer(d_model)

    def route(self, x: Tensor, k: int, previous: Tensor | None = None) -> Routing:
        routing = super().route(x, k, previous)
        weight = torch.sigmoid(self.gate(x).gather(-1, routing.index)).unsqueeze(-1)
        return replace(routing, weight=weight)

    def causal_weight(self, x: Tensor, decide: Tensor) -> Tensor:
        return torch.sigmoid(self.gate(x))

    def flops_per_token(self, d_model: int) -> tuple[float, float]:
        return LinearScorer.flops(d_model)


class RandomMlpRouter(RandomGatedRouter):
    scope = "mlp"


@register_variant("random_gated", config=RandomConfig, role="control", control_of="sigmoid",
                  source="control: random top-k with sigmoid's learned gate (Raposo et al. 2024 §3.4)",
                  provenance=Provenance("modbench's own", "modbench's own", "modbench's own"))
def build_random_gated(d_model: int, config: RandomConfig) -> RandomGatedRouter:
    """Control of ``sigmoid``: k random tokens, delta × sigmoid(w·x) with a learned w."""
    return RandomGatedRouter(config, d_model)


@register_variant("random_mlp", config=RandomConfig, source="control: random top-k at MLP scope, learned gate",
                  role="control", control_of="mlp_skip",
                  provenance=Provenance("modbench's own", "modbench's own", "modbench's own"))
def build_random_mlp(d_model: int, config: RandomConfig) -> RandomMlpRouter:
    """Control of ``mlp_skip``: attention on all tokens, the MLP on k random ones, gated."""
    return RandomMlpRouter(config, d_model)
