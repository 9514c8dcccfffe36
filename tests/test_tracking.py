"""Tests for modbench.track.tracking (batched MLflow logger) and modbench.run.heatmap."""

from __future__ import annotations

import math
import os
import socket
import struct
import tempfile
from pathlib import Path

import mlflow
import numpy as np
import pytest
import torch
from mlflow.tracking import MlflowClient

from modbench.track import provenance
from modbench.track import tracking
from modbench.errors import ModbenchError
from modbench.track.provenance import environment_tags
from modbench.run.heatmap import routing_heatmap, routing_heatmap_figure, routing_mask
from modbench.track import background
from modbench.track.background import TrackerProcess, TrackerProcessError
from modbench.track.store import resolve_tracking_uri
from modbench.track.tracking import (
    HEARTBEAT_TAG,
    PARENT_RUN_TAG,
    NullTracker,
    Tracker,
    fail_stale_runs,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

# MLflow 3.17's SqlAlchemyStore uses an ORM loader SQLAlchemy 2.1 deprecates; not ours.
pytestmark = pytest.mark.filterwarnings("ignore:The ``noload`` loader strategy:DeprecationWarning")


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> str:
    """One SQLite store for the module: creating/migrating it takes seconds."""
    root = tmp_path_factory.mktemp("mlstore")
    return f"sqlite:///{root}/mlflow.db"


@pytest.fixture
def cwd(tmp_path, monkeypatch) -> Path:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    return tmp_path


def store_dir(uri: str) -> Path:
    return Path(uri[len("sqlite:///") :]).parent


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def history(client: MlflowClient, run_id: str, key: str) -> list:
    return sorted(client.get_metric_history(run_id, key), key=lambda m: m.step)


# --------------------------------------------------------------------------- round trip


def test_full_run_round_trip(store, cwd, monkeypatch):
    params = {f"p{i:03d}": i * 0.5 for i in range(150)}
    with Tracker("roundtrip", run_name="r1", uri=store, tags={"variant": "mod"}) as tr:
        tr.log_params(params)
        for step in range(50):
            tr.log_metrics({"train/loss": 3.0 - step * 0.01, "lr": 1e-3}, step=step)
        tr.log_dict({"model": {"d_model": 64}, "path": Path("/x")}, "config/resolved.json")
        png = routing_heatmap(
            [np.arange(0, 32, 2), np.arange(8, 24)], 32, cwd / "heat.png", title="val seq 0"
        )
        tr.log_artifact(png, "routing")
        tr.log_figure(routing_heatmap_figure([np.array([1, 2])], 8), "routing/fig.png")
        run_id = tr.run_id

    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)  # read by mlflow's fluent API
    df = mlflow.search_runs(experiment_names=["roundtrip"], output_format="pandas")
    assert list(df["run_id"]) == [run_id]
    row = df.iloc[0]
    assert row["status"] == "FINISHED"
    assert all(row[f"params.{k}"] == str(v) for k, v in params.items())
    assert row["tags.variant"] == "mod"
    assert row["tags.torch_version"] == torch.__version__
    assert row["tags.git_sha"] == environment_tags()["git_sha"]
    assert row["tags.mlflow.runName"] == "r1"

    client = MlflowClient(tracking_uri=store)
    run = client.get_run(run_id)
    assert len(run.data.params) == 150
    for key in ("train/loss", "lr"):
        points = history(client, run_id, key)
        assert [m.step for m in points] == list(range(50))
    assert history(client, run_id, "train/loss")[-1].value == pytest.approx(3.0 - 0.49)

    top = {a.path for a in client.list_artifacts(run_id)}
    assert top == {"config", "routing"}
    routing = {a.path for a in client.list_artifacts(run_id, "routing")}
    assert routing == {"routing/heat.png", "routing/fig.png"}
    assert [a.path for a in client.list_artifacts(run_id, "config")] == ["config/resolved.json"]
    # artifacts live next to the database, never in the cwd
    local = store_dir(store) / "mlartifacts" / "roundtrip" / run_id / "artifacts"
    assert (local / "routing" / "heat.png").read_bytes()[:8] == PNG_MAGIC
    assert '"d_model": 64' in (local / "config" / "resolved.json").read_text()
    assert not (cwd / "mlruns").exists()
    assert not (cwd / "mlartifacts").exists()
    assert not (store_dir(store) / "mlruns").exists()


def test_yaml_dict_and_long_params(store, cwd):
    long_value = "x" * 7000
    with Tracker("params", uri=store) as tr:
        tr.log_params({"long": long_value, "none": None, "tuple": (1, 2)})
        tr.log_dict({"a": [1, 2], "b": {"c": "d"}}, "cfg.yaml")
    client = MlflowClient(tracking_uri=store)
    p = client.get_run(tr.run_id).data.params
    assert len(p["long"]) == 6000
    assert p["long"].endswith("[truncated from 7000 chars]")
    assert p["none"] == "None" and p["tuple"] == "(1, 2)"
    local = Path(client.download_artifacts(tr.run_id, "cfg.yaml", str(cwd)))
    assert local.read_text().splitlines()[:2] == ["a:", "- 1"]


# --------------------------------------------------------------------------- URIs / tags


def test_tracking_uri_respects_env(monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:5000")
    assert resolve_tracking_uri() == "http://127.0.0.1:5000"


def test_tracking_uri_default_is_absolute_sqlite(cwd):
    uri = resolve_tracking_uri()
    assert uri.startswith("sqlite:///")
    path = Path(uri[len("sqlite:///") :])
    assert path.is_absolute()
    assert path == cwd.resolve() / "mlflow.db"
    assert not (cwd / "mlruns").exists()


def test_environment_tags():
    tags = environment_tags()
    assert set(tags) == {
        "git_sha",
        "torch_version",
        "python_version",
        "platform",
        "modbench_version",
        "hostname",
    }
    assert tags["torch_version"] == torch.__version__
    assert tags["hostname"] == socket.gethostname()
    assert all(isinstance(v, str) and v for v in tags.values())
    sha = tags["git_sha"].removesuffix("-dirty")
    assert sha == "unknown" or (len(sha) == 40 and int(sha, 16) >= 0)


def test_git_sha_clean_dirty_and_outside_checkout(tmp_path, monkeypatch):
    import shutil
    import subprocess

    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    repo = tmp_path / "repo"
    pkg = repo / "harness"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("x = 1\n")
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(repo)]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "init"], check=True)
    head = subprocess.run(
        [*git, "rev-parse", "HEAD"], check=True, capture_output=True, text=True
    ).stdout.strip()

    monkeypatch.setattr(provenance, "_PKG_DIR", pkg)
    assert provenance.git_sha() == head
    (pkg / "notes.txt").write_text("untracked files do not make a checkout dirty")
    assert provenance.git_sha() == head
    (pkg / "__init__.py").write_text("x = 2\n")
    assert provenance.git_sha() == head + "-dirty"

    elsewhere = tmp_path / "not-a-repo"
    elsewhere.mkdir()
    monkeypatch.setattr(provenance, "_PKG_DIR", elsewhere)
    assert provenance.git_sha() == "unknown"


# --------------------------------------------------------------------------- statuses


@pytest.mark.parametrize(
    ("exc", "status"), [(RuntimeError("boom"), "FAILED"), (KeyboardInterrupt(), "KILLED")]
)
def test_exception_sets_status(store, cwd, exc, status):
    with pytest.raises(type(exc)):
        with Tracker("statuses", uri=store) as tr:
            tr.log_metrics({"loss": 1.0}, step=0)
            raise exc
    run = MlflowClient(tracking_uri=store).get_run(tr.run_id)
    assert run.info.status == status
    assert run.data.metrics == {"loss": 1.0}  # the buffer was flushed on the way out


def test_end_rejects_unknown_status(store, cwd):
    tr = Tracker("statuses", uri=store).start()
    with pytest.raises(ValueError, match="FINISHED"):
        tr.end("DONE")
    tr.end("KILLED")
    assert MlflowClient(tracking_uri=store).get_run(tr.run_id).info.status == "KILLED"


def test_parent_child(store, cwd):
    with Tracker("study", run_name="parent", uri=store) as parent:
        with Tracker("study", run_name="trial-0", uri=store, parent_run_id=parent.run_id) as c:
            pass
    client = MlflowClient(tracking_uri=store)
    assert client.get_run(c.run_id).data.tags[PARENT_RUN_TAG] == parent.run_id
    assert PARENT_RUN_TAG not in client.get_run(parent.run_id).data.tags
    children = client.search_runs(
        [client.get_experiment_by_name("study").experiment_id],
        filter_string=f"tags.mlflow.parentRunId = '{parent.run_id}'",
    )
    assert [r.info.run_id for r in children] == [c.run_id]


def test_fail_stale_runs(store, cwd):
    dead = Tracker("stale", uri=store).start()  # a worker that died: never ended
    other = Tracker("stale", uri=store).start()
    done = Tracker("stale", uri=store).start()
    done.end()
    client = MlflowClient(tracking_uri=store)
    assert client.get_run(dead.run_id).info.status == "RUNNING"

    assert fail_stale_runs("stale", uri=store, older_than_s=3600) == 0  # too recent
    assert fail_stale_runs("stale", uri=store, run_ids=[dead.run_id]) == 1
    assert client.get_run(dead.run_id).info.status == "FAILED"
    assert client.get_run(other.run_id).info.status == "RUNNING"
    assert client.get_run(done.run_id).info.status == "FINISHED"
    assert fail_stale_runs("stale", uri=store) == 1  # only `other` is still RUNNING
    assert client.get_run(other.run_id).info.status == "FAILED"
    assert fail_stale_runs("no-such-experiment", uri=store) == 0


# --------------------------------------------------------------------------- metrics


def test_log_metrics_is_batched(store, cwd):
    client = MlflowClient(tracking_uri=store)
    with Tracker("batching", uri=store, flush_every=10) as tr:
        for step in range(9):
            tr.log_metrics({"loss": float(step)}, step=step)
        assert client.get_metric_history(tr.run_id, "loss") == []
        tr.log_metrics({"loss": 9.0}, step=9)
        assert [m.step for m in history(client, tr.run_id, "loss")] == list(range(10))
        assert HEARTBEAT_TAG in client.get_run(tr.run_id).data.tags
        tr.log_metrics({"loss": 10.0}, step=10)
    assert len(client.get_metric_history(tr.run_id, "loss")) == 11  # end() flushes


def test_log_metrics_values(store, cwd):
    with Tracker("values", uri=store) as tr:
        tr.log_metrics(
            {
                "tensor": torch.tensor(1.5),
                "np": np.float32(2.5),
                "int": 3,
                "dropped": None,
                "nan": float("nan"),
            },
            step=np.int64(7),
        )
    client = MlflowClient(tracking_uri=store)
    metrics = client.get_run(tr.run_id).data.metrics
    assert set(metrics) == {"tensor", "np", "int", "nan"}
    assert (metrics["tensor"], metrics["np"], metrics["int"]) == (1.5, 2.5, 3.0)
    assert math.isnan(metrics["nan"])  # a diverging run stays visible
    assert client.get_metric_history(tr.run_id, "nan")[0].step == 7


def test_seconds_accumulates_and_store_calls_are_batched(store, cwd, monkeypatch):
    tr = Tracker("overhead", uri=store, flush_every=10).start()
    after_start = tr.seconds
    assert after_start > 0

    calls = []
    real = tr.client.log_batch
    monkeypatch.setattr(tr.client, "log_batch", lambda *a, **k: calls.append(1) or real(*a, **k))
    for step in range(25):
        before = tr.seconds
        tr.log_metrics({"a": 1.0, "b": 2.0}, step=step)
        assert tr.seconds > before
    assert len(calls) == 2  # 25 calls -> 2 round trips, the rest stayed in memory
    tr.end()
    assert len(calls) == 3
    assert tr.seconds > after_start


def test_the_tracker_process_logs_everything_in_order(store, cwd):
    """TrackerProcess: this process only sends; the run, once ended, holds every param, tag,
    metric point, dataset, figure and artifact, as with a Tracker, and the process has exited."""
    tr = TrackerProcess("background", run_name="bg", uri=store, tags={"variant": "mod"}, flush_every=3).start()
    assert tr.alive and tr.pid != os.getpid()
    tr.log_params({"lr": 0.001, "depth": 4})
    tr.set_tags({"dataset": "arithmetic"})
    tr.log_dataset("arithmetic(seed=0)", "abc123", "made on the machine", "training")
    tr.monitor_system(0)
    for step in range(10):
        tr.log_metrics({"loss": torch.tensor(float(step)), "skipped": None}, step=step)
    tr.log_dict({"a": 1}, "config.json")
    tr.log_figure(routing_heatmap_figure([np.array([1, 2])], 8), "routing/fig.png")
    (cwd / "ckpt.pt").write_bytes(b"weights")
    tr.log_artifact(cwd / "ckpt.pt", "checkpoint")
    run_id = tr.run_id  # waits for the run to exist
    tr.flush()  # waits for the store
    client = MlflowClient(tracking_uri=store)
    assert [m.step for m in history(client, run_id, "loss")] == list(range(10))
    assert [m.value for m in history(client, run_id, "loss")] == [float(s) for s in range(10)]
    tr.end()
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "bg"
    assert run.data.params == {"lr": "0.001", "depth": "4"}
    assert run.data.tags["variant"] == "mod" and run.data.tags["dataset"] == "arithmetic"
    assert "skipped" not in run.data.metrics
    assert run.inputs.dataset_inputs[0].dataset.name == "arithmetic(seed=0)"
    assert {a.path for a in client.list_artifacts(run_id)} == {"checkpoint", "config.json", "routing"}
    assert [a.path for a in client.list_artifacts(run_id, "routing")] == ["routing/fig.png"]
    assert not tr.alive  # the process exits with the run
    assert not list(Path(tempfile.gettempdir()).glob("modbench-figure-*"))  # the figure's copy is gone


def test_a_prewarmed_tracker_process_is_taken_over_and_an_unused_one_stopped(store, cwd):
    """modbench starts the process before it imports torch; the run takes that process over."""
    background.prewarm(store)
    warm = background._prewarmed.proc
    tr = TrackerProcess("prewarm", uri=store).start()
    assert tr.pid == warm.pid and background._prewarmed is None
    tr.end()
    assert MlflowClient(tracking_uri=store).get_run(tr.run_id).info.status == "FINISHED"
    background.prewarm(store)  # a command that fails before its run starts
    unused = background._prewarmed.proc
    background.discard_prewarmed()
    assert unused.poll() is not None


@pytest.mark.parametrize("argv, rank, expected", [
    (["train", "--track", "--tracking-uri", "sqlite:////x/a.db"], "0", "sqlite:////x/a.db"),  # --track is no prefix
    (["train", "--budget", "steps=2", "--tracking-uri=http://h:5000"], "0", "http://h:5000"),
    (["train", "--no-track"], "0", None),
    (["train", "--print-config"], "0", None),
    (["train", "--tracking-uri", "sqlite:////x/a.db"], "1", None),  # only rank 0 tracks
    (["study", "run", "quick", "--tracking-uri", "sqlite:////x/a.db"], "0", None),
])
def test_which_command_lines_start_a_tracker_process_early(monkeypatch, argv, rank, expected):
    from modbench.cli.main import _tracked_train_uri

    monkeypatch.setenv("RANK", rank)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert _tracked_train_uri(argv) == expected


def test_a_prewarmed_tracker_process_creates_no_store_before_the_run_starts(tmp_path):
    """The command may fail after the process was started (a bad flag): warming up must not have
    begun a database it would then leave half-created."""
    db = tmp_path / "new" / "mlflow.db"
    db.parent.mkdir()
    background.prewarm(f"sqlite:///{db}")
    child = background._prewarmed
    child.send(("run_id",))  # answered once the warm-up is done: requests are served in order
    assert child.answer() is None
    assert not db.exists()
    background.discard_prewarmed()
    assert child.proc.poll() is not None and not db.exists()


def test_a_tracker_process_that_loses_its_parent_ends_the_run_failed(store, cwd):
    """The parent dies (its end of the pipe closes) before ending the run: the run is not left RUNNING."""
    tr = TrackerProcess("orphan", uri=store).start()
    tr.log_metrics({"loss": 1.0}, step=0)
    run_id = tr.run_id
    tr._child.proc.stdin.close()  # what the parent's death does
    assert tr._child.proc.wait(timeout=120) == 0
    assert MlflowClient(tracking_uri=store).get_run(run_id).info.status == "FAILED"


def test_a_dead_tracker_process_is_one_error_not_a_broken_pipe(store, cwd):
    tr = TrackerProcess("dead", uri=store).start()
    tr._child.proc.kill()
    tr._child.proc.wait()
    with pytest.raises(TrackerProcessError, match="tracker process has stopped"):
        for step in range(10_000):  # the first sends may still fit in the pipe's buffer
            tr.log_metrics({"loss": 1.0}, step=step)
        tr.flush()


@pytest.mark.parametrize("background", [False, True])
def test_a_run_shorter_than_one_sampling_interval_still_has_system_metrics(store, cwd, background):
    """MLflow's monitor logs a sample only after a whole interval; the run ends long before 60 s
    (and, in the background, maybe before the monitor has started): its samples still land."""
    tr = (TrackerProcess if background else Tracker)("sysmetrics", uri=store).start()
    tr.monitor_system(60)
    tr.log_metrics({"loss": 1.0}, step=0)
    run_id = tr.run_id
    tr.end()
    logged = MlflowClient(tracking_uri=store).get_run(run_id).data.metrics
    assert {"system/cpu_utilization_percentage", "system/system_memory_usage_megabytes"} <= set(logged)


def test_the_tracker_process_refuses_a_store_it_cannot_write_at_once(tmp_path):
    """The check TrackerProcess.start makes before training (no MLflow import): one line now."""
    with pytest.raises(ModbenchError, match="cannot reach MLflow tracking store"):
        TrackerProcess("x", uri=f"sqlite:///{tmp_path / 'missing' / 'mlflow.db'}").start()
    db = tmp_path / "ro" / "mlflow.db"
    db.parent.mkdir()
    uri = f"sqlite:///{db}"
    Tracker("x", uri=uri).start().end()  # creates the store
    db.chmod(0o444)
    try:
        if os.access(db, os.W_OK):
            pytest.skip("running as a user who may write read-only files")
        with pytest.raises(ModbenchError, match="refused to start a run .*readonly"):
            TrackerProcess("x", uri=uri).start()
    finally:
        db.chmod(0o644)


def test_tracker_process_errors_reach_the_caller_and_the_run_still_ends(store, cwd):
    with Tracker("bgerr", uri=store) as first:
        first.log_params({"lr": 0.001})
    tr = TrackerProcess("bgerr", uri=store).start()
    tr.log_params({"lr": 0.001})
    tr.flush()
    client = MlflowClient(tracking_uri=store)
    client.log_param(tr.run_id, "depth", 4)
    tr.log_params({"depth": 8})  # refused by the store, in the background
    with pytest.raises(ModbenchError, match="params cannot change"):
        tr.flush()
    tr.log_metrics({"loss": 1.0}, step=0)  # not written after the error; no second raise
    tr.end("FAILED")
    assert client.get_run(tr.run_id).info.status == "FAILED"
    assert client.get_metric_history(tr.run_id, "loss") == []


def test_resume_appends_to_same_run(store, cwd):
    client = MlflowClient(tracking_uri=store)
    with Tracker("resume", uri=store) as first:
        first.log_params({"lr": 0.001})
        for step in range(5):
            first.log_metrics({"loss": 1.0}, step=step)
    with Tracker("resume", uri=store, run_id=first.run_id) as again:
        assert again.run_id == first.run_id
        assert client.get_run(first.run_id).info.status == "RUNNING"
        again.log_params({"lr": 0.001})  # same value: allowed
        for step in range(5, 8):
            again.log_metrics({"loss": 0.5}, step=step)
    assert [m.step for m in history(client, first.run_id, "loss")] == list(range(8))
    assert client.get_run(first.run_id).info.status == "FINISHED"
    assert len(client.search_runs([again.experiment_id])) == 1

    with pytest.raises(ModbenchError, match="params cannot change"):
        with Tracker("resume", uri=store, run_id=first.run_id) as third:
            third.log_params({"lr": 0.01})
    with pytest.raises(ModbenchError, match="belongs to experiment 'resume'"):
        Tracker("elsewhere", uri=store, run_id=first.run_id).start()
    with pytest.raises(ModbenchError, match="no such run"):
        Tracker("resume", uri=store, run_id="0" * 32).start()


# --------------------------------------------------------------------------- errors / null


def test_unreachable_sqlite_store(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    uri = f"sqlite:///{blocker}/mlflow.db"
    with pytest.raises(ModbenchError, match="cannot reach MLflow tracking store at") as err:
        Tracker("x", uri=uri).start()
    assert "MLFLOW_TRACKING_URI" in str(err.value) and "\n" not in str(err.value)


def test_unreachable_server_fails_fast():
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(ModbenchError, match=f"127.0.0.1:{port}"):
        Tracker("x", uri=f"http://127.0.0.1:{port}").start()
    with pytest.raises(ModbenchError, match="cannot reach"):
        fail_stale_runs("x", uri=f"postgresql://u:p@127.0.0.1:{port}/db")


def test_unstarted_tracker_refuses_logging():
    tr = Tracker("x", uri="sqlite:////nonexistent-never-created/mlflow.db")
    with pytest.raises(RuntimeError, match="start"):
        tr.log_metrics({"a": 1.0}, step=0)
    with pytest.raises(RuntimeError, match="start"):
        _ = tr.run_id
    tr.end()  # ending a run that never started is a no-op
    assert tr.seconds == 0
    assert not Path("/nonexistent-never-created").exists()


def test_null_tracker(tmp_path):
    with NullTracker("anything", uri="bogus://") as tr:
        tr.log_params({"a": 1})
        tr.set_tags({"b": "c"})
        tr.log_metrics({"loss": 1.0}, step=0)
        tr.flush()
        tr.log_dict({"a": 1}, "c.json")
        tr.log_artifact(tmp_path, "x")
        tr.log_figure(None, "f.png")
    assert tr.run_id is None and tr.seconds == 0
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ValueError):
        tr.end("DONE")


def test_set_tags(store, cwd):
    with Tracker("tags", uri=store) as tr:
        tr.set_tags({f"t{i}": i for i in range(120)})
    tags = MlflowClient(tracking_uri=store).get_run(tr.run_id).data.tags
    assert all(tags[f"t{i}"] == str(i) for i in range(120))


def test_tracking_module_imports_mlflow_lazily():
    import subprocess
    import sys

    code = "import sys, modbench.track.tracking; print('mlflow' in sys.modules)"
    root = Path(tracking.__file__).resolve().parents[1]
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=root, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "False"


def test_environment_tags_name_the_torch_version_without_importing_torch():
    """The tracker process tags every run with torch's version; importing torch for it would cost
    that process seconds."""
    import subprocess
    import sys

    code = ("import sys; from modbench.track.provenance import environment_tags; v = environment_tags()['torch_version']; "
            "imported = 'torch' in sys.modules; import torch; print(imported, v == torch.__version__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False True"


def test_the_command_line_starts_the_tracker_process_before_it_imports_torch():
    """modbench's entry point, and the tracker process's module, import neither torch nor MLflow:
    the process is started first, so its imports run beside torch's (modbench.track.background)."""
    import subprocess
    import sys

    code = ("import sys, modbench.cli.main, modbench.track.background; "
            "print('torch' in sys.modules, 'mlflow' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False False"


# --------------------------------------------------------------------------- heatmap


def test_heatmap_png(tmp_path):
    selected = [np.arange(0, 64, 2), np.arange(16, 48), np.array([], dtype=np.int64), [5]]
    out = routing_heatmap(selected, 64, tmp_path / "sub" / "heat.png", title="layer routing")
    assert out == tmp_path / "sub" / "heat.png"
    width, height = png_size(out)
    assert 300 <= width <= 2500 and 200 <= height <= 1500
    assert width > height  # positions run along the wider x axis


def test_heatmap_pixels_follow_mask():
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    selected = [np.arange(0, 32), np.array([], dtype=int), np.array([5, 60])]
    fig = routing_heatmap_figure(selected, 64, title="t")
    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    rgb = np.asarray(canvas.buffer_rgba())[..., :3].astype(float).mean(axis=2) / 255
    box = fig.axes[0].get_window_extent()
    mask = routing_mask(selected, 64)

    def brightness(layer: int, pos: int) -> float:
        x = box.x0 + (pos + 0.5) / 64 * box.width
        y = box.y1 - (layer + 0.5) / len(selected) * box.height  # layer 0 at the top
        return rgb[int(rgb.shape[0] - y), int(x)]

    for layer in range(len(selected)):
        for pos in (2, 5, 20, 40, 60):
            expected_dark = mask[layer, pos]
            assert (brightness(layer, pos) < 0.5) == expected_dark, (layer, pos)


def test_routing_mask():
    mask = routing_mask([np.array([0, 3]), np.array([], dtype=np.int32)], 4)
    assert mask.tolist() == [[True, False, False, True], [False, False, False, False]]


@pytest.mark.parametrize(
    "selected",
    [[np.array([0, 8])], [np.array([-1])], [np.array([[0, 1]])], [np.array([0.5])], []],
)
def test_heatmap_rejects_bad_input(tmp_path, selected):
    with pytest.raises(ValueError):
        routing_heatmap(selected, 8, tmp_path / "bad.png")
    assert not (tmp_path / "bad.png").exists()


def test_two_workers_logging_one_new_dataset_at_once_both_link_it(tmp_path):
    """MLflow looks a dataset up, then inserts it: a second worker between the two fails on the
    dataset's unique key (seen as a crashed worker in CI). The dataset exists then, and the tracker
    links it on a second try; any other refusal still stops the run."""
    from mlflow.exceptions import MlflowException

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    first = tracking.Tracker("race", uri=uri).start()
    first.log_dataset("stdlib", "a" * 36, "made here", "training")
    second = tracking.Tracker("race", uri=uri).start()
    real = second.client.log_inputs
    calls = []

    def racing(run_id, inputs):  # the other worker's insert landed between our lookup and our insert
        calls.append(run_id)
        if len(calls) == 1:
            raise MlflowException("(sqlite3.IntegrityError) UNIQUE constraint failed: datasets.experiment_id, "
                                  "datasets.name, datasets.digest")
        return real(run_id, inputs)

    second.client.log_inputs = racing
    second.log_dataset("stdlib", "a" * 36, "made here", "training")
    assert len(calls) == 2
    inputs = MlflowClient(uri).get_run(second.run_id).inputs.dataset_inputs
    assert [d.dataset.name for d in inputs] == ["stdlib"]
    second.client.log_inputs = lambda run_id, inputs: (_ for _ in ()).throw(MlflowException("disk I/O error"))
    with pytest.raises(MlflowException, match="disk I/O error"):
        second.log_dataset("other", "b" * 36, "made here", "training")
    first.end()
    second.end()
