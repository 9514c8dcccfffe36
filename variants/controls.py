"""The two reference points every study needs: ``dense`` and ``random``.

``dense`` is the baseline transformer: every layer processes every token (the model builds
plain blocks; no router exists). ``random`` keeps k uniformly random tokens per routed layer
(a control: a learned router that cannot beat chance has learned nothing useful). Its
randomness comes from torch's global generator, so a seed fixes it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .base import Router, VariantConfig
from .registry import register_variant


@dataclass(frozen=True)
class DenseConfig(VariantConfig):
    pass


class DenseRouter(Router):
    """Marks layers as unrouted; the model never calls it."""

    scope = "none"

    def score(self, x: Tensor) -> Tensor:
        return torch.ones(x.shape[:-1], device=x.device, dtype=x.dtype)

    def decide_causal(self, x: Tensor) -> Tensor:
        return torch.ones(x.shape[:-1], device=x.device, dtype=torch.bool)


@register_variant("dense", config=DenseConfig, source="baseline (Vaswani et al. 2017; no routing)")
def build_dense(d_model: int, config: DenseConfig) -> DenseRouter:
    """The dense baseline: every token through every layer."""
    return DenseRouter(config)


@dataclass(frozen=True)
class RandomConfig(VariantConfig):
    pass


class RandomRouter(Router):
    scope = "block"

    def __init__(self, config: RandomConfig) -> None:
        super().__init__(config)
        self.register_buffer("fraction", torch.ones(()))

    def score(self, x: Tensor) -> Tensor:
        return torch.rand(x.shape[:-1], device=x.device)

    def observe(self, scores: Tensor, topk_values: Tensor) -> None:
        self.fraction.fill_(topk_values.shape[-1] / scores.shape[-1])

    def decide_causal(self, x: Tensor) -> Tensor:
        return torch.rand(x.shape[:-1], device=x.device) < self.fraction


@register_variant("random", config=RandomConfig, source="control (uniform random top-k)")
def build_random(d_model: int, config: RandomConfig) -> RandomRouter:
    """Control: k uniformly random tokens per routed layer, unweighted."""
    return RandomRouter(config)
