"""Tests for modbench.track.offline: runs logged to files without MLflow, imported later."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from mlflow.tracking import MlflowClient

from modbench.errors import ModbenchError
from modbench.track.offline import (
    OFFLINE_RUN_TAG,
    OfflineTracker,
    fail_offline_runs,
    import_offline_runs,
    read_offline_metrics,
    read_offline_runs,
)
from modbench.track.provenance import environment_tags
from modbench.track.tracking import (
    DESCRIPTION_TAG,
    EXPERIMENT_KIND_TAG,
    PARENT_RUN_TAG,
    TRAINING_KIND,
    RunTracker,
)

# MLflow 3.17's SqlAlchemyStore uses an ORM loader SQLAlchemy 2.1 deprecates; not ours.
pytestmark = pytest.mark.filterwarnings("ignore:The ``noload`` loader strategy:DeprecationWarning")


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> str:
    """One SQLite store for the module: creating/migrating it takes seconds."""
    root = tmp_path_factory.mktemp("mlstore")
    return f"sqlite:///{root}/mlflow.db"


def history(client: MlflowClient, run_id: str, key: str) -> list[tuple[int, float]]:
    """(step, value) of every point of ``key`` in that order, NaN as the string 'nan' so lists compare."""
    points = [(m.step, "nan" if math.isnan(m.value) else m.value) for m in client.get_metric_history(run_id, key)]
    return sorted(points, key=lambda p: (p[0], str(p[1])))


def log_study(root: Path, tmp_path: Path) -> tuple[OfflineTracker, OfflineTracker]:
    """A parent run and one trial under it, logging one of everything."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    (tmp_path / "notes.txt").write_text("hello\n")
    with OfflineTracker("offline-study", root=root, run_name="study", experiment_description="the study") as parent:
        parent.log_params({"n_trials": 1})
        with OfflineTracker("offline-study", root=root, run_name="trial-0", parent_run_id=parent.run_id,
                            tags={"variant": "mod"}) as child:
            child.log_params({"lr": 1e-3, "url": "postgresql://u:secret@h/db", "long": "x" * 7000})
            child.set_tags({"phase": "train"})
            child.log_dataset("tinyshakespeare", "abc123", "https://example.com/data.txt", "training")
            child.monitor_system(1.0)
            child.log_metrics({"loss": torch.tensor(3.0), "lr": np.float32(0.5), "skip": None}, step=0)
            child.log_metrics({"loss": 2.0}, step=1)
            child.log_metrics({"loss": 1.5}, step=1)  # the same key twice at one step
            child.log_metrics({"loss": float("nan"), "grad": float("inf")}, step=2)
            child.flush()
            child.log_dict({"model": {"d_model": 64}, "path": Path("/x")}, "config/resolved.json")
            child.log_dict({"a": 1}, "config/resolved.yaml")
            child.log_artifact(tmp_path / "notes.txt", "extra")
            fig, ax = plt.subplots(figsize=(2, 2))
            ax.plot([0, 1], [1, 0])
            child.log_figure(fig, "figures/curve.png")
            plt.close(fig)
    return parent, child


def test_round_trip_into_mlflow(store, tmp_path):
    root = tmp_path / "offline"
    parent, child = log_study(root, tmp_path)
    assert isinstance(child, RunTracker)
    assert child.seconds > 0
    # the files alone hold the run
    record = json.loads((root / child.run_id / "run.json").read_text())
    assert record["status"] == "FINISHED" and record["end_time"] >= record["start_time"]
    assert record["params"]["url"] == "postgresql://u:***@h/db"  # never a password
    assert record["params"]["long"].endswith("...[truncated from 7000 chars]")
    assert record["tags"][PARENT_RUN_TAG] == parent.run_id
    assert [r["run_id"] for r in read_offline_runs(root)] == [parent.run_id, child.run_id]

    mapping = import_offline_runs(root, uri=store)
    assert set(mapping) == {parent.run_id, child.run_id}
    client = MlflowClient(tracking_uri=store)
    run = client.get_run(mapping[child.run_id])
    exp = client.get_experiment(run.info.experiment_id)
    assert exp.name == "offline-study"
    assert exp.tags[EXPERIMENT_KIND_TAG] == TRAINING_KIND and exp.tags[DESCRIPTION_TAG] == "the study"

    assert run.info.status == "FINISHED"
    assert run.info.run_name == "trial-0"
    assert (run.info.start_time, run.info.end_time) == (record["start_time"], record["end_time"])
    assert run.data.params == record["params"]
    assert run.data.tags[PARENT_RUN_TAG] == mapping[parent.run_id]
    assert PARENT_RUN_TAG not in client.get_run(mapping[parent.run_id]).data.tags
    assert run.data.tags[OFFLINE_RUN_TAG] == child.run_id
    assert run.data.tags["variant"] == "mod" and run.data.tags["phase"] == "train"
    assert run.data.tags["git_sha"] == environment_tags()["git_sha"]

    assert history(client, run.info.run_id, "loss") == [(0, 3.0), (1, 1.5), (1, 2.0), (2, "nan")]
    assert history(client, run.info.run_id, "lr") == [(0, 0.5)]
    assert '"value": Infinity' in (root / child.run_id / "metrics.jsonl").read_text()
    assert history(client, run.info.run_id, "grad") == [(2, sys.float_info.max)]  # how MLflow's SQL store keeps inf
    assert "skip" not in run.data.metrics
    assert sorted(client.get_metric_history(run.info.run_id, "loss"), key=lambda m: m.step)[0].timestamp == \
        read_offline_metrics(root / child.run_id)[0]["timestamp"]

    (dataset_input,) = run.inputs.dataset_inputs
    assert (dataset_input.dataset.name, dataset_input.dataset.digest) == ("tinyshakespeare", "abc123")
    assert json.loads(dataset_input.dataset.source) == {"url": "https://example.com/data.txt"}
    assert [(t.key, t.value) for t in dataset_input.tags] == [("mlflow.data.context", "training")]

    rid = run.info.run_id
    assert {a.path for a in client.list_artifacts(rid)} == {"config", "extra", "figures"}
    assert {a.path for a in client.list_artifacts(rid, "config")} == {"config/resolved.json", "config/resolved.yaml"}
    local = Path(client.download_artifacts(rid, "config/resolved.json", str(tmp_path / "dl")))
    assert json.loads(local.read_text()) == {"model": {"d_model": 64}, "path": "/x"}
    assert Path(client.download_artifacts(rid, "extra/notes.txt", str(tmp_path / "dl"))).read_text() == "hello\n"
    png = Path(client.download_artifacts(rid, "figures/curve.png", str(tmp_path / "dl")))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_import_twice_creates_no_duplicates(store, tmp_path):
    root = tmp_path / "offline"
    with OfflineTracker("offline-twice", root=root) as parent:
        with OfflineTracker("offline-twice", root=root, parent_run_id=parent.run_id) as child:
            child.log_metrics({"loss": 1.0}, step=0)
    first = import_offline_runs(root, uri=store)
    with OfflineTracker("offline-twice", root=root) as late:  # a run added since
        pass
    second = import_offline_runs(root, uri=store)
    assert second == {**first, late.run_id: second[late.run_id]}
    client = MlflowClient(tracking_uri=store)
    runs = client.search_runs([client.get_experiment_by_name("offline-twice").experiment_id])
    assert sorted(r.info.run_id for r in runs) == sorted(second.values())
    assert len(client.get_metric_history(second[child.run_id], "loss")) == 1


def test_an_import_cut_off_half_way_is_redone(store, tmp_path):
    root = tmp_path / "offline"
    with OfflineTracker("offline-cut", root=root) as tr:
        tr.log_metrics({"loss": 1.0}, step=0)
    client = MlflowClient(tracking_uri=store)
    exp_id = client.create_experiment("offline-cut")
    half = client.create_run(exp_id, tags={OFFLINE_RUN_TAG: tr.run_id}).info.run_id  # never terminated
    mapping = import_offline_runs(root, uri=store, progress=True)
    assert mapping[tr.run_id] != half
    assert client.get_run(half).info.lifecycle_stage == "deleted"
    assert [r.info.run_id for r in client.search_runs([exp_id])] == [mapping[tr.run_id]]


def test_running_runs_are_imported_killed_and_can_be_failed(store, tmp_path):
    root = tmp_path / "offline"
    dead = OfflineTracker("offline-dead", root=root).start()  # a worker that died: never ended
    dead.log_metrics({"loss": 1.0}, step=0)
    with open(root / dead.run_id / "metrics.jsonl", "a") as f:
        f.write('{"key": "loss", "val')  # the line it was writing when it was killed
    assert read_offline_metrics(root / dead.run_id) == read_offline_metrics(root / dead.run_id)[:1]
    mapping = import_offline_runs(root, uri=store)
    run = MlflowClient(tracking_uri=store).get_run(mapping[dead.run_id])
    assert run.info.status == "KILLED"
    assert run.info.end_time == read_offline_metrics(root / dead.run_id)[0]["timestamp"]  # its last sign of life

    other = OfflineTracker("offline-dead", root=root).start()
    with OfflineTracker("offline-dead", root=root) as done:
        pass
    assert fail_offline_runs(root, [other.run_id, done.run_id, "0" * 32]) == 1
    statuses = {r["run_id"]: r["status"] for r in read_offline_runs(root)}
    assert statuses == {dead.run_id: "RUNNING", other.run_id: "FAILED", done.run_id: "FINISHED"}
    assert fail_offline_runs(root, [other.run_id]) == 0


def test_params_cannot_change_and_resume_appends(tmp_path):
    root = tmp_path / "offline"
    with OfflineTracker("offline-resume", root=root) as first:
        first.log_params({"lr": 0.001})
        first.log_metrics({"loss": 1.0}, step=0)
    with OfflineTracker("offline-resume", root=root, run_id=first.run_id) as again:
        assert json.loads((root / first.run_id / "run.json").read_text())["status"] == "RUNNING"
        again.log_params({"lr": 0.001})  # same value: allowed
        again.log_metrics({"loss": 0.5}, step=1)
        with pytest.raises(ModbenchError, match="params cannot change.*lr"):
            again.log_params({"lr": 0.01, "new": 1})
    record = json.loads((root / first.run_id / "run.json").read_text())
    assert record["params"] == {"lr": "0.001"} and record["status"] == "FINISHED"
    assert [p["step"] for p in read_offline_metrics(root / first.run_id)] == [0, 1]
    with pytest.raises(ModbenchError, match="belongs to experiment 'offline-resume'"):
        OfflineTracker("elsewhere", root=root, run_id=first.run_id).start()
    with pytest.raises(ModbenchError, match="no such run"):
        OfflineTracker("offline-resume", root=root, run_id="0" * 32).start()


def test_exceptions_set_the_status_and_unstarted_trackers_refuse(tmp_path):
    with pytest.raises(KeyboardInterrupt):
        with OfflineTracker("x", root=tmp_path) as tr:
            raise KeyboardInterrupt
    assert read_offline_runs(tmp_path)[0]["status"] == "KILLED"
    with pytest.raises(ValueError, match="FINISHED"):
        tr.end("DONE")
    fresh = OfflineTracker("x", root=tmp_path / "none")
    with pytest.raises(RuntimeError, match="start"):
        fresh.log_metrics({"a": 1.0}, step=0)
    with pytest.raises(RuntimeError, match="start"):
        _ = fresh.run_id
    fresh.end()  # ending a run that never started is a no-op
    assert fresh.seconds == 0 and not (tmp_path / "none").exists()
    with OfflineTracker("x", root=tmp_path) as tr2:
        with pytest.raises(ValueError, match="inside the run"):
            tr2.log_dict({}, "../escape.json")


def test_a_store_that_refuses_writes_is_one_line(store, tmp_path, monkeypatch):
    root = tmp_path / "offline"
    with OfflineTracker("offline-ro", root=root):
        pass
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(ModbenchError, match="cannot reach MLflow tracking store") as err:
        import_offline_runs(root, uri=f"sqlite:///{blocker}/mlflow.db")
    assert "\n" not in str(err.value)

    from mlflow.exceptions import MlflowException

    def refuse(*args, **kwargs):
        raise MlflowException("(sqlite3.OperationalError) attempt to write a readonly database\n[SQL: INSERT ...]")

    monkeypatch.setattr(MlflowClient, "log_batch", refuse)
    with pytest.raises(ModbenchError, match="refused the import of offline run .*attempt to write a readonly database") as err:
        import_offline_runs(root, uri=store)
    assert "\n" not in str(err.value)


def test_the_offline_tracker_needs_no_mlflow(tmp_path):
    """What a lent GPU machine runs: importing the module and a whole session, with MLflow
    impossible to import."""
    code = textwrap.dedent(f"""
        import sys

        class NoMlflow:
            def find_spec(self, name, path=None, target=None):
                if name == "mlflow" or name.startswith("mlflow."):
                    raise ImportError("no mlflow here")
                return None

        sys.meta_path.insert(0, NoMlflow())
        import modbench.track.offline as offline
        from pathlib import Path
        root = Path({str(tmp_path / "offline")!r})
        (root.parent / "a.txt").write_text("a")
        with offline.OfflineTracker("gpu", root=root) as parent:
            with offline.OfflineTracker("gpu", root=root, parent_run_id=parent.run_id, tags={{"k": "v"}}) as tr:
                tr.log_params({{"lr": 0.1}})
                tr.set_tags({{"t": "1"}})
                tr.log_dataset("d", "digest", "made here", "training")
                tr.monitor_system(1.0)
                tr.log_metrics({{"loss": 1.0}}, step=0)
                tr.flush()
                tr.log_dict({{"a": 1}}, "c/config.yaml")
                tr.log_artifact(root.parent / "a.txt", "files")
        offline.fail_offline_runs(root, [tr.run_id])
        assert len(offline.read_offline_runs(root)) == 2
        try:
            import mlflow
        except ImportError:
            pass
        else:
            raise SystemExit("the finder did not block mlflow")
        print("mlflow" in sys.modules)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
    (run,) = [r for r in read_offline_runs(tmp_path / "offline") if r["parent_run_id"]]
    assert run["params"] == {"lr": "0.1"} and run["tags"]["t"] == "1" and run["status"] == "FINISHED"
    assert (tmp_path / "offline" / run["run_id"] / "artifacts" / "c" / "config.yaml").read_text() == "a: 1\n"
    assert (tmp_path / "offline" / run["run_id"] / "artifacts" / "files" / "a.txt").read_text() == "a"
