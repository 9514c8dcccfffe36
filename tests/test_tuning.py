"""The tuning protocol ([tune]): bracketing decisions, the stages a study plans, and stages
queued exactly once by concurrent workers.

Planning is a pure function of the study and its trials (``modbench.study.tuning``), so most
tests feed it trials with chosen validation values; two tests run workers in other processes
against one SQLite store, synchronised by a barrier (an event), never by sleeping.
"""

from __future__ import annotations

import json
import math
import multiprocessing as mp
import os
import subprocess
import sys
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import numpy as np
import optuna
import pandas as pd
import pytest

from modbench.design.study_file import TuneSettings, load_study
from modbench.study import tuning
from modbench.study.tuning import TrialPoint, decide

REPO = Path(__file__).resolve().parents[1]
TUNE = TuneSettings((1.0, 2.0, 4.0), 0, 0.25, 8.0)

STUDY = """
[study]
name = "{name}"
seeds = {seeds}
sampler = "grid"
objectives = ["val/bpb"]
claims = ["mod_vs_best_dense", "learned_vs_random"]

[model]
depth = 2
n_embd = 32
head_dim = 16
max_seq_len = 64

[train]
dataset = "arithmetic"
seq_len = 32
batch_size = 4
budget = "steps={steps}"
eval_every = 3
eval_windows = 4
log_every = 3

[tune]
lr_mult = {grid}
min_lr_mult = {low}
max_lr_mult = {high}

[space]
variant = ["dense", "sigmoid", "random_gated"]
capacity = [0.25]
pattern = ["alternate"]
"""


def write_study(tmp: Path, name: str, *, seeds=(0, 1), steps=6, grid=(1, 2), low=1, high=4, extra="") -> Path:
    path = tmp / f"{name}.toml"
    path.write_text(STUDY.format(name=name, seeds=list(seeds), steps=steps, grid=list(grid), low=low, high=high) + extra)
    return path


# --- bracketing one family -----------------------------------------------------------------------
def test_best_at_the_upper_edge_extends_up_and_at_the_lower_edge_extends_down():
    up = decide({1.0: 3.0, 2.0: 2.9, 4.0: 2.8}, TUNE)
    assert (up.best, up.bracketed, up.extend) == (4.0, False, 8.0)
    down = decide({1.0: 2.7, 2.0: 2.9, 4.0: 3.0}, TUNE)
    assert (down.best, down.bracketed, down.extend) == (1.0, False, 0.5)


def test_interior_best_is_bracketed_and_stops():
    d = decide({1.0: 3.0, 2.0: 2.8, 4.0: 2.9}, TUNE)
    assert (d.best, d.bracketed, d.extend, d.note) == (2.0, True, None, "interior")


def test_limit_hit_leaves_the_family_unbracketed_with_the_reason():
    d = decide({2.0: 3.0, 4.0: 2.9, 8.0: 2.8}, TUNE)  # next would be 16 > max_lr_mult 8
    assert (d.best, d.bracketed, d.extend) == (8.0, False, None)
    assert d.note.startswith("limit") and "max_lr_mult 8" in d.note
    low = decide({0.25: 2.0, 0.5: 2.5}, TUNE)  # next would be 0.125 < min_lr_mult 0.25
    assert (low.best, low.bracketed, low.extend) == (0.25, False, None) and "min_lr_mult" in low.note


def test_a_failed_trial_counts_as_worse_never_as_missing():
    # lr×8 diverged: lr×4 is then interior, bracketed by the failure, and the reason is kept.
    d = decide({2.0: 3.0, 4.0: 2.8, 8.0: None}, TUNE, {8.0: "training loss became nan at step 40"})
    assert (d.best, d.bracketed, d.extend) == (4.0, True, None)
    assert d.grid == (2.0, 4.0, 8.0) and d.failed == ("lr×8: training loss became nan at step 40",)
    # A failure at the top of the grid does not make a smaller value "at the edge".
    assert decide({1.0: 3.0, 2.0: 2.9, 4.0: None}, TUNE).bracketed


def test_every_value_failed_extends_down_then_stops_at_the_limit():
    d = decide({1.0: None, 2.0: None}, TUNE)
    assert (d.best, d.extend) == (None, 0.5)
    d = decide({0.25: None, 0.5: None}, TUNE)
    assert (d.best, d.extend, d.bracketed) == (None, None, False) and d.note.startswith("limit")


def test_ties_go_to_the_smaller_multiplier():
    assert decide({1.0: 3.0, 2.0: 2.5, 4.0: 2.5}, TUNE).best == 2.0


# --- the stages, on chosen values ------------------------------------------------------------------
def loss_of(arm, lr: float) -> float:
    """A validation value with its minimum at lr×2 for dense and lr×4 for routed arms, and a
    size optimum at depth 3 (a parabola in log size: the study's width is fixed, so parameters
    grow as depth), a size the study does not declare."""
    best_lr = 2.0 if arm.variant == "dense" else 4.0
    return 3.0 + (math.log2(lr) - math.log2(best_lr)) ** 2 * 0.1 + (math.log2(arm.depth) - math.log2(3)) ** 2 * 0.5


def finish(points: list[TrialPoint], queue, stage: str, fail: dict | None = None) -> list[TrialPoint]:
    """The queued trials, finished: COMPLETE at ``loss_of`` (headline = value), or failed."""
    out = list(points)
    for arm, seed in queue:
        if fail and (arm.variant, arm.lr_mult) in fail:
            out.append(TrialPoint(arm, seed, "FAIL", stage, None, None, fail[(arm.variant, arm.lr_mult)]))
        else:
            v = loss_of(arm, arm.lr_mult) + 0.01 * seed * (arm.variant == "sigmoid")
            out.append(TrialPoint(arm, seed, "COMPLETE", stage, v, v))
    return out


def sizes_study(tmp: Path, extra: str = ""):
    sizes = '\n[[space.also]]\nvariant = ["dense"]\ndepth = [1, 4, 5]\n'
    return load_study(write_study(tmp, "plan", seeds=(0, 1, 2), grid=(1, 2), low=0.5, high=8, extra=sizes + extra))


def test_stages_in_order_from_tuning_to_confirmation(tmp_path):
    claims = '\n[claims.mod_vs_best_dense]\npositive_control = "steps=3"\n'
    study = sizes_study(tmp_path, claims)
    points: list[TrialPoint] = []
    history: list[str] = []
    stages = []
    for _ in range(12):
        step = tuning.plan(study, points, history)
        if step.stage == tuning.COMPLETE:
            break
        stages.append((step.stage, step.queue))
        history.append(step.stage)
        points = finish(points, step.queue, step.stage)
    names = [s for s, _ in stages]
    assert names[0] == "tune" and names[-1] == "confirm" and names.count("optimum") == 1
    tune_queue = stages[0][1]
    families = {a.family for a, _ in tune_queue}
    # Every declared family but the random control (which follows sigmoid) gets the grid, on the tuning seed.
    assert {(f.variant, f.depth) for f in families} == {("dense", 1), ("dense", 2), ("dense", 4), ("dense", 5), ("sigmoid", 2)}
    assert sorted({a.lr_mult for a, _ in tune_queue}) == [1.0, 2.0] and {s for _, s in tune_queue} == {0}
    # The fitted optimum (depth 3, never declared) is trained at the grid, then bracketed like the others.
    optimum = dict(stages)["optimum"]
    assert {(a.variant, a.depth, a.lr_mult) for a, _ in optimum} == {("dense", 3, 1.0), ("dense", 3, 2.0)}
    dec = tuning.decisions(study, points)
    assert all(d.bracketed for d in dec.values()), {study.label(f): d.note for f, d in dec.items()}
    assert {(f.variant, f.depth): d.best for f, d in dec.items()} == {
        ("dense", 1): 2.0, ("dense", 2): 2.0, ("dense", 3): 2.0, ("dense", 4): 2.0, ("dense", 5): 2.0, ("sigmoid", 2): 4.0}
    # Confirmation: fresh seeds, each family at its best value; the dense sizes other than the
    # best (depth 3) are not confirmed; random_gated runs at sigmoid's best; the positive control
    # is the best dense model (its shape and LR) at the smaller budget.
    confirm = dict(stages)["confirm"]
    assert {s for _, s in confirm} == {1, 2}
    runs = {(a.variant, a.depth, a.lr_mult, a.budget, bool(a.control)) for a, _ in confirm}
    assert runs == {("dense", 3, 2.0, "steps=6", False), ("sigmoid", 2, 4.0, "steps=6", False),
                    ("random_gated", 2, 4.0, "steps=6", False), ("dense", 3, 2.0, "steps=3", True)}
    # Once everything has run, there is nothing more to plan, and planning twice queues nothing twice.
    assert tuning.plan(study, points, history).stage == tuning.COMPLETE
    keys = [(a, s) for _, q in stages for a, s in q]
    assert len(keys) == len(set(keys))


def test_the_family_table_names_grid_best_bracketed_and_failures(tmp_path):
    study = sizes_study(tmp_path)
    points, history = [], []
    fail = {("sigmoid", 8.0): "training loss became nan at step 3"}
    for _ in range(12):
        step = tuning.plan(study, points, history)
        if step.stage == tuning.COMPLETE:
            break
        history.append(step.stage)
        points = finish(points, step.queue, step.stage, fail)
    table = tuning.family_table(study, points).set_index("family")
    sig = table.loc["sigmoid C=0.25 alternate"]
    # sigmoid: 1, 2 → best at the edge → 4 → best at the edge → 8 diverged (worse): 4 bracketed.
    assert (sig.grid, sig.best_lr_mult, bool(sig.bracketed)) == ("1, 2, 4, 8", 4.0, True)
    assert sig.failed == "lr×8: training loss became nan at step 3"
    assert table.loc["random_gated C=0.25 alternate"].follows == "sigmoid C=0.25 alternate"
    assert table.loc["random_gated C=0.25 alternate"].confirmed_at == 4.0
    assert table.loc["dense L3"].confirmed_at == 2.0 and math.isnan(table.loc["dense L4"].confirmed_at)


def test_extra_seeds_for_the_primary_contrast_follow_the_rule_and_the_cap(tmp_path):
    claims = '\n[claims.mod_vs_best_dense]\nci_half_width = 0.01\nmax_seeds = 4\n'
    study = sizes_study(tmp_path, claims)
    calls = []

    def rule(kind, sd, target, cap):
        calls.append((kind, round(sd, 6), target, cap))
        return 99  # more than the cap: the cap wins

    points, history = [], []
    for _ in range(12):
        step = tuning.plan(study, points, history, rule)
        if step.stage == tuning.COMPLETE:
            break
        history.append(step.stage)
        if step.stage == tuning.SEEDS:
            seeds_step = step
        points = finish(points, step.queue, step.stage)
    # The paired differences sigmoid − dense over seeds 1, 2 are 0.01·seed + const: SD = 0.01/√2.
    assert calls == [("half_width", round(0.01 / math.sqrt(2), 6), 0.01, 4)]
    assert {s for _, s in seeds_step.queue} == {3, 4}  # new seeds after the study's, up to 4 pairs
    assert {(a.variant, a.depth) for a, _ in seeds_step.queue} == {("sigmoid", 2), ("dense", 3)}
    record = seeds_step.record["mod_vs_best_dense"]
    assert record["pairs"] == 2 and record["needed"] == 4 and record["added_seeds"] == [3, 4]
    assert tuning.plan(study, points, history, rule).stage == tuning.COMPLETE  # the seed rule runs once


def test_a_study_without_tune_has_no_stages_and_its_grid_is_unchanged(tmp_path):
    smoke = load_study(REPO / "studies" / "smoke.toml")
    assert smoke.tune.lr_mult == () and smoke.claim_settings == {}


# --- concurrency: the stage lock ---------------------------------------------------------------------
def _advance_in_process(path: str, url: str, out_dir: str, tracking: str, rounds: int, barrier, results) -> None:
    """A worker that, each round, plans at the same instant as the other (a 3-party barrier: the
    test process finishes the queued trials between rounds)."""
    from modbench.design.study_file import load_study
    from modbench.study.runner import Runner

    runner = Runner(load_study(path), url, Path(out_dir), tracking_uri=tracking, heartbeat=10, grace=30)
    for _ in range(rounds):
        barrier.wait()  # go: both workers plan at once
        results.put(runner._advance(runner.optuna))
        barrier.wait()  # done: the test finishes what was queued


def _finish_waiting(url: str, name: str) -> int:
    """Finish every waiting trial as a worker would, with a chosen validation value."""
    from modbench.design.arm import Arm

    study = optuna.load_study(study_name=name, storage=url)
    n = 0
    for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.WAITING,)):
        trial = study.ask()
        arm = Arm.from_params(trial.user_attrs["arm_params"])
        value = loss_of(arm, arm.lr_mult)
        trial.set_user_attr("val/causal_bpb", value)
        study.tell(trial, value)
        n += 1
    return n


@contextmanager
def _stage_storage(kind: str, tmp_path: Path):
    """The study storage the race runs on: SQLite (the stage lock is a flock) or a fresh PostgreSQL
    database (the lock is pg_advisory_lock), the server CI starts on 127.0.0.1."""
    if kind == "sqlite":
        yield f"sqlite:///{tmp_path}/optuna.db"
        return
    from test_multi_machine import POSTGRES, fresh_database

    if not POSTGRES:
        pytest.skip("set MODBENCH_TEST_POSTGRES_URL (CI starts PostgreSQL on 127.0.0.1)")
    with fresh_database() as url:
        if url is None:
            pytest.skip("the PostgreSQL user may not create databases")
        yield url


@pytest.mark.parametrize("kind", ["sqlite", "postgresql"])
def test_two_workers_advance_each_stage_exactly_once(tmp_path, kind):
    with _stage_storage(kind, tmp_path) as url:
        _race_two_workers_through_the_stages(tmp_path, url)


def _race_two_workers_through_the_stages(tmp_path: Path, url: str) -> None:
    from modbench.study.runner import Runner

    name = "race"
    path = write_study(tmp_path, name, grid=(1, 2), low=1, high=4)
    tracking = f"sqlite:///{tmp_path}/mlflow.db"
    creator = Runner(load_study(path), url, tmp_path, tracking_uri=tracking, heartbeat=10, grace=30)  # queues "tune"
    ctx = mp.get_context("spawn")
    rounds, barrier, results = 3, ctx.Barrier(3), ctx.Queue()
    procs = [ctx.Process(target=_advance_in_process, args=(str(path), url, str(tmp_path), tracking, rounds, barrier, results))
             for _ in range(2)]
    for p in procs:
        p.start()
    outcomes = []
    try:
        # tune done → extend (dense and sigmoid to lr×4) → optimum (one size: nothing) and confirm → complete
        for _ in range(rounds):
            assert _finish_waiting(url, name) > 0
            barrier.wait(timeout=300)
            outcomes.append(sorted(results.get(timeout=300) for _ in procs))
            barrier.wait(timeout=300)
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    # Each stage: one worker queued it, the other found its trials waiting; then both see the end.
    assert outcomes == [["busy", "queued"]] * 2 + [["complete", "complete"]]
    assert _finish_waiting(url, name) == 0
    stages = [s["stage"] for s in creator.stages()]
    assert stages == ["tune", "extend", "optimum", "confirm"], stages
    trials = creator.optuna.get_trials(deepcopy=False)
    keys = [(json.dumps(t.user_attrs["arm_params"], sort_keys=True), t.user_attrs["seed"]) for t in trials]
    assert len(keys) == len(set(keys)), "a point was queued twice"
    assert [s["queued"] for s in creator.stages()] == [4, 2, 0, 3]


@pytest.mark.slow
def test_two_workers_run_a_tuned_study_through_its_stages(tmp_path):
    """Two CLI workers on one SQLite store: every stage queued once, each worker waits for the
    next stage instead of exiting, and both end with the whole study complete."""
    name = "tuned"
    claims = '\n[claims.mod_vs_best_dense]\nmargin = 0.05\npositive_control = "steps=3"\n'
    path = write_study(tmp_path, name, extra=claims)
    url = f"sqlite:///{tmp_path}/runs/studies/{name}/optuna.db"
    env = {**os.environ, "PYTHONPATH": str(REPO), "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path}/mlflow.db"}
    cmd = [sys.executable, "-m", "modbench.cli.main", "study", "run", str(path), "--quiet"]
    workers = [subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
               for _ in range(2)]
    outputs = [w.communicate(timeout=600)[0] for w in workers]
    assert [w.returncode for w in workers] == [0, 0], outputs
    study = optuna.load_study(study_name=name, storage=url)
    trials = [t for t in study.trials if not t.user_attrs.get("surplus")]
    # Neither worker left while the other still had a stage to run: both saw the study finished.
    for out in outputs:
        summary = json.loads(out.strip().splitlines()[-1])
        assert summary["trials"] == {"COMPLETE": len(trials)}, out
    history = study.user_attrs["stages"]
    names = [h["stage"] for h in history]
    assert names[0] == "tune" and names[-1] == "confirm" and study.user_attrs["stages_complete"] is True
    for stage in set(names) - {"extend"}:
        assert names.count(stage) == 1
    assert [sum(1 for t in trials if t.user_attrs["stage"] == h["stage"]) for h in history] == \
        [sum(h2["queued"] for h2 in history if h2["stage"] == h["stage"]) for h in history]
    keys = [(json.dumps(t.user_attrs["arm_params"], sort_keys=True), t.user_attrs["seed"]) for t in trials]
    assert len(keys) == len(set(keys)), "a point ran twice"
    # The final grids and best values, recomputed from the trials, agree with what was confirmed.
    from modbench.track.optuna_store import trials_frame

    points = tuning.points_from_frame(trials_frame(name, url))
    s = load_study(path)
    table = tuning.family_table(s, points).set_index("family")
    for family in ("dense", "sigmoid C=0.25 alternate"):
        row = table.loc[family]
        grid = [float(v) for v in row.grid.split(", ")]
        assert grid[:2] == [1.0, 2.0] and set(grid) <= {1.0, 2.0, 4.0}
        values = {p.arm.lr_mult: p.value for p in points if p.seed == 0 and p.arm.variant == family.split()[0]
                  and not p.arm.control}
        assert row.best_lr_mult == min(values, key=values.get)
        assert bool(row.bracketed) == (grid[0] < row.best_lr_mult < grid[-1])
        confirmed = {p.arm.lr_mult for p in points if p.seed == 1 and p.arm.variant == family.split()[0] and not p.arm.control}
        assert confirmed == {row.best_lr_mult}
    gated = [p for p in points if p.arm.variant == "random_gated"]
    assert [p.seed for p in gated] == [1] and gated[0].arm.lr_mult == table.loc["sigmoid C=0.25 alternate"].best_lr_mult
    control = [p for p in points if p.arm.control.startswith(tuning.POSITIVE_CONTROL)]
    assert len(control) == 1 and control[0].arm.budget == "steps=3"
    assert control[0].arm.lr_mult == table.loc["dense"].best_lr_mult
    # The parent run ends only now, FINISHED.
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    runs = client.search_runs([client.get_experiment_by_name(name).experiment_id])
    parents = [r for r in runs if r.data.tags.get("modbench.role") == "study"]
    assert len(parents) == 1 and parents[0].info.status == "FINISHED"

    # And the report a user then writes reads every stage: the tuning table with both families, the
    # claims on the confirmation seeds, the positive control, the protocol's sections.
    report = subprocess.run([sys.executable, "-m", "modbench.cli.main", "report", str(path), "--quiet"], cwd=tmp_path,
                            env=env, capture_output=True, text=True, timeout=600)
    assert report.returncode == 0, report.stdout + report.stderr
    assert "Traceback" not in report.stderr
    text = (tmp_path / "reports" / name / "report.md").read_text()
    assert "Not tuned" not in text
    for section in ("## Learning-rate tuning", "## Claims", "## Effects", "## Environment", "## Reproduce"):
        assert section in text, section
    tuning_section = text.split("## Learning-rate tuning", 1)[1].split("\n## ", 1)[0]
    assert "dense" in tuning_section and "sigmoid" in tuning_section
    summary = json.loads((tmp_path / "reports" / name / "summary.json").read_text())
    assert summary["claims"], "the report's summary carries the claims"


def test_extra_seeds_with_the_statistics_modules_rule(tmp_path):
    """The default rule is the report's paired-t half-width rule: the smallest n ≥ 2 with
    t(0.975, n − 1) · SD / √n ≤ target, counted in pairs (the confirmation seeds included)."""
    from scipy import stats

    claims = '\n[claims.mod_vs_best_dense]\nci_half_width = 0.01\nmax_seeds = 8\n'
    study = sizes_study(tmp_path, claims)
    points, history, seeds_step = [], [], None
    for _ in range(12):
        step = tuning.plan(study, points, history)
        if step.stage == tuning.COMPLETE:
            break
        history.append(step.stage)
        seeds_step = step if step.stage == tuning.SEEDS else seeds_step
        points = finish(points, step.queue, step.stage)
    sd = 0.01 / math.sqrt(2)  # sigmoid − dense over seeds 1, 2 differ by 0.01
    n = next(n for n in range(2, 100) if stats.t.ppf(0.975, n - 1) * sd / math.sqrt(n) <= 0.01)
    assert n == 5 and seeds_step.record["mod_vs_best_dense"]["added_seeds"] == list(range(3, 3 + n - 2))


def test_two_claims_share_the_new_seeds_of_their_common_arm(tmp_path):
    """C1 (sigmoid − best dense, up to 4 seeds; the positive control with the best dense) and C2
    (sigmoid − random_gated at sigmoid's best value, up to 3): the new seeds are numbered alike,
    so sigmoid runs each once."""
    claims = ('\n[claims.mod_vs_best_dense]\nmargin = 0.05\nmax_seeds = 4\npositive_control = "steps=3"\n'
              '\n[claims.learned_vs_random]\nci_half_width = 0.01\nmax_seeds = 3\n')
    study = sizes_study(tmp_path, claims)
    points, history, seeds_step = [], [], None
    for _ in range(12):
        step = tuning.plan(study, points, history, lambda kind, sd, target, cap: cap)
        if step.stage == tuning.COMPLETE:
            break
        history.append(step.stage)
        seeds_step = step if step.stage == tuning.SEEDS else seeds_step
        points = finish(points, step.queue, step.stage)
    runs = sorted((a.variant, a.depth, a.lr_mult, a.budget, s) for a, s in seeds_step.queue)
    assert runs == [("dense", 3, 2.0, "steps=3", 3), ("dense", 3, 2.0, "steps=3", 4),  # the positive control follows C1's reference
                    ("dense", 3, 2.0, "steps=6", 3), ("dense", 3, 2.0, "steps=6", 4), ("random_gated", 2, 4.0, "steps=6", 3),
                    ("sigmoid", 2, 4.0, "steps=6", 3), ("sigmoid", 2, 4.0, "steps=6", 4)]
    assert seeds_step.record["learned_vs_random"]["reference"] == "random_gated C=0.25 alternate lr×4"


# --- what the claims compare in a tuned study; the count `study list` shows ------------------------
def _run_to_completion(study, value_of) -> list[TrialPoint]:
    """Every stage planned and finished, each trial's validation and test value ``value_of(arm, seed)``."""
    points, history = [], []
    for _ in range(12):
        step = tuning.plan(study, points, history)
        if step.stage == tuning.COMPLETE:
            return points
        history.append(step.stage)
        points += [TrialPoint(a, s, "COMPLETE", step.stage, value_of(a, s), value_of(a, s)) for a, s in step.queue]
    raise AssertionError("the plan did not complete")


def _trials_frame(study, points: list[TrialPoint]) -> pd.DataFrame:
    """The report's view of finished trials (``ReportData.done``): one row per trial."""
    return pd.DataFrame([{"arm": study.label(p.arm), "variant": p.arm.variant, "control": p.arm.control,
                          "lr_mult": p.arm.lr_mult, "capacity": p.arm.capacity, "pattern": p.arm.pattern,
                          "depth": p.arm.depth, "budget": p.arm.budget, "seed": p.seed, "state": p.state,
                          "val/causal_bpb": p.value, "test/causal_bpb": p.headline} for p in points])


def _tuned_claims_study(tmp: Path):
    claims = '\n[claims.mod_vs_best_dense]\nmargin = 0.05\npositive_control = "steps=3"\n'
    sizes = '\n[[space.also]]\nvariant = ["dense"]\ndepth = [1, 4, 5]\n'
    return load_study(write_study(tmp, "tuned_claims", seeds=(0, 1, 2, 3, 4, 5), grid=(1, 2), low=0.5, high=8,
                                  extra=sizes + claims))


def _value(control_gap: float):
    """``loss_of`` plus a shared per-seed offset; sigmoid 0.02 worse than dense on every seed but
    the tuning seed, where it is 1.0 better (a row that would move C1's estimate if it were used);
    the positive control (the smaller budget) ``control_gap`` worse than its full-budget model."""
    def value(arm, seed: int) -> float:
        v = loss_of(arm, arm.lr_mult) + 0.003 * ((seed * 7) % 5)
        if arm.variant == "sigmoid":
            v += -1.0 if seed == 0 else 0.02 + 0.002 * (seed % 2)
        if arm.control.startswith(tuning.POSITIVE_CONTROL):
            v += control_gap + 0.002 * (seed % 3 - 1)
        return v
    return value


def test_claims_of_a_tuned_study_compare_the_confirmed_arms_on_the_confirmation_seeds(tmp_path):
    from modbench.report import claims as report_claims

    study = _tuned_claims_study(tmp_path)
    points = _run_to_completion(study, _value(0.3))
    done = _trials_frame(study, points)
    best = tuning.best_arms(study, points)
    confirmed = [study.label(a) for a in best.values()]
    # A stray trial of an unconfirmed size on a confirmation seed, best on validation if it counted.
    stray = done[(done["variant"] == "dense") & (done["depth"] == 1) & (done["lr_mult"] == 1.0)].iloc[[0]]
    done = pd.concat([done, stray.assign(seed=1, **{"val/causal_bpb": 0.0, "test/causal_bpb": 0.0})], ignore_index=True)

    found, effects, _ = report_claims.test_claims(done, study, confirmed)
    c1 = effects[(effects["claim"] == "C1") & (effects["family"] == "primary")].iloc[0]
    sigmoid = study.label(best[next(f for f in best if f.variant == "sigmoid")])
    dense = study.label(next(a for f, a in best.items() if f.variant == "dense" and not f.control))
    assert (c1["arm"], c1["reference"]) == (sigmoid, dense) == ("sigmoid C=0.25 alternate lr×4", "dense lr×2 L3")
    by = done[done["seed"] != 0].groupby(["arm", "seed"])["test/causal_bpb"].mean()
    expected = (by[sigmoid] - by[dense]).mean()  # seeds 1–5 only; seed 0 (Δ ≈ −1) is left out
    claim = next(c for c in found if c.id == "C1")
    assert claim.estimate == pytest.approx(expected) and claim.estimate > 0 and claim.n_seeds == 5
    # C2: random_gated at sigmoid's best value, on the same seeds.
    c2 = effects[effects["claim"] == "C2"].iloc[0]
    assert (c2["arm"], c2["reference"]) == (sigmoid, "random_gated C=0.25 alternate lr×4") and c2["n_arm"] == 5
    # The positive control is in no C1 family, only its own claim C1+, and is classed "worse".
    control = study.label(next(a for f, a in best.items() if f.control.startswith(tuning.POSITIVE_CONTROL)))
    c1_rows = effects[effects["claim"] == "C1"]
    assert control not in set(c1_rows["arm"]) | set(c1_rows["reference"])
    plus = effects[effects["claim"] == "C1+"]
    assert list(zip(plus["arm"], plus["reference"], plus["family"])) == [(control, dense, "primary")]
    c1_plus = next(c for c in found if c.id == "C1+")
    assert c1_plus.verdict_class == "worse" and c1_plus.margin == 0.05 and c1_plus.n_seeds == 5
    assert c1_plus.estimate == pytest.approx(0.3 + np.mean([0.002 * (s % 3 - 1) for s in range(1, 6)]))
    assert report_claims.positive_control_line(found).startswith("**The design passed its positive control")


def test_a_positive_control_the_design_cannot_see_is_reported_as_a_failed_design(tmp_path):
    from modbench.report import claims as report_claims

    study = _tuned_claims_study(tmp_path)
    points = _run_to_completion(study, _value(0.0))  # the smaller budget is no worse here
    confirmed = [study.label(a) for a in tuning.best_arms(study, points).values()]
    found, _, _ = report_claims.test_claims(_trials_frame(study, points), study, confirmed)
    c1_plus = next(c for c in found if c.id == "C1+")
    assert c1_plus.verdict_class in ("equivalent", "inconclusive")
    line = report_claims.positive_control_line(found)
    assert line.startswith("**The design failed its positive control") and f'"{c1_plus.verdict_class}"' in line


def test_study_list_and_show_count_what_the_first_stage_queues(tmp_path, capsys):
    from modbench.cli.main import main
    from modbench.cli.study import planned_trials
    from modbench.study.runner import Runner

    path = write_study(tmp_path, "counted", seeds=(0, 1, 2), grid=(1, 2, 4), low=0.5, high=8)
    study = load_study(path)
    runner = Runner(study, f"sqlite:///{tmp_path}/optuna.db", tmp_path, tracking_uri=f"sqlite:///{tmp_path}/mlflow.db",
                    heartbeat=10, grace=30)  # creating the study queues its first stage
    queued = runner.optuna.get_trials(deepcopy=False)
    # dense and sigmoid × lr×{1, 2, 4} on the tuning seed; random_gated follows sigmoid, the
    # confirmation seeds come later: not 3 arms × 3 seeds.
    assert planned_trials(study) == len(queued) == 6
    assert main(["study", "show", str(path)]) == 0
    out = capsys.readouterr().out
    assert "# ≥ 6 trials: tuning stage; later stages add extensions, confirmation and extra seeds" in out


def test_claim_settings_are_preregistered_before_the_first_confirmation_trial_and_amended_only_on_the_record(tmp_path):
    """Issue "Best against best", item 3: the runner records the claims' settings with the commit when
    it queues the confirmation stage; a study file that changes them afterwards is refused, or with
    --amend-claims recorded as an amendment, which the report's summary carries."""
    from modbench.errors import ModbenchError
    from modbench.report.render import preregistration_lines
    from modbench.report.sections import preregistration
    from modbench.study.points import AMENDMENTS_ATTR, PREREGISTERED_ATTR
    from modbench.study.runner import Runner
    from modbench.track.provenance import git_sha

    name = "prereg"
    claims = '\n[claims.mod_vs_best_dense]\nmargin = 0.05\n'
    path = write_study(tmp_path, name, extra=claims)
    url, tracking = f"sqlite:///{tmp_path}/optuna.db", f"sqlite:///{tmp_path}/mlflow.db"
    runner = Runner(load_study(path), url, tmp_path, tracking_uri=tracking, heartbeat=10, grace=30)
    assert PREREGISTERED_ATTR not in runner.optuna.user_attrs  # tuning: nothing is fixed yet
    for _ in range(10):  # tune, extend, optimum: finish each stage's trials, then plan the next
        _finish_waiting(url, name)
        runner._advance(runner.optuna)
        stages = [h["stage"] for h in optuna.load_study(study_name=name, storage=url).user_attrs.get("stages", [])]
        if "confirm" in stages:
            break
    study = optuna.load_study(study_name=name, storage=url)
    record = study.user_attrs[PREREGISTERED_ATTR]
    assert record["claims"]["mod_vs_best_dense"]["margin"] == 0.05 and record["commit"] == git_sha()
    confirm = [t for t in study.trials if t.user_attrs.get("stage") == "confirm"]
    assert confirm and all(t.datetime_start is None for t in confirm)  # recorded before any confirmation trial ran

    path.write_text(path.read_text().replace("margin = 0.05", "margin = 0.2"))
    with pytest.raises(ModbenchError, match=r"pre-registered at commit .*--amend-claims"):
        Runner(load_study(path), url, tmp_path, tracking_uri=tracking, heartbeat=10, grace=30)
    assert AMENDMENTS_ATTR not in optuna.load_study(study_name=name, storage=url).user_attrs
    Runner(load_study(path), url, tmp_path, tracking_uri=tracking, heartbeat=10, grace=30, amend_claims=True)
    attrs = optuna.load_study(study_name=name, storage=url).user_attrs
    amended = attrs[AMENDMENTS_ATTR]
    assert len(amended) == 1 and amended[0]["changed"] == ["mod_vs_best_dense"]
    assert amended[0]["claims"]["mod_vs_best_dense"]["margin"] == 0.2
    # The same file again is no new amendment; the report says what changed and when.
    Runner(load_study(path), url, tmp_path, tracking_uri=tracking, heartbeat=10, grace=30)
    registration = preregistration(dict(optuna.load_study(study_name=name, storage=url).user_attrs))
    assert len(registration["amendments"]) == 1
    text = " ".join(preregistration_lines(registration))
    assert "amended after that" in text and "mod_vs_best_dense" in text and record["commit"][:12] in text


def test_a_tuning_choice_won_by_less_than_the_seed_noise_is_reported_as_such(tmp_path):
    """methods_shootout's ×2 rates won by margins smaller than the seed noise at ×2 (issue "Best
    against best"): the family table says by how much each best value won on the tuning seed, the
    confirmed arm's SD over its confirmation seeds, and whether the win is within that noise."""
    from modbench.report.render import tuning_lines

    study = load_study(write_study(tmp_path, "noise", seeds=(0, 1, 2, 3), grid=(1, 2, 4)))
    dense = next(a for a in study.arms() if a.variant == "dense")
    sigmoid = next(a for a in study.arms() if a.variant == "sigmoid")
    points = []
    for family, values, confirm in ((dense, {1: 3.00, 2: 2.99, 4: 3.10}, (2.90, 3.00, 3.10)),
                                    (sigmoid, {1: 3.50, 2: 3.00, 4: 3.40}, (3.00, 3.01, 3.02))):
        for lr, v in values.items():
            points.append(TrialPoint(replace(family, lr_mult=float(lr)), 0, "COMPLETE", "tune", v, v))
        for seed, v in zip((1, 2, 3), confirm):
            points.append(TrialPoint(replace(family, lr_mult=2.0), seed, "COMPLETE", "confirm", v, v))
    table = tuning.family_table(study, points).set_index("family")
    row = table.loc[study.label(dense)]
    assert row.best_lr_mult == 2.0 and row.won_by == pytest.approx(0.01) and row.seed_sd == pytest.approx(0.1)
    assert row.within_noise is True or row.within_noise == True  # noqa: E712
    clear = table.loc[study.label(sigmoid)]
    assert clear.won_by == pytest.approx(0.40) and clear.within_noise == False  # noqa: E712
    text = " ".join(tuning_lines(table.reset_index()))
    assert "Chosen within the seed noise: dense (won by 0.010, seed SD 0.100)" in text
    assert "sigmoid C=0.25 alternate (won by" not in text


def test_a_routed_size_sweep_confirms_its_best_size_only_as_the_dense_one_does(tmp_path):
    """paper_claims (1.5e13) swept three sigmoid sizes beside three dense sizes, and the protocol
    confirmed every sigmoid size but only the best dense one: the MoD side would then pick its size
    on the confirmation seeds and the dense side on the tuning seed alone (issue "Best against best":
    the same search, chosen by the same rule). Each size sweep now confirms its best size on the
    tuning seed; its random control follows that size."""
    extra = '\n[[space.also]]\nvariant = ["sigmoid"]\ndepth = [3, 4]\n'
    study = sizes_study(tmp_path, extra)
    points: list[TrialPoint] = []
    history: list[str] = []
    confirm = ()
    for _ in range(12):
        step = tuning.plan(study, points, history)
        if step.stage == tuning.COMPLETE:
            break
        history.append(step.stage)
        if step.stage == tuning.CONFIRM:
            confirm = step.queue
        points = finish(points, step.queue, step.stage)
    routed = {(a.variant, a.depth) for a, _ in confirm if a.variant != "dense"}
    assert routed == {("sigmoid", 3), ("random_gated", 3)}  # loss_of's size optimum is depth 3
    assert {a.depth for a, _ in confirm if a.variant == "dense"} == {3}
    dec = tuning.decisions(study, points)
    assert {f.depth for f in dec if f.variant == "sigmoid"} == {2, 3, 4}  # every size was tuned
