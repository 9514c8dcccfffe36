"""Recursive arms in study files (issue 29, item 5): the recursion axes, their labels and run
configs, the controls a recursive arm gets, and studies/recursion_vs_routing.toml end to end."""

import tomllib
from dataclasses import replace
from pathlib import Path

import pytest
import tomli_w

from modbench.cli.main import main
from modbench.design.arm import Arm
from modbench.design.study_file import load_study
from modbench.errors import ModbenchError
from modbench.model.sizing import MATCH_TOLERANCE, flops_per_token, non_embedding_params
from modbench.design.controls import control_arms, study_arms
from modbench.study import tuning

REPO = Path(__file__).resolve().parents[1]
SHIPPED = REPO / "studies" / "recursion_vs_routing.toml"

STUDY = """
[study]
name = "{name}"
seeds = [0]
objectives = ["val/causal_bpb"]
controls = ["matched_dense", "param_matched_dense"]

[model]
depth = 5
n_embd = 32
head_dim = 16
max_seq_len = 32

[train]
dataset = "arithmetic"
seq_len = 32
batch_size = 4
budget = "steps=4"
eval_every = 4
eval_windows = 4
log_every = 2

[space]
variant = ["dense", "mor"]
recursion = ["middle_cycle"]
recursions = [3]
capacities = ["1, 2/3, 1/3"]
pattern = ["fixed:1,1"]

[[space.also]]
variant = ["dense", "sigmoid"]
recursion = ["none"]
capacities = [""]
capacity = [0.25]
"""


def write(tmp: Path, text: str = STUDY, name: str = "rec") -> Path:
    path = tmp / f"{name}.toml"
    path.write_text(text.format(name=name))
    return path


# --- the axes -------------------------------------------------------------------------------------
def test_the_axes_make_recursive_arms_with_their_labels_and_run_configs(tmp_path):
    s = load_study(write(tmp_path))
    labels = [s.label(a) for a in s.arms()]
    assert labels == ["dense middle_cycle N_R=3", "mor C=1,2/3,1/3 fixed:1,1 middle_cycle N_R=3", "dense",
                      "sigmoid C=0.25 fixed:1,1"]  # dense drops capacities; recursion "none" drops N_R
    rec_dense, mor, dense, sigmoid = s.arms()
    assert (mor.recursion, mor.recursions, mor.capacities, mor.capacity) == ("middle_cycle", 3, "1,2/3,1/3", pytest.approx(1 / 3))
    assert (dense.recursion, dense.recursions, rec_dense.capacities) == ("none", 1, "")
    cfg = s.run_config(mor, 0)
    assert (cfg.model.recursion, cfg.model.recursions, cfg.model.layers, cfg.model.physical_layers) == ("middle_cycle", 3, 5, 3)
    assert cfg.routing.capacities == "1,2/3,1/3" and cfg.routing.capacity_list == pytest.approx((1, 2 / 3, 1 / 3))
    assert cfg.routing.routed_layers(5) == (False, True, True, True, False)  # one router per application
    plain = s.run_config(sigmoid, 0)
    assert (plain.model.recursion, plain.model.recursions, plain.routing.capacities) == ("none", 1, "")


def test_vanilla_arms_keep_their_identity_and_recursive_ones_round_trip():
    vanilla = Arm("sigmoid", 0.125, "alternate", "constant", 1.0, 4, "flops=7e12")
    assert vanilla.params() == {"variant": "sigmoid", "capacity": 0.125, "pattern": "alternate", "schedule": "constant",
                                   "lr_mult": 1.0, "depth": 4, "budget": "flops=7e12"}  # no recursion keys: stored arms still match
    assert vanilla.label == "sigmoid C=0.125 alternate"
    mor = Arm("mor", 0.5, "fixed:1,1", "constant", 2.0, 5, "flops=1e13", recursion="middle_cycle",
              recursions=3, capacities="1,2/3,1/3")
    assert mor.capacity == pytest.approx(1 / 3)  # the last entry, whatever capacity the grid listed
    params = mor.params()
    assert {k: params[k] for k in ("recursion", "recursions", "capacities")} == \
        {"recursion": "middle_cycle", "recursions": 3, "capacities": "1,2/3,1/3"}
    assert Arm.from_params(params) == mor
    assert Arm("dense", 1, "-", "constant", 1, 5, "x", recursion="none", recursions=3).recursions == 1


@pytest.mark.parametrize("old, new, message", [
    ('recursion = ["middle_cycle"]', 'recursion = ["loop"]',
     r"space\.recursion: recursion 'loop' is unknown: expected 'none', 'cycle' or 'middle_cycle'"),
    ("recursions = [3]", "recursions = [5]", r"space\.recursions: recursions 5 is not accepted: expected N_R = 2, 3 or 4"),
    ("recursions = [3]", "recursions = [1]",
     r"arm 'dense middle_cycle N_R=1': model\.recursions = 1 is out of range for recursion 'middle_cycle': expected one of 2, 3, 4"),
    ("depth = 5", "depth = 4", r"model depth 4 does not split into 3 applications of one shared block"),
    ('capacities = ["1, 2/3, 1/3"]', 'capacities = ["1,x"]', r"space\.capacities: .*entry 'x': expected comma-separated fractions"),
    ('capacities = ["1, 2/3, 1/3"]', 'capacities = ["1,2/3"]', r"'1,2/3' has 2 entries for 3 routed layers"),
    ('capacities = [""]\n', "", r"space\.also\[0\]\.capacities: \['1,2/3,1/3'\] would apply to variant 'sigmoid' "
                                r"\(a key left out takes \[space\]'s list\): per-step capacities are for 'mor'"),
    ('variant = ["dense", "mor"]', 'variant = ["dense", "mor", "norm"]', r"space\.capacities: .* would apply to variant 'norm'"),
    ('recursion = ["middle_cycle"]', 'recursion = ["none"]',
     r"study\.controls: 'param_matched_dense' .* \[space\] has no recursive arm"),
])
def test_bad_recursion_axes_are_one_line_errors_naming_the_accepted_values(tmp_path, capsys, old, new, message):
    text = STUDY.replace(old, new, 1)
    assert text != STUDY
    with pytest.raises(ModbenchError, match=message):
        load_study(write(tmp_path, text))
    assert main(["study", "show", str(tmp_path / "rec.toml")]) == 2  # the CLI: exit 2, one line, no traceback
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err


def test_a_sampled_study_cannot_vary_recursion(tmp_path):
    text = STUDY.replace("controls = [\"matched_dense\", \"param_matched_dense\"]", 'sampler = "tpe"\nn_trials = 2')
    text = text.split("[[space.also]]")[0]
    with pytest.raises(ModbenchError, match=r"space\.recursion: sampler 'tpe' .* recursive arms need sampler = \"grid\""):
        load_study(write(tmp_path, text))


# --- the controls of recursive arms ---------------------------------------------------------------
def _model_stats(s, arm):
    cfg = s.run_config(arm, 0)
    return flops_per_token(cfg.model, cfg.routing, cfg.train.seq_len), non_embedding_params(cfg.model, cfg.routing), cfg


def test_shipped_study_controls_match_what_they_claim():
    s = load_study(SHIPPED)
    arms = {s.label(a): a for a in study_arms(s)}
    by_role = {"rec_dense": [a for a in arms.values() if a.variant == "dense" and a.recursion != "none"],
               "mor": [a for a in arms.values() if a.variant == "mor"],
               "vanilla": [a for a in arms.values() if a.variant == "dense" and a.recursion == "none" and not a.control],
               "flop": [a for a in arms.values() if a.control.startswith("FLOP-matched")],
               "param": [a for a in arms.values() if a.control.startswith("param-matched")]}
    assert all(len(v) == 1 for v in by_role.values()), by_role
    (rec_dense,), (mor,), (vanilla,), (flop,), (param,) = by_role.values()
    f_rec, p_rec, c_rec = _model_stats(s, rec_dense)
    f_mor, p_mor, c_mor = _model_stats(s, mor)
    f_van, p_van, _ = _model_stats(s, vanilla)
    f_flop, _, c_flop = _model_stats(s, flop)
    f_par, p_par, c_par = _model_stats(s, param)
    # FLOPs per application: the recursive dense model costs what its unshared twin costs, with fewer parameters
    assert f_rec == f_van and p_rec < p_van
    # the FLOP-matched dense: vanilla, within the sizing's tolerance of the recursive routed arm's FLOPs
    assert c_flop.model.recursion == "none" and abs(f_flop / f_mor - 1) <= MATCH_TOLERANCE
    assert f_flop < f_van  # mor's per-step capacities save FLOPs, so the matched model is smaller
    # the param-matched dense: vanilla, exactly the recursive dense model's parameters at its width;
    # the routed arm adds its routers only (d + 1 per routed position)
    assert (c_par.model.recursion, c_par.model.layers, c_par.model.width) == ("none", c_rec.model.physical_layers, c_rec.model.width)
    assert p_par == p_rec and p_mor - p_par == 3 * (c_mor.model.width + 1)
    assert f_par < f_rec  # fewer applications: 1/N_R of the shared part's FLOPs


@pytest.mark.parametrize("name", ["recursion_vs_routing", "methods_shootout", "variant_shootout"])
def test_the_model_free_control_count_is_what_sizing_derives(name):
    s = load_study(REPO / "studies" / f"{name}.toml")
    assert s.derived_control_count() == len(control_arms(s)) > 0


def test_the_protocol_tunes_and_confirms_the_recursive_dense_model_as_a_family_of_its_own():
    s = load_study(SHIPPED)
    families = tuning.tuned_families(s)
    assert len(families) == 7 and all(f.lr_mult == 1.0 for f in families)
    # every family's grid on seed 0, the vanilla dense the best of the dense models
    points = []
    for i, f in enumerate(families):
        for lr in s.tune.lr_mult:
            val = 2.0 + 0.01 * i + (0.0 if lr == 1.5 else abs(lr - 1.5))
            points.append(tuning.TrialPoint(replace(f, lr_mult=lr), s.tune.seed, "COMPLETE", "tune", val, val))
    for lr in (s.tune.min_lr_mult, s.tune.max_lr_mult):  # bracket every family
        for f in families:
            points.append(tuning.TrialPoint(replace(f, lr_mult=lr), s.tune.seed, "COMPLETE", "extend", 9.0, 9.0))
    step = tuning.plan(s, points, ["tune", "extend", "optimum"])
    assert step.stage == tuning.CONFIRM
    confirmed = {a.family for a, _ in step.queue}
    assert confirmed == set(families)  # the recursive dense and the param-matched model too, not only the best dense
    assert {seed for _, seed in step.queue} == set(s.settings.seeds) - {s.tune.seed}


# --- the shipped study, tiny, end to end ----------------------------------------------------------
def test_a_tiny_copy_of_the_shipped_study_runs_and_reports(tmp_cwd):
    raw = tomllib.loads(SHIPPED.read_text())
    raw["study"].update(name="tiny_rvr", seeds=[0])
    raw.pop("tune")
    # One seed: C3b's equivalence text formats a TOST p that one seed cannot give (harness/report/claims.py
    # causal_rule builds the "equivalent" sentence whatever the class); with no margin it is not built.
    raw["claims"]["causal_rule"].pop("margin")
    raw["model"] = {"depth": 5, "n_embd": 32, "head_dim": 16, "max_seq_len": 32}
    raw["train"] = {"dataset": "arithmetic", "seq_len": 32, "batch_size": 4, "budget": "steps=4", "eval_every": 4,
                    "eval_windows": 4, "log_every": 2}
    path = tmp_cwd / "tiny_rvr.toml"
    path.write_text(tomli_w.dumps(raw))
    s = load_study(path)
    labels = [s.label(a) for a in study_arms(s)]
    assert len(labels) == 7 and {"dense middle_cycle N_R=3", "mor C=1,2/3,1/3 fixed:1,1 middle_cycle N_R=3",
                                 "mor_token_choice C=1,2/3,1/3 fixed:1,1 middle_cycle N_R=3"} <= set(labels)
    assert main(["study", "run", str(path), "--quiet"]) == 0
    from modbench.track.optuna_store import trials_frame

    trials = trials_frame("tiny_rvr", f"sqlite:///{tmp_cwd}/runs/studies/tiny_rvr/optuna.db")
    assert (trials["state"] == "COMPLETE").all() and sorted(trials["arm"]) == sorted(labels)
    mor = trials[trials["variant"] == "mor"].iloc[0]
    assert (mor["recursion"], mor["recursions"], mor["capacities"]) == ("middle_cycle", 3, "1,2/3,1/3")
    from mlflow.tracking import MlflowClient

    run = MlflowClient(f"sqlite:///{tmp_cwd}/mlflow.db").get_run(mor["mlflow_run_id"])
    assert run.data.params["arm.recursion"] == "middle_cycle" and run.data.params["arm.capacities"] == "1,2/3,1/3"
    assert run.data.params["model.recursion"] == "middle_cycle" and run.data.params["routing.capacities"] == "1,2/3,1/3"
    assert main(["report", str(path)]) == 0
    text = (tmp_cwd / "reports" / "tiny_rvr" / "report.md").read_text()
    for label in labels:
        assert label in text, label
    # The opening answers with each arm's decode costs, measured on its checkpoint, before the claims table.
    opening = text.split("## Claims")[0]
    assert "KV bytes/token" in opening and "KV-cached tokens/s (1 CPU thread)" in opening
    import json

    summary = json.loads((tmp_cwd / "reports" / "tiny_rvr" / "summary.json").read_text())
    costs = {c["arm"]: c for c in summary["decode_costs"]}
    assert set(costs) == set(labels)
    for arm in summary["degenerate_arms"]:  # (after 4 steps, sigmoid's router has collapsed)
        assert f"{arm} (degenerate: in no claim)" in opening
    d = raw["model"]["n_embd"]
    # a dense model caches K and V (fp32) of every token at every layer: 2·layers·d·4 bytes; L3 and L5 exactly
    assert costs["dense"]["kv_bytes_per_token"] == 2 * 5 * d * 4 and costs["dense"]["decode_share"] == 1.0
    param_matched = next(label for label in labels if "param-matched" in label)
    assert costs[param_matched]["kv_bytes_per_token"] == 2 * 3 * d * 4
    assert costs[param_matched]["params"] == costs["dense middle_cycle N_R=3"]["params"] < costs["dense"]["params"]
    # recursion-wise caching: mor's later steps cache only the tokens they process (never more than dense)
    mor = costs["mor C=1,2/3,1/3 fixed:1,1 middle_cycle N_R=3"]
    assert 2 * 2 * d * 4 <= mor["kv_bytes_per_token"] <= costs["dense middle_cycle N_R=3"]["kv_bytes_per_token"]
    assert all(c["decode_tokens_per_s"] > 0 and 0 < c["decode_share"] <= 1 for c in costs.values())
