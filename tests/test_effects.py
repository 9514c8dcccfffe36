"""Effects and sanity baselines, tested on simulated studies with known answers."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from modbench.errors import ModbenchError
from modbench.report.baselines import KneserNey, compressed_bits_per_byte, sanity_baselines
from modbench.report import effects, stats as report_stats
from modbench.report.effects import (
    agreement,
    compare_effects,
    min_detectable_effect,
    seeds_for_equivalence,
    seeds_for_half_width,
    seeds_needed,
    t_test_power,
    tost_power,
)
from scipy import stats

SHAKESPEARE = Path(__file__).resolve().parents[2] / "shared" / "data" / "tinyshakespeare.txt"
FIXTURES = Path(__file__).resolve().parent / "fixtures"


def study(rng, means: dict[str, float], n: int, sd: float = 0.05, seed_sd: float = 0.0) -> pd.DataFrame:
    """Trials of arms with the given true means; ``seed_sd`` is noise shared by a seed across arms."""
    shared = rng.normal(0, seed_sd, n)
    rows = [dict(arm=arm, seed=s, bpb=mu + shared[s] + rng.normal(0, sd)) for arm, mu in means.items() for s in range(n)]
    return pd.DataFrame(rows)


# --- effects -------------------------------------------------------------------------------
def test_planted_difference_is_found_with_the_right_sign_and_ci():
    rng = np.random.default_rng(0)
    df = study(rng, {"dense": 3.0, "mod": 2.9}, n=12, sd=0.02)
    row = compare_effects(df, "bpb", [("mod", "dense")]).iloc[0]
    assert row.method == "paired by seed (t)"
    assert row.ci_low < -0.1 < row.ci_high < 0
    assert row.p_adj < 0.05 and row.verdict.startswith("mod lower (better)")


@pytest.mark.parametrize("paired", [True, False])
def test_null_differences_give_about_five_percent_false_positives(paired):
    rng = np.random.default_rng(1)
    sims, hits, covered = 400, 0, 0
    for _ in range(sims):
        # Shared seed noise makes an unpaired test conservative, so only the paired case gets it.
        df = study(rng, {"a": 3.0, "b": 3.0}, n=6, seed_sd=0.05 if paired else 0.0)
        row = compare_effects(df, "bpb", [("a", "b")], paired=paired, n_resamples=499).iloc[0]
        hits += row.p_adj < 0.05
        covered += row.ci_low <= 0 <= row.ci_high
    # Binomial(400, 0.05) lies in [9, 32] with probability > 0.999.
    assert 9 <= hits <= 32, hits
    # The t interval is exact; BCa with 6 seeds per arm is known to be somewhat liberal.
    assert covered / sims >= (0.92 if paired else 0.85), covered / sims


def test_pairing_by_seed_removes_shared_seed_noise():
    """With seed noise much larger than the effect, only the paired analysis sees the effect."""
    rng = np.random.default_rng(2)
    df = study(rng, {"dense": 3.0, "mod": 2.98}, n=8, sd=0.005, seed_sd=0.2)
    paired = compare_effects(df, "bpb", [("mod", "dense")]).iloc[0]
    unpaired = compare_effects(df, "bpb", [("mod", "dense")], paired=False).iloc[0]
    assert paired.p_adj < 0.05 <= unpaired.p_adj
    assert paired.mde < unpaired.mde


def test_holm_family_is_the_declared_comparisons():
    rng = np.random.default_rng(3)
    df = study(rng, {"dense": 3.0, "a": 2.97, "b": 3.0, "c": 3.0}, n=5)
    one = compare_effects(df, "bpb", [("a", "dense")]).iloc[0]
    three = compare_effects(df, "bpb", [("a", "dense"), ("b", "dense"), ("c", "dense")])
    assert three.iloc[0].p == pytest.approx(one.p)
    assert three.iloc[0].p_adj >= one.p_adj
    assert three.iloc[0].mde > one.mde  # the family's level alpha / 3 needs a larger effect


def test_dunnett_gives_simultaneous_intervals_against_one_reference():
    rng = np.random.default_rng(4)
    df = study(rng, {"dense": 3.0, "a": 2.9, "b": 3.0}, n=6)
    out = compare_effects(df, "bpb", [("a", "dense"), ("b", "dense")], correction="dunnett")
    assert set(out.method) == {"dunnett (simultaneous CI)"}
    assert out.iloc[0].ci_high < 0 and out.iloc[1].ci_low < 0 < out.iloc[1].ci_high
    with pytest.raises(ModbenchError, match="one shared reference"):
        compare_effects(df, "bpb", [("a", "dense"), ("a", "b")], correction="dunnett")


def test_mde_has_the_stated_power_and_seeds_needed_inverts_it():
    rng = np.random.default_rng(5)
    sd, n = 0.05, 6
    mde = min_detectable_effect(sd, n, n, paired=True, alpha=0.05)
    hits = sum(
        compare_effects(pd.DataFrame(
            [dict(arm="a", seed=s, bpb=mde + rng.normal(0, sd)) for s in range(n)]
            + [dict(arm="b", seed=s, bpb=0.0) for s in range(n)]), "bpb", [("a", "b")]).iloc[0].p_adj < 0.05
        for _ in range(400)
    )
    assert 0.74 <= hits / 400 <= 0.86  # 80 % power, up to the sampling error of 400 runs
    assert seeds_needed(mde, sd, paired=True, alpha=0.05) == n


# --- power: the noncentral t, checked against simulation ---------------------------------------
# nc values include ones where scipy's nct.cdf(-t, df, nc) returned NaN (7.35, 7.7, 8.05, 8.45).
NONCENTRALITIES = np.array([0.0, 1.5, 3.0, 5.0, 7.35, 7.7, 8.05, 8.45, 12.0, 20.0, 30.0])


@pytest.mark.parametrize("df", [1, 2, 3, 4, 7])
def test_t_test_power_matches_monte_carlo(df):
    """Two-sided t test power = P(|T| > t_crit), T = (Z + nc) / sqrt(V / df): 2e5 draws per df."""
    rng = np.random.default_rng(100 + df)
    z, v = rng.standard_normal(200_000), rng.chisquare(df, 200_000)
    t = (z[None, :] + NONCENTRALITIES[:, None]) / np.sqrt(v / df)[None, :]
    for alpha in (0.05, 0.0125, 0.00625):
        simulated = (np.abs(t) > stats.t.ppf(1 - alpha / 2, df)).mean(axis=1)
        computed = np.array([t_test_power(nc, df, alpha) for nc in NONCENTRALITIES])
        assert np.all(np.isfinite(computed))
        np.testing.assert_allclose(computed, simulated, atol=0.005, err_msg=f"df={df} alpha={alpha}")
    assert t_test_power(0.0, df, 0.05) == pytest.approx(0.05)  # no effect: the power is the level


def test_methods_shootout_norm_vs_sigmoid_mde_is_0_118():
    """Regression: its C4 family (8 methods vs sigmoid, 3 seeds, alpha / 8) detects |Δ| ≥ 0.118,
    not the 0.094 the NaN-dropping power claimed."""
    done = pd.read_csv(FIXTURES / "methods_shootout_trials.csv")
    methods = ["norm", "token_choice", "threshold", "mode_staged", "mode_integrated", "amod", "nested", "pmod"]
    arm = {v: done.loc[done["variant"] == v, "arm"].iloc[0] for v in methods + ["sigmoid"]}
    out = compare_effects(done, "test/causal_bpb", [(arm[v], arm["sigmoid"]) for v in methods])
    assert out.iloc[0].arm.startswith("norm") and out.iloc[0].mde == pytest.approx(0.118, abs=0.0005)


def test_flop_matched_c1_row_needs_four_seeds():
    """Regression: at 3 seeds the FLOP-matched row of paper_claims' C1 family (4 rows) has power
    0.68, so the seeds needed for 80 % power are 4."""
    done = pd.read_csv(FIXTURES / "paper_claims_c1_trials.csv")
    mod, best, matched = "sigmoid C=0.125 alternate lr×2", "dense lr×2 L3", "dense L4 d96 (FLOP-matched to C=0.125 alternate)"
    family = [(mod, best), ("norm C=0.125 alternate", best), (mod, matched), (mod, "dense (iso-tokens of C=0.125 alternate)")]
    row = compare_effects(done, "test/causal_bpb", family).iloc[2]
    assert row.reference == matched and row.seeds_needed == 4
    d = (done[done.arm == mod].sort_values("seed")["test/causal_bpb"].to_numpy()
         - done[done.arm == matched].sort_values("seed")["test/causal_bpb"].to_numpy())
    power3 = t_test_power(abs(d.mean()) / (d.std(ddof=1) / np.sqrt(3)), 2, 0.05 / 4)
    assert power3 == pytest.approx(0.68, abs=0.01)


def test_one_holm_for_the_package():
    assert not hasattr(effects, "_holm") and effects.holm is report_stats.holm
    rng = np.random.default_rng(11)
    df = study(rng, {"dense": 3.0, "a": 2.97, "b": 3.0, "c": 2.9}, n=5)
    out = compare_effects(df, "bpb", [("a", "dense"), ("b", "dense"), ("c", "dense")])
    assert out.p_adj.tolist() == pytest.approx(report_stats.holm(out.p.tolist()))


# --- equivalence (TOST) and the verdict classes -----------------------------------------------
def test_tost_decides_exactly_when_the_90_percent_ci_lies_inside_the_margin():
    rng = np.random.default_rng(12)
    decided = set()
    for _ in range(60):
        df = study(rng, {"a": 3.0 + rng.normal(0, 0.02), "b": 3.0}, n=5, sd=0.02, seed_sd=0.1)
        row = compare_effects(df, "bpb", [("a", "b")], margin=0.03).iloc[0]
        inside = -0.03 < row.equiv_ci_low and row.equiv_ci_high < 0.03
        assert (row.tost_p < 0.05) == inside
        decided.add(inside)
    assert decided == {True, False}  # both outcomes were exercised


def test_verdict_classes_better_equivalent_inconclusive_and_significant_inside_the_margin():
    rng = np.random.default_rng(13)
    tight = study(rng, {"a": 3.0, "b": 3.0, "c": 2.99, "d": 2.8}, n=8, sd=0.002, seed_sd=0.1)
    out = compare_effects(tight, "bpb", [("a", "b"), ("c", "b"), ("d", "b")], margin=0.05).set_index("arm")
    assert out.loc["a", "verdict_class"] == "equivalent" and out.loc["a", "verdict"].startswith("equivalent within ±0.05")
    # significant and inside the margin: the sign wins, the margin is named
    assert out.loc["c", "verdict_class"] == "better" and out.loc["c", "verdict"] == "c lower (better) within ±0.05"
    assert out.loc["d", "verdict_class"] == "better" and "within" not in out.loc["d", "verdict"]
    noisy = study(rng, {"a": 3.0, "b": 3.0}, n=3, sd=0.1)
    assert compare_effects(noisy, "bpb", [("a", "b")], margin=0.05).iloc[0].verdict_class == "inconclusive"
    no_margin = compare_effects(tight, "bpb", [("a", "b")]).iloc[0]
    assert no_margin.verdict_class == "inconclusive" and no_margin.tost_p is None  # equivalence needs a margin
    unpaired = compare_effects(tight, "bpb", [("a", "b")], paired=False, margin=0.5, n_resamples=499).iloc[0]
    assert unpaired.method.startswith("bootstrap") and unpaired.verdict_class == "equivalent"
    with pytest.raises(ModbenchError, match="margin"):
        compare_effects(tight, "bpb", [("a", "b")], margin=-0.05)


# --- seeds for a target precision -------------------------------------------------------------
@pytest.mark.parametrize("sd,half_width", [(0.035, 0.03), (0.035, 0.05), (0.02, 0.005), (0.1, 0.3)])
def test_seeds_for_half_width_is_the_smallest_n_whose_t_interval_is_narrow_enough(sd, half_width):
    n = seeds_for_half_width(sd, half_width, cap=1000)
    width = lambda k: stats.t.ppf(0.975, k - 1) * sd / np.sqrt(k)  # noqa: E731
    assert width(n) <= half_width and (n == 2 or width(n - 1) > half_width)
    assert n >= (1.96 * sd / half_width) ** 2  # the t quantile never asks for fewer seeds than the normal one
    assert seeds_for_half_width(sd, half_width, cap=n) == n and seeds_for_half_width(sd, half_width / 10, cap=n) == n


def test_seeds_for_half_width_rejects_bad_input():
    with pytest.raises(ModbenchError, match="cap"):
        seeds_for_half_width(0.03, 0.01, cap=1)
    with pytest.raises(ModbenchError, match="half_width"):
        seeds_for_half_width(0.03, 0.0, cap=10)


@pytest.mark.parametrize("n,true_diff", [(3, 0.0), (6, 0.0), (8, 0.0), (8, 0.02), (12, -0.03)])
def test_tost_power_matches_monte_carlo(n, true_diff):
    """Paired TOST within ±0.05 at alpha 0.05, per-seed differences N(true_diff, 0.035²): 2e5 studies."""
    rng = np.random.default_rng(n)
    d = rng.normal(true_diff, 0.035, (200_000, n))
    half = stats.t.ppf(0.95, n - 1) * d.std(axis=1, ddof=1) / np.sqrt(n)
    mean = d.mean(axis=1)
    simulated = ((mean - half > -0.05) & (mean + half < 0.05)).mean()
    assert tost_power(0.035, 0.05, n, true_diff=true_diff) == pytest.approx(simulated, abs=0.005)


def test_seeds_for_equivalence_is_the_smallest_n_with_the_power():
    n = seeds_for_equivalence(0.035, 0.05, cap=50)
    assert tost_power(0.035, 0.05, n) >= 0.8 > tost_power(0.035, 0.05, n - 1)
    assert n == 6
    assert seeds_for_equivalence(0.035, 0.05, power=0.9, cap=50) > n
    assert seeds_for_equivalence(0.035, 0.05, true_diff=0.05, cap=20) == 20  # a difference at the margin: never
    assert seeds_for_equivalence(0.2, 0.05, cap=10) == 10  # capped


def test_missing_arm_and_undefined_cases_are_named():
    df = pd.DataFrame([dict(arm="a", seed=0, bpb=1.0), dict(arm="b", seed=0, bpb=1.1)])
    with pytest.raises(ModbenchError, match="'zz' is not in the results"):
        compare_effects(df, "bpb", [("zz", "a")])
    row = compare_effects(df, "bpb", [("a", "b")]).iloc[0]
    assert row.p_adj is None and row.verdict.startswith("not testable (n<2)")


def test_agreement_reports_chance_levels():
    ref = np.zeros(800, dtype=bool)
    ref[::8] = True  # top-k at C = 0.125
    skip = agreement(np.zeros_like(ref), ref)
    assert skip.agreement == pytest.approx(0.875) == pytest.approx(skip.always_skip)
    assert skip.recall == 0 and skip.precision is None and skip.kappa == pytest.approx(0.0)
    perfect = agreement(ref, ref)
    assert perfect.agreement == 1 and perfect.precision == perfect.recall == 1 and perfect.kappa == pytest.approx(1)
    rng = np.random.default_rng(6)
    independent = agreement(rng.random(ref.size) < 0.125, ref)
    assert abs(independent.agreement - independent.chance) < 0.03 and abs(independent.kappa) < 0.1


# --- sanity baselines -----------------------------------------------------------------------
@pytest.mark.parametrize("order", [1, 2, 3])
def test_kneser_ney_is_a_distribution_for_seen_and_unseen_contexts(order):
    rng = np.random.default_rng(7)
    train = rng.integers(97, 110, 5000).astype(np.uint8)  # a small alphabet: many unseen contexts
    model = KneserNey(train, order)
    for context in ([97, 98], [200, 201], [97, 250]):
        probs = [model.prob(np.array(context + [c], dtype=np.uint8))[-1] for c in range(256)]
        assert min(probs) > 0
        assert sum(probs) == pytest.approx(1.0, abs=1e-9)


def test_baselines_know_easy_and_random_data():
    rng = np.random.default_rng(8)
    periodic = np.tile(np.frombuffer(b"abcdefg", dtype=np.uint8), 3000)
    assert KneserNey(periodic, 3).bits_per_byte(periodic[:700]) < 0.1
    noise = rng.integers(0, 256, 200_000).astype(np.uint8)
    assert KneserNey(noise, 1).bits_per_byte(noise[:20_000]) > 7.95
    assert all(v > 7.9 for v in compressed_bits_per_byte(noise[:20_000]).values())
    assert all(v < 0.1 for v in compressed_bits_per_byte(periodic).values())


def test_ngram_orders_on_real_text():
    if not SHAKESPEARE.exists():
        pytest.skip("../shared/data/tinyshakespeare.txt is not beside the checkout")
    data = np.fromfile(SHAKESPEARE, dtype=np.uint8)
    cut = int(0.9 * len(data))
    b = sanity_baselines(data[:cut], data[cut: cut + 50_000])
    assert b.trigram < b.bigram < b.unigram
    counts = np.bincount(data[:cut], minlength=256)
    p = counts[counts > 0] / cut
    assert b.unigram == pytest.approx(float(-(p * np.log2(p)).sum()), abs=0.05)  # ≈ the train entropy
    assert 2.5 < b.trigram < 3.2 and b.trigram < b.zstd


# --- isoFLOP profiles ------------------------------------------------------------------------
def test_isoflop_profile_recovers_a_planted_optimum():
    from modbench.report.isoflop import profiles

    rng = np.random.default_rng(9)
    rows = []
    for family, u_star, floor in (("dense", 6.0, 3.0), ("sigmoid", 6.3, 2.9)):
        for u in (5.4, 5.7, 6.0, 6.3, 6.6, 6.9):
            for s in range(4):
                rows.append(dict(family=family, budget=1e13, params=10**u, seed=s,
                                 loss=floor + 0.5 * (u - u_star) ** 2 + rng.normal(0, 0.01)))
    fits, diffs = profiles(pd.DataFrame(rows), reference="dense")
    by = fits.set_index("family")
    assert by.loc["dense", "inside"] and by.loc["sigmoid", "inside"]
    assert by.loc["dense", "opt_low"] < 10**6.0 < by.loc["dense", "opt_high"]
    assert np.log10(by.loc["sigmoid", "opt_params"]) == pytest.approx(6.3, abs=0.05)
    d = diffs.iloc[0]
    assert d.family == "sigmoid" and d.estimate == pytest.approx(-0.1, abs=0.01) and d.ci_high < 0


def test_isoflop_profile_flags_an_optimum_at_the_edge_of_the_sweep():
    from modbench.report.isoflop import fit_profile

    rows = [dict(family="dense", budget=1e12, params=10**u, seed=s, loss=3.0 - 0.2 * u + 0.001 * s)
            for u in (5.0, 5.5, 6.0) for s in range(3)]
    fit = fit_profile(pd.DataFrame(rows), "dense", 1e12)
    assert not fit.inside and np.isnan(fit.opt_params)
    with pytest.raises(ModbenchError, match="at least 3"):
        fit_profile(pd.DataFrame(rows[:6]), "dense", 1e12)


def test_figures_write_png_and_pdf(tmp_path):
    from modbench.report.figures import forest_plot, small_multiples

    effects = pd.DataFrame([dict(arm="sigmoid", reference="dense", estimate=-0.05, ci_low=-0.08, ci_high=-0.02),
                            dict(arm="norm", reference="random", estimate=0.01, ci_low=None, ci_high=None)])
    png = forest_plot(effects, tmp_path / "forest.png")
    assert png.stat().st_size > 1000 and png.with_suffix(".pdf").stat().st_size > 1000
    curves = pd.DataFrame([dict(arm=a, variant=v, capacity=c, step=s, flops=1e9 * (s + 1), val_bpb=3 - 0.1 * s)
                           for a, v, c in (("dense", "dense", 1.0), ("dense L2", "dense", 1.0), ("sigmoid C=0.125", "sigmoid", 0.125),
                                           ("sigmoid C=0.5", "sigmoid", 0.5)) for s in range(4)])
    assert small_multiples(curves, tmp_path / "curves.png").with_suffix(".pdf").exists()
