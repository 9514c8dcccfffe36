"""The GPU study kit (modbench.study.slot): a study that runs on a machine without MLflow or
statsmodels, stops at a deadline, travels as one archive, resumes on another machine, and is
imported into MLflow and Optuna here so that the report reads it like any other study."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import optuna
import pytest

from modbench.design.study_file import load_study
from modbench.data import STDLIB_FILE_ENV, dataset_origin, load_corpus, stdlib_file_name
from modbench.errors import ModbenchError
from modbench.study import slot
from modbench.study.runner import longest_trial_s, run_study

REPO = Path(__file__).resolve().parents[1]
DRY = REPO / "tests" / "studies" / "slot_dry.toml"
# What a lent GPU machine lacks besides Optuna: a worker must not import them (the kit brings no wheels for them).
ABSENT_ON_GPU = ("mlflow", "statsmodels", "tomli_w", "zstandard", "psutil")
BLOCKER = """import sys
class _Absent:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {names!r}:
            raise ImportError("not on the GPU machine: " + name)
sys.meta_path.insert(0, _Absent())
"""


def _gpu_like_env(tmp: Path) -> dict[str, str]:
    """The environment of a GPU machine as far as imports go: the absent packages cannot be imported
    (a sitecustomize on PYTHONPATH, inherited by every worker the slot starts)."""
    site = tmp / "gpu-site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(BLOCKER.format(names=set(ABSENT_ON_GPU)))
    return {**os.environ, "PYTHONPATH": f"{site}{os.pathsep}{REPO}", "MODBENCH_DATA_DIR": str(tmp / "data")}


def _modbench(*args: str, env=None, cwd=None, timeout=600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "modbench.cli.main", *args], capture_output=True, text=True,
                          env=env, cwd=cwd, timeout=timeout)


def _points(name: str, url: str) -> list[tuple[str, int, str, float | None]]:
    study = optuna.load_study(study_name=name, storage=url)
    return sorted((t.user_attrs["arm"], t.user_attrs["seed"], t.state.name, t.value) for t in study.trials
                  if not t.user_attrs.get("requeued") and not t.user_attrs.get("surplus"))


# --- the corpus that travels ----------------------------------------------------------------------
def test_a_pinned_stdlib_corpus_is_the_file_its_hash_names(tmp_path, monkeypatch):
    payload = b"def f(x):\n    return x + 1\n" * 200
    sha = hashlib.sha256(payload).hexdigest()
    pinned = tmp_path / stdlib_file_name(sha)
    pinned.write_bytes(payload)
    monkeypatch.setenv(STDLIB_FILE_ENV, str(pinned))
    corpus = load_corpus("stdlib", root=tmp_path / "cache")
    assert corpus.sha256 == sha and corpus.name == "stdlib"
    assert bytes(corpus.train) + bytes(corpus.val) + bytes(corpus.test) == payload
    assert pinned.name in dataset_origin("stdlib")
    assert not (tmp_path / "cache").exists() or not list((tmp_path / "cache").glob("stdlib-3*.bin")), \
        "this interpreter's library was built although a file was pinned"
    damaged = tmp_path / stdlib_file_name("0" * 64)
    damaged.write_bytes(payload)
    monkeypatch.setenv(STDLIB_FILE_ENV, str(damaged))
    with pytest.raises(ModbenchError, match="damaged"):
        load_corpus("stdlib", root=tmp_path / "cache")
    monkeypatch.setenv(STDLIB_FILE_ENV, str(tmp_path / "missing.bin"))
    with pytest.raises(ModbenchError, match=STDLIB_FILE_ENV):
        load_corpus("stdlib", root=tmp_path / "cache")


# --- the deadline ---------------------------------------------------------------------------------
@pytest.mark.slow
def test_no_trial_starts_that_the_longest_finished_trial_says_would_end_after_the_deadline(tmp_path, monkeypatch):
    monkeypatch.setenv("MODBENCH_DATA_DIR", str(tmp_path / "data"))
    out, runs = tmp_path / "out", tmp_path / "out" / "runs"
    first = run_study(DRY, out_dir=out, n_trials=1, progress=False, tracking_uri="sqlite:///unused.db", offline_runs=runs)
    assert first.ran == 1
    url = first.storage
    longest = longest_trial_s(optuna.load_study(study_name="slot_dry", storage=url))
    assert longest > 0
    # Time enough for half of the longest trial: nothing starts, nothing is lost.
    cut = run_study(DRY, out_dir=out, progress=False, tracking_uri="sqlite:///unused.db", offline_runs=runs,
                    deadline=time.time() + longest / 2)
    assert cut.ran == 0 and cut.counts.get("COMPLETE") == 1
    # Time enough for several: trials run, and each started before the deadline less its estimate.
    deadline = time.time() + 600
    more = run_study(DRY, out_dir=out, n_trials=2, progress=False, tracking_uri="sqlite:///unused.db", offline_runs=runs,
                     deadline=deadline)
    assert more.ran == 2
    study = optuna.load_study(study_name="slot_dry", storage=url)
    assert all(t.datetime_complete.timestamp() <= deadline for t in study.trials if t.datetime_complete)
    # No MLflow store was touched: every run is a folder.
    assert not Path("unused.db").exists()
    assert len([p for p in runs.iterdir() if (p / "run.json").is_file()]) == 1 + 3  # the parent and three trials


# --- one study over two slots, then imported -----------------------------------------------------
@pytest.mark.slow
def test_a_study_cut_short_resumes_from_its_archive_elsewhere_and_imports_for_the_report(tmp_path, monkeypatch):
    monkeypatch.setenv("MODBENCH_DATA_DIR", str(tmp_path / "data"))
    study = load_study(DRY)
    # Slot 1 (in process): three trials, then the archive, with no room for checkpoints.
    first = tmp_path / "machine1"
    done = run_study(DRY, out_dir=first, n_trials=3, progress=False, tracking_uri="sqlite:///unused.db",
                     offline_runs=first / "slot_dry" / "runs")
    assert done.ran == 3
    archive1 = tmp_path / "slot1.tar.gz"
    manifest = slot.write_archive(first / "slot_dry", study, archive1, call={"device": "test"}, checkpoint_mib=0)
    assert manifest["checkpoints"]["kept"] == [] and len(manifest["checkpoints"]["left_out"]) == 3
    with tarfile.open(archive1) as tar:
        assert not [n for n in tar.getnames() if n.endswith("checkpoint.pt")]
    before = [p for p in _points("slot_dry", done.storage) if p[2] == "COMPLETE"]
    assert len(before) == 3

    # Slot 2 (another machine, as a GPU machine imports: no MLflow, no statsmodels): the CLI, the worker
    # count measured in the same call (--workers auto: the probe of 1 and 2 workers, then the study).
    env = _gpu_like_env(tmp_path)
    archive2 = tmp_path / "slot2" / "slot2.tar.gz"
    second = tmp_path / "machine2"
    res = _modbench("study", "slot", str(DRY), "--workers", "auto", "--probe-workers", "1,2", "--minutes", "8",
                    "--resume", str(archive1), "--archive", str(archive2), "--out-dir", str(second), "--quiet", env=env)
    assert res.returncode == 0, res.stdout + res.stderr + "".join(
        p.read_text() for p in (second / "slot" / "slot_dry" / "logs").glob("*.log"))
    summary = json.loads(res.stdout.strip().splitlines()[-1])
    assert set(summary["trials"]) == {"COMPLETE"}
    url2 = f"sqlite:///{second / 'slot' / 'slot_dry' / 'optuna.db'}"
    after = _points("slot_dry", url2)
    assert set(before) <= set(after), "a trial of the first slot was lost or run again"
    keys = [(arm, seed) for arm, seed, _, _ in after]
    assert len(keys) == len(set(keys)), "an (arm, seed) ran twice"
    stages = optuna.load_study(study_name="slot_dry", storage=url2).user_attrs
    assert stages["stages_complete"] is True
    with tarfile.open(archive2) as tar:
        manifest2 = json.loads(tar.extractfile("manifest.json").read())
    assert [c.get("device") for c in manifest2["calls"]] == ["test", "cpu"]
    probe = manifest2["calls"][-1]["probe"]
    assert probe["candidates"] == [1, 2] and [r["workers"] for r in probe["settings"]] == [1, 2]
    assert probe["arm"] == "dense L3" and probe["budget"] == "steps=2"  # the heaviest arm, a third of steps=6
    assert all(r["status"] == "ok" and r["trials"] == r["workers"] for r in probe["settings"]), probe
    assert manifest2["calls"][-1]["workers"] == probe["chosen"] == slot.best_worker_count(probe["settings"])
    table = (archive2.parent / "slot_dry-slot-probe.md").read_text()  # beside the archive: it comes back too
    assert "| off | 1 | 1/1 |" in table and "| off | 2 | 2/2 |" in table
    assert json.loads((archive2.parent / "slot_dry-slot-probe.json").read_text())["arms"] == ["dense L3"]
    assert manifest2["checkpoints"]["kept"], "the report's checkpoints fit the default budget at this size"

    # Here: import (twice: nothing doubles), then the report reads it as it reads a local study.
    here = tmp_path / "here"
    uri = f"sqlite:///{here / 'mlflow.db'}"
    for _ in range(2):
        imp = _modbench("study", "import", str(archive2), "--out-dir", str(here / "studies"), "--tracking-uri", uri,
                        "--quiet")
        assert imp.returncode == 0, imp.stdout + imp.stderr
    info = json.loads(imp.stdout.strip().splitlines()[-1])
    # Every trial's run and the study's parent run; a machine loaded enough to miss heartbeats may add the
    # run of a trial retried as stale (Optuna's heartbeat retry), which no trial points at.
    assert info["trials"] == len(after) and info["runs"] >= len(after) + 1
    local = f"sqlite:///{here / 'studies' / 'slot_dry' / 'optuna.db'}"
    assert _points("slot_dry", local) == after
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    runs = client.search_runs([client.get_experiment_by_name("slot_dry").experiment_id], max_results=1000)
    assert len(runs) == info["runs"]
    by_id = {r.info.run_id: r for r in runs}
    parent = [r for r in runs if r.data.tags.get("modbench.role") == "study"]
    assert len(parent) == 1 and parent[0].info.status == "FINISHED"
    lstudy = optuna.load_study(study_name="slot_dry", storage=local)
    assert lstudy.user_attrs["mlflow_parent_run_id"] == parent[0].info.run_id
    for t in lstudy.trials:
        if t.state != optuna.trial.TrialState.COMPLETE:  # a surplus trial (the queue was empty) ran nothing
            continue
        run = by_id[t.user_attrs["mlflow_run_id"]]  # every trial points at its imported run
        assert run.data.tags["mlflow.parentRunId"] == parent[0].info.run_id
        assert run.data.metrics["val/causal_bpb"] == pytest.approx(t.user_attrs["val/causal_bpb"])
        history = client.get_metric_history(run.info.run_id, "val/bpb")
        assert [m.step for m in history] == sorted(m.step for m in history) and history
    left_out = [r for r in runs if "modbench.checkpoint_left_out" in r.data.tags]
    assert len(left_out) == len(manifest2["checkpoints"]["left_out"])
    assert all("modbench.checkpoint" not in r.data.tags for r in left_out)

    report = _modbench("report", str(DRY), "--out-dir", str(here / "studies"), "--tracking-uri", uri, "--reports-dir",
                       str(here / "reports"), "--quiet", cwd=tmp_path)
    assert report.returncode == 0, report.stdout + report.stderr
    text = (here / "reports" / "slot_dry" / "report.md").read_text()
    assert "## Claims" in text and "## Environment" in text
    # where it ran: the two calls, the second's workers chosen by its probe
    assert "It ran in 2 slot calls (`modbench study slot`, the lent-GPU path): test; cpu, 8 min bound" in text
    assert f"{probe['chosen']} worker" in text and "chosen by a probe on the heaviest arm, trials/min by workers: 1: " in text


# --- --workers auto -------------------------------------------------------------------------------
def _row(n: int, per_min: float, status: str = "ok", trials: int | None = None) -> dict:
    return {"workers": n, "trials": n if trials is None else trials, "trials_per_min": per_min, "status": status}


@pytest.mark.parametrize("rows, chosen", [
    ([_row(4, 10.0), _row(8, 16.0)], 8),                     # 8 clearly faster
    ([_row(4, 10.0), _row(8, 10.4)], 4),                     # within 5 %: the fewer in flight
    ([_row(1, 3.0), _row(4, 10.0), _row(8, 9.0)], 4),        # past the GPU's limit 8 is slower
    ([_row(4, 10.0), _row(8, 30.0, "failed")], 4),           # out of memory at 8: not a candidate
    ([_row(4, 10.0, "incomplete"), _row(8, 0.0, "failed", 0)], None),  # nothing clean: the caller runs one
    ([_row(4, 0.0, trials=0)], None),
])
def test_auto_runs_the_fewest_workers_near_the_best_clean_rate(rows, chosen):
    assert slot.best_worker_count(rows) == chosen


def test_auto_probes_the_heaviest_arm_at_a_third_of_its_budget(tmp_path):
    from modbench.design.controls import study_arms
    from modbench.design.study_file import find_study
    from modbench.model.sizing import flops_per_token

    study = load_study(find_study("paper_claims_gpu"))
    args = slot.auto_probe_args(study, (4, 8), 60.0, tmp_path)
    per_token = {study.label(a): flops_per_token(c.model, c.routing, c.train.seq_len)
                 for a in study_arms(study) for c in [study.run_config(a, 0)]}
    assert args.arms == ("sigmoid C=0.125 alternate L8",) == (max(per_token, key=per_token.get),)
    assert args.budget == "flops=5e+14" and args.workers == (4, 8) and args.trials_per_worker == 1
    assert args.timeout_s == 60.0 and args.compile == ("off",) and args.json.parent == tmp_path


def test_a_later_call_on_the_same_device_reuses_the_probe_its_manifest_records(tmp_path):
    def call(device, candidates, chosen, started):
        return {"device": device, "started": started, "workers": chosen,
                "probe": {"candidates": candidates, "settings": [], "chosen": chosen}}
    (tmp_path / slot.MANIFEST).write_text(json.dumps({"calls": [
        call("NVIDIA H100 80GB HBM3", [4, 8], 8, "t1"),
        {"device": "NVIDIA H100 80GB HBM3", "started": "t2", "workers": 8, "probe": {"reused": "t1", "chosen": 8}},
        call("NVIDIA H200", [4, 8], 4, "t3")]}))
    assert slot.earlier_choice(tmp_path, "NVIDIA H100 80GB HBM3", (4, 8)) == {"workers": 8, "from": "t1"}
    assert slot.earlier_choice(tmp_path, "NVIDIA H200", (4, 8)) == {"workers": 4, "from": "t3"}
    assert slot.earlier_choice(tmp_path, "NVIDIA H100 80GB HBM3", (2, 4)) is None  # other candidates: probe again
    assert slot.earlier_choice(tmp_path, "cpu", (4, 8)) is None
    assert slot.earlier_choice(tmp_path / "new", "NVIDIA H200", (4, 8)) is None  # a first call


def test_a_probe_that_breaks_or_has_no_time_still_leaves_the_slot_its_study(tmp_path, monkeypatch):
    import modbench.study.workers_probe as workers_probe

    def broken(args):
        raise RuntimeError("CUDA error: an illegal memory access was encountered\nmore")
    monkeypatch.setattr(workers_probe, "probe", broken)
    study, settings, lines = load_study(DRY), slot.SlotSettings(workers="auto", probe_workers=(4, 8)), []
    n, record = slot.choose_workers(study, tmp_path, settings, time.time() + 600, "cpu", tmp_path, lines.append)
    assert n == 1 and record == {"failed": "RuntimeError: CUDA error: an illegal memory access was encountered",
                                 "candidates": [4, 8], "chosen": 1}
    assert "the probe failed" in lines[-1]
    n, record = slot.choose_workers(study, tmp_path, settings, time.time() + 60, "cpu", tmp_path, lines.append)
    assert n == 4 and record["skipped"] == "no time"  # 60 s: under 20 s a setting, nothing measured


def test_each_slot_worker_gets_its_share_of_the_cores_as_the_probe_measured(tmp_path, monkeypatch):
    from modbench.study.workers_probe import thread_share

    started = []

    class Done:  # a worker that has already ended
        def __init__(self, command, **kwargs):
            started.append(kwargs["env"])
            self.returncode, self.pid = 0, 0

        def poll(self):
            return 0

    monkeypatch.setattr(slot.subprocess, "Popen", Done)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    slot._run_workers(load_study(DRY), tmp_path / "s", 3, time.time() + 60, 10.0, lambda line: None)
    assert [e["OMP_NUM_THREADS"] for e in started] == [str(thread_share(3))] * 3
    assert thread_share(3) == max(1, len(os.sched_getaffinity(0)) // 3)
    started.clear()
    monkeypatch.setenv("OMP_NUM_THREADS", "5")  # the user's own setting wins
    slot._run_workers(load_study(DRY), tmp_path / "s", 2, time.time() + 60, 10.0, lambda line: None)
    assert [e["OMP_NUM_THREADS"] for e in started] == ["5", "5"]


def test_the_slot_reads_the_gpus_name_in_a_child_so_its_own_process_holds_no_cuda_context(monkeypatch):
    import torch

    def in_process(*args):  # what initialises CUDA in the slot's process
        raise AssertionError("the slot's own process read the GPU")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", in_process)
    # The child is a real process; it prints a name as the real code's torch.cuda.get_device_name(0) does.
    monkeypatch.setattr(slot, "DEVICE_NAME_CODE", "import os; print('NVIDIA H100 80GB HBM3', os.getpid())")
    name = slot._machine()["device"]
    assert name.startswith("NVIDIA H100 80GB HBM3 ") and int(name.split()[-1]) != os.getpid()
    # A child that cannot read it: this process does, and the slot still has a name to record.
    monkeypatch.setattr(slot, "DEVICE_NAME_CODE", "raise SystemExit(3)")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *args: "read in the slot's process")
    assert slot._machine()["device"] == "read in the slot's process"


# --- refusals: one line, exit 2, nothing created or lost -----------------------------------------
def test_bad_slot_and_import_input_is_one_line_and_creates_nothing(tmp_path):
    out = tmp_path / "out"
    cases = {
        ("study", "slot", str(DRY), "--workers", "0", "--out-dir", str(out)): "--workers",
        ("study", "slot", str(DRY), "--workers", "some", "--out-dir", str(out)): "'auto'",
        ("study", "slot", str(DRY), "--workers", "auto", "--probe-workers", "4,0", "--out-dir", str(out)):
            "--probe-workers",
        ("study", "slot", str(DRY), "--minutes", "0.5", "--out-dir", str(out)): "--minutes",
        ("study", "slot", str(DRY), "--resume", str(tmp_path / "none.tar.gz"), "--out-dir", str(out)): "--resume",
        ("study", "slot", str(tmp_path / "nostudy.toml"), "--out-dir", str(out)): "nostudy",
        ("study", "import", str(tmp_path / "none.tar.gz"), "--out-dir", str(out)): "no archive",
    }
    junk = tmp_path / "junk.tar.gz"
    junk.write_bytes(b"not a tar")
    cases[("study", "import", str(junk), "--out-dir", str(out), "--tracking-uri", f"sqlite:///{out}/mlflow.db")] = \
        "not a slot archive"
    for args, needle in cases.items():
        res = _modbench(*args, cwd=tmp_path)
        assert res.returncode == 2, (args, res.stdout, res.stderr)
        lines = res.stderr.strip().splitlines()
        assert len(lines) == 1 and needle in lines[0] and "Traceback" not in res.stderr, (args, res.stderr)
        assert not out.exists(), (args, "created storage")


@pytest.mark.slow
def test_import_never_replaces_a_study_that_did_not_come_from_an_archive(tmp_path, monkeypatch):
    monkeypatch.setenv("MODBENCH_DATA_DIR", str(tmp_path / "data"))
    study = load_study(DRY)
    machine = tmp_path / "machine"
    run_study(DRY, out_dir=machine, n_trials=1, progress=False, tracking_uri="sqlite:///unused.db",
              offline_runs=machine / "slot_dry" / "runs")
    archive = tmp_path / "a.tar.gz"
    slot.write_archive(machine / "slot_dry", study, archive, call={}, checkpoint_mib=12)
    # A study of the same name that ran here (its own MLflow runs): the import must leave it alone.
    here = tmp_path / "here"
    local = run_study(DRY, out_dir=here, n_trials=1, progress=False, tracking_uri=f"sqlite:///{tmp_path}/mlflow.db")
    before = _points("slot_dry", local.storage)
    res = _modbench("study", "import", str(archive), "--out-dir", str(here), "--tracking-uri",
                    f"sqlite:///{tmp_path}/mlflow.db")
    assert res.returncode == 2 and "was not imported from a slot archive" in res.stderr
    assert _points("slot_dry", local.storage) == before


@pytest.mark.slow
def test_a_checkpoint_left_on_the_slot_still_gives_the_report_its_routing(tmp_path, monkeypatch):
    """A checkpoint too large for the archive stays on the lent machine; the routing masks the report
    draws from it are computed there and travel instead (routing section and heatmap intact)."""
    from mlflow.tracking import MlflowClient

    from modbench.report.routing_analysis import MASKS_ARTIFACT, MASKS_TAG

    monkeypatch.setenv("MODBENCH_DATA_DIR", str(tmp_path / "data"))
    study = load_study(DRY)
    machine = tmp_path / "machine"
    run_study(DRY, out_dir=machine, n_trials=4, progress=False, tracking_uri="sqlite:///unused.db",
              offline_runs=machine / "slot_dry" / "runs")
    archive = tmp_path / "a.tar.gz"
    manifest = slot.write_archive(machine / "slot_dry", study, archive, call={}, checkpoint_mib=0)
    assert manifest["checkpoints"]["kept"] == [] and manifest["checkpoints"]["left_out"]
    with tarfile.open(archive) as tar:
        masks = [n for n in tar.getnames() if n.endswith(MASKS_ARTIFACT)]
    assert masks, "no routed run's masks travelled"
    here = tmp_path / "here"
    uri = f"sqlite:///{here / 'mlflow.db'}"
    res = _modbench("study", "import", str(archive), "--out-dir", str(here / "studies"), "--tracking-uri", uri, "--quiet")
    assert res.returncode == 0, res.stderr
    client = MlflowClient(uri)
    runs = client.search_runs([client.get_experiment_by_name("slot_dry").experiment_id])
    tagged = [r for r in runs if r.data.tags.get(MASKS_TAG)]
    assert len(tagged) == len(masks) and all("modbench.checkpoint" not in r.data.tags for r in tagged)
    report = _modbench("report", str(DRY), "--out-dir", str(here / "studies"), "--tracking-uri", uri, "--reports-dir",
                       str(here / "reports"), "--quiet", cwd=tmp_path)
    assert report.returncode == 0, report.stdout + report.stderr
    text = (here / "reports" / "slot_dry" / "report.md").read_text()
    routing = text.split("## Routing", 1)[1].split("\n## ", 1)[0]
    assert "No trial checkpoints were found" not in routing and "routing_positions.png" in routing
