"""Everything a report needs, pulled into pandas: trials from Optuna, curves and tags from MLflow.

One row per finished (arm, seed) trial. An *arm label* names the settings that vary in the
study; a *group* is what must be equal for a fair comparison (depth, budget, LR multiplier):
each routed arm is compared with the dense arm of its group.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from modbench.track.optuna_store import default_storage, trials_frame
from modbench.config.study import Study

ARM_KEYS = ("variant", "capacity", "pattern", "schedule", "lr_mult", "depth", "budget", "width", "control")
GROUP_KEYS = ("depth", "budget", "lr_mult")
FINAL_METRICS = (
    "val/causal_bpb", "val/dense_bpb", "val/causal_gap", "val/dense_gap", "val/causal_agreement",
    "val/causal_fraction", "val/topk_leak_rate", "val/hard_precision", "val/hard_recall", "val/hard_base_rate",
    "perf/logging_overhead", "val/causal_precision", "val/causal_recall", "val/causal_chance_agreement",
    "test/causal_bpb", "test/causal_fraction", "test/dense_bpb",
)


@dataclass
class ReportData:
    study: Study
    storage: str
    trials: pd.DataFrame  # every trial, any state
    done: pd.DataFrame  # COMPLETE trials with arm/group labels and final metrics
    curves: pd.DataFrame  # arm, seed, step, flops, val/bpb
    tags: dict[str, str] = field(default_factory=dict)


def _label(row: pd.Series, varying: set[str]) -> str:
    parts = [row["variant"]]
    if row["variant"] != "dense":
        parts.append(f"C={row['capacity']:g}")
        if "pattern" in varying:
            parts.append(row["pattern"])
        if row.get("schedule") == "log":
            parts.append("log")
    if row.get("width") and not pd.isna(row["width"]) and int(row["width"]):
        parts.append(f"L{int(row['depth'])} d{int(row['width'])}")
    elif "depth" in varying:
        parts.append(f"depth={int(row['depth'])}")
    if isinstance(row.get("control"), str) and row["control"]:
        parts.append(f"({row['control']})")
    elif "budget" in varying:
        parts.append(row["budget"])
    if "lr_mult" in varying:
        parts.append(f"lr×{row['lr_mult']:g}")
    return " ".join(parts)


def collect(study: Study, *, uri: str, storage: str | None = None, out_dir: str | Path = "runs/studies",
            progress: bool = False) -> ReportData:
    url = storage or default_storage(study, out_dir)
    trials = trials_frame(study.name, url)
    done = trials[trials.state == "COMPLETE"].copy()
    for key in ARM_KEYS:
        if key not in done:
            done[key] = None
    done.loc[done.variant == "dense", ["capacity", "pattern", "schedule"]] = [1.0, "-", "constant"]
    done["capacity"] = done["capacity"].astype(float)
    done["lr_mult"] = done["lr_mult"].astype(float)
    varying = {k for k in ARM_KEYS if done[k].astype(str).nunique() > 1}
    done["arm"] = done.apply(_label, axis=1, varying=varying) if len(done) else pd.Series(dtype=str)
    done["group"] = done.apply(lambda r: " ".join(f"{k}={r[k]}" for k in GROUP_KEYS if k in varying) or "all", axis=1) if len(done) else pd.Series(dtype=str)
    curves, tags = _from_mlflow(done, study.name, uri, progress)
    return ReportData(study, url, trials, done, curves, tags)


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
        fpt = run.data.metrics.get("perf/flops_per_token")
        tokens_per_step = float(run.data.params.get("budget.tokens_per_step", "nan"))
        for m in client.get_metric_history(run_id, "val/bpb"):
            rows.append({"arm": trial["arm"], "seed": trial["seed"], "step": m.step, "val/bpb": m.value,
                         "flops": m.step * tokens_per_step * (fpt or trial["perf/flops_per_token"])})
    return pd.DataFrame(rows, columns=["arm", "seed", "step", "flops", "val/bpb"]), tags
