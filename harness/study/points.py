"""A study's points: which (arm, seed) a trial is, and what every trial of a study shares.

A grid point is stored as trial user attributes (``grid_attrs``), not as Optuna params: params
would fix the study's search space at creation, so an arm added to the study file later could
not be queued. Sampled studies (TPE, NSGA-II) suggest their arms as params (``suggest_arm``).
A study file may add arms and seeds to a study; the settings every trial shares
(``fixed_settings``) may not change.
"""

from __future__ import annotations

from typing import Any

import optuna

from modbench.config.run import RunConfig
from modbench.config.study import Arm, Range, Study, canonical_arm
from modbench.errors import ModbenchError, redact
from modbench.model.sizing import study_arms

FIXED_ATTR = "fixed_settings"  # what every trial shares (model, train, options, objectives)


def fixed_settings(study: Study) -> dict[str, str]:
    """The settings every trial shares; a study file may add arms and seeds, never change these."""
    return {**{f"base.{k}": repr(v) for k, v in study.base.to_dict().items()
               if k not in ("train.seed", "train.out_dir", "train.run_name", "train.experiment", "train.track")},
            **{f"options.{v}.{k}": repr(x) for v, table in sorted(study.options.items()) for k, x in table.items()},
            "study.objectives": repr(list(study.settings.objectives)),
            # Only when set: a study created before [tune] existed records no such key.
            **({"study.tune": repr(study.tune)} if study.tune.lr_mult else {})}


def refuse_changed_fixed_settings(optuna_study: optuna.Study, s: Study, storage_url: str) -> None:
    before = optuna_study.user_attrs.get(FIXED_ATTR)
    if before is None:
        return  # a study created before modbench recorded them
    now = fixed_settings(s)
    # A setting modbench added after the study was created is no change while it keeps its default.
    defaults = {f"base.{k}": repr(v) for k, v in RunConfig().to_dict().items()}
    changed = sorted(k for k in set(before) | set(now) if before.get(k) != now.get(k)
                     and not (k not in before and now.get(k) == defaults.get(k)))
    if changed:
        raise ModbenchError(
            f"{s.path} changes settings that study {s.name!r} in {redact(storage_url)} fixed when it was created "
            f"({', '.join(changed[:6])}{', …' if len(changed) > 6 else ''}): its trials would not be comparable; "
            f"give the study a new name (study.name) to start a new one, or restore those settings"
        )


def queue_new_grid_points(optuna_study: optuna.Study, s: Study) -> None:
    """Arms or seeds added to the study file since the study was created are queued now."""
    # Keyed by the arm's params, not its label: a label names what usually varies, and two arms
    # of an isoFLOP grid (other depth or budget) can share one.
    have = {(_key(t.user_attrs.get("arm_params")), t.user_attrs.get("seed")) for t in optuna_study.get_trials(deepcopy=False)
            if not t.user_attrs.get("surplus") and not t.user_attrs.get("requeued")}
    arms = study_arms(s)
    for seed in s.settings.seeds:  # seed-major, as at creation
        for arm in arms:
            if (_key(arm_params(arm)), seed) not in have:
                optuna_study.enqueue_trial({}, user_attrs=grid_attrs(arm, seed, s.label(arm)))


def _key(params: dict[str, Any] | None) -> tuple:
    return tuple(sorted((k, str(v)) for k, v in (params or {}).items()))


def arm_params(arm: Arm) -> dict[str, Any]:
    """Optuna params of an arm; dense has no capacity, pattern or schedule (conditional space)."""
    params = {"variant": arm.variant}
    if arm.variant != "dense":
        params.update(capacity=arm.capacity, pattern=arm.pattern, schedule=arm.schedule)
    params.update(lr_mult=arm.lr_mult, depth=arm.depth, budget=arm.budget)
    if arm.width:
        params["width"] = arm.width
    if arm.capacity_first:
        params["capacity_first"] = arm.capacity_first
    # Only when set, like width and capacity_first: a vanilla arm's params (its identity in a
    # study's storage) stay what they were before arms could be recursive.
    if arm.recursion != "none":
        params.update(recursion=arm.recursion, recursions=arm.recursions)
    if arm.capacities:
        params["capacities"] = arm.capacities
    if arm.control:
        params["control"] = arm.control
    return params


def grid_attrs(arm: Arm, seed: int, label: str, stage: str = "") -> dict[str, Any]:
    """A grid point as trial user attributes. A grid samples nothing, so its arm is not an Optuna
    param: params would fix the study's search space at creation, and an arm added to the study
    file later could not be queued (Optuna refuses new categorical choices). ``stage``: the
    tuning stage that queued it (``modbench.study.tuning``), for studies with [tune]."""
    return {"seed": seed, "arm": label, "arm_params": arm_params(arm), **({"stage": stage} if stage else {})}


def point_attrs(user_attrs: dict[str, Any]) -> dict[str, Any]:
    """The attributes that say which (arm, seed) a trial is, to queue the same point again."""
    return {k: user_attrs[k] for k in ("seed", "arm", "arm_params", "stage") if k in user_attrs}


def arm_of(trial: optuna.Trial, study: Study) -> Arm:
    """The trial's arm: from its grid attributes, else suggested by the sampler."""
    fixed = trial.user_attrs.get("arm_params")
    if fixed is None:
        return suggest_arm(trial, study)
    return arm_from_params(fixed)


def arm_from_params(fixed: dict[str, Any]) -> Arm:
    """The arm of ``arm_params`` (a grid point's attributes, or a row of the trials frame)."""
    dense = fixed["variant"] == "dense"
    return canonical_arm(fixed["variant"], 1.0 if dense else fixed["capacity"], "-" if dense else fixed["pattern"],
                         "constant" if dense else fixed["schedule"], fixed["lr_mult"], fixed["depth"], fixed["budget"],
                         fixed.get("width", 0), fixed.get("capacity_first", 0.0), fixed.get("control", ""),
                         fixed.get("recursion", "none"), fixed.get("recursions", 1), fixed.get("capacities", ""))


def suggest_arm(trial: optuna.Trial, study: Study) -> Arm:
    space = study.space

    def pick(name: str):
        choices = space[name]
        if isinstance(choices, Range):
            return trial.suggest_float(name, choices.low, choices.high, log=choices.log)
        if len(choices) == 1:  # a constant: a user attribute, not a one-value parameter (blank Slice/Contour plots)
            trial.set_user_attr(f"fixed.{name}", choices[0])
            return choices[0]
        return trial.suggest_categorical(name, choices)

    variant = pick("variant")
    capacity, pattern, schedule = (1.0, "-", "constant") if variant == "dense" else (pick("capacity"), pick("pattern"), pick("schedule"))
    # A sampled space has one recursion (the [model]'s: modbench.config.study refuses more)
    return canonical_arm(variant, capacity, pattern, schedule, pick("lr_mult"), pick("depth"), pick("budget"),
                         recursion=space["recursion"][0], recursions=space["recursions"][0])
