"""``pmod``: p-MoD's router — TanhNorm weights and symmetric token reweighting (STRing).

Source: Zhang et al. 2024, p-MoD: Building Mixture-of-Depths MLLMs via Progressive Ratio Decay
(arXiv:2412.04449), §3.2–3.3, and its released code:

- **TanhNorm**: the router's weight is w = α·tanh(r) + 1 with α = 0.2 (``alpha``), r = w_r·x + b,
  so weights stay in [1 − α, 1 + α].
- **Where the weight goes** (option ``weight_scope``, the router's ``Mixing.weight``): "mlp"
  (default, as p-MoD's released code) weights the MLP output only, so a processed token becomes
  x + attn + w·mlp; "block" weights the whole block delta, x + w·(attn + mlp), as MoD does with its
  router weight.
- **STRing** (symmetric token reweighting; option ``string``, ``Mixing(skip="scale")``): tokens
  the layer *skips* are scaled by their weight as well, x ↦ w·x (Figure 2: "both the selected and
  skipped tokens are symmetrically scaled by their corresponding weights"), so the router gets a
  gradient from every token, not only the selected ones. Skipped rows are therefore not
  bit-identical for this variant, by design; the registry sweeps check them against w·x instead.
- **Progressive ratio decay** (PRD) is not a router option: modbench reparameterises it as the
  routing config's ``capacity_first`` (capacity falling along a cosine from the first routed layer
  to the last, available to every variant), which matches PRD's shape of a ratio decaying over
  depth but is set by its two end points rather than by p-MoD's own schedule parameters.

Decoding (modbench's own): p-MoD routes the vision tokens of a multimodal LLM, whose top-k runs
over the image tokens of a sequence and so needs no causal rule. For a decoder the causal rule here
is r > 0, taught by the auxiliary BCE towards top-k membership (as ``sigmoid``), and a skipped
token is scaled by its own weight at decode time too, so decoding equals the causal forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .base import LinearRouter, Mixing, PositiveScoreRule, Provenance, VariantConfig, check_interval, check_nonnegative
from .registry import register_variant


@dataclass(frozen=True)
class PModConfig(VariantConfig):
    alpha: float = 0.2  # TanhNorm: w = alpha·tanh(r) + 1
    string: bool = True  # STRing: scale skipped tokens by their weight too
    aux_weight: float = 0.01  # BCE of r against top-k membership (the causal rule r > 0)
    weight_scope: str = "mlp"  # "mlp": x + attn + w·mlp (p-MoD's released code); "block": x + w·(attn + mlp)

    def __post_init__(self) -> None:
        if self.weight_scope not in ("mlp", "block"):
            raise ValueError(f"weight_scope must be 'mlp' or 'block', got {self.weight_scope!r}")
        check_interval(self, "alpha", "(0, 1)", " (weights stay positive)")
        check_nonnegative(self, "aux_weight")


class PModRouter(PositiveScoreRule, LinearRouter):
    """TanhNorm weight 0.2·tanh(r)+1 on processed tokens' MLP output; STRing scales skipped tokens by it too.

    Causal rule: r > 0, taught by the aux BCE (``PositiveScoreRule``), as ``sigmoid``'s."""

    scope = "block"

    def __init__(self, d_model: int, config: PModConfig) -> None:
        super().__init__(d_model, config)
        # x + attn + w·mlp ("mlp") or x + w·Δ ("block"); skipped tokens w·x under STRing
        self.mixing = Mixing(weight=config.weight_scope, skip="scale" if config.string else "keep")

    def tanh_norm(self, r: Tensor) -> Tensor:
        return self.config.alpha * torch.tanh(r) + 1.0

    def mix_weight(self, selected_scores: Tensor, scores: Tensor) -> Tensor:
        return self.tanh_norm(selected_scores)

    def skip_scale_of(self, scores: Tensor) -> Tensor:
        return self.tanh_norm(scores)  # (asked only under STRing: ``mixing.skip == "scale"``)


register_variant("pmod", PModRouter, config=PModConfig, source="p-MoD, Zhang et al. 2024 (arXiv:2412.04449) §3.2-3.3 and its released code",
                 # Selection over every token of a decoder, not over an MLLM's vision tokens.
                 provenance=Provenance("paper's recipe", "paper", "modbench's own",
                                       (("p-MoD §3.2-3.3", "secondary"),
                                        ("MCG-NJU/p-MoD pmod_llava_llama.py (ModLayer)", "released code"))))
