"""``learned_temperature``: sigmoid routing with a learnable temperature and regularisers.

Source: an unpublished enwik8 MoD development report (2025; its v2 router): p = sigmoid(r / τ) with τ a learnable scalar kept in
[τ_min, τ_max] = [0.1, 5] (initialised at 2), an entropy regulariser that rewards uncertain
routing probabilities (the report maximises the binary entropy to prevent collapse) and a
balance loss (mean p − capacity)² that keeps the soft processing rate at the capacity. Both
losses ramp in linearly over ``aux_warmup_steps`` (the report's progressive schedule). Unlike
the report, selection is a real top-k, so the compute saving is real. Causal rule: threshold
at the running k-th-largest logit.

Bounding τ (modbench's choice): the report clamps τ, and a clamp in the forward has zero gradient
outside the bounds, so a τ that leaves them never comes back. Here τ = τ_min + (τ_max − τ_min)·
sigmoid(θ) with θ the learned parameter (``temperature_logit``): always inside the bounds, always a
gradient. A checkpoint of the clamped form (a ``temperature`` parameter) is converted on loading:
θ = logit of its clamped τ, which gives the same τ (to within 1e-6 of the bounds).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from .base import LinearRouter, Provenance, QuantileRule, QuantileThreshold, VariantConfig, linear_ramp
from .registry import register_variant


@dataclass(frozen=True)
class LearnedTemperatureConfig(VariantConfig):
    temperature_init: float = 2.0
    temperature_min: float = 0.1
    temperature_max: float = 5.0
    entropy_weight: float = 0.01
    balance_weight: float = 0.01
    aux_warmup_steps: int = 500
    calibration_momentum: float = 0.01

    def __post_init__(self) -> None:
        fixed = self.temperature_min == self.temperature_init == self.temperature_max
        if not (0 < self.temperature_min < self.temperature_init < self.temperature_max or 0 < self.temperature_min and fixed):
            raise ValueError(
                "need 0 < temperature_min < temperature_init < temperature_max (τ is a sigmoid between the bounds), "
                f"or all three equal for a fixed τ; got {self.temperature_min}, {self.temperature_init}, {self.temperature_max}"
            )
        if self.entropy_weight < 0 or self.balance_weight < 0 or self.aux_warmup_steps < 0:
            raise ValueError("entropy_weight, balance_weight and aux_warmup_steps must be >= 0")


class LearnedTemperatureRouter(QuantileRule, LinearRouter):
    """Linear router; delta × sigmoid(r/τ), τ learned in (0.1, 5) via a sigmoid; entropy + balance losses.

    The score is r itself (top-k of r is top-k of sigmoid(r/τ), τ > 0); the causal rule is ``QuantileRule``'s."""

    scope = "block"

    def __init__(self, d_model: int, config: LearnedTemperatureConfig) -> None:
        super().__init__(d_model, config)
        self.temperature_logit = nn.Parameter(torch.tensor(self.logit_of(config.temperature_init)))
        self.threshold = QuantileThreshold(config.calibration_momentum)

    def logit_of(self, tau: float) -> float:
        """θ with τ(θ) = tau (tau clamped to within 1e-6 of the bounds; 0 for a fixed τ)."""
        lo, hi = self.config.temperature_min, self.config.temperature_max
        if hi == lo:
            return 0.0
        u = min(max((tau - lo) / (hi - lo), 1e-6), 1 - 1e-6)
        return math.log(u / (1 - u))

    def tau(self) -> Tensor:
        lo, hi = self.config.temperature_min, self.config.temperature_max
        return lo + (hi - lo) * torch.sigmoid(self.temperature_logit)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs) -> None:
        # A checkpoint of the clamped parameterisation holds τ itself under ``temperature``: convert.
        old = state_dict.pop(prefix + "temperature", None)
        if old is not None and prefix + "temperature_logit" not in state_dict:
            state_dict[prefix + "temperature_logit"] = torch.tensor(self.logit_of(float(old)), dtype=old.dtype)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def mix_weight(self, selected_scores: Tensor, scores: Tensor) -> Tensor:
        return torch.sigmoid(selected_scores / self.tau())

    def aux_losses(self, x: Tensor, scores: Tensor, index: Tensor) -> dict[str, Tensor]:
        p = torch.sigmoid(scores / self.tau())
        eps = 1e-6
        entropy = -(p * torch.log(p + eps) + (1 - p) * torch.log(1 - p + eps)).mean()
        target = index.shape[-1] / scores.shape[-1]
        return {"entropy": -entropy, "balance": (p.mean() - target) ** 2}

    def aux_weights(self, step: int) -> dict[str, float]:
        ramp = linear_ramp(step, self.config.aux_warmup_steps)
        return {"entropy": ramp * self.config.entropy_weight, "balance": ramp * self.config.balance_weight}


register_variant("learned_temperature", LearnedTemperatureRouter, config=LearnedTemperatureConfig, source="an enwik8 MoD development report (2025, unpublished): v2 router, entropy + balance losses",
                 # The report's router is soft (no top-k); τ is bounded by a sigmoid here, clamped there.
                 provenance=Provenance("modbench's own", "paper's recipe", "modbench's own",
                                       (("unpublished enwik8 MoD report (2025), v2 router", "secondary"),)))
