"""The Optuna side of the results store: where a study's trials live and how to read them.

Both the study runner (writing trials) and the report (reading them) use this module.
"""

from __future__ import annotations

import fcntl
import functools
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol

import optuna

from modbench.errors import ModbenchError, redact
from modbench.results import METRICS
from modbench.track.store import sqlite_db_path


class Named(Protocol):
    """What this module needs of a study spec: its name (track may not import modbench.design)."""

    name: str


PARENT_ATTR = "mlflow_parent_run_id"  # the study's MLflow parent run; set once the study is fully created
SLOT_ATTR = "slot_archive"  # a study imported from lent-GPU slots (modbench.study.slot): where and how its calls ran


def parent_run_id(name: str, storage: str) -> str | None:
    """The MLflow parent run of a study (None for a study created before modbench recorded it)."""
    rdb = connect_storage(storage)
    try:
        return optuna.load_study(study_name=name, storage=rdb).user_attrs.get(PARENT_ATTR)
    finally:
        rdb.engine.dispose()


FAIL_REASON_ATTR = "fail_reason"  # why a trial failed: printed by the runner, tabled by the report


def fail_reason(exc: BaseException) -> str:
    """One line saying why a trial failed: the exception's first line (its type when it has no
    text), with any URL password masked."""
    text = str(exc).strip()
    return redact(text.splitlines()[0] if text else type(exc).__name__)[:300]


def with_fail_reason(objective: Callable[[optuna.Trial], Any]) -> Callable[[optuna.Trial], Any]:
    """``objective`` recording why a trial failed wherever in the objective it failed: Optuna keeps
    no reason, and a trial that fails before or after training must not read "unknown reason"."""

    @functools.wraps(objective)
    def recorded(trial: optuna.Trial) -> Any:
        try:
            return objective(trial)
        except (optuna.TrialPruned, KeyboardInterrupt):
            raise
        except Exception as e:
            if FAIL_REASON_ATTR not in trial.user_attrs:  # the objective's own, more precise, reason wins
                trial.set_user_attr(FAIL_REASON_ATTR, fail_reason(e))
            raise

    return recorded


def study_dir(study: Named, out_dir: str | Path) -> Path:
    return Path(out_dir) / study.name


def default_storage(study: Named, out_dir: str | Path) -> str:
    path = study_dir(study, out_dir) / "optuna.db"
    path.parent.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{path.resolve()}"


def existing_storage(study: Named, out_dir: str | Path, storage: str | None) -> str:
    """The storage a reading command (report, status) opens: ``storage`` if given (a SQLite file
    must exist), else the study's SQLite file in ``out_dir`` when it exists. ModbenchError naming
    the ways out otherwise: a reader must not leave an empty ``optuna.db`` (and its folder) behind."""
    if storage is not None:
        path = sqlite_db_path(storage)
        if path is None or path.is_file():
            return storage
    else:
        path = study_dir(study, out_dir) / "optuna.db"
        if path.is_file():
            return f"sqlite:///{path.resolve()}"
    raise ModbenchError(f"no study named {study.name!r} in {path}: run 'modbench study run' first, or pass the "
                        "--storage (or set $MODBENCH_STORAGE, or --out-dir) it ran with")


def connect_storage(url: str, **kwargs) -> optuna.storages.RDBStorage:
    """Optuna's RDB storage at ``url``; an unreachable or malformed URL is a one-line error.

    Creating a fresh SQLite store runs Optuna's schema migration; two workers started at the
    same instant would both run it and one would fail ("UNIQUE constraint failed:
    alembic_version"). A lock file beside the database makes them take turns; on PostgreSQL
    (workers on several machines) an advisory lock does the same ("duplicate key value violates
    unique constraint pg_type_typname_nsp_index" otherwise).
    """
    try:
        with _sqlite_creation_lock(url), _postgres_creation_lock(url):
            storage = SQLiteStorage if sqlite_db_path(url) else optuna.storages.RDBStorage
            return storage(url, engine_kwargs={"pool_pre_ping": True}, **kwargs)
    except ModbenchError:
        raise
    except Exception as e:  # sqlalchemy raises many kinds; the user needs the URL and the reason
        reason = next((line.strip() for line in str(e).splitlines() if line.strip()), type(e).__name__)[:200]
        raise ModbenchError(
            f"cannot open Optuna storage {redact(url)!r}: {reason}; check the URL and that the database "
            "server is running (e.g. postgresql+psycopg://user@host:5432/db or sqlite:///path/optuna.db)"
        ) from None


# pg_advisory_lock key (any constant bigint) serialising Optuna's schema creation in one database
_PG_SCHEMA_LOCK = 0x6D6F6462656E6368  # "modbench"


@contextmanager
def _postgres_creation_lock(url: str):
    if not url.startswith("postgresql"):
        yield
        return
    with advisory_lock(url, _PG_SCHEMA_LOCK):
        yield


@contextmanager
def advisory_lock(url: str, key: int):
    """A session-level ``pg_advisory_lock(key)`` on a connection of its own, held while the block
    runs: PostgreSQL releases it when the holding process dies, so no lock outlives its worker."""
    import sqlalchemy as sa

    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    try:
        with engine.connect() as conn:
            conn.execute(sa.text("SELECT pg_advisory_lock(:key)"), {"key": key})
            try:
                yield
            finally:
                conn.execute(sa.text("SELECT pg_advisory_unlock(:key)"), {"key": key})
    finally:
        engine.dispose()


@contextmanager
def file_lock(path: Path):
    """An exclusive ``flock`` on ``path`` (created), held while the block runs; the OS releases it
    when the holding process dies."""
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


class SQLiteStorage(optuna.storages.RDBStorage):
    """Optuna's RDB storage on SQLite, where taking a queued trial is atomic across processes.

    Why: a worker takes a WAITING trial by reading its state and writing RUNNING
    (``RDBStorage.set_trial_state_values``). PostgreSQL locks the row it read (``SELECT … FOR
    UPDATE``); SQLite ignores ``FOR UPDATE``, and Python's sqlite3 starts the transaction only at
    the write, so two workers could both read WAITING and both write RUNNING: both then trained the
    same (arm, seed), and the second to finish failed with "Cannot tell a COMPLETE trial" (seen in
    CI with two workers on one loaded machine). Here that read-and-write holds an ``flock`` on a file
    beside the database, so the second worker reads RUNNING and takes the next trial."""

    def set_trial_state_values(self, trial_id: int, state, values=None) -> bool:
        if state != optuna.trial.TrialState.RUNNING:
            return super().set_trial_state_values(trial_id, state, values)
        with file_lock(take_lock_path(sqlite_db_path(self.url))):
            return super().set_trial_state_values(trial_id, state, values)


def take_lock_path(db: Path) -> Path:
    """The lock file ``SQLiteStorage`` holds while a worker takes a queued trial."""
    return db.with_name(db.name + ".take.lock")


@contextmanager
def _sqlite_creation_lock(url: str):
    db = sqlite_db_path(url)
    if db is None:
        yield
        return
    lock_path = Path(db).with_name(Path(db).name + ".lock")
    try:
        open(lock_path, "a").close()
    except OSError as e:
        raise ModbenchError(f"cannot create the Optuna store {db}: {e.strerror}; check that its folder exists "
                            "and is writable, or pass --storage") from None
    with file_lock(lock_path):
        yield


def trials_frame(name: str, storage: str):
    """Every trial of a study as a pandas frame (state, arm, seed, objectives, user attrs).

    The storage's connection pool is closed before returning: a caller that polls (a test
    waiting for a trial, a status loop) must not leak a PostgreSQL connection per call.
    """
    rdb = connect_storage(storage)
    try:
        return _frame_of(name, storage, rdb)
    finally:
        rdb.engine.dispose()


def _frame_of(name: str, storage: str, rdb: optuna.storages.RDBStorage):
    import pandas as pd

    try:
        study = optuna.load_study(study_name=name, storage=rdb)
    except KeyError:
        raise ModbenchError(f"no study named {name!r} in {redact(storage)}: run 'modbench study run "
                            "<study file>' first, or pass the --storage it ran on") from None
    columns = ["number", "state", "arm", "seed", *METRICS, "steps", "mlflow_run_id", "worker", "fail_reason"]
    rows = []
    for t in study.get_trials(deepcopy=False):
        if t.user_attrs.get("surplus") or t.user_attrs.get("requeued"):  # an interrupted trial ran again
            continue
        row = {"number": t.number, "state": t.state.name, "arm": t.user_attrs.get("arm"), "seed": t.user_attrs.get("seed")}
        row.update(t.user_attrs.get("arm_params") or t.params)  # a grid point's arm, or the sampled params
        row.update({k.removeprefix("fixed."): v for k, v in t.user_attrs.items() if k.startswith("fixed.")})  # constants
        row.update({k: t.user_attrs.get(k) for k in (*METRICS, "steps", "mlflow_run_id", "worker", "fail_reason")})
        rows.append(row)
    return pd.DataFrame(rows, columns=list(dict.fromkeys(columns + [k for r in rows for k in r])))
