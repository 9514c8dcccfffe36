"""The control arms a study derives (``[study] controls``), sized by the model's analytic FLOPs.

A MoD model costs fewer FLOPs per token than the dense model of its shape, so under one FLOP
budget it trains on more tokens; the derived dense controls separate "routing helps" from "a
cheaper model sees more data" (Raposo et al. 2024 §4.1). Their sizes come from
``modbench.model.sizing`` (FLOP-matched shape, iso-token budget, param-matched vanilla twin of a
recursive model: see its docstring); this module turns them into arms of a study:

- ``matched_dense``: the FLOP-matched dense model of each routed shape, same budget;
- ``iso_token_dense``: the routed shape's own dense model for as many steps as the routed arm
  (FLOP budgets only);
- ``param_matched_dense``: the vanilla twin with a recursive arm's parameters.

Each control's label (``Arm.control``) begins with one of ``FLOP_MATCHED``, ``PARAM_MATCHED``,
``ISO_TOKENS`` (the two at the study's own budget first), which the claims match on.
"""

from __future__ import annotations

from modbench.config.budget import Budget
from modbench.design.arm import Arm
from modbench.design.study_file import StudySpec
from modbench.model.sizing import iso_token_budget, matched_dense_shape, param_matched_vanilla
from modbench.design.vocabulary import DENSE

FLOP_MATCHED, PARAM_MATCHED, ISO_TOKENS = "FLOP-matched to ", "param-matched to ", "iso-tokens of "


def control_arms(study: StudySpec) -> list[Arm]:
    """The study's derived control arms (``study.controls``), for each routed arm of [space]
    (``param_matched_dense``: for each recursive arm of [space], routed or dense).

    Routed arms that share a shape (capacity, pattern, schedule, depth, width, budget, recursion)
    share their controls; the FLOPs are those of the first routed variant listed (routers differ by
    a few FLOPs per token, far inside the tolerance).
    """
    wanted = study.settings.controls
    if not wanted:
        return []
    out: dict[Arm, None] = {}
    seen_shapes: set[tuple] = set()
    for arm in study.main_arms():
        if "param_matched_dense" in wanted and arm.recursion != "none":
            out.setdefault(param_matched_arm(study, arm), None)
        shape = (arm.shape, arm.lr_mult)
        if arm.variant == DENSE or shape in seen_shapes:
            continue
        seen_shapes.add(shape)
        cfg = study.run_config(arm, study.settings.seeds[0])
        what = f"{arm.capacity_text} {arm.pattern}" + (" log" if arm.schedule == "log" else "") \
            + (f" {arm.recursion_text}" if arm.recursion_text else "")
        if "matched_dense" in wanted:
            depth, width, _ = matched_dense_shape(cfg)
            out.setdefault(Arm(DENSE, lr_mult=arm.lr_mult, depth=depth, budget=arm.budget, width=width,
                                control=f"{FLOP_MATCHED}{what}"), None)
        if "iso_token_dense" in wanted and Budget.parse(arm.budget).kind == "flops":
            out.setdefault(Arm(DENSE, lr_mult=arm.lr_mult, depth=arm.depth, budget=iso_token_budget(cfg), width=arm.width,
                                control=f"{ISO_TOKENS}{what}"), None)
    return list(out)


def param_matched_arm(study: StudySpec, arm: Arm) -> Arm:
    """The vanilla dense arm with the parameters of ``arm``'s recursive model: its physical depth at
    its width (``param_matched_vanilla``), same budget and learning-rate multiplier."""
    model = study.run_config(arm, study.settings.seeds[0]).model
    twin = param_matched_vanilla(model)
    return Arm(DENSE, lr_mult=arm.lr_mult, depth=twin.layers, budget=arm.budget, width=twin.width,
               control=f"{PARAM_MATCHED}L{model.layers} {arm.recursion_text}")


def study_arms(study: StudySpec) -> list[Arm]:
    """Every arm a grid study runs: its declared arms, then its derived controls."""
    arms = dict.fromkeys(study.arms())
    for arm in control_arms(study):
        arms.setdefault(arm, None)
    return list(arms)
