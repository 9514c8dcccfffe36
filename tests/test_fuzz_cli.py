"""Every command's flags, fuzzed with hypothesis: no input gives a traceback, and every refusal is
one line with exit 2 that never shows a password.

A command that accepts its input would go on to train, run a study, build a report or serve the UI;
those entry points are replaced by a sentinel, so an accepted input ends the example at once.
"""

import contextlib
import io

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import modbench.study.runner as runner_mod
from modbench.cli.main import main

SECRET = "hunter2secret"


class Accepted(Exception):
    """The input passed every check and the command would start its work."""


def _accept(*args, **kwargs):
    raise Accepted


VALUES = st.sampled_from([
    "0", "-1", "1", "3", "0.5", "1e400", "-1e-9", "nan", "inf", "2.5", "4294967296", "9" * 40, "", " ", "x", "é",
    "../../x", "a/b", "sigmoid", "dense", "nrom", "flops=1", "steps=0.5", "tokens=1", "flops=1e12", "seconds=-3",
    "all", "alternate", "fixed:9,9", "every:0", "DDM", "log", "constant", "cpu", "cuda", "tpu", "stdlib", "arithmetic",
    "no/such/file.txt", "aux_weight=2", "aux_weight=x", "bogus=1", "=", "slack=100", "quick", "paper_claims",
    f"postgresql+psycopg://user:{SECRET}@127.0.0.1:1/db", f"http://user:{SECRET}@127.0.0.1:1", "sqlite:///",
])
FLAGS = {
    "train": ["--variant", "--capacity", "--budget", "--depth", "--n-embd", "--n-head", "--head-dim", "--n-layer",
              "--seq-len", "--batch-size", "--grad-accum", "--lr", "--beta1", "--beta2", "--seed", "--pattern",
              "--schedule", "--capacity-first", "--capacity-warmup-steps", "--option", "--dataset", "--device",
              "--experiment", "--run-name", "--eval-windows", "--eval-every", "--system-metrics-s", "--max-seq-len",
              "--vocab-size", "--mlp-ratio", "--weight-decay", "--warmup-frac", "--tracking-uri", "--config"],
    "study run": ["--storage", "--out-dir", "--n-trials", "--heartbeat", "--grace", "--tracking-uri"],
    "study status": ["--storage", "--out-dir"],
    "report": ["--storage", "--out-dir", "--reports-dir", "--tracking-uri"],
    "generate": ["--run", "--prompt", "--max-new-tokens", "--temperature", "--top-k", "--seed", "--batch", "--device",
                 "--tracking-uri"],
    "ui": ["--port", "--host", "--tracking-uri"],
}
POSITIONAL = {"study run": True, "study status": True, "report": True, "ui": False, "train": False, "generate": False}


def argv_for(command: str):
    pairs = st.lists(st.tuples(st.sampled_from(FLAGS[command]), VALUES), max_size=5)
    head = command.split()
    if POSITIONAL[command]:
        return st.tuples(VALUES, pairs).map(lambda p: [*head, p[0], *[x for pair in p[1] for x in pair]])
    return pairs.map(lambda ps: [*head, *[x for pair in ps for x in pair]])


@pytest.fixture
def entry_points_stubbed(tmp_cwd, monkeypatch):
    import modbench.cli.ui as ui_mod
    import modbench.report.build as build_mod
    import modbench.run.train as train_mod

    from modbench.design.study_file import load_study

    def validate_then_accept(study_file, *args, **kwargs):
        load_study(study_file)  # the study file is still validated, as the real command does first
        raise Accepted

    monkeypatch.setattr(train_mod, "train", _accept)
    monkeypatch.setattr(runner_mod, "run_study", validate_then_accept)
    monkeypatch.setattr(build_mod, "build_report", validate_then_accept)
    monkeypatch.setattr(ui_mod, "serve", _accept)  # the MLflow server is never started
    return tmp_cwd


def run_cli(argv: list[str]) -> tuple[int | str, str]:
    err, out = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        try:
            code: int | str = main(argv)
        except Accepted:
            code = "accepted"
    return code, err.getvalue() + out.getvalue()


@pytest.mark.parametrize("command", list(FLAGS))
def test_no_flag_combination_gives_a_traceback_or_shows_a_password(command, entry_points_stubbed):
    seen = set()

    @settings(max_examples=60, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
    @given(argv_for(command))
    def check(argv):
        code, output = run_cli(argv)
        seen.add(code)
        assert "Traceback" not in output, (argv, output)
        assert SECRET not in output, (argv, output)
        assert code in (0, 2, "accepted"), (argv, code, output)
        if code == 2:
            lines = [line for line in output.strip().splitlines() if line.strip()]
            assert len(lines) == 1 and lines[0].startswith("modbench: error: "), (argv, output)

    check()
    assert 2 in seen, "the fuzz never produced a refused input: it tests nothing"
    if command == "train":
        assert "accepted" in seen, "the fuzz never produced an accepted input: the stub is not reached"


@pytest.mark.parametrize("argv", [["train"], ["study", "run", "quick"], ["report", "quick"], ["ui"]])
def test_the_stubs_are_reached_by_valid_input(argv, entry_points_stubbed):
    """So that 'accepted' in the fuzz means what it says."""
    if argv == ["ui"]:
        (entry_points_stubbed / "mlflow.db").touch()  # the UI needs a store to serve
    if argv[0] == "report":  # a report needs the study's trials (it never creates an empty store)
        import optuna

        from modbench.design.study_file import load_study
        from modbench.track.optuna_store import default_storage

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        optuna.create_study(study_name="quick", storage=default_storage(load_study("quick"), "runs/studies"))
        (entry_points_stubbed / "mlflow.db").touch()  # and the MLflow store its runs are in
    assert run_cli(argv)[0] == "accepted"
