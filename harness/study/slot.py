"""One study on one lent GPU, in one slot: N workers, a deadline, one archive that travels.

A *slot* is a lent machine with one GPU for a few minutes: no network, no MLflow, and what comes
back is a handful of files. ``modbench study slot STUDY`` runs a study there:

1. **Resume.** The study's folder (``<out-dir>/<study>/``: the Optuna SQLite store and the run
   folders) is taken as it is when this machine already has it (a second call), else unpacked
   from ``--resume ARCHIVE`` (a call on the next lent machine), else started afresh.
2. **Workers.** ``--workers N`` processes run ``modbench study run`` against that one SQLite
   store on the one GPU (a small model in one process leaves most of an H100 idle). Their runs are
   written as files (``modbench.track.offline``), not to MLflow, which the machine does not have.
   ``--workers auto`` measures N first, in the same call (``choose_workers``): the workers probe
   (``modbench.study.workers_probe``) runs each of ``--probe-workers`` (default 4, 8) on the study's
   heaviest arm (the most training FLOPs a token: its trials set the pace and its memory is the
   workers' peak) at a third of that arm's budget, one trial a worker, within a third of the slot at
   most (a count whose workers would not fit in the GPU's memory by the peak measured before becomes
   the most that fit: ``workers_probe.fitting_workers``); the study then runs with the fewest
   workers within 5 % of the highest trials/minute (fewer trials in flight lose less to the deadline
   and hold less memory), or with one worker when no setting ended cleanly (an out-of-memory fails
   that setting, not the study). A later call on a device of the same name reuses the choice its
   manifest records. Why in the call: a lent machine stays warm for 30 s after a command, so a probe
   in a call of its own would cost a second start or a decision made in half a minute.
3. **Deadline.** ``--minutes M`` bounds the whole command. Workers start no trial that the longest
   finished trial says would end after ``M`` minutes less the archive's reserve; a trial still
   running at that point is stopped the way Ctrl-C stops one (``modbench.interrupts``: its
   (arm, seed) is queued again, so the next call runs it whole), then the archive is written.
4. **Archive.** One ``.tar.gz`` (``write_archive``): the Optuna store (a consistent SQLite
   backup), every run folder, the study file, and ``manifest.json`` (study, commit, device,
   torch, each call's wall time and workers, which checkpoints came along). Checkpoints are
   large (weights and optimizer state) and a slot returns at most 16 MiB a file: the archive
   keeps the weights only, of the trials the report reads (each arm's lowest seed, and its
   lowest confirmation seed), smallest first, up to ``--checkpoint-mib``; the rest are named in
   the manifest, and for each of them the routing masks the report draws (16 validation windows,
   computed here, on the GPU) travel instead: the report's routing section is whole, and only its
   decode-cost measurement leaves those arms out.

``modbench study import ARCHIVE`` (on a machine with MLflow) then imports the runs into the
MLflow store, with their metric histories and artifacts, and copies the Optuna study into the
local storage with each trial pointing at its imported run, so ``modbench report STUDY`` and the
MLflow UI read a slot's study as they read one run here. Importing again replaces that copy (and
reuses the runs already imported); a local study of the same name that did not come from an
archive is never replaced.

Why hand-written: Optuna's ``copy_study`` copies trials but cannot rewrite the MLflow run ids
they hold, and neither MLflow nor Optuna has a notion of a deadline shared by several processes.
"""

from __future__ import annotations

import copy
import json
import os
import signal
import sqlite3
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from modbench.errors import ModbenchError

ARCHIVE_FORMAT = 1
MANIFEST = "manifest.json"
STORE = "optuna.db"
RUNS = "runs"  # the offline run folders (modbench.track.offline)
STUDY_FILE = "study.toml"
CHECKPOINT_ARTIFACT = "checkpoint/checkpoint.pt"
LEFT_OUT_TAG = "modbench.checkpoint_left_out"  # on an imported run whose checkpoint stayed on the slot
WEIGHT_KEYS = ("model", "config", "step", "run_id", "history")  # what report and generate read of a checkpoint
AUTO = "auto"
PROBE_SHARE = 1 / 3  # of the slot's training window, the most the probe of --workers auto may take
PROBE_SETTING_S = 90.0  # one probe setting's limit: worker start-up, then one trial a worker
PROBE_BUDGET_SHARE = 1 / 3  # of the heaviest arm's budget, one probe trial's
NEAR_BEST = 0.95  # a worker count within 5 % of the best trials/minute is as good


@dataclass(frozen=True)
class SlotSettings:
    """How one call uses its slot."""

    workers: int | Literal["auto"] = 4
    """Worker processes on the one GPU, or "auto": measure ``probe_workers`` first (module docstring)."""
    probe_workers: tuple[int, ...] = (4, 8)
    """The worker counts "auto" measures (add 1 for the probe's speed-up column)."""
    minutes: float = 8.0
    """Wall-clock bound of the whole call: workers, stop and archive."""
    reserve_s: float = 45.0
    """Seconds kept back from ``minutes`` to stop the workers and write the archive."""
    checkpoint_mib: float = 12.0
    """Checkpoint weights the archive may hold (a slot returns files of at most 16 MiB)."""

    def check(self) -> None:
        if self.workers != AUTO and (not isinstance(self.workers, int) or self.workers < 1):
            raise ModbenchError(f"--workers {self.workers!r} is not accepted: expected a positive integer or {AUTO!r}")
        if not self.probe_workers or any(n < 1 for n in self.probe_workers):
            raise ModbenchError(f"--probe-workers {self.probe_workers!r} is not accepted: expected positive integers")
        if not self.minutes * 60 > self.reserve_s:
            raise ModbenchError(f"--minutes {self.minutes:g} leaves no time to train: give more than "
                                f"{self.reserve_s / 60:.2f} minutes (the stop and archive take {self.reserve_s:g} s)")
        if self.checkpoint_mib < 0:
            raise ModbenchError(f"--checkpoint-mib must be >= 0, got {self.checkpoint_mib:g}")


def parse_workers(text: str) -> int | Literal["auto"]:
    """``--workers``: a positive integer, or "auto"."""
    text = str(text).strip().lower()
    if text == AUTO:
        return AUTO
    if not text.isdigit() or int(text) < 1:
        raise ModbenchError(f"--workers {text!r} is not accepted: expected a positive integer or {AUTO!r}")
    return int(text)


@dataclass
class SlotOutcome:
    study: str
    archive: Path
    counts: dict[str, int]
    wall_s: float
    call: dict[str, Any] = field(default_factory=dict)


# --------------------------------------------------------------------------- run


def run_slot(study_file: str, *, settings: SlotSettings, archive: Path, out_dir: Path,
             resume: Path | None = None, log=print) -> SlotOutcome:
    """Run (or resume) ``study_file`` with ``settings.workers`` workers until it is complete or
    the deadline nears, then write ``archive`` (module docstring)."""
    from modbench.design.study_file import load_study

    settings.check()
    study = load_study(study_file)  # a bad study file fails here, before anything is created
    if resume is not None and not resume.is_file():
        raise ModbenchError(f"--resume {resume}: no such archive; give the archive a previous slot wrote")
    start = time.time()
    folder = out_dir / study.name
    _restore(folder, study.name, resume, log)
    deadline = start + settings.minutes * 60 - settings.reserve_s
    machine = _machine()
    workers, probe = (settings.workers, None) if settings.workers != AUTO else \
        choose_workers(study, folder, settings, deadline, machine["device"], archive.parent, log)
    log(f"slot: study {study.name}, {_workers_text(workers)}, trials start until "
        f"{(deadline - start) / 60:.1f} min; stop and archive by {settings.minutes:g} min")
    code = _run_workers(study, folder, workers, deadline, settings.reserve_s, log)
    counts = trial_counts(study.name, folder / STORE)
    call = {"started": _iso(start), "wall_s": round(time.time() - start, 1), "workers": workers,
            "minutes": settings.minutes, "worker_exit_codes": code, "trials": counts, **machine}
    if probe is not None:
        call["probe"] = probe
    write_archive(folder, study, archive, call=call, checkpoint_mib=settings.checkpoint_mib)
    wall = time.time() - start
    log(f"slot: {', '.join(f'{k} {v}' for k, v in sorted(counts.items()))}; archive {archive} "
        f"({archive.stat().st_size / 2**20:.1f} MiB) after {wall:.0f} s")
    return SlotOutcome(study.name, archive, counts, wall, call)


def _restore(folder: Path, name: str, resume: Path | None, log) -> None:
    """The study's folder: this machine's own (a later call), else the archive's, else new."""
    if (folder / STORE).is_file():
        log(f"slot: resuming from {folder} (this machine's earlier call)")
        return
    if resume is None:
        return
    with tempfile.TemporaryDirectory(prefix="modbench-slot-") as tmp:
        manifest = _unpack(resume, Path(tmp))
        if manifest["study"] != name:
            raise ModbenchError(f"--resume {resume} holds study {manifest['study']!r}, not {name!r}: "
                                "give that study's archive")
        folder.mkdir(parents=True, exist_ok=True)
        for part in (STORE, RUNS, MANIFEST):
            src = Path(tmp) / part
            if src.exists():
                os.replace(src, folder / part)
    log(f"slot: resuming from {resume} ({len(manifest.get('calls', []))} earlier calls)")


def choose_workers(study, folder: Path, settings: SlotSettings, deadline: float, device: str, out: Path,
                   log) -> tuple[int, dict[str, Any]]:
    """``--workers auto``: (the worker count, what the manifest records of how it was chosen)."""
    earlier = earlier_choice(folder, device, settings.probe_workers)
    if earlier is not None:
        log(f"slot: {_workers_text(earlier['workers'])}, as the probe of {earlier['from']} chose on this device")
        return earlier["workers"], {"reused": earlier["from"], "chosen": earlier["workers"]}
    setting_s = min(PROBE_SETTING_S, (deadline - time.time()) * PROBE_SHARE / len(settings.probe_workers))
    if setting_s < 20:  # too short a slot to measure: the smallest candidate, untested
        fallback = min(settings.probe_workers)
        log(f"slot: no time to probe ({setting_s:.0f} s a setting); {_workers_text(fallback)}")
        return fallback, {"skipped": "no time", "candidates": list(settings.probe_workers), "chosen": fallback}
    args = auto_probe_args(study, settings.probe_workers, setting_s, out)
    log(f"slot: probing {', '.join(map(str, args.workers))} workers on {args.arms[0]!r} at {args.budget} "
        f"(at most {setting_s:.0f} s each)")
    from modbench.study.workers_probe import probe

    t0 = time.time()
    try:
        data, _ = probe(args)
    except Exception as e:  # a probe that breaks must not cost the slot its study: run the safe count
        reason = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"[:200]
        log(f"slot: the probe failed ({reason}); 1 worker")
        return 1, {"failed": reason, "candidates": list(args.workers), "chosen": 1}
    rows = [{k: s.get(k) for k in ("workers", "trials", "trials_per_min", "median_trial_s", "speedup", "peak_mem_gib",
                                    "status", "reasons", "asked")} for s in data["settings"]]
    chosen = best_worker_count(rows) or 1  # none clean: the one worker that shares nothing
    log("slot: probe " + "; ".join(f"N {r['workers']}: {r['trials_per_min']:.2f} trials/min ({r['status']})"
                                   for r in rows) + f" -> {_workers_text(chosen)}")
    return chosen, {"arm": args.arms[0], "budget": args.budget, "seconds": round(time.time() - t0, 1),
                    "candidates": list(args.workers), "settings": rows, "chosen": chosen}


def _workers_text(n: int) -> str:
    return f"{n} worker{'' if n == 1 else 's'}"


def best_worker_count(rows: list[dict[str, Any]]) -> int | None:
    """The fewest workers within ``NEAR_BEST`` of the highest trials/minute among the settings that
    ended cleanly; None when none did (the caller then runs one worker, the setting that shares nothing)."""
    ok = [r for r in rows if r["status"] == "ok" and r["trials"]]
    if not ok:
        return None
    top = max(r["trials_per_min"] for r in ok)
    return min(r["workers"] for r in ok if r["trials_per_min"] >= NEAR_BEST * top)


def earlier_choice(folder: Path, device: str, candidates: tuple[int, ...]) -> dict[str, Any] | None:
    """The worker count an earlier call of this study chose by probing the same candidates on a device
    of the same name (its manifest, restored with the study), or None."""
    manifest = folder / MANIFEST
    calls = json.loads(manifest.read_text()).get("calls", []) if manifest.is_file() else []
    for call in reversed(calls):
        probe = call.get("probe") or {}
        if call.get("device") == device and probe.get("candidates") == list(candidates) and "settings" in probe:
            return {"workers": probe["chosen"], "from": call.get("started", "an earlier call")}
    return None


def auto_probe_args(study, candidates: tuple[int, ...], setting_s: float, out: Path):
    """The probe of ``--workers auto``: the heaviest arm, a third of its budget, one trial a worker."""
    import torch

    from modbench.config.budget import Budget
    from modbench.design.controls import study_arms
    from modbench.model.sizing import flops_per_token
    from modbench.study.workers_probe import ProbeArgs

    def heaviness(arm) -> float:
        cfg = study.run_config(arm, 0)
        return flops_per_token(cfg.model, cfg.routing, cfg.train.seq_len)

    arm = max(study_arms(study), key=heaviness)
    cfg = study.run_config(arm, 0)
    budget = Budget.parse(cfg.train.budget)
    amount = budget.amount * PROBE_BUDGET_SHARE
    probe_budget = Budget(budget.kind, max(1.0, float(int(amount))) if budget.kind == "steps" else amount)
    return ProbeArgs(study=str(study.path), workers=candidates, compile=("on" if cfg.train.compile else "off",),
                     trials_per_worker=1, device="cuda" if torch.cuda.is_available() else "cpu",
                     budget=str(probe_budget), arms=(study.label(arm),), threads=0, warmup=True, out_dir=None,
                     json=out / f"{study.name}-slot-probe.json", markdown=out / f"{study.name}-slot-probe.md",
                     timeout_s=setting_s)


def _run_workers(study, folder: Path, workers: int, deadline: float, reserve_s: float, log) -> list[int]:
    """Start the workers, stop them at the deadline, return their exit codes."""
    folder.mkdir(parents=True, exist_ok=True)
    logs = folder / "logs"
    logs.mkdir(exist_ok=True)
    started = time.time()
    minutes_left = (deadline - started) / 60
    command = [sys.executable, "-m", "modbench.cli.main", "study", "run", str(study.path), "--out-dir",
               str(folder.parent), "--offline-runs", str(folder / RUNS), "--minutes", f"{minutes_left:.4f}", "--quiet"]
    from modbench.study.workers_probe import thread_share

    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(thread_share(workers)))  # each its share of the cores, as the probe measured
    procs = []
    for i in range(workers):
        with open(logs / f"worker-{i}.log", "ab") as out:
            # Each worker its own process group: the stop below reaches it and what it started.
            procs.append(subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True))
    last_note = time.time()
    while any(p.poll() is None for p in procs) and time.time() < deadline:
        time.sleep(1.0)
        if time.time() - last_note >= 30:
            last_note = time.time()
            counts = trial_counts(study.name, folder / STORE)
            log(f"slot: {time.time() - started:.0f} s, trials " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
    _stop(procs, grace_s=max(5.0, reserve_s / 2), log=log)
    return [p.returncode for p in procs]


def _stop(procs: list[subprocess.Popen], *, grace_s: float, log) -> None:
    """SIGTERM what still runs (the trial is queued again), then SIGKILL what ignores it."""
    running = [p for p in procs if p.poll() is None]
    if running:
        log(f"slot: deadline: stopping {len(running)} worker(s); their trials are queued again")
    for p in running:
        os.killpg(p.pid, signal.SIGTERM)
    end = time.time() + grace_s
    for p in running:
        try:
            p.wait(timeout=max(0.1, end - time.time()))
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)  # its RUNNING trial is retried after its heartbeat's grace
            p.wait()


def trial_counts(name: str, store: Path) -> dict[str, int]:
    """Trials by state as ``modbench study status`` counts them (surplus and re-queued ones left out)."""
    from modbench.track.optuna_store import trials_frame

    if not store.is_file():
        return {}
    frame = trials_frame(name, f"sqlite:///{store.resolve()}")
    return {str(k): int(v) for k, v in frame["state"].value_counts().items()} if len(frame) else {}


def _machine() -> dict[str, str]:
    import platform

    import torch

    from modbench.track.provenance import git_sha

    device = _cuda_device_name() if torch.cuda.is_available() else "cpu"
    return {"device": device, "torch": str(torch.__version__), "python": platform.python_version(), "git_sha": git_sha()}


# Read in a child process that exits at once, so the slot's own process does not initialise CUDA while its
# workers share the GPU: torch.cuda.get_device_name initialises CUDA in its caller, and a CUDA context
# holds ~0.5 GiB of device memory until the process ends. The probe's memory fit counts only the workers.
DEVICE_NAME_CODE = "import torch; print(torch.cuda.get_device_name(0))"


def _cuda_device_name() -> str:
    """The GPU's name, as torch reports it, read without touching CUDA in this process. Where the child
    cannot read it, this process does, so the slot still runs (perhaps holding a context)."""
    try:
        done = subprocess.run([sys.executable, "-c", DEVICE_NAME_CODE], capture_output=True, text=True, timeout=60)
        lines = done.stdout.strip().splitlines()
        if done.returncode == 0 and lines:
            return lines[-1]
    except (OSError, subprocess.TimeoutExpired):
        pass
    import torch

    return torch.cuda.get_device_name(0)


def _iso(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))


# --------------------------------------------------------------------------- archive


def write_archive(folder: Path, study, archive: Path, *, call: dict[str, Any], checkpoint_mib: float) -> dict[str, Any]:
    """Pack the study's folder into ``archive`` atomically; returns the manifest."""
    previous = json.loads((folder / MANIFEST).read_text()) if (folder / MANIFEST).is_file() else {}
    with tempfile.TemporaryDirectory(prefix="modbench-slot-") as tmp:
        stage = Path(tmp)
        _backup_sqlite(folder / STORE, stage / STORE)
        kept, left_out = _stage_runs(folder / RUNS, stage / RUNS, stage / STORE, study, checkpoint_mib)
        (stage / STUDY_FILE).write_bytes(Path(study.path).read_bytes())
        manifest = {"format": ARCHIVE_FORMAT, "study": study.name, "study_file_sha256": study.file_sha256,
                    "dataset": study.base.train.dataset, "calls": [*previous.get("calls", []), call],
                    "checkpoints": {"kept": kept, "left_out": left_out}}
        (stage / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        (folder / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")  # the next call on this machine
        archive.parent.mkdir(parents=True, exist_ok=True)
        part = archive.with_name(archive.name + ".part")
        with tarfile.open(part, "w:gz") as tar:
            for name in (MANIFEST, STUDY_FILE, STORE, RUNS):
                if (stage / name).exists():
                    tar.add(stage / name, arcname=name)
        os.replace(part, archive)
    return manifest


def _backup_sqlite(src: Path, dst: Path) -> None:
    """A consistent copy of a store other processes may still hold open (SQLite's backup API)."""
    if not src.is_file():
        raise ModbenchError(f"no Optuna store at {src}: the workers never created the study (see {src.parent}/logs)")
    with sqlite3.connect(src, timeout=30) as source, sqlite3.connect(dst) as target:
        source.backup(target)


def _stage_runs(src: Path, dst: Path, store: Path, study, checkpoint_mib: float) -> tuple[list[str], list[str]]:
    """Copy every run folder without its checkpoint, then add the weights of the checkpoints the
    report reads, smallest first, while they fit. Returns (kept, left out) run ids."""
    import shutil

    dst.mkdir(parents=True, exist_ok=True)
    if not src.is_dir():
        return [], []
    for run in sorted(p for p in src.iterdir() if p.is_dir()):
        shutil.copytree(run, dst / run.name, ignore=lambda d, names: [n for n in names if n == "checkpoint.pt"])
    wanted = [r for r in _report_runs(store, study) if (src / r / "artifacts" / CHECKPOINT_ARTIFACT).is_file()]
    sized = sorted(((src / r / "artifacts" / CHECKPOINT_ARTIFACT).stat().st_size, r) for r in wanted)
    budget, kept, left_out = checkpoint_mib * 2**20, [], []
    for _, run_id in sized:
        target = dst / run_id / "artifacts" / CHECKPOINT_ARTIFACT
        size = _write_weights(src / run_id / "artifacts" / CHECKPOINT_ARTIFACT, target)
        if size <= budget:
            budget -= size
            kept.append(run_id)
        else:
            target.unlink()
            left_out.append(run_id)
            _write_masks(src / run_id / "artifacts" / CHECKPOINT_ARTIFACT, dst / run_id)
    return kept, left_out


def _write_masks(checkpoint: Path, run: Path) -> None:
    """The routing masks the report draws from a checkpoint, computed here from the one that stays
    (on the GPU when there is one: a forward of 16 windows), kept as the run's artifact and tag."""
    import torch

    from modbench.report.routing_analysis import MASKS_ARTIFACT, MASKS_TAG, save_masks, selection_masks

    x, masks, _ = selection_masks(checkpoint, device="cuda" if torch.cuda.is_available() else "cpu")
    if not masks:  # a dense model routes nothing: the report draws nothing for it
        return
    save_masks(run / "artifacts" / MASKS_ARTIFACT, x, masks)
    meta = json.loads((run / "run.json").read_text())
    meta["tags"][MASKS_TAG] = MASKS_ARTIFACT
    (run / "run.json").write_text(json.dumps(meta))


def _write_weights(src: Path, dst: Path) -> int:
    """The checkpoint without its optimizer and RNG states (what report and generate read)."""
    from modbench.track.checkpoint import load_checkpoint, save_checkpoint

    state = load_checkpoint(src)
    save_checkpoint(dst, {k: state[k] for k in WEIGHT_KEYS if k in state})
    return dst.stat().st_size


def _report_runs(store: Path, study) -> list[str]:
    """The runs whose checkpoints the report reads: for each arm, its trial of lowest seed and
    its trial of lowest seed other than the tuning seed (``modbench.report.build`` routing,
    ``modbench.report.decode_costs``)."""
    import optuna

    from modbench.track.optuna_store import connect_storage

    rdb = connect_storage(f"sqlite:///{store}")
    try:
        trials = optuna.load_study(study_name=study.name, storage=rdb).get_trials(
            deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
    finally:
        rdb.engine.dispose()
    tuning_seed = study.tune.seed if study.tune.lr_mult else None
    chosen: dict[tuple[str, bool], tuple[int, str]] = {}
    for t in trials:
        arm, seed, run_id = t.user_attrs.get("arm"), t.user_attrs.get("seed"), t.user_attrs.get("mlflow_run_id")
        if arm is None or seed is None or not run_id:
            continue
        for confirming in (False, True):
            if confirming and seed == tuning_seed:
                continue
            key = (arm, confirming)
            if key not in chosen or seed < chosen[key][0]:
                chosen[key] = (int(seed), run_id)
    return list(dict.fromkeys(run_id for _, run_id in chosen.values()))


def _unpack(archive: Path, dest: Path) -> dict[str, Any]:
    """Extract a slot archive (nothing outside ``dest``: tarfile's ``data`` filter) and return its manifest."""
    try:
        with tarfile.open(archive, "r:gz") as tar:
            tar.extractall(dest, filter="data")
        manifest = json.loads((dest / MANIFEST).read_text())
    except (tarfile.TarError, OSError, ValueError, KeyError) as e:
        raise ModbenchError(f"{archive} is not a slot archive ({type(e).__name__}: {str(e)[:120]}): give a file "
                            "'modbench study slot' wrote") from None
    if manifest.get("format") != ARCHIVE_FORMAT:
        raise ModbenchError(f"{archive} has archive format {manifest.get('format')!r}; this modbench reads "
                            f"format {ARCHIVE_FORMAT}")
    return manifest


# --------------------------------------------------------------------------- import


@dataclass
class ImportOutcome:
    study: str
    storage: str
    runs: int
    trials: int
    checkpoints_left_out: int
    manifest: dict[str, Any]


def import_archive(archive: Path, *, tracking_uri: str, out_dir: Path, progress: bool = False) -> ImportOutcome:
    """Import a slot archive's runs into MLflow and its study into the local Optuna storage."""
    import optuna

    from modbench.track.offline import import_offline_runs
    from modbench.track.optuna_store import connect_storage
    from modbench.track.store import check_sqlite_store

    if not archive.is_file():
        raise ModbenchError(f"no archive at {archive}: give the .tar.gz a slot wrote")
    optuna.logging.set_verbosity(optuna.logging.ERROR)  # no "A new study created" line
    with tempfile.TemporaryDirectory(prefix="modbench-slot-") as tmp:
        manifest = _unpack(archive, Path(tmp))  # a file that is no archive: one line, nothing created
        name = manifest["study"]
        folder = out_dir / name
        url = f"sqlite:///{(folder / STORE).resolve()}"
        if (folder / STORE).is_file():
            _refuse_foreign_study(name, url)
        check_sqlite_store(tracking_uri)
        _tag_left_out(Path(tmp) / RUNS, manifest["checkpoints"]["left_out"])
        mapping = import_offline_runs(Path(tmp) / RUNS, uri=tracking_uri, progress=progress)
        folder.mkdir(parents=True, exist_ok=True)
        source = connect_storage(f"sqlite:///{Path(tmp) / STORE}")
        target = connect_storage(url)
        try:
            trials = _copy_study(source, target, name, mapping, manifest)
        finally:
            source.engine.dispose()
            target.engine.dispose()
    return ImportOutcome(name, url, len(mapping), trials, len(manifest["checkpoints"]["left_out"]), manifest)


def _refuse_foreign_study(name: str, url: str) -> None:
    import optuna

    from modbench.track.optuna_store import SLOT_ATTR, connect_storage

    rdb = connect_storage(url)
    try:
        existing = optuna.load_study(study_name=name, storage=rdb)
    except KeyError:
        return
    finally:
        rdb.engine.dispose()
    if SLOT_ATTR not in existing.user_attrs:
        raise ModbenchError(f"{url.removeprefix('sqlite:///')} already holds a study {name!r} that was not imported "
                            "from a slot archive: import into another --out-dir, or move that study away first")


def _tag_left_out(runs: Path, left_out: list[str]) -> None:
    """Runs whose checkpoint stayed on the slot say so (and name none the report would fetch)."""
    from modbench.track.records import CHECKPOINT_TAG

    for run_id in left_out:
        meta_path = runs / run_id / "run.json"
        meta = json.loads(meta_path.read_text())
        meta["tags"].pop(CHECKPOINT_TAG, None)
        meta["tags"][LEFT_OUT_TAG] = "the slot archive's checkpoint budget (modbench study slot --checkpoint-mib)"
        meta_path.write_text(json.dumps(meta))
    for run in runs.iterdir() if runs.is_dir() else []:
        if run.is_dir() and run.name not in left_out and not (run / "artifacts" / CHECKPOINT_ARTIFACT).is_file():
            meta = json.loads((run / "run.json").read_text())
            if CHECKPOINT_TAG in meta["tags"]:  # a run the report does not read: its checkpoint never travels
                meta["tags"].pop(CHECKPOINT_TAG)
                (run / "run.json").write_text(json.dumps(meta))


CALL_KEYS = ("started", "wall_s", "minutes", "workers", "device", "torch", "git_sha", "trials")
PROBE_ROW_KEYS = ("workers", "trials_per_min", "peak_mem_gib", "status")


def call_summary(call: dict[str, Any]) -> dict[str, Any]:
    """What the imported study keeps of one slot call (its manifest entry), for the report's compute
    line: where, how long, how many workers and how the probe chose them; not the workers' exit codes
    or the probe's failure reasons, whose text may hold the lent machine's paths."""
    out = {k: call[k] for k in CALL_KEYS if k in call}
    probe = call.get("probe")
    if probe:
        out["probe"] = {"chosen": probe.get("chosen"), "reused": "reused" in probe, "skipped": "skipped" in probe,
                        "failed": "failed" in probe,
                        "settings": [{**{k: r.get(k) for k in PROBE_ROW_KEYS},
                                      "asked": (r.get("asked") or {}).get("workers")} for r in probe.get("settings", [])]}
    return out


def _copy_study(source, target, name: str, mapping: dict[str, str], manifest: dict[str, Any]) -> int:
    """``optuna.copy_study`` with each trial's run id rewritten to its imported MLflow run."""
    import optuna
    from optuna.trial import TrialState

    from modbench.track.optuna_store import PARENT_ATTR, SLOT_ATTR

    src = optuna.load_study(study_name=name, storage=source)
    try:
        optuna.delete_study(study_name=name, storage=target)  # an earlier import of this archive (checked above)
    except KeyError:
        pass
    kwargs = {"directions": src.directions} if len(src.directions) > 1 else {"direction": src.direction}
    dst = optuna.create_study(study_name=name, storage=target, **kwargs)
    for key, value in src.user_attrs.items():
        dst.set_user_attr(key, mapping.get(value, value) if key == PARENT_ATTR else value)
    dst.set_user_attr(SLOT_ATTR, {"calls": [call_summary(c) for c in manifest["calls"]],
                                  "study_file_sha256": manifest["study_file_sha256"]})
    copies = []
    for t in src.get_trials(deepcopy=False):
        c = copy.deepcopy(t)
        run_id = c.user_attrs.get("mlflow_run_id")
        if run_id in mapping:
            c.set_user_attr("mlflow_run_id", mapping[run_id])
        if c.state == TrialState.RUNNING:  # a worker killed without re-queueing: its trial did not finish
            c.state, c.datetime_complete = TrialState.FAIL, c.datetime_start
        copies.append(c)
    dst.add_trials(copies)
    # as ``modbench study status`` counts them: a surplus trial (a worker found the queue empty) or a
    # re-queued one (its point ran again) is kept in the copy but is no trial of the study's
    return sum(1 for c in copies if not c.user_attrs.get("surplus") and not c.user_attrs.get("requeued"))
