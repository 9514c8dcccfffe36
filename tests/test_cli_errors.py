"""Every user mistake the CLI can meet ends in one stderr line and exit code 2.

Each case is a real invocation of ``modbench`` (in-process, through ``modbench.cli.main.main``);
the expected fragment names the problem, and for choices the accepted values.
"""

from __future__ import annotations

import socket
import urllib.error
import urllib.request

import pytest

from modbench.cli.main import main

STUDY = "studies/smoke.toml"


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again on exit: nothing listens there


CASES = [
    ([], "the following arguments are required: command"),
    (["frobnicate"], "invalid choice: 'frobnicate' (choose from"),
    (["train", "--capacity", "1.5"], "capacity 1.5 is out of range: expected a fraction in (0, 1]"),
    (["train", "--variant", "nrm"], "unknown variant 'nrm' (did you mean 'norm'?): registered variants are"),
    (["train", "--pattern", "xyz"], "layer pattern 'xyz' is not understood: expected 'alternate'"),
    (["train", "--batch-size", "0"], "train.batch_size = 0 is out of range: expected an integer in [1, 65536]"),
    (["train", "--budget", "flops=abc"], "budget 'flops=abc' is not understood: expected 'steps=N'"),
    (["train", "--lr", "nan"], "--lr is NaN: expected a number"),
    (["train", "--depth", "x"], "--depth = 'x' has the wrong type: expected an integer"),
    (["train", "--dataset", "tinyshakespear"], "unknown dataset 'tinyshakespear': expected 'stdlib', 'tinyshakespeare'"),
    (["train", "--dataset", "missing/corpus.txt"], "dataset file 'missing/corpus.txt' does not exist"),
    (["train", "--option", "aux_weight"], "--option 'aux_weight' is not KEY=VALUE"),
    (["train", "--config", "nope.toml"], "config file 'nope.toml' does not exist"),
    (["variants", "zz*"], "no variant matches 'zz*': registered variants are 'amod', 'dense'"),
    (["study", "run", "nope.toml"], "no study file 'nope.toml', and no shipped study of that name"),
    (["study", "status", "nope"], "no study 'nope' under"),
    (["study", "status", STUDY, "--storage", "nosuchdialect://x"], "cannot open Optuna storage 'nosuchdialect://x'"),
    (["report", "nope.toml"], "no study file 'nope.toml', and no shipped study of that name"),
    (["generate", "--run", "not-a-run", "--prompt", "x"], "it is not an MLflow run id (32 hex digits)"),
]


@pytest.mark.parametrize("argv,fragment", CASES, ids=[" ".join(a) or "<none>" for a, _ in CASES])
def test_user_error_is_one_line_exit_2(argv, fragment, capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("modbench: error: ")
    assert fragment in lines[0]


def test_unreachable_postgres_is_one_line_and_hides_the_password(capsys):
    url = f"postgresql+psycopg://who:hunter2@127.0.0.1:{_closed_port()}/db"
    assert main(["study", "status", STUDY, "--storage", url]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "cannot open Optuna storage" in err
    assert "hunter2" not in err and "***" in err and "check the URL and that the database server is running" in err


def test_missing_dataset_offline_says_where_to_put_it(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("MODBENCH_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")

    def offline(*args, **kwargs):
        raise urllib.error.URLError("Name or service not known")

    monkeypatch.setattr(urllib.request, "urlopen", offline)
    code = main(["train", "--quiet", "--dataset", "tinyshakespeare", "--budget", "steps=1",
                 "--out-dir", str(tmp_path / "runs")])
    out, err = capsys.readouterr()
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "could not download tinyshakespeare" in err and str(tmp_path / "data") in err
    assert out == ""  # nothing printed (or tracked) before the failure
