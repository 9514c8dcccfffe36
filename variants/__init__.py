"""Routing variants for Mixture-of-Depths, and their registry.

Built in: the seed recipes ``norm``, ``linear_softmax``, ``sigmoid``, ``learned_temperature``,
``mlp_skip``; the baseline ``dense`` and the controls ``random``, ``random_gated``, ``random_mlp``;
and methods of the later literature: ``nested`` (hierarchical filtering without weight sharing), ``mor``
(Mixture-of-Recursions' expert-choice router on a recursive model), ``mor_token_choice`` (its
token-choice router: each token's recursion depth chosen up front), ``token_choice``,
``threshold`` (Router-Tuning / MoDification), ``expert_threshold`` (Expert-Threshold routing, the paper's
rule), ``expert_threshold_released`` (the same method as its released code trains it: an expert-choice
warm-up, a bias-corrected cutoff EMA), ``pmod`` (p-MoD's TanhNorm and STRing),
``mode_staged`` (MoD with a mixture-of-experts MLP), ``mode_integrated`` (a no-op expert among the
experts), ``amod`` (A-MoD's attention routing), ``dtrnet`` (DTRNet: attention's token mixing routed, a
token-local update and the MLP for every token), ``tsa`` (Token-Selective Attention: a two-layer MLP halting
gate, soft on every token in training, a threshold at decode time), ``null_experts`` (null experts in a
token-choice mixture: each token runs its top-1 expert MLP unless a null expert wins, balanced over real and
null experts). Every fixed-count routed variant also answers to "<name>+aux" (``decode_aliases``): the same
training, decoded by Raposo et al. 2024 (arXiv:2404.02258) §3.5's auxiliary predictor. Add your own with
``@register_variant`` (docs/variants.md).
"""

from .base import (BudgetController, Mixing, Provenance, QuantileThreshold, Router, Routing, RunningMean, StepMean,
                   VariantConfig, linear_ramp, topk_membership)
from .registry import (
    AUX_SUFFIX,
    ENTRY_POINT_GROUP,
    ROLES,
    VariantSpec,
    baseline_variant,
    build_router,
    decode_aliases,
    get_variant,
    is_baseline,
    list_variants,
    random_controls,
    register_variant,
    static_decode_refusal,
    training_host_read,
)

# Importing the modules registers the built-in variants.
from . import (amod, controls, dtrnet, expert_threshold, expert_threshold_released,  # noqa: E402,F401
               learned_temperature, linear_softmax, mlp_skip, mode, mor, mor_token_choice, nested, norm,
               null_experts, pmod, sigmoid, token_choice, tsa)

__all__ = [
    "AUX_SUFFIX",
    "BudgetController",
    "ENTRY_POINT_GROUP",
    "Mixing",
    "Provenance",
    "ROLES",
    "QuantileThreshold",
    "Router",
    "Routing",
    "RunningMean",
    "StepMean",
    "VariantConfig",
    "VariantSpec",
    "baseline_variant",
    "build_router",
    "decode_aliases",
    "get_variant",
    "is_baseline",
    "linear_ramp",
    "list_variants",
    "random_controls",
    "register_variant",
    "static_decode_refusal",
    "training_host_read",
    "topk_membership",
]
