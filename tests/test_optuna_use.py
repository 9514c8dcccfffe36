"""Optuna used the way its users expect: learning curves, and constants kept out of the space."""

import warnings
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


def test_taking_a_queued_trial_on_sqlite_holds_a_lock_across_processes(tmp_path, monkeypatch):
    """Two workers on one SQLite store once both took the same WAITING trial (SQLite ignores SELECT
    ... FOR UPDATE): both trained it and the second failed with "Cannot tell a COMPLETE trial". The
    read-and-write that takes a queued trial must hold the take lock (an flock another process
    would wait on); finishing a trial needs no lock."""
    import fcntl

    from optuna.trial import TrialState

    from modbench.track.optuna_store import SQLiteStorage, connect_storage, take_lock_path

    db = tmp_path / "optuna.db"
    storage = connect_storage(f"sqlite:///{db}")
    assert isinstance(storage, SQLiteStorage)
    study = optuna.create_study(storage=storage, study_name="take")
    study.enqueue_trial({}, user_attrs={"arm": "dense"})
    seen = []
    real = optuna.storages.RDBStorage.set_trial_state_values

    def probe(self, trial_id, state, values=None):
        with open(take_lock_path(db), "a") as other:  # another open file: as another process would
            try:
                fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
                fcntl.flock(other, fcntl.LOCK_UN)
                seen.append((state, "free"))
            except BlockingIOError:
                seen.append((state, "held"))
        return real(self, trial_id, state, values)

    monkeypatch.setattr(optuna.storages.RDBStorage, "set_trial_state_values", probe)
    trial = study.ask()
    assert trial.user_attrs["arm"] == "dense"  # the queued trial was taken
    study.tell(trial, 1.0)
    assert seen == [(TrialState.RUNNING, "held"), (TrialState.COMPLETE, "free")]


def test_grid_trials_carry_their_arm_as_params_and_an_added_arm_still_runs(tmp_cwd):
    """optuna-dashboard's slice, contour and importance pages read params: a grid trial's arm must be
    there (the axes that vary, dense without a capacity), equal to the arm it ran; an arm added to the
    file after creation, with a choice the categorical did not have, still runs (left out of the params)."""
    text = SMOKE.replace('name = "smoke"', 'name = "grid_params"').replace("seeds = [0, 1]", "seeds = [0]")
    text = text.replace("capacity = [0.25]", "capacity = [0.25, 0.5]")
    path = tmp_cwd / "grid_params.toml"
    path.write_text(text)
    assert main(["study", "run", str(path), "--quiet"]) == 0
    storage = f"sqlite:///{tmp_cwd}/runs/studies/grid_params/optuna.db"
    study = optuna.load_study(study_name="grid_params", storage=storage)
    done = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    assert len(done) == 3  # dense (one arm: it has no capacity), sigmoid at 0.25 and 0.5
    for t in done:
        arm = t.user_attrs["arm_params"]
        assert t.params["variant"] == arm["variant"]
        assert t.params.get("capacity") == arm.get("capacity")  # dense: absent on both sides
        assert "pattern" not in t.params  # one value in the whole study: no parameter
    assert sorted(t.params.get("capacity", 0) for t in done) == [0, 0.25, 0.5]
    with warnings.catch_warnings():  # "less than 2 trials" per regime: one seed in a test
        warnings.simplefilter("ignore", UserWarning)
        assert set(optuna.importance.get_param_importances(study)) == {"variant", "capacity"}  # the importance page

    path.write_text(text.replace('variant = ["dense", "sigmoid"]', 'variant = ["dense", "sigmoid", "random"]'))
    assert main(["study", "run", str(path), "--quiet"]) == 0
    study = optuna.load_study(study_name="grid_params", storage=storage)
    added = [t for t in study.trials if t.user_attrs["arm_params"]["variant"] == "random"]
    assert len(added) == 2 and all(t.state == optuna.trial.TrialState.COMPLETE for t in added)
    assert all("variant" not in t.params and t.params["capacity"] in (0.25, 0.5) for t in added)
