"""``modbench ui [STUDY_FILE]``: the MLflow UI over the store studies and training log to.

The store is the one ``modbench.track.tracking`` writes to (``$MLFLOW_TRACKING_URI``, else
``sqlite:///<cwd>/mlflow.db``) unless ``--backend-store-uri`` names another. The server runs
in the foreground until Ctrl-C; with a study file the printed URL opens that study's
experiment. Experiments created from the UI keep their artifacts in ``<dir of
mlflow.db>/mlartifacts`` like the ones tracking.py creates.
"""

from __future__ import annotations

import errno
import os
import signal
import socket
import subprocess
import sys

from modbench.errors import ModbenchError, redact

_WILDCARD_HOSTS = ("0.0.0.0", "::", "")


def resolve_store(backend_store_uri: str | None) -> str:
    """The backend store URI to serve; ModbenchError when it is a server already or a
    SQLite file that does not exist (``mlflow server`` would create an empty one)."""
    from modbench.track.store import check_sqlite_store, resolve_tracking_uri, sqlite_db_path

    uri = resolve_tracking_uri(backend_store_uri)
    if uri.split("://", 1)[0].lower() in ("http", "https"):
        where = "--backend-store-uri" if backend_store_uri else "MLFLOW_TRACKING_URI"
        raise ModbenchError(f"{where} is a tracking server already ({uri}): open it in a browser, "
                            "or pass --backend-store-uri sqlite:///PATH/mlflow.db")
    db = sqlite_db_path(uri)
    if db is not None and not db.is_file():
        raise ModbenchError(f"no MLflow store at {db}: run 'modbench study run STUDY_FILE' or 'modbench train' "
                            "in this directory first, or pass --backend-store-uri")
    check_sqlite_store(uri, "--tracking-uri")  # mlflow server would die on it with a traceback
    return uri


def _port_free(host: str, port: int) -> bool:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        # The server sets SO_REUSEADDR too: a port whose old connections linger in TIME_WAIT is free.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                return False
            raise ModbenchError(f"cannot listen on {host}:{port} ({e.strerror}); pass --host 127.0.0.1 or another --port") from None
    return True


def check_port(host: str, port: int) -> None:
    """ModbenchError naming a free alternative when ``port`` is taken on ``host``."""
    if not 1 <= port <= 65535:
        raise ModbenchError(f"--port must be between 1 and 65535, got {port}")
    if _port_free(host, port):
        return
    spare = next((p for p in range(port + 1, min(port + 50, 65536)) if _port_free(host, p)), port + 1)
    raise ModbenchError(f"port {port} on {host} is already in use; pass --port N (e.g. --port {spare}) "
                        "or stop the other server")


def study_experiment_id(uri: str, study_file: str) -> str:
    """The MLflow experiment id of the study in ``study_file``."""
    from modbench.design.study_file import load_study
    from modbench.track.store import connect

    name = load_study(study_file).name
    exp = connect(uri).get_experiment_by_name(name)
    if exp is None:
        raise ModbenchError(f"no MLflow experiment {name!r} in {uri}: run 'modbench study run {study_file}' first")
    return exp.experiment_id


def server_command(uri: str, host: str, port: int) -> list[str]:
    """The ``mlflow server`` command line for ``uri``; the store itself goes in the environment
    (:func:`server_environment`), since a command line is shown by ``ps`` to every user."""
    from modbench.track.store import artifact_root

    cmd = [sys.executable, "-m", "mlflow", "server",
           "--host", host, "--port", str(port),
           "--workers", "1"]  # one user browsing: each extra worker is another MLflow import and ~300 MB
    root = artifact_root(uri)
    if root is not None:  # new experiments and proxied uploads land where tracking.py puts artifacts
        cmd += ["--default-artifact-root", root, "--artifacts-destination", root]
    return cmd


# MLflow 3's UI lays a page out for GenAI (Traces, Judges, Prompts, Evaluation runs in the sidebar)
# unless the URL asks for model training: its sidebar then offers Runs, Models and the model registry.
# The experiment's mlflow.experimentKind tag (tracking.py) does not switch that layout in 3.17.
TRAINING_LAYOUT = "workflowType=machine_learning"


def ui_url(host: str, port: int, experiment_id: str | None = None) -> str:
    """The address a browser on this machine opens, in MLflow's model-training layout."""
    shown = "127.0.0.1" if host in _WILDCARD_HOSTS else host
    if ":" in shown:
        shown = f"[{shown}]"
    url = f"http://{shown}:{port}/"
    return url + (f"#/experiments/{experiment_id}/runs" if experiment_id else "#/experiments") + f"?{TRAINING_LAYOUT}"


def server_environment(uri: str) -> dict[str, str]:
    """This process's environment for the server: ``uri`` as its backend store (``mlflow server``
    reads ``MLFLOW_BACKEND_STORE_URI`` as ``--backend-store-uri``), and no GenAI job runner, which a
    results browser does not need (10 more processes and about 3 GB)."""
    env = dict(os.environ, MLFLOW_BACKEND_STORE_URI=uri)
    env.setdefault("MLFLOW_SERVER_ENABLE_JOB_EXECUTION", "false")
    return env


def serve(cmd: list[str], env: dict[str, str]) -> int:
    """Run the server in the foreground; SIGINT/SIGTERM stop it (and end with code 0)."""
    proc = subprocess.Popen(cmd, env=env)
    stopped = False

    def forward(signum, _frame) -> None:
        # The server may already have the terminal's Ctrl-C too; a second signal only hurries it.
        nonlocal stopped
        stopped = True
        if proc.poll() is None:
            proc.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        rc = proc.wait()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        if proc.poll() is None:
            proc.kill()
    if stopped:
        print("modbench ui: server stopped", file=sys.stderr)
        return 0
    return rc


def run(args) -> int:
    uri = resolve_store(args.backend_store_uri)
    check_port(args.host, args.port)
    experiment_id = study_experiment_id(uri, args.study_file) if args.study_file else None
    print(f"MLflow UI for {redact(uri)}: {ui_url(args.host, args.port, experiment_id)} (Ctrl-C to stop)", flush=True)
    return serve(server_command(uri, args.host, args.port), server_environment(uri))


def add_parser(sub) -> None:
    p = sub.add_parser("ui", help="browse and compare tracked runs in the MLflow UI (foreground, Ctrl-C stops)")
    p.add_argument("study_file", nargs="?", help="open this study's experiment (default: the experiment list)")
    p.add_argument("--tracking-uri", "--backend-store-uri", dest="backend_store_uri",
                   help="store to serve (default: $MLFLOW_TRACKING_URI, else sqlite:///<cwd>/mlflow.db)")
    p.add_argument("--host", default="127.0.0.1", help="interface to listen on (default: 127.0.0.1, this machine only)")
    p.add_argument("--port", type=int, default=5000, help="port to listen on (default: 5000)")
    p.set_defaults(func=run)
