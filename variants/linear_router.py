"""Shared pieces of the learned variants: a linear scorer and the auxiliary predictor."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn


class LinearScorer(nn.Module):
    """r = w·x + b: one scalar logit per token (Raposo et al. 2024, eq. 1)."""

    def __init__(self, d_model: int) -> None:
        super().__init__()
        self.proj = nn.Linear(d_model, 1)
        nn.init.normal_(self.proj.weight, std=0.02)
        nn.init.zeros_(self.proj.bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.proj(x).squeeze(-1)

    @staticmethod
    def flops(d_model: int) -> tuple[float, float]:
        # forward 2d per token; backward computes input and weight grads: 2 × forward
        return 2.0 * d_model, 4.0 * d_model


class AuxPredictor(nn.Module):
    """Small MLP predicting top-k membership from the *detached* hidden state.

    Raposo et al. 2024 §3.5 (method 2) and the "Mixture of Depth is Vibe" blog (joey00072/ohara): trained with BCE against the top-k
    targets; no gradient reaches the language model, so it cannot change what the LM
    learns, only how well decoding can imitate the non-causal top-k.
    """

    def __init__(self, d_model: int, hidden: int) -> None:
        super().__init__()
        self.hidden = hidden
        self.net = nn.Sequential(nn.Linear(d_model, hidden), nn.SiLU(), nn.Linear(hidden, 1))

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x.detach()).squeeze(-1)

    def loss(self, x: Tensor, membership: Tensor) -> Tensor:
        return F.binary_cross_entropy_with_logits(self(x), membership)

    def flops(self, d_model: int) -> tuple[float, float]:
        h = self.hidden
        fwd = 2.0 * d_model * h + 2.0 * h
        # The input is detached: the first layer needs only its weight grad (1 × forward),
        # the second needs weight and input grads (2 × forward).
        bwd = 2.0 * d_model * h + 2.0 * (2.0 * h)
        return fwd, bwd
