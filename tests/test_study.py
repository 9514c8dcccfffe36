"""Studies: end to end on SQLite, resume, kill-and-retry, two workers on PostgreSQL, bad files."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import mlflow
import optuna
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mlflow.tracking import MlflowClient

from modbench.cli.main import main
from modbench.errors import ModbenchError
from modbench.results import ALIASES
from modbench.track.optuna_store import trials_frame
from modbench.design.study_file import load_study

REPO = Path(__file__).resolve().parents[1]
SMOKE = REPO / "studies" / "smoke.toml"
POSTGRES = os.environ.get("MODBENCH_TEST_POSTGRES_URL")


def cli(*args: str, cwd: Path, env: dict | None = None, wait: bool = True):
    cmd = [sys.executable, "-m", "modbench.cli.main", *args]
    full_env = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    if wait:
        return subprocess.run(cmd, cwd=cwd, env=full_env, capture_output=True, text=True, timeout=600)
    return subprocess.Popen(cmd, cwd=cwd, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def smoke_variant(tmp: Path, name: str, steps: int = 6, seeds=(0, 1), extra: str = "") -> Path:
    text = SMOKE.read_text().replace('name = "smoke"', f'name = "{name}"')
    text = text.replace('budget = "steps=6"', f'budget = "steps={steps}"').replace("seeds = [0, 1]", f"seeds = {list(seeds)}")
    path = tmp / f"{name}.toml"
    path.write_text(text + extra)
    return path


def sqlite_url(tmp: Path, name: str) -> str:
    return f"sqlite:///{tmp}/runs/studies/{name}/optuna.db"


def exactly_once(df) -> None:
    done = df[df.state == "COMPLETE"]
    keys = list(zip(done.arm, done.seed))
    assert len(keys) == len(set(keys)), f"an (arm, seed) completed twice: {sorted(keys)}"


def test_smoke_study_end_to_end_with_mlflow_parent_and_children(tmp_cwd):
    rc = main(["study", "run", str(SMOKE), "--quiet"])
    assert rc == 0
    df = trials_frame("smoke", sqlite_url(tmp_cwd, "smoke"))
    assert sorted(df.state) == ["COMPLETE"] * 4
    assert sorted(zip(df.arm, df.seed)) == [("dense", 0), ("dense", 1), ("sigmoid C=0.25 alternate", 0), ("sigmoid C=0.25 alternate", 1)]
    mlflow.set_tracking_uri(f"sqlite:///{tmp_cwd}/mlflow.db")
    runs = mlflow.search_runs(experiment_names=["smoke"], output_format="list")
    parents = [r for r in runs if r.data.tags.get("modbench.role") == "study"]
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId")]
    assert len(parents) == 1 and parents[0].info.status == "FINISHED"
    assert len(children) == 4
    assert {r.data.tags["mlflow.parentRunId"] for r in children} == {parents[0].info.run_id}
    for r in children:
        assert r.info.status == "FINISHED" and r.data.tags["optuna.state"] == "COMPLETE"
        assert "val/bpb" in r.data.metrics and "trial.number" in r.data.params
        # One spelling: the declared names, never an old alias or an objective/ duplicate.
        assert not [k for k in r.data.metrics if k in ALIASES or k.startswith("objective/")]
        assert r.data.tags["modbench.checkpoint"] == "checkpoint/checkpoint.pt"
        assert r.info.run_name == f"{r.data.tags['modbench.arm']} s{r.data.tags['modbench.seed']}"  # arm first
        assert r.data.tags["optuna.trial_number"].isdigit()
    exp = MlflowClient(f"sqlite:///{tmp_cwd}/mlflow.db").get_experiment_by_name("smoke")
    assert exp.tags["mlflow.experimentKind"] == "custom_model_development"  # the training layout, not GenAI
    assert exp.tags["mlflow.note.content"] == load_study(SMOKE).settings.description
    assert set(df.mlflow_run_id) == {r.info.run_id for r in children}
    assert "best/val/bpb" in parents[0].data.metrics
    study = optuna.load_study(study_name="smoke", storage=sqlite_url(tmp_cwd, "smoke"))
    assert study.metric_names == ["val/bpb"]  # the dashboard's name for the objective
    for trial in study.trials:
        assert trial.user_attrs["val/bpb"] == trial.value
        assert not set(trial.user_attrs) & set(ALIASES)


def test_resume_adds_trials_without_duplicates(tmp_cwd):
    path = smoke_variant(tmp_cwd, "resume")
    assert main(["study", "run", str(path), "--n-trials", "2", "--quiet"]) == 0
    df = trials_frame("resume", sqlite_url(tmp_cwd, "resume"))
    assert (df.state == "COMPLETE").sum() == 2 and (df.state == "WAITING").sum() == 2
    first = set(df[df.state == "COMPLETE"].number)
    assert main(["study", "run", str(path), "--quiet"]) == 0
    df = trials_frame("resume", sqlite_url(tmp_cwd, "resume"))
    assert len(df) == 4 and (df.state == "COMPLETE").all()
    exactly_once(df)
    assert first <= set(df.number)
    assert main(["study", "run", str(path), "--quiet"]) == 0  # nothing left: runs nothing
    assert len(trials_frame("resume", sqlite_url(tmp_cwd, "resume"))) == 4


def test_status_command_json(tmp_cwd, capsys):
    path = smoke_variant(tmp_cwd, "status")
    main(["study", "run", str(path), "--n-trials", "1", "--quiet"])
    capsys.readouterr()
    assert main(["study", "status", str(path), "--json"]) == 0
    import json

    out = json.loads(capsys.readouterr().out)
    assert out["trials"] == {"COMPLETE": 1, "WAITING": 3}


def running_trial(name: str, storage: str, *, completed: int, running: int = 1, timeout_s: float = 300):
    """Wait for an event, never a fixed time: ``completed`` trials done and ``running`` RUNNING trials
    that have opened their MLflow runs (so Optuna has recorded their first heartbeat). Returns the first."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        try:
            df = trials_frame(name, storage)
            now = df[df.state == "RUNNING"]
            if (df.state == "COMPLETE").sum() == completed and len(now) == running \
                    and now.mlflow_run_id.map(lambda r: isinstance(r, str)).all():
                return now.iloc[0]
        except ModbenchError:
            pass
        time.sleep(0.3)
    pytest.fail(f"no {running} running trial(s) after {completed} completed ones within {timeout_s:g} s")


def storages(tmp: Path, name: str):
    return POSTGRES or sqlite_url(tmp, name)


@pytest.mark.slow
@pytest.mark.parametrize("rerun", ["after_grace", "at_once"])
def test_killed_worker_trial_is_retried_and_its_mlflow_run_failed(tmp_path, rerun):
    """SIGKILL mid-trial. After the grace period the heartbeat marks it dead; re-run at once on
    the same host, the worker's vanished pid does (the grace is then long enough not to)."""
    name = f"kill_{rerun}_{os.getpid()}"
    # Trials long enough (hundreds of steps) that the kill lands mid-trial on any machine; the
    # kill is triggered by an event, never a sleep: the second trial is RUNNING and has opened
    # its MLflow run (so Optuna has recorded its first heartbeat, which starts with the trial).
    path = smoke_variant(tmp_path, name, steps=600, seeds=(0,))
    storage = POSTGRES or sqlite_url(tmp_path, name)
    (tmp_path / "runs" / "studies" / name).mkdir(parents=True)
    grace = "3" if rerun == "after_grace" else "600"
    args = ["study", "run", str(path), "--storage", storage, "--heartbeat", "1", "--grace", grace, "--quiet"]
    worker = cli(*args, cwd=tmp_path, wait=False)
    try:
        running_trial(name, storage, completed=1)
        worker.send_signal(signal.SIGKILL)
        worker.wait(timeout=30)
    finally:
        if worker.poll() is None:
            worker.kill()
    before = trials_frame(name, storage)
    finished_before = before[before.state == "COMPLETE"][["number", "arm", "seed", "val/bpb"]]
    killed = before[before.state == "RUNNING"].iloc[0]
    if rerun == "after_grace":
        time.sleep(3.5)  # past the grace period: the heartbeat is what declares the worker dead
    done = cli(*args, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    after = trials_frame(name, storage)
    # finished trials are intact
    merged = finished_before.merge(after, on="number", suffixes=("", "_after"))
    assert (merged["val/bpb"] == merged["val/bpb_after"]).all() and len(merged) == len(finished_before)
    # the killed trial failed and the same (arm, seed) was retried to completion
    if rerun == "after_grace":
        assert after.set_index("number").loc[killed.number, "state"] == "FAIL"
    else:
        assert killed.number not in set(after.number)  # failed, re-queued, and left out of the results
        assert "lost its worker" in done.stderr
    retried = after[(after.arm == killed.arm) & (after.seed == killed.seed) & (after.state == "COMPLETE")]
    assert len(retried) == 1 and retried.number.iloc[0] > killed.number
    exactly_once(after)
    assert (after.state == "COMPLETE").sum() == 2
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    assert client.get_run(killed.mlflow_run_id).info.status == "FAILED"


@pytest.mark.skipif(not POSTGRES, reason="set MODBENCH_TEST_POSTGRES_URL (CI starts PostgreSQL on 127.0.0.1)")
def test_two_workers_on_postgresql_run_every_trial_exactly_once(tmp_path):
    name = f"pg_two_workers_{os.getpid()}_{int(time.time())}"
    # Trials long enough (~4 s each on 2 cores) that the second worker, which needs a few
    # seconds to import torch and join, cannot find the queue already emptied by the first.
    path = smoke_variant(tmp_path, name, steps=60, seeds=(0, 1, 2))
    args = ["study", "run", str(path), "--storage", POSTGRES, "--quiet"]
    env = {"MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path}/mlflow.db"}
    workers = [cli(*args, cwd=tmp_path, env=env, wait=False) for _ in range(2)]
    outputs = [w.communicate(timeout=600)[0] for w in workers]
    assert [w.returncode for w in workers] == [0, 0], outputs
    df = trials_frame(name, POSTGRES)
    assert len(df) == 6 and (df.state == "COMPLETE").all()
    exactly_once(df)
    assert df.worker.nunique() == 2, f"one worker did everything: {df.worker.value_counts().to_dict()}; outputs: {outputs}"


_TUNED = '[study]\nname = "b"\nseeds = [0, 1]\nclaims = ["mod_vs_best_dense"]\n[train]\nbudget = "flops=1e12"\n[tune]\nlr_mult = [1, 2]\n'
_DENSE = '[space]\nvariant = ["dense", "sigmoid"]\n'

BAD = {
    "unknown key": ('[study]\nname = "b"\nsampler = "grid"\nbogus = 1\n[space]\nvariant = ["dense"]\n', "unknown key 'bogus'"),
    "wrong type": ('[study]\nname = "b"\nseeds = "0"\n[space]\nvariant = ["dense"]\n', "seeds"),
    "capacity 1.5": ('[study]\nname = "b"\n[space]\nvariant = ["norm"]\ncapacity = [1.5]\n', "space.capacity"),
    "unknown variant": ('[study]\nname = "b"\n[space]\nvariant = ["nrom"]\n', "unknown variant 'nrom'"),
    "unknown pattern": ('[study]\nname = "b"\n[space]\nvariant = ["norm"]\npattern = ["zigzag"]\n', "space.pattern"),
    "pruner with two objectives": ('[study]\nname = "b"\nsampler = "nsga2"\nn_trials = 2\npruner = "median"\nobjectives = ["val_bpb", "flops_per_token"]\n[space]\nvariant = ["norm"]\n', "cannot prune multi-objective"),
    "empty space": ('[study]\nname = "b"\n[space]\n', "space: is empty"),
    "no space": ('[study]\nname = "b"\n', "space: is empty"),
    "bad toml": ('[study\nname = "b"\n', "not valid TOML"),
    "unknown section": ('[stduy]\nname = "b"\n', "unknown section"),
    "bad model key": ('[study]\nname = "b"\n[model]\ndepht = 3\n[space]\nvariant = ["dense"]\n', "unknown key 'depht'"),
    "nsga2 single objective": ('[study]\nname = "b"\nsampler = "nsga2"\nn_trials = 2\n[space]\nvariant = ["norm"]\n', "multi-objective"),
    "range on grid": ('[study]\nname = "b"\n[space]\nvariant = ["norm"]\ncapacity = {low = 0.1, high = 0.5}\n', "model-based sampler"),
    "bad option": ('[study]\nname = "b"\n[options.sigmoid]\naux_wieght = 1\n[space]\nvariant = ["sigmoid"]\n', "options.sigmoid"),
    "bad budget": ('[study]\nname = "b"\n[train]\nbudget = "flops=-1"\n[space]\nvariant = ["dense"]\n', "budget"),
    # [tune] and [claims.<kind>]: the learning rate is tuned or declared, never both; no boolean is a number.
    "tune and lr_mult in space": (_TUNED + '[space]\nvariant = ["dense"]\nlr_mult = [1.0]\n', "space.lr_mult: with [tune]"),
    "tune boolean in the grid": (_TUNED.replace("[1, 2]", "[true, 2]") + _DENSE, "tune.lr_mult"),
    "tune unknown key": (_TUNED + "bogus = 1\n" + _DENSE, "tune.bogus: unknown key"),
    "tune grid past its limit": (_TUNED + "max_lr_mult = 1.5\n" + _DENSE, "must lie within"),
    "tune boolean seed": (_TUNED + "seed = true\n" + _DENSE, "tune.seed"),
    "tune without a confirmation seed": (_TUNED.replace("[0, 1]", "[0]") + _DENSE, "no confirmation seed"),
    "tune with a sampler": (_TUNED.replace('seeds', 'sampler = "tpe"\nn_trials = 2\nseeds') + _DENSE, "need sampler = \"grid\""),
    "claims of an unlisted kind": (_TUNED + _DENSE + "[claims.learned_vs_random]\nmargin = 0.05\n", "claims.learned_vs_random"),
    "claims boolean margin": (_TUNED + _DENSE + "[claims.mod_vs_best_dense]\nmargin = true\n", "claims.mod_vs_best_dense.margin"),
    "claims unknown key": (_TUNED + _DENSE + "[claims.mod_vs_best_dense]\nmragin = 0.05\n", "claims.mod_vs_best_dense.mragin"),
    "claims max_seeds without target": (_TUNED + _DENSE + "[claims.mod_vs_best_dense]\nmax_seeds = 4\n", "ci_half_width or margin"),
    "claims seeds without tune": ('[study]\nname = "b"\nclaims = ["mod_vs_best_dense"]\n' + _DENSE
                                  + "[claims.mod_vs_best_dense]\nmargin = 0.05\nmax_seeds = 4\n", "needs a [tune] table"),
    "claims unknown primary": (_TUNED + _DENSE + '[claims.mod_vs_best_dense]\nprimary = "sigmiod"\n', "claims.mod_vs_best_dense.primary"),
    "positive control not smaller": (_TUNED + _DENSE + '[claims.mod_vs_best_dense]\npositive_control = "flops=1e20"\n', "smaller budget"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_study_file_is_one_line_exit_2_and_writes_nothing(tmp_cwd, capsys, case):
    text, message = BAD[case]
    path = tmp_cwd / "bad.toml"
    path.write_text(text)
    rc = main(["study", "run", str(path)])
    err = capsys.readouterr().err.strip()
    assert rc == 2, err
    assert message in err and len(err.splitlines()) == 1
    assert str(path) in err or "bad.toml" in err
    assert not (tmp_cwd / "runs").exists() and not (tmp_cwd / "mlflow.db").exists()


def test_shipped_study_files_are_valid():
    files = sorted((REPO / "studies").glob("*.toml"))
    assert {"smoke", "quick", "variant_shootout", "capacity_sweep", "layer_patterns", "isoflop"} <= {f.stem for f in files}
    for f in files:
        study = load_study(f)
        assert study.name == f.stem
        if study.settings.sampler == "grid":
            assert study.arms()


def test_variant_shootout_covers_all_variants_and_their_controls_at_three_capacities():
    s = load_study(REPO / "studies" / "variant_shootout.toml")
    from modbench import variants

    seed_recipes = {"norm", "linear_softmax", "sigmoid", "learned_temperature", "mlp_skip"}
    controls = {"random", "random_gated", "random_mlp"}
    assert seed_recipes | controls | {"dense"} <= set(s.space["variant"]) <= set(variants.list_variants())
    assert sorted(s.space["capacity"]) == [0.125, 0.25, 0.5]
    assert s.space["pattern"] == ["alternate"] and len(s.settings.seeds) >= 3
    assert set(s.settings.controls) == {"matched_dense", "iso_token_dense"}
    assert s.settings.objectives == ["val/causal_bpb"]


_key = st.sampled_from(["study", "model", "train", "space", "options", "name", "seeds", "sampler", "pruner", "objectives",
                        "variant", "capacity", "pattern", "depth", "budget", "n_trials", "bogus", "lr_mult", "schedule",
                        "tune", "claims", "seed", "max_lr_mult", "margin", "max_seeds", "mod_vs_best_dense"])
_scalar = st.one_of(st.integers(-3, 3), st.floats(allow_nan=False, allow_infinity=False, width=32), st.booleans(),
                    st.sampled_from(["dense", "norm", "grid", "tpe", "alternate", "flops=1e9", "val_bpb", "", "x"]))
_value = st.one_of(_scalar, st.lists(_scalar, max_size=3))


def _toml(doc: dict) -> str:
    import json

    lines = []
    for section, table in doc.items():
        lines.append(f"[{section}]")
        for k, v in table.items():
            lines.append(f"{k} = {json.dumps(v).replace('true', 'true')}")
    return "\n".join(lines) + "\n"


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(doc=st.dictionaries(_key, st.dictionaries(_key, _value, max_size=4), max_size=4))
def test_fuzzed_study_files_never_give_a_traceback(tmp_path, doc):
    path = tmp_path / "fuzz.toml"
    path.write_text(_toml(doc))
    try:
        load_study(path)
    except ModbenchError as e:
        assert "\n" not in str(e)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(raw=st.binary(max_size=200))
def test_fuzzed_bytes_never_give_a_traceback(tmp_path, raw):
    path = tmp_path / "fuzz.toml"
    path.write_bytes(raw)
    try:
        load_study(path)
    except ModbenchError as e:
        assert "\n" not in str(e)


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_interrupted_trial_is_requeued_and_a_rerun_completes_the_grid(tmp_path, sig):
    """Ctrl-C or SIGTERM mid-trial (triggered when the trial has opened its MLflow run): one line,
    exit 130, the run KILLED, the (arm, seed) queued again, the parent not finished; a re-run
    completes every (arm, seed) exactly once and finishes the parent."""
    name = f"int_{sig.name.lower()}"
    # Trials long enough (~20 s on a quiet machine) that the signal lands inside the first one: with
    # 600 steps a fast machine finished both trials between two polls of the store.
    path = smoke_variant(tmp_path, name, steps=2000, seeds=(0,))
    storage = sqlite_url(tmp_path, name)
    worker = cli("study", "run", str(path), "--heartbeat", "1", cwd=tmp_path, wait=False)
    try:
        victim = running_trial(name, storage, completed=0)
        worker.send_signal(sig)
        out, _ = worker.communicate(timeout=120)
    finally:
        if worker.poll() is None:
            worker.kill()
    assert worker.returncode == 130, out
    lines = [line for line in out.splitlines() if line.strip() and "it/s" not in line and "trial/s" not in line]
    assert lines[-1].startswith("modbench: error: interrupted: trial") and "Traceback" not in out
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    assert client.get_run(victim.mlflow_run_id).info.status == "KILLED"
    parent = [r for r in client.search_runs([client.get_experiment_by_name(name).experiment_id])
              if r.data.tags.get("modbench.role") == "study"][0]
    assert parent.info.status != "FINISHED"
    waiting = trials_frame(name, storage)
    assert ((waiting.state == "WAITING") & (waiting.arm == victim.arm) & (waiting.seed == victim.seed)).any()
    done = cli("study", "run", str(path), "--quiet", cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    after = trials_frame(name, storage)
    assert (after.state == "COMPLETE").all() and len(after) == 2
    exactly_once(after)
    assert client.get_run(parent.info.run_id).info.status == "FINISHED"


def test_added_arms_and_seeds_are_queued_and_changed_fixed_settings_refused(tmp_cwd, capsys):
    path = smoke_variant(tmp_cwd, "edits", seeds=(0,))
    assert main(["study", "run", str(path), "--quiet"]) == 0
    assert sorted(trials_frame("edits", sqlite_url(tmp_cwd, "edits")).state) == ["COMPLETE"] * 2
    # Add a seed and an arm: the re-run queues exactly the new (arm, seed) pairs.
    text = path.read_text().replace("seeds = [0]", "seeds = [0, 1]")
    text = text.replace('variant = ["dense", "sigmoid"]', 'variant = ["dense", "sigmoid", "norm"]')
    assert 'variant = ["dense", "sigmoid", "norm"]' in text
    path.write_text(text)
    capsys.readouterr()
    assert main(["study", "run", str(path), "--quiet"]) == 0
    df = trials_frame("edits", sqlite_url(tmp_cwd, "edits"))
    assert len(df) == 6 and (df.state == "COMPLETE").all()
    exactly_once(df)
    # Change a fixed setting (the budget every trial shares): refused, naming the key.
    path.write_text(text.replace('budget = "steps=6"', 'budget = "steps=7"'))
    assert main(["study", "run", str(path), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "base.train.budget" in err and "give the study a new name" in err and "\n" not in err.strip()
    # A setting a newer modbench added (absent from what the study recorded) is no change at its default.
    import optuna

    from modbench.study.points import FIXED_ATTR

    path.write_text(text)
    stored = optuna.load_study(study_name="edits", storage=sqlite_url(tmp_cwd, "edits"))
    older = {k: v for k, v in stored.user_attrs[FIXED_ATTR].items() if k != "base.train.system_metrics_s"}
    stored.set_user_attr(FIXED_ATTR, older)
    assert main(["study", "run", str(path), "--quiet"]) == 0


def _open_store_at_once(url, barrier, results):
    from modbench.track.optuna_store import connect_storage

    barrier.wait()
    try:
        connect_storage(url)
        results.put("ok")
    except Exception as e:  # what the user would have seen
        results.put(f"{type(e).__name__}: {e}")


def test_two_workers_creating_one_sqlite_store_at_the_same_instant_both_work(tmp_path):
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    for attempt in range(2):  # the race window is small: try it twice
        url = f"sqlite:///{tmp_path}/race{attempt}/optuna.db"
        (tmp_path / f"race{attempt}").mkdir()
        barrier, results = ctx.Barrier(2), ctx.Queue()
        procs = [ctx.Process(target=_open_store_at_once, args=(url, barrier, results)) for _ in range(2)]
        for p in procs:
            p.start()
        outcomes = [results.get(timeout=120) for _ in procs]
        for p in procs:
            p.join(timeout=60)
        assert outcomes == ["ok", "ok"], outcomes


def test_a_study_stopped_early_has_every_arm_at_the_same_seeds(tmp_cwd):
    """Trials are queued seed-major: the first trials are seed 0 of every arm, not every seed of arm 0."""
    path = smoke_variant(tmp_cwd, "order", seeds=(0, 1))
    assert main(["study", "run", str(path), "--quiet", "--n-trials", "2"]) == 0
    df = trials_frame("order", sqlite_url(tmp_cwd, "order"))
    done = df[df.state == "COMPLETE"]
    assert sorted(done.arm) == ["dense", "sigmoid C=0.25 alternate"] and set(done.seed) == {0}


@pytest.mark.slow
def test_ctrl_c_stops_every_worker_of_study_run_workers_and_loses_nothing(tmp_path):
    """`study run --workers 2` (make quick): Ctrl-C reaches the command's own worker, which passes
    one SIGINT to its helper; both stop between two steps, queue their trials again (a re-run then
    completes them: test_interrupted_trial_is_requeued_and_a_rerun_completes_the_grid), exit with the
    one interrupted line (130), and leave no helper running."""
    name = "int_workers"
    path = smoke_variant(tmp_path, name, steps=2000, seeds=(0,))
    storage = sqlite_url(tmp_path, name)
    worker = cli("study", "run", str(path), "--workers", "2", "--heartbeat", "1", cwd=tmp_path, wait=False)
    try:
        running_trial(name, storage, completed=0, running=2)  # the event: both workers in a trial
        worker.send_signal(signal.SIGINT)
        out, _ = worker.communicate(timeout=180)
    finally:
        if worker.poll() is None:
            worker.kill()
    assert worker.returncode == 130, out
    lines = [line for line in out.splitlines() if line.strip() and "it/s" not in line and "trial/s" not in line]
    assert lines[-1].startswith("modbench: error: interrupted") and "Traceback" not in out
    after = trials_frame(name, storage)
    assert (after.state == "WAITING").sum() == 2 and (after.state == "RUNNING").sum() == 0  # both queued again
    import psutil

    left = [p for p in psutil.process_iter(["cmdline"]) if str(path) in " ".join(p.info["cmdline"] or [])]
    assert not left, "a helper worker outlived the command"
