"""``modbench report STUDY_FILE``: write reports/<study>/report.md with plots and CSVs."""

from __future__ import annotations

import json
import os

from modbench.cli.common import add_tracking_flag, tracking_uri_of


def run(args) -> int:
    from modbench.report.build import build_report, command_line

    if args.quiet or args.json:  # MLflow's own bars while fetching checkpoints, too
        os.environ["MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR"] = "false"
    path = build_report(args.study_file, uri=tracking_uri_of(args), storage=args.storage, out_dir=args.out_dir, reports_dir=args.reports_dir,
                        command=command_line(), progress=not (args.quiet or args.json))
    if args.quiet or args.json:
        print(json.dumps({"report": str(path)}))
    else:
        print(f"report written to {path}")
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("report", help="statistics, tables and plots of a study as markdown")
    p.add_argument("study_file", help="a study file, or the name of a shipped study (modbench study list)")
    p.add_argument("--storage", help="Optuna storage URL (default: SQLite in --out-dir)")
    p.add_argument("--out-dir", default="runs/studies", help="where the study's SQLite storage and checkpoints are (default: runs/studies)")
    p.add_argument("--reports-dir", default="reports", help="the report goes to <reports-dir>/<study>/ (default: reports)")
    add_tracking_flag(p)
    p.add_argument("--quiet", action="store_true", help="no progress bars; print one JSON line")
    p.add_argument("--json", action="store_true", help="print the report's path as JSON")
    p.set_defaults(func=run)
