"""No secret in any output, file or artifact.

A password is planted in the Optuna storage URL (PostgreSQL's trust authentication, as CI starts
it, accepts any), a study is run and reported through the real command line, and everything the
two commands print and write is searched for it: stdout, stderr, every file under the working
directory (trial folders, MLflow store and artifacts, the report and its CSVs), the Optuna
tables, and, through an MLflow tracking server, the server's store and artifact root (the report
is logged to the study's parent run there, for anyone with UI access to read).
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import time
from pathlib import Path

import pytest

from test_multi_machine import POSTGRES, fresh_database, isolated_env, modbench_command, tracking_server  # noqa: F401

PLANTED = "pl4nted-S3cret"

pytestmark = [pytest.mark.slow, pytest.mark.postgres,
              pytest.mark.skipif(not POSTGRES, reason="set MODBENCH_TEST_POSTGRES_URL (CI starts PostgreSQL on 127.0.0.1)")]

STUDY = """[study]
name = "{name}"
seeds = [0]
[model]
depth = 2
n_embd = 16
head_dim = 8
max_seq_len = 32
[train]
dataset = "arithmetic"
seq_len = 16
batch_size = 2
budget = "steps=4"
eval_every = 2
eval_windows = 2
[space]
variant = ["dense", "sigmoid"]
capacity = [0.5]
"""


@pytest.fixture
def planted_url():
    """A fresh database's URL with a password in it (trust authentication ignores it)."""
    import sqlalchemy as sa

    with fresh_database() as url:
        parsed = sa.engine.make_url(url or POSTGRES)
        yield parsed.set(password=PLANTED).render_as_string(hide_password=False)


def _modbench(args: list[str], cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    done = subprocess.run(modbench_command() + args, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


def _files_holding(root: Path, secret: str) -> list[str]:
    """Every file under ``root`` whose bytes contain ``secret`` (SQLite stores and PNGs included)."""
    needle = secret.encode()
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() and needle in p.read_bytes())


def _rows_holding(url: str, tables: tuple[str, ...], secret: str) -> list[str]:
    """Rows of a database's ``tables`` that contain ``secret`` anywhere."""
    import sqlalchemy as sa

    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    found = []
    try:
        with engine.connect() as conn:
            for table in tables:
                found += [f"{table}: {row}" for row in conn.execute(sa.text(f"SELECT * FROM {table}"))
                          if secret in str(tuple(row))]
    finally:
        engine.dispose()
    return found


# Where Optuna and MLflow keep text a study wrote (attributes; params, tags and the runs themselves).
OPTUNA_TABLES = ("studies", "study_user_attributes", "study_system_attributes", "trial_user_attributes",
                 "trial_system_attributes")
MLFLOW_TABLES = ("experiments", "experiment_tags", "runs", "params", "tags")


def _run_and_report(tmp_path: Path, storage: str, tracking: list[str], env: dict[str, str]) -> tuple[str, Path]:
    """``study run`` then the report command it prints as its hint, as printed; their output and the study name."""
    name = f"secrets_{os.getpid()}_{time.monotonic_ns()}"
    (tmp_path / "work").mkdir()
    (tmp_path / "work" / f"{name}.toml").write_text(STUDY.format(name=name))
    ran = _modbench(["study", "run", f"{name}.toml", "--storage", storage, *tracking, "--json"], tmp_path / "work", env)
    hint = json.loads(ran.stdout)["report"]  # stdout is exactly one JSON document, server or not
    assert "${PGPASSWORD}" in hint  # the password's place names the variable libpq reads
    # The hint works as printed, in a shell whose PGPASSWORD holds the password.
    reported = subprocess.run(["bash", "-c", hint.replace("modbench", shlex.join(modbench_command()), 1)],
                              cwd=tmp_path / "work", env={**env, "PGPASSWORD": PLANTED}, capture_output=True,
                              text=True, timeout=600)
    assert reported.returncode == 0, reported.stdout[-3000:] + reported.stderr[-3000:]
    return ran.stdout + ran.stderr + reported.stdout + reported.stderr, tmp_path / "work" / "reports" / name


def test_a_password_in_the_storage_url_appears_in_no_output_or_file(tmp_path, planted_url):
    env = isolated_env(tmp_path / "home")
    output, report_dir = _run_and_report(tmp_path, planted_url, [], env)
    assert PLANTED not in output
    report = (report_dir / "report.md").read_text()
    assert "${PGPASSWORD}" in report.split("## Reproduce")[1]  # the Reproduce block keeps the flag, not the secret
    assert _files_holding(tmp_path / "work", PLANTED) == []  # report, CSVs, trial folders, mlflow.db, mlartifacts
    assert _rows_holding(planted_url, OPTUNA_TABLES, PLANTED) == []


def test_the_storage_url_can_come_from_the_environment(tmp_path, planted_url):
    """$MODBENCH_STORAGE keeps the URL off the command line, where ps shows it to every user."""
    env = isolated_env(tmp_path / "home", MODBENCH_STORAGE=planted_url)
    name = f"from_env_{os.getpid()}_{time.monotonic_ns()}"
    (tmp_path / f"{name}.toml").write_text(STUDY.format(name=name))
    ran = _modbench(["study", "run", f"{name}.toml", "--json"], tmp_path, env)
    assert PLANTED not in ran.stdout + ran.stderr
    assert not (tmp_path / "runs" / "studies" / name / "optuna.db").exists()  # the trials went to PostgreSQL
    status = _modbench(["study", "status", f"{name}.toml", "--json"], tmp_path, env)
    assert '"COMPLETE": 2' in status.stdout and PLANTED not in status.stdout + status.stderr


def test_no_password_reaches_a_tracking_server_or_its_artifacts(tmp_path, planted_url, tracking_server):
    uri, _port, artifact_root, server_database = tracking_server
    env = isolated_env(tmp_path / "home")
    output, report_dir = _run_and_report(tmp_path, planted_url, ["--tracking-uri", uri], env)
    assert PLANTED not in output
    assert "View run" not in output and "View experiment" not in output  # MLflow's own URL lines, silenced
    assert (report_dir / "report.md").is_file()
    assert list(artifact_root.rglob("report/report.md")), "the report was not logged to the parent run"
    assert _files_holding(artifact_root.parent, PLANTED) == []  # artifacts, the server's log and home
    assert _rows_holding(server_database, MLFLOW_TABLES, PLANTED) == []
    assert _files_holding(tmp_path / "work", PLANTED) == []
