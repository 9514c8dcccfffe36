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

from .base import LinearRouter, Provenance, QuantileRule, QuantileThreshold, VariantConfig
from .registry import register_variant


@dataclass(frozen=True)
class MlpSkipConfig(VariantConfig):
    calibration_momentum: float = 0.01


class MlpSkipRouter(QuantileRule, LinearRouter):
    """Attention on all tokens; the MLP runs on the top-k only; delta × sigmoid(r).

    The score is r = w·x + b of the MLP's input; the causal rule is ``QuantileRule``'s."""

    scope = "mlp"

    def __init__(self, d_model: int, config: MlpSkipConfig) -> None:
        super().__init__(d_model, config)
        self.threshold = QuantileThreshold(config.calibration_momentum)

    def mix_weight(self, selected_scores: Tensor, scores: Tensor) -> Tensor:
        return torch.sigmoid(selected_scores)


register_variant("mlp_skip", MlpSkipRouter, config=MlpSkipConfig, source="an enwik8 MoD development report (2025, unpublished): v1 AdaptiveBlock, MLP really skipped",
                 # The report masks the MLP output of every token; here the MLP runs on the top-k only.
                 provenance=Provenance("paper's recipe", "paper", "modbench's own",
                                       (("unpublished enwik8 MoD report (2025), v1 AdaptiveBlock", "secondary"),)))
