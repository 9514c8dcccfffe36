"""The tracker process: ``modbench train``'s MLflow run, written by a second process.

Opening an MLflow store costs about 2.3 CPU-seconds, nearly all of it module imports (``mlflow``,
then SQLAlchemy and alembic for a database store); every write after that costs milliseconds.
On a short run that fixed cost is the whole logging overhead, and a thread cannot hide it: the
imports hold the GIL, and on a machine whose cores all train, their CPU time comes out of
training. A process started when the command starts (:func:`prewarm`, called by ``modbench``
before it imports torch) does those imports on the core the single-threaded start-up leaves
idle, so the run pays for little more than pickling its calls. MLflow's own asynchronous logging
(``synchronous=False``) does not serve: it queues writes to a thread of the same process, which
hides a write's latency but not the imports, the cost measured here.

:class:`TrackerProcess` is a :class:`~modbench.track.tracking.RunTracker`: the training loop calls
it as it calls a :class:`~modbench.track.tracking.Tracker`. Each call checks and converts its
arguments here (tensors to floats, dicts to plain copies), then sends one pickled request down the
child's stdin; the child runs a foreground ``Tracker`` and performs the requests in call order.
Only ``run_id``, ``flush`` and ``end`` wait for an answer. The child's first error is kept, later
writes are skipped (the run is still ended), and the error is raised by the next call that
waits. A child that loses its parent (the pipe closes without ``end``) ends the run FAILED.

The child runs in its own session, so a Ctrl-C at the terminal reaches only the parent, which
ends the run KILLED. The URI reaches the child through the pipe, never its command line, where
a password would be visible to every user of the machine.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

from modbench.errors import ModbenchError, accepted
from modbench.track.store import first_line, store_accepts_writes
from modbench.track.tracking import STATUSES, end_run_on_exit, to_float

_PIPE_BYTES = 1 << 20  # requests queue here while the child is still importing
_F_SETPIPE_SZ = 1031  # Linux fcntl; elsewhere the default pipe size is kept


class TrackerProcessError(RuntimeError):
    """The tracker process failed in a way that is not the user's to fix (it died, or MLflow
    raised something unexpected); its message names what happened."""


# --------------------------------------------------------------------------- the parent's side


class _Child:
    """One tracker process and its two pipes."""

    def __init__(self, uri: str) -> None:
        self.uri = uri
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "modbench.track.background"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True, close_fds=True,
        )
        try:
            import fcntl

            fcntl.fcntl(self.proc.stdin.fileno(), _F_SETPIPE_SZ, _PIPE_BYTES)
        except (ImportError, OSError):
            pass
        self.send(("warm", uri))

    def send(self, request: tuple) -> None:
        try:
            pickle.dump(request, self.proc.stdin, protocol=pickle.HIGHEST_PROTOCOL)
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            raise TrackerProcessError(f"the MLflow tracker process has stopped (exit code {self.proc.poll()}); "
                                      "its error, if any, is printed above") from None

    def answer(self):
        """The child's answer to the last waiting request: its value, or its error raised here."""
        try:
            kind, payload = pickle.load(self.proc.stdout)
        except (EOFError, OSError, pickle.UnpicklingError):
            raise TrackerProcessError(f"the MLflow tracker process has stopped (exit code {self.proc.wait()}); "
                                      "its error, if any, is printed above") from None
        if kind == "ok":
            return payload
        if kind == "user":
            raise ModbenchError(payload)
        raise TrackerProcessError(payload)

    def close(self, *, kill: bool = False) -> None:
        """Close the pipes and reap the child (killed first when it is not needed)."""
        if kill and self.proc.poll() is None:
            self.proc.kill()
        for pipe in (self.proc.stdin, self.proc.stdout):
            try:
                pipe.close()
            except OSError:
                pass
        self.proc.wait()


_prewarmed: _Child | None = None


def prewarm(uri: str) -> None:
    """Start the tracker process for ``uri`` now, so that MLflow's imports overlap the command's
    own start-up; the next :class:`TrackerProcess` on the same URI takes it over."""
    global _prewarmed
    discard_prewarmed()
    _prewarmed = _Child(uri)


def discard_prewarmed() -> None:
    """Stop a prewarmed process nobody took over (the command failed, or did not track)."""
    global _prewarmed
    if _prewarmed is not None:
        child, _prewarmed = _prewarmed, None
        child.close(kill=True)


def _take_or_spawn(uri: str) -> _Child:
    global _prewarmed
    if _prewarmed is not None and _prewarmed.uri == uri and _prewarmed.proc.poll() is None:
        child, _prewarmed = _prewarmed, None
        return child
    discard_prewarmed()
    return _Child(uri)


class TrackerProcess:
    """A :class:`~modbench.track.tracking.Tracker` run by the tracker process (see the module doc).

    The constructor takes the same arguments as ``Tracker``. :meth:`start` checks now, in
    milliseconds and without importing MLflow, that the store answers and takes writes (one line
    before anything trains); a store it cannot check cheaply, or a run being resumed, is opened
    before ``start`` returns, so that its errors come first too. ``seconds`` is the wall time this
    process spent in the tracker: pickling requests and waiting for answers.
    """

    def __init__(self, experiment: str, *, uri: str, run_id: str | None = None, flush_every: int = 20,
                 **options) -> None:
        if flush_every < 1:
            raise ValueError(f"flush_every must be >= 1, got {flush_every}")
        self.uri = uri
        self.seconds = 0.0
        self._options = {"experiment": experiment, "uri": uri, "run_id": run_id, "flush_every": flush_every,
                         **options}
        self._run_id = run_id
        self._child: _Child | None = None
        self._ended = False
        self._monitoring = False

    @contextmanager
    def _timed(self):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds += time.perf_counter() - t0

    @property
    def pid(self) -> int | None:
        """The tracker process's id (None before :meth:`start`)."""
        return None if self._child is None else self._child.proc.pid

    @property
    def alive(self) -> bool:
        return self._child is not None and self._child.proc.poll() is None

    def start(self) -> "TrackerProcess":
        if self._child is not None:
            return self
        with self._timed():
            checked = store_accepts_writes(self.uri)
            self._child = _take_or_spawn(self.uri)
            self._child.send(("start", self._options))
        if not checked or self._run_id is not None:
            try:
                self.run_id  # noqa: B018 - waits for the store to open: its errors come before training
            except BaseException:
                self.end("FAILED")  # no run to end: the process just exits
                raise
        return self

    def _send(self, request: tuple) -> None:
        if self._child is None:
            raise RuntimeError("TrackerProcess.start() has not been called")
        if self._ended:
            raise RuntimeError(f"MLflow run {self._run_id} has already ended")
        self._child.send(request)

    def _ask(self, request: tuple):
        with self._timed():
            self._send(request)
            return self._child.answer()

    @property
    def run_id(self) -> str | None:
        if self._run_id is None and self._child is not None and not self._ended:
            self._run_id = self._ask(("run_id",))
        return self._run_id

    def _call(self, method: str, *args) -> None:
        with self._timed():
            self._send(("call", method, args))

    def log_params(self, params: dict[str, object]) -> None:
        if params:
            self._call("log_params", {str(k): str(v) for k, v in params.items()})

    def set_tags(self, tags: dict[str, str]) -> None:
        if tags:
            self._call("set_tags", {str(k): str(v) for k, v in tags.items()})

    def log_dataset(self, name: str, digest: str, source: str, context: str) -> None:
        self._call("log_dataset", str(name), str(digest), str(source), str(context))

    def monitor_system(self, interval_s: float) -> None:
        if interval_s > 0 and not self._monitoring:
            self._monitoring = True
            self._call("monitor_system", float(interval_s))

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        """Tensors and numpy scalars become floats here (the child has no torch); None is dropped."""
        with self._timed():
            plain = {str(k): to_float(v) for k, v in metrics.items() if v is not None}
            self._send(("call", "log_metrics", (plain, int(step))))

    def flush(self) -> None:
        """Wait until every earlier call has reached the store; raise the first error."""
        if self._child is not None and not self._ended:
            self._ask(("flush",))

    def log_dict(self, obj: dict, artifact_file: str) -> None:
        with self._timed():
            plain = json.loads(json.dumps(obj, default=str))  # a copy: later changes to obj are not logged
            self._send(("call", "log_dict", (plain, str(artifact_file))))

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        """Log a file or a directory, as it is when the child reaches this request: the caller
        leaves it in place until :meth:`flush` or :meth:`end`."""
        path = Path(path).resolve()
        if not path.exists():
            raise FileNotFoundError(f"artifact to log does not exist: {path}")
        self._call("log_artifact", str(path), artifact_path)

    def log_figure(self, fig, artifact_file: str) -> None:
        """Saved here (the figure stays the caller's), logged and deleted by the child."""
        with self._timed():
            tmp = tempfile.mkdtemp(prefix="modbench-figure-")
            path = Path(tmp) / Path(artifact_file).name
            fig.savefig(path)
            parent = Path(artifact_file).parent.as_posix()
            self._send(("figure", str(path), None if parent in ("", ".") else parent))

    def end(self, status: str = "FINISHED") -> None:
        """End the run with ``status`` once every request is done; the child then exits. The
        error raised, if any, is the child's first (the run is ended all the same)."""
        if status not in STATUSES:
            raise ValueError(f"status must be {accepted(STATUSES)}, got {status!r}")
        if self._child is None or self._ended:
            return
        try:
            self._run_id = self._ask(("end", status)) or self._run_id
        finally:
            self._ended = True
            with self._timed():
                self._child.close()

    def __enter__(self) -> "TrackerProcess":
        return self.start()

    def __exit__(self, exc_type, exc, tb) -> bool:
        end_run_on_exit(self, exc_type)
        return False


# --------------------------------------------------------------------------- the child's side


def _warm(uri: str) -> None:
    """Import what opening ``uri`` needs; open it too when that can write nothing (a SQLite file
    that exists). A new store is created by ``start`` only: this process may be stopped at any
    moment before that (the command failed), and must not leave a half-created database."""
    import mlflow.system_metrics.system_metrics_monitor  # noqa: F401 - imported before it is needed
    from mlflow.tracking import MlflowClient  # noqa: F401

    from modbench.track.store import connect, sqlite_db_path

    if uri.split(":", 1)[0].lower() in ("http", "https"):
        import mlflow.store.tracking.rest_store  # noqa: F401
        return
    import mlflow.store.tracking.sqlalchemy_store  # noqa: F401 - SQLAlchemy and alembic: most of the cost

    db = sqlite_db_path(uri)
    if db is not None and db.is_file():
        connect(uri)


def _error_answer(exc: BaseException) -> tuple[str, str]:
    if isinstance(exc, ModbenchError):
        return "user", str(exc)
    return "error", f"MLflow tracking failed: {type(exc).__name__}: {first_line(exc)}"


class _Server:
    """The child: one foreground Tracker, requests in call order, the first error kept."""

    def __init__(self, replies: BinaryIO) -> None:
        self.replies = replies
        self.tracker = None
        self.failure: BaseException | None = None
        self.reported = False

    def reply(self, value=None) -> None:
        if self.failure is not None and not self.reported:
            self.reported = True
            answer = _error_answer(self.failure)
        else:
            answer = ("ok", value)
        pickle.dump(answer, self.replies, protocol=pickle.HIGHEST_PROTOCOL)
        self.replies.flush()

    @contextmanager
    def keeping_failure(self):
        try:
            yield
        except BaseException as exc:  # noqa: BLE001 - handed to the parent's next waiting call
            if self.failure is None:
                self.failure = exc

    def handle(self, request: tuple) -> bool:
        """Do one request; False once the run has ended."""
        kind = request[0]
        if kind == "warm":
            try:
                _warm(request[1])
            except Exception:  # noqa: BLE001 - "start" opens the store again and reports it
                pass
        elif kind == "start":
            from modbench.track.tracking import Tracker

            with self.keeping_failure():
                self.tracker = Tracker(**request[1]).start()
        elif kind == "call":
            if self.failure is None:
                with self.keeping_failure():
                    getattr(self.tracker, request[1])(*request[2])
        elif kind == "figure":
            path = Path(request[1])
            if self.failure is None:
                with self.keeping_failure():
                    self.tracker.log_artifact(path, request[2])
            path.unlink(missing_ok=True)
            path.parent.rmdir()
        elif kind == "run_id":
            self.reply(None if self.tracker is None else self.tracker.run_id)
        elif kind == "flush":
            if self.failure is None:
                with self.keeping_failure():
                    self.tracker.flush()
            self.reply()
        elif kind == "end":
            self.finish(request[1])
            self.reply(None if self.tracker is None else self.tracker.run_id)
            return False
        return True

    def finish(self, status: str) -> None:
        """End the run, after an error too: a run must not stay RUNNING."""
        if self.tracker is not None and self.tracker.run_id is not None:
            with self.keeping_failure():
                self.tracker.end(status)


def serve(requests: BinaryIO, replies: BinaryIO) -> None:
    """The tracker process's loop: until ``end``, or until the parent goes away."""
    server = _Server(replies)
    while True:
        try:
            request = pickle.load(requests)
        except EOFError:  # the parent died or gave up on this process before ending the run
            server.finish("FAILED")
            return
        if not server.handle(request):
            return


def _main() -> None:
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides how the run ends
    replies = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # a stray print must not corrupt the answers
    serve(sys.stdin.buffer, replies)
    # Every write was synchronous and the run has ended: skip the interpreter's teardown of MLflow
    # and SQLAlchemy (about a CPU-second, which the command would wait for).
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    _main()
