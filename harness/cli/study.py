"""``modbench study run FILE`` and ``modbench study status NAME|FILE``."""

from __future__ import annotations

import json
from pathlib import Path

from modbench.cli.common import add_tracking_flag, tracking_uri_of
from modbench.errors import ModbenchError, redact


def _storage_for(args) -> tuple[str, str]:
    """(study name, storage URL) for status: a study file or a name in --out-dir."""
    from modbench.track.optuna_store import default_storage
    from modbench.config.study import load_study

    from modbench.config.study import shipped_studies

    target = Path(args.study)
    if target.suffix == ".toml" or target.is_file() or args.study in shipped_studies():
        study = load_study(args.study)
        return study.name, args.storage or default_storage(study, args.out_dir)
    if args.storage:
        return args.study, args.storage
    db = Path(args.out_dir) / args.study / "optuna.db"
    if not db.is_file():
        raise ModbenchError(f"no study {args.study!r} under {args.out_dir}: give the study file, or --storage URL")
    return args.study, f"sqlite:///{db.resolve()}"


def run(args) -> int:
    from modbench.study.runner import run_study

    outcome = run_study(args.study_file, storage=args.storage, out_dir=args.out_dir, n_trials=args.n_trials,
                        progress=not args.quiet, heartbeat=args.heartbeat, grace=args.grace,
                        tracking_uri=tracking_uri_of(args))
    summary = {"study": outcome.name, "storage": redact(outcome.storage), "ran": outcome.ran, "trials": outcome.counts,
               "best": outcome.best, "seconds": round(outcome.seconds, 1)}
    if args.quiet or args.json:
        print(json.dumps(summary))
    else:
        print(f"study {outcome.name}: ran {outcome.ran} trials in {outcome.seconds:.0f}s; trials by state {outcome.counts}")
        if outcome.best:
            print(f"best so far: {outcome.best}")
        print(f"storage: {redact(outcome.storage)}\ncompare runs: modbench ui {args.study_file}; "
              f"report: modbench report {args.study_file}")
    return 0


def status(args) -> int:
    from modbench.track.optuna_store import trials_frame

    name, url = _storage_for(args)
    df = trials_frame(name, url)
    url = redact(url)  # what is shown from here on
    by_state = df["state"].value_counts().to_dict() if len(df) else {}
    if args.json:
        print(json.dumps({"study": name, "storage": url, "trials": by_state,
                          "rows": json.loads(df.to_json(orient="records")) if len(df) else []}))
        return 0
    print(f"study {name} ({url}): {len(df)} trials — " + ", ".join(f"{k} {v}" for k, v in sorted(by_state.items())))
    if len(df):
        cols = [c for c in ("number", "state", "arm", "seed", "val/bpb", "val/causal_bpb", "perf/flops_per_token",
                               "perf/train_tokens_per_s") if c in df]
        print(df[cols].to_markdown(index=False, floatfmt=".4g"))
    print(f"live dashboard: optuna-dashboard {url}")
    return 0


def list_studies(args) -> int:
    """The studies shipped with modbench: name, size (arms × seeds), first line of the description."""
    from modbench.config.study import load_study, shipped_studies
    from modbench.model.sizing import study_arms

    rows = []
    for name, path in sorted(shipped_studies().items()):
        s = load_study(path)
        arms = len(study_arms(s)) if s.settings.sampler == "grid" else s.settings.n_trials
        rows.append({"study": name, "trials": arms * len(s.settings.seeds),
                     "description": (s.settings.description.strip().splitlines() or [""])[0]})
    if args.json:
        print(json.dumps(rows))
    else:
        for r in rows:
            print(f"{r['study']:<18} {r['trials']:>4} trials  {r['description']}")
        print("run one with: modbench study run NAME; read one with: modbench study show NAME")
    return 0


def show_study(args) -> int:
    """The study file's text (a shipped study by name, or a file)."""
    from modbench.config.study import find_study, load_study

    from modbench.model.sizing import study_arms

    path = find_study(args.study)
    s = load_study(path)  # a file that does not validate is an error here too
    print(path.read_text(encoding="utf-8"), end="")
    if s.settings.sampler == "grid":  # what will run, derived control arms included (as TOML comments)
        arms = study_arms(s)
        print(f"\n# The grid: {len(arms)} arms × {len(s.settings.seeds)} seeds")
        for arm in arms:
            print(f"#   {s.label(arm)}" + (f"  [{arm.budget}]" if arm.control.startswith("iso") else ""))
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("study", help="run or inspect an Optuna ablation study from a study file")
    ssub = p.add_subparsers(dest="study_command", required=True, parser_class=type(p))
    r = ssub.add_parser("run", help="run (or resume) a study; several workers may run it against one --storage")
    r.add_argument("study_file", help="a study file, or the name of a shipped study (modbench study list)")
    r.add_argument("--storage", help="Optuna storage URL (default: SQLite in --out-dir), e.g. postgresql+psycopg://user@host/db")
    r.add_argument("--out-dir", default="runs/studies", help="where SQLite storage and trial checkpoints go")
    r.add_argument("--n-trials", type=int, help="run at most this many trials now")
    r.add_argument("--heartbeat", type=int, default=10, help="seconds between trial heartbeats")
    r.add_argument("--grace", type=int, default=30, help="seconds without heartbeat before a trial counts as dead and is retried")
    add_tracking_flag(r)
    r.add_argument("--quiet", action="store_true", help="no progress bars; print one JSON line")
    r.add_argument("--json", action="store_true", help="print the summary as one JSON line")
    r.set_defaults(func=run)
    ls = ssub.add_parser("list", help="the studies shipped with modbench")
    ls.add_argument("--json", action="store_true", help="print a JSON list")
    ls.set_defaults(func=list_studies)
    sh = ssub.add_parser("show", help="print a study file (a shipped study by name)")
    sh.add_argument("study", help="shipped study name or study file")
    sh.set_defaults(func=show_study)
    s = ssub.add_parser("status", help="trials by state")
    s.add_argument("study", help="study file or study name")
    s.add_argument("--storage", help="Optuna storage URL (default: SQLite in --out-dir)")
    s.add_argument("--out-dir", default="runs/studies", help="where the SQLite storage is (default: runs/studies)")
    s.add_argument("--json", action="store_true", help="print the counts as JSON")
    s.set_defaults(func=status)
