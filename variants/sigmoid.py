"""``sigmoid``: linear router, block delta weighted by sigmoid(r) (or by r itself).

Source: the paper's router-weight path (Raposo et al. 2024, arXiv:2404.02258, §3.4 "Routing
implementation": x' = r·f(x̃) + x for the top-k tokens — the block output multiplied by the *raw*
router weight r = w·x, so the router is trained by the LM loss) and the "Mixture of Depth is Vibe"
blog's (joey00072/ohara) causal-friendly alternative to the softmax ("replace softmax with sigmoid
... doesn't break causality"), which is where sigmoid(r) comes from. ``weighting`` picks the form:
"sigmoid" (default, the blog's) or "raw" (the paper's r). The optional auxiliary BCE loss (§3.5,
method 1) pushes r > 0 exactly for top-k members, so ``r > 0`` is the causal rule at decode time
(for "raw", the processed tokens' weights are then positive, as the top-k's are once r > 0 holds).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .base import LinearRouter, Mixing, PositiveScoreRule, Provenance, VariantConfig, check_choice, check_nonnegative
from .registry import register_variant


WEIGHTINGS = ("sigmoid", "raw")


@dataclass(frozen=True)
class SigmoidConfig(VariantConfig):
    aux_weight: float = 0.01  # weight of BCE(r, top-k membership); 0 turns it off
    # False: the delta is added unweighted. The router then gets no gradient from the LM loss
    # (only the aux BCE towards its own top-k): selection without a trained gate, a control.
    gate: bool = True
    # How the gate weights the delta: "sigmoid" (sigmoid(r), the blog's) or "raw" (r, Raposo et al. §3.4).
    weighting: str = "sigmoid"

    def __post_init__(self) -> None:
        check_nonnegative(self, "aux_weight")
        check_choice(self, "weighting", WEIGHTINGS)


class SigmoidRouter(PositiveScoreRule, LinearRouter):
    """Linear router; delta × sigmoid(r) (or × r); optional aux BCE so r > 0 is the causal rule.

    The score is r = w·x + b; the rule and its BCE are ``PositiveScoreRule``'s."""

    scope = "block"

    def __init__(self, d_model: int, config: SigmoidConfig) -> None:
        super().__init__(d_model, config)
        self.mixing = Mixing(weight="block" if config.gate else "none")  # x + w·Δ, or x + Δ without the gate

    def mix_weight(self, selected_scores: Tensor, scores: Tensor) -> Tensor | None:
        if not self.config.gate:
            return None
        return selected_scores if self.config.weighting == "raw" else torch.sigmoid(selected_scores)


register_variant("sigmoid", SigmoidRouter, config=SigmoidConfig,
                 source="Raposo et al. 2024 §3.4 (eq. 1), §3.5; 'Mixture of Depth is Vibe' blog (joey00072/ohara)",
                 # Weighting: the paper's router-weight path with the blog's sigmoid (weighting="raw": the paper's r).
                 provenance=Provenance("paper", "paper's recipe", "paper's recipe",
                                       (("Raposo et al. 2024 §3.4, §3.5", "secondary"),
                                        ("'Mixture of Depth is Vibe' blog (joey00072/ohara)", "paper's text"))))
