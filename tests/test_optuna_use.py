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
