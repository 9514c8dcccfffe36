"""Tests for modbench.report.stats: summaries, arm-vs-baseline tests, corrections, Pareto fronts."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from scipy import stats as sps

from modbench.errors import ModbenchError
from modbench.report.stats_text import describe_comparison
from modbench.report.stats import (
    COMPARISON_COLUMNS,
    SUMMARY_COLUMNS,
    benjamini_hochberg,
    compare_to_baseline,
    hedges_g,
    holm,
    mwu_min_p,
    pareto_front,
    summarize,
)

P_COLUMNS = ["welch_t", "welch_p", "mwu_u", "mwu_p", "welch_p_adj", "mwu_p_adj", "hedges_g"]


def frame(arms: dict[str, list[float]], metric: str = "val_bpb") -> pd.DataFrame:
    rows = [
        {"arm": arm, "seed": seed, metric: v}
        for arm, values in arms.items()
        for seed, v in enumerate(values)
    ]
    return pd.DataFrame(rows, columns=["arm", "seed", metric])


def no_nan_anywhere(df: pd.DataFrame) -> None:
    """No NaN value in any cell, and none in the rendered table."""
    for col in df.columns:
        for v in df[col]:
            assert not (isinstance(v, float) and math.isnan(v)), (col, v)
    assert "nan" not in df.to_markdown().lower()


# --------------------------------------------------------------------------- known effects


def test_large_effect_is_detected():
    rng = np.random.default_rng(0)
    df = frame({
        "dense": list(rng.normal(1.5, 0.1, 8)),
        "sigmoid": list(rng.normal(1.0, 0.1, 8)),
    })
    (row,) = compare_to_baseline(df, "val_bpb", "dense").to_dict("records")
    assert row["n_arm"] == row["n_base"] == 8
    assert row["mean_diff"] < -0.3
    assert row["welch_p"] < 0.01 and row["mwu_p"] < 0.01
    assert row["welch_p_adj"] < 0.05 and row["mwu_p_adj"] < 0.05
    assert row["hedges_g"] < -2  # arm lower than baseline -> negative
    assert row["can_reach_significance"] is True
    assert row["mwu_method"] == "exact" and row["note"] == ""
    text = describe_comparison(row, unit="bpb")
    assert text.startswith("sigmoid is ") and "bpb better than dense" in text
    assert "n = 8 vs 8" in text and "significant at" in text and "not significant" not in text


def test_welch_uses_unequal_variances():
    """t and Welch–Satterthwaite df from the textbook formulas (a pooled-variance test differs)."""
    a = np.array([0.90, 0.95, 0.97, 1.00, 1.30, 0.70])  # spread out
    b = np.array([1.05, 1.06, 1.07])  # tight, smaller
    va, vb = a.var(ddof=1) / a.size, b.var(ddof=1) / b.size
    t = (a.mean() - b.mean()) / math.sqrt(va + vb)
    df = (va + vb) ** 2 / (va**2 / (a.size - 1) + vb**2 / (b.size - 1))
    p = 2 * sps.t.sf(abs(t), df)
    (row,) = compare_to_baseline(frame({"dense": list(b), "mod": list(a)}), "val_bpb", "dense").to_dict(
        "records"
    )
    assert row["welch_t"] == pytest.approx(t) and row["welch_p"] == pytest.approx(p)
    pooled = sps.ttest_ind(a, b, equal_var=True).pvalue
    assert abs(pooled - p) > 0.01


def test_no_effect_controls_family_wise_error():
    """200 null families of 6 arms vs a shared baseline, n = 5 each."""
    rng = np.random.default_rng(12345)
    families, per_test, reject_raw, fwe = 200, 6, 0, 0
    for _ in range(families):
        values = rng.normal(1.0, 0.05, size=(per_test + 1, 5))
        df = frame({("dense" if i == 0 else f"arm{i}"): list(v) for i, v in enumerate(values)})
        cmp = compare_to_baseline(df, "val_bpb", "dense")
        raw = cmp["welch_p"].astype(float).to_numpy()
        adj = cmp["welch_p_adj"].astype(float).to_numpy()
        reject_raw += int((raw < 0.05).sum())
        fwe += int((adj < 0.05).any())
        # adjusted never below raw, and monotone in the raw order
        for r, a in (("welch_p", "welch_p_adj"), ("mwu_p", "mwu_p_adj")):
            rv, av = cmp[r].astype(float).to_numpy(), cmp[a].astype(float).to_numpy()
            assert np.all(av >= rv - 1e-15)
            order = np.argsort(rv, kind="mergesort")
            assert np.all(np.diff(av[order]) >= -1e-15)
    assert fwe / families <= 0.08
    assert 0.03 <= reject_raw / (families * per_test) <= 0.075


# --------------------------------------------------------------------------- corrections


def test_holm_hand_computed():
    assert holm([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    assert holm([0.5, 0.9]) == pytest.approx([1.0, 1.0])  # capped at 1
    assert holm([0.01, 0.01]) == pytest.approx([0.02, 0.02])  # ties get equal values
    assert holm([0.2]) == [0.2]
    assert holm([]) == []


def test_holm_matches_statsmodels():
    from statsmodels.stats.multitest import multipletests

    rng = np.random.default_rng(21)
    for m in (1, 2, 5, 12):
        p = rng.uniform(0, 0.2, m)
        p[: m // 3] = p[0]  # ties
        assert holm(p) == pytest.approx(multipletests(p, method="holm")[1].tolist(), abs=1e-15)


def test_benjamini_hochberg_hand_computed_and_matches_scipy():
    p = [0.01, 0.04, 0.03, 0.005]
    # sorted 0.005, 0.01, 0.03, 0.04 -> 4p/rank = 0.02, 0.02, 0.04, 0.04 (running min from top)
    assert benjamini_hochberg(p) == pytest.approx([0.02, 0.04, 0.04, 0.02])
    rng = np.random.default_rng(3)
    q = rng.uniform(0, 0.2, 17)
    assert benjamini_hochberg(q) == pytest.approx(sps.false_discovery_control(q).tolist())
    assert benjamini_hochberg([]) == []


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(0, 1), max_size=12))
def test_adjusted_p_values_dominate_raw_and_are_monotone(ps):
    order = np.argsort(ps, kind="mergesort")
    for adjust in (holm, benjamini_hochberg):
        adj = np.asarray(adjust(ps))
        assert adj.shape == (len(ps),)
        assert np.all(adj >= np.asarray(ps) - 1e-12) and np.all(adj <= 1)
        assert np.all(np.diff(adj[order]) >= -1e-12)
    assert np.all(np.asarray(holm(ps)) >= np.asarray(benjamini_hochberg(ps)) - 1e-12)


def test_corrections_reject_invalid_p_values():
    for bad in ([0.1, float("nan")], [1.5], [-0.1]):
        with pytest.raises(ValueError):
            holm(bad)
        with pytest.raises(ValueError):
            benjamini_hochberg(bad)


def test_correction_is_over_the_family_of_defined_p_values():
    rng = np.random.default_rng(5)
    arms = {"dense": list(rng.normal(1.0, 0.05, 6))}
    for i in range(3):
        arms[f"a{i}"] = list(rng.normal(0.9 + 0.05 * i, 0.05, 6))
    arms["single"] = [0.5]  # no test: must not enlarge the family
    cmp = compare_to_baseline(frame(arms), "val_bpb", "dense").set_index("arm")
    defined = cmp.loc[["a0", "a1", "a2"]]
    assert defined["welch_p_adj"].tolist() == pytest.approx(holm(defined["welch_p"].tolist()))
    assert defined["mwu_p_adj"].tolist() == pytest.approx(holm(defined["mwu_p"].tolist()))
    assert cmp.loc["single", "welch_p_adj"] is None
    bh = compare_to_baseline(frame(arms), "val_bpb", "dense", correction="bh").set_index("arm")
    assert bh.loc[["a0", "a1", "a2"], "welch_p_adj"].tolist() == pytest.approx(
        benjamini_hochberg(defined["welch_p"].tolist())
    )


# --------------------------------------------------------------------------- intervals


def test_t_interval_coverage():
    rng = np.random.default_rng(7)
    samples = rng.normal(0.0, 1.0, size=(400, 10))
    df = frame({f"s{i}": list(v) for i, v in enumerate(samples)}, metric="x")
    summ = summarize(df, "x", ci=0.95)
    assert (summ["ci_method"] == "t").all()
    low, high = summ["ci_low"].astype(float), summ["ci_high"].astype(float)
    coverage = ((low <= 0) & (high >= 0)).mean()
    assert 0.92 <= coverage <= 0.98
    # the interval is the textbook one
    x = samples[0]
    half = sps.t.ppf(0.975, 9) * x.std(ddof=1) / math.sqrt(10)
    assert summ.loc[0, "ci_low"] == pytest.approx(x.mean() - half)
    assert summ.loc[0, "ci_high"] == pytest.approx(x.mean() + half)
    assert summ.loc[0, "std"] == pytest.approx(x.std(ddof=1))


def test_bca_interval_on_skewed_data():
    rng = np.random.default_rng(11)
    reps, n = 30, 20
    true_mean = math.exp(0.5)  # lognormal(0, 1)
    samples = rng.lognormal(0.0, 1.0, size=(reps, n))
    df = frame({f"s{i}": list(v) for i, v in enumerate(samples)}, metric="x")
    summ = summarize(df, "x", method="bca", n_resamples=999, seed=1)
    assert (summ["ci_method"] == "bca").all()
    low, high = summ["ci_low"].astype(float), summ["ci_high"].astype(float)
    mean = summ["mean"].astype(float)
    assert ((low < mean) & (mean < high)).all()
    assert ((low <= true_mean) & (true_mean <= high)).mean() >= 0.75
    # right skew: the upper arm of the interval is longer than the lower one, mostly
    assert ((high - mean) > (mean - low)).mean() >= 0.8
    # it is scipy's BCa interval with the documented seeding (not the plain percentile one)
    ref = sps.bootstrap(
        (samples[0],), np.mean, method="BCa", n_resamples=999, rng=np.random.default_rng(1)
    ).confidence_interval
    assert (summ.loc[0, "ci_low"], summ.loc[0, "ci_high"]) == pytest.approx((ref.low, ref.high))
    # reproducible with the same seed
    again = summarize(df, "x", method="bca", n_resamples=999, seed=1)
    assert again["ci_low"].tolist() == summ["ci_low"].tolist()


def test_bca_falls_back_to_t_when_too_small():
    df = frame({"a": [1.0, 1.2], "b": [1.0, 1.1, 1.3]})
    summ = summarize(df, "val_bpb", method="bca", n_resamples=999).set_index("arm")
    assert summ.loc["a", "ci_method"].startswith("t (bca fallback")
    t_only = summarize(df, "val_bpb").set_index("arm")
    assert summ.loc["a", "ci_low"] == pytest.approx(t_only.loc["a", "ci_low"])
    assert summ.loc["b", "ci_method"] == "bca"


# --------------------------------------------------------------------------- attainable significance


def test_mwu_min_p_values():
    assert mwu_min_p(3, 3) == pytest.approx(0.1)
    assert mwu_min_p(5, 5) == pytest.approx(2 / 252)
    assert mwu_min_p(5, 5) == pytest.approx(0.00794, abs=1e-5)
    assert mwu_min_p(2, 2) == pytest.approx(1 / 3)
    assert mwu_min_p(1, 1) == 1.0 and mwu_min_p(0, 4) == 1.0
    # it is the p-value of a perfectly separated sample
    assert sps.mannwhitneyu([1, 2, 3, 4], [5, 6, 7], method="exact").pvalue == pytest.approx(
        mwu_min_p(4, 3)
    )


def test_three_vs_three_cannot_reach_significance_even_for_huge_effect():
    df = frame({"dense": [2.0, 2.1, 2.2], "mod": [1.0, 1.1, 1.2]})
    (row,) = compare_to_baseline(df, "val_bpb", "dense", alpha=0.05).to_dict("records")
    assert row["welch_p"] < 0.001  # Welch is tiny...
    assert row["mwu_p"] == pytest.approx(0.1)  # ...but MWU cannot go below 0.1
    assert row["mwu_min_p"] == pytest.approx(0.1)
    assert row["can_reach_significance"] is False
    assert "cannot reach significance" in row["note"]
    text = describe_comparison(row)
    assert "cannot reach significance with n = 3 vs 3" in text and "0.1" in text
    assert "normality assumption" in text


def test_attainable_significance_accounts_for_the_correction():
    rng = np.random.default_rng(2)
    arms = {"dense": list(rng.normal(2.0, 0.05, 5))}
    for i in range(7):
        arms[f"a{i}"] = list(rng.normal(1.0, 0.05, 5))
    holm_cmp = compare_to_baseline(frame(arms), "val_bpb", "dense", correction="holm")
    # 7 * 2/252 = 0.056 > 0.05: no arm can pass Holm with MWU
    assert holm_cmp["mwu_min_p_adj"].tolist() == pytest.approx([7 * 2 / 252] * 7)
    assert not holm_cmp["can_reach_significance"].any()
    assert (holm_cmp["mwu_p_adj"].astype(float) > 0.05).all()
    bh_cmp = compare_to_baseline(frame(arms), "val_bpb", "dense", correction="bh")
    assert bh_cmp["can_reach_significance"].all()
    assert (bh_cmp["mwu_p_adj"].astype(float) <= 0.05).all()


# --------------------------------------------------------------------------- effect size


def test_hedges_g_hand_computed():
    # means 2 vs 4, both variances 1 -> d = -2; df = 4, J = 1 / (sqrt(2) * Gamma(1.5))
    j = 1 / (math.sqrt(2) * math.gamma(1.5))
    assert hedges_g([1, 2, 3], [3, 4, 5]) == pytest.approx(-2 * j, rel=1e-9)
    assert hedges_g([3, 4, 5], [1, 2, 3]) == pytest.approx(2 * j, rel=1e-9)
    # unequal n and variance: pooled SD weights by degrees of freedom
    a, b = np.array([1.0, 2.0, 4.0, 7.0]), np.array([0.0, 1.0])
    sp = math.sqrt((3 * a.var(ddof=1) + 1 * b.var(ddof=1)) / 4)
    j4 = math.gamma(2) / (math.sqrt(2) * math.gamma(1.5))
    assert hedges_g(a, b) == pytest.approx(j4 * (a.mean() - b.mean()) / sp)
    assert hedges_g([1.0], [1.0, 2.0]) is None
    assert hedges_g([1.0, 1.0], [2.0, 2.0]) is None


# --------------------------------------------------------------------------- degenerate inputs


def test_one_seed_per_arm():
    df = frame({"dense": [1.0], "mod": [0.9]})
    summ = summarize(df, "val_bpb")
    assert summ["std"].tolist() == [None, None]
    assert summ["ci_low"].tolist() == [None, None] and summ["ci_high"].tolist() == [None, None]
    assert (summ["ci_method"] == "none: n<2").all()
    no_nan_anywhere(summ)
    cmp = compare_to_baseline(df, "val_bpb", "dense")
    (row,) = cmp.to_dict("records")
    assert all(row[c] is None for c in P_COLUMNS)
    assert row["mean_diff"] == pytest.approx(-0.1)
    assert row["can_reach_significance"] is False
    assert "n=1 in both groups: no test possible" in row["note"]
    no_nan_anywhere(cmp)
    text = describe_comparison(cmp.iloc[0])
    assert "nan" not in text.lower() and "no test possible" in text and "n = 1 vs 1" in text


def test_failed_arm_is_counted_not_crashing():
    nan = float("nan")
    df = frame({"dense": [1.0, 1.1, 0.9], "broken": [nan, nan], "partial": [0.8, nan, 0.85]})
    df.loc[len(df)] = {"arm": "partial", "seed": 9, "val_bpb": float("inf")}  # diverged
    summ = summarize(df, "val_bpb").set_index("arm")
    assert summ.loc["broken", "n"] == 0 and summ.loc["broken", "n_failed"] == 2
    assert summ.loc["broken", "mean"] is None
    assert summ.loc["partial", "n"] == 2 and summ.loc["partial", "n_failed"] == 2
    assert summ.loc["partial", "mean"] == pytest.approx(0.825)
    no_nan_anywhere(summ.reset_index())
    cmp = compare_to_baseline(df, "val_bpb", "dense").set_index("arm")
    assert cmp.loc["broken", "mean_diff"] is None
    assert "no successful trials in broken (2 failed)" in cmp.loc["broken", "note"]
    assert cmp.loc["partial", "n_arm"] == 2
    no_nan_anywhere(cmp.reset_index())
    for _, row in cmp.reset_index().iterrows():
        assert "nan" not in describe_comparison(row).lower()


def test_failed_baseline():
    nan = float("nan")
    cmp = compare_to_baseline(frame({"dense": [nan, nan], "mod": [1.0, 1.1]}), "val_bpb", "dense")
    (row,) = cmp.to_dict("records")
    assert row["n_base"] == 0 and row["mean_diff"] is None and row["welch_p"] is None
    assert "no successful trials in dense" in row["note"]
    assert "nan" not in describe_comparison(row).lower()


def test_missing_baseline_gives_empty_frame():
    cmp = compare_to_baseline(frame({"a": [1.0, 2.0], "b": [1.0, 3.0]}), "val_bpb", "dense")
    assert cmp.empty and list(cmp.columns) == COMPARISON_COLUMNS
    assert "dense" in cmp.attrs["reason"]
    assert cmp["n_arm"].dtype == "int64" and cmp["can_reach_significance"].dtype == bool
    empty = pd.DataFrame({"arm": pd.Series([], dtype=str), "val_bpb": pd.Series([], dtype=float)})
    assert summarize(empty, "val_bpb").empty
    assert list(summarize(empty, "val_bpb").columns) == SUMMARY_COLUMNS
    assert compare_to_baseline(empty, "val_bpb", "dense").empty


def test_zero_variance_equal_means():
    df = frame({"dense": [1.0, 1.0, 1.0], "mod": [1.0, 1.0, 1.0]})
    (row,) = compare_to_baseline(df, "val_bpb", "dense").to_dict("records")
    assert row["welch_t"] is None and row["welch_p"] is None  # documented: Welch undefined
    assert row["hedges_g"] is None
    assert row["mwu_p"] == pytest.approx(1.0)  # all values tie
    assert row["mean_diff"] == 0
    assert "zero variance in both groups" in row["note"]
    text = describe_comparison(row)
    assert "nan" not in text.lower() and "same mean" in text


def test_zero_variance_different_means():
    df = frame({"dense": [1.0] * 4, "mod": [0.5] * 4})
    (row,) = compare_to_baseline(df, "val_bpb", "dense").to_dict("records")
    assert row["welch_p"] is None and row["hedges_g"] is None
    assert row["mwu_p"] == pytest.approx(mwu_min_p(4, 4))
    summ = summarize(df, "val_bpb")
    assert (summ["ci_method"] == "none: zero variance").all() and (summ["std"] == 0).all()


def test_identical_values_leak_no_nan():
    df = frame({"dense": [0.7] * 5, "a": [0.7] * 5, "b": [0.7] * 2, "c": [0.7]})
    for method in ("t", "bca"):
        no_nan_anywhere(summarize(df, "val_bpb", method=method, n_resamples=999))
    cmp = compare_to_baseline(df, "val_bpb", "dense")
    no_nan_anywhere(cmp)
    for _, row in cmp.iterrows():
        assert "nan" not in describe_comparison(row).lower()


def test_ties_use_exact_permutation_distribution():
    df = frame({"dense": [1.0, 1.0, 2.0, 3.0], "mod": [0.0, 0.0, 0.5, 1.0]})
    (row,) = compare_to_baseline(df, "val_bpb", "dense").to_dict("records")
    assert row["mwu_method"] == "permutation (ties)"
    exact = sps.permutation_test(
        ([0.0, 0.0, 0.5, 1.0], [1.0, 1.0, 2.0, 3.0]),
        lambda x, y: sps.mannwhitneyu(x, y).statistic,
        permutation_type="independent", n_resamples=np.inf, vectorized=False,
    )
    assert row["mwu_p"] == pytest.approx(exact.pvalue)
    assert row["mwu_p"] >= row["mwu_min_p"]


def test_user_errors():
    df = frame({"dense": [1.0, 2.0]})
    with pytest.raises(ModbenchError, match="'bca'"):
        summarize(df, "val_bpb", method="percentile")
    with pytest.raises(ModbenchError, match="'bh'"):
        compare_to_baseline(df, "val_bpb", "dense", correction="bonferroni")
    with pytest.raises(ModbenchError, match="loss"):
        summarize(df, "loss")
    with pytest.raises(ModbenchError):
        summarize(df, "val_bpb", ci=95)


def test_summary_columns_and_grouping_key():
    df = pd.DataFrame({"variant": ["x", "y", "x"], "bpb": [1.0, 2.0, 1.5]})
    summ = summarize(df, "bpb", by="variant")
    assert list(summ.columns) == SUMMARY_COLUMNS
    assert summ["arm"].tolist() == ["x", "y"] and summ["n"].tolist() == [2, 1]


# --------------------------------------------------------------------------- Pareto


def test_pareto_front_minimize():
    df = pd.DataFrame({
        "val_bpb": [1.0, 1.1, 0.9, 1.2, 1.0, 0.9],
        "flops": [5.0, 3.0, 8.0, 6.0, 5.0, 9.0],
    }, index=list("abcdef"))
    mask = pareto_front(df, minimize=["val_bpb", "flops"])
    # a and e tie (both kept); d dominated by a; f dominated by c
    assert mask.to_dict() == {"a": True, "b": True, "c": True, "d": False, "e": True, "f": False}
    assert mask.dtype == bool


def test_pareto_front_maximize_and_missing():
    df = pd.DataFrame({
        "val_bpb": [1.0, 1.0, 0.9, 1.2, float("nan")],
        "tokens_per_s": [100.0, 120.0, 90.0, 200.0, 500.0],
    })
    mask = pareto_front(df, minimize=["val_bpb"], maximize=["tokens_per_s"])
    assert mask.tolist() == [False, True, True, True, False]
    only_speed = pareto_front(df, maximize=["tokens_per_s"])
    assert only_speed.tolist() == [False, False, False, False, True]
    with pytest.raises(ModbenchError):
        pareto_front(df)
    with pytest.raises(ModbenchError):
        pareto_front(df, minimize=["val_bpb"], maximize=["val_bpb"])


# --------------------------------------------------------------------------- fuzz

values = st.sampled_from([0.5, 1.0, 1.0, 1.25, 2.0, float("nan")]) | st.floats(0, 3)


@st.composite
def study(draw):
    n_arms = draw(st.integers(1, 4))
    arms = {f"arm{i}": draw(st.lists(values, min_size=0, max_size=6)) for i in range(n_arms)}
    baseline = draw(st.sampled_from(sorted(arms) + ["missing"]))
    return arms, baseline


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(study(), st.sampled_from(["holm", "bh"]))
def test_fuzz_never_raises_and_never_leaks_nan(arms_baseline, correction):
    arms, baseline = arms_baseline
    df = frame(arms)
    summ = summarize(df, "val_bpb")
    present = [a for a, v in arms.items() if v]
    assert summ["arm"].tolist() == present
    assert (summ["n"] + summ["n_failed"]).tolist() == [len(arms[a]) for a in present]
    no_nan_anywhere(summ)
    cmp = compare_to_baseline(df, "val_bpb", baseline, correction=correction)
    assert list(cmp.columns) == COMPARISON_COLUMNS
    no_nan_anywhere(cmp)
    for col in ("welch_p", "mwu_p", "welch_p_adj", "mwu_p_adj"):
        for p in cmp[col]:
            assert p is None or 0.0 <= p <= 1.0
    for _, row in cmp.iterrows():
        assert (row["welch_p"] is None) == (row["welch_p_adj"] is None)
        if row["mwu_p"] is not None:
            assert row["mwu_p"] >= row["mwu_min_p"] - 1e-12
            assert row["mwu_p_adj"] >= row["mwu_p"] - 1e-12
        text = describe_comparison(row)
        assert "nan" not in text.lower()
