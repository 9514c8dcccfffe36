"""A thin, batched MLflow logger.

:class:`Tracker` wraps one MLflow run through an explicit ``MlflowClient`` (never the
global fluent API state), so several trackers and tracking URIs can coexist in one
process and nothing leaks between tests. Metrics are buffered and sent with
``MlflowClient.log_batch`` every ``flush_every`` calls; ``Tracker.seconds`` accumulates
the wall time spent inside the tracker so the caller can report logging overhead.

The default store is SQLite (``sqlite:///<cwd>/mlflow.db``), never the deprecated
``./mlruns`` file store, and experiments created here keep their artifacts next to the
database in ``<dir of mlflow.db>/mlartifacts/<experiment>/``.

``mlflow`` is imported lazily (it takes seconds), so ``--no-track`` runs, which use
:class:`NullTracker`, never pay for it.
"""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import queue
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol, runtime_checkable
from urllib.parse import quote, urlsplit

from modbench.errors import ModbenchError, accepted, redact
from modbench.track.provenance import environment_tags

# MLflow's limits (mlflow/utils/validation.py); a log_batch call exceeding them is refused.
MAX_PARAMS_PER_BATCH = 100
MAX_TAGS_PER_BATCH = 100
MAX_METRICS_PER_BATCH = 1000
MAX_PARAM_VALUE_LENGTH = 6000

PARENT_RUN_TAG = "mlflow.parentRunId"
HEARTBEAT_TAG = "modbench.heartbeat"
STATUSES = ("FINISHED", "FAILED", "KILLED")

_NETWORK_DEFAULT_PORTS = {
    "http": 80,
    "https": 443,
    "postgresql": 5432,
    "postgres": 5432,
    "mysql": 3306,
    "mssql": 1433,
}
_CONNECT_TIMEOUT_S = 5.0


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


# --------------------------------------------------------------------------- URIs / tags


def resolve_tracking_uri(flag: str | None = None) -> str:
    """The tracking URI of one command, resolved once and passed down: ``--tracking-uri`` if
    given, else ``$MLFLOW_TRACKING_URI`` (a tracking server works unchanged), else an absolute
    ``sqlite:///<cwd>/mlflow.db``. Never the ./mlruns file store."""
    if flag and flag.strip():
        return flag.strip()
    env = os.environ.get("MLFLOW_TRACKING_URI", "").strip()
    if env:
        return env
    return "sqlite:///" + (Path.cwd().resolve() / "mlflow.db").as_posix()


def sqlite_db_path(uri: str) -> Path | None:
    """The database file of a ``sqlite:///`` URI, made absolute; None for other URIs or
    an in-memory database."""
    if not uri.startswith("sqlite:///"):
        return None
    raw = uri[len("sqlite:///") :].split("?", 1)[0]
    if not raw or raw == ":memory:":
        return None
    return (Path.cwd() / raw).resolve()


# --------------------------------------------------------------------------- helpers


def _quiet_mlflow_logging() -> None:
    """MLflow and alembic log INFO lines when a database is first created/migrated, and MLflow logs
    a database error as an ERROR paragraph before raising it: modbench reports it in one line."""
    for name in ("alembic", "alembic.runtime.migration"):
        logging.getLogger(name).setLevel(logging.WARNING)
    logging.getLogger("mlflow.store.db.utils").setLevel(logging.CRITICAL)


def _store_problem(exc: BaseException) -> str:
    """The database's own reason inside an MLflow exception (SQLAlchemy wraps it in a paragraph)."""
    text = str(exc)
    for line in text.splitlines():
        if "OperationalError" in line or "Error)" in line:
            return " ".join(line.split(") ", 1)[-1].split())
    return _first_line(exc)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return " ".join(text.splitlines()[0].split())


def _unreachable(uri: str, reason: str) -> ModbenchError:
    return ModbenchError(
        f"cannot reach MLflow tracking store at {redact(uri)}: {reason}; pass --tracking-uri (or set "
        "MLFLOW_TRACKING_URI) with a reachable server or database (default: sqlite:///<cwd>/mlflow.db); "
        "'modbench train' can also run with --no-track"
    )


def _check_network_store(uri: str) -> None:
    """Fail within seconds for a server or database that refuses connections; MLflow
    itself retries for minutes before giving up."""
    try:
        parts = urlsplit(uri)
        scheme = parts.scheme.split("+", 1)[0].lower()
        host, port = parts.hostname, parts.port
    except ValueError as exc:
        raise _unreachable(uri, f"malformed URI ({exc})") from None
    if scheme not in _NETWORK_DEFAULT_PORTS or not host:
        return
    try:
        with socket.create_connection(
            (host, port or _NETWORK_DEFAULT_PORTS[scheme]), timeout=_CONNECT_TIMEOUT_S
        ):
            pass
    except OSError as exc:
        raise _unreachable(uri, _first_line(exc)) from None


def connect(uri: str):
    """An ``MlflowClient`` for ``uri`` whose store answered one query."""
    _check_network_store(uri)
    _quiet_mlflow_logging()
    from mlflow.tracking import MlflowClient

    try:
        client = MlflowClient(tracking_uri=uri)
        client.search_experiments(max_results=1)
    except Exception as exc:  # any failure to reach/open the store is the user's to fix
        raise _unreachable(uri, _first_line(exc)) from exc
    return client


def artifact_root(uri: str) -> str | None:
    """``<dir of mlflow.db>/mlartifacts`` for a SQLite store, where every experiment keeps
    its artifacts; None (the server decides) otherwise."""
    db = sqlite_db_path(uri)
    return None if db is None else (db.parent / "mlartifacts").as_posix()


def _artifact_location(uri: str, experiment: str) -> str | None:
    """``<artifact_root>/<experiment>`` for a SQLite store; None otherwise."""
    root = artifact_root(uri)
    if root is None:
        return None
    slug = re.sub(r"[^A-Za-z0-9._-]+", "_", experiment).strip("._") or "experiment"
    return f"{root}/{slug}"


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
                name, artifact_location=_artifact_location(uri, name), tags=tags
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


def _to_float(value: Any) -> float:
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


class Tracker:
    """One MLflow run with buffered metrics.

    Metrics are sent with ``MlflowClient.log_batch`` every ``flush_every`` calls of
    :meth:`log_metrics` (and at :meth:`flush`/:meth:`end`); ``seconds`` is the wall time
    the caller spent inside the tracker (waiting for it included). Pass ``run_id`` to resume
    an existing run.

    :meth:`start` opens the store and creates the run before it returns. :meth:`start_in_background`
    (what ``modbench train`` uses) checks the store in milliseconds, then imports MLflow, opens the
    store, creates the run and does every write on one background thread, in call order, while
    training runs: the caller only queues. :meth:`flush` and :meth:`end` wait for the queue; the
    first error of the thread is raised by the next call.
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
        self.seconds = 0.0
        self.experiment_id: str | None = None
        self._run_id = run_id
        self._client = None
        self._buffer: list[tuple[str, float, int, int]] = []  # (key, value, timestamp ms, step)
        self._calls_since_flush = 0
        self._started = False
        self._ended = False
        self._depth = 0
        self._jobs: queue.Queue | None = None  # the background thread's work, in call order
        self._worker: threading.Thread | None = None
        self._opened = threading.Event()
        self._failure: BaseException | None = None  # the background thread's first error

    # ------------------------------------------------------------------ bookkeeping

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
            raise RuntimeError("Tracker.start() has not been called")
        if self._ended:
            raise RuntimeError(f"MLflow run {self._run_id} has already ended")
        self._raise_failure()

    def _raise_failure(self) -> None:
        """Raise the background thread's error once; it writes nothing more but ends the run."""
        if self._failure is not None and self._failure is not _RAISED:
            failure, self._failure = self._failure, _RAISED
            raise failure

    def _submit(self, job) -> None:
        """Run ``job`` now, or queue it for the background thread."""
        if self._jobs is None:
            job()
        else:
            self._jobs.put(job)

    def _drain(self) -> None:
        """Wait until the background thread has done every queued job."""
        if self._jobs is not None:
            self._jobs.join()

    def _wait_opened(self) -> None:
        if self._worker is not None and not self._opened.is_set():
            with self._timed():
                self._opened.wait()
        self._raise_failure()

    @property
    def run_id(self) -> str:
        if self._worker is not None and self._started:
            self._wait_opened()
        if self._run_id is None:
            raise RuntimeError("Tracker.start() has not been called")
        return self._run_id

    @property
    def client(self):
        """The underlying ``MlflowClient`` (after :meth:`start`)."""
        self._require_started()
        self._wait_opened()
        return self._client

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> "Tracker":
        """Open the store and create (or resume) the run. A store that refuses the write (read-only,
        full, locked) is one line here, before anything trains."""
        if self._started:
            return self
        with self._timed():
            self._open()
        self._started = True
        return self

    def start_in_background(self) -> "Tracker":
        """Start a new run without waiting for MLflow: check now, without importing it, that the
        store is reachable and (a SQLite file) writable, then import MLflow, open the store, create
        the run and do every later write on a background thread (see the class doc). Resuming a
        run, or a store this cannot check cheaply, starts in the foreground (:meth:`start`)."""
        if self._started:
            return self
        if self._run_id is not None:
            return self.start()
        with self._timed():
            if not _store_accepts_writes(self.uri):
                return self.start()
            self._jobs = queue.Queue()
            self._worker = threading.Thread(target=self._work, name="modbench-tracker", daemon=True)
            self._worker.start()
        self._started = True
        return self

    def _work(self) -> None:
        try:
            self._open()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's next call
            self._failure = exc
        finally:
            self._opened.set()
        while True:
            job = self._jobs.get()
            try:
                if job is None:
                    return
                if self._failure is None or getattr(job, "always", False):
                    job()
            except BaseException as exc:  # noqa: BLE001 - handed to the caller's next call
                if self._failure is None:
                    self._failure = exc
            finally:
                self._jobs.task_done()

    def _open(self) -> None:
        from mlflow.exceptions import MlflowException

        try:
            self._start()
        except MlflowException as e:
            raise ModbenchError(f"the MLflow store {redact(self.uri)} refused to start a run ({_store_problem(e)}): "
                                "check that it is writable and has space, or pass another --tracking-uri") from None

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
                f"cannot resume MLflow run {self._run_id!r}: no such run at {self.uri}"
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
        if status not in STATUSES:
            raise ValueError(f"status must be {accepted(STATUSES)}, got {status!r}")
        if not self._started or self._ended:
            return
        with self._timed():
            try:
                try:
                    self._flush()
                finally:
                    self._submit(_always(lambda: self._terminate(status)))
                self._drain()
            finally:
                self._ended = True
                if self._worker is not None:
                    self._jobs.put(None)
                    self._worker.join()
        self._raise_failure()

    def _terminate(self, status: str) -> None:
        if self._client is None:  # the run was never created
            return
        try:
            if self._monitor not in (None, True):
                self._monitor.finish()  # its last samples land before the run ends
                # MLflow's loop drops the samples of its last, unfinished interval, so a run
                # shorter than one interval (or than the store's opening, in the background)
                # would show no system metrics at all: publish what it collected, plus now.
                self._monitor.collect_metrics()
                self._monitor.publish_metrics(self._monitor.aggregate_metrics())
                self._monitor.mlflow_logger.flush()
        finally:
            self._client.set_terminated(self._run_id, status=status)

    def __enter__(self) -> "Tracker":
        return self.start()

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc_type is None:
            self.end("FINISHED")
            return False
        status = "KILLED" if issubclass(exc_type, KeyboardInterrupt) else "FAILED"
        try:
            self.end(status)
        except Exception as end_exc:  # never mask the exception that is escaping
            logging.getLogger(__name__).warning(
                "could not end MLflow run %s as %s: %s", self._run_id, status, end_exc
            )
        return False

    # ------------------------------------------------------------------ logging
    # Each method checks and converts its arguments on the caller's thread, then hands the store
    # work (MLflow imports included) to _submit: run now, or queued for the background thread.

    def log_params(self, params: dict[str, object]) -> None:
        if not params:
            return
        self._require_started()
        with self._timed():
            items = [(str(k), redact(_param_value(v))) for k, v in params.items()]  # never a password
            self._submit(lambda: self._write_params(items))

    def _write_params(self, items: list[tuple[str, str]]) -> None:
        from mlflow.entities import Param
        from mlflow.exceptions import MlflowException

        for chunk in _chunks([Param(k, v) for k, v in items], MAX_PARAMS_PER_BATCH):
            try:
                self._client.log_batch(self._run_id, params=chunk, synchronous=True)
            except MlflowException as exc:
                if "Changing param values is not allowed" in str(exc):
                    raise ModbenchError(
                        f"MLflow run {self._run_id} already has different values for "
                        "some of these params (params cannot change, e.g. on --resume "
                        f"with another config): {_first_line(exc)}"
                    ) from None
                raise

    def set_tags(self, tags: dict[str, str]) -> None:
        if not tags:
            return
        self._require_started()
        with self._timed():
            items = [(str(k), redact(v)) for k, v in tags.items()]
            self._submit(lambda: self._write_tags(items))

    def _write_tags(self, items: list[tuple[str, str]]) -> None:
        from mlflow.entities import RunTag

        for chunk in _chunks([RunTag(k, v) for k, v in items], MAX_TAGS_PER_BATCH):
            self._client.log_batch(self._run_id, tags=chunk, synchronous=True)

    def log_dataset(self, name: str, digest: str, source: str, context: str) -> None:
        """Record the dataset as a run input (MLflow's dataset tracking, the run's *Datasets*
        column): ``source`` is a URL, or a description for data made on the machine."""
        self._require_started()
        kind = "http" if source.startswith(("http://", "https://")) else "code"
        payload = json.dumps({"url": source} if kind == "http" else {"tags": {"origin": source}})

        def write() -> None:
            from mlflow.entities import Dataset, DatasetInput, InputTag

            dataset = Dataset(name=name[:500], digest=digest[:36], source_type=kind, source=redact(payload))
            self._client.log_inputs(self._run_id, [DatasetInput(dataset, [InputTag("mlflow.data.context", context)])])

        with self._timed():
            self._submit(write)

    def monitor_system(self, interval_s: float) -> None:
        """Log CPU, memory (and GPU, when MLflow can see one) every ``interval_s`` seconds with
        MLflow's own system-metrics monitor (the run's *System metrics* tab), until ``end``."""
        self._require_started()
        if interval_s <= 0 or self._monitor is not None:
            return

        def begin() -> None:
            from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

            logging.getLogger("mlflow.system_metrics").setLevel(logging.WARNING)  # its start/stop lines are noise
            monitor = SystemMetricsMonitor(self._run_id, sampling_interval=interval_s, tracking_uri=self.uri)
            monitor.start()
            self._monitor = monitor

        with self._timed():
            self._monitor = True  # a placeholder until it runs: a second call starts no other monitor
            self._submit(begin)

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
                self._buffer.append((str(key), _to_float(value), timestamp, step))
            self._calls_since_flush += 1
            if (
                self._calls_since_flush >= self.flush_every
                or len(self._buffer) >= MAX_METRICS_PER_BATCH
            ):
                self._flush()

    def flush(self) -> None:
        """Send the buffered metrics and wait until every earlier call has reached the store."""
        if not self._started or self._ended:
            return
        with self._timed():
            self._flush()
            self._drain()
        self._raise_failure()

    def _flush(self) -> None:
        self._calls_since_flush = 0
        if not self._buffer:
            return
        heartbeat = f"{time.time():.3f}"
        if self._jobs is None:  # in the foreground a failed batch stays buffered for the next flush
            while self._buffer:
                chunk = self._buffer[:MAX_METRICS_PER_BATCH]
                self._write_metrics(chunk, heartbeat)
                del self._buffer[: len(chunk)]
            return
        pending, self._buffer = self._buffer, []
        self._jobs.put(lambda: self._write_metrics(pending, heartbeat))

    def _write_metrics(self, pending: list[tuple[str, float, int, int]], heartbeat: str) -> None:
        from mlflow.entities import Metric, RunTag

        metrics = [Metric(*m) for m in pending]
        for chunk in _chunks(metrics, MAX_METRICS_PER_BATCH):
            self._client.log_batch(self._run_id, metrics=chunk, tags=[RunTag(HEARTBEAT_TAG, heartbeat)],
                                   synchronous=True)

    def log_dict(self, obj: dict, artifact_file: str) -> None:
        """Write ``obj`` as JSON, or YAML when ``artifact_file`` ends in .yaml/.yml;
        values JSON cannot encode (paths, dtypes, ...) are written as strings."""
        self._require_started()
        with self._timed():
            plain = json.loads(json.dumps(obj, default=str))  # a copy: later changes to obj are not logged
            self._submit(lambda: self._write_dict(plain, artifact_file))

    def _write_dict(self, plain: dict, artifact_file: str) -> None:
        name = Path(artifact_file).name
        with tempfile.TemporaryDirectory(prefix="modbench-artifact-") as tmp:
            path = Path(tmp) / name
            if name.endswith((".yaml", ".yml")):
                import yaml

                path.write_text(yaml.safe_dump(plain, sort_keys=False))
            else:
                path.write_text(json.dumps(plain, indent=2) + "\n")
            self._client.log_artifact(self._run_id, str(path), _artifact_dir(artifact_file))

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        """Log a file, or every file under a directory (as it is when the store receives it:
        in the background, when the store is written; the caller leaves it in place)."""
        self._require_started()
        path = Path(path)
        if not path.exists():
            raise FileNotFoundError(f"artifact to log does not exist: {path}")

        def write() -> None:
            if path.is_dir():
                self._client.log_artifacts(self._run_id, str(path), artifact_path)
            else:
                self._client.log_artifact(self._run_id, str(path), artifact_path)

        with self._timed():
            self._submit(write)

    def log_figure(self, fig, artifact_file: str) -> None:
        """Log a matplotlib figure (saved in the format its extension names), now: the caller
        may change or close the figure afterwards."""
        self._require_started()
        with self._timed():
            self._wait_opened()
            self._drain()  # in call order
            self._client.log_figure(self._run_id, fig, artifact_file)


class _Raised(Exception):
    """Stands for a background error already raised to the caller: later jobs are skipped."""


_RAISED = _Raised()


def _always(job):
    """Mark ``job`` to run on the background thread even after an error (ending the run)."""
    job.always = True
    return job


def _store_accepts_writes(uri: str) -> bool:
    """Whether the store was checked, in milliseconds and without importing MLflow: a server or
    database answers connections, a SQLite file (or its directory, for a new one) takes writes.
    ModbenchError when it refuses; False for a store this does not check (start it in the foreground)."""
    scheme = uri.split(":", 1)[0].split("+", 1)[0].lower()
    if scheme in _NETWORK_DEFAULT_PORTS:
        _check_network_store(uri)
        return True
    db = sqlite_db_path(uri)
    if db is None or "?" in uri or uri[len("sqlite:///"):].startswith("file:"):
        return False  # in-memory, URI filenames, options: MLflow's own open says what is wrong
    import sqlite3

    def refused(reason: str) -> ModbenchError:
        return ModbenchError(f"the MLflow store {redact(uri)} refused to start a run ({reason}): "
                             "check that it is writable and has space, or pass another --tracking-uri")

    if not db.exists():
        if not db.parent.is_dir():
            raise _unreachable(uri, f"unable to open database file: {db.parent} is not a directory")
        if not os.access(db.parent, os.W_OK | os.X_OK):
            raise refused(f"{db.parent} is not writable")
        return True
    try:
        con = sqlite3.connect(f"file:{quote(db.as_posix())}?mode=rw", uri=True, timeout=_CONNECT_TIMEOUT_S)
    except sqlite3.Error as exc:
        raise _unreachable(uri, str(exc)) from None
    try:
        (version,) = con.execute("PRAGMA user_version").fetchone()
        con.execute(f"PRAGMA user_version = {int(version)}")  # a write that changes nothing
    except sqlite3.Error as exc:
        raise refused(str(exc)) from None
    finally:
        con.close()
    return True


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
) -> int:
    """Mark RUNNING runs of ``experiment`` as FAILED, for workers that died without
    ending their run. A run counts as stale when its last sign of life (the latest of
    its start time and the heartbeat tag each metric flush writes) is more than
    ``older_than_s`` seconds ago; ``run_ids`` restricts the candidates. Returns how many
    runs were changed (0 when the experiment does not exist)."""
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
            client.set_terminated(run.info.run_id, status="FAILED")
            changed += 1
    return changed
