"""modbench.study.workers_probe: a CPU dry run of the probe, its one-line errors, and its imports
on a machine without optuna, mlflow, sqlalchemy or statsmodels (the lent GPU machine)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from modbench.study import workers_probe

REPO = Path(__file__).resolve().parents[1]
TINY_SHAKESPEARE = REPO.parent / "shared" / "data" / "tinyshakespeare.txt"  # as tests/conftest.py finds it
ABSENT = ("optuna", "mlflow", "sqlalchemy", "statsmodels")  # not installed on the GPU machine

# A finder that refuses the GPU machine's missing packages, whoever imports them.
BLOCKER = f"""
import importlib.abc, sys
class _Absent(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in {ABSENT!r}:
            raise ImportError(f"{{name}} is not installed on the GPU machine")
        return None
sys.meta_path.insert(0, _Absent())
"""

TINY_STUDY = """
[study]
name = "probe_tiny"
description = "workers_probe dry run: two arms of a tiny model"
seeds = [0]
sampler = "grid"
objectives = ["val_bpb"]

[model]
depth = 2
n_embd = 32
head_dim = 16
max_seq_len = 32

[train]
dataset = {dataset}
seq_len = 32
batch_size = 4
budget = "steps=3"
eval_every = 3
eval_windows = 4
log_every = 3

[space]
variant = ["dense", "sigmoid"]
capacity = [0.25]
pattern = ["alternate"]
"""


def _study(tmp_path: Path) -> Path:
    dataset = str(TINY_SHAKESPEARE) if TINY_SHAKESPEARE.is_file() else "arithmetic"
    path = tmp_path / "probe_tiny.toml"
    path.write_text(TINY_STUDY.format(dataset=json.dumps(dataset)))
    return path


def _blocked_env(tmp_path: Path) -> dict[str, str]:
    """The environment of a process (and of the workers it starts) where ABSENT cannot be imported."""
    site = tmp_path / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(BLOCKER)
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": str(site) + (os.pathsep + path if path else ""), "OMP_NUM_THREADS": "1"}


def _probe(args: list[str], tmp_path: Path, env: dict[str, str] | None = None, timeout: float = 120):
    return subprocess.run([sys.executable, "-m", "modbench.study.workers_probe", *args], capture_output=True,
                          text=True, cwd=tmp_path, env=env, timeout=timeout)


def test_cpu_dry_run_measures_every_setting(tmp_path):
    env = _blocked_env(tmp_path)
    check = subprocess.run([sys.executable, "-c", "import optuna"], capture_output=True, text=True, env=env)
    assert check.returncode != 0 and "not installed on the GPU machine" in check.stderr  # the workers inherit it
    out_json, out_md = tmp_path / "probe.json", tmp_path / "probe.md"
    r = _probe([str(_study(tmp_path)), "--device", "cpu", "--workers", "1,2", "--compile", "off",
                "--trials-per-worker", "1", "--out-dir", str(tmp_path / "runs"), "--timeout-s", "100",
                "--json", str(out_json), "--markdown", str(out_md)], tmp_path, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "Traceback" not in r.stderr

    data = json.loads(out_json.read_text())
    assert data["schema"] == "modbench.workers_probe/1"
    assert data["study"] == "probe_tiny" and data["budget"] == "steps=3" and data["device"] == "cpu"
    assert data["torch_version"] and data["python_version"] and data["device_name"] == "cpu"
    assert [(s["compile"], s["workers"]) for s in data["settings"]] == [("off", 1), ("off", 2)]
    for s in data["settings"]:
        n = s["workers"]
        assert s["status"] == "ok", s["reasons"]
        assert s["trials"] == s["trials_expected"] == n * 1
        assert s["trials_per_min"] > 0 and s["tokens_per_s"] > 0 and s["wall_s"] > 0 and s["median_trial_s"] > 0
        rows = [t for t in data["trials"] if t["workers"] == n and t["compile"] == "off"]
        assert len(rows) == n * 1
        assert sorted(t["worker"] for t in rows) == list(range(n))
        for t in rows:
            assert t["status"] == "ok" and t["seconds"] > 0 and t["tokens"] > 0 and t["steps"] == 3
            assert t["tokens_per_s"] > 0 and t["label"] in data["arms"]
    assert data["settings"][0]["speedup"] == 1.0 and data["settings"][1]["speedup"] > 0
    # with one trial each, worker w trains arm w: both arms ran at N = 2
    assert {t["label"] for t in data["trials"] if t["workers"] == 2} == {"dense", "sigmoid C=0.25 alternate"}
    assert data["best"]["compile"] == "off" and data["best"]["workers"] in (1, 2)

    table = out_md.read_text()
    assert ("| compile | N | trials | wall s | trials/min | aggregate tokens/s | median trial s | speed-up | "
            "peak GiB a worker | status |") in table
    assert "| off | 1 | 1/1 |" in table and "| off | 2 | 2/2 |" in table
    assert table.rstrip().splitlines()[-1].startswith("Highest trials/minute: compile off, N = ")
    assert "| off | 2 | 2/2 |" in r.stdout  # the table is printed too


@pytest.mark.parametrize("flag, value, names", [
    ("--workers", "0", ["--workers", "positive integers"]),
    ("--compile", "maybe", ["--compile", "'off'", "'on'"]),
    ("--arms", "dense;nope", ["--arms", "'nope'", "'sigmoid C=0.25 alternate'"]),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, flag, value, names):
    r = _probe([str(_study(tmp_path)), "--device", "cpu", flag, value], tmp_path, timeout=60)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert all(n in lines[0] for n in names), lines[0]
    assert r.stdout == ""


def test_unknown_study_is_one_line_and_exit_2(tmp_path):
    r = _probe(["no_such_study", "--device", "cpu"], tmp_path, timeout=60)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr
    assert "no_such_study" in r.stderr and "quick" in r.stderr  # names the shipped studies it accepts


def test_imports_without_optuna_mlflow_sqlalchemy_statsmodels():
    code = BLOCKER + f"""
import modbench.study.workers_probe as probe
# what the probe imports lazily: the parent's study loading, the workers' training
import modbench.design.study_file, modbench.design.controls, modbench.model.sizing, modbench.run.train
for name in {ABSENT!r}:
    try:
        __import__(name)
    except ImportError:
        pass
    else:
        raise SystemExit(name + " was importable: the blocker did not work")
leaked = sorted(m for m in sys.modules if m.partition(".")[0] in {ABSENT!r})
print("ok" if not leaked else leaked)
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "ok"


def _setting(n: int, peak: float | None, status: str = "ok", device_gib: float | None = 79.2):
    rows = [{"status": "ok", "peak_mem_gib": peak} for _ in range(n)]
    info = {"device_memory_gib": device_gib} if device_gib else {}
    return workers_probe.SettingResult("off", n, 1, n, rows, 10.0, status, [], info)


@pytest.mark.parametrize("asked, done, expected", [
    (8, [], 8),                                        # nothing measured: run as asked
    (8, [_setting(4, 9.5)], 6),                        # 0.9 × 79.2 GiB = 71.3 GiB holds 6 × 10.25 GiB, not 7
    (8, [_setting(4, 7.0)], 8),                        # 8 × 7.75 = 62 GiB fits
    (8, [_setting(4, 9.5, device_gib=139.7)], 8),      # an H200
    (8, [_setting(1, 20.0)], 3),
    (8, [_setting(4, 9.5, status="failed")], 8),       # only clean settings' peaks count
    (8, [_setting(4, None, device_gib=None)], 8),      # a CPU: no memory figures
    (2, [_setting(1, 60.0)], 1),                       # not even two fit
])
def test_a_worker_count_too_large_for_the_gpu_memory_is_replaced_by_the_most_that_fit(asked, done, expected):
    n, why = workers_probe.fitting_workers(asked, done)
    assert n == expected
    assert (why == "") == (n == asked) and (not why or f"{asked} ×" in why and "GiB" in why)
