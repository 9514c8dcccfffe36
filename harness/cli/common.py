"""Flags several subcommands share, resolved once per command and passed down."""

from __future__ import annotations

import argparse

TRACKING_HELP = ("MLflow tracking URI: a tracking server (http://host:5000) or a store (sqlite:///path/mlflow.db); "
                 "default: $MLFLOW_TRACKING_URI, else sqlite:///<current directory>/mlflow.db")


def add_tracking_flag(parser: argparse.ArgumentParser) -> None:
    """``--tracking-uri``: every command that writes or reads runs takes it."""
    parser.add_argument("--tracking-uri", help=TRACKING_HELP)


def tracking_uri_of(args: argparse.Namespace) -> str:
    """The command's one resolution of the tracking URI (flag, else environment, else ./mlflow.db)."""
    from modbench.track.store import resolve_tracking_uri

    return resolve_tracking_uri(getattr(args, "tracking_uri", None))
