"""Reports generated end to end from tiny real studies, including degenerate ones."""

import re
from pathlib import Path

import pytest

import modbench.study.runner as study_mod
from modbench.cli.main import main
from modbench.errors import ModbenchError
from modbench.run.train import TrainingDiverged

REPO = Path(__file__).resolve().parents[1]
SMOKE = (REPO / "studies" / "smoke.toml").read_text()


def study_file(tmp: Path, name: str, seeds="[0, 1]", variants='["dense", "sigmoid"]') -> Path:
    text = SMOKE.replace('name = "smoke"', f'name = "{name}"').replace("seeds = [0, 1]", f"seeds = {seeds}")
    text = text.replace('variant = ["dense", "sigmoid"]', f"variant = {variants}")
    path = tmp / f"{name}.toml"
    path.write_text(text)
    return path


def links(report: str) -> list[str]:
    return re.findall(r"!\[[^\]]*\]\(([^)]+)\)", report)


def test_report_end_to_end_has_every_section_and_plot(tmp_cwd):
    path = study_file(tmp_cwd, "rep", seeds="[0, 1, 2]", variants='["dense", "sigmoid", "norm"]')
    assert main(["study", "run", str(path), "--quiet"]) == 0
    assert main(["report", str(path)]) == 0
    out = tmp_cwd / "reports" / "rep"
    text = (out / "report.md").read_text()
    for heading in ("## Arms (deployable metric first)", "## Sanity baselines", "## Top-k validation summary by group",
                    "## Arms (validation top-k)", "## Comparisons against dense", "## Validation curves", "## Pareto fronts",
                    "## Throughput", "## Routing", "## Environment", "## Reproduce"):
        assert heading in text, heading
    for link in links(text):
        png = out / link
        assert png.is_file() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", link
    assert {"curves.png", "pareto_flops.png", "pareto_speed.png", "throughput.png", "routing_positions.png"} <= set(links(text))
    for csv in ("trials.csv", "arms.csv", "comparisons.csv", "curves.csv"):
        assert (out / csv).is_file()
    assert "nan" not in text.lower()
    assert "Holm" in text and "Hedges" in text
    # the summary's sentences come from the statistics: both routed arms are compared with dense
    assert text.count("than dense") >= 2
    assert "| arm " in text and "|:--" in text  # markdown tables from pandas.to_markdown
    assert "modbench study run rep.toml" in text and str(tmp_cwd) not in text  # portable: no machine paths
    # the report is also an artifact of the study's MLflow parent run
    from mlflow.tracking import MlflowClient

    from modbench.track.optuna_store import parent_run_id

    parent = parent_run_id("rep", f"sqlite:///{tmp_cwd}/runs/studies/rep/optuna.db")
    logged = {f.path for f in MlflowClient(f"sqlite:///{tmp_cwd}/mlflow.db").list_artifacts(parent, "report")}
    assert {"report/report.md", "report/summary.json", "report/curves.png", "report/trials.csv"} <= logged


def test_one_seed_per_arm_is_reported_not_tested(tmp_cwd):
    path = study_file(tmp_cwd, "oneseed", seeds="[0]")
    assert main(["study", "run", str(path), "--quiet"]) == 0
    assert main(["report", str(path)]) == 0
    text = (tmp_cwd / "reports" / "oneseed" / "report.md").read_text()
    assert "no test possible" in text or "fewer than two successful seeds" in text
    assert "nan" not in text.lower()


def test_failed_arm_and_missing_dense_baseline(tmp_cwd, monkeypatch):
    real_train = study_mod.train

    def flaky(cfg, **kw):
        if cfg.routing.variant == "norm":
            raise TrainingDiverged("training loss became nan at step 3")
        return real_train(cfg, **kw)

    monkeypatch.setattr(study_mod, "train", flaky)
    path = study_file(tmp_cwd, "nodense", variants='["sigmoid", "norm"]')
    assert main(["study", "run", str(path), "--quiet"]) == 0
    assert main(["report", str(path)]) == 0
    text = (tmp_cwd / "reports" / "nodense" / "report.md").read_text()
    assert "no dense baseline" in text
    assert "2 fail" in text  # the trial count line reports the failed arm's trials
    failed = text.split("## Arms with no finished trial", 1)[1].split("\n## ", 1)[0]
    assert re.search(r"norm C=0.25 alternate\s*\|\s*2\s*\|", failed), failed
    assert "training loss became nan at step 3" in failed  # the reason, from the trial
    assert "nan" not in text.lower().replace("became nan", "")


def test_report_of_a_partial_study(tmp_cwd):
    path = study_file(tmp_cwd, "empty")
    assert main(["study", "run", str(path), "--n-trials", "1", "--quiet"]) == 0
    # one of four trials done: still a valid report
    assert main(["report", str(path)]) == 0


def test_report_of_unknown_study_is_a_clear_error(tmp_cwd, capsys):
    path = study_file(tmp_cwd, "never_ran")
    rc = main(["report", str(path), "--storage", f"sqlite:///{tmp_cwd}/none.db"])
    assert rc == 2 and "no study named 'never_ran'" in capsys.readouterr().err


def test_throughput_caveat_comes_from_the_seed_spread():
    import pandas as pd

    from modbench.report.build import _throughput_caveat

    quiet = pd.DataFrame({"arm": ["dense", "norm C=0.25"], "tokens_per_s_spread": [1.05, 1.2]})
    assert _throughput_caveat(quiet) == []
    busy = pd.DataFrame({"arm": ["dense", "norm C=0.25", "sigmoid C=0.5"], "tokens_per_s_spread": [1.05, 3.4, 1.6]})
    text = " ".join(_throughput_caveat(busy))
    assert "2 of 3 arms" in text and "worst: norm C=0.25, 3.40×" in text and "reports/bench" in text



def test_the_reproduce_line_holds_no_machine_path(tmp_path, monkeypatch):
    """A report travels: the command it prints names no absolute path of the machine that wrote it."""
    from modbench.report import build

    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    monkeypatch.setattr(build.sys, "argv", [
        "modbench", "report", str(tmp_path / "study.toml"), "--reports-dir", str(work / "out"),
        "--storage", f"sqlite:///{work}/runs/optuna.db", "--tracking-uri", f"sqlite:///{tmp_path}/mlflow.db"])
    line = build.command_line()
    assert str(tmp_path) not in line
    assert line == ("modbench report study.toml --reports-dir out --storage sqlite:///runs/optuna.db "
                    "--tracking-uri sqlite:///mlflow.db")


# The registry needs torch, so this lives here and not in test_effects.py (which the
# minimum-versions CI job runs without torch).
def test_every_variant_gets_its_own_colour_and_no_learned_variant_is_grey():
    """One colour per variant in every figure: all registered variants at once stay distinct, and
    grey stays the random controls'."""
    from matplotlib.colors import to_rgb

    from modbench import variants
    from modbench.report.figures import variant_colors

    names = variants.list_variants()
    colors = {v: to_rgb(c) for v, c in variant_colors(names).items()}
    assert set(colors) == set(names) and len(set(colors.values())) == len(names)
    for v, (r, g, b) in colors.items():
        is_grey = max(r, g, b) - min(r, g, b) < 0.05
        assert is_grey == (v == "dense" or v.startswith("random")), v
