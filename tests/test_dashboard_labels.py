"""What optuna-dashboard shows of a modbench study: every trial labelled by its arm and seed (user
attributes: the dashboard draws each learning curve as `trial #N`), and learning curves in the
objective's own metric."""

from pathlib import Path

import optuna
from mlflow.tracking import MlflowClient

from modbench.design.study_file import load_study
from modbench.design.controls import study_arms
from modbench.study.runner import Runner, run_study

from test_tuning import write_study

REPO = Path(__file__).resolve().parents[1]
SMOKE = (REPO / "studies" / "smoke.toml").read_text()


def _labelled(trials, study) -> None:
    labels = {study.label(a) for a in study_arms(study)}
    for t in trials:
        assert isinstance(t.user_attrs.get("arm"), str) and t.user_attrs["arm"], t.number
        assert t.user_attrs.get("seed") in study.settings.seeds, t.number
        if study.settings.sampler == "grid" and not study.tune.lr_mult:
            assert t.user_attrs["arm"] in labels


def test_every_queued_trial_of_a_grid_and_of_a_staged_study_carries_its_arm_and_seed(tmp_path):
    """Queued, not yet run: the labels are there from the moment a trial exists."""
    grid = tmp_path / "labels_grid.toml"
    grid.write_text(SMOKE.replace('name = "smoke"', 'name = "labels_grid"'))
    staged = write_study(tmp_path, "labels_staged")
    for path in (grid, staged):
        study = load_study(path)
        url = f"sqlite:///{tmp_path}/{study.name}.db"
        runner = Runner(study, url, tmp_path, tracking_uri=f"sqlite:///{tmp_path}/mlflow.db", heartbeat=10, grace=30)
        waiting = runner.optuna.get_trials(states=(optuna.trial.TrialState.WAITING,))
        assert waiting, study.name
        _labelled(waiting, study)


def test_a_sampled_study_labels_every_trial_and_its_curves_are_the_causal_objective(tmp_cwd):
    """TPE proposes the first seed's arm; the other seeds are queued with it. With the objective
    val/causal_bpb, each trial's intermediate values are the causal metric logged at every evaluation."""
    text = (SMOKE.replace('name = "smoke"', 'name = "labels_tpe"').replace('sampler = "grid"', 'sampler = "tpe"\nn_trials = 1')
            .replace('objectives = ["val_bpb"]', 'objectives = ["val/causal_bpb"]').replace('budget = "steps=6"', 'budget = "steps=9"')
            .replace('variant = ["dense", "sigmoid"]', 'variant = ["sigmoid", "mlp_skip"]'))
    path = tmp_cwd / "labels_tpe.toml"
    path.write_text(text)
    outcome = run_study(path, progress=False, tracking_uri=f"sqlite:///{tmp_cwd}/mlflow.db")
    assert sum(outcome.counts.values()) == outcome.counts.get("COMPLETE"), outcome.counts
    study = optuna.load_study(study_name="labels_tpe", storage=f"sqlite:///{tmp_cwd}/runs/studies/labels_tpe/optuna.db")
    trials = study.get_trials(states=(optuna.trial.TrialState.COMPLETE,))
    assert len(trials) == 2  # one sampled arm × seeds [0, 1]
    _labelled(trials, load_study(path))
    assert len({t.user_attrs["arm"] for t in trials}) == 1
    client = MlflowClient(f"sqlite:///{tmp_cwd}/mlflow.db")
    for t in trials:
        run = client.get_run(t.user_attrs["mlflow_run_id"])
        assert run.data.tags["modbench.arm"] == t.user_attrs["arm"]
        logged = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "val/causal_bpb")}
        assert t.intermediate_values == {s: v for s, v in logged.items() if s in (3, 6)}  # the periodic evaluations
        assert t.intermediate_values and t.values[0] == logged[9]  # the final one is the objective
