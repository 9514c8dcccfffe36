"""The CLI as a new user meets it: version, shipped studies by name, pipes."""

from __future__ import annotations

import json
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
