"""Where runs are stored: the tracking URI, and cheap checks that its store answers.

One command resolves its URI once (:func:`resolve_tracking_uri`: the flag, else
``$MLFLOW_TRACKING_URI``, else ``sqlite:///<cwd>/mlflow.db``, never the deprecated ``./mlruns``
file store) and passes it down. A store that cannot be reached or written is one line here,
within seconds and before anything trains: :func:`store_accepts_writes` checks a SQLite file or a
server without importing MLflow (which takes seconds); :func:`connect` opens the store with MLflow.
A SQLite store keeps its artifacts beside the database, in ``<dir of mlflow.db>/mlartifacts/``.
"""

from __future__ import annotations

import logging
import os
import re
import socket
from pathlib import Path
from urllib.parse import quote, urlsplit

from modbench.errors import ModbenchError, redact

_NETWORK_DEFAULT_PORTS = {
    "http": 80,
    "https": 443,
    "postgresql": 5432,
    "postgres": 5432,
    "mysql": 3306,
    "mssql": 1433,
}
_CONNECT_TIMEOUT_S = 5.0


def resolve_tracking_uri(flag: str | None = None) -> str:
    """The tracking URI of one command, resolved once and passed down: ``--tracking-uri`` if
    given, else ``$MLFLOW_TRACKING_URI`` (a tracking server works unchanged), else an absolute
    ``sqlite:///<cwd>/mlflow.db``. Never the ./mlruns file store."""
    if flag and flag.strip():
        return _sqlite_if_bare_path(flag.strip())
    env = os.environ.get("MLFLOW_TRACKING_URI", "").strip()
    if env:
        return _sqlite_if_bare_path(env)
    return default_tracking_uri()


def default_tracking_uri() -> str:
    """``sqlite:///<cwd>/mlflow.db``: the store when neither flag nor environment names one."""
    return "sqlite:///" + (Path.cwd().resolve() / "mlflow.db").as_posix()


def _sqlite_if_bare_path(uri: str) -> str:
    """``other.db`` (natural after reading "default ./mlflow.db") as ``sqlite:///<abs>/other.db``:
    MLflow would take a bare path for its deprecated file store and print a paragraph about it."""
    if ":" in uri or uri == "databricks":  # a URI (sqlite:, http:, postgresql:, file:), Databricks' name
        return uri
    if not uri.endswith(".db"):  # MLflow's retired file store, which answers with a paragraph
        raise ModbenchError(f"tracking URI {uri!r} is a folder path, MLflow's retired file store: pass a SQLite file "
                            "(a path ending in .db, or sqlite:///PATH) or a tracking server (http://host:5000)")
    return "sqlite:///" + (Path.cwd() / uri).resolve().as_posix()


STORAGE_ENV = "MODBENCH_STORAGE"  # the Optuna storage URL, kept off the command line (and out of ps)


def resolve_storage(flag: str | None = None) -> str | None:
    """The Optuna storage URL of one command: ``--storage`` if given, else ``$MODBENCH_STORAGE``,
    else None (SQLite in the study's output folder)."""
    for value in (flag, os.environ.get(STORAGE_ENV)):
        if value and value.strip():
            return value.strip()
    return None


# Where each driver reads a password that a URL leaves out: libpq (psycopg) reads PGPASSWORD (and
# ~/.pgpass), MLflow's REST client MLFLOW_TRACKING_PASSWORD. A shown URL names the variable instead.
_PASSWORD_VARIABLES = {"postgresql": "PGPASSWORD", "postgres": "PGPASSWORD", "http": "MLFLOW_TRACKING_PASSWORD",
                       "https": "MLFLOW_TRACKING_PASSWORD", "mysql": "MYSQL_PWD"}


def shell_url(uri: str) -> str:
    """``uri`` as a shell word for a printed command: a password becomes a reference to the
    environment variable its driver reads (``"postgresql://u:${PGPASSWORD}@h/db"``), so the
    command works as printed and no secret is shown or stored."""
    import shlex

    try:
        parts = urlsplit(uri)
        password = parts.password
    except ValueError:
        return shlex.quote(redact(uri))
    if password is None:
        return shlex.quote(uri)
    scheme = parts.scheme.split("+", 1)[0].lower()
    variable = _PASSWORD_VARIABLES.get(scheme, "MODBENCH_DB_PASSWORD")
    at = uri.index(parts.netloc)
    before, after = uri[:at], uri[at + len(parts.netloc):]
    user, _, host = parts.netloc.rpartition("@")
    user = user.split(":", 1)[0]

    def literal(text: str) -> str:  # inside double quotes only \ " $ ` are special to the shell
        return re.sub(r'([\\"$`])', r"\\\1", text)

    return '"' + literal(f"{before}{user}:") + "${" + variable + "}" + literal(f"@{host}{after}") + '"'


def sqlite_db_path(uri: str) -> Path | None:
    """The database file of a ``sqlite:///`` URI, made absolute; None for other URIs or
    an in-memory database."""
    if not uri.startswith("sqlite:///"):
        return None
    raw = uri[len("sqlite:///") :].split("?", 1)[0]
    if not raw or raw == ":memory:":
        return None
    return (Path.cwd() / raw).resolve()




SQLITE_HEADER = b"SQLite format 3\x00"  # the first 16 bytes of every SQLite database file


def check_sqlite_store(uri: str, flag: str = "--tracking-uri", *, must_exist: bool = False) -> None:
    """ModbenchError when ``uri`` is a SQLite URL whose file exists but is not a SQLite database
    (MLflow would fail deep in SQLAlchemy, or ``mlflow server`` with a traceback), or, for a
    command that only reads runs (``must_exist``), whose file is not there: opening it would
    create an empty store, in which the runs it looks for are missing."""
    db = sqlite_db_path(uri)
    if db is None:
        return
    if not db.is_file():
        if must_exist:
            raise ModbenchError(f"no MLflow store at {db}: pass the {flag} the study ran with "
                                "(or run from the directory that has its mlflow.db)")
        return
    try:
        with open(db, "rb") as f:
            head = f.read(len(SQLITE_HEADER))
    except OSError as e:
        raise ModbenchError(f"cannot read the MLflow store {db}: {e.strerror or e}; pass another {flag}") from None
    if head and head != SQLITE_HEADER:  # an empty file is a database SQLite has not written yet
        raise ModbenchError(f"the MLflow store {db} is not a SQLite database (file is not a database); "
                            f"pass another {flag} or move the file away")


def quiet_mlflow_logging() -> None:
    """MLflow and alembic log INFO lines when a database is first created/migrated, and MLflow logs
    a database error as an ERROR paragraph before raising it: modbench reports it in one line."""
    for name in ("alembic", "alembic.runtime.migration"):
        logging.getLogger(name).setLevel(logging.WARNING)
    logging.getLogger("mlflow.store.db.utils").setLevel(logging.CRITICAL)


def store_problem(exc: BaseException) -> str:
    """The database's own reason inside an MLflow exception (SQLAlchemy wraps it in a paragraph)."""
    text = str(exc)
    for line in text.splitlines():
        if "OperationalError" in line or "Error)" in line:
            return " ".join(line.split(") ", 1)[-1].split())
    return first_line(exc)


def first_line(exc: BaseException) -> str:
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
        raise _unreachable(uri, first_line(exc)) from None


def connect(uri: str):
    """An ``MlflowClient`` for ``uri`` whose store answered one query."""
    _check_network_store(uri)
    quiet_mlflow_logging()
    from mlflow.tracking import MlflowClient

    try:
        client = MlflowClient(tracking_uri=uri)
        client.search_experiments(max_results=1)
    except Exception as exc:  # any failure to reach/open the store is the user's to fix
        raise (_half_migrated(uri, exc) or _unreachable(uri, first_line(exc))) from exc
    return client


# What SQLite says when MLflow re-runs a schema migration that an interrupted first open had half
# applied (SQLite commits each ALTER TABLE at once; the migration's version row never got written).
HALF_MIGRATED = ("duplicate column name", "already exists")


def _half_migrated(uri: str, exc: BaseException) -> ModbenchError | None:
    """The line for a SQLite store whose schema migration was interrupted (Ctrl-C while MLflow
    created a fresh ./mlflow.db): every later open fails on the half-applied migration, and the
    generic "cannot reach" line gives no way out. Deleting the file is the way out when it holds no
    runs (the interrupted migration was the store's first); otherwise it says so and keeps it."""
    db = sqlite_db_path(uri)
    if db is None or not any(text in str(exc) for text in HALF_MIGRATED):
        return None
    reason = store_problem(exc)
    runs = _run_count(db)
    if runs == 0:
        return ModbenchError(f"the MLflow store {db} was left half-created: its first migration was interrupted ({reason}); "
                             f"it holds no runs: delete {db} and run again (a new store is created)")
    held = f"holds {runs} runs" if runs else "may hold runs"
    return ModbenchError(f"the MLflow store {db} has a half-applied schema migration ({reason}) and {held}: "
                         "restore it from a backup, or pass another --tracking-uri")


def _run_count(db: Path) -> int | None:
    """How many runs the SQLite store holds: 0 also when it has no runs table yet, None when
    SQLite cannot say (then nobody is told to delete it)."""
    import sqlite3

    try:
        con = sqlite3.connect(f"file:{quote(db.as_posix())}?mode=ro", uri=True, timeout=_CONNECT_TIMEOUT_S)
        try:
            return int(con.execute("SELECT COUNT(*) FROM runs").fetchone()[0])
        finally:
            con.close()
    except sqlite3.OperationalError as e:
        return 0 if "no such table" in str(e) else None
    except sqlite3.Error:
        return None


def artifact_root(uri: str) -> str | None:
    """``<dir of mlflow.db>/mlartifacts`` for a SQLite store, where every experiment keeps
    its artifacts; None (the server decides) otherwise."""
    db = sqlite_db_path(uri)
    return None if db is None else (db.parent / "mlartifacts").as_posix()


def artifact_location(uri: str, experiment: str) -> str | None:
    """``<artifact_root>/<experiment>`` for a SQLite store; None otherwise."""
    root = artifact_root(uri)
    if root is None:
        return None
    slug = re.sub(r"[^A-Za-z0-9._-]+", "_", experiment).strip("._") or "experiment"
    return f"{root}/{slug}"



def store_accepts_writes(uri: str) -> bool:
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
