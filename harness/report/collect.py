"""Everything a report needs, pulled into pandas: trials from Optuna, curves and tags from MLflow.

One row per finished (arm, seed) trial. An *arm label* names the settings that vary in the
study; a *group* is what must be equal for a fair comparison (depth, budget, LR multiplier):
each routed arm is compared with the dense arm of its group.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from modbench.design.arm import ARM_KEYS, Arm
from modbench.design.study_file import StudySpec
from modbench.track.optuna_store import connect_storage, default_storage, trials_frame
from modbench.design.vocabulary import DENSE

GROUP_KEYS = ("depth", "width", "budget", "lr_mult")
FINAL_METRICS = (
    "val/causal_bpb", "val/dense_bpb", "val/causal_gap", "val/dense_gap", "val/causal_agreement",
    "val/causal_fraction", "val/topk_leak_rate", "val/hard_precision", "val/hard_recall", "val/hard_base_rate",
    "perf/logging_overhead", "val/causal_precision", "val/causal_recall", "val/causal_chance_agreement",
    "test/causal_bpb", "test/causal_fraction", "test/dense_bpb",
)


@dataclass
class ReportData:
    study: StudySpec
    storage: str
    trials: pd.DataFrame  # every trial, any state
    done: pd.DataFrame  # COMPLETE trials with arm/group labels and final metrics
    curves: pd.DataFrame  # arm, variant, capacity, seed, step, flops, tokens, val/bpb
    tags: dict[str, str] = field(default_factory=dict)
    uri: str | None = None  # the MLflow tracking URI the runs were read from
    attrs: dict = field(default_factory=dict)  # the Optuna study's user attributes (stages, pre-registration, …)


def missing(x) -> bool:
    """A cell the trial did not store (None, NaN): the axis takes its default."""
    return x is None or (isinstance(x, float) and math.isnan(x))


def row_arm(row: pd.Series) -> Arm:
    """The study arm a trial (a row of the trials frame) ran."""
    return Arm.from_params({k: row[k] for k in ARM_KEYS if k in row and not missing(row[k])})


def collect(study: StudySpec, *, uri: str, storage: str | None = None, out_dir: str | Path = "runs/studies",
            progress: bool = False) -> ReportData:
    url = storage or default_storage(study, out_dir)
    trials = trials_frame(study.name, url)
    if len(trials):
        trials = trials.merge(trial_times(study.name, url), on="number", how="left")
    done = label_done(study, trials)
    curves, tags = _from_mlflow(done, study.name, uri, progress)
    return ReportData(study, url, trials, done, curves, tags, uri, study_attrs(study.name, url))


def label_done(study: StudySpec, trials: pd.DataFrame) -> pd.DataFrame:
    """The COMPLETE trials, each with every arm key (a dense arm's routing keys fixed), its arm
    label and its comparison group."""
    done = trials[trials.state == "COMPLETE"].copy() if len(trials) else trials.copy()
    for key in ARM_KEYS:
        if key not in done:
            done[key] = None
    done.loc[done.variant == DENSE, ["capacity", "pattern", "schedule"]] = [1.0, "-", "constant"]
    done["capacity"] = done["capacity"].astype(float)
    done["lr_mult"] = done["lr_mult"].astype(float)
    varying = {k for k in ARM_KEYS if done[k].astype(str).nunique() > 1}
    # The study's own label of each arm: the names of its MLflow runs and trials.
    done["arm"] = [study.label(row_arm(r)) for _, r in done.iterrows()] if len(done) else pd.Series(dtype=str)
    done["group"] = done.apply(lambda r: " ".join(f"{k}={r[k]}" for k in GROUP_KEYS if k in varying) or "all", axis=1) if len(done) else pd.Series(dtype=str)
    return done


def study_attrs(name: str, storage: str) -> dict:
    """The Optuna study's user attributes (what the runner recorded: stages, pre-registration)."""
    import optuna

    rdb = connect_storage(storage)
    try:
        return dict(optuna.load_study(study_name=name, storage=rdb).user_attrs)
    finally:
        rdb.engine.dispose()


def trial_times(name: str, storage: str) -> pd.DataFrame:
    """When each trial started and finished (Optuna's own timestamps): the study's compute in
    trial-hours and its wall time come from these."""
    import optuna

    rdb = connect_storage(storage)
    try:
        trials = optuna.load_study(study_name=name, storage=rdb).get_trials(deepcopy=False)
        return pd.DataFrame([{"number": t.number, "started": t.datetime_start, "finished": t.datetime_complete}
                             for t in trials], columns=["number", "started", "finished"])
    finally:
        rdb.engine.dispose()


def _from_mlflow(done: pd.DataFrame, experiment: str, uri: str, progress: bool = False) -> tuple[pd.DataFrame, dict[str, str]]:
    from mlflow.tracking import MlflowClient
    from tqdm.auto import tqdm

    client = MlflowClient(uri)
    rows, tags = [], {}
    for idx, trial in tqdm(done.iterrows(), total=len(done), desc="reading MLflow runs", unit="run", disable=not progress):
        run_id = trial.get("mlflow_run_id")
        if not isinstance(run_id, str):
            continue
        run = client.get_run(run_id)
        if not tags:
            tags = {k: v for k, v in run.data.tags.items() if not k.startswith("mlflow.")}
        for name in FINAL_METRICS:
            if name in run.data.metrics:
                done.loc[idx, name] = run.data.metrics[name]
        done.loc[idx, "git_sha"] = run.data.tags.get("git_sha")  # per trial: a study can span commits
        fpt = run.data.metrics.get("perf/flops_per_token")
        tokens_per_step = float(run.data.params.get("budget.tokens_per_step", "nan"))
        for m in client.get_metric_history(run_id, "val/bpb"):
            rows.append({"arm": trial["arm"], "variant": trial["variant"], "capacity": trial["capacity"],
                         "seed": trial["seed"], "step": m.step, "val/bpb": m.value, "tokens": m.step * tokens_per_step,
                         "flops": m.step * tokens_per_step * (fpt or trial["perf/flops_per_token"])})
    columns = ["arm", "variant", "capacity", "seed", "step", "flops", "tokens", "val/bpb"]
    return pd.DataFrame(rows, columns=columns), tags
