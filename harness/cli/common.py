"""Flags several subcommands share, resolved once per command and passed down, and the
commands modbench prints for the user to run next (hints, a report's *Reproduce* block)."""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path

TRACKING_HELP = ("MLflow tracking URI: a tracking server (http://host:5000) or a store (sqlite:///path/mlflow.db, "
                 "or a bare path ending in .db); default: $MLFLOW_TRACKING_URI, else sqlite:///<current directory>/mlflow.db")
STORAGE_HELP = ("Optuna storage URL, e.g. postgresql+psycopg://user@host/db (password from $PGPASSWORD or ~/.pgpass); "
                "default: $MODBENCH_STORAGE, else SQLite in --out-dir")
DEFAULT_OUT_DIR = "runs/studies"


def add_tracking_flag(parser: argparse.ArgumentParser) -> None:
    """``--tracking-uri``: every command that writes or reads runs takes it."""
    parser.add_argument("--tracking-uri", help=TRACKING_HELP)


def add_storage_flag(parser: argparse.ArgumentParser) -> None:
    """``--storage``: every command that writes or reads a study's trials takes it."""
    parser.add_argument("--storage", help=STORAGE_HELP)


def tracking_uri_of(args: argparse.Namespace) -> str:
    """The command's one resolution of the tracking URI (flag, else environment, else ./mlflow.db)."""
    from modbench.track.store import resolve_tracking_uri

    return resolve_tracking_uri(getattr(args, "tracking_uri", None))


def storage_of(args: argparse.Namespace) -> str | None:
    """The command's one resolution of the Optuna storage (flag, else $MODBENCH_STORAGE, else None:
    SQLite in --out-dir)."""
    from modbench.track.store import resolve_storage

    return resolve_storage(getattr(args, "storage", None))


def study_command(words: list[str], *, tracking_uri: str, storage: str | None,
                  out_dir: str | Path = DEFAULT_OUT_DIR, travels: bool = False) -> str:
    """``modbench WORDS...`` with the store flags this command actually used, as a shell line that
    works as printed from this directory: defaults are left out, paths under the working directory
    are relative, and a password is a reference to the environment variable its driver reads.
    ``travels``: for a file read on other machines (a report), a path outside the working directory
    is named by its last component alone, never by this machine's absolute path."""
    from modbench.track.store import default_tracking_uri, shell_url

    def path(text: str) -> str:
        return _portable(text, travels)

    line = ["modbench", *(shlex.quote(path(w)) for w in words)]
    if tracking_uri != default_tracking_uri():  # also when it came from $MLFLOW_TRACKING_URI: say it
        line += ["--tracking-uri", shell_url(path(tracking_uri))]
    if storage is not None:
        line += ["--storage", shell_url(path(storage))]
    if Path(out_dir) != Path(DEFAULT_OUT_DIR):
        line += ["--out-dir", shlex.quote(path(str(out_dir)))]
    return " ".join(line)


def _portable(text: str, travels: bool) -> str:
    """A path or ``sqlite:///`` URL under the working directory, written relative to it."""
    scheme = "sqlite:///" if text.startswith("sqlite:////") else ""
    rest = text[len(scheme):]
    if not rest.startswith("/"):
        return text
    path, cwd = Path(rest).resolve(), Path.cwd().resolve()
    if path.is_relative_to(cwd):
        return scheme + str(path.relative_to(cwd))
    return scheme + (path.name if travels else rest)
