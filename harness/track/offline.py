"""Runs logged to plain files, and imported into an MLflow store later.

A lent GPU machine has no MLflow (and no network to reach a tracking server), so a study there
logs each run with :class:`OfflineTracker` to files; a machine with MLflow then replays them into
a real store with :func:`import_offline_runs`. The format is hand-written rather than MLflow's own
file store: MLflow is absent where the files are written, MLflow 3 deprecates its file store, and
the format only has to hold what the import needs. One folder per run, under a root::

    <root>/<run_id>/run.json        experiment, experiment_description, run_name, run_id,
                                    parent_run_id, tags, params, status, start_time and
                                    end_time (ms since the epoch), inputs (datasets)
    <root>/<run_id>/metrics.jsonl   one point a line: {"key", "value", "timestamp" (ms), "step"}
    <root>/<run_id>/artifacts/...   artifact files at their artifact paths

``run_id`` is ``uuid.uuid4().hex``. ``run.json`` is replaced atomically whenever it changes and
each :meth:`OfflineTracker.log_metrics` call appends and flushes its lines, so a worker killed at
any moment leaves a readable run with everything it had logged. NaN and infinities are written as
JSON's ``NaN``/``Infinity``/``-Infinity`` (Python's ``json`` reads them back).

MLflow is imported only inside :func:`import_offline_runs`, never by the tracker.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
import uuid
from pathlib import Path, PurePosixPath

from modbench.errors import ModbenchError, accepted, redact
from modbench.track.provenance import environment_tags
from modbench.track.store import connect, store_problem
from modbench.track.tracking import (
    MAX_METRICS_PER_BATCH,
    MAX_PARAMS_PER_BATCH,
    MAX_TAGS_PER_BATCH,
    PARENT_RUN_TAG,
    STATUSES,
    TimedRun,
    write_dict,
    _chunks,
    _get_or_create_experiment,
    _param_value,
    to_float,
)

RUN_FILE = "run.json"
METRICS_FILE = "metrics.jsonl"
ARTIFACTS_DIR = "artifacts"
OFFLINE_RUN_TAG = "modbench.offline_run_id"  # on an imported run: which offline run it came from
# Set instead of mlflow.parentRunId when the parent was never imported: a parent link to a run
# that does not exist would hide the child in the MLflow UI.
OFFLINE_PARENT_TAG = "modbench.offline_parent_run_id"


def _now_ms() -> int:
    return int(time.time() * 1000)


def _write_json_atomically(path: Path, obj: dict) -> None:
    """A reader (or a worker killed mid-write) sees the old file or the new one, never half."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(obj, f, indent=2)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _artifact_target(artifacts: Path, artifact_path: str | None) -> Path:
    """``artifacts/<artifact_path>``; a path that would leave the run's folder is refused."""
    if not artifact_path:
        return artifacts
    rel = PurePosixPath(artifact_path.replace("\\", "/"))
    if rel.is_absolute() or ".." in rel.parts:
        raise ValueError(f"artifact path must be relative and stay inside the run, got {artifact_path!r}")
    return artifacts.joinpath(*rel.parts)


# --------------------------------------------------------------------------- the tracker


class OfflineTracker(TimedRun):
    """One run written to ``<root>/<run_id>/``: a :class:`~modbench.track.tracking.RunTracker`
    that needs no MLflow. It tags, redacts and truncates like :class:`~modbench.track.tracking.Tracker`
    so that an imported run reads as if it had been logged online; pass ``run_id`` to resume a run
    under ``root`` (its status goes back to RUNNING)."""

    def __init__(
        self,
        experiment: str,
        *,
        root: str | Path,
        run_name: str | None = None,
        parent_run_id: str | None = None,
        tags: dict[str, str] | None = None,
        run_id: str | None = None,
        experiment_description: str | None = None,
    ) -> None:
        self.experiment = experiment
        self.experiment_description = experiment_description
        self.root = Path(root)
        self.run_name = run_name
        self.parent_run_id = parent_run_id
        self.extra_tags = {str(k): str(v) for k, v in (tags or {}).items()}
        self._record: dict = {}
        self._metrics = None  # the open metrics.jsonl, appended to
        self._init_bookkeeping(run_id)

    KIND = "offline run"

    # ------------------------------------------------------------------ bookkeeping

    @property
    def run_id(self) -> str:
        if self._run_id is None or not self._started:
            raise RuntimeError("OfflineTracker.start() has not been called")
        return self._run_id

    @property
    def run_dir(self) -> Path:
        """``<root>/<run_id>`` (after :meth:`start`)."""
        return self.root / self.run_id

    def _save(self) -> None:
        _write_json_atomically(self.root / self._run_id / RUN_FILE, self._record)

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> "OfflineTracker":
        """Create (or resume) the run's folder."""
        if self._started:
            return self
        with self._timed():
            tags = {**environment_tags(), **self.extra_tags}
            if tags["git_sha"] != "unknown":  # shown by the MLflow UI, as Tracker sets it
                tags["mlflow.source.git.commit"] = tags["git_sha"].removesuffix("-dirty")
            if self._run_id is not None:
                self._resume(tags)
            else:
                self._create(tags)
            self._save()
            self._metrics = open(self.root / self._run_id / METRICS_FILE, "a", encoding="utf-8")
        self._started = True
        return self

    def _create(self, tags: dict[str, str]) -> None:
        self._run_id = uuid.uuid4().hex
        if self.parent_run_id:
            tags[PARENT_RUN_TAG] = self.parent_run_id
        (self.root / self._run_id / ARTIFACTS_DIR).mkdir(parents=True)
        self._record = {
            "experiment": self.experiment,
            "experiment_description": self.experiment_description,
            "run_name": self.run_name,
            "run_id": self._run_id,
            "parent_run_id": self.parent_run_id,
            "tags": tags,
            "params": {},
            "status": "RUNNING",
            "start_time": _now_ms(),
            "end_time": None,
            "inputs": [],
        }

    def _resume(self, tags: dict[str, str]) -> None:
        path = self.root / self._run_id / RUN_FILE
        try:
            record = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            raise ModbenchError(f"cannot resume offline run {self._run_id!r}: no such run under {self.root}") from None
        if record.get("experiment") != self.experiment:
            raise ModbenchError(f"cannot resume offline run {self._run_id!r}: it belongs to experiment "
                                f"{record.get('experiment')!r}, not {self.experiment!r}")
        record["tags"].update(tags)
        record.update(status="RUNNING", end_time=None)
        (self.root / self._run_id / ARTIFACTS_DIR).mkdir(exist_ok=True)
        self._record = record

    def end(self, status: str = "FINISHED") -> None:
        """End the run with ``status`` (a no-op before :meth:`start` or after the first end)."""
        if status not in STATUSES:
            raise ValueError(f"status must be {accepted(STATUSES)}, got {status!r}")
        if not self._started or self._ended:
            return
        with self._timed():
            self._ended = True
            self._metrics.close()
            self._record.update(status=status, end_time=_now_ms())
            self._save()

    # ------------------------------------------------------------------ logging

    def log_params(self, params: dict[str, object]) -> None:
        """Record params; one that already has another value is refused, as MLflow refuses it."""
        if not params:
            return
        self._require_started()
        with self._timed():
            new = {str(k): redact(_param_value(v)) for k, v in params.items()}  # never a password
            old = self._record["params"]
            changed = [f"{k}: {old[k]!r} -> {v!r}" for k, v in new.items() if k in old and old[k] != v]
            if changed:
                raise ModbenchError(
                    f"offline run {self._run_id} already has different values for some of these params "
                    f"(params cannot change, e.g. on --resume with another config): {'; '.join(changed)}"
                )
            old.update(new)
            self._save()

    def set_tags(self, tags: dict[str, str]) -> None:
        if not tags:
            return
        self._require_started()
        with self._timed():
            self._record["tags"].update({str(k): redact(v) for k, v in tags.items()})
            self._save()

    def log_dataset(self, name: str, digest: str, source: str, context: str) -> None:
        """Record the dataset as a run input, in the fields MLflow's ``Dataset`` takes (built as
        :meth:`Tracker.log_dataset <modbench.track.tracking.Tracker.log_dataset>` builds them)."""
        self._require_started()
        with self._timed():
            kind = "http" if source.startswith(("http://", "https://")) else "code"
            payload = json.dumps({"url": source} if kind == "http" else {"tags": {"origin": source}})
            self._record["inputs"].append({"name": name[:500], "digest": digest[:36], "source_type": kind,
                                           "source": redact(payload), "context": context})
            self._save()

    def monitor_system(self, interval_s: float) -> None:
        """Does nothing: the system-metrics monitor is MLflow's own (absent here), and samples
        logged for later import would only say how busy the machine was, which the lent machine's
        own limits already bound."""
        self._require_started()

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        """Append ``metrics`` at ``step`` and flush them to the file; None values are dropped,
        tensors and numpy scalars become floats, NaN/inf are kept (a diverging run stays visible)."""
        self._require_started()
        with self._timed():
            timestamp, step = _now_ms(), int(step)
            lines = [json.dumps({"key": str(k), "value": to_float(v), "timestamp": timestamp, "step": step}) + "\n"
                     for k, v in metrics.items() if v is not None]
            self._metrics.write("".join(lines))
            self._metrics.flush()  # a killed worker keeps every point logged so far

    def flush(self) -> None:
        """Nothing is buffered: every call has already reached the file."""

    def log_dict(self, obj: dict, artifact_file: str) -> None:
        """Write ``obj`` as JSON, or YAML when ``artifact_file`` ends in .yaml/.yml;
        values JSON cannot encode (paths, dtypes, ...) are written as strings."""
        self._require_started()
        with self._timed():
            write_dict(obj, self._artifact_file(artifact_file))

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        """Copy a file, or every file under a directory, to ``artifacts/[artifact_path]``."""
        self._require_started()
        path = Path(path)
        if not path.exists():
            raise FileNotFoundError(f"artifact to log does not exist: {path}")
        with self._timed():
            target = _artifact_target(self.run_dir / ARTIFACTS_DIR, artifact_path)
            if path.is_dir():  # its contents go under artifact_path, as MlflowClient.log_artifacts does
                shutil.copytree(path, target, dirs_exist_ok=True)
            else:
                target.mkdir(parents=True, exist_ok=True)
                shutil.copy2(path, target / path.name)

    def log_figure(self, fig, artifact_file: str) -> None:
        """Save a matplotlib figure (in the format its extension names)."""
        self._require_started()
        with self._timed():
            fig.savefig(self._artifact_file(artifact_file))

    def _artifact_file(self, artifact_file: str) -> Path:
        path = _artifact_target(self.run_dir / ARTIFACTS_DIR, artifact_file)
        path.parent.mkdir(parents=True, exist_ok=True)
        return path


# --------------------------------------------------------------------------- reading the files


def fail_offline_runs(root: str | Path, run_ids: list[str], tags: dict[str, str] | None = None) -> int:
    """Mark those of ``run_ids`` under ``root`` that are still RUNNING as FAILED (workers that
    died without ending their run), with ``tags`` set on them; returns how many changed."""
    changed = 0
    for run_id in run_ids:
        path = Path(root) / run_id / RUN_FILE
        try:
            record = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue  # no such run (or never written): nothing to fail
        if record.get("status") == "RUNNING":
            record.update(status="FAILED", end_time=_now_ms())
            record.setdefault("tags", {}).update({str(k): redact(v) for k, v in (tags or {}).items()})
            _write_json_atomically(path, record)
            changed += 1
    return changed


def read_offline_runs(root: str | Path) -> list[dict]:
    """Every ``run.json`` under ``root``, each parent before its children, then by start time."""
    runs = []
    for path in sorted(Path(root).glob(f"*/{RUN_FILE}")):
        try:
            runs.append(json.loads(path.read_text(encoding="utf-8")))
        except ValueError as e:
            raise ModbenchError(f"offline run file {path} is not valid JSON ({e}); move it away and import again") from None
    by_id = {r["run_id"]: r for r in runs}

    def depth(run: dict) -> int:
        seen = {run["run_id"]}
        n = 0
        while (parent := run.get("parent_run_id")) in by_id and parent not in seen:
            seen.add(parent)
            run, n = by_id[parent], n + 1
        return n

    return sorted(runs, key=lambda r: (depth(r), r.get("start_time") or 0, r["run_id"]))


def read_offline_metrics(run_dir: str | Path) -> list[dict]:
    """The points of ``<run_dir>/metrics.jsonl`` in the order they were logged; a last line cut
    off by a killed worker is skipped."""
    path = Path(run_dir) / METRICS_FILE
    if not path.exists():
        return []
    points = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            points.append(json.loads(line))
        except ValueError:
            continue
    return points


# --------------------------------------------------------------------------- the import


def import_offline_runs(
    root: str | Path, *, uri: str, experiment: str | None = None, progress: bool = False
) -> dict[str, str]:
    """Import every offline run under ``root`` into the MLflow store at ``uri`` (into its own
    experiment, or ``experiment`` when given); returns {offline run id: MLflow run id}.

    Idempotent: a run already imported (a finished run in that experiment has its
    ``modbench.offline_run_id`` tag) is not imported again. An import cut off half-way leaves
    that run RUNNING; the next import deletes it and imports the run again. A run still RUNNING
    offline is imported KILLED and later imports leave it so."""
    from mlflow.exceptions import MlflowException

    runs = read_offline_runs(root)
    client = connect(uri)
    importer = _Importer(client, uri, Path(root), experiment)
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(runs), desc="importing runs", unit="run")
    try:
        for run in runs:
            try:
                importer.import_run(run)
            except (MlflowException, OSError) as e:  # OSError: the artifact folder refused a copy
                raise ModbenchError(f"the MLflow store {redact(uri)} refused the import of offline run "
                                    f"{run['run_id']} ({store_problem(e)}): check that it is writable and has "
                                    "space, or pass another --tracking-uri") from None
            if bar is not None:
                bar.update(1)
    finally:
        if bar is not None:
            bar.close()
    return importer.mapping


class _Importer:
    """One import: the experiments it opened and which offline runs each already holds."""

    def __init__(self, client, uri: str, root: Path, experiment: str | None) -> None:
        self.client, self.uri, self.root, self.experiment = client, uri, root, experiment
        self.mapping: dict[str, str] = {}  # offline run id -> MLflow run id, of this call
        self._known: dict[str, str] = {}  # ... of every run imported into the experiments seen
        self._experiments: dict[str, str] = {}  # name -> id

    def import_run(self, run: dict) -> None:
        offline_id = run["run_id"]
        exp_id = self._experiment_id(run)
        if offline_id in self._known:
            self.mapping[offline_id] = self._known[offline_id]
            return
        points = read_offline_metrics(self.root / offline_id)
        mlflow_id = self._create(run, exp_id)
        self._log_data(run, points, mlflow_id)
        # A run that never ended offline ends at its last sign of life: the time of the import
        # would make a dead run look long-lived.
        end_time = run.get("end_time") or max([run.get("start_time") or 0, *(p["timestamp"] for p in points)])
        status = run["status"] if run.get("status") in STATUSES else "KILLED"
        # The last write: a run terminated in the store is a complete import.
        self.client.set_terminated(mlflow_id, status=status, end_time=end_time)
        self.mapping[offline_id] = self._known[offline_id] = mlflow_id

    def _experiment_id(self, run: dict) -> str:
        name = self.experiment or run["experiment"]
        if name not in self._experiments:
            exp_id = _get_or_create_experiment(self.client, name, self.uri, run.get("experiment_description"))
            self._experiments[name] = exp_id
            self._known.update(self._imported_runs(exp_id))
        return self._experiments[name]

    def _imported_runs(self, exp_id: str) -> dict[str, str]:
        """{offline id: MLflow id} of the runs of the experiment imported before; a run whose
        import was cut off (still RUNNING: every import ends its run) is deleted, to be redone."""
        from mlflow.entities import ViewType

        found, token = [], None
        while True:
            page = self.client.search_runs([exp_id], filter_string=f"tags.`{OFFLINE_RUN_TAG}` LIKE '%'",
                                           run_view_type=ViewType.ACTIVE_ONLY, max_results=1000, page_token=token)
            found.extend(page)
            token = page.token
            if not token:
                break
        known = {}
        for r in found:
            if r.info.status == "RUNNING":
                self.client.delete_run(r.info.run_id)
            else:
                known[r.data.tags[OFFLINE_RUN_TAG]] = r.info.run_id
        return known

    def _create(self, run: dict, exp_id: str) -> str:
        """The run with its start time, name and the tags that link it (the rest follow in batches)."""
        tags = {OFFLINE_RUN_TAG: run["run_id"]}
        parent = run.get("tags", {}).get(PARENT_RUN_TAG) or run.get("parent_run_id")
        if parent:
            if parent in self._known:
                tags[PARENT_RUN_TAG] = self._known[parent]
            else:
                tags[OFFLINE_PARENT_TAG] = parent
        created = self.client.create_run(exp_id, start_time=run.get("start_time"), tags=tags,
                                         run_name=run.get("run_name"))
        return created.info.run_id

    def _log_data(self, run: dict, points: list[dict], mlflow_id: str) -> None:
        from mlflow.entities import Metric, Param, RunTag

        tags = [RunTag(k, str(v)) for k, v in run.get("tags", {}).items() if k != PARENT_RUN_TAG]
        for chunk in _chunks(tags, MAX_TAGS_PER_BATCH):
            self.client.log_batch(mlflow_id, tags=chunk, synchronous=True)
        params = [Param(k, str(v)) for k, v in run.get("params", {}).items()]
        for chunk in _chunks(params, MAX_PARAMS_PER_BATCH):
            self.client.log_batch(mlflow_id, params=chunk, synchronous=True)
        # Every point as logged, in order: nothing merged or filled in (MLflow itself drops only a
        # point identical in key, value, timestamp and step to one it holds).
        metrics = [Metric(p["key"], float(p["value"]), int(p["timestamp"]), int(p["step"])) for p in points]
        for chunk in _chunks(metrics, MAX_METRICS_PER_BATCH):
            self.client.log_batch(mlflow_id, metrics=chunk, synchronous=True)
        self._log_inputs(run.get("inputs", []), mlflow_id)
        artifacts = self.root / run["run_id"] / ARTIFACTS_DIR
        if artifacts.is_dir() and any(artifacts.iterdir()):
            self.client.log_artifacts(mlflow_id, str(artifacts))

    def _log_inputs(self, inputs: list[dict], mlflow_id: str) -> None:
        if not inputs:
            return
        from mlflow.entities import Dataset, DatasetInput, InputTag

        self.client.log_inputs(mlflow_id, [
            DatasetInput(Dataset(name=d["name"], digest=d["digest"], source_type=d["source_type"], source=d["source"]),
                         [InputTag("mlflow.data.context", d["context"])])
            for d in inputs
        ])
