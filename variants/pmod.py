"""``pmod``: p-MoD's router — TanhNorm weights and symmetric token reweighting (STRing).

Source: Zhang et al. 2024, p-MoD: Building Mixture-of-Depths MLLMs via Progressive Ratio Decay
(arXiv:2412.04449), §3.2–3.3. Three designs, all available here:

- **TanhNorm**: the router's weight is w = α·tanh(r) + 1 with α = 0.2 (``alpha``), r = w_r·x + b,
  so weights stay in [1 − α, 1 + α] and a processed token's update is x + w·Δ.
- **STRing** (symmetric token reweighting): tokens the layer *skips* are scaled by their weight
  as well, x ↦ w·x (Figure 2: "both the selected and skipped tokens are symmetrically scaled by
  their corresponding weights"), so the router gets a gradient from every token, not only the
  selected ones. Skipped rows are therefore not bit-identical for this variant, by design; the
  registry sweeps check them against w·x instead.
- **Progressive ratio decay** (PRD): capacity falling over depth along a cosine. It is the
  routing config's ``capacity_first`` (available to every variant); set it to use PRD.

Decoding: p-MoD routes vision tokens in a bidirectional prefill. For a decoder the causal rule
is r > 0, taught by the auxiliary BCE towards top-k membership (as ``sigmoid``), and a skipped
token is scaled by its own weight at decode time too, so decoding equals the causal forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from .base import Router, VariantConfig, topk_membership
from .linear_router import LinearScorer
from .registry import register_variant


@dataclass(frozen=True)
class PModConfig(VariantConfig):
    alpha: float = 0.2  # TanhNorm: w = alpha·tanh(r) + 1
    string: bool = True  # STRing: scale skipped tokens by their weight too
    aux_weight: float = 0.01  # BCE of r against top-k membership (the causal rule r > 0)

    def __post_init__(self) -> None:
        if not 0.0 < self.alpha < 1.0:
            raise ValueError(f"alpha must be in (0, 1) (weights stay positive), got {self.alpha}")
        if self.aux_weight < 0:
            raise ValueError(f"aux_weight must be >= 0, got {self.aux_weight}")


class PModRouter(Router):
    scope = "block"

    def __init__(self, d_model: int, config: PModConfig) -> None:
        super().__init__(config)
        self.scorer = LinearScorer(d_model)

    def score(self, x: Tensor) -> Tensor:
        return self.scorer(x)

    def tanh_norm(self, r: Tensor) -> Tensor:
        return self.config.alpha * torch.tanh(r) + 1.0

    def mix_weight(self, selected_scores: Tensor, scores: Tensor) -> Tensor:
        return self.tanh_norm(selected_scores)

    def skip_scale_of(self, scores: Tensor) -> Tensor | None:
        return self.tanh_norm(scores) if self.config.string else None

    def aux_losses(self, x: Tensor, scores: Tensor, index: Tensor) -> dict[str, Tensor]:
        if self.config.aux_weight == 0:
            return {}
        return {"router_bce": F.binary_cross_entropy_with_logits(scores, topk_membership(scores, index))}

    def aux_weights(self, step: int) -> dict[str, float]:
        return {"router_bce": self.config.aux_weight}

    def decide_causal(self, x: Tensor) -> Tensor:
        return self.scorer(x) > 0

    def flops_per_token(self, d_model: int) -> tuple[float, float]:
        return LinearScorer.flops(d_model)


@register_variant("pmod", config=PModConfig, source="p-MoD, Zhang et al. 2024 (arXiv:2412.04449) §3.2-3.3")
def build_pmod(d_model: int, config: PModConfig) -> PModRouter:
    """TanhNorm weight 0.2·tanh(r)+1 on processed deltas; STRing scales skipped tokens by it too."""
    return PModRouter(d_model, config)
