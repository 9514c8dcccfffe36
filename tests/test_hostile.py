"""Hostile inputs: files that would run code, names that would escape their folders."""

from __future__ import annotations

import pickle

import pytest
import torch

from modbench.cli.main import main
from modbench.errors import ModbenchError
from modbench.track.checkpoint import load_checkpoint


class _Payload:
    def __reduce__(self):  # what a crafted pickle does on load
        return (open, ("PWNED", "w"))


def test_a_crafted_checkpoint_runs_nothing(tmp_cwd, capsys):
    """torch.load(weights_only=True): a pickle with a code payload is refused, its code never runs."""
    bad = tmp_cwd / "evil.pt"
    with open(bad, "wb") as f:
        pickle.dump({"model": {}, "config": {}, "x": _Payload()}, f)
    with pytest.raises(ModbenchError, match="never code"):
        load_checkpoint(bad)
    assert main(["generate", "--run", str(bad), "--prompt", "x"]) == 2
    assert "never code" in capsys.readouterr().err
    assert not (tmp_cwd / "PWNED").exists()


def test_checkpoint_must_belong_to_the_run_that_names_it(tmp_path):
    path = tmp_path / "c.pt"
    torch.save({"run_id": "a" * 32, "model": {}}, path)
    assert load_checkpoint(path, run_id="a" * 32)["run_id"] == "a" * 32
    with pytest.raises(ModbenchError, match="written by MLflow run a+, not b+"):
        load_checkpoint(path, run_id="b" * 32)


@pytest.mark.parametrize("name", [".", "..", ".hidden", "a/b", "x" * 101])
def test_study_names_cannot_escape_their_folders(tmp_cwd, capsys, name):
    (tmp_cwd / "s.toml").write_text(f'[study]\nname = "{name}"\n[space]\nvariant = ["dense"]\n')
    assert main(["study", "run", "s.toml"]) == 2
    assert "study.name" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_cwd.iterdir()) == ["s.toml"]


def test_reruns_with_another_budget_get_their_own_run_folder():
    from dataclasses import replace

    from modbench.config.run import RunConfig, TrainConfig
    from modbench.run.train import default_run_name

    a = RunConfig(train=TrainConfig(budget="steps=10"))
    b = replace(a, train=replace(a.train, budget="steps=20"))
    c = replace(a, train=replace(a.train, lr=2e-3))
    assert len({default_run_name(a), default_run_name(b), default_run_name(c)}) == 3
    assert default_run_name(a) == default_run_name(RunConfig(train=TrainConfig(budget="steps=10")))


@pytest.mark.parametrize("value", ["nan", "inf", "-1", "hot"])
def test_generate_temperature_must_be_a_finite_non_negative_number(tmp_cwd, capsys, value):
    assert main(["generate", "--run", "x.pt", "--prompt", "a", "--temperature", value]) == 2
    err = capsys.readouterr().err
    assert "is not a temperature: expected a finite number >= 0" in err and len(err.strip().splitlines()) == 1
