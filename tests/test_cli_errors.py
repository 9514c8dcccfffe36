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


# --- a broken environment, not a malformed file: still one line, never a traceback -----------------

TINY = ["--dataset", "arithmetic", "--depth", "2", "--n-embd", "16", "--head-dim", "8", "--max-seq-len", "32",
        "--seq-len", "16", "--batch-size", "2", "--eval-windows", "2"]


def _one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("modbench: error: "), err
    return lines[0]


def _unreadable(path, monkeypatch) -> None:
    """``path`` without read permission; root reads any file, so there the refusal is injected
    where the file is opened (the same PermissionError the kernel gives everyone else)."""
    import errno
    import os
    import pathlib

    path.chmod(0)
    if os.access(path, os.R_OK):
        real = pathlib.Path.read_text

        def refuse(self, *args, **kwargs):
            if self.resolve() == path.resolve():
                raise PermissionError(errno.EACCES, "Permission denied", str(self))
            return real(self, *args, **kwargs)

        monkeypatch.setattr(pathlib.Path, "read_text", refuse)


def test_a_study_file_the_user_may_not_read_is_one_line(tmp_cwd, capsys, monkeypatch):
    study = tmp_cwd / "mine.toml"
    study.write_text('[study]\nname = "mine"\n[space]\nvariant = ["dense"]\n')
    _unreadable(study, monkeypatch)
    assert main(["study", "run", str(study)]) == 2
    line = _one_line(capsys.readouterr().err)
    assert "cannot read" in line and "mine.toml" in line and "Permission denied" in line


def test_generate_asking_for_more_memory_than_the_machine_has_is_one_line(tmp_cwd, capsys):
    assert main(["train", *TINY, "--budget", "steps=1", "--no-track", "--quiet", "--run-name", "tiny"]) == 0
    capsys.readouterr()
    checkpoint = next(tmp_cwd.glob("runs/tiny*/checkpoint.pt"))
    # 10^12 sequences: terabytes for the prompts alone, more than any machine running this has
    assert main(["generate", "--run", str(checkpoint), "--prompt", "ab", "--batch", str(10**12),
                 "--max-new-tokens", "2", "--no-dense"]) == 2
    line = _one_line(capsys.readouterr().err)
    assert "--batch 1000000000000 needs more memory than cpu has" in line and "smaller --batch" in line


@pytest.mark.parametrize("command", [["report", STUDY], ["ui"]])
def test_report_or_ui_at_an_mlflow_store_that_is_not_a_database_is_one_line(tmp_cwd, capsys, command):
    (tmp_cwd / "mlflow.db").write_text("these are notes, not a database\n")
    assert main([*command, "--tracking-uri", "sqlite:///mlflow.db"]) == 2
    line = _one_line(capsys.readouterr().err)
    assert "is not a SQLite database" in line and "--tracking-uri" in line


def test_a_reports_folder_that_cannot_be_created_is_one_line_before_any_work(tmp_cwd, capsys):
    import optuna

    from modbench.design.study_file import load_study
    from modbench.track.optuna_store import default_storage

    optuna.logging.set_verbosity(optuna.logging.WARNING)  # as the runner does: no INFO line per study
    optuna.create_study(study_name="smoke", storage=default_storage(load_study(STUDY), "runs/studies"))
    capsys.readouterr()
    (tmp_cwd / "mlflow.db").touch()  # an MLflow store SQLite has not written yet
    (tmp_cwd / "taken").write_text("a file where the reports folder should go")
    assert main(["report", STUDY, "--reports-dir", "taken/reports"]) == 2
    line = _one_line(capsys.readouterr().err)
    assert "--reports-dir taken/reports/smoke is not writable" in line


def test_a_report_whose_mlflow_store_is_missing_is_one_line_and_creates_none(tmp_cwd, capsys):
    """The study's trials are here, its MLflow runs are not (they went to another --tracking-uri)."""
    import optuna

    from modbench.design.study_file import load_study
    from modbench.track.optuna_store import default_storage

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    optuna.create_study(study_name="smoke", storage=default_storage(load_study(STUDY), "runs/studies"))
    capsys.readouterr()
    assert main(["report", STUDY]) == 2
    line = _one_line(capsys.readouterr().err)
    assert f"no MLflow store at {tmp_cwd.resolve() / 'mlflow.db'}: pass the --tracking-uri the study ran with" in line
    assert not (tmp_cwd / "mlflow.db").exists() and not (tmp_cwd / "reports").exists()


def test_a_report_of_a_study_that_never_ran_leaves_no_empty_store_behind(tmp_cwd, capsys):
    assert main(["report", STUDY]) == 2
    assert "no study named 'smoke' in runs/studies/smoke/optuna.db" in _one_line(capsys.readouterr().err)
    assert main(["report", STUDY, "--storage", "sqlite:///elsewhere.db"]) == 2
    assert f"no study named 'smoke' in {tmp_cwd.resolve() / 'elsewhere.db'}" in _one_line(capsys.readouterr().err)
    assert main(["study", "status", STUDY]) == 2
    assert "run 'modbench study run' first" in _one_line(capsys.readouterr().err)
    assert sorted(p.name for p in tmp_cwd.iterdir()) == []  # no runs/studies/smoke/optuna.db, no mlflow.db


@pytest.mark.parametrize("key,value", [("capacity", "[true]"), ("capacity", "{low = true, high = 0.5}"),
                                       ("capacity_first", "[false]")])
def test_a_toml_boolean_is_not_a_capacity(tmp_cwd, capsys, key, value):
    """``capacity = true`` would train at 1.0 (float(True)): refused like any other non-number."""
    (tmp_cwd / "b.toml").write_text(f'[study]\nname = "b"\n[space]\nvariant = ["sigmoid"]\n{key} = {value}\n')
    assert main(["study", "run", "b.toml"]) == 2
    line = _one_line(capsys.readouterr().err)
    assert f"space.{key}" in line and "is not a number: expected a fraction in (0, 1]" in line
