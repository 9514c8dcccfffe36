"""The arm, declared once (modbench.design.arm): what is derived from the declarations, an arm's
identity in a storage, a new axis added as a field, and the registry's roles behind the claims'
vocabulary."""

from __future__ import annotations

import json
from dataclasses import fields

import pytest

from modbench import variants
from modbench.design.arm import ARM_KEYS, DENSE_IGNORES, SPACE_KEYS, Arm, space_defaults
from modbench.design.controls import study_arms
from modbench.design.study_file import load_study, shipped_studies
from modbench.design.vocabulary import CONTROL_VARIANTS, DENSE, RANDOM_CONTROL
from modbench.errors import ModbenchError


def test_the_space_keys_and_the_stored_form_are_derived_from_the_declarations():
    # A study file's keys: every axis but the control label, in declared order.
    assert SPACE_KEYS == ("variant", "capacity", "pattern", "schedule", "lr_mult", "depth", "budget", "width",
                          "capacity_first", "recursion", "recursions", "capacities", "mlp_ratio")
    assert set(ARM_KEYS) == set(SPACE_KEYS) | {"control"}
    assert set(DENSE_IGNORES) == {"capacity", "pattern", "schedule", "capacity_first", "capacities"}
    # The stored form of a vanilla arm is what it was before recursion, capacities or mlp_ratio existed:
    # a study created then still finds its trials.
    assert Arm("sigmoid", 0.125, "alternate", "constant", 2.0, 4, "flops=7e12").params() == {
        "variant": "sigmoid", "capacity": 0.125, "pattern": "alternate", "schedule": "constant", "lr_mult": 2.0,
        "depth": 4, "budget": "flops=7e12"}
    assert Arm(DENSE, 0.5, "fixed:1,1", "log", 1.0, 3, "steps=5", width=64, control="x").params() == {
        "variant": DENSE, "lr_mult": 1.0, "depth": 3, "budget": "steps=5", "width": 64, "control": "x"}


def test_an_arm_is_canonical_whatever_it_is_built_from():
    dense = Arm(DENSE, 0.25, "fixed:1,1", "log", 1, 4, "steps=5", capacity_first=0.5, capacities="1,1/2")
    assert (dense.capacity, dense.pattern, dense.schedule, dense.capacity_first, dense.capacities) == \
        (1.0, "-", "constant", 0.0, "")
    assert dense == Arm(DENSE, lr_mult=1.0, depth=4, budget="steps=5")
    assert Arm("mor", 0.9, "fixed:1,1", capacities="1,2/3,1/3", depth=5, budget="x").capacity == pytest.approx(1 / 3)
    assert Arm(DENSE, depth=5, budget="x", recursion="none", recursions=3).recursions == 1
    assert isinstance(Arm("sigmoid", 1, depth=4.0, budget="x").depth, int)


GRID_STUDIES = sorted(n for n, p in shipped_studies().items() if load_study(p).settings.sampler == "grid")


@pytest.mark.parametrize("name", GRID_STUDIES)
def test_every_arm_of_every_shipped_grid_study_round_trips_through_its_stored_form(name):
    study = load_study(name)
    for arm in study_arms(study):
        stored = json.loads(json.dumps(arm.params()))  # as Optuna keeps it
        assert Arm.from_params(stored) == arm
        assert Arm.from_params(arm.to_dict()) == arm
        assert arm.family == Arm.from_params({**stored, "lr_mult": 1.0})
        assert arm.shape == arm.family.shape and len(arm.shape) == len(fields(Arm)) - 3


def test_a_new_axis_is_a_field_and_the_line_where_it_takes_effect(tmp_path):
    """mlp_ratio was added as one field of Arm and one line of StudySpec.run_config: the study file
    accepts it, the grid spans it, the label names it, the run gets it, the trial stores it."""
    path = tmp_path / "mlp.toml"
    path.write_text('[study]\nname = "mlp"\n[model]\ndepth = 2\nn_embd = 32\nhead_dim = 16\nmax_seq_len = 32\n'
                    '[train]\ndataset = "arithmetic"\nseq_len = 32\nbatch_size = 2\nbudget = "steps=2"\n'
                    '[space]\nvariant = ["dense", "sigmoid"]\nmlp_ratio = [0, 2]\n')
    study = load_study(path)
    arms = study.arms()
    assert len(arms) == 4
    labels = {study.label(a) for a in arms}
    assert labels == {"dense", "dense mlp×2", "sigmoid C=0.125 alternate", "sigmoid C=0.125 alternate mlp×2"}
    narrow = next(a for a in arms if a.variant == "sigmoid" and a.mlp_ratio == 2)
    assert study.run_config(narrow, 0).model.mlp_ratio == 2
    assert study.run_config(Arm(**{**narrow.to_dict(), "mlp_ratio": 0}), 0).model.mlp_ratio == study.base.model.mlp_ratio
    assert narrow.params()["mlp_ratio"] == 2 and "mlp_ratio" not in Arm("sigmoid", depth=2, budget="x").params()
    path.write_text(path.read_text().replace("mlp_ratio = [0, 2]", "mlp_ratio = [65]"))
    with pytest.raises(ModbenchError, match=r"space\.mlp_ratio: mlp_ratio 65 is not accepted"):
        load_study(path)


def test_space_defaults_take_the_model_and_train_settings():
    study = load_study("quick")
    defaults = space_defaults(study.base.model, study.base.train)
    assert defaults["depth"] == [study.base.model.depth] and defaults["budget"] == [study.base.train.budget]
    assert defaults["variant"] == [DENSE] and set(defaults) == set(SPACE_KEYS)


def test_the_baseline_and_the_random_controls_are_the_registrys_roles():
    assert variants.baseline_variant() == DENSE == "dense" and variants.is_baseline(DENSE)
    assert not variants.is_baseline("sigmoid") and not variants.is_baseline("no_such_variant")
    assert RANDOM_CONTROL == {"sigmoid": "random_gated", "norm": "random", "mlp_skip": "random_mlp"}
    assert set(CONTROL_VARIANTS) == set(RANDOM_CONTROL.values())
    for name in variants.list_variants():
        spec = variants.get_variant(name)
        assert spec.role in variants.ROLES
        assert (spec.role == "control") == bool(spec.control_of)
        if spec.control_of:  # a control randomises a learned variant of the same scope
            learned = variants.get_variant(spec.control_of)
            assert learned.role == "learned" and learned.scope == spec.scope
    # The figures colour roles without importing the registry (their path runs without torch): the same roles.
    from modbench.report import figures

    assert figures.DENSE == DENSE and set(figures._CONTROL_GREYS) == set(CONTROL_VARIANTS)
    with pytest.raises(ValueError, match="control_of"):
        variants.register_variant("bad_control", lambda d, c: None, config=variants.VariantConfig, source="x",
                                  role="control")
