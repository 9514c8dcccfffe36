"""Configs are parsed once: bounds in one place, no side effects, a TOML round trip."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from modbench.cli.main import main
from modbench.config.io import check_bounds
from modbench.config.model import ModelConfig, RoutingConfig
from modbench.config.run import RunConfig, TrainConfig, load_run
from modbench.errors import ModbenchError
from modbench.model.gpt import GPT
from modbench.variants import registry


@pytest.mark.parametrize("section, field, value, expected", [
    ("model", "n_head", 0, "model.n_head = 0 is out of range: expected an integer in [1, 1024]"),
    ("model", "n_embd", -64, "model.n_embd = -64 is out of range"),
    ("model", "vocab_size", 16, "model.vocab_size = 16 is out of range: expected an integer in [256, 1048576]"),
    ("model", "max_seq_len", 10**9, "model.max_seq_len = 1000000000 is out of range"),
    ("train", "beta1", 1.5, "train.beta1 = 1.5 is out of range: expected a number in [0, 1)"),
    ("train", "beta2", 1.0, "train.beta2 = 1.0 is out of range"),
    ("train", "seed", 2**32, "train.seed = 4294967296 is out of range: expected an integer in [0, 4294967295]"),
    ("train", "batch_size", 10**7, "train.batch_size = 10000000 is out of range"),
    ("train", "grad_clip", 0.0, "train.grad_clip = 0.0 is out of range: expected a number in (0, 1e+09]"),
    ("train", "lr", -1.0, "train.lr = -1.0 is out of range"),
])
def test_bad_values_are_refused_at_construction_with_field_and_range(section, field, value, expected):
    cls = {"model": ModelConfig, "train": TrainConfig}[section]
    with pytest.raises(ModbenchError) as e:
        cls(**{field: value})
    assert str(e.value).startswith(expected) and "\n" not in str(e.value)


@pytest.mark.parametrize("argv, expected", [
    (["--n-head", "0"], "--n-head = 0 is out of range") ,
    (["--beta1", "1.5"], "train.beta1 = 1.5 is out of range"),
    (["--experiment", ""], "train.experiment = '' is not accepted"),
    (["--run-name", "../../x"], "train.run_name = '../../x' is not accepted"),
    (["--run-name", "x" * 300], "is not accepted: expected a name of at most 100"),
    (["--budget", "steps=0.5"], "budget 'steps=0.5' is smaller than one training step"),
    (["--budget", "tokens=1"], "budget 'tokens=1' is smaller than one training step"),
])
def test_bad_flags_are_one_line_exit_2_before_anything_is_written(tmp_cwd, capsys, argv, expected):
    assert main(["train", "--dataset", "arithmetic", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("modbench: error:") and expected.split(" is ")[-1] in err and "\n" not in err
    assert list(tmp_cwd.iterdir()) == []  # no store, no run directory


def test_print_config_round_trips_through_config(tmp_cwd, capsys):
    argv = ["train", "--variant", "sigmoid", "--capacity", "0.25", "--pattern", "fixed:1,1", "--depth", "6",
            "--n-head", "3", "--lr", "0.003", "--budget", "tokens=1e6", "--option", "aux_weight=0.05",
            "--dataset", "arithmetic", "--seed", "7", "--no-scale-hparams"]
    assert main([*argv, "--print-config"]) == 0
    text = capsys.readouterr().out
    (tmp_cwd / "run.toml").write_text(text)
    assert main(["train", "--config", "run.toml", "--print-config"]) == 0
    assert capsys.readouterr().out == text
    from modbench.config.io import read_toml

    cfg = RunConfig.from_dict(read_toml(tmp_cwd / "run.toml"))
    assert cfg.routing == RoutingConfig("sigmoid", 0.25, "constant", "fixed:1,1", {"aux_weight": 0.05})
    assert cfg.model.n_head == 3 and cfg.train.seed == 7 and cfg.train.scale_hparams is False
    assert cfg.to_dict() == RunConfig.from_dict(cfg.to_toml_dict()).to_dict()
    assert not (tmp_cwd / "runs").exists()


def test_constructors_touch_no_file_and_load_no_plugin(monkeypatch):
    """The dataclasses check values only; the dataset file and the registry are load_run's."""
    def boom(*a, **k):
        raise AssertionError("a constructor looked outside its values")

    monkeypatch.setattr(registry, "_load_plugins", boom)
    monkeypatch.setattr("modbench.config.run.check_dataset", boom)
    cfg = RunConfig(ModelConfig(), RoutingConfig("no-such-variant", 0.5), TrainConfig(dataset="no/such/file.txt"))
    assert cfg.train.dataset == "no/such/file.txt"
    monkeypatch.undo()
    with pytest.raises(ModbenchError, match="dataset file 'no/such/file.txt' does not exist"):
        load_run(cfg)
    with pytest.raises(ModbenchError, match="unknown variant 'no-such-variant'"):
        load_run(dataclasses.replace(cfg, train=TrainConfig(dataset="arithmetic")))


_bounded_ints = st.fixed_dictionaries({
    "depth": st.integers(1, 3), "head_dim": st.sampled_from([2, 4, 8, 16]), "aspect_ratio": st.integers(1, 24),
    "mlp_ratio": st.integers(1, 4), "max_seq_len": st.integers(1, 32), "vocab_size": st.integers(256, 300),
})


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(model=_bounded_ints, variant=st.sampled_from(["dense", "norm", "sigmoid", "mlp_skip", "random_gated"]),
       capacity=st.sampled_from([0.1, 0.5, 1.0]), n_head=st.one_of(st.none(), st.integers(1, 4)))
def test_anything_that_passes_validation_runs(model, variant, capacity, n_head):
    """A config the loader accepts builds a model and runs forward and backward."""
    try:
        cfg = load_run(RunConfig(ModelConfig(n_head=n_head, **model), RoutingConfig(variant, capacity),
                                 TrainConfig(dataset="arithmetic", seq_len=min(8, model["max_seq_len"]))))
    except ModbenchError:
        return  # refused at load, with one line: fine
    check_bounds(cfg.model, "model")
    m = GPT(cfg.model, cfg.routing)
    x = torch.randint(0, 256, (2, cfg.train.seq_len))
    out = m(x, x)
    assert torch.isfinite(out.loss)
    out.loss.backward()


@pytest.mark.parametrize("depth, pattern", [(1, "alternate"), (3, "every:4"), (4, "DD"), (2, "DDM"), (5, "D")])
def test_a_routed_config_whose_pattern_routes_no_layer_is_refused(depth, pattern):
    """Silently training the dense model under a routed variant's name would mislabel a result."""
    with pytest.raises(ModbenchError) as e:
        RunConfig(ModelConfig(depth=depth), RoutingConfig("sigmoid", 0.25, pattern=pattern))
    msg = str(e.value)
    assert f"routing.pattern {pattern!r} routes no layer of a {depth}-layer model" in msg and "\n" not in msg
    assert "expected a pattern that routes at least one layer" in msg
    # dense configs (the baseline, capacity 1, the sizing code's dense probes) are exempt
    RunConfig(ModelConfig(depth=depth), RoutingConfig("dense", pattern=pattern))
    RunConfig(ModelConfig(depth=depth), RoutingConfig("sigmoid", 1.0, pattern=pattern))
    RunConfig(ModelConfig(depth=depth), RoutingConfig())


def test_a_pattern_that_routes_nothing_is_one_line_exit_2_on_the_command_line(tmp_cwd, capsys):
    assert main(["train", "--dataset", "arithmetic", "--variant", "sigmoid", "--depth", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("modbench: error:") and "routes no layer of a 1-layer model" in err and "\n" not in err
    assert list(tmp_cwd.iterdir()) == []


def test_sizing_probes_of_dense_shapes_down_to_depth_one_still_work():
    from modbench.model.sizing import matched_dense_shape

    cfg = RunConfig(ModelConfig(depth=2, n_embd=32, head_dim=8, max_seq_len=32), RoutingConfig("sigmoid", 0.125),
                    TrainConfig(seq_len=32))
    depth, width, ratio = matched_dense_shape(cfg, tolerance=1.0)
    assert 1 <= depth <= 2 and width <= 32 and ratio > 0
