"""What a new user meets along the README's path (issue 39): MLflow series a chart can use, a
``--print-config`` that shows what trains, refusals at load before any storage exists, faults
(unreadable data, a full disk, a half-migrated store, a lost worker) as one line, and one final
summary per study worker."""

from __future__ import annotations

import collections
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from modbench.cli.main import main
from modbench.config.model import ModelConfig, RoutingConfig
from modbench.config.run import RunConfig, TrainConfig
from modbench.run.train import train
from modbench.track.tracking import Tracker

REPO = Path(__file__).resolve().parents[1]
SMOKE = (REPO / "studies" / "smoke.toml").read_text()
TINY = ModelConfig(depth=2, n_embd=32, head_dim=16, max_seq_len=16)
TRAIN_FLAGS = ["train", "--dataset", "arithmetic", "--depth", "2", "--n-embd", "32", "--head-dim", "16",
               "--max-seq-len", "16", "--seq-len", "16", "--batch-size", "4", "--eval-every", "100",
               "--eval-windows", "2"]

# MLflow 3.17's SqlAlchemyStore uses an ORM loader SQLAlchemy 2.1 deprecates; not ours.
pytestmark = pytest.mark.filterwarnings("ignore:The ``noload`` loader strategy:DeprecationWarning")


def one_line(err: str) -> str:
    """The single ``modbench: error:`` line a refusal prints (no traceback, nothing else)."""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("modbench: error: "), err
    return lines[0]


def study_file(folder: Path, name: str, **replace: str) -> Path:
    """The smoke study under another name, one seed, with text replacements (old=new)."""
    text = SMOKE.replace('name = "smoke"', f'name = "{name}"').replace("seeds = [0, 1]", "seeds = [0]")
    for old, new in replace.items():
        assert old in text, old
        text = text.replace(old, new)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.toml"
    path.write_text(text, encoding="utf-8")
    return path


# --------------------------------------------------------------------------- MLflow series


def test_every_metric_is_logged_once_per_step_and_cum_flops_ends_at_the_runs_flops(tmp_cwd):
    """Evaluations fall on steps the training log also writes (here 4 and the final 8): each key
    must still hold one point per step, or a chart with x-axis perf/cum_flops draws stair-steps."""
    uri = f"sqlite:///{tmp_cwd}/mlflow.db"
    cfg = RunConfig(TINY, RoutingConfig("sigmoid", 0.25),
                    TrainConfig(dataset="arithmetic", seq_len=16, batch_size=4, budget="steps=8", eval_every=4,
                                log_every=2, eval_windows=2, system_metrics_s=0, out_dir="runs", track=True))
    with Tracker("once", uri=uri) as tracker:
        result = train(cfg, tracker=tracker, progress=False)
    client = MlflowClient(uri)
    run = client.get_run(result.run_id)
    for key in run.data.metrics:
        steps = [m.step for m in client.get_metric_history(result.run_id, key)]
        repeated = [s for s, n in collections.Counter(steps).items() if n > 1]
        assert not repeated, f"{key} logged more than once at step(s) {repeated}"
    flops = sorted(client.get_metric_history(result.run_id, "perf/cum_flops"), key=lambda m: m.step)
    assert [m.step for m in flops] == [2, 4, 6, 8]
    values = [m.value for m in flops]
    assert all(a < b for a, b in zip(values, values[1:]))
    assert values[-1] == run.data.metrics["perf/total_flops"] == result.flops


# --------------------------------------------------------------------------- --print-config


def test_print_config_names_the_scaled_lr_and_weight_decay_and_reads_back_to_the_same_run(tmp_cwd, capsys):
    """train.lr / train.weight_decay are the unscaled values; the run trains at the depth/width-scaled
    ones (scale_hparams is on by default). The printout says so, and --config still reads it back."""
    import re
    import tomllib

    from modbench.model.gpt import GPT
    from modbench.run.train import build_optimizer

    flags = [*TRAIN_FLAGS, "--lr", "0.002", "--budget", "steps=2"]
    assert main([*flags, "--print-config"]) == 0
    printed = capsys.readouterr().out
    note = re.search(r"^# trains at lr ([0-9.e-]+) and weight_decay ([0-9.e-]+)", printed, re.M)
    assert note, printed
    data = tomllib.loads(printed)
    cfg = RunConfig.from_dict(data)
    assert cfg.train.lr == 0.002 and cfg.train.scale_hparams  # the file keeps the unscaled value
    groups = {g["name"]: g for g in build_optimizer(GPT(cfg.model, cfg.routing), cfg).param_groups}
    assert float(note[1]) == pytest.approx(groups["decay"]["lr"], rel=1e-3) != 0.002
    assert float(note[2]) == pytest.approx(groups["decay"]["weight_decay"], rel=1e-3) != 0.1
    saved = tmp_cwd / "run.toml"
    saved.write_text(printed)
    assert main(["train", "--config", str(saved), "--print-config"]) == 0
    assert capsys.readouterr().out == printed  # the round trip: the same run, the same note


# --------------------------------------------------------------------------- refusals at load


@pytest.mark.parametrize("name, replace, expected", [
    ("études", {}, "ASCII letters"),  # str.isalnum() takes it; the MLflow experiment name does not
    ("underbudget", {'budget = "steps=6"': 'budget = "flops=1e3"'}, "smaller than one training step"),
    ("onelayer", {'variant = ["dense", "sigmoid"]': 'variant = ["mor_token_choice"]',
                  "[space]": "[options.mor_token_choice]\nmin_depth = 1\n\n[space]"}, "needs at least 2 routed layers"),
])
def test_a_study_the_trainer_would_refuse_is_refused_at_load_with_nothing_created(tmp_cwd, capsys, name, replace,
                                                                                   expected):
    path = study_file(tmp_cwd, name, **replace)
    assert main(["study", "run", str(path), "--quiet"]) == 2
    line = one_line(capsys.readouterr().err)
    assert expected in line and "study" in line
    assert sorted(p.name for p in tmp_cwd.iterdir()) == [path.name]  # no runs/, no optuna.db, no mlflow.db


def test_a_different_study_file_with_the_same_name_is_refused_and_adds_nothing(tmp_cwd, capsys):
    from modbench.track.optuna_store import trials_frame

    first = study_file(tmp_cwd / "mine", "twin", **{'budget = "steps=6"': 'budget = "steps=2"'})
    assert main(["study", "run", str(first), "--quiet", "--n-trials", "1"]) == 0
    storage = f"sqlite:///{tmp_cwd}/runs/studies/twin/optuna.db"
    before = trials_frame("twin", storage)
    client = MlflowClient(f"sqlite:///{tmp_cwd}/mlflow.db")
    runs_before = len(client.search_runs([client.get_experiment_by_name("twin").experiment_id]))
    other = study_file(tmp_cwd / "theirs", "twin", **{'budget = "steps=6"': 'budget = "steps=2"',
                                                      '"sigmoid"]': '"sigmoid", "norm"]'})
    capsys.readouterr()
    assert main(["study", "run", str(other), "--quiet"]) == 2
    line = one_line(capsys.readouterr().err)
    assert str(first.resolve()) in line and "rename study.name" in line
    after = trials_frame("twin", storage)
    assert len(after) == len(before) and "norm" not in set(after.arm)  # nothing queued
    assert len(client.search_runs([client.get_experiment_by_name("twin").experiment_id])) == runs_before
    copy = tmp_cwd / "copy" / "twin.toml"  # the same file elsewhere (another worker's checkout) resumes it
    copy.parent.mkdir()
    copy.write_bytes(first.read_bytes())
    assert main(["study", "run", str(copy), "--quiet"]) == 0
    assert (trials_frame("twin", storage).state == "COMPLETE").sum() == 2


# --------------------------------------------------------------------------- faults


def test_an_unreadable_dataset_file_is_one_line(tmp_cwd, capsys, monkeypatch):
    import builtins
    import errno

    data = tmp_cwd / "corpus.txt"
    data.write_bytes(b"a+b=c\n" * 500)
    data.chmod(0)
    if os.access(data, os.R_OK):  # root reads any file: refuse its reads as the kernel refuses another user's
        real_open, target = builtins.open, data.resolve()

        def refusing_open(file, *args, **kwargs):
            if isinstance(file, (str, os.PathLike)) and Path(file).resolve() == target:
                raise PermissionError(errno.EACCES, "Permission denied", str(file))
            return real_open(file, *args, **kwargs)

        monkeypatch.setattr(builtins, "open", refusing_open)
    flags = [f if f != "arithmetic" else str(data) for f in TRAIN_FLAGS]
    assert main([*flags, "--budget", "steps=2", "--no-track", "--quiet"]) == 2
    line = one_line(capsys.readouterr().err)
    assert str(data) in line and "cannot be read" in line and "Permission denied" in line
    assert not (tmp_cwd / "runs").exists()


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs Linux's /dev/full")
def test_a_full_disk_while_writing_a_checkpoint_is_one_line_and_leaves_no_partial_file(tmp_cwd, capsys):
    """A real ENOSPC from the kernel: the checkpoint's temporary file is /dev/full. Given a path,
    torch.save's own writer reported it as a RuntimeError (a traceback) and left the .tmp behind."""
    run_dir = tmp_cwd / "runs" / "full"
    run_dir.mkdir(parents=True)
    tmp = run_dir / "checkpoint.pt.tmp"
    tmp.symlink_to("/dev/full")
    assert main([*TRAIN_FLAGS, "--budget", "steps=2", "--run-name", "full", "--quiet"]) == 2
    line = one_line(capsys.readouterr().err)
    assert "No space left on device" in line and "runs/full/checkpoint.pt" in line
    assert not os.path.lexists(tmp) and not (run_dir / "checkpoint.pt").exists()
    client = MlflowClient(f"sqlite:///{tmp_cwd}/mlflow.db")
    (run,) = client.search_runs([client.get_experiment_by_name("modbench").experiment_id])
    assert run.info.status == "FAILED"  # the tracked run ends, not left RUNNING


@pytest.mark.filterwarnings("ignore:Heartbeat of storage:UserWarning")  # the test takes the trial with ask()
def test_a_lost_workers_run_has_its_optuna_state_tag_follow_the_trial(tmp_cwd, capsys):
    """The worker died mid-trial (its pid on this host is gone): the next worker fails the trial and
    queues its (arm, seed) again, and the trial's MLflow run says FAIL, not RUNNING forever."""
    import socket

    import optuna

    from modbench.design.study_file import load_study
    from modbench.study.runner import Runner

    uri = f"sqlite:///{tmp_cwd}/mlflow.db"
    spec = load_study(study_file(tmp_cwd, "lost", **{'budget = "steps=6"': 'budget = "steps=2"'}))
    runner = Runner(spec, f"sqlite:///{tmp_cwd}/optuna.db", tmp_cwd / "runs", tracking_uri=uri, heartbeat=10, grace=30)
    trial = runner.optuna.ask()  # the first queued (arm, seed), now RUNNING, as a worker takes it
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # a worker pid that no longer exists
    tracker = Tracker("lost", uri=uri, parent_run_id=runner.parent_run_id,
                      tags={"modbench.role": "trial", "optuna.state": "RUNNING"}).start()  # never ended: the worker died
    trial.set_user_attr("mlflow_run_id", tracker.run_id)
    trial.set_user_attr("worker", f"{socket.gethostname()}:{dead.pid}")
    client = MlflowClient(uri)
    assert client.get_run(tracker.run_id).info.status == "RUNNING"
    runner._retry_dead_local_workers()
    run = client.get_run(tracker.run_id)
    assert run.info.status == "FAILED" and run.data.tags["optuna.state"] == "FAIL"
    assert "worker lost" in run.data.tags["modbench.fail_reason"]
    assert runner.optuna.trials[trial.number].state == optuna.trial.TrialState.FAIL
    assert "queued again" in capsys.readouterr().err


def test_a_store_whose_first_migration_was_interrupted_is_one_line_naming_the_file_to_delete(tmp_cwd, capsys):
    """Ctrl-C while MLflow migrates a fresh ./mlflow.db: the columns a migration added are there
    (SQLite commits each ALTER TABLE), its version row is not, and the store lacks the tables of the
    later migrations. Every open then re-runs the migration and fails with "duplicate column name"."""
    from mlflow.store.db.utils import InitialBase

    MlflowClient(f"sqlite:///{tmp_cwd}/whole.db").search_experiments()  # a store MLflow migrated
    broken = tmp_cwd / "mlflow.db"
    broken.write_bytes((tmp_cwd / "whole.db").read_bytes())
    con = sqlite3.connect(broken)
    tables = {row[0] for row in con.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    later = sorted(tables - set(InitialBase.metadata.tables) - {"alembic_version"})
    con.execute("DELETE FROM alembic_version")  # the interrupted migration never recorded its version
    con.execute(f"DROP TABLE {later[-1]}")  # nor did the migrations after it run
    con.commit()
    con.close()
    capsys.readouterr()
    assert main([*TRAIN_FLAGS, "--budget", "steps=2", "--quiet"]) == 2  # the default store: ./mlflow.db
    line = one_line(capsys.readouterr().err)
    assert "first migration was interrupted" in line and f"delete {broken}" in line
    assert "duplicate column name" in line
    assert broken.is_file()  # the user is told to delete it; modbench does not


# --------------------------------------------------------------------------- the terminal


@pytest.mark.filterwarnings("ignore:Heartbeat of storage:UserWarning")  # the test takes a trial with ask()
def test_only_the_worker_that_finishes_the_study_prints_its_per_arm_numbers(tmp_cwd, capsys):
    """Two workers: the first to stop must not print a per-arm table taken mid-study while the other
    still runs a trial; the last one prints the final table (and --quiet's JSON says which is which).
    Inside a trial, `study run` shows its steps and loss."""
    import json
    import socket

    import optuna

    path = study_file(tmp_cwd, "busy", **{'budget = "steps=6"': 'budget = "steps=2"', "log_every = 3": "log_every = 1"})
    assert main(["study", "run", str(path), "--n-trials", "1"]) == 0
    out, err = capsys.readouterr()
    assert "per arm (objectives" not in out and "1 waiting trial(s) left" in out and "study status" in out
    assert any(line.startswith("trial-0:") and "step" in line and "loss=" in line for line in err.splitlines()), err
    assert "\x1b" not in err  # a log gets whole lines: no cursor moves for the nested bar

    storage = f"sqlite:///{tmp_cwd}/runs/studies/busy/optuna.db"
    other = optuna.load_study(study_name="busy", storage=storage).ask()  # another worker, alive, runs the last trial
    other.set_user_attr("worker", f"{socket.gethostname()}:{os.getpid()}")
    assert main(["study", "run", str(path), "--quiet"]) == 0
    mid = json.loads(capsys.readouterr().out)
    assert mid["finished"] is False and mid["arms"] == [] and mid["trials"] == {"COMPLETE": 1, "RUNNING": 1}

    optuna.load_study(study_name="busy", storage=storage).tell(other.number, 7.5)  # the other worker finishes
    assert main(["study", "run", str(path)]) == 0
    assert "per arm (objectives: mean over finished seeds)" in capsys.readouterr().out
    assert main(["study", "run", str(path), "--quiet"]) == 0
    final = json.loads(capsys.readouterr().out)
    assert final["finished"] is True and len(final["arms"]) == 2


@pytest.mark.filterwarnings("ignore:Heartbeat of storage")
def test_a_worker_done_before_the_others_keeps_counting_their_trials(tmp_cwd, capsys, monkeypatch):
    """`study run --workers 2`: the command's worker finishes its share while a helper is still in a trial.
    Its bar then counts the helper's trials as they end (one line first says so) until the helper stops,
    so it ends at the study's count, not the one it last saw. Each step here is an event: another worker's
    trial ends inside the ``others_running`` poll."""
    import optuna

    from modbench.design.study_file import load_study
    from modbench.study import runner as study_runner

    monkeypatch.setattr(study_runner, "STAGE_POLL_S", 0.0)
    spec = load_study(study_file(tmp_cwd, "follow", **{"seeds = [0]": "seeds = [0, 1]"}))
    runner = study_runner.Runner(spec, f"sqlite:///{tmp_cwd}/optuna.db", tmp_cwd / "runs",
                                 tracking_uri=f"sqlite:///{tmp_cwd}/mlflow.db", heartbeat=10, grace=30)
    queued = len(runner.optuna.get_trials(states=(optuna.trial.TrialState.WAITING,)))
    bar = study_runner._Progress(True, runner)
    assert bar.bar.n == 0 and queued == 4
    polls = []

    def others_running() -> bool:  # a helper worker: one of its trials ends at each poll; it stops after the 4th
        polls.append(bar.bar.n)
        runner.optuna.tell(runner.optuna.ask(), state=optuna.trial.TrialState.PRUNED)
        return len(polls) < 4

    bar.follow(others_running)
    assert polls[-1] >= 2  # counting while the helper ran, not only once it stopped
    assert bar.bar.n == 4  # every trial, the one that ended as the helper stopped included
    bar.close()
    assert "this worker is done; the bar counts the other workers' trials" in capsys.readouterr().err
    bar.follow(lambda: False)  # nothing else running: no line
    assert "this worker is done" not in capsys.readouterr().err


def test_study_run_with_two_workers_prints_one_final_summary(tmp_cwd, capfd):
    """`make quick` is `study run --workers 2`: the helper worker prints nothing, the command prints
    one summary once both have stopped, with every trial counted (ran by either worker) and the
    final per-arm table; a bad --workers is one line with nothing created."""
    import json

    path = study_file(tmp_cwd, "pair", **{"seeds = [0]": "seeds = [0, 1]", 'budget = "steps=6"': 'budget = "steps=2"'})
    assert main(["study", "run", str(path), "--workers", "2", "--quiet"]) == 0
    out, err = capfd.readouterr()
    lines = [line for line in out.splitlines() if line.strip()]
    assert len(lines) == 1, out  # one JSON summary, not one per worker
    summary = json.loads(lines[0])
    assert summary["finished"] is True and summary["trials"] == {"COMPLETE": 4} and summary["ran"] == 4
    assert len(summary["arms"]) == 2
    assert "worker 2" not in err  # the helper did not fail

    assert main(["study", "run", str(study_file(tmp_cwd / "bad", "bad")), "--workers", "0"]) == 2
    assert one_line(capfd.readouterr().err) == "modbench: error: --workers must be >= 1, got 0"
    assert not (tmp_cwd / "runs" / "studies" / "bad").exists()
