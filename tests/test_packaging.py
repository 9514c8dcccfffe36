"""What `pip install` puts on a user's machine: one `modbench` package, and floors that work."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def floors() -> dict[str, str]:
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    return {m[1].lower(): m[2] for d in deps if (m := re.match(r"([A-Za-z0-9_\-]+)(?:\[.*\])?>=([0-9.]+)", d))}


def test_ci_checks_the_statistics_floors_that_pyproject_declares():
    """.ci/min_versions.sh installs exactly pyproject's floors for the statistics path."""
    script = (REPO / ".ci" / "min_versions.sh").read_text()
    pinned = dict(re.findall(r'"([a-z]+)==([0-9.]+)\.\*"', script))
    declared = floors()
    for name in ("numpy", "scipy", "pandas", "zstandard", "tabulate", "matplotlib"):
        assert pinned[name] == declared[name], f"{name}: CI tests {pinned[name]}, pyproject says >={declared[name]}"


def test_postgres_driver_is_an_extra_not_a_dependency():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert not any(d.startswith("psycopg") for d in project["dependencies"])
    assert any(d.startswith("psycopg") for d in project["optional-dependencies"]["postgres"])


@pytest.mark.slow
def test_wheel_holds_only_modbench_and_its_studies(tmp_path):
    """A non-editable install: the wheel has one top-level package and works from anywhere."""
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                            "-w", str(tmp_path / "dist"), str(REPO)], capture_output=True, text=True)
    assert build.returncode == 0, build.stderr[-2000:]
    wheel = next((tmp_path / "dist").glob("modbench-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    assert {n.split("/")[0] for n in names} == {"modbench", wheel.name.split("-py3")[0] + ".dist-info"}
    assert "modbench/studies/quick.toml" in names and "modbench/variants/__init__.py" in names
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    code = ("import importlib.util as u, modbench.variants, modbench.cli.main; "
            "assert u.find_spec('harness') is None and u.find_spec('variants') is None; "
            "import modbench; print(modbench.__file__); "
            "from modbench.track.provenance import git_sha; print(git_sha())")
    # PYTHONPATH puts the unpacked wheel ahead of the development install's finder.
    ran = subprocess.run([sys.executable, "-c", code], cwd=outside, capture_output=True, text=True,
                         env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"})
    assert ran.returncode == 0, ran.stderr[-2000:]
    location, sha = ran.stdout.split()
    assert location.startswith(str(site))
    # Outside any checkout, runs still name the commit the wheel was built from.
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    assert head and sha.removesuffix("-dirty") == head

    # The user's path after `pip install modbench`, in an empty directory: the commands, the shipped
    # studies by name, a study run and its report, all from the installed wheel alone.
    env = {"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path / "home")}

    def modbench(*args: str) -> subprocess.CompletedProcess:
        done = subprocess.run([sys.executable, "-m", "modbench.cli", *args], cwd=outside, env=env,
                              capture_output=True, text=True)
        assert done.returncode == 0, (args, done.stderr[-2000:])
        return done

    from modbench import __version__

    assert modbench("--version").stdout.strip() == f"modbench {__version__}"
    assert {"quick", "smoke", "paper_claims"} <= {row["study"] for row in json.loads(modbench("study", "list", "--json").stdout)}
    assert 'name = "quick"' in modbench("study", "show", "quick").stdout
    assert json.loads(modbench("study", "run", "smoke", "--quiet").stdout)["trials"] == {"COMPLETE": 4}
    quiet = modbench("report", "smoke", "--quiet")
    assert json.loads(quiet.stdout) == {"report": "reports/smoke/report.md"} and quiet.stderr == "", quiet.stderr[-500:]
    report = (outside / "reports" / "smoke" / "report.md").read_text()
    assert "4 complete of 4 planned" in report and str(tmp_path) not in report

    # A tracked training run from the command line: the tracker process modbench starts before
    # it imports torch (modbench.track.background) writes the run.
    trained = json.loads(modbench("train", "--dataset", "arithmetic", "--depth", "2", "--n-embd", "32", "--head-dim",
                                  "16", "--max-seq-len", "32", "--seq-len", "32", "--batch-size", "4", "--eval-windows",
                                  "2", "--budget", "steps=3", "--track", "--run-name", "cli", "--quiet").stdout)
    check = (f"from mlflow.tracking import MlflowClient; r = MlflowClient('sqlite:///{outside}/mlflow.db')"
             f".get_run('{trained['run_id']}'); print(r.info.status, r.data.params['train.run_name'])")
    ran = subprocess.run([sys.executable, "-c", check], cwd=outside, env=env, capture_output=True, text=True)
    assert ran.stdout.split() == ["FINISHED", "cli"], ran.stderr[-2000:]
