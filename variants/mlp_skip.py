"""``mlp_skip``: attention runs on every token; only the MLP is routed.

Source: an unpublished enwik8 MoD development report (2025; its v1 ``AdaptiveBlock``), which always applies attention and masks the
MLP output per token. The report computes the MLP for *every* token and multiplies the skipped
ones by zero, which saves no FLOPs at all. Here the MLP runs only on the gathered top-k
tokens, so its saving is real and measured: attention keeps full cost, the MLP costs C of
dense. Weighting is the report's sigmoid gate, p = sigmoid(r); causal rule: threshold at the
running k-th-largest logit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .base import Provenance, QuantileThreshold, Router, VariantConfig
from .linear_router import LinearScorer
from .registry import register_variant


@dataclass(frozen=True)
class MlpSkipConfig(VariantConfig):
    calibration_momentum: float = 0.01


class MlpSkipRouter(Router):
    scope = "mlp"

    def __init__(self, d_model: int, config: MlpSkipConfig) -> None:
        super().__init__(config)
        self.scorer = LinearScorer(d_model)
        self.threshold = QuantileThreshold(config.calibration_momentum)

    def score(self, x: Tensor) -> Tensor:
        return self.scorer(x)

    def mix_weight(self, selected_scores: Tensor, scores: Tensor) -> Tensor:
        return torch.sigmoid(selected_scores)

    def observe(self, scores: Tensor, topk_values: Tensor) -> None:
        self.threshold.update(topk_values.amin(-1))

    def decide_causal(self, x: Tensor) -> Tensor:
        return self.threshold(self.score(x))

    def flops_per_token(self, d_model: int) -> tuple[float, float]:
        return LinearScorer.flops(d_model)


@register_variant("mlp_skip", config=MlpSkipConfig, source="an enwik8 MoD development report (2025, unpublished): v1 AdaptiveBlock, MLP really skipped",
                  # The report masks the MLP output of every token; here the MLP runs on the top-k only.
                  provenance=Provenance("paper's recipe", "paper", "modbench's own",
                                        (("unpublished enwik8 MoD report (2025), v1 AdaptiveBlock", "secondary"),)))
def build_mlp_skip(d_model: int, config: MlpSkipConfig) -> MlpSkipRouter:
    """Attention on all tokens; the MLP runs on the top-k only; delta × sigmoid(r)."""
    return MlpSkipRouter(d_model, config)
