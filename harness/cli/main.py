"""The ``modbench`` command line.

User mistakes raise ``ModbenchError``; ``main`` prints its one line and exits with code 2.
Each subcommand lives in its own module and registers itself through ``add_parser``.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from modbench.errors import ModbenchError, redact



class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse prints usage + exits 2; keep it to one line
        raise ModbenchError(f"{message} (see '{self.prog} --help')")


def build_parser() -> argparse.ArgumentParser:
    from modbench import __version__
    from modbench.cli import demo, generate, report, study, train, ui, variants  # torch: seconds

    parser = _Parser(prog="modbench", description="Benchmark and ablation suite for Mixture-of-Depths routing.")
    parser.add_argument("--version", action="version", version=f"modbench {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for module in (variants, demo, train, study, report, generate, ui):
        module.add_parser(sub)
    return parser


def _tracked_train_uri(argv: Sequence[str]) -> str | None:
    """The tracking URI when ``argv`` is ``train`` with tracking on rank 0 (a cheap guess made
    before parsing, which needs torch: a config file that turns tracking off only wastes the
    process, which is then stopped)."""
    if not argv or argv[0] != "train" or os.environ.get("RANK", "0") != "0":
        return None
    if {"--no-track", "--print-config", "-h", "--help"} & set(argv):
        return None
    from modbench.track.store import resolve_tracking_uri

    flag = None
    for i, arg in enumerate(argv):  # not argparse: it would take --track for --tracking-uri
        if arg == "--tracking-uri" and i + 1 < len(argv):
            flag = argv[i + 1]
        elif arg.startswith("--tracking-uri="):
            flag = arg.split("=", 1)[1]
    try:
        return resolve_tracking_uri(flag)
    except ModbenchError:  # the command itself says so, in its one line
        return None


def main(argv: Sequence[str] | None = None) -> int:
    from modbench.track import background

    if argv is None:
        # A real command line: start the MLflow tracker process before importing torch, so its
        # imports run beside ours (modbench.track.background). Programmatic calls (tests,
        # notebooks) start it when the run starts.
        uri = _tracked_train_uri(sys.argv[1:])
        if uri is not None:
            background.prewarm(uri)
    try:
        args = build_parser().parse_args(argv)
        return int(args.func(args) or 0)
    except ModbenchError as e:
        print(f"modbench: error: {redact(e)}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("modbench: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # `modbench variants --json | head`: the reader left; no traceback, and none at exit either.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    finally:
        background.discard_prewarmed()


if __name__ == "__main__":
    sys.exit(main())
