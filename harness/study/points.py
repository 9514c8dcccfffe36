"""A study's points: which (arm, seed) a trial is, and what every trial of a study shares.

A grid point is stored as trial user attributes (``grid_attrs``): those say which arm a trial runs.
Queued params would fix the study's search space at creation, so an arm added to the study file
later could not be queued. Its arm is also written as Optuna params once the trial starts
(``record_grid_params``), for optuna-dashboard's slice, contour and importance pages, which read
params: distributions fixed per axis (``NUMERIC_PARAMS``) or at creation (``grid_params``), and a
value outside them left out, so no edit of the file can make a trial fail. Sampled studies (TPE,
NSGA-II) suggest their arms as params (``suggest_arm``).
A study file may add arms and seeds to a study; the settings every trial shares
(``fixed_settings``) may not change.
"""

from __future__ import annotations

from dataclasses import asdict, fields
from typing import Any

import optuna
from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

from modbench.config.run import RunConfig
from modbench.design.arm import DENSE_IGNORES, SAMPLED_KEYS, Arm, Range
from modbench.design.vocabulary import DENSE
from modbench.design.study_file import StudySpec
from modbench.errors import ModbenchError, redact
from modbench.design.controls import study_arms

FIXED_ATTR = "fixed_settings"  # what every trial shares (model, train, options, objectives)
PREREGISTERED_ATTR = "preregistered"  # the claims' decision settings, fixed before the first confirmation trial
AMENDMENTS_ATTR = "preregistration_amendments"  # changes made after that with --amend-claims (the report lists them)


def fixed_settings(study: StudySpec) -> dict[str, str]:
    """The settings every trial shares; a study file may add arms and seeds, never change these."""
    return {**{f"base.{k}": repr(v) for k, v in study.base.to_dict().items()
               if k not in ("train.seed", "train.out_dir", "train.run_name", "train.experiment", "train.track")},
            **{f"options.{v}.{k}": repr(x) for v, table in sorted(study.options.items()) for k, x in table.items()},
            "study.objectives": repr(list(study.settings.objectives)),
            # Only when set: a study created before [tune] existed records no such key.
            **({"study.tune": repr(study.tune)} if study.tune.lr_mult else {})}


def refuse_changed_fixed_settings(optuna_study: optuna.Study, s: StudySpec, storage_url: str) -> None:
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


def claim_settings(study: StudySpec) -> dict[str, dict[str, Any]]:
    """How each claim is decided (``[claims.<kind>]``): margins, primary contrasts, seed rules, the
    positive control; what a pre-registration fixes."""
    return {kind: asdict(settings) for kind, settings in sorted(study.claim_settings.items())}


def preregister(optuna_study: optuna.Study, s: StudySpec, commit: str, at: str) -> None:
    """Record the claims' settings, the commit and the time, once (before the first confirmation trial)."""
    if PREREGISTERED_ATTR not in optuna_study.user_attrs:
        optuna_study.set_user_attr(PREREGISTERED_ATTR, {"claims": claim_settings(s), "commit": commit, "at": at,
                                                        "study_file_sha256": s.file_sha256})


def check_preregistration(optuna_study: optuna.Study, s: StudySpec, *, amend: bool, commit: str, at: str) -> None:
    """A study file whose claim settings differ from the pre-registered ones is refused, unless
    ``amend`` (``--amend-claims``): then the change is recorded, and the report shows it."""
    record = optuna_study.user_attrs.get(PREREGISTERED_ATTR)
    if record is None:
        return
    amendments = optuna_study.user_attrs.get(AMENDMENTS_ATTR, [])
    current = amendments[-1]["claims"] if amendments else record["claims"]
    now = claim_settings(s)
    if now == current:
        return
    changed = sorted(k for k in set(now) | set(current) if now.get(k) != current.get(k))
    if not amend:
        raise ModbenchError(
            f"{s.path} changes the claim settings of study {s.name!r} ({', '.join(f'[claims.{k}]' for k in changed)}), "
            f"which were pre-registered at commit {record['commit'][:12]} before its first confirmation trial: "
            "restore them, or pass --amend-claims to change them on the record (the report lists every amendment)")
    optuna_study.set_user_attr(AMENDMENTS_ATTR, [*amendments, {"claims": now, "changed": changed, "commit": commit,
                                                               "at": at}])


def queue_new_grid_points(optuna_study: optuna.Study, s: StudySpec) -> None:
    """Arms or seeds added to the study file since the study was created are queued now."""
    # Keyed by the arm's params, not its label: a label names what usually varies, and two arms
    # of an isoFLOP grid (other depth or budget) can share one.
    have = {(_key(t.user_attrs.get("arm_params")), t.user_attrs.get("seed")) for t in optuna_study.get_trials(deepcopy=False)
            if not t.user_attrs.get("surplus") and not t.user_attrs.get("requeued")}
    arms = study_arms(s)
    for seed in s.settings.seeds:  # seed-major, as at creation
        for arm in arms:
            if (_key(arm.params()), seed) not in have:
                optuna_study.enqueue_trial({}, user_attrs=grid_attrs(arm, seed, s.label(arm)))


def _key(params: dict[str, Any] | None) -> tuple:
    return tuple(sorted((k, str(v)) for k, v in (params or {}).items()))


def grid_attrs(arm: Arm, seed: int, label: str, stage: str = "") -> dict[str, Any]:
    """A grid point as trial user attributes. A grid samples nothing, so its arm is not an Optuna
    param: params would fix the study's search space at creation, and an arm added to the study
    file later could not be queued (Optuna refuses new categorical choices). ``stage``: the
    tuning stage that queued it (``modbench.study.tuning``), for studies with [tune]."""
    return {"seed": seed, "arm": label, "arm_params": arm.params(), **({"stage": stage} if stage else {})}


GRID_PARAMS_ATTR = "grid_params"  # study user attr: the axes a grid study's trials carry as params (``grid_params``)
# A numeric axis's distribution as a grid trial's param: one range per axis whatever the study, so that every
# trial of a study, arms added to the file later included, has the same distribution (Optuna refuses another).
NUMERIC_PARAMS = {"capacity": FloatDistribution(0.0, 1.0), "capacity_first": FloatDistribution(0.0, 1.0),
                  "lr_mult": FloatDistribution(2.0**-12, 2.0**12, log=True), "depth": IntDistribution(1, 1024),
                  "width": IntDistribution(0, 1 << 20), "recursions": IntDistribution(1, 1024),
                  "mlp_ratio": IntDistribution(0, 1024)}


def grid_params(study: StudySpec) -> dict[str, list[str] | None]:
    """The axes a grid study's trials carry as Optuna params: those whose stored value differs between
    its arms (a constant draws blank slice and contour plots), and ``lr_mult`` under [tune] (the stages
    vary it). A string axis maps to its choices, fixed here, at the study's creation (a categorical
    distribution cannot grow); a numeric one to None (its ``NUMERIC_PARAMS`` range)."""
    stored = [arm.params() for arm in study_arms(study)]
    axes: dict[str, list[str] | None] = {}
    for name in (f.name for f in fields(Arm)):
        values = {repr(p[name]) for p in stored if name in p}  # among the arms that store it (dense stores no capacity)
        if len(values) < 2 and not (name == "lr_mult" and study.tune.lr_mult):
            continue
        if name in NUMERIC_PARAMS:
            axes[name] = None
        else:
            axes[name] = sorted({str(p[name]) for p in stored if name in p})
    return axes


def record_grid_params(trial: optuna.Trial, arm: Arm, axes: dict[str, list[str] | None]) -> None:
    """The grid trial's arm as Optuna params, for display (the arm it runs is its user attributes): each
    axis of ``axes`` that the arm stores, written to the storage directly (the value is the grid's, no
    sampler's). A value outside its distribution (an arm the file gained after the study's creation)
    is left out, as is anything Optuna refuses."""
    stored = arm.params()
    for name, choices in axes.items():
        if name not in stored:
            continue  # an axis this arm ignores (dense has no capacity): a conditional parameter
        value = stored[name] if choices is None else str(stored[name])
        if choices is None:
            dist = NUMERIC_PARAMS[name]
            if not dist.low <= value <= dist.high:
                continue
        elif value in choices:
            dist = CategoricalDistribution(choices)
        else:
            continue
        try:
            trial.storage.set_trial_param(trial._trial_id, name, dist.to_internal_repr(value), dist)
        except ValueError:  # a distribution an older modbench recorded differently: display only, so skip it
            continue


def point_attrs(user_attrs: dict[str, Any]) -> dict[str, Any]:
    """The attributes that say which (arm, seed) a trial is, to queue the same point again."""
    return {k: user_attrs[k] for k in ("seed", "arm", "arm_params", "stage") if k in user_attrs}


def arm_of(trial: optuna.Trial, study: StudySpec) -> Arm:
    """The trial's arm: from its grid attributes, else suggested by the sampler."""
    fixed = trial.user_attrs.get("arm_params")
    if fixed is None:
        return suggest_arm(trial, study)
    return Arm.from_params(fixed)


def suggest_arm(trial: optuna.Trial, study: StudySpec) -> Arm:
    space = study.space

    def pick(name: str):
        choices = space[name]
        if isinstance(choices, Range):
            return trial.suggest_float(name, choices.low, choices.high, log=choices.log)
        if len(choices) == 1:  # a constant: a user attribute, not a one-value parameter (blank Slice/Contour plots)
            trial.set_user_attr(f"fixed.{name}", choices[0])
            return choices[0]
        return trial.suggest_categorical(name, choices)

    axes: dict[str, Any] = {}
    for name in SAMPLED_KEYS:  # in declared order (the sampler sees the same parameters in the same order)
        if not (axes.get("variant") == DENSE and name in DENSE_IGNORES):  # a conditional space: dense has none
            axes[name] = pick(name)
    # A sampled space has one recursion (the [model]'s: modbench.design.study_file refuses more)
    return Arm(**axes, recursion=space["recursion"][0], recursions=space["recursions"][0])
