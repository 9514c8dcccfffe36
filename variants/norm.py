"""``norm``: parameter-free routing by the L2 norm of the residual stream.

Source: the MoD documentation of a nanochat fork (``Block.forward_mod``): score = ‖x‖₂ per token, top-k,
sorted positions, no weighting of the block's output. With no weight the router gets no
gradient; the selection is whatever the norms are. Causal rule: threshold at the running
k-th-largest norm seen in training.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .base import Mixing, Provenance, QuantileRule, QuantileThreshold, VariantConfig, check_interval
from .registry import register_variant


@dataclass(frozen=True)
class NormConfig(VariantConfig):
    calibration_momentum: float = 0.01  # EMA rate of the causal threshold

    def __post_init__(self) -> None:
        check_interval(self, "calibration_momentum", "(0, 1]")


class NormRouter(QuantileRule):
    """Score ‖x‖₂; causal rule ``QuantileRule``."""

    scope = "block"
    mixing = Mixing(weight="none")  # x + Δ

    def __init__(self, config: NormConfig) -> None:
        super().__init__(config)
        self.threshold = QuantileThreshold(config.calibration_momentum)

    def score(self, x: Tensor) -> Tensor:
        return torch.linalg.vector_norm(x, dim=-1)

    def flops_per_token(self, d_model: int) -> tuple[float, float]:
        return 2.0 * d_model, 0.0  # square and sum; the norm carries no gradient to the LM


@register_variant("norm", config=NormConfig, source="nanochat MoD fork documentation (norm routing, Block.forward_mod)",
                  provenance=Provenance("paper", "paper", "modbench's own",
                                        (("nanochat MoD fork documentation", "secondary"),)))
def build_norm(d_model: int, config: NormConfig) -> NormRouter:
    """Parameter-free: score = L2 norm of the residual stream, top-k, unweighted."""
    return NormRouter(config)
