"""Statistics for modbench studies: per-arm summaries, arm-vs-baseline tests, Pareto fronts.

A study yields one row per (arm, seed) trial; an *arm* is one setting (variant x capacity x
pattern x schedule x ...), and the metric is typically validation bits-per-byte (lower is
better). Studies run few seeds (2-8), so every method here is chosen to stay honest at small n,
and every number that is undefined is reported as ``None`` (never NaN) together with a plain
reason.

Methods and why
---------------
* **Failed trials.** A non-finite metric (NaN from a failed run, +/-inf from a diverged one) is
  a failed trial: it is excluded from every statistic and counted in ``n_failed``.
* **Confidence intervals** (:func:`summarize`). ``method='t'``: the Student-t interval
  ``mean +/- t_{n-1} * s / sqrt(n)`` (``scipy.stats.t.interval``); exact under normality and a
  reasonable default for seed-to-seed noise. ``method='bca'``: the bias-corrected and
  accelerated percentile bootstrap (``scipy.stats.bootstrap(method='BCa')``) with a fixed seed so
  reports are reproducible; it adapts to skew but needs n >= 3 and non-degenerate data, and
  falls back to the t interval otherwise (recorded in ``ci_method``). With n < 2, or with zero
  spread, there is no interval (``None``): a zero-width interval would claim certainty that a
  handful of identical seeds cannot give.
* **Tests** (:func:`compare_to_baseline`), each non-baseline arm against the baseline:
  Welch's t-test (``scipy.stats.ttest_ind(equal_var=False)``), which does not assume equal
  variances across arms, and the Mann-Whitney U test (``scipy.stats.mannwhitneyu``,
  two-sided), which does not assume normality. Mann-Whitney uses the exact null distribution
  when there are no ties (n1 + n2 <= 100), the exact *permutation* distribution when there are
  ties and C(n1+n2, n1) <= 20000 (the normal approximation is poor at these sizes), and the
  tie-corrected normal approximation otherwise. Both tests need n >= 2 in each group.
* **Effect size**: Hedges' g, the standardized mean difference (arm - baseline) over the pooled
  SD, times the exact small-sample bias correction
  ``J(df) = Gamma(df/2) / (sqrt(df/2) * Gamma((df-1)/2))``, df = n1 + n2 - 2 (Cohen's d is
  biased upwards by ~20 % at n = 5 vs 5). No library implements it; it is written here.
* **Attainable significance.** With n1 vs n2 trials and no ties, the smallest two-sided exact
  Mann-Whitney p-value is ``2 / C(n1+n2, n1)`` (:func:`mwu_min_p`): 0.33 for 2 vs 2, 0.1 for
  3 vs 3, 0.0079 for 5 vs 5. ``can_reach_significance`` is False when even that best case,
  after the multiple-comparison correction, cannot get below alpha (``mwu_min_p_adj``), or when
  a group has n < 2. Ties only make the minimum larger, so the flag never overstates.
* **Multiple comparisons.** Each test's p-values form one family across all comparisons of a
  call. ``'holm'`` (default): Holm-Bonferroni step-down (:func:`holm`, the package's only Holm,
  checked against statsmodels' ``multipletests``), which controls the family-wise error
  rate under any dependence (comparisons share the baseline, so they are dependent) and is
  uniformly more powerful than Bonferroni. ``'bh'``: Benjamini-Hochberg
  (``scipy.stats.false_discovery_control``), which controls the false-discovery rate, for large
  screens. Undefined p-values stay ``None`` and are not part of the family.

Degenerate cases (documented decisions)
---------------------------------------
* n < 2 in either group: Welch, Mann-Whitney and Hedges' g are ``None``; ``note`` says why.
  ``mean_diff`` is still given when both groups have a trial.
* No successful trials in a group: ``mean_diff`` is ``None`` as well.
* Zero variance in both groups: Welch t/p and Hedges' g are ``None`` (t would be infinite or
  0/0); Mann-Whitney stays defined (p = 1.0 when all values tie).
* Baseline arm absent from the data: :func:`compare_to_baseline` returns an empty frame with the
  usual columns and ``frame.attrs['reason']`` set; the caller reports "no baseline". It does not
  raise, so a report over a partially failed study still renders.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields
from typing import Any

import numpy as np
import pandas as pd
from scipy import special, stats

from modbench.errors import ModbenchError, accepted

CI_METHODS = ("t", "bca")
CORRECTIONS = ("holm", "bh")
CORRECTION_NAMES = {"holm": "Holm", "bh": "BH"}
_PERMUTATION_LIMIT = 20_000  # enumerate the tie-aware permutation null up to this many splits
_EXACT_LIMIT = 100  # scipy's exact Mann-Whitney null is cheap up to here (n1 + n2)


@dataclass(frozen=True)
class ArmSummary:
    """One arm's successful trials. Undefined quantities are ``None``."""

    arm: str
    n: int
    n_failed: int
    mean: float | None
    std: float | None  # ddof=1; None when n < 2
    ci_low: float | None
    ci_high: float | None
    ci_method: str  # 't', 'bca', 't (bca fallback: ...)', 'none: n<2', 'none: zero variance'


@dataclass(frozen=True)
class Comparison:
    """One arm against the baseline. Undefined quantities are ``None``; ``note`` says why."""

    arm: str
    baseline: str
    n_arm: int
    n_base: int
    mean_diff: float | None  # arm - baseline (negative = arm lower)
    hedges_g: float | None
    welch_t: float | None
    welch_p: float | None
    mwu_u: float | None  # U statistic of the arm's sample
    mwu_p: float | None
    mwu_method: str  # 'exact', 'permutation (ties)', 'asymptotic' or '' when not run
    mwu_min_p: float  # smallest attainable two-sided exact p, no correction
    mwu_min_p_adj: float  # same after the family's correction (best case)
    welch_p_adj: float | None
    mwu_p_adj: float | None
    can_reach_significance: bool
    note: str
    metric: str
    correction: str  # 'holm' or 'bh'
    alpha: float


SUMMARY_COLUMNS = [f.name for f in fields(ArmSummary)]
COMPARISON_COLUMNS = [f.name for f in fields(Comparison)]
_SUMMARY_NULLABLE = ("mean", "std", "ci_low", "ci_high")
_COMPARISON_NULLABLE = (
    "mean_diff", "hedges_g", "welch_t", "welch_p", "mwu_u", "mwu_p", "welch_p_adj", "mwu_p_adj",
)


# --------------------------------------------------------------------------- helpers


def _opt(x: Any) -> float | None:
    """A plain float, or None for None/NaN/inf."""
    if x is None:
        return None
    x = float(x)
    return x if math.isfinite(x) else None


_EMPTY_DTYPES = {"int": "int64", "float": "float64", "bool": "bool", "str": "str"}


def _frame(records: list[dict], cls: type, nullable: Sequence[str]) -> pd.DataFrame:
    """Frame with the fields of ``cls`` as columns; nullable columns are object dtype, so None
    stays None (never NaN). An empty frame still gets the columns' dtypes."""
    columns = [f.name for f in fields(cls)]
    if not records:
        return pd.DataFrame({
            f.name: pd.Series([], dtype=object if f.name in nullable else _EMPTY_DTYPES[f.type])
            for f in fields(cls)
        })
    frame = pd.DataFrame.from_records(records, columns=columns)
    for c in nullable:
        column = np.empty(len(records), dtype=object)
        column[:] = [r[c] for r in records]
        frame[c] = column
    return frame


def _require_columns(df: pd.DataFrame, cols: Sequence[str]) -> None:
    missing = [c for c in cols if c not in df.columns]
    if missing:
        raise ModbenchError(
            f"column {missing[0]!r} not in the results; available: {accepted(list(map(str, df.columns)))}"
        )


def _groups(df: pd.DataFrame, metric: str, by: str) -> dict[str, tuple[np.ndarray, int]]:
    """Arm label -> (finite metric values, number of failed trials), in order of appearance."""
    _require_columns(df, [by, metric])
    if df[by].isna().any():
        raise ModbenchError(f"{int(df[by].isna().sum())} result rows have no {by!r} label")
    try:
        values = pd.to_numeric(df[metric], errors="raise").astype(float)
    except (ValueError, TypeError) as exc:
        raise ModbenchError(f"metric {metric!r} has non-numeric values ({exc})") from None
    codes, labels = pd.factorize(df[by], sort=False)  # order of first appearance
    v = values.to_numpy()
    out: dict[str, tuple[np.ndarray, int]] = {}
    for code, label in enumerate(labels):
        x = v[codes == code]
        ok = np.isfinite(x)
        out[str(label)] = (x[ok], int((~ok).sum()))
    return out


def _as_pvalues(pvalues: Sequence[float]) -> np.ndarray:
    p = np.asarray(list(pvalues), dtype=float)
    if p.ndim != 1:
        raise ValueError("p-values must be a flat sequence")
    if not np.all((p >= 0) & (p <= 1)):  # also rejects NaN
        raise ValueError(f"p-values must lie in [0, 1] (got {p.tolist()})")
    return p


def _constant(x: np.ndarray) -> bool:
    return x.size > 0 and bool(np.all(x == x[0]))


# --------------------------------------------------------------------------- building blocks


def holm(pvalues: Sequence[float]) -> list[float]:
    """Holm-Bonferroni adjusted p-values (step-down), in the input order: the package's one Holm
    (``modbench.report.effects`` uses it too).

    Sorted ascending, ``adj_(i) = max_{j<=i} min(1, (m - j + 1) * p_(j))``: monotone in the raw
    order, never below the raw p-value, capped at 1. Equal raw p-values get equal adjusted ones.
    The same numbers as statsmodels' ``multipletests(method="holm")`` (a test checks it), written
    here because that function runs a full ``gc.collect()`` on every call (statsmodels 0.14/0.15),
    about 0.3 s in a process holding torch, and a report calls it once per family.
    """
    p = _as_pvalues(pvalues)
    m = p.size
    if m == 0:
        return []
    order = np.argsort(p, kind="mergesort")
    scaled = (m - np.arange(m)) * p[order]
    adjusted = np.minimum(1.0, np.maximum.accumulate(scaled))
    out = np.empty(m)
    out[order] = adjusted
    return [float(v) for v in out]


def benjamini_hochberg(pvalues: Sequence[float]) -> list[float]:
    """Benjamini-Hochberg adjusted p-values (``scipy.stats.false_discovery_control``)."""
    p = _as_pvalues(pvalues)
    if p.size == 0:
        return []
    return [float(v) for v in stats.false_discovery_control(p, method="bh")]


def _adjust(pvalues: Sequence[float], correction: str) -> list[float]:
    return holm(pvalues) if correction == "holm" else benjamini_hochberg(pvalues)


def hedges_g(a, b) -> float | None:
    """Hedges' g of ``a`` relative to ``b``: J(df) * (mean(a) - mean(b)) / pooled SD.

    Uses the exact bias correction J(df) = Gamma(df/2) / (sqrt(df/2) Gamma((df-1)/2)),
    df = n_a + n_b - 2. ``None`` when either sample has fewer than 2 values or both have zero
    variance (the ratio would be infinite or 0/0). Values must be finite.
    """
    a = np.asarray(a, dtype=float).ravel()
    b = np.asarray(b, dtype=float).ravel()
    if not (np.all(np.isfinite(a)) and np.all(np.isfinite(b))):
        raise ValueError("hedges_g needs finite values")
    n1, n2 = a.size, b.size
    if n1 < 2 or n2 < 2:
        return None
    df = n1 + n2 - 2
    pooled_var = ((n1 - 1) * np.var(a, ddof=1) + (n2 - 1) * np.var(b, ddof=1)) / df
    if not pooled_var > 0:
        return None
    j = math.exp(special.gammaln(df / 2) - special.gammaln((df - 1) / 2)) / math.sqrt(df / 2)
    return _opt(j * (a.mean() - b.mean()) / math.sqrt(pooled_var))


def mwu_min_p(n1: int, n2: int) -> float:
    """Smallest two-sided p-value an exact Mann-Whitney test can give with n1 vs n2 (no ties).

    The most extreme split has probability 1 / C(n1+n2, n1) under the null on each side, so
    ``min(1, 2 / C(n1+n2, n1))``: 3 vs 3 -> 0.1, 5 vs 5 -> 0.0079, 2 vs 2 -> 0.33. With an empty
    group no test exists and the result is 1.
    """
    if n1 < 0 or n2 < 0:
        raise ValueError("sample sizes must be non-negative")
    return min(1.0, 2.0 / math.comb(n1 + n2, n1))


def _mannwhitney(x: np.ndarray, y: np.ndarray) -> tuple[float | None, float | None, str]:
    n1, n2 = x.size, y.size
    ties = np.unique(np.concatenate([x, y])).size < n1 + n2
    if not ties and n1 + n2 <= _EXACT_LIMIT:
        method, label = "exact", "exact"
    elif ties and math.comb(n1 + n2, n1) <= _PERMUTATION_LIMIT:
        method, label = stats.PermutationMethod(n_resamples=np.inf), "permutation (ties)"
    else:
        method, label = "asymptotic", "asymptotic"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        res = stats.mannwhitneyu(x, y, alternative="two-sided", method=method)
    return _opt(res.statistic), _opt(res.pvalue), label


def _welch(x: np.ndarray, y: np.ndarray) -> tuple[float | None, float | None]:
    with warnings.catch_warnings():  # near-constant data: scipy warns about precision loss
        warnings.simplefilter("ignore", RuntimeWarning)
        res = stats.ttest_ind(x, y, equal_var=False)
    t, p = _opt(res.statistic), _opt(res.pvalue)
    return (t, p) if t is not None and p is not None else (None, None)


# --------------------------------------------------------------------------- summaries


def _interval(x: np.ndarray, ci: float, method: str, n_resamples: int, seed: int):
    """(low, high, ci_method) for the mean of x."""
    n = x.size
    if n < 2:
        return None, None, "none: n<2"
    if _constant(x):
        return None, None, "none: zero variance"
    fallback = ""
    if method == "bca":
        if n < 3:
            fallback = "t (bca fallback: n<3)"
        else:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                res = stats.bootstrap(
                    (x,), np.mean, confidence_level=ci, method="BCa",
                    n_resamples=n_resamples, rng=np.random.default_rng(seed),
                )
            low, high = _opt(res.confidence_interval.low), _opt(res.confidence_interval.high)
            if low is not None and high is not None and low < high:
                return low, high, "bca"
            fallback = "t (bca fallback: degenerate bootstrap)"
    low, high = stats.t.interval(ci, x.size - 1, loc=x.mean(), scale=stats.sem(x))
    return _opt(low), _opt(high), fallback or "t"


def summarize(
    df: pd.DataFrame,
    metric: str,
    by: str = "arm",
    ci: float = 0.95,
    method: str = "t",
    *,
    n_resamples: int = 9999,
    seed: int = 0,
) -> pd.DataFrame:
    """One row per group of ``by`` (in order of first appearance): the columns of
    :class:`ArmSummary` (the group label is in column ``arm``).

    ``method='t'`` gives the Student-t interval; ``'bca'`` the BCa bootstrap with
    ``n_resamples`` resamples drawn from ``numpy.random.default_rng(seed)`` (reproducible),
    falling back to the t interval for n < 3 or a degenerate bootstrap, as ``ci_method`` records.
    Rows whose metric is NaN/inf are failed trials: excluded, counted in ``n_failed``. An arm
    with no successful trial has n = 0 and ``mean``/``std``/CI ``None``.
    """
    if method not in CI_METHODS:
        raise ModbenchError(f"unknown CI method {method!r}; accepted: {accepted(CI_METHODS)}")
    if not 0 < ci < 1:
        raise ModbenchError(f"confidence level must lie strictly between 0 and 1 (got {ci})")
    records = []
    for label, (x, n_failed) in _groups(df, metric, by).items():
        low, high, ci_method = _interval(x, ci, method, n_resamples, seed)
        records.append(asdict(ArmSummary(
            arm=label,
            n=int(x.size),
            n_failed=n_failed,
            mean=_opt(x.mean()) if x.size else None,
            std=_opt(np.std(x, ddof=1)) if x.size >= 2 else None,
            ci_low=low,
            ci_high=high,
            ci_method=ci_method,
        )))
    return _frame(records, ArmSummary, _SUMMARY_NULLABLE)


# --------------------------------------------------------------------------- comparisons


def compare_to_baseline(
    df: pd.DataFrame,
    metric: str,
    baseline: str,
    by: str = "arm",
    alpha: float = 0.05,
    correction: str = "holm",
) -> pd.DataFrame:
    """Every non-baseline arm against ``baseline``: one row per arm, the columns of
    :class:`Comparison`.

    Welch and Mann-Whitney p-values are corrected (``'holm'`` or ``'bh'``) separately, each over
    the family of its defined p-values in this call; undefined ones stay ``None`` and are left
    out of the family. If ``baseline`` is not among the arms, the result is an empty frame with
    the same columns and ``attrs['reason']`` saying so (no exception), so the caller can state
    "no baseline" in its report.
    """
    if correction not in CORRECTIONS:
        raise ModbenchError(f"unknown correction {correction!r}; accepted: {accepted(CORRECTIONS)}")
    if not 0 < alpha < 1:
        raise ModbenchError(f"alpha must lie strictly between 0 and 1 (got {alpha})")
    groups = _groups(df, metric, by)
    baseline = str(baseline)
    if baseline not in groups:
        empty = _frame([], Comparison, _COMPARISON_NULLABLE)
        empty.attrs["reason"] = f"baseline {baseline!r} not in the results"
        return empty
    y, base_failed = groups[baseline]
    rows = [
        _compare_pair(label, x, arm_failed, baseline, y, base_failed, metric, correction, alpha)
        for label, (x, arm_failed) in groups.items()
        if label != baseline
    ]
    for test in ("welch", "mwu"):
        _adjust_family(rows, test, correction)
    _mark_attainability(rows, correction, alpha)
    for r in rows:
        r["note"] = "; ".join(r.pop("_notes"))
    return _frame(rows, Comparison, _COMPARISON_NULLABLE)


def _compare_pair(label: str, x: np.ndarray, arm_failed: int, baseline: str, y: np.ndarray, base_failed: int,
                  metric: str, correction: str, alpha: float) -> dict:
    """One arm against the baseline, before any correction; ``_notes`` collects the reasons."""
    n1, n2 = int(x.size), int(y.size)
    notes: list[str] = []
    row = dict(
        arm=label, baseline=baseline, n_arm=n1, n_base=n2,
        mean_diff=_opt(x.mean() - y.mean()) if n1 and n2 else None,
        hedges_g=None, welch_t=None, welch_p=None, mwu_u=None, mwu_p=None, mwu_method="",
        mwu_min_p=mwu_min_p(n1, n2), metric=metric, correction=correction, alpha=alpha,
    )
    if n1 == 0 or n2 == 0:
        for name, n, failed in ((label, n1, arm_failed), (baseline, n2, base_failed)):
            if n == 0:
                notes.append(f"no successful trials in {name} ({failed} failed)")
        notes[-1] += ": no comparison possible"
    elif n1 < 2 or n2 < 2:
        where = "both groups" if n1 < 2 and n2 < 2 else ("arm" if n1 < 2 else "baseline")
        notes.append(f"n=1 in {where}: no test possible")
    else:
        row["hedges_g"] = hedges_g(x, y)
        if _constant(x) and _constant(y):
            notes.append("zero variance in both groups: Welch test and Hedges' g undefined")
        else:
            row["welch_t"], row["welch_p"] = _welch(x, y)
            if row["welch_p"] is None:
                notes.append("Welch test undefined for these values")
        row["mwu_u"], row["mwu_p"], row["mwu_method"] = _mannwhitney(x, y)
    row["_notes"] = notes
    return row


def _adjust_family(rows: list[dict], test: str, correction: str) -> None:
    """Set ``{test}_p_adj``: the correction over the rows whose ``{test}_p`` is defined."""
    defined = [r for r in rows if r[f"{test}_p"] is not None]
    adjusted = _adjust([r[f"{test}_p"] for r in defined], correction)
    for r in rows:
        r[f"{test}_p_adj"] = None
    for r, p in zip(defined, adjusted):
        r[f"{test}_p_adj"] = p


def _mark_attainability(rows: list[dict], correction: str, alpha: float) -> None:
    """Best-case adjusted Mann-Whitney p and ``can_reach_significance`` for every row.

    Holm multiplies the smallest p of the family by m, so no adjusted p can be below
    m * (smallest attainable p in the family); BH can leave a p as is.
    """
    family = [r for r in rows if r["mwu_p"] is not None]  # every row with n >= 2 on both sides
    m = len(family)
    floor = min((r["mwu_min_p"] for r in family), default=1.0)
    for r in rows:
        best = r["mwu_min_p"]
        if correction == "holm" and m > 1:
            best = max(best, min(1.0, m * floor))
        r["mwu_min_p_adj"] = best
        testable_row = r["mwu_p"] is not None
        r["can_reach_significance"] = bool(testable_row and best <= alpha)
        if testable_row and not r["can_reach_significance"]:
            msg = f"cannot reach significance: minimum Mann\u2013Whitney p = {_num(r['mwu_min_p'])}"
            if best != r["mwu_min_p"]:
                msg += f" ({CORRECTION_NAMES[correction]}-adjusted over {m}: {_num(best)})"
            r["_notes"].append(msg + f" > alpha = {_num(alpha)}")


# --------------------------------------------------------------------------- Pareto


def pareto_front(
    df: pd.DataFrame, minimize: Sequence[str] = (), maximize: Sequence[str] = ()
) -> pd.Series:
    """Boolean mask (index of ``df``) of rows not dominated on the given objectives.

    Row a dominates row b when a is at least as good on every objective and strictly better on
    one. Rows equal on all objectives do not dominate each other (all stay on the front). A row
    with a missing (NaN) objective is never on the front and dominates nothing.
    """
    minimize, maximize = list(minimize), list(maximize)
    if not minimize and not maximize:
        raise ModbenchError("pareto_front needs at least one objective to minimize or maximize")
    both = set(minimize) & set(maximize)
    if both:
        raise ModbenchError(f"column {sorted(both)[0]!r} is both minimized and maximized")
    _require_columns(df, minimize + maximize)
    cost = np.column_stack(
        [pd.to_numeric(df[c], errors="coerce").to_numpy(dtype=float) for c in minimize]
        + [-pd.to_numeric(df[c], errors="coerce").to_numpy(dtype=float) for c in maximize]
    )
    valid = ~np.isnan(cost).any(axis=1)
    c = np.where(valid[:, None], cost, np.inf)
    # dominated[i, j]: row j dominates row i
    le = (c[None, :, :] <= c[:, None, :]).all(axis=2)
    lt = (c[None, :, :] < c[:, None, :]).any(axis=2)
    dominates = le & lt & valid[None, :]
    front = valid & ~dominates.any(axis=1)
    return pd.Series(front, index=df.index, name="pareto", dtype=bool)


def _num(x: float, digits: int = 2) -> str:
    """Compact number with a typographic minus: 0.031, −1.9, 0.33."""
    return f"{x:.{digits}g}".replace("-", "\u2212")
