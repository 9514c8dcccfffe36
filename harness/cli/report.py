"""``modbench report STUDY_FILE``: write reports/<study>/report.md with plots and CSVs."""

from __future__ import annotations

import json
import os
from pathlib import Path

from modbench.cli.common import (DEFAULT_OUT_DIR, add_storage_flag, add_tracking_flag, storage_of, study_command,
                                 tracking_uri_of)


def run(args) -> int:
    from modbench.design.study_file import load_study
    from modbench.report.build import build_report
    from modbench.track.checkpoint import check_writable
    from modbench.track.optuna_store import existing_storage
    from modbench.track.store import check_sqlite_store, connect

    if args.quiet or args.json:  # MLflow's own bars while fetching checkpoints, too
        os.environ["MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR"] = "false"
    if args.from_data:
        return _rerender(args)
    # Everything the report needs is checked before the minutes it takes: the study, its trials,
    # the MLflow store and the folder the report goes to.
    uri, storage = tracking_uri_of(args), storage_of(args)
    check_sqlite_store(uri)
    study = load_study(args.study_file)
    storage = existing_storage(study, args.out_dir, storage)
    check_sqlite_store(uri, must_exist=True)  # the study ran: its runs must be in this store
    connect(uri)  # a server or database that does not answer: one line in seconds, not MLflow's minutes of retries
    check_writable(Path(args.reports_dir) / study.name, "--reports-dir")
    flags = dict(tracking_uri=uri, storage=storage_of(args), out_dir=args.out_dir, travels=True)
    reproduce = "\n".join([study_command(["study", "run", args.study_file], **flags),
                           study_command(["report", args.study_file, *_reports_dir_words(args.reports_dir)], **flags)])
    path = build_report(args.study_file, uri=uri, storage=storage, out_dir=args.out_dir, reports_dir=args.reports_dir,
                        command=reproduce, progress=not (args.quiet or args.json), tuning=_tuning_table)
    if args.quiet or args.json:
        print(json.dumps({"report": str(path)}))
    else:
        print(f"report written to {path}")
    return 0


def _rerender(args) -> int:
    """``--from-data DIR``: the report computed and rendered again from the data a report saved."""
    from modbench.errors import ModbenchError
    from modbench.report.build import rerender_report
    from modbench.track.checkpoint import check_writable
    from modbench.track.store import default_tracking_uri

    folder = Path(args.from_data)
    if not (folder / "trials.csv").is_file():
        raise ModbenchError(f"--from-data {args.from_data}: no trials.csv there; expected the folder of a report "
                            "that `modbench report` wrote, such as reports/<study>")
    study_words = [args.study_file, "--from-data", args.from_data, *_reports_dir_words(args.reports_dir)]
    check_writable(Path(args.reports_dir), "--reports-dir")
    # as the Reproduce block writes any command: no machine path (a report travels), relative where it can be
    command = study_command(["report", *study_words], tracking_uri=default_tracking_uri(), storage=None, travels=True)
    path = rerender_report(args.study_file, folder, reports_dir=args.reports_dir, tuning=_tuning_table, command=command)
    print(json.dumps({"report": str(path)}) if args.quiet or args.json else f"report written to {path}")
    return 0


def _tuning_table(study, trials):
    """The study runner's per-family tuning table, for the report (a report may not import study)."""
    from modbench.study.tuning import family_table, points_from_frame

    return family_table(study, points_from_frame(trials))


def _reports_dir_words(reports_dir: str) -> list[str]:
    return [] if Path(reports_dir) == Path("reports") else ["--reports-dir", reports_dir]


def add_parser(sub) -> None:
    p = sub.add_parser("report", help="statistics, tables and plots of a study as markdown")
    p.add_argument("study_file", help="a study file, or the name of a shipped study (modbench study list)")
    add_storage_flag(p)
    p.add_argument("--out-dir", default=DEFAULT_OUT_DIR, help="where the study's SQLite storage and checkpoints are (default: runs/studies)")
    p.add_argument("--reports-dir", default="reports", help="the report goes to <reports-dir>/<study>/ (default: reports)")
    add_tracking_flag(p)
    p.add_argument("--from-data", metavar="DIR", default=None,
                   help="compute and render the report again from the data a report saved in DIR (reports/<study>), "
                        "without the study's Optuna and MLflow stores")
    p.add_argument("--quiet", action="store_true", help="no progress bars; print one JSON line")
    p.add_argument("--json", action="store_true", help="print the report's path as JSON")
    p.set_defaults(func=run)
