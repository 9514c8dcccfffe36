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


def test_redact_masks_every_url_password_and_nothing_else():
    from modbench.errors import redact

    text = "cannot open postgresql+psycopg://alice:s3cr%40t@db:5432/x and http://bob:pw@h:5000/ (sqlite:///a/b.db)"
    out = redact(text)
    assert "s3cr" not in out and ":pw@" not in out
    assert "postgresql+psycopg://alice:***@db:5432/x" in out and "http://bob:***@h:5000/" in out
    assert "sqlite:///a/b.db" in out and redact("lr=0.003 a:b@c") == "lr=0.003 a:b@c"


@pytest.mark.parametrize("argv", [
    ["study", "run", "smoke", "--storage", "postgresql+psycopg://alice:S3CRET@127.0.0.1:1/db"],
    ["study", "status", "smoke", "--storage", "postgresql+psycopg://alice:S3CRET@127.0.0.1:1/db"],
    ["report", "smoke", "--storage", "postgresql+psycopg://alice:S3CRET@127.0.0.1:1/db"],
    ["train", "--dataset", "arithmetic", "--budget", "steps=1", "--tracking-uri", "http://alice:S3CRET@127.0.0.1:1"],
])
def test_no_password_in_any_error_line(tmp_cwd, capsys, argv):
    assert main(argv) == 2
    out = capsys.readouterr()
    assert "S3CRET" not in out.out + out.err and "modbench: error:" in out.err


def test_no_password_in_mlflow_params_or_tags(tmp_cwd):
    from mlflow.tracking import MlflowClient

    from modbench.track.tracking import Tracker

    store = f"sqlite:///{tmp_cwd}/mlflow.db"
    with Tracker("secrets", uri=store) as tr:
        tr.log_params({"study.storage": "postgresql://u:S3CRET@h/db"})
        tr.set_tags({"storage": "postgresql://u:S3CRET@h/db"})
    run = MlflowClient(store).get_run(tr.run_id)
    assert "S3CRET" not in str(run.data.params) + str(run.data.tags)


def test_out_dir_that_cannot_take_files_fails_before_training(tmp_cwd, capsys):
    """A file where --out-dir's folder should be: one line at the start, nothing trained."""
    (tmp_cwd / "taken").write_text("a file, not a folder")
    assert main(["train", "--dataset", "arithmetic", "--budget", "steps=1000000", "--no-track",
                 "--out-dir", "taken/runs"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("modbench: error: --out-dir taken/runs is not writable") and "\n" not in err


def test_a_file_that_is_not_a_database_as_the_mlflow_store_is_one_line(tmp_cwd, capsys):
    (tmp_cwd / "mlflow.db").write_text("not a database")
    assert main(["train", "--dataset", "arithmetic", "--budget", "steps=1", "--depth", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert "file is not a database" in err and "--tracking-uri" in err and "\n" not in err


def test_ui_keeps_a_store_password_off_the_screen_and_the_server_command_line(tmp_cwd, capsys, monkeypatch):
    """``ps`` shows every process's command line to every user: the store goes in the environment."""
    import socket

    import modbench.cli.ui as ui

    launched = {}

    def serve(cmd, env):
        launched.update(cmd=cmd, env=env)
        return 0

    monkeypatch.setattr(ui, "serve", serve)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    uri = "postgresql+psycopg://alice:S3CRET@127.0.0.1:1/mlflow"
    assert main(["ui", "--tracking-uri", uri, "--port", str(port)]) == 0
    out = capsys.readouterr()
    assert "S3CRET" not in out.out + out.err and "alice:***@" in out.out
    assert "S3CRET" not in " ".join(launched["cmd"])
    assert launched["env"]["MLFLOW_BACKEND_STORE_URI"] == uri
    assert launched["env"]["MLFLOW_SERVER_ENABLE_JOB_EXECUTION"] == "false"  # no GenAI job runner
