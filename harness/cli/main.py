"""The ``modbench`` command line.

User mistakes raise ``ModbenchError``; ``main`` prints its one line and exits with code 2.
Each subcommand lives in its own module and registers itself through ``add_parser``.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from modbench.cli import demo, generate, report, study, train, ui, variants
from modbench.errors import ModbenchError, redact



class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse prints usage + exits 2; keep it to one line
        raise ModbenchError(f"{message} (see '{self.prog} --help')")


def build_parser() -> argparse.ArgumentParser:
    from modbench import __version__

    parser = _Parser(prog="modbench", description="Benchmark and ablation suite for Mixture-of-Depths routing.")
    parser.add_argument("--version", action="version", version=f"modbench {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for module in (variants, demo, train, study, report, generate, ui):
        module.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
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


if __name__ == "__main__":
    sys.exit(main())
