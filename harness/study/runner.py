"""Run an ablation study from a study file with Optuna, tracked in MLflow.

- Storage: SQLite in the study's output folder by default; ``--storage`` takes any SQLAlchemy
  URL (PostgreSQL for workers on several machines running the same command). Heartbeats mark
  a killed worker's trial FAILED once its grace period passes, and a retry callback queues the
  same (arm, seed) again, so nothing is lost and nothing is run twice.
- A trial is one (arm, seed). Grid studies queue every arm × seed when the study is created;
  model-based samplers propose an arm and queue the remaining seeds of that arm, so every arm
  runs the same seeds and statistics compare like with like.
- A study with [tune] runs in stages (``modbench.study.tuning``: tune → extend → optimum →
  confirm → seeds): what a stage queues depends on the finished trials of the ones before. When
  nothing waits, a worker takes the storage's stage lock (``stage_lock``), and if no trial is
  still running it plans and queues the next stage; a worker that finds trials of the current
  stage still running waits for them instead of exiting. The study is complete, and its MLflow
  parent run ends, when the last stage has nothing more to queue.
- Re-running the command resumes: finished trials are never repeated; ``--n-trials`` caps how
  many this invocation runs (and lets a model-based study sample more arms than its file says).
- MLflow: one experiment per study, a parent run for the study and a child run per trial, with
  the trial's number, params, state and objective values. Pruned trials end KILLED, failed ones
  FAILED. On a machine without MLflow (a lent GPU), ``offline_runs`` writes the same runs as
  files (``modbench.track.offline``), imported into MLflow later (``modbench.study.slot``).
- A deadline (``deadline``, seconds since the epoch) stops a worker from starting a trial that
  would not finish before it: the estimate is the longest trial the study has finished so far
  (every worker's), so a slot's last minutes are not spent on a trial that would be cut off.
"""

from __future__ import annotations

import hashlib
import math
import os
import socket
import sys
import time
import warnings
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import TrialState

from modbench import interrupts
from modbench.errors import ModbenchError, redact
from modbench.results import RunRecord
from modbench.design.arm import Arm
from modbench.design.study_file import StudySpec, check_arms_train, load_study
from modbench.design.controls import study_arms
from modbench.study.points import (
    FIXED_ATTR, GRID_PARAMS_ATTR, arm_of, check_preregistration, preregister, fixed_settings, grid_attrs, grid_params,
    point_attrs, queue_new_grid_points, record_grid_params, refuse_changed_fixed_settings, suggest_arm,
)
from modbench.study import tuning
from modbench.track.checkpoint import check_writable
from modbench.track.provenance import git_sha
from modbench.track.optuna_store import (PARENT_ATTR, advisory_lock, connect_storage, default_storage, file_lock,
                                        study_dir, with_fail_reason)
from modbench.track.tracking import RunTracker, Tracker, fail_stale_runs
from modbench.run.train import train

FINISHED = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)
TRIAL_ROLE = "trial"  # MLflow tag modbench.role of a trial's run (the study's parent run: "study")
CREATION_WAIT_S = 300.0  # how long a worker waits for another to finish creating the study
STAGE_POLL_S = 1.0  # how often a worker with nothing to run looks whether the current stage has finished
STAGES_ATTR = "stages"  # study user attr: the stages queued so far, in order ({"stage", "queued", "record"})
STAGES_DONE_ATTR = "stages_complete"  # study user attr: True once the last stage has nothing left to queue
STUDY_FILES_ATTR = "study_files"  # study user attr: {sha256: resolved path} of every study file that has run it


@contextmanager
def stage_lock(url: str, name: str):
    """Held while a worker plans and queues a study's next stage, so that it happens once.

    Why a lock and not a compare-and-set attribute: the check (nothing waits or runs, the plan
    has something missing) and the writes (the trials, the stage record) are many statements, and
    a lock the database or the OS holds for a *process* is released when that process dies
    (no stale lock to expire). SQLite: ``flock`` on a file beside the database (SQLite storage is
    one host's file). PostgreSQL: a session-level ``pg_advisory_lock`` keyed by the study name,
    held on a connection of its own. Planning is also idempotent (``tuning.plan`` returns only
    points with no trial yet), so a second worker that gets the lock after the first finds the
    stage queued and queues nothing.
    """
    if url.startswith("sqlite:///") and ":memory:" not in url:
        db = Path(url.removeprefix("sqlite:///"))
        with file_lock(db.with_name(f"{db.name}.{name}.stages.lock")):
            yield
    elif url.startswith("sqlite://"):  # in memory: one process, no other worker can see it
        yield
    elif url.startswith("postgresql"):
        key = int.from_bytes(hashlib.sha256(f"modbench.stages.{name}".encode()).digest()[:8], "big", signed=True)
        with advisory_lock(url, key):
            yield
    else:
        check_stage_storage(url)


def check_stage_storage(url: str) -> None:
    """A study with [tune] needs a storage ``stage_lock`` can lock: refused before anything is written."""
    if not url.startswith(("sqlite://", "postgresql")):
        raise ModbenchError(f"storage {redact(url)!r}: a study with [tune] runs in stages, which need SQLite or "
                            "PostgreSQL storage (a lock that ends with its worker); use sqlite:///… or postgresql+psycopg://…")


class StudyInterrupted(ModbenchError):
    """Ctrl-C or SIGTERM: the running trial was re-queued; exit code 130 (the shell's for SIGINT)."""

    exit_code = 130


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, another user's
        return True
    return True


@dataclass
class StudyOutcome:
    name: str
    storage: str
    ran: int
    counts: dict[str, int]
    best: dict[str, Any] | None
    seconds: float
    stages: dict[str, Any] | None = None  # a study with [tune]: ``stage_status``


@dataclass(frozen=True)
class RunDestination:
    """Where a study's runs go: the MLflow store at ``tracking_uri``, or run folders under
    ``offline`` (``modbench.track.offline``: a machine without MLflow; imported afterwards)."""

    tracking_uri: str
    offline: Path | None = None

    def tracker(self, experiment: str, **kwargs: Any) -> RunTracker:
        if self.offline is not None:
            from modbench.track.offline import OfflineTracker

            return OfflineTracker(experiment, root=self.offline, **kwargs)
        return Tracker(experiment, uri=self.tracking_uri, **kwargs)

    def fail(self, experiment: str, run_ids: list[str], reason: str) -> None:
        """End the runs of workers that died (RUNNING → FAILED), their ``optuna.state`` tag with
        them: the trial is FAIL in Optuna now, and the dead worker left the tag at RUNNING."""
        tags = {"optuna.state": "FAIL", "modbench.fail_reason": reason}
        if self.offline is not None:
            from modbench.track.offline import fail_offline_runs

            fail_offline_runs(self.offline, run_ids, tags)
        else:
            fail_stale_runs(experiment, uri=self.tracking_uri, run_ids=run_ids, tags=tags)

    def finish_parent(self, experiment: str, run_id: str, metrics: dict[str, float]) -> None:
        """Log the study's summary metrics on its parent run and end it FINISHED."""
        if self.offline is not None:
            parent = self.tracker(experiment, run_id=run_id).start()
            parent.log_metrics(metrics, step=0)
            parent.end("FINISHED")
            return
        from mlflow.tracking import MlflowClient

        client = MlflowClient(self.tracking_uri)
        for name, value in metrics.items():
            client.log_metric(run_id, name, value)
        client.set_terminated(run_id, "FINISHED")


def open_storage(url: str, experiment: str, *, runs: RunDestination, heartbeat: int, grace: int,
                 max_retry: int = 2) -> optuna.storages.RDBStorage:
    with warnings.catch_warnings():  # heartbeats are marked experimental in Optuna 5
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        retry = optuna.storages.RetryHeartbeatStaleTrialCallback(max_retry=max_retry)

        def on_stale(study: optuna.Study, trial: optuna.trial.FrozenTrial) -> None:
            # The worker died: its MLflow child run must not stay RUNNING forever.
            run_id = trial.user_attrs.get("mlflow_run_id")
            if run_id:
                runs.fail(experiment, [run_id], "worker lost (no heartbeat)")
            retry(study, trial)

        return connect_storage(url, heartbeat_interval=heartbeat, grace_period=grace,
                               heartbeat_stale_trial_callback=on_stale)


def make_sampler(study: StudySpec) -> optuna.samplers.BaseSampler:
    seed = study.settings.seeds[0]
    return {
        "grid": lambda: optuna.samplers.RandomSampler(seed=seed),  # never consulted: every grid trial is queued
        "random": lambda: optuna.samplers.RandomSampler(seed=seed),
        "tpe": lambda: optuna.samplers.TPESampler(seed=seed, multivariate=True),
        "nsga2": lambda: optuna.samplers.NSGAIISampler(seed=seed),
    }[study.settings.sampler]()


def make_pruner(study: StudySpec) -> optuna.pruners.BasePruner:
    return {
        "none": optuna.pruners.NopPruner,
        "median": lambda: optuna.pruners.MedianPruner(n_startup_trials=len(study.settings.seeds), n_warmup_steps=1),
        "hyperband": optuna.pruners.HyperbandPruner,
    }[study.settings.pruner]()


def objective_values(study: StudySpec, record: RunRecord) -> list[float]:
    """The study's objectives, read from the run's record by their declared names."""
    return [record.value(o) for o in study.settings.objectives]


def intermediate_metric(objective: str) -> str:
    """The periodic validation metric a trial reports at every evaluation: the objective itself
    when it is one (val/causal_bpb is measured at every evaluation too), else top-k val bpb."""
    name = objective.removeprefix("val/")
    return name if objective.startswith("val/") and name in ("bpb", "causal_bpb") else "bpb"


class Runner:
    def __init__(self, study: StudySpec, storage_url: str, out_dir: Path, *, tracking_uri: str, heartbeat: int,
                 grace: int, offline_runs: Path | None = None, deadline: float | None = None,
                 amend_claims: bool = False) -> None:
        self.study = study
        self.out_dir = out_dir
        self.storage_url = storage_url
        self.runs = runs = RunDestination(tracking_uri, offline_runs)
        self.deadline = deadline  # seconds since the epoch: no trial starts that would end after it
        self.amend_claims = amend_claims  # a change of the pre-registered claim settings is recorded, not refused
        self.interrupted: str | None = None  # which trial a Ctrl-C / SIGTERM re-queued
        self.trial_progress = False  # a step bar (loss, tokens/s) inside each trial: set by ``run``
        if study.tune.lr_mult:
            check_stage_storage(storage_url)
        self.storage = open_storage(storage_url, study.name, runs=runs, heartbeat=heartbeat, grace=grace)
        self.optuna = self._create_or_load()

    # --- study creation: exactly one worker creates, queues the grid and the parent run ----
    def _create_or_load(self) -> optuna.Study:
        s = self.study
        kwargs = dict(storage=self.storage, study_name=s.name, sampler=make_sampler(s), pruner=make_pruner(s))
        if len(s.directions) == 1:
            kwargs["direction"] = s.directions[0]
        else:
            kwargs["directions"] = s.directions
        try:
            study = optuna.create_study(load_if_exists=False, **kwargs)
            created = True
        except optuna.exceptions.DuplicatedStudyError:
            study = optuna.load_study(storage=self.storage, study_name=s.name, sampler=kwargs["sampler"], pruner=kwargs["pruner"])
            created = False
        if created:
            try:
                self._initialise(study)
            except BaseException:
                # All or nothing: a study whose parent run or grid could not be created (a broken MLflow
                # store, an arm without a matched control) is removed, so a re-run starts it afresh
                # instead of waiting for a creator that is gone.
                optuna.delete_study(study_name=s.name, storage=self.storage)
                raise
        else:
            self._refuse_another_file(study)
            if study.directions != [optuna.study.StudyDirection.MINIMIZE if d == "minimize" else optuna.study.StudyDirection.MAXIMIZE for d in s.directions]:
                raise ModbenchError(f"study {s.name!r} in {self.storage_url} has other objectives than {s.path}: give the study a new name")
            refuse_changed_fixed_settings(study, s, self.storage_url)
            check_preregistration(study, s, amend=self.amend_claims, commit=git_sha(), at=_now())
            deadline = time.monotonic() + CREATION_WAIT_S
            while PARENT_ATTR not in study.user_attrs:  # a worker that lost the creation race waits
                if time.monotonic() > deadline:
                    raise ModbenchError(
                        f"study {s.name!r} in {redact(self.storage_url)} was created but never finished "
                        f"initialising (its creating worker may have died within {CREATION_WAIT_S:g} s): "
                        f"delete it (optuna delete-study --study-name {s.name} --storage URL) or rename the study"
                    )
                time.sleep(0.2)
                study = optuna.load_study(storage=self.storage, study_name=s.name, sampler=kwargs["sampler"], pruner=kwargs["pruner"])
            if s.settings.sampler == "grid" and study.user_attrs.get("study_file_sha256") != s.file_sha256:
                if not s.tune.lr_mult:  # a staged study's next plan queues what the edit adds
                    queue_new_grid_points(study, s)  # the first worker to see the edited file queues what it adds
                study.set_user_attr("study_file_sha256", s.file_sha256)
            self._record_file(study)
        return study

    def _record_file(self, study: optuna.Study) -> None:
        """Remember this study file (its sha256 and where it is) as one that runs the study."""
        files = dict(study.user_attrs.get(STUDY_FILES_ATTR, {}))
        if files.get(self.study.file_sha256) is None:
            files[self.study.file_sha256] = str(Path(self.study.path).resolve())
            study.set_user_attr(STUDY_FILES_ATTR, files)

    def _refuse_another_file(self, study: optuna.Study) -> None:
        """A different study file that happens to share ``[study] name`` must not add its arms to
        this study (its trials would mix into the other's report). Accepted: a file with the content
        of one that ran the study (a copy on another worker's machine), or an edit of such a file in
        place (adding arms or seeds to one's own study is how a study grows). A study created before
        modbench recorded its files accepts any, as before."""
        files = study.user_attrs.get(STUDY_FILES_ATTR)
        here = str(Path(self.study.path).resolve())
        if files is None or self.study.file_sha256 in files or here in files.values():
            return
        first = next(iter(files.values()))
        raise ModbenchError(
            f"{self.study.path}: study {self.study.name!r} in {redact(self.storage_url)} was created from another file "
            f"({first}) and this file differs from it: rename study.name in {Path(self.study.path).name} to start a new "
            f"study, or run {first} to resume that one")

    def _grid_params(self) -> dict[str, list[str] | None]:
        """The axes this grid study's trials carry as params (``grid_params``), fixed when the study was
        created; a study created before modbench recorded them fixes them now, from this file."""
        axes = self.optuna.user_attrs.get(GRID_PARAMS_ATTR)
        if axes is None:
            axes = grid_params(self.study)
            self.optuna.set_user_attr(GRID_PARAMS_ATTR, axes)
        return axes

    def _initialise(self, study: optuna.Study) -> None:
        """The creating worker's part: attributes, the MLflow parent run, the whole grid queued."""
        s = self.study
        study.set_user_attr("study_file_sha256", s.file_sha256)
        if s.settings.sampler == "grid":
            study.set_user_attr(GRID_PARAMS_ATTR, grid_params(s))
        self._record_file(study)
        study.set_user_attr("objectives", s.settings.objectives)
        study.set_user_attr(FIXED_ATTR, fixed_settings(s))
        with warnings.catch_warnings():  # experimental in Optuna 5
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            study.set_metric_names(list(s.settings.objectives))  # the dashboard shows val/bpb, not "Objective 0"
        parent = self.runs.tracker(s.name, run_name=f"study {s.name}", tags={"modbench.study": s.name, "modbench.role": "study"},
                                   experiment_description=s.settings.description).start()
        parent.log_params({"study.file": str(s.path), "study.sampler": s.settings.sampler, "study.pruner": s.settings.pruner,
                           "study.seeds": s.settings.seeds, "study.objectives": s.settings.objectives,
                           "study.file_sha256": s.file_sha256, **{f"base.{k}": v for k, v in s.base.to_dict().items()}})
        parent.flush()
        if s.tune.lr_mult:
            self._advance(study)  # the first stage (tune); the later ones follow the trials
        elif s.settings.sampler == "grid":
            preregister(study, s, git_sha(), _now())  # no tuning: every trial is a confirmation trial
            # Seed-major: every arm's seed 0 first, so a study stopped early compares arms on the same seeds.
            arms = study_arms(s)
            for seed in s.settings.seeds:
                for arm in arms:
                    study.enqueue_trial({}, user_attrs=grid_attrs(arm, seed, s.label(arm)))
        # Set last: it tells the other workers the study is complete (parent run and the
        # whole grid queued). Set earlier, a worker could find an empty queue and stop.
        study.set_user_attr(PARENT_ATTR, parent.run_id)

    @property
    def parent_run_id(self) -> str | None:
        return self.optuna.user_attrs.get(PARENT_ATTR)

    # --- one trial ----------------------------------------------------------------------------
    def objective(self, trial: optuna.Trial) -> float | list[float]:
        s = self.study
        seed = trial.user_attrs.get("seed")
        if seed is None:
            if s.settings.sampler == "grid":
                # Another worker took the last queued trial between our check and our ask.
                trial.set_user_attr("surplus", True)
                raise optuna.TrialPruned("grid exhausted")
            arm = suggest_arm(trial, s)
            seed = s.settings.seeds[0]
            trial.set_user_attr("seed", seed)
            trial.set_user_attr("arm", s.label(arm))
            trial.set_user_attr("sampled", True)
            for other in s.settings.seeds[1:]:
                self.optuna.enqueue_trial(trial.params, user_attrs={"seed": other, "arm": s.label(arm)})
        else:
            arm = arm_of(trial, s)
            record_grid_params(trial, arm, self._grid_params())
        cfg = s.run_config(arm, seed, out_dir=str(study_dir(s, self.out_dir) / "trials"), run_name=f"trial-{trial.number}",
                           experiment=s.name, track=True)  # tracked, through the tracker passed to train
        # modbench.role: "trial" here, "study" on the parent run: the chart filter (docs/studies.md) keeps the
        # parent (no arm, no curves) out of the arms' charts, where it would be an "Unassigned" series.
        tags = {"modbench.study": s.name, "modbench.role": TRIAL_ROLE, "optuna.trial_number": str(trial.number),
                "modbench.arm": s.label(arm), "modbench.seed": str(seed), "optuna.state": "RUNNING"}
        # The run's name starts with the arm (the UI's table cuts long names); the trial number is a tag.
        tracker = self.runs.tracker(s.name, run_name=f"{s.label(arm)} s{seed}", parent_run_id=self.parent_run_id,
                                    tags=tags)
        multi = len(s.directions) > 1
        curve = intermediate_metric(s.settings.objectives[0])

        def report(step: int, val: dict[str, float]) -> None:
            # Intermediate values at every evaluation (the dashboard's learning curves, what a
            # pruner compares); Optuna keeps none for multi-objective studies.
            if multi:
                return
            trial.report(val[curve], step)
            if s.settings.pruner != "none" and trial.should_prune():
                raise optuna.TrialPruned(f"pruned at step {step} (val/{curve} {val[curve]:.4f})")

        with tracker:
            trial.set_user_attr("mlflow_run_id", tracker.run_id)
            trial.set_user_attr("worker", f"{socket.gethostname()}:{os.getpid()}")
            tracker.log_params({"trial.number": trial.number, "trial.seed": seed, **{f"arm.{k}": v for k, v in arm.to_dict().items()}})
            try:
                interrupts.check()  # asked to stop while the run opened: this trial waits for the re-run
                result = train(cfg, tracker=tracker, progress=self.trial_progress, on_eval=report)
            except optuna.TrialPruned:
                tracker.set_tags({"optuna.state": "PRUNED"})
                tracker.end("KILLED")
                raise
            except KeyboardInterrupt:  # Ctrl-C or SIGTERM, raised at a safe point (modbench.interrupts)
                tracker.set_tags({"optuna.state": "INTERRUPTED"})
                tracker.end("KILLED")
                self._requeue(trial, arm, seed)
                raise
            except Exception as e:
                reason = redact(str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__)[:300]
                trial.set_user_attr("fail_reason", reason)
                tracker.set_tags({"optuna.state": "FAIL", "modbench.fail_reason": reason})
                raise
            values = objective_values(s, result.record)
            tracker.set_tags({"optuna.state": "COMPLETE"})
        for k, v in {**result.record.metrics, "steps": result.steps}.items():  # the record's names, as MLflow has them
            trial.set_user_attr(k, v)
        if any(not math.isfinite(v) for v in values):
            trial.set_user_attr("fail_reason", f"diverged: non-finite objective {values}")
            raise ModbenchError(f"trial {trial.number} produced a non-finite objective {values}")
        return values[0] if len(values) == 1 else values

    def _retry_dead_local_workers(self) -> None:
        """A RUNNING trial whose worker ran on this host under a pid that no longer exists is
        dead now: fail it, fail its MLflow run and queue its (arm, seed) again at once, instead
        of waiting out the heartbeat grace period (which still covers workers on other hosts)."""
        host = socket.gethostname()
        for t in self.optuna.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
            worker_host, _, pid = str(t.user_attrs.get("worker", "")).rpartition(":")
            if worker_host != host or not pid.isdigit() or _pid_alive(int(pid)):
                continue
            self.optuna._storage.set_trial_user_attr(t._trial_id, "requeued", True)
            if not self.optuna._storage.set_trial_state_values(t._trial_id, TrialState.FAIL):
                continue  # another worker got there first
            run_id = t.user_attrs.get("mlflow_run_id")
            if run_id:
                self.runs.fail(self.study.name, [run_id], f"worker lost (pid {pid} on {host} is gone); queued again")
            self.optuna.enqueue_trial(t.params, user_attrs=point_attrs(t.user_attrs))
            print(f"modbench: trial {t.number} ({t.user_attrs.get('arm')}, seed {t.user_attrs.get('seed')}) lost its "
                  f"worker (pid {pid} on this host is gone): queued again", file=sys.stderr)

    def _say_if_failed(self, study: optuna.Study, last: optuna.trial.FrozenTrial) -> None:
        """One line per failed trial (Optuna's own warning, with its traceback, is silenced); ``last``
        is the trial this worker just ran (the study's newest trial may be a queued one)."""
        if last.state == TrialState.FAIL and not last.user_attrs.get("requeued"):
            reason = last.user_attrs.get("fail_reason", "unknown reason")
            print(f"modbench: trial {last.number} ({last.user_attrs.get('arm')}, seed {last.user_attrs.get('seed')}) "
                  f"failed: {reason}", file=sys.stderr)

    def _requeue(self, trial: optuna.Trial, arm: Arm, seed: int) -> None:
        """Queue the interrupted (arm, seed) again; Optuna marks this trial FAIL, the report skips it."""
        trial.set_user_attr("requeued", True)
        self.optuna.enqueue_trial(trial.params, user_attrs=point_attrs(trial.user_attrs))
        self.interrupted = f"trial {trial.number} ({self.study.label(arm)}, seed {seed})"

    # --- stages (studies with [tune]) --------------------------------------------------------
    def _points(self, study: optuna.Study) -> list[tuning.TrialPoint]:
        """Every trial of the study as planning sees it (surplus and re-queued ones left out)."""
        out = []
        for t in study.get_trials(deepcopy=False):
            attrs = t.user_attrs
            if attrs.get("surplus") or attrs.get("requeued") or "arm_params" not in attrs:
                continue
            complete = t.state == TrialState.COMPLETE
            # The claims' selection metric; a study whose runs do not record it selects on its objective.
            value = attrs.get(tuning.SELECT, t.values[0] if complete and t.values else None) if complete else None
            headline = attrs.get(tuning.HEADLINE) if complete else None
            reason = attrs.get("fail_reason") or ("worker lost (no heartbeat)" if t.state == TrialState.FAIL else "")
            out.append(tuning.TrialPoint(Arm.from_params(attrs["arm_params"]), int(attrs["seed"]), t.state.name,
                                         attrs.get("stage", ""), tuning.finite_or_none(value), tuning.finite_or_none(headline), reason))
        return out

    def _advance(self, study: optuna.Study) -> str:
        """Queue the next stage if the current one has finished: "queued", "busy" (trials of the
        current stage wait or run) or "complete". Under the stage lock, so once per stage."""
        with stage_lock(self.storage_url, self.study.name):
            while True:
                active = study.get_trials(deepcopy=False, states=(TrialState.WAITING, TrialState.RUNNING))
                if active:
                    return "busy"
                history = study.user_attrs.get(STAGES_ATTR, [])
                step = tuning.plan(self.study, self._points(study), [h["stage"] for h in history])
                if step.stage == tuning.COMPLETE:
                    study.set_user_attr(STAGES_DONE_ATTR, True)
                    return "complete"
                if step.stage == tuning.CONFIRM and step.queue:  # the claims' settings are fixed from here on
                    preregister(study, self.study, git_sha(), _now())
                for arm, seed in step.queue:
                    study.enqueue_trial({}, user_attrs=grid_attrs(arm, seed, self.study.label(arm), step.stage))
                # Recorded after the trials: a worker that dies in between leaves trials queued and
                # the stage unrecorded, and the next plan finds nothing missing for that stage.
                study.set_user_attr(STAGES_ATTR, [*history, {"stage": step.stage, "queued": len(step.queue),
                                                             "record": step.record}])
                study.set_user_attr(STAGES_DONE_ATTR, False)
                if step.queue:
                    return "queued"

    def stages(self) -> list[dict]:
        return self.optuna.user_attrs.get(STAGES_ATTR, [])

    def stages_complete(self) -> bool:
        return bool(self.optuna.user_attrs.get(STAGES_DONE_ATTR))

    # --- the worker loop ----------------------------------------------------------------------
    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for t in self.optuna.get_trials(deepcopy=False):
            if t.user_attrs.get("surplus") or t.user_attrs.get("requeued"):
                continue
            out[t.state.name] = out.get(t.state.name, 0) + 1
        return out

    def expected_total(self) -> int:
        """Trials planned: the whole grid, the sampled arms × seeds, or (with [tune]) the trials
        the stages have queued so far (it grows with each stage)."""
        s = self.study
        if s.tune.lr_mult:
            return sum(self.counts().values())
        arms = len(study_arms(s)) if s.settings.sampler == "grid" else s.settings.n_trials
        return arms * len(s.settings.seeds)

    def sampled_arms(self) -> int:
        return sum(1 for t in self.optuna.get_trials(deepcopy=False) if t.user_attrs.get("sampled"))

    def run(self, *, max_trials: int | None, progress: bool, timeout_s: float | None,
            others_running: Callable[[], bool] | None = None) -> int:
        """Run trials until the study (or this worker's share: ``max_trials``, ``timeout_s``, the deadline)
        is done; returns how many this worker ran. ``others_running``: whether this command's other workers
        are still in a trial; the bar then keeps counting theirs until they stop."""
        s = self.study
        grid = s.settings.sampler == "grid"
        start = time.monotonic()
        ran = 0
        self.trial_progress = progress  # without it, a long trial shows nothing until it ends
        bar = _Progress(progress, self)
        try:
            while max_trials is None or ran < max_trials:
                interrupts.check()  # a stop asked for after the last trial's final check
                if timeout_s and time.monotonic() - start > timeout_s:
                    break
                if self._past_deadline():
                    break
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                    optuna.storages.fail_stale_trials(self.optuna)
                self._retry_dead_local_workers()
                waiting = self.optuna.get_trials(deepcopy=False, states=(TrialState.WAITING,))
                if not waiting and s.tune.lr_mult:
                    state = self._advance(self.optuna)
                    if state == "complete":
                        break
                    if state == "busy" and not self.optuna.get_trials(deepcopy=False, states=(TrialState.WAITING,)):
                        time.sleep(STAGE_POLL_S)  # other workers run the stage's last trials: wait for the next
                    bar.update()
                    continue
                if not waiting:
                    if grid:
                        break
                    if max_trials is None and self.sampled_arms() >= s.settings.n_trials:
                        break
                self.optuna.optimize(with_fail_reason(self.objective), n_trials=1, catch=(ModbenchError,),
                                     callbacks=[self._say_if_failed])
                ran += 1
                bar.update()
            if others_running is not None:
                bar.follow(others_running)
        finally:
            bar.close()
        self._maybe_finish_parent()
        return ran

    def _maybe_finish_parent(self) -> None:
        counts = self.counts()
        if counts.get("WAITING", 0) or counts.get("RUNNING", 0):
            return
        done = sum(counts.get(k, 0) for k in ("COMPLETE", "PRUNED", "FAIL"))
        if done < self.expected_total() or not self.parent_run_id:
            return
        if self.study.tune.lr_mult and not self.stages_complete():
            return  # a later stage is still to be queued
        metrics = {f"trials/{state.lower()}": float(n) for state, n in counts.items()}
        for t in best_trials(self.optuna)[:1]:
            metrics.update({f"best/{name}": value for name, value in zip(self.study.settings.objectives, t.values)})
        self.runs.finish_parent(self.study.name, self.parent_run_id, metrics)

    def _past_deadline(self) -> bool:
        """Whether a trial started now would end after the deadline (module docstring)."""
        if self.deadline is None:
            return False
        return time.time() + longest_trial_s(self.optuna) > self.deadline


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def longest_trial_s(study: optuna.Study) -> float:
    """The longest wall time of the study's finished trials (0 before any has finished)."""
    spans = [(t.datetime_complete - t.datetime_start).total_seconds()
             for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
             if t.datetime_start and t.datetime_complete]
    return max(spans, default=0.0)


def best_trials(study: optuna.Study) -> list[optuna.trial.FrozenTrial]:
    complete = [t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))]
    if not complete:
        return []
    if len(study.directions) == 1:
        return [study.best_trial]
    return study.best_trials


class _Progress:
    """Trials done / total (all workers), best so far, ETA."""

    def __init__(self, enabled: bool, runner: Runner) -> None:
        self.runner = runner
        self.bar = None
        if enabled:
            from modbench.progress import progress_bar

            self.bar = progress_bar(total=runner.expected_total(), initial=self._done(runner.counts()),
                                    desc=f"study {runner.study.name}", unit="trial")

    @staticmethod
    def _done(counts: dict[str, int]) -> int:
        return sum(counts.get(k, 0) for k in ("COMPLETE", "PRUNED", "FAIL"))

    def update(self, counts: dict[str, int] | None = None) -> None:
        if self.bar is None:
            return
        counts = self.runner.counts() if counts is None else counts
        done = self._done(counts)
        self.bar.total = max(self.bar.total, done + counts.get("WAITING", 0) + counts.get("RUNNING", 0))
        self.bar.n = done
        best = best_trials(self.runner.optuna)
        if best:
            self.bar.set_postfix(best=f"{best[0].values[0]:.4f} ({best[0].user_attrs.get('arm', '?')})")
        self.bar.refresh()

    def follow(self, others_running: Callable[[], bool]) -> None:
        """This worker is done: count the other workers' trials until ``others_running()`` is False (a
        line says so first; on a log the bar prints a line only when the count moves)."""
        if self.bar is None or not others_running():
            return
        self.bar.write("modbench: this worker is done; the bar counts the other workers' trials", file=sys.stderr)
        running = True
        while running:
            interrupts.check()  # Ctrl-C while waiting: this worker stops, and the command stops its helpers
            running = others_running()  # (asked before counting: a trial that ended as a helper stopped is counted)
            counts = self.runner.counts()
            if self._done(counts) != self.bar.n:
                self.update(counts)
            if running:
                time.sleep(STAGE_POLL_S)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def run_study(path: str | Path, *, storage: str | None = None, out_dir: str | Path = "runs/studies",
              n_trials: int | None = None, progress: bool = True, heartbeat: int = 10, grace: int = 30,
              tracking_uri: str, offline_runs: Path | None = None, deadline: float | None = None,
              amend_claims: bool = False, others_running: Callable[[], bool] | None = None) -> StudyOutcome:
    """Run (or resume) a study in this process (module docstring); ``offline_runs``: log runs to
    files there instead of MLflow; ``deadline``: start no trial that would end after it (epoch s);
    ``amend_claims``: record a change of the pre-registered claim settings instead of refusing it;
    ``others_running``: whether the command's other workers are still busy (``Runner.run``)."""
    study = load_study(path)
    check_arms_train(study)  # an arm the trainer would refuse: now, before any storage exists
    if n_trials is not None and n_trials < 1:
        raise ModbenchError(f"--n-trials must be >= 1, got {n_trials}")
    check_writable(Path(out_dir), "--out-dir")
    url = storage or default_storage(study, out_dir)
    optuna.logging.set_verbosity(optuna.logging.ERROR)  # failed trials get our one line, not a traceback
    t0 = time.monotonic()
    runner = Runner(study, url, Path(out_dir), tracking_uri=tracking_uri, heartbeat=heartbeat, grace=grace,
                    offline_runs=offline_runs, deadline=deadline, amend_claims=amend_claims)
    timeout = study.settings.timeout_s or None
    try:
        with interrupts.deferred():
            ran = runner.run(max_trials=n_trials, progress=progress, timeout_s=timeout, others_running=others_running)
            interrupts.check()  # asked during the last trial's final writes: still say so, exit 130
    except KeyboardInterrupt:
        what = runner.interrupted
        raise StudyInterrupted(f"interrupted: {what}; it is queued again, and running the same command finishes the study"
                               if what else "interrupted between trials; running the same command finishes the study") from None
    best = best_trials(runner.optuna)
    best_info = None
    if best:
        b = best[0]
        best_info = {"trial": b.number, "arm": b.user_attrs.get("arm"), "seed": b.user_attrs.get("seed"),
                     **dict(zip(study.settings.objectives, b.values))}
    return StudyOutcome(study.name, url, ran, runner.counts(), best_info, time.monotonic() - t0,
                        _stage_summary(runner.optuna.user_attrs))


def _stage_summary(attrs: dict[str, Any]) -> dict[str, Any] | None:
    if STAGES_ATTR not in attrs:
        return None
    return {"stages": [{"stage": h["stage"], "queued": h["queued"]} for h in attrs[STAGES_ATTR]],
            "complete": bool(attrs.get(STAGES_DONE_ATTR))}


def stage_status(name: str, url: str) -> dict[str, Any] | None:
    """A staged study's stages, each with the trials it queued, and whether the last is done
    (None for a study without [tune]): ``modbench study status`` shows them."""
    rdb = connect_storage(url)
    try:
        return _stage_summary(optuna.load_study(study_name=name, storage=rdb).user_attrs)
    except KeyError:  # no such study: the trials listing says so
        return None
    finally:
        rdb.engine.dispose()


def stage_line(summary: dict[str, Any]) -> str:
    """One line: "stages: tune 21, extend 2, optimum 0, confirm 21 (in progress)"."""
    parts = ", ".join(f"{h['stage']} {h['queued']}" for h in summary["stages"])
    return f"stages: {parts} ({'complete' if summary['complete'] else 'in progress'})"
