"""A report is computed, then rendered, and re-rendered from the data it saved (issue "The study wing
gets a home", item 3): with the stores gone, ``modbench report STUDY --from-data DIR`` writes the same
report.md (apart from its Environment and Reproduce sections), summary.json, CSVs and figures; and
the claims say when their two sides were searched unequally, flag a bracket that rests on a collapsed
router, and show what a contrast holds equal (issue "Best against best", items 2, 5 and 7)."""

import json
import shutil
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest

from modbench.cli.main import main
from modbench.report.claims import Claim

STUDY = """
[study]
name = "rr"
description = "re-render: a tuned claims study with two sizes per family"
seeds = [0, 1, 2]
sampler = "grid"
objectives = ["val/causal_bpb"]
claims = ["mod_vs_best_dense", "learned_vs_random"]

[model]
depth = 2
n_embd = 32
head_dim = 16
max_seq_len = 32

[train]
dataset = "stdlib"
seq_len = 32
batch_size = 4
budget = "flops=3e8"
eval_every = 3
eval_windows = 4
log_every = 3

[tune]
lr_mult = [1, 2]
seed = 0
min_lr_mult = 1
max_lr_mult = 2

[claims.mod_vs_best_dense]
margin = 0.05
primary = "sigmoid"
tie_break = "decode_flops"

[claims.learned_vs_random]
primary = "sigmoid"

[space]
variant = ["dense", "sigmoid", "random_gated"]
capacity = [0.25]
pattern = ["alternate"]

[[space.also]]
variant = ["dense"]
depth = [3]
"""

SECTIONS_THAT_MAY_DIFFER = ("## Environment", "## Reproduce")


def _body(text: str) -> str:
    """report.md without the sections a re-render may change (the machine, the command)."""
    return text[:min(text.index(s) for s in SECTIONS_THAT_MAY_DIFFER)]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """A tiny tuned study, run and reported once; its stores then deleted."""
    root = tmp_path_factory.mktemp("rerender")
    import os

    old = os.getcwd()
    os.chdir(root)
    try:
        (root / "rr.toml").write_text(STUDY)
        assert main(["study", "run", "rr.toml", "--quiet"]) == 0
        assert main(["report", "rr.toml", "--quiet"]) == 0
        shutil.rmtree(root / "runs")
        for store in root.glob("mlflow.db*"):
            store.unlink()
        shutil.rmtree(root / "mlartifacts", ignore_errors=True)
    finally:
        os.chdir(old)
    return root


def test_a_report_re_rendered_from_its_saved_data_is_the_same_report(built, monkeypatch):
    monkeypatch.chdir(built)
    first = built / "reports" / "rr"
    assert main(["report", "rr.toml", "--from-data", "reports/rr", "--reports-dir", "again", "--quiet"]) == 0
    again = built / "again" / "rr"
    assert not (built / "runs").exists() and not (built / "mlflow.db").exists()  # no store was needed, none created
    assert _body((again / "report.md").read_text()) == _body((first / "report.md").read_text())
    assert (again / "summary.json").read_bytes() == (first / "summary.json").read_bytes()
    for table in sorted(first.glob("*.csv")):
        assert (again / table.name).read_bytes() == table.read_bytes(), table.name
    figures = sorted(p.name for p in first.glob("*.png"))
    assert figures and figures == sorted(p.name for p in again.glob("*.png"))
    assert "## Routing" in (again / "report.md").read_text() and (again / "routing_heatmap.png").is_file()
    reproduce = (again / "report.md").read_text().split("## Reproduce")[1]
    assert "modbench study run rr.toml" in reproduce and "--from-data reports/rr" in reproduce


def test_a_re_render_from_elsewhere_writes_no_machine_path(built, tmp_path, monkeypatch):
    """The folders given by absolute paths outside the working directory: the Reproduce block names
    them by their last component, as every command a report prints (a report travels)."""
    monkeypatch.chdir(built)
    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(built / "reports" / "rr", elsewhere / "rr")
    out = tmp_path / "out"
    assert main(["report", "rr.toml", "--from-data", str(elsewhere / "rr"), "--reports-dir", str(out), "--quiet"]) == 0
    text = (out / "rr" / "report.md").read_text()
    assert str(tmp_path) not in text
    assert "modbench report rr.toml --from-data rr --reports-dir out" in text.split("## Reproduce")[1]


def test_the_saved_data_holds_the_study_file_and_no_secret_or_machine_path(built):
    data = built / "reports" / "rr" / "data"
    assert (data / "study.toml").read_text() == STUDY
    store = json.loads((data / "store.json").read_text())
    assert store["attrs"]["preregistered"]["claims"]["mod_vs_best_dense"]["margin"] == 0.05
    assert str(built) not in (data / "store.json").read_text()
    assert set(store["tags"]) <= {"device", "git_sha", "torch_version", "python_version", "dataset_sha256"}


def test_a_report_that_predates_saved_data_re_renders_and_says_what_is_missing(built, tmp_path, monkeypatch):
    """A committed report written before modbench saved its data has trials.csv, curves.csv and
    summary.json only: it re-renders with its decode costs from summary.json, its environment from
    its report.md, and the routing analysis named as missing (never a traceback)."""
    legacy = tmp_path / "legacy" / "rr"
    shutil.copytree(built / "reports" / "rr", legacy)
    shutil.rmtree(legacy / "data")
    shutil.copy(built / "rr.toml", tmp_path / "rr.toml")
    monkeypatch.chdir(tmp_path)
    assert main(["report", "rr.toml", "--from-data", "legacy/rr", "--reports-dir", "out", "--quiet"]) == 0
    text = (tmp_path / "out" / "rr" / "report.md").read_text()
    assert "not in this report's saved data" in text
    old = (built / "reports" / "rr" / "report.md").read_text()
    device = next(line for line in old.splitlines() if line.startswith("| device"))
    assert device in text  # the environment travelled through the old report.md
    summary = json.loads((tmp_path / "out" / "rr" / "summary.json").read_text())
    assert summary["decode_costs"] == json.loads((built / "reports" / "rr" / "summary.json").read_text())["decode_costs"]


def test_from_data_without_a_report_there_is_one_line_and_exit_2(built, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    shutil.copy(built / "rr.toml", tmp_path / "rr.toml")
    assert main(["report", "rr.toml", "--from-data", "nowhere"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no trials.csv" in err[0] and "Traceback" not in err[0]
    assert not (tmp_path / "reports").exists()


# --- equal search, collapsed brackets, like for like (unit) ----------------------------------------
def _done(rows):
    return pd.DataFrame([{"arm": a, "variant": v, "capacity": c, "pattern": "alternate" if v != "dense" else "-",
                          "depth": d, "lr_mult": lr, "seed": s, "val/causal_fraction": share}
                         for a, v, c, d, lr, s, share in rows])


def test_a_claim_whose_sides_were_searched_unequally_says_so_in_its_verdict():
    from modbench.report.sections import search_groups, with_search

    study = SimpleNamespace(label=lambda arm: f"{arm.variant} L{arm.depth or 2}" + (f" lr×{arm.lr_mult:g}" if arm.lr_mult != 1 else ""))
    done = _done([("dense L2", "dense", 1.0, 2, 1.0, 0, 1.0), ("dense L3", "dense", 1.0, 3, 1.0, 0, 1.0),
                  ("sigmoid L2", "sigmoid", 0.25, 2, 1.0, 0, 0.25)])
    tuning = pd.DataFrame({"family": ["dense L2", "dense L3", "sigmoid L2"], "grid": ["1, 2", "1, 2, 4", "1, 2"]})
    searches = search_groups(tuning, done, study)
    assert searches["dense"]["sizes"] == 2 and searches["dense"]["lr_runs"] == 5
    assert searches["sigmoid C=0.25"] == {"sizes": 1, "lr_runs": 2, "families": ["sigmoid L2"]}
    rows = pd.DataFrame([{"arm": "sigmoid L2", "reference": "dense L3"}])
    claim = Claim("C1", "s", "equivalent within ±0.05 bpb", 0.0, -0.01, 0.01, 3, verdict_class="equivalent")
    said = with_search(claim, rows, searches, done)
    assert "searched unequally" in said.verdict and "dense over 2 sizes (5 learning-rate runs)" in said.caveat
    equal = {"dense": {"sizes": 1, "lr_runs": 2}, "sigmoid C=0.25": {"sizes": 1, "lr_runs": 2}}
    assert with_search(claim, rows, equal, done) == claim  # the same search: nothing to say


def test_a_best_value_bracketed_only_by_a_collapsed_router_is_flagged():
    """methods_shootout's token_choice lr×2 was bracketed above by an lr×4 run whose router processed
    0.2 % of tokens (issue "Best against best"): that side says the router broke, not that lr×4 is worse."""
    from modbench.design.study_file import load_study
    from modbench.report.collect import row_arm
    from modbench.report.sections import flag_collapsed_runs

    study = load_study("methods_shootout")
    done = _done([("tc", "token_choice", 0.125, None, 1.0, 0, 0.12), ("tc lr×2", "token_choice", 0.125, None, 2.0, 0, 0.13),
                  ("tc lr×4", "token_choice", 0.125, None, 4.0, 0, 0.0017)]).drop(columns="depth")
    done["budget"] = study.base.train.budget
    family = study.label(row_arm(done.iloc[0]).family)
    tuning = pd.DataFrame({"family": [family], "grid": ["1, 2, 4"], "best_lr_mult": [2.0]})
    out = flag_collapsed_runs(tuning, done, study)
    assert out.loc[0, "collapsed_bracket"] and out.loc[0, "collapsed"].startswith("lr×4: realised share 0.0017")
    healthy = done.assign(**{"val/causal_fraction": [0.12, 0.13, 0.11]})
    assert not flag_collapsed_runs(tuning, healthy, study).loc[0, "collapsed_bracket"]
    best_is_broken = tuning.assign(best_lr_mult=[4.0])  # a collapsed best brackets nothing
    assert not flag_collapsed_runs(best_is_broken, done, study).loc[0, "collapsed_bracket"]


def test_equal_tokens_reads_the_longer_run_at_the_shorter_runs_last_token_count():
    from modbench.report.sections import _equal_flops_and_tokens

    curves = pd.DataFrame(
        [{"arm": "mod", "seed": s, "tokens": t, "val/bpb": v} for s in (1, 2) for t, v in ((100, 3.0), (200, 2.0), (300, 1.5))]
        + [{"arm": "dense", "seed": s, "tokens": t, "val/bpb": v} for s in (1, 2) for t, v in ((75, 3.0), (150, 2.4))])
    at_end, at_tokens = _equal_flops_and_tokens(curves, "mod", "dense")
    assert at_end == pytest.approx([1.5 - 2.4] * 2)
    assert at_tokens == pytest.approx([np.interp(150, [100, 200, 300], [3.0, 2.0, 1.5]) - 2.4] * 2)  # 2.5 − 2.4


def test_a_study_that_decides_nothing_says_why_and_what_would_and_names_a_random_best_arm():
    """methods_shootout decided none of its contrasts and random routing scored its best arm, and its
    report said neither (issue "Best against best")."""
    from modbench.report.render import decision_lines
    from modbench.report.sections import REGIME_NOT_REACHED, decision_summary

    arms = pd.DataFrame({"arm": ["random_gated C=0.125", "sigmoid C=0.125"], "variant": ["random_gated", "sigmoid"],
                         "causal_bpb": [2.58, 2.60]})
    effects = pd.DataFrame([{"claim_id": "C4a", "claim": "C4", "arm": "a", "reference": "b", "seeds_needed": 27,
                             "verdict_class": "inconclusive"},
                            {"claim_id": "C4b", "claim": "C4", "arm": "c", "reference": "b", "seeds_needed": 662,
                             "verdict_class": "inconclusive"}])
    claims = [Claim("C4a", "s", "v", 0.03, -0.2, 0.3, 3, verdict_class="inconclusive"),
              Claim("C4b", "s", "v", 0.01, -0.1, 0.1, 3, verdict_class=REGIME_NOT_REACHED)]
    d = decision_summary(claims, effects, arms)
    assert d["decided"] == [] and d["regime_not_reached"] == ["C4b"] and d["seeds_needed"] == [27, 662]
    text = " ".join(decision_lines(d, True))
    assert "decides none of its claims" in text and "27–662 seeds per arm" in text and "larger FLOP budget" in text
    assert "random control, **random_gated C=0.125**" in text
    decided = [Claim("C1", "s", "v", -0.1, -0.2, -0.05, 8, verdict_class="better")]
    assert decision_lines(decision_summary(decided, effects, arms.iloc[::-1].assign(causal_bpb=[2.5, 2.6])), True) == []


def test_the_regime_line_says_when_only_arms_outside_the_claims_fall_short():
    """paper_claims (1.5e13): the compared arms beat the 4-gram while a size at the edge of a sweep
    did not; the report must not call the claims' regime under-trained."""
    from modbench.report.baselines import Baselines
    from modbench.report.render import regime_lines

    base = Baselines(**{**{f: 0.0 for f in Baselines.__dataclass_fields__}, "split": "test", "n_bytes": 65536,
                        "window_fourgram": 2.22, "window_bytes": 65536})
    arms = pd.DataFrame({"arm": ["mod", "dense L3", "dense L4"], "variant": ["sigmoid", "dense", "dense"],
                         "causal_bpb": [1.99, 2.07, 2.23]})
    line = regime_lines(arms, {"test": base}, {"mod", "dense L3"})[0]
    assert line.startswith("Every arm the claims compare beats") and "dense L4 (2.23)" in line and "Under-trained" not in line
    assert regime_lines(arms, {"test": base})[0].startswith("> **Under-trained")  # no claims: every arm counts
