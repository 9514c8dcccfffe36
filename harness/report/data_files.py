"""A report's saved data: everything it was computed from, beside it, so it can be re-rendered.

``modbench report`` reads a study's Optuna store, its MLflow runs and the trials' checkpoints.
None of those travel with a committed report, so the report saves what it read:

    trials.csv           every trial (Optuna), any state
    curves.csv           every validation curve (MLflow metric histories)
    data/runs.csv        the final metrics and git sha each COMPLETE trial's MLflow run holds
    data/store.json      the runs' environment tags, the Optuna study's pre-registration record, the
                         redacted storage URL, the commands that built the report, the heatmap's arm
    data/decode_costs.csv, data/routing_*.csv, data/routing_heatmap.npz
                         what ``modbench.report.measure`` measured on the checkpoints

``modbench report STUDY --from-data DIR`` loads them (``load``) and computes and renders the
report again without any store: the same numbers, and with the same modbench the same text
apart from the Environment and Reproduce sections. A report written before modbench saved its
data has only trials.csv, curves.csv and summary.json: its decode costs come from summary.json,
its environment from its report.md, and the routing analysis, which needs the checkpoints, is
said to be missing.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pandas as pd

from modbench.design.study_file import StudySpec
from modbench.errors import ModbenchError, redact
from modbench.report.collect import FINAL_METRICS, ReportData, label_done
from modbench.report.measure import Measurements, RoutingData
from modbench.track.optuna_store import SLOT_ATTR

DATA = "data"
STORE_JSON = "store.json"
FORMAT = 1
ENV_TAGS = ("device", "git_sha", "torch_version", "python_version", "dataset_sha256")  # what the Environment shows
REPORT_ATTRS = ("preregistered", "preregistration_amendments", "protocol_amendments", SLOT_ATTR)  # what a report reads
ROUTING_FRAMES = ("positions", "classes", "overlaps")
NOT_SAVED = ("The routing analysis needs the trials' checkpoints and is not in this report's saved data "
             "(the report predates saving it): rebuild the study to measure it.")


def save(dest: Path, data: ReportData, measured: Measurements, storage_text: str, command: str | None) -> None:
    """Write the data a re-render needs beside the report in ``dest`` (``storage_text``: the
    storage as the Environment prints it, already redacted and free of machine paths; ``command``:
    the Reproduce block's commands that built it)."""
    data.trials.to_csv(dest / "trials.csv", index=False)
    data.curves.to_csv(dest / "curves.csv", index=False)
    folder = dest / DATA
    folder.mkdir(exist_ok=True)
    runs = [c for c in (*FINAL_METRICS, "git_sha") if c in data.done]
    data.done[["number", *runs]].to_csv(folder / "runs.csv", index=False)
    measured.decode_costs.to_csv(folder / "decode_costs.csv", index=False)
    r = measured.routing
    for name in ROUTING_FRAMES:
        (folder / f"routing_{name}.csv").unlink(missing_ok=True)
    (folder / "routing_heatmap.npz").unlink(missing_ok=True)
    if r is not None:
        for name in ROUTING_FRAMES:
            getattr(r, name).to_csv(folder / f"routing_{name}.csv", index=False)
        if r.heatmap:
            np.savez_compressed(folder / "routing_heatmap.npz", *r.heatmap)
    store = {"format": FORMAT, "study": data.study.name, "storage": redact(storage_text), "command": command,
             "tags": {k: data.tags[k] for k in ENV_TAGS if k in data.tags},
             "attrs": {k: data.attrs[k] for k in REPORT_ATTRS if k in data.attrs},
             "routing": None if r is None else {"heatmap_arm": r.heatmap_arm, "heatmap_title": r.heatmap_title},
             "routing_missing": measured.routing_missing}
    (folder / STORE_JSON).write_text(json.dumps(store, indent=2, default=str))


def load(study: StudySpec, folder: Path) -> tuple[ReportData, Measurements]:
    """A report's data, read back from its folder (see the module docstring)."""
    if not (folder / "trials.csv").is_file():
        raise ModbenchError(f"--from-data {folder}: no trials.csv there; expected the folder of a report that "
                            "`modbench report` wrote (reports/<study>)")
    trials = pd.read_csv(folder / "trials.csv")
    done = label_done(study, trials)
    runs_csv = folder / DATA / "runs.csv"
    if runs_csv.is_file() and len(done):
        runs = pd.read_csv(runs_csv).set_index("number")
        for column in runs.columns:
            done[column] = done["number"].map(runs[column])
    curves_csv = folder / "curves.csv"
    curves = pd.read_csv(curves_csv) if curves_csv.is_file() and curves_csv.stat().st_size else pd.DataFrame(
        columns=["arm", "variant", "capacity", "seed", "step", "flops", "tokens", "val/bpb"])
    store_json = folder / DATA / STORE_JSON
    store = json.loads(store_json.read_text()) if store_json.is_file() else _legacy_store(folder)
    data = ReportData(study, store.get("storage", "n/a"), trials, done, curves, store.get("tags", {}), None,
                      store.get("attrs", {}))
    return data, _measurements(folder, store)


def built_by(folder: Path) -> str | None:
    """The commands that built the report saved in ``folder`` (its Reproduce block), if recorded."""
    store_json = folder / DATA / STORE_JSON
    return json.loads(store_json.read_text()).get("command") if store_json.is_file() else None


def _measurements(folder: Path, store: dict) -> Measurements:
    costs_csv = folder / DATA / "decode_costs.csv"
    if costs_csv.is_file():
        costs = pd.read_csv(costs_csv) if costs_csv.stat().st_size > 1 else pd.DataFrame()
    else:
        summary = folder / "summary.json"
        costs = pd.DataFrame(json.loads(summary.read_text()).get("decode_costs", [])) if summary.is_file() else pd.DataFrame()
    routing = store.get("routing")
    if routing is None or not (folder / DATA / "routing_positions.csv").is_file():
        return Measurements(costs, None, store.get("routing_missing", NOT_SAVED))
    frames = {name: pd.read_csv(folder / DATA / f"routing_{name}.csv") for name in ROUTING_FRAMES}
    heatmap_npz = folder / DATA / "routing_heatmap.npz"
    heatmap = []
    if heatmap_npz.is_file():
        with np.load(heatmap_npz) as f:
            heatmap = [f[f"arr_{i}"] for i in range(len(f.files))]
    return Measurements(costs, RoutingData(frames["positions"], frames["classes"], frames["overlaps"], heatmap,
                                           routing["heatmap_arm"], routing["heatmap_title"]))


ENV_ROWS = {"device": "device", "git sha (trials)": "git_sha", "torch (trials)": "torch_version",
            "python (trials)": "python_version", "dataset sha256": "dataset_sha256", "Optuna storage": "storage"}


def _legacy_store(folder: Path) -> dict:
    """The environment of a report written before modbench saved its data: read from the
    Environment table of its report.md (the only record of it that travelled)."""
    report = folder / "report.md"
    rows = {}
    if report.is_file():
        for key, value in re.findall(r"^\| ([^|]+?)\s+\| (.+?)\s+\|$", report.read_text(), flags=re.M):
            if key in ENV_ROWS:
                rows[ENV_ROWS[key]] = value
    storage = rows.pop("storage", "n/a")
    sha = rows.get("git_sha", "")
    rows["git_sha"] = sha.split(" ")[0] if sha else "n/a"
    return {"storage": storage, "tags": rows, "attrs": {}, "routing": None, "routing_missing": NOT_SAVED}
