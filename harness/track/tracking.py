"""A thin, batched MLflow logger.

:class:`Tracker` wraps one MLflow run through an explicit ``MlflowClient`` (never the
global fluent API state), so several trackers and tracking URIs can coexist in one
process and nothing leaks between tests. Metrics are buffered and sent with
``MlflowClient.log_batch`` every ``flush_every`` calls; ``Tracker.seconds`` accumulates
the wall time spent inside the tracker so the caller can report logging overhead.
Experiments created here open in MLflow's model-training layout and, on a SQLite store, keep
their artifacts beside the database (:mod:`modbench.track.store`).

``mlflow`` is imported lazily (it takes seconds), so ``--no-track`` runs, which use
:class:`NullTracker`, never pay for it; ``modbench train`` pays for it in a separate process
(:mod:`modbench.track.background`).
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from modbench.errors import ModbenchError, accepted, redact
from modbench.track.provenance import environment_tags
from modbench.track.store import artifact_location, connect, first_line, store_problem

# MLflow's limits (mlflow/utils/validation.py); a log_batch call exceeding them is refused.
MAX_PARAMS_PER_BATCH = 100
MAX_TAGS_PER_BATCH = 100
MAX_METRICS_PER_BATCH = 1000
MAX_PARAM_VALUE_LENGTH = 6000

# Against a tracking server MLflow prints "🏃 View run … / 🧪 View experiment …" to stdout whenever a
# run ends: it would break `--json` (stdout is one JSON document) and litter every trial's output,
# and its links open the GenAI layout. modbench prints its own. Set at import, before any run or the
# tracker process (modbench.track.background, which inherits the environment) starts.
os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")

PARENT_RUN_TAG = "mlflow.parentRunId"
# What SQLite and PostgreSQL say when an insert hits a unique key another writer just used.
DUPLICATE_KEY = ("UNIQUE constraint failed", "duplicate key value violates unique constraint")
HEARTBEAT_TAG = "modbench.heartbeat"
STATUSES = ("FINISHED", "FAILED", "KILLED")

# --------------------------------------------------------------------------- the protocol


@runtime_checkable
class RunTracker(Protocol):
    """What a training run logs to: :class:`Tracker` (one MLflow run) or :class:`NullTracker`."""

    run_id: str | None
    seconds: float  # wall time spent inside the tracker (the logging overhead)

    def start(self) -> "RunTracker": ...
    def log_params(self, params: dict[str, object]) -> None: ...
    def set_tags(self, tags: dict[str, str]) -> None: ...
    def log_dataset(self, name: str, digest: str, source: str, context: str) -> None: ...
    def monitor_system(self, interval_s: float) -> None: ...
    def log_metrics(self, metrics: dict[str, float], step: int) -> None: ...
    def flush(self) -> None: ...
    def log_dict(self, obj: dict, artifact_file: str) -> None: ...
    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None: ...
    def log_figure(self, fig, artifact_file: str) -> None: ...
    def end(self, status: str = "FINISHED") -> None: ...
    def __enter__(self) -> "RunTracker": ...
    def __exit__(self, exc_type, exc, tb) -> bool: ...


# MLflow 3's UI opens an experiment in its GenAI layout (traces, judges) unless told it is model
# training; the note is the experiment's description in the UI.
EXPERIMENT_KIND_TAG, TRAINING_KIND = "mlflow.experimentKind", "custom_model_development"
DESCRIPTION_TAG = "mlflow.note.content"


def _get_or_create_experiment(client, name: str, uri: str, description: str | None = None) -> str:
    from mlflow.exceptions import MlflowException

    exp = client.get_experiment_by_name(name)
    if exp is None:
        tags = {EXPERIMENT_KIND_TAG: TRAINING_KIND, **({DESCRIPTION_TAG: description} if description else {})}
        try:
            return client.create_experiment(
                name, artifact_location=artifact_location(uri, name), tags=tags
            )
        except MlflowException:
            # Another worker may have created it between our lookup and create.
            exp = client.get_experiment_by_name(name)
            if exp is None:
                raise
    if exp.lifecycle_stage != "active":
        raise ModbenchError(
            f"MLflow experiment {name!r} is deleted; restore it "
            f"(mlflow experiments restore --experiment-id {exp.experiment_id}) "
            "or choose another experiment name"
        )
    return exp.experiment_id


def to_float(value: Any) -> float:
    if hasattr(value, "item"):  # torch tensors, numpy scalars and 0-d arrays
        value = value.item()
    return float(value)


def _param_value(value: object) -> str:
    text = str(value)
    if len(text) <= MAX_PARAM_VALUE_LENGTH:
        return text
    note = f"...[truncated from {len(text)} chars]"
    return text[: MAX_PARAM_VALUE_LENGTH - len(note)] + note


def _chunks(items: list, size: int):
    for i in range(0, len(items), size):
        yield items[i : i + size]


# --------------------------------------------------------------------------- Tracker


class TimedRun:
    """What every run tracker keeps the same way: whether it started and ended, and ``seconds``,
    the wall time spent inside it (nested calls counted once): the caller's logging overhead."""

    KIND = "run"  # how errors name the run ("MLflow run", "offline run")

    def _init_bookkeeping(self, run_id: str | None) -> None:
        self.seconds = 0.0
        self._run_id = run_id
        self._started = False
        self._ended = False
        self._depth = 0

    @contextmanager
    def _timed(self):
        self._depth += 1
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._depth -= 1
            if self._depth == 0:
                self.seconds += time.perf_counter() - t0

    def _require_started(self) -> None:
        if not self._started:
            raise RuntimeError(f"{type(self).__name__}.start() has not been called")
        if self._ended:
            raise RuntimeError(f"{self.KIND} {self._run_id} has already ended")

    def __enter__(self):
        return self.start()

    def __exit__(self, exc_type, exc, tb) -> bool:
        end_run_on_exit(self, exc_type)
        return False


class Tracker(TimedRun):
    """One MLflow run with buffered metrics, written from the calling thread.

    Metrics are sent with ``MlflowClient.log_batch`` every ``flush_every`` calls of
    :meth:`log_metrics` (and at :meth:`flush`/:meth:`end`); ``seconds`` is the wall time
    spent inside the tracker. Pass ``run_id`` to resume an existing run. :meth:`start` opens
    the store and creates the run before it returns; a store that refuses the write (read-only,
    full, locked) is one line there, before anything trains. A study worker opens one per trial
    on a store it has already opened; ``modbench train`` runs one in a tracker process
    (:mod:`modbench.track.background`), so that MLflow's imports and writes cost its training
    nothing.
    """

    def __init__(
        self,
        experiment: str,
        *,
        run_name: str | None = None,
        parent_run_id: str | None = None,
        tags: dict[str, str] | None = None,
        uri: str,
        flush_every: int = 20,
        run_id: str | None = None,
        experiment_description: str | None = None,
    ) -> None:
        if flush_every < 1:
            raise ValueError(f"flush_every must be >= 1, got {flush_every}")
        self.experiment = experiment
        self.experiment_description = experiment_description
        self.run_name = run_name
        self.parent_run_id = parent_run_id
        self.extra_tags = {str(k): str(v) for k, v in (tags or {}).items()}
        self.uri = uri
        self.flush_every = flush_every
        self._monitor = None  # MLflow's system-metrics monitor, once monitor_system starts it
        self.experiment_id: str | None = None
        self._client = None
        self._buffer: list[tuple[str, float, int, int]] = []  # (key, value, timestamp ms, step)
        self._calls_since_flush = 0
        self._init_bookkeeping(run_id)

    KIND = "MLflow run"

    # ------------------------------------------------------------------ bookkeeping

    @property
    def run_id(self) -> str:
        if self._run_id is None:
            raise RuntimeError("Tracker.start() has not been called")
        return self._run_id

    @property
    def client(self):
        """The underlying ``MlflowClient`` (after :meth:`start`)."""
        self._require_started()
        return self._client

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> "Tracker":
        """Open the store and create (or resume) the run."""
        if self._started:
            return self
        from mlflow.exceptions import MlflowException

        with self._timed():
            try:
                self._start()
            except MlflowException as e:
                raise ModbenchError(f"the MLflow store {redact(self.uri)} refused to start a run ({store_problem(e)}): "
                                    "check that it is writable and has space, or pass another --tracking-uri") from None
        self._started = True
        return self

    def _start(self) -> None:
        client = connect(self.uri)
        tags = {**environment_tags(), **self.extra_tags}
        if tags["git_sha"] != "unknown":  # shown by the MLflow UI
            tags["mlflow.source.git.commit"] = tags["git_sha"].removesuffix("-dirty")
        if self._run_id is not None:
            self._resume(client, tags)
        else:
            self.experiment_id = _get_or_create_experiment(client, self.experiment, self.uri,
                                                           self.experiment_description)
            if self.parent_run_id:
                tags[PARENT_RUN_TAG] = self.parent_run_id
            run = client.create_run(self.experiment_id, run_name=self.run_name, tags=tags)
            self._run_id = run.info.run_id
        self._client = client

    def _resume(self, client, tags: dict[str, str]) -> None:
        from mlflow.entities import RunTag
        from mlflow.exceptions import MlflowException

        try:
            run = client.get_run(self._run_id)
        except MlflowException:
            raise ModbenchError(
                f"cannot resume MLflow run {self._run_id!r}: no such run at {redact(self.uri)}"
            ) from None
        exp = client.get_experiment(run.info.experiment_id)
        if exp.name != self.experiment:
            raise ModbenchError(
                f"cannot resume MLflow run {self._run_id!r}: it belongs to experiment "
                f"{exp.name!r}, not {self.experiment!r}"
            )
        if run.info.lifecycle_stage != "active":
            raise ModbenchError(f"cannot resume MLflow run {self._run_id!r}: it is deleted")
        self.experiment_id = exp.experiment_id
        client.update_run(self._run_id, status="RUNNING")
        tag_list = [RunTag(k, v) for k, v in tags.items()]
        for chunk in _chunks(tag_list, MAX_TAGS_PER_BATCH):
            client.log_batch(self._run_id, tags=chunk, synchronous=True)

    def end(self, status: str = "FINISHED") -> None:
        """Send the buffered metrics and end the run with ``status`` (the run ends even when the
        last metrics are refused; that error is raised afterwards)."""
        if status not in STATUSES:
            raise ValueError(f"status must be {accepted(STATUSES)}, got {status!r}")
        if not self._started or self._ended:
            return
        with self._timed():
            try:
                self._flush()
            finally:
                self._ended = True
                self._terminate(status)

    def _terminate(self, status: str) -> None:
        try:
            if self._monitor is not None:
                self._monitor.finish()  # its last samples land before the run ends
                # MLflow's loop drops the samples of its last, unfinished interval, so a run
                # shorter than one interval would show no system metrics at all: publish what it
                # collected, plus a sample taken now.
                self._monitor.collect_metrics()
                self._monitor.publish_metrics(self._monitor.aggregate_metrics())
                self._monitor.mlflow_logger.flush()
        finally:
            self._client.set_terminated(self._run_id, status=status)

    # ------------------------------------------------------------------ logging

    def log_params(self, params: dict[str, object]) -> None:
        if not params:
            return
        self._require_started()
        from mlflow.entities import Param
        from mlflow.exceptions import MlflowException

        with self._timed():
            items = [Param(str(k), redact(_param_value(v))) for k, v in params.items()]  # never a password
            for chunk in _chunks(items, MAX_PARAMS_PER_BATCH):
                try:
                    self._client.log_batch(self._run_id, params=chunk, synchronous=True)
                except MlflowException as exc:
                    if "Changing param values is not allowed" in str(exc):
                        raise ModbenchError(
                            f"MLflow run {self._run_id} already has different values for "
                            "some of these params (params cannot change, e.g. on --resume "
                            f"with another config): {first_line(exc)}"
                        ) from None
                    raise

    def set_tags(self, tags: dict[str, str]) -> None:
        if not tags:
            return
        self._require_started()
        from mlflow.entities import RunTag

        with self._timed():
            items = [RunTag(str(k), redact(v)) for k, v in tags.items()]
            for chunk in _chunks(items, MAX_TAGS_PER_BATCH):
                self._client.log_batch(self._run_id, tags=chunk, synchronous=True)

    def log_dataset(self, name: str, digest: str, source: str, context: str) -> None:
        """Record the dataset as a run input (MLflow's dataset tracking, the run's *Datasets*
        column): ``source`` is a URL, or a description for data made on the machine."""
        self._require_started()
        from mlflow.entities import Dataset, DatasetInput, InputTag
        from mlflow.exceptions import MlflowException

        with self._timed():
            kind = "http" if source.startswith(("http://", "https://")) else "code"
            payload = json.dumps({"url": source} if kind == "http" else {"tags": {"origin": source}})
            dataset = Dataset(name=name[:500], digest=digest[:36], source_type=kind, source=redact(payload))
            inputs = [DatasetInput(dataset, [InputTag("mlflow.data.context", context)])]
            try:
                self._client.log_inputs(self._run_id, inputs)
            except MlflowException as e:
                # Two workers logging one new dataset at once: MLflow looks it up, then inserts it, and the
                # slower insert fails on the dataset's unique key. It exists now: the second try links it.
                if not any(text in str(e) for text in DUPLICATE_KEY):
                    raise
                self._client.log_inputs(self._run_id, inputs)

    def monitor_system(self, interval_s: float) -> None:
        """Log CPU, memory (and GPU, when MLflow can see one) every ``interval_s`` seconds with
        MLflow's own system-metrics monitor (the run's *System metrics* tab), until ``end``."""
        self._require_started()
        if interval_s <= 0 or self._monitor is not None:
            return
        from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

        with self._timed():
            logging.getLogger("mlflow.system_metrics").setLevel(logging.WARNING)  # its start/stop lines are noise
            monitor = SystemMetricsMonitor(self._run_id, sampling_interval=interval_s, tracking_uri=self.uri)
            monitor.start()
            self._monitor = monitor

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        """Buffer ``metrics`` at ``step``; None values are dropped, tensors and numpy
        scalars become floats, NaN/inf are kept (a diverging run stays visible)."""
        self._require_started()
        with self._timed():
            timestamp = int(time.time() * 1000)
            step = int(step)
            for key, value in metrics.items():
                if value is None:
                    continue
                self._buffer.append((str(key), to_float(value), timestamp, step))
            self._calls_since_flush += 1
            if (
                self._calls_since_flush >= self.flush_every
                or len(self._buffer) >= MAX_METRICS_PER_BATCH
            ):
                self._flush()

    def flush(self) -> None:
        """Send the buffered metrics now."""
        if not self._started or self._ended:
            return
        with self._timed():
            self._flush()

    def _flush(self) -> None:
        """A failed batch stays buffered for the next flush."""
        from mlflow.entities import Metric, RunTag

        self._calls_since_flush = 0
        heartbeat = [RunTag(HEARTBEAT_TAG, f"{time.time():.3f}")]  # for fail_stale_runs
        while self._buffer:
            chunk = self._buffer[:MAX_METRICS_PER_BATCH]
            self._client.log_batch(self._run_id, metrics=[Metric(*m) for m in chunk], tags=heartbeat,
                                   synchronous=True)
            del self._buffer[: len(chunk)]

    def log_dict(self, obj: dict, artifact_file: str) -> None:
        """Write ``obj`` as JSON, or YAML when ``artifact_file`` ends in .yaml/.yml;
        values JSON cannot encode (paths, dtypes, ...) are written as strings."""
        self._require_started()
        with self._timed():
            with tempfile.TemporaryDirectory(prefix="modbench-artifact-") as tmp:
                path = Path(tmp) / Path(artifact_file).name
                write_dict(obj, path)
                self._client.log_artifact(self._run_id, str(path), _artifact_dir(artifact_file))

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        """Log a file, or every file under a directory."""
        self._require_started()
        path = Path(path)
        if not path.exists():
            raise FileNotFoundError(f"artifact to log does not exist: {path}")
        with self._timed():
            if path.is_dir():
                self._client.log_artifacts(self._run_id, str(path), artifact_path)
            else:
                self._client.log_artifact(self._run_id, str(path), artifact_path)

    def log_figure(self, fig, artifact_file: str) -> None:
        """Log a matplotlib figure (saved in the format its extension names)."""
        self._require_started()
        with self._timed():
            self._client.log_figure(self._run_id, fig, artifact_file)


def write_dict(obj: dict, path: Path) -> None:
    """``obj`` as JSON, or YAML when ``path`` ends in .yaml/.yml (a run tracker's ``log_dict``);
    values JSON cannot encode (paths, dtypes, ...) are written as strings."""
    plain = json.loads(json.dumps(obj, default=str))
    if path.name.endswith((".yaml", ".yml")):
        import yaml

        path.write_text(yaml.safe_dump(plain, sort_keys=False), encoding="utf-8")
    else:
        path.write_text(json.dumps(plain, indent=2) + "\n", encoding="utf-8")


def end_run_on_exit(tracker: "RunTracker", exc_type) -> None:
    """A tracker's ``__exit__``: FINISHED, KILLED on Ctrl-C, FAILED on any other error; an error
    while ending is logged, never raised over the exception that is escaping."""
    if exc_type is None:
        tracker.end("FINISHED")
        return
    status = "KILLED" if issubclass(exc_type, KeyboardInterrupt) else "FAILED"
    try:
        tracker.end(status)
    except Exception as end_exc:
        logging.getLogger(__name__).warning("could not end MLflow run %s as %s: %s", tracker.run_id, status, end_exc)


def _artifact_dir(artifact_file: str) -> str | None:
    parent = Path(artifact_file).parent.as_posix()
    return None if parent in ("", ".") else parent


# --------------------------------------------------------------------------- NullTracker


class NullTracker:
    """A :class:`RunTracker` that records nothing (``--no-track``, ranks other than 0)."""

    run_id = None
    experiment_id = None
    seconds = 0.0

    def __init__(self, *args: object, **kwargs: object) -> None:
        pass

    def start(self) -> "NullTracker":
        return self

    def log_params(self, params: dict[str, object]) -> None:
        pass

    def set_tags(self, tags: dict[str, str]) -> None:
        pass

    def log_dataset(self, name: str, digest: str, source: str, context: str) -> None:
        pass

    def monitor_system(self, interval_s: float) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        pass

    def flush(self) -> None:
        pass

    def log_dict(self, obj: dict, artifact_file: str) -> None:
        pass

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        pass

    def log_figure(self, fig, artifact_file: str) -> None:
        pass

    def end(self, status: str = "FINISHED") -> None:
        if status not in STATUSES:
            raise ValueError(f"status must be {accepted(STATUSES)}, got {status!r}")

    def __enter__(self) -> "NullTracker":
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        return False


# --------------------------------------------------------------------------- stale runs


def fail_stale_runs(
    experiment: str,
    *,
    uri: str,
    older_than_s: float = 0,
    run_ids: list[str] | None = None,
    tags: dict[str, str] | None = None,
) -> int:
    """Mark RUNNING runs of ``experiment`` as FAILED, for workers that died without
    ending their run. A run counts as stale when its last sign of life (the latest of
    its start time and the heartbeat tag each metric flush writes) is more than
    ``older_than_s`` seconds ago; ``run_ids`` restricts the candidates. ``tags`` are set on
    each run it fails first (a study's ``optuna.state``, which the dead worker left RUNNING).
    Returns how many runs were changed (0 when the experiment does not exist)."""
    from mlflow.entities import ViewType

    client = connect(uri)
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        return 0
    wanted = set(run_ids) if run_ids is not None else None
    running = []
    token = None
    while True:  # collect every page first: terminating runs would shift the pages
        page = client.search_runs(
            [exp.experiment_id],
            filter_string="attributes.status = 'RUNNING'",
            run_view_type=ViewType.ACTIVE_ONLY,
            max_results=1000,
            page_token=token,
        )
        running.extend(page)
        token = page.token
        if not token:
            break
    now = time.time()
    changed = 0
    for run in running:
        if wanted is not None and run.info.run_id not in wanted:
            continue
        last = (run.info.start_time or 0) / 1000.0
        try:
            last = max(last, float(run.data.tags.get(HEARTBEAT_TAG, 0)))
        except ValueError:
            pass
        if now - last >= older_than_s:
            for key, value in (tags or {}).items():
                client.set_tag(run.info.run_id, key, redact(value))
            client.set_terminated(run.info.run_id, status="FAILED")
            changed += 1
    return changed
