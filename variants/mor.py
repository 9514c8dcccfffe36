"""``mor``: Mixture-of-Recursions' expert-choice router, one router per recursion step.

Source: Bae et al. 2025, Mixture-of-Recursions (arXiv:2507.10524) §2.2, as its authors' released
code implements it (raymin0223/mixture_of_recursions ``model/mor_model/expert_choice_router.py``,
``MoRLlamaDecoderLayer``; read for every choice below). Meant for a recursive model
(``ModelConfig.recursion``): route the positions of the shared block (``pattern = "fixed:1,1"`` under
middle_cycle with a one-layer block, ``"all"`` under cycle), each with its own router as in the
released code, where every recursion step wraps the block with a router of its own.

- Selection: expert choice with hierarchical filtering. Step r keeps the top-k_r of its scores among
  the tokens step r − 1 processed (the released code gathers those candidates before scoring), so
  the active set shrinks with depth. k_r = max(1, ⌊C_r·T⌋) of the *whole* sequence, as the code's
  ``top_k = max(1, int(capacity_factor * seq_len))``. Per-step capacities: the routing config's
  ``capacities`` list, one per step (the code's comma-separated ``mor.capacity``), e.g.
  ``capacities = "1,2/3,1/3", capacity = 1/3``; ``capacity_first`` → ``capacity`` (a cosine) works
  too. The capacity warm-up (``capacity_warmup_steps``) is the code's ``cap_warmup_step`` cosine
  from 1.
- Score: r = w·(x/τ) + b, the code's ``mor_router(x / temp)`` (``temperature`` τ).
- Weighting and update: g = α·sigmoid(r) (``router_func = sigmoid``, ``alpha``; the released configs
  use α = 0.1). ``update = "output"`` (default) is the code's ``scatter_add(x, g · block(x))``: the
  block's *output* x + Δ is weighted, so a processed token becomes x + g·(x + Δ). ``update =
  "delta"``: x + g·Δ, the MoD form the other variants use (modbench's own option).
- Auxiliary losses (``sampling = aux_loss``): BCE of r against top-k membership over the step's
  *candidates* only (the code scores the gathered candidates; mean over them), weight
  ``aux_weight`` (the released configs' ``coeff`` 0.001); the router z-loss mean(logsumexp(r)²) =
  mean(r²) over the candidates (a single logit per token), weight ``z_weight`` (the code's
  ``z_coeff``; off in its expert-choice configs, so 0 here by default).
- Causal rule at decode time: sigmoid(r) ≥ 0.5, i.e. r ≥ 0 (the code's prediction of its BCE),
  *and* processed by the previous step: hierarchical at decode time too. The released code trains
  this predictor but releases no decoding; the rule is modbench's reading (paper's recipe).
  ``sampling = "aux_router"`` is the code's other option: a second linear router on the *detached*
  state, trained by that BCE (the main router then gets none), decides at decode time (its logit
  ≥ 0 and the previous step); the weight g stays the main router's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from .base import (LinearRouter, Mixing, Provenance, Routing, VariantConfig, check_choice, check_interval,
                   check_nonnegative, topk_membership)
from .linear_router import LinearScorer
from .registry import register_variant

UPDATES = ("output", "delta")
SAMPLINGS = ("aux_loss", "aux_router")  # the released code's names for the two causal predictors
_MASK = 1e4  # subtracted from the scores of non-candidates: below every candidate's


@dataclass(frozen=True)
class MorConfig(VariantConfig):
    alpha: float = 0.1  # g = α·sigmoid(r)
    temperature: float = 1.0  # τ in r = w·(x/τ) + b
    aux_weight: float = 0.001  # BCE of r against top-k membership, over the step's candidates
    z_weight: float = 0.0  # router z-loss mean(r²) over the step's candidates
    update: str = "output"  # 'output': x + g·(x + Δ) (released code); 'delta': x + g·Δ
    sampling: str = "aux_loss"  # decode-time predictor: 'aux_loss' (BCE on r) or 'aux_router' (a detached router)

    def __post_init__(self) -> None:
        check_interval(self, "alpha", "(0, 10]")
        check_interval(self, "temperature", "(0, 100]")
        check_nonnegative(self, "aux_weight", "z_weight")
        check_choice(self, "update", UPDATES)
        check_choice(self, "sampling", SAMPLINGS)


class MorRouter(LinearRouter):
    """Expert choice per recursion step among the previous step's tokens; x + α·sigmoid(r)·(x + Δ)."""

    scope = "block"

    def __init__(self, d_model: int, config: MorConfig) -> None:
        super().__init__(d_model, config)
        # sampling = aux_router: the decode-time predictor, a linear router on the detached state
        self.aux_scorer = LinearScorer(d_model) if config.sampling == "aux_router" else None
        # x + g·(x + Δ) (update="output": the weight multiplies the block's output) or x + g·Δ
        self.mixing = Mixing(weight="block", output=config.update == "output")

    _candidates: Tensor | None = None  # (B, T) bool, set only while ``route`` runs

    def logit(self, x: Tensor) -> Tensor:
        """r = w·(x/τ) + b for every token."""
        return self.scorer(x / self.config.temperature)

    def score(self, x: Tensor) -> Tensor:
        """r; inside ``route`` after a first step, tokens the previous step skipped get r − 10⁴."""
        r = self.logit(x)
        if self._candidates is not None:
            r = torch.where(self._candidates, r, r - _MASK)
        return r

    def route(self, x: Tensor, k: int, previous: Tensor | None = None) -> Routing:
        # Hierarchical filtering: only the previous step's tokens are candidates. (If k exceeds their
        # count, the extra slots go to the best of the others rather than failing, as in ``nested``.)
        self._candidates = previous if isinstance(previous, Tensor) else None
        try:
            return super().route(x, k, previous)
        finally:
            self._candidates = None

    @staticmethod
    def _raw(scores: Tensor) -> Tensor:
        return torch.where(scores < -_MASK / 2, scores + _MASK, scores)

    def mix_weight(self, selected_scores: Tensor, scores: Tensor) -> Tensor:
        return self.config.alpha * torch.sigmoid(self._raw(selected_scores))

    def causal_weight(self, x: Tensor, decide: Tensor | None) -> Tensor:
        return self.config.alpha * torch.sigmoid(self.logit(x))

    def aux_losses(self, x: Tensor, scores: Tensor, index: Tensor) -> dict[str, Tensor]:
        cfg = self.config
        if cfg.aux_weight == 0 and cfg.z_weight == 0:
            return {}
        raw = self._raw(scores)
        cand = torch.ones_like(raw) if self._candidates is None else self._candidates.to(raw.dtype)
        n = cand.sum().clamp_min(1.0)
        out = {}
        if cfg.aux_weight:
            predictor = raw if self.aux_scorer is None else self.aux_scorer(x.detach())
            bce = F.binary_cross_entropy_with_logits(predictor, topk_membership(raw, index), reduction="none")
            out["router_bce"] = (bce * cand).sum() / n
        if cfg.z_weight:
            out["router_z"] = (raw.square() * cand).sum() / n  # logsumexp of one logit is the logit
        return out

    def aux_weights(self, step: int) -> dict[str, float]:
        return {"router_bce": self.config.aux_weight, "router_z": self.config.z_weight}

    def decide_causal(self, x: Tensor) -> Tensor:
        return (self.logit(x) if self.aux_scorer is None else self.aux_scorer(x)) >= 0

    def decide_causal_given(self, x: Tensor, previous: Tensor | None) -> Tensor:
        decide = self.decide_causal(x)
        return decide & previous if isinstance(previous, Tensor) else decide

    def flops_per_token(self, d_model: int) -> tuple[float, float]:
        fwd, bwd = super().flops_per_token(d_model)
        if self.aux_scorer is not None and self.config.aux_weight:
            # the detached router: forward 2d, backward its weight gradient only (2d)
            fwd, bwd = fwd + 2.0 * d_model, bwd + 2.0 * d_model
        return fwd, bwd


register_variant("mor", MorRouter, config=MorConfig,
                 source="Mixture-of-Recursions, Bae et al. 2025 (arXiv:2507.10524) §2.2, expert-choice routing, "
                        "per recursion step of a shared block",
                 provenance=Provenance("paper", "paper", "paper's recipe",
                                       (("Mixture-of-Recursions §2.2", "secondary"),
                                        ("raymin0223/mixture_of_recursions expert_choice_router.py", "released code"))))
