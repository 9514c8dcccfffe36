"""``modbench study run FILE``, ``study status NAME|FILE``, and a study on a lent GPU:
``study slot FILE`` there, ``study import ARCHIVE`` here (``modbench.study.slot``)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from modbench.cli.common import (DEFAULT_OUT_DIR, add_storage_flag, add_tracking_flag, storage_of, study_command,
                                 tracking_uri_of)
from modbench.errors import ModbenchError, redact


def _storage_for(args) -> tuple[str, str]:
    """(study name, storage URL) for status: a study file or a name in --out-dir."""
    from modbench.design.study_file import load_study, shipped_studies
    from modbench.track.optuna_store import existing_storage

    target = Path(args.study)
    storage = storage_of(args)
    if target.suffix == ".toml" or target.is_file() or args.study in shipped_studies():
        study = load_study(args.study)
        return study.name, existing_storage(study, args.out_dir, storage)
    if storage:
        return args.study, storage
    db = Path(args.out_dir) / args.study / "optuna.db"
    if not db.is_file():
        raise ModbenchError(f"no study {args.study!r} under {args.out_dir}: give the study file, or --storage URL (or $MODBENCH_STORAGE)")
    return args.study, f"sqlite:///{db.resolve()}"


def run(args) -> int:
    from modbench.design.study_file import load_study
    from modbench.study.runner import run_study
    from modbench.track.optuna_store import trials_frame

    import time

    uri, storage = tracking_uri_of(args), storage_of(args)
    if args.minutes is not None and not args.minutes > 0:
        raise ModbenchError(f"--minutes must be positive, got {args.minutes:g}")
    if args.workers < 1:
        raise ModbenchError(f"--workers must be >= 1, got {args.workers}")
    deadline = time.time() + args.minutes * 60 if args.minutes else None
    offline = Path(args.offline_runs) if args.offline_runs else None
    helpers = HelperWorkers.start(args, uri, storage) if args.workers > 1 else None
    try:
        outcome = run_study(args.study_file, storage=storage, out_dir=args.out_dir, n_trials=args.n_trials,
                            progress=not args.quiet, heartbeat=args.heartbeat, grace=args.grace, tracking_uri=uri,
                            offline_runs=offline, deadline=deadline, amend_claims=args.amend_claims,
                            others_running=None if helpers is None else helpers.busy)
    except BaseException:
        if helpers is not None:
            helpers.stop()  # this worker's error (or Ctrl-C) is the one line; the helpers' would repeat it
        raise
    if helpers is not None:
        # The study is finished (or left) only when every worker has stopped.
        ran = helpers.join()
    frame = trials_frame(outcome.name, outcome.storage)
    if helpers is not None:  # the counts as the study stands now, every worker's trials in
        from dataclasses import replace

        from modbench.study.runner import stage_status

        counts = {str(k): int(v) for k, v in frame["state"].value_counts().items()} if len(frame) else {}
        outcome = replace(outcome, ran=outcome.ran + ran, counts=counts, stages=stage_status(outcome.name, outcome.storage))
    objectives = load_study(args.study_file).settings.objectives
    finished = study_finished(outcome.counts, outcome.stages)
    # Per-arm numbers only from a finished study: a worker that stops while others still run trials
    # would print a table taken mid-study, contradicting the last worker's (make quick runs two).
    arms = arm_summary(frame, objectives) if finished else None
    report = study_command(["report", args.study_file], tracking_uri=uri, storage=storage, out_dir=args.out_dir)
    summary = {"study": outcome.name, "storage": redact(outcome.storage), "ran": outcome.ran, "trials": outcome.counts,
               "finished": finished, "arms": [] if arms is None else arms.to_dict(orient="records"),
               "seconds": round(outcome.seconds, 1), "report": report}
    if outcome.stages:
        summary["stages"] = outcome.stages
    if args.quiet or args.json:
        print(json.dumps(summary))
    else:
        print(f"study {outcome.name}: ran {outcome.ran} trials in {outcome.seconds:.0f}s; trials by state "
              + ", ".join(f"{state} {n}" for state, n in sorted(outcome.counts.items())))
        if outcome.stages:
            from modbench.study.runner import stage_line

            print(stage_line(outcome.stages))
        if arms is None:
            from modbench.track.store import default_tracking_uri

            status_line = study_command(["study", "status", args.study_file], tracking_uri=default_tracking_uri(),
                                        storage=storage, out_dir=args.out_dir)  # status takes no --tracking-uri
            print(f"per arm: {unfinished_text(outcome.counts, outcome.stages)}; the worker that finishes the study "
                  f"prints the table (now: {status_line})")
        elif len(arms):
            print("per arm (objectives: mean over finished seeds):\n" + arms.to_markdown(index=False, floatfmt=".4f"))
        print(f"storage: {redact(outcome.storage)}\ncompare runs: {compare_hint(args.study_file, uri)}\nreport: {report}")
    if outcome.counts.get("FAIL", 0) and not outcome.counts.get("COMPLETE", 0):
        raise StudyFailed(f"every trial of study {outcome.name} failed ({outcome.counts['FAIL']}); "
                          "the reasons are in the lines above and in 'modbench study status'")
    return 0


def slot(args) -> int:
    """``modbench study slot FILE``: the study on this (lent GPU) machine until done or the deadline."""
    from modbench.study.slot import SlotSettings, parse_workers, run_slot
    from modbench.study.workers_probe import worker_counts

    settings = SlotSettings(workers=parse_workers(args.workers), probe_workers=worker_counts("--probe-workers", args.probe_workers),
                            minutes=args.minutes, checkpoint_mib=args.checkpoint_mib)
    archive = Path(args.archive) if args.archive else Path(args.out_dir) / "slot" / f"{Path(args.study_file).stem}.tar.gz"
    log = (lambda *a, **k: None) if args.quiet else (lambda line: print(line, flush=True))
    outcome = run_slot(args.study_file, settings=settings, archive=archive, out_dir=Path(args.out_dir) / "slot",
                       resume=Path(args.resume) if args.resume else None, log=log)
    if args.quiet:
        print(json.dumps({"study": outcome.study, "archive": str(outcome.archive), "trials": outcome.counts,
                          "seconds": round(outcome.wall_s, 1)}))
    return 0


def import_(args) -> int:
    """``modbench study import ARCHIVE``: a slot's runs into MLflow, its study into local storage."""
    from modbench.study.slot import import_archive

    uri = tracking_uri_of(args)
    outcome = import_archive(Path(args.archive), tracking_uri=uri, out_dir=Path(args.out_dir),
                             progress=not args.quiet)
    summary = {"study": outcome.study, "storage": redact(outcome.storage), "runs": outcome.runs,
               "trials": outcome.trials, "checkpoints_left_out": outcome.checkpoints_left_out,
               "calls": outcome.manifest["calls"]}
    if args.quiet:
        print(json.dumps(summary))
        return 0
    calls = outcome.manifest["calls"]
    print(f"imported study {outcome.study}: {outcome.trials} trials, {outcome.runs} MLflow runs, from "
          f"{len(calls)} slot call(s) on {', '.join(sorted({c.get('device', '?') for c in calls}))}")
    if outcome.checkpoints_left_out:
        print(f"{outcome.checkpoints_left_out} checkpoint(s) stayed on the slot (archive budget): the report's "
              "routing and decode-cost sections leave those arms out")
    print("report: " + study_command(["report", outcome.study], tracking_uri=uri, storage=None, out_dir=args.out_dir))
    return 0


class HelperWorkers:
    """The extra workers of ``study run --workers N``: N − 1 processes running ``study run --quiet`` on
    the same study and storage beside this one, so that one command prints one summary, once every
    worker has stopped (two commands, as ``make quick`` ran, each printed their own).

    Hand-written over ``subprocess`` because no library runs "this CLI again, N times" (Optuna's
    ``n_jobs`` runs threads in one process: one GIL, and trials that set the global torch seed would
    share it). The storage and tracking URIs go to the helpers through the environment, not their
    command lines, where ``ps`` would show a password. Their JSON line is dropped (this worker prints
    the summary); their stderr goes to a file, and a helper that fails says so in one line at the end."""

    def __init__(self, procs: list[subprocess.Popen], logs: list[Path]) -> None:
        self.procs, self.logs = procs, logs

    @classmethod
    def start(cls, args, uri: str, storage: str | None) -> "HelperWorkers":
        import os
        import sys
        import tempfile

        import torch

        from modbench.track.store import STORAGE_ENV

        from modbench.design.study_file import check_arms_train, load_study
        from modbench.study.workers_probe import thread_share

        check_arms_train(load_study(args.study_file))  # a refusal: one line from this worker, no helper started
        threads = thread_share(args.workers)
        env = {**os.environ, "MLFLOW_TRACKING_URI": uri}
        if storage:
            env[STORAGE_ENV] = storage
        env.setdefault("OMP_NUM_THREADS", str(threads))
        if "OMP_NUM_THREADS" not in os.environ:
            torch.set_num_threads(threads)  # this worker's share of the cores, as the helpers'
        command = [sys.executable, "-m", "modbench.cli.main", "study", "run", args.study_file, "--quiet",
                   "--out-dir", args.out_dir, "--heartbeat", str(args.heartbeat), "--grace", str(args.grace)]
        for flag, value in (("--n-trials", args.n_trials), ("--minutes", args.minutes), ("--offline-runs", args.offline_runs)):
            if value is not None:
                command += [flag, str(value)]
        if args.amend_claims:
            command.append("--amend-claims")
        procs, logs = [], []
        for _ in range(args.workers - 1):
            log = Path(tempfile.mkstemp(prefix="modbench-worker-", suffix=".log")[1])
            with open(log, "wb") as out:
                # Its own session: a Ctrl-C at the terminal reaches this worker alone, which passes on exactly
                # one SIGINT (``stop``); a second would stop a helper at once instead of between two steps.
                procs.append(subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env,
                                              start_new_session=True))
            logs.append(log)
        return cls(procs, logs)

    def busy(self) -> bool:
        """Whether a helper is still running (its trials are what this worker's bar counts after its own)."""
        return any(proc.poll() is None for proc in self.procs)

    def join(self) -> int:
        """Wait for every helper, say in one line each what a failed one said last; returns how many
        trials the helpers ran (their JSON lines' ``ran``)."""
        import sys

        ran = 0
        for i, (proc, log) in enumerate(zip(self.procs, self.logs), start=2):
            rc = proc.wait()
            lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
            log.unlink(missing_ok=True)
            if rc != 0:
                print(f"modbench: worker {i} of {len(self.procs) + 1} stopped with exit code {rc}"
                      + (f": {redact(lines[-1])}" if lines else ""), file=sys.stderr)
                continue
            try:
                ran += int(json.loads(lines[-1])["ran"])
            except (IndexError, ValueError, KeyError, TypeError):
                pass  # a worker that printed no summary ran nothing this summary can count
        return ran

    def stop(self) -> None:
        """SIGINT every helper (it stops between two steps and queues its trial again), then wait."""
        import signal

        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
        for proc, log in zip(self.procs, self.logs):
            try:
                proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            log.unlink(missing_ok=True)


def compare_hint(study_file: str, uri: str) -> str:
    """Where to compare the runs: ``modbench ui`` over a store, or the tracking server's own UI."""
    if uri.split("://", 1)[0].lower() in ("http", "https"):
        from modbench.cli.ui import TRAINING_LAYOUT

        return f"{redact(uri).rstrip('/')}/#/experiments?{TRAINING_LAYOUT}"
    return study_command(["ui", study_file], tracking_uri=uri, storage=None)


def study_finished(counts: dict[str, int], stages: dict | None) -> bool:
    """Whether nothing of the study is left to run: no trial waits or runs (in any worker), and a
    staged study has queued its last stage."""
    return not counts.get("WAITING", 0) and not counts.get("RUNNING", 0) and (stages is None or stages["complete"])


def unfinished_text(counts: dict[str, int], stages: dict | None) -> str:
    """What is left of an unfinished study, for the line printed instead of its per-arm table."""
    left = [f"{counts[k]} {what}" for k, what in (("RUNNING", "running"), ("WAITING", "waiting")) if counts.get(k)]
    return (f"{' and '.join(left)} trial(s) left" if left else "later stages to plan") + " (study not finished)"


class StudyFailed(ModbenchError):
    """No trial of the study finished: not a user's typo, but not a success either."""

    exit_code = 1


def arm_summary(trials, objectives: list[str]):
    """One row per arm: finished and failed trials, and each objective's mean over finished seeds."""
    import pandas as pd

    if trials.empty or "arm" not in trials:
        return pd.DataFrame()
    shown = [o for o in dict.fromkeys([*objectives, "val/causal_bpb"]) if o in trials]
    rows = []
    for arm, g in trials.groupby("arm", sort=False):
        done = g[g.state == "COMPLETE"]
        row = {"arm": arm, "complete": len(done), "failed": int((g.state == "FAIL").sum())}
        row.update({o: (float(pd.to_numeric(done[o]).mean()) if len(done) else None) for o in shown})
        rows.append(row)
    return pd.DataFrame(rows)


def status(args) -> int:
    from modbench.track.optuna_store import trials_frame
    from modbench.track.store import shell_url

    name, url = _storage_for(args)
    df = trials_frame(name, url)
    dashboard = f"optuna-dashboard {shell_url(url)}"  # a password as a reference to $PGPASSWORD
    raw_url, url = url, redact(url)  # what is shown from here on
    by_state = df["state"].value_counts().to_dict() if len(df) else {}
    from modbench.study.runner import stage_line, stage_status

    stages = stage_status(name, raw_url)  # a study with [tune]: its stages so far
    if args.json:
        print(json.dumps({"study": name, "storage": url, "trials": by_state,
                          "rows": json.loads(df.to_json(orient="records")) if len(df) else [],
                          **({"stages": stages} if stages else {})}))
        return 0
    print(f"study {name} ({url}): {len(df)} trials — " + ", ".join(f"{k} {v}" for k, v in sorted(by_state.items())))
    if stages:
        print(stage_line(stages))
    if len(df):
        cols = [c for c in ("number", "state", "arm", "seed", "val/bpb", "val/causal_bpb", "perf/flops_per_token",
                               "perf/train_tokens_per_s") if c in df]
        print(df[cols].to_markdown(index=False, floatfmt=".4g"))
    print(f"live dashboard: {dashboard}")
    return 0


def list_studies(args) -> int:
    """The studies shipped with modbench: name, size (arms × seeds), first line of the description."""
    from modbench.design.study_file import load_study, shipped_studies

    rows = []
    for name, path in sorted(shipped_studies().items()):
        s = load_study(path)
        rows.append({"study": name, "trials": planned_trials(s), "staged": bool(s.tune.lr_mult),
                     "description": (s.settings.description.strip().splitlines() or [""])[0]})
    if args.json:
        print(json.dumps(rows))
    else:
        for r in rows:
            count = f"≥ {r['trials']:>3}" if r["staged"] else f"{r['trials']:>5}"
            print(f"{r['study']:<18} {count} trials  {r['description']}")
        if any(r["staged"] for r in rows):
            print(f"≥ N trials: {STAGED_COUNT}")
        print("run one with: modbench study run NAME; read one with: modbench study show NAME")
    return 0


STAGED_COUNT = "tuning stage; later stages add extensions, confirmation and extra seeds"


def planned_trials(study) -> int:
    """Trials a study plans, counted without building a model (``study list`` must be instant):
    a grid's arms, plus one derived control per kind for each routed shape, as
    ``modbench.model.sizing.control_arms`` derives them (sizing them needs the models); times seeds.
    A study with ``[tune]`` plans in stages (``modbench.study.tuning.plan``): the count is what
    its first stage queues, a lower bound on the whole: every family that follows no other
    (``tuning.leader_of``: the random controls run at their learned arm's value later), derived
    controls included, at each value of the grid on the tuning seed."""
    if study.settings.sampler != "grid":
        return study.settings.n_trials * len(study.settings.seeds)
    if study.tune.lr_mult:
        from modbench.study.tuning import leader_of

        declared = list(dict.fromkeys(a.family for a in study.arms()))
        tuned = [f for f in declared if leader_of(f, declared) is None]
        return (len(tuned) + _derived_controls(study)) * len(study.tune.lr_mult)
    return (len(study.arms()) + _derived_controls(study)) * len(study.settings.seeds)


def _derived_controls(study) -> int:
    """The control arms ``study.controls`` derive (``Study.derived_control_count``: counted without
    building a model, so listing stays fast)."""
    return study.derived_control_count()


def show_study(args) -> int:
    """The study file's text (a shipped study by name, or a file)."""
    from modbench.design.study_file import find_study, load_study

    from modbench.design.controls import study_arms

    path = find_study(args.study)
    s = load_study(path)  # a file that does not validate is an error here too
    print(path.read_text(encoding="utf-8"), end="")
    if s.tune.lr_mult:  # a staged study: what its first stage queues (as TOML comments)
        from modbench.study.tuning import plan

        queue = plan(s, [], []).queue
        print(f"\n# ≥ {len(queue)} trials: {STAGED_COUNT}")
        for arm, seed in queue:
            print(f"#   {s.label(arm)}  [seed {seed}]")
    elif s.settings.sampler == "grid":  # what will run, derived control arms included (as TOML comments)
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
    add_storage_flag(r)
    r.add_argument("--out-dir", default=DEFAULT_OUT_DIR, help="where SQLite storage and trial checkpoints go")
    r.add_argument("--n-trials", type=int, help="run at most this many trials now")
    r.add_argument("--minutes", type=float, help="finish within this many minutes: start no trial that the longest "
                   "finished trial says would end later")
    r.add_argument("--offline-runs", metavar="DIR", help="write runs as files under DIR instead of MLflow (a machine "
                   "without MLflow); 'modbench study import' brings them into MLflow")
    r.add_argument("--amend-claims", action="store_true", help="accept a study file whose [claims.*] settings differ "
                   "from the ones pre-registered before the first confirmation trial; the report lists the amendment")
    r.add_argument("--workers", type=int, default=1, help="worker processes on this machine (default 1); the "
                   "command prints one summary once all have stopped (more workers on other machines: run the "
                   "command there too, with the same --storage)")
    r.add_argument("--heartbeat", type=int, default=10, help="seconds between trial heartbeats")
    r.add_argument("--grace", type=int, default=30, help="seconds without heartbeat before a trial counts as dead and is retried")
    add_tracking_flag(r)
    r.add_argument("--quiet", action="store_true", help="no progress bars; print one JSON line (its per-arm "
                   "'arms' only from the worker that finishes the study: 'finished' says which)")
    r.add_argument("--json", action="store_true", help="print the summary as one JSON line")
    r.set_defaults(func=run)
    sl = ssub.add_parser("slot", help="run a study on one lent GPU within a deadline: N workers, one archive "
                         "that resumes it and that 'study import' reads")
    sl.add_argument("study_file", help="a study file, or the name of a shipped study")
    sl.add_argument("--workers", default="4", help="worker processes on the one GPU, or 'auto': probe "
                    "--probe-workers first, in this call, and run with the best (default 4)")
    sl.add_argument("--probe-workers", default="4,8", help="the worker counts --workers auto measures (default 4,8)")
    sl.add_argument("--minutes", type=float, default=8.0, help="wall-clock bound of the whole call (default 8)")
    sl.add_argument("--archive", help="where the archive goes (default <out-dir>/slot/<study>.tar.gz)")
    sl.add_argument("--resume", help="an archive of an earlier slot call of this study, to go on from")
    sl.add_argument("--checkpoint-mib", type=float, default=12.0,
                    help="checkpoint weights the archive may hold (default 12; a slot returns files of <= 16 MiB)")
    sl.add_argument("--out-dir", default=DEFAULT_OUT_DIR, help="working folder (the study goes to <out-dir>/slot/<study>)")
    sl.add_argument("--quiet", action="store_true", help="print one JSON line")
    sl.set_defaults(func=slot)
    im = ssub.add_parser("import", help="import a slot archive: runs into MLflow, the study into local storage")
    im.add_argument("archive", help="the .tar.gz 'modbench study slot' wrote")
    im.add_argument("--out-dir", default=DEFAULT_OUT_DIR, help="where the study's SQLite storage goes (default: runs/studies)")
    add_tracking_flag(im)
    im.add_argument("--quiet", action="store_true", help="print one JSON line")
    im.set_defaults(func=import_)
    ls = ssub.add_parser("list", help="the studies shipped with modbench")
    ls.add_argument("--json", action="store_true", help="print a JSON list")
    ls.set_defaults(func=list_studies)
    sh = ssub.add_parser("show", help="print a study file (a shipped study by name)")
    sh.add_argument("study", help="shipped study name or study file")
    sh.set_defaults(func=show_study)
    s = ssub.add_parser("status", help="trials by state")
    s.add_argument("study", help="study file or study name")
    add_storage_flag(s)
    s.add_argument("--out-dir", default=DEFAULT_OUT_DIR, help="where the SQLite storage is (default: runs/studies)")
    s.add_argument("--json", action="store_true", help="print the counts as JSON")
    s.set_defaults(func=status)
