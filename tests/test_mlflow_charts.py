"""The comparison a user makes in MLflow's chart view: val/causal_bpb (the deployable number) at
every evaluation, against perf/cum_flops, one series per arm, without the study's parent run."""

import re
from pathlib import Path

import pytest
import torch
from mlflow.tracking import MlflowClient

from modbench.model.gpt import GPT
from modbench.run import train as train_module
from modbench.run.causal_eval import calibrate_causal_rules, causal_metrics
from modbench.run.evaluate import evaluate_causal
from modbench.run.train import train
from modbench.study.runner import run_study
from modbench.track.checkpoint import load_checkpoint

from test_train import tiny

REPO = Path(__file__).resolve().parents[1]
STUDIES_DOC = (REPO / "docs" / "studies.md").read_text()  # the MLflow recipe, moved there from the README
SMOKE = (REPO / "studies" / "smoke.toml").read_text()


def _final(result) -> dict:
    """Everything a run ends with that does not depend on the clock: final val and test metrics,
    the training losses at every logged step and the weights (calibrated buffers included)."""
    losses = [(h["step"], h["train/loss"]) for h in result.history if "train/loss" in h]
    weights = load_checkpoint(result.checkpoint)["model"]
    return {"val": result.val, "test": result.test, "losses": losses, "weights": weights}


def _assert_same(a: dict, b: dict) -> None:
    assert a["val"] == b["val"] and a["test"] == b["test"] and a["losses"] == b["losses"]
    assert a["weights"].keys() == b["weights"].keys()
    for k in a["weights"]:
        assert torch.equal(a["weights"][k], b["weights"][k]), k


# `random` draws its scores from the global RNG (calibration forwards must not shift training's
# draws); `mlp_skip` and `linear_softmax` keep running statistics that calibration rewrites.
@pytest.mark.parametrize("variant", ["mlp_skip", "random", "linear_softmax"])
def test_periodic_causal_metric_leaves_a_seeded_runs_final_metrics_bit_identical(tmp_cwd, monkeypatch, variant):
    cfg = dict(budget="steps=8", eval_every=2, log_every=2, checkpoint_every=0)
    with_causal = _final(train(tiny(variant, **cfg), progress=False))
    monkeypatch.setattr(train_module, "PERIODIC_CAUSAL", False)
    without_causal = _final(train(tiny(variant, **cfg), progress=False))
    monkeypatch.undo()
    no_periodic_eval = _final(train(tiny(variant, **{**cfg, "eval_every": 1000}), progress=False))
    _assert_same(with_causal, without_causal)
    _assert_same(with_causal, no_periodic_eval)


def test_periodic_calibration_is_undone_before_training_goes_on(tmp_cwd):
    run = train_module._setup(tiny("mlp_skip", budget="steps=6"), torch.device("cpu"))  # a running threshold
    for _ in range(3):
        train_module._train_step(run, run.step / run.total_steps)
    before = {k: v.clone() for k, v in run.model.state_dict().items()}
    rng = torch.get_rng_state()
    with train_module._calibration_undone(run.model):
        train_module._calibrate(run)
        moved = [k for k, v in run.model.state_dict().items() if not torch.equal(v, before[k])]
        assert moved and all(".router." in k for k in moved)  # calibration rewrote the thresholds, only them
    after = run.model.state_dict()
    assert all(torch.equal(after[k], before[k]) for k in before)
    assert torch.equal(torch.get_rng_state(), rng)


@pytest.mark.parametrize("variant", ["sigmoid", "mlp_skip", "linear_softmax"])
def test_periodic_causal_bpb_is_the_final_evaluations_number(variant):
    """evaluate_causal sums exactly as causal_metrics does: the periodic points and the final
    point are one series, equal bit for bit on the same model and windows."""
    torch.manual_seed(0)
    cfg = tiny(variant)
    model = GPT(cfg.model, cfg.routing)
    x = torch.randint(0, 256, (12, 64))
    y = torch.randint(0, 256, (12, 64))
    calibrate_causal_rules(model, [torch.randint(0, 256, (4, 64)) for _ in range(3)])
    final = causal_metrics(model, x, y, batch_size=5, device=torch.device("cpu"))
    periodic = evaluate_causal(model, x, y, batch_size=5, device=torch.device("cpu"), topk_bpb=0.0)
    assert periodic["causal_bpb"] == final["causal_bpb"]
    assert periodic["causal_fraction"] == final["causal_fraction"]


def _recipe_filter() -> str:
    """The chart filter docs/studies.md gives, taken from it so the test runs what it says."""
    match = re.search(r"`(tags\.\"modbench\.role\" = '[a-z]+')`", STUDIES_DOC)
    assert match, "the MLflow comparison recipe of docs/studies.md names no modbench.role filter"
    return match.group(1)


def test_chart_recipe_gives_one_causal_curve_per_arm_against_cum_flops(tmp_cwd):
    study = tmp_cwd / "charts.toml"
    study.write_text(SMOKE.replace('name = "smoke"', 'name = "charts"').replace("seeds = [0, 1]", "seeds = [0]")
                     .replace('budget = "steps=6"', 'budget = "steps=9"'))
    outcome = run_study(study, progress=False, tracking_uri=f"sqlite:///{tmp_cwd}/mlflow.db")
    assert sum(outcome.counts.values()) == outcome.counts.get("COMPLETE"), outcome.counts
    client = MlflowClient(f"sqlite:///{tmp_cwd}/mlflow.db")
    exp = client.get_experiment_by_name("charts")
    everything = client.search_runs([exp.experiment_id])
    shown = client.search_runs([exp.experiment_id], filter_string=_recipe_filter())
    parent = [r for r in everything if r.data.tags.get("modbench.role") == "study"]
    assert len(everything) == 3 and len(parent) == 1  # the parent exists, and the filter leaves it out
    assert {r.info.run_id for r in shown} == {r.info.run_id for r in everything} - {parent[0].info.run_id}
    assert sorted(r.data.tags["modbench.arm"] for r in shown) == ["dense", "sigmoid C=0.25 alternate"]  # Group by
    for r in shown:
        causal = {m.step: m.value for m in client.get_metric_history(r.info.run_id, "val/causal_bpb")}
        topk = {m.step: m.value for m in client.get_metric_history(r.info.run_id, "val/bpb")}
        axis = sorted(client.get_metric_history(r.info.run_id, "perf/cum_flops"), key=lambda m: m.step)
        flops = {m.step for m in axis}
        assert sorted(causal) == [3, 6, 9]  # eval_every = 3: every evaluation, the final one included
        assert sorted(causal) == sorted(topk)
        assert set(causal) <= flops  # each point has its x value on the perf/cum_flops axis
        # The x-axis itself: one point per step (log_every = eval_every = 3 share steps), rising, and
        # ending at the FLOPs the trial spent (no stair-steps, no group that ends elsewhere).
        assert len(axis) == len(flops)
        assert all(a.value < b.value for a, b in zip(axis, axis[1:]))
        assert axis[-1].value == r.data.metrics["perf/total_flops"]
        if r.data.tags["modbench.arm"] == "dense":
            assert causal == topk  # no routed layer: the causal rule is the model
