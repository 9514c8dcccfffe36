"""The CLI as a new user meets it: version, shipped studies by name, pipes."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys

import pytest

from modbench import __version__
from modbench.cli.main import main


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"modbench {__version__}"


def test_shipped_studies_are_listed_shown_and_run_by_name_from_an_empty_directory(tmp_cwd, capsys):
    assert main(["study", "list", "--json"]) == 0
    names = {row["study"] for row in json.loads(capsys.readouterr().out)}
    assert {"quick", "smoke", "variant_shootout"} <= names
    assert main(["study", "show", "smoke"]) == 0
    assert 'name = "smoke"' in capsys.readouterr().out
    assert main(["study", "run", "smoke", "--quiet"]) == 0  # no study file in this directory
    out = json.loads(capsys.readouterr().out)
    assert out["study"] == "smoke" and out["trials"] == {"COMPLETE": 4}
    assert main(["study", "status", "smoke", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["trials"] == {"COMPLETE": 4}


def test_unknown_study_name_lists_the_shipped_ones(tmp_cwd, capsys):
    assert main(["study", "run", "quik"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("modbench: error: no study file 'quik'") and "'quick'" in err and "\n" not in err


def test_output_into_a_closed_pipe_is_not_a_traceback(tmp_path):
    """`modbench variants --json | head -c 10`: the reader leaves early; no BrokenPipe traceback."""
    proc = subprocess.Popen([sys.executable, "-m", "modbench.cli", "variants", "--json"], cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # like `| true`: the reader is gone before the first write (BrokenPipe certain)
    err = proc.stderr.read().decode()
    proc.wait(timeout=60)
    assert "Traceback" not in err and "BrokenPipe" not in err


def _actions(parser):
    """Every option and positional of ``parser`` and of its subcommands, with the command's name."""
    import argparse

    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                for prog, inner in _actions(sub):
                    yield f"{name} {prog}".strip(), inner
        elif not isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
            yield "", action


def test_every_flag_of_every_command_has_help_text():
    from modbench.cli.main import build_parser

    missing = [f"modbench {prog} {'/'.join(a.option_strings) or a.dest}" for prog, a in _actions(build_parser())
               if not (a.help or "").strip() or (a.help or "").startswith("default:")]
    assert not missing, missing


def test_train_help_states_the_grammars_and_choices(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for needle in ("'steps=N', 'tokens=N', 'flops=X' or 'seconds=S'",  # budgets
                   "'alternate', 'all', 'fixed:S,E', 'every:K' or a string of D/M",  # layer patterns
                   "'constant' or 'log'",  # capacity schedules
                   "auto, cpu, cuda", "bf16 autocast on cuda, float32 on cpu",  # device and precision
                   "stdlib, tinyshakespeare, enwik8, arithmetic"):  # datasets
        assert needle in text, needle


# --- a study's end: its table, its exit code, and hints that work as printed -------------------------

TINY_STUDY = """[study]
name = "tiny"
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
budget = "steps=2"
eval_every = 2
eval_windows = 2
[space]
variant = ["dense", "sigmoid"]
capacity = [0.5]
"""


@pytest.fixture
def tiny_study(tmp_cwd):
    path = tmp_cwd / "tiny.toml"
    path.write_text(TINY_STUDY)
    return path


def test_a_study_whose_every_trial_failed_exits_non_zero_with_each_reason(tiny_study, capsys, monkeypatch):
    from modbench.errors import ModbenchError
    from modbench.study import runner

    def out_of_data(*args, **kwargs):
        raise ModbenchError("the dataset ran out of windows")

    monkeypatch.setattr(runner, "train", out_of_data)
    code = main(["study", "run", "tiny.toml", "--json"])
    out, err = capsys.readouterr()
    assert code == 1
    assert json.loads(out)["trials"] == {"FAIL": 2}  # stdout is still the one JSON document
    assert err.count("failed: the dataset ran out of windows") == 2
    assert err.strip().splitlines()[-1] == ("modbench: error: every trial of study tiny failed (2); the reasons are "
                                            "in the lines above and in 'modbench study status'")


def test_a_trial_that_fails_outside_training_still_says_why(tiny_study, capsys, monkeypatch):
    """A failure after training (reading the objective) carries its reason, never "unknown reason"."""
    from modbench.errors import ModbenchError
    from modbench.study import runner

    def no_objective(*args, **kwargs):
        raise ModbenchError("the run record has no val/bpb")

    monkeypatch.setattr(runner, "objective_values", no_objective)
    assert main(["study", "run", "tiny.toml", "--quiet"]) == 1
    err = capsys.readouterr().err
    assert "unknown reason" not in err and err.count("failed: the run record has no val/bpb") == 2
    assert main(["study", "status", "tiny.toml", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert [r["fail_reason"] for r in rows] == ["the run record has no val/bpb"] * 2


def test_study_run_ends_with_a_per_arm_table_and_a_report_hint_that_works(tiny_study, capsys):
    out_dir = "elsewhere/studies"
    assert main(["study", "run", "tiny.toml", "--tracking-uri", "other.db", "--out-dir", out_dir]) == 0
    out, err = capsys.readouterr()
    assert "{" not in out  # no dict repr of one seed
    assert "filesystem tracking backend" not in err  # other.db is a SQLite store, not MLflow's file store
    table = [line for line in out.splitlines() if line.startswith("|")]
    assert [c.strip() for c in table[0].strip("|").split("|")] == ["arm", "complete", "failed", "val/bpb", "val/causal_bpb"]
    assert any(line.startswith("| dense ") for line in table) and any("sigmoid C=0.5" in line for line in table)
    (hint,) = [line.removeprefix("report: ") for line in out.splitlines() if line.startswith("report: ")]
    assert hint == "modbench report tiny.toml --tracking-uri sqlite:///other.db --out-dir elsewhere/studies"
    assert main(shlex.split(hint)[1:] + ["--quiet"]) == 0  # the hint, run as printed
    assert json.loads(capsys.readouterr().out)["report"] == "reports/tiny/report.md"
    assert not (tiny_study.parent / "mlflow.db").exists() and not (tiny_study.parent / "runs").exists()
    reproduce = (tiny_study.parent / "reports/tiny/report.md").read_text().split("## Reproduce")[1]
    assert "modbench study run tiny.toml --tracking-uri sqlite:///other.db --out-dir elsewhere/studies" in reproduce


def test_a_bare_db_path_is_a_sqlite_store_without_mlflow_s_file_store_notice(tmp_cwd, capsys):
    from modbench.track.store import resolve_tracking_uri

    assert resolve_tracking_uri("other.db") == f"sqlite:///{tmp_cwd.resolve()}/other.db"
    assert resolve_tracking_uri("sqlite:///x.db") == "sqlite:///x.db"
    assert main(["train", "--dataset", "arithmetic", "--budget", "steps=1", "--tracking-uri", "mlruns"]) == 2
    err = capsys.readouterr().err.strip()
    assert "is a folder path, MLflow's retired file store" in err and "\n" not in err


def test_study_list_builds_no_model(monkeypatch, capsys):
    """Listing is instant: the trial counts come from the study files, not from sizing models."""
    from modbench.model import gpt

    def no_model(*args, **kwargs):
        raise AssertionError("study list built a model")

    monkeypatch.setattr(gpt.GPT, "__init__", no_model)
    assert main(["study", "list", "--json"]) == 0
    counts = {row["study"]: row["trials"] for row in json.loads(capsys.readouterr().out)}
    assert counts["smoke"] == 4 and counts["quick"] > 0


@pytest.mark.parametrize("name", ["recursion_vs_routing", "methods_shootout"])
def test_study_list_counts_derived_controls_as_the_runner_will(name):
    from modbench.cli.study import planned_trials
    from modbench.design.study_file import load_study
    from modbench.design.controls import study_arms
    from modbench.study.tuning import plan

    study = load_study(name)
    assert study.settings.controls  # a study with derived controls: the count that sizing decides
    if study.tune.lr_mult:  # a staged study ([tune]): what its first stage queues, the models sized
        assert planned_trials(study) == len(plan(study, [], []).queue)
    else:
        assert planned_trials(study) == len(study_arms(study)) * len(study.settings.seeds)


def test_train_json_prints_exactly_one_json_document(tmp_cwd, capsys):
    assert main(["train", "--dataset", "arithmetic", "--depth", "2", "--n-embd", "16", "--head-dim", "8",
                 "--max-seq-len", "32", "--seq-len", "16", "--batch-size", "2", "--budget", "steps=1",
                 "--eval-windows", "2", "--no-track", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)  # the whole of stdout parses
    assert summary["steps"] == 1
