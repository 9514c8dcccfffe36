"""Reports generated end to end from tiny real studies, including degenerate ones."""

import re
from pathlib import Path

import pytest

import modbench.study.runner as study_mod
from modbench.cli.main import main
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
    assert {"curves.png", "pareto_flops.png", "pareto_speed.png", "throughput.png", "routing_positions.png",
            "routing_heatmap.png"} <= set(links(text))
    from test_figures import assert_200_dpi_with_pdf

    for png in out.glob("*.png"):  # every figure, the routing heatmap redrawn from its checkpoint too
        assert_200_dpi_with_pdf(png)
    env = text.split("## Environment", 1)[1].split("## Reproduce", 1)[0]
    assert "git sha (trials)" in env and "numpy (report)" in env and "matplotlib (report)" in env
    for csv in ("trials.csv", "arms.csv", "comparisons.csv", "curves.csv"):
        assert (out / csv).is_file()
    assert "nan" not in text.lower()
    # A study without claims still opens with the first question answered (issue "As a user"): each
    # routed arm − its dense on test causal bpb, with a CI, before any table.
    opening = text.split("## ", 1)[0]
    for arm in ("sigmoid", "norm"):
        assert re.search(rf"\*\*{arm}[^*]*\*\* − dense[^:]*: Δ test causal bpb = [+−]\d\.\d{{3}}, 95 % CI \[", opening), arm
    import json

    summary = json.loads((out / "summary.json").read_text())
    assert len(summary["versus_dense"]) == 2 and summary["provenance"]["study_file_sha256"]
    assert summary["provenance"]["trials_git_sha"] and summary["provenance"]["packages_report"]["pandas"]
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

    from modbench.report.render import throughput_caveat as _throughput_caveat

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


# --- the dense isoFLOP profile: each size at its best LR, a CI from the fit's residuals -------------
def _planted(sizes, sd=0.01, seed=0, u_star=5.0):
    import numpy as np
    import pandas as pd

    rng = np.random.default_rng(seed)
    return pd.DataFrame([dict(family="dense", budget=1e12, params=10**u, seed=s,
                              loss=2.0 + 0.4 * (u - u_star) ** 2 + rng.normal(0, sd)) for u in sizes for s in (0, 1)])


def test_a_fit_through_three_sizes_is_flagged_exact_with_no_ci():
    import numpy as np

    from modbench.report.isoflop import fit_profile

    fit = fit_profile(_planted((4.5, 5.0, 5.5)), "dense", 1e12)
    assert fit.df == 0 and fit.inside and "exact fit (0 residual df)" in fit.note
    assert np.isnan(fit.opt_low) and np.isnan(fit.loss_low) and np.isnan(fit.loss_se)


def test_the_optimum_loss_ci_is_the_ols_prediction_interval_at_the_vertex():
    """At the vertex the delta method's gradient of c − b²/4a is (u*², u*, 1): its SE must equal the
    standard error of the fitted mean there (statsmodels OLS), with a t quantile at the residual df."""
    import numpy as np
    import statsmodels.api as sm
    from scipy import stats

    from modbench.report.isoflop import fit_profile

    points = _planted((4.2, 4.6, 5.0, 5.4, 5.8), sd=0.03, seed=4)
    fit = fit_profile(points, "dense", 1e12)
    means = points.groupby("params")["loss"].mean()
    u = np.log10(means.index.to_numpy())
    ols = sm.OLS(means.to_numpy(), np.column_stack([u**2, u, np.ones_like(u)])).fit()
    u_opt = np.log10(fit.opt_params)
    pred = ols.get_prediction(np.array([[u_opt**2, u_opt, 1.0]]))
    assert fit.df == 2 and fit.loss_se == pytest.approx(float(pred.se_mean[0]), rel=1e-9)
    assert fit.loss_high - fit.opt_loss == pytest.approx(stats.t.ppf(0.975, 2) * fit.loss_se, rel=1e-9)


def test_the_optimum_ci_covers_the_planted_optimum_at_about_its_level():
    import numpy as np

    from modbench.report.isoflop import fit_profile

    covered = [fit.opt_low < 10**5.0 < fit.opt_high
               for fit in (fit_profile(_planted((4.0, 4.5, 5.0, 5.5, 6.0, 6.5), sd=0.02, seed=s), "dense", 1e12)
                           for s in range(300))]
    assert 0.9 <= np.mean(covered) <= 0.99


def test_each_size_is_taken_at_its_best_lr_on_the_tuning_seed_and_bracketing_is_reported():
    import pandas as pd

    from modbench.report.isoflop import best_lr_points

    rows = []
    for params, best in ((1e4, 2.0), (1e5, 4.0)):
        for lr in (1.0, 2.0, 4.0):
            # on the tuning seed (0) ``best`` wins; on seed 1 (confirmation, best LR only) it is worse
            rows.append(dict(family="dense", budget=1e12, params=params, lr_mult=lr, seed=0, loss=3.0 - (lr == best)))
        rows.append(dict(family="dense", budget=1e12, params=params, lr_mult=best, seed=1, loss=5.0))
    best_rows, table = best_lr_points(pd.DataFrame(rows), tuning_seed=0)
    by = table.set_index("params")
    assert by.loc[1e4, "best lr_mult"] == 2.0 and by.loc[1e4, "bracketed"]
    assert by.loc[1e5, "best lr_mult"] == 4.0 and not by.loc[1e5, "bracketed"]  # the top of its grid
    assert by.loc[1e4, "lr grid"] == "1, 2, 4" and by.loc[1e4, "seeds at best"] == 2
    assert set(zip(best_rows["params"], best_rows["lr_mult"])) == {(1e4, 2.0), (1e5, 4.0)}


def test_the_best_dense_model_is_chosen_on_the_tuning_seed_at_the_studys_budget_only():
    """As the study chose C1's reference: every size on the tuning seed. A size confirmed on five
    seeds (mean 2.245, 2.215 on seed 0) beats a size run on seed 0 only (2.217); comparing the
    first's five-seed mean with the second's one seed named the wrong best model (the paper_claims
    report of 2026-11-26 did). A positive control at another budget and the same size stays out."""
    import pandas as pd

    from modbench.report.isoflop import dense_reference

    rows = [dict(family="dense", budget=7e12, params=3.3e5, arm="L3 d96", lr_mult=2.0, seed=s, loss=v)
            for s, v in enumerate((2.215, 2.237, 2.271, 2.249, 2.253))]
    rows += [dict(family="dense", budget=7e12, params=2.3e5, arm="L3 d80", lr_mult=4.0, seed=0, loss=2.217)]
    rows += [dict(family="dense", budget=5.75e12, params=3.3e5, arm="control", lr_mult=2.0, seed=s, loss=2.34)
             for s in range(4)]
    dense, compared, best = dense_reference(pd.DataFrame(rows), 7e12, tuning_seed=0, family="dense")
    assert best == "L3 d96"
    assert set(compared["seed"]) == {0} and set(dense["budget"]) == {7e12} and "control" not in set(dense["arm"])
    assert dense_reference(pd.DataFrame(rows), 7e12, tuning_seed=None, family="dense")[2] == "L3 d80"  # untuned: seed means


# --- the report's first lines --------------------------------------------------------------------
def test_one_plain_sentence_per_claim_names_both_arms_and_the_margin():
    from dataclasses import dataclass

    import pandas as pd

    from modbench.report.render import claim_sentence

    @dataclass(frozen=True)
    class C:
        id: str
        verdict: str
        estimate: float | None
        ci_low: float | None
        ci_high: float | None
        n_seeds: int
        verdict_class: str | None = None
        margin: float | None = None

    effects = pd.DataFrame([dict(claim="C1", arm="sigmoid lr×2", reference="dense lr×2 L3"),
                            dict(claim="C4", arm="norm", reference="sigmoid"),
                            dict(claim="C4", arm="pmod", reference="sigmoid")])
    tie = C("C1", "equivalent within ±0.05 bpb", -0.01, -0.04, 0.02, 8, "equivalent", 0.05)
    assert claim_sentence(tie, effects) == ("**C1**: sigmoid lr×2 ties dense lr×2 L3 within ±0.05 bpb on test causal bpb "
                                            "(Δ = \u22120.010 bpb, 95 % CI [\u22120.040, +0.020], 8 seeds).")
    # the verdict sentence carries the decode cost of the pair (issue "Best against best", item 6)
    costs = pd.DataFrame([{"arm": "sigmoid lr×2", "reference": "dense lr×2 L3", "decode cost ratio": 1.25,
                           "decode FLOPs/token (arm)": 9.9e5, "decode FLOPs/token (reference)": 7.9e5,
                           "train FLOPs/token ratio": 1.29}])
    assert claim_sentence(tie, effects, costs).endswith(
        "8 seeds). It decodes at 1.25× the reference's FLOPs per token (9.9e+05 vs 7.9e+05) and trains at 1.29× its "
        "FLOPs per token.")
    worse = C("C4b", "reversed", 0.2, 0.1, 0.3, 3, "worse")
    assert claim_sentence(worse, effects).startswith("**C4b**: pmod is worse than sigmoid")  # C4b: the family's 2nd row
    before = C("C3a", "supported: the causal rule agrees with top-k above chance", 0.15, 0.12, 0.19, 3)
    assert claim_sentence(before, effects) == ("**C3a**: supported: the causal rule agrees with top-k above chance "
                                               "(estimate +0.150, 95 % CI [+0.120, +0.190], 3 seeds).")


def test_compute_and_wall_time_come_from_the_trials_timestamps():
    import pandas as pd

    from modbench.report.render import compute_line
    from modbench.report.sections import compute_summary

    t0 = pd.Timestamp("2026-01-01 10:00:00")
    trials = pd.DataFrame({"state": ["COMPLETE", "COMPLETE", "FAIL"], "perf/total_flops": [7e12, 7e12, None],
                           "started": [t0, t0, t0 + pd.Timedelta(minutes=5)],
                           "finished": [t0 + pd.Timedelta(minutes=10), t0 + pd.Timedelta(minutes=20),
                                        t0 + pd.Timedelta(minutes=6)]})
    c = compute_summary(trials)
    assert c == {"trials": 3, "complete": 2, "train_flops": 1.4e13, "trial_s": 31 * 60.0, "wall_s": 20 * 60.0,
                 "slot_calls": []}
    assert "1.4e+13 training FLOPs" in compute_line(c) and "20.0 min of wall time" in compute_line(c)
    assert "slot call" not in compute_line(c)


def test_a_slot_studys_compute_line_names_each_call_its_device_workers_and_probe():
    import pandas as pd

    from modbench.report.render import compute_line
    from modbench.report.sections import compute_summary
    from modbench.study.slot import call_summary

    probe = {"arm": "sigmoid C=0.125 alternate L8", "budget": "flops=5e+14", "candidates": [4, 8], "chosen": 6,
             "settings": [{"workers": 4, "trials": 4, "trials_per_min": 10.2, "peak_mem_gib": 9.6, "status": "ok",
                           "reasons": [], "asked": None},
                          {"workers": 6, "trials": 6, "trials_per_min": 13.9, "peak_mem_gib": 9.7, "status": "ok",
                           "reasons": [], "asked": {"workers": 8, "why": "8 × 10.4 GiB would exceed 90 %"}}]}
    manifest_calls = [
        {"device": "NVIDIA H100 80GB HBM3", "minutes": 8.5, "wall_s": 505.2, "workers": 6, "probe": probe,
         "worker_exit_codes": [0] * 6, "git_sha": "abc"},
        {"device": "NVIDIA H100 80GB HBM3", "minutes": 8.5, "wall_s": 300.0, "workers": 6,
         "probe": {"reused": "2026-11-28T01:00:00Z", "chosen": 6}},
        {"device": "NVIDIA H200", "minutes": 4.0, "workers": 1,
         "probe": {"failed": "OSError: /root/tmp/x.pt: no space left", "candidates": [4, 8], "chosen": 1}}]
    calls = [call_summary(c) for c in manifest_calls]
    assert "/root" not in repr(calls) and "worker_exit_codes" not in repr(calls)  # what the study attr keeps
    trials = pd.DataFrame({"state": ["COMPLETE"]})
    line = compute_line(compute_summary(trials, calls))
    assert "It ran in 3 slot calls" in line
    assert ("NVIDIA H100 80GB HBM3, 8.5 min bound, 8.4 min used, 6 workers (chosen by a probe on the heaviest arm, "
            "trials/min by workers: 4: 10.20, 6 for 8: 13.90; at most 9.7 GiB reserved a worker)") in line
    assert "5.0 min used, 6 workers (an earlier call's probe on this device)" in line
    assert "NVIDIA H200, 4 min bound, 1 worker (the probe failed: the fallback count)" in line


def test_a_dirty_or_mixed_git_sha_is_said_plainly():
    from modbench.report.build import git_sha_line

    assert git_sha_line(["abc123", "abc123"]) == "abc123"
    assert "uncommitted changes" in git_sha_line(["abc123-dirty"])
    assert "2 different commits" in git_sha_line(["abc123", "def456"])


def test_the_tuning_table_names_every_unbracketed_family():
    import pandas as pd

    from modbench.report.render import tuning_lines

    table = pd.DataFrame([dict(family="sigmoid C=0.125", grid="1, 2, 4", best_lr_mult=2.0, bracketed=True),
                          dict(family="dense L3", grid="1, 2, 4, 8, 16", best_lr_mult=16.0, bracketed=False),
                          dict(family="random_gated C=0.125", grid="", best_lr_mult=None, bracketed=None)])
    text = "\n".join(tuning_lines(table))
    assert "Unbracketed (best value at an edge of what was tried): dense L3." in text
    assert "| **no** " in text and "| yes " in text
    assert tuning_lines(pd.DataFrame()) == []


def test_a_size_is_its_architecture_and_a_recursive_model_never_enters_the_dense_profile():
    """recursion_vs_routing's dense middle_cycle N_R=3 has the parameters of the param-matched
    L3 d160 (922,720); the isoFLOP profile grouped sizes by parameter count and labelled every dense
    model "dense", so the recursive model was averaged into L3 d160 and the profile's optimum was an
    artefact (issue "Best against best"). Each architecture is its own size, and the recursive dense
    model is a family of its own."""
    import pandas as pd

    from modbench.design.arm import Arm
    from modbench.design.controls import study_arms
    from modbench.design.study_file import load_study
    from modbench.report.sections import profile_points
    from modbench.report.collect import ReportData
    from modbench.report.isoflop import best_lr_points

    study = load_study("recursion_vs_routing")
    arms = {study.label(a): a for a in study_arms(study)}
    recursive = next(a for a in arms.values() if a.variant == "dense" and a.recursion != "none")
    twin = next(a for a in arms.values() if a.control.startswith("param-matched"))
    vanilla = next(a for a in arms.values() if a.variant == "dense" and not a.control and a.recursion == "none")
    small = Arm("dense", depth=2, budget=study.base.train.budget)
    losses = {recursive: 2.30, twin: 2.60, vanilla: 2.50, small: 2.70}
    rows = []
    for arm, loss in losses.items():
        for lr in (1.0, 2.0):
            rows.append({**arm.to_dict(), "lr_mult": lr, "seed": 0, "arm": study.label(arm),
                         "val/causal_bpb": loss + (0.1 if lr == 2.0 else 0.0), "steps": 10})
    done = pd.DataFrame(rows)
    data = ReportData(study, "", pd.DataFrame(), done, pd.DataFrame())
    points = profile_points(data)
    families = points.groupby("arm")["family"].first()
    assert families[study.label(recursive)] == "dense middle_cycle N_R=3"
    assert set(families[[study.label(twin), study.label(vanilla), study.label(small)]]) == {"dense"}
    best, sizes = best_lr_points(points, tuning_seed=0)
    dense = sizes[sizes["family"] == "dense"]
    assert sorted(dense["size"]) == ["L2 d64", "L3 d160", "L5 d160"]
    # the recursive model's params equal the twin's, yet the twin's size holds the twin's loss alone
    params = points.groupby("arm")["params"].first()
    assert params[study.label(recursive)] == params[study.label(twin)]
    twin_rows = best[(best["family"] == "dense") & (best["size"] == "L3 d160")]
    assert twin_rows["loss"].tolist() == [2.60]
