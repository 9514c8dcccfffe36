"""Optuna used the way its users expect: learning curves, and constants kept out of the space."""

from pathlib import Path

import optuna

from modbench.cli.main import main
from modbench.track.optuna_store import trials_frame

REPO = Path(__file__).resolve().parents[1]
SMOKE = (REPO / "studies" / "smoke.toml").read_text()


def test_trials_report_intermediate_values_and_sampled_constants_are_user_attrs(tmp_cwd):
    text = SMOKE.replace('name = "smoke"', 'name = "tpe_use"').replace('sampler = "grid"', 'sampler = "tpe"\nn_trials = 2')
    text = text.replace("seeds = [0, 1]", "seeds = [0]").replace("capacity = [0.25]", "capacity = {low = 0.2, high = 0.5}")
    path = tmp_cwd / "tpe_use.toml"
    path.write_text(text)
    assert main(["study", "run", str(path), "--quiet"]) == 0
    storage = f"sqlite:///{tmp_cwd}/runs/studies/tpe_use/optuna.db"
    study = optuna.load_study(study_name="tpe_use", storage=storage)
    done = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    assert len(done) == 2
    for t in done:
        assert sorted(t.intermediate_values) == [3]  # eval_every = 3 of 6 steps: the curve the dashboard draws
        assert "pattern" not in t.params and "lr_mult" not in t.params  # one-value lists are no parameters
        assert t.user_attrs["fixed.lr_mult"] == 1.0
        if t.params["variant"] == "sigmoid":
            assert "capacity" in t.params and t.user_attrs["fixed.pattern"] == "alternate"  # a real range is searched
    frame = trials_frame("tpe_use", storage)
    assert (frame["lr_mult"] == 1.0).all()  # the constants are back in the report's rows
