"""Effects and sanity baselines, tested on simulated studies with known answers."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from modbench.errors import ModbenchError
from modbench.report.baselines import KneserNey, compressed_bits_per_byte, sanity_baselines
from modbench.report.effects import agreement, compare_effects, min_detectable_effect, seeds_needed

SHAKESPEARE = Path(__file__).resolve().parents[2] / "shared" / "data" / "tinyshakespeare.txt"


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
    fits, diffs = profiles(pd.DataFrame(rows))
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
    fit, _ = fit_profile(pd.DataFrame(rows), "dense", 1e12)
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
