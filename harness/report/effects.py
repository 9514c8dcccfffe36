"""Effects that answer a study's questions: differences with confidence intervals, corrected
over the family of comparisons the study declares, with the power to see them, and the verdict
classes better / worse / equivalent / inconclusive.

A claim such as "MoD beats the matched dense model" is a difference, arm − reference, of a
metric over seeds. For each declared comparison this module gives:

- **the estimate and its 95 % CI**, by one of two methods, named in ``method``:
  *paired by seed* when both arms ran the same seeds (in modbench a seed fixes the data order,
  the initialisation and the routing noise, so seed s of two arms saw the same batches): the
  mean of the per-seed differences with its Student-t interval (``scipy.stats.ttest_rel``);
  otherwise *bootstrap over seeds*: the BCa bootstrap of the difference of means
  (``scipy.stats.bootstrap``, seeds resampled within each arm, fixed RNG seed), with Welch's
  test for the p-value;
- **the p-value corrected over the family**: Holm's step-down (any dependence; the default,
  ``modbench.report.stats.holm``, the one Holm of the package), or Dunnett's many-to-one test
  (``scipy.stats.dunnett``, unpaired only, one shared reference), whose CIs are simultaneous;
- **equivalence** when a margin m is given: two one-sided tests (TOST, Schuirmann 1987;
  ``statsmodels.stats.weightstats.ttost_paired`` when paired, ``ttost_ind(usevar="unequal")``,
  Welch, otherwise) of H0: |Δ| ≥ m. At level α this is the same as the (1 − 2α) t interval
  (90 % at α = 0.05, in ``equiv_ci_low``/``equiv_ci_high``) lying inside ±m. The TOST p-values
  are Holm-corrected over the same family as the two-sided ones;
- **the minimum detectable effect** (MDE): the smallest |difference| the same design detects
  with 80 % power at the family's per-comparison level (α/m, Bonferroni, which is what Holm
  demands of its smallest p-value), from the noncentral t distribution with the observed
  spread; and **the seeds needed** per arm to detect the observed difference with that power.
  The power of the two-sided t test at noncentrality δ is
  ``P(T > t_crit) + P(T < −t_crit)`` with T ~ nct(df, δ); the lower tail is computed as
  ``scipy.stats.nct.sf(t_crit, df, −δ)`` (the reflection T(df, δ) = −T(df, −δ)), because
  ``scipy.stats.nct.cdf(−t_crit, df, δ)`` returns NaN at scattered δ above about 7 for small df
  (scipy 1.17; statsmodels' power code calls it the same way). A NaN power is an error, never
  replaced by a guess;
- **a verdict class** and a verdict in words. The rule, for lower-is-better metrics:

  1. the two-sided test is significant after correction (p_adj < α): ``"better"`` if the
     estimate is negative, else ``"worse"``. If the effect is *also* inside the margin
     (TOST significant), the class stays better/worse (the sign is established) and the words
     add "within the ±m margin": a real difference smaller than the one declared to matter;
  2. otherwise, with a margin, the TOST is significant after correction: ``"equivalent"``;
  3. otherwise ``"inconclusive"`` (with the MDE in words), also when there is nothing to test.

Seeds for the two-stage rule (the study runner queues them after the first seeds):
:func:`seeds_for_half_width` (the primary contrast's CI to a target half-width) and
:func:`seeds_for_equivalence` (TOST power at the margin, :func:`tost_power`), both paired by seed
and planned at the SD observed so far.

:func:`agreement` scores a causal routing rule against the top-k decisions it imitates, beside
its chance level: always-skip agreement and the agreement of an independent rule with the
same marginals, with precision, recall and Cohen's kappa.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields

import numpy as np
import pandas as pd
from scipy import integrate, optimize, stats

from modbench.errors import ModbenchError, accepted
from modbench.report.stats import holm

CORRECTIONS = ("holm", "dunnett")
VERDICT_CLASSES = ("better", "worse", "equivalent", "inconclusive")
POWER = 0.8
MAX_SEEDS = 10_000


@dataclass(frozen=True)
class Effect:
    """One comparison, arm − reference. Undefined quantities are ``None``."""

    arm: str
    reference: str
    metric: str
    n_arm: int
    n_ref: int
    estimate: float | None
    ci_low: float | None
    ci_high: float | None
    method: str  # 'paired by seed (t)' | 'bootstrap over seeds (BCa)' | 'dunnett' | 'none: ...'
    p: float | None
    p_adj: float | None
    correction: str
    mde: float | None  # smallest |difference| detected with 80 % power at alpha / m
    seeds_needed: int | None  # per arm, to detect |estimate| with 80 % power at alpha / m
    margin: float | None  # equivalence margin (metric units); None: no equivalence test
    equiv_ci_low: float | None  # the (1 − 2·alpha) t interval TOST decides on (90 % at alpha = 0.05)
    equiv_ci_high: float | None
    tost_p: float | None  # TOST p of H0 |Δ| ≥ margin (the larger of the two one-sided p's)
    tost_p_adj: float | None  # corrected over the family (Holm)
    verdict_class: str  # one of VERDICT_CLASSES
    verdict: str


EFFECT_COLUMNS = [f.name for f in fields(Effect)]


def _seed_values(df: pd.DataFrame, arm: str, metric: str, by: str, seed_col: str) -> pd.Series:
    """The arm's metric indexed by seed, failed (non-finite) trials dropped."""
    rows = df[df[by] == arm]
    values = pd.to_numeric(rows[metric], errors="coerce").astype(float)
    series = pd.Series(values.to_numpy(), index=rows[seed_col].to_numpy()) if seed_col in rows else values
    return series[np.isfinite(series.to_numpy())]


def t_test_power(nc: float, df: float, alpha: float) -> float:
    """Power of a two-sided t test at level ``alpha`` with ``df`` degrees of freedom when the
    statistic is noncentral t with noncentrality ``nc``: P(T > t_crit) + P(T < −t_crit).

    The lower tail is ``nct.sf(t_crit, df, −nc)`` (T(df, nc) = −T(df, −nc)):
    ``nct.cdf(−t_crit, df, nc)`` returns NaN at scattered nc > ~7 for small df.
    """
    t_crit = stats.t.ppf(1 - alpha / 2, df)
    power = float(stats.nct.sf(t_crit, df, nc) + stats.nct.sf(t_crit, df, -nc))
    if not math.isfinite(power):
        raise FloatingPointError(f"noncentral t power is {power} at nc={nc}, df={df}, alpha={alpha}")
    return power


def _power(delta: float, se: float, df: int, alpha: float) -> float:
    """Power of a two-sided t test at level ``alpha`` when the true difference is ``delta``."""
    return t_test_power(abs(delta) / se, df, alpha)


def min_detectable_effect(sd: float, n_arm: int, n_ref: int, *, paired: bool, alpha: float,
                          power: float = POWER) -> float | None:
    """Smallest |difference| found with ``power`` by a two-sided t test at ``alpha``.

    ``sd`` is the SD of the per-seed differences (paired) or the pooled SD of the two arms.
    ``None`` when the design has no degrees of freedom or no spread.
    """
    n = min(n_arm, n_ref) if paired else None
    df = (n - 1) if paired else n_arm + n_ref - 2
    if df < 1 or not sd > 0:
        return None
    se = sd / math.sqrt(n) if paired else sd * math.sqrt(1 / n_arm + 1 / n_ref)
    hi = se
    while _power(hi, se, df, alpha) < power:
        hi *= 2.0
    return float(optimize.brentq(lambda d: _power(d, se, df, alpha) - power, 1e-12 * se, hi))


def seeds_needed(effect: float, sd: float, *, paired: bool, alpha: float, power: float = POWER) -> int | None:
    """Seeds per arm for a two-sided t test at ``alpha`` to find ``effect`` with ``power``."""
    if not sd > 0 or effect == 0 or not math.isfinite(effect):
        return None

    def enough(n: int) -> bool:  # power grows with n, so the smallest such n is found by bisection
        df = n - 1 if paired else 2 * n - 2
        se = sd / math.sqrt(n) if paired else sd * math.sqrt(2 / n)
        return _power(effect, se, df, alpha) >= power - 1e-9  # the MDE itself must map back to n

    if not enough(MAX_SEEDS):
        return None
    low, high = 1, 2  # enough(high) is sought; low is known not enough (n = 1 has no df)
    while not enough(high):
        low, high = high, min(2 * high, MAX_SEEDS)
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (low, mid) if enough(mid) else (mid, high)
    return high


def _check_cap(cap: int) -> None:
    if not isinstance(cap, (int, np.integer)) or cap < 2:
        raise ModbenchError(f"cap {cap!r} must be an integer number of seeds >= 2")


def seeds_for_half_width(sd: float, half_width: float, *, ci: float = 0.95, cap: int) -> int:
    """Seeds (pairs, in all) for the paired-t ``ci`` interval of a contrast to reach ``half_width``.

    The smallest n >= 2 with ``t_{1-(1-ci)/2, n-1} · sd / sqrt(n) <= half_width``: the t quantile
    is recomputed at each candidate n's own df (not the normal quantile, which understates n at
    few seeds). ``sd`` is the SD of the per-seed differences observed after the first seeds; the
    rule plans at that SD, so the realised half-width is itself random (about half the time
    a little wider). Capped at ``cap`` (returned when the target needs more).
    """
    _check_cap(cap)
    if not 0 < ci < 1:
        raise ModbenchError(f"ci {ci} must lie strictly between 0 and 1")
    if not (math.isfinite(sd) and sd >= 0) or not (math.isfinite(half_width) and half_width > 0):
        raise ModbenchError(f"sd {sd!r} must be finite and >= 0 and half_width {half_width!r} finite and > 0")
    q = 1 - (1 - ci) / 2
    for n in range(2, cap + 1):
        if stats.t.ppf(q, n - 1) * sd / math.sqrt(n) <= half_width:
            return n
    return cap


def tost_power(sd: float, margin: float, n: int, *, alpha: float = 0.05, true_diff: float = 0.0) -> float:
    """Exact power of the paired TOST (equivalence within ±``margin`` at level ``alpha``) with
    ``n`` seeds when the per-seed differences are N(``true_diff``, ``sd``²).

    TOST rejects when −m + t_c·S/√n < D̄ < m − t_c·S/√n, t_c = t_{1−α, n−1}; D̄ and the sample SD S
    are independent, so the power is the normal probability of that interval integrated over
    the distribution of S (√(n−1)·S/sd ~ chi(n−1)), here by ``scipy.integrate.quad``
    (Owen 1965's formula in integral form). Unlike the shifted-t approximation it is never
    negative and is exact at any n >= 2.
    """
    if n < 2 or not sd > 0 or not margin > 0:
        raise ModbenchError(f"tost_power needs n >= 2, sd > 0 and margin > 0 (got n={n}, sd={sd}, margin={margin})")
    df = n - 1
    a = margin * math.sqrt(n) / sd  # the margin in standard errors
    b = true_diff * math.sqrt(n) / sd
    c = stats.t.ppf(1 - alpha, df) / math.sqrt(df)  # t_c·S/√n in SE units is c·u, u ~ chi(df)
    chi = stats.chi(df)

    def inside(u: float) -> float:
        return (stats.norm.cdf(a - c * u - b) - stats.norm.cdf(-a + c * u - b)) * chi.pdf(u)

    value, _ = integrate.quad(inside, 0.0, a / c, limit=200)
    return float(min(1.0, max(0.0, value)))


def seeds_for_equivalence(sd: float, margin: float, *, alpha: float = 0.05, power: float = POWER,
                          true_diff: float = 0.0, cap: int) -> int:
    """Seeds (pairs, in all) for the paired TOST within ±``margin`` to reach ``power`` when the
    per-seed differences have SD ``sd`` (the one observed after the first seeds) and mean
    ``true_diff`` (0: the arms are truly equal, the usual planning value).

    The smallest n >= 2 with :func:`tost_power` >= ``power``, capped at ``cap`` (returned when
    the target needs more, and whenever |true_diff| >= margin, where power never exceeds alpha).
    With a paired sd of 0.035 bpb and margin 0.05 at alpha = 0.05: 6 seeds give power 0.82, 8 give 0.95.
    """
    _check_cap(cap)
    if not (math.isfinite(sd) and sd >= 0) or not (math.isfinite(margin) and margin > 0):
        raise ModbenchError(f"sd {sd!r} must be finite and >= 0 and margin {margin!r} finite and > 0")
    if not 0 < power < 1 or not 0 < alpha < 0.5:
        raise ModbenchError(f"power {power} must lie in (0, 1) and alpha {alpha} in (0, 0.5)")
    if sd == 0:
        return 2 if abs(true_diff) < margin else cap
    for n in range(2, cap + 1):
        if tost_power(sd, margin, n, alpha=alpha, true_diff=true_diff) >= power:
            return n
    return cap

def _finite_or_none(x) -> float | None:
    return float(x) if x is not None and math.isfinite(float(x)) else None


def _equivalence(res, tost, alpha: float, margin: float | None) -> dict:
    """The (1 − 2·alpha) interval of a scipy t-test result and the TOST p within ±margin."""
    if margin is None:
        return dict(equiv_ci_low=None, equiv_ci_high=None, tost_p=None)
    low, high = res.confidence_interval(confidence_level=1 - 2 * alpha)
    with warnings.catch_warnings():  # zero spread: statsmodels divides by zero, the p is then undefined
        warnings.simplefilter("ignore", RuntimeWarning)
        p = tost()[0]
    return dict(equiv_ci_low=_finite_or_none(low), equiv_ci_high=_finite_or_none(high), tost_p=_finite_or_none(p))


def _paired(x: pd.Series, y: pd.Series, ci: float, alpha: float, margin: float | None) -> dict:
    seeds = sorted(set(x.index) & set(y.index))
    a, b = x.loc[seeds].to_numpy(), y.loc[seeds].to_numpy()
    d = a - b
    res = stats.ttest_rel(a, b)
    low, high = res.confidence_interval(confidence_level=ci)
    sd = float(np.std(d, ddof=1))
    return dict(estimate=float(d.mean()), ci_low=float(low), ci_high=float(high), p=float(res.pvalue),
                method="paired by seed (t)", sd=sd, paired=True, n=len(seeds)) \
        | _equivalence(res, lambda: _ttost()[0](a, b, -margin, margin), alpha, margin)


def _bootstrap(x: np.ndarray, y: np.ndarray, ci: float, n_resamples: int, seed: int, alpha: float,
               margin: float | None) -> dict:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        boot = stats.bootstrap((x, y), lambda a, b, axis=-1: a.mean(axis) - b.mean(axis), vectorized=True,
                               confidence_level=ci, method="BCa", n_resamples=n_resamples,
                               rng=np.random.default_rng(seed))
        welch = stats.ttest_ind(x, y, equal_var=False)
    pooled = math.sqrt(((x.size - 1) * x.var(ddof=1) + (y.size - 1) * y.var(ddof=1)) / (x.size + y.size - 2))
    return dict(estimate=float(x.mean() - y.mean()), ci_low=float(boot.confidence_interval.low),
                ci_high=float(boot.confidence_interval.high), p=float(welch.pvalue),
                method="bootstrap over seeds (BCa)", sd=pooled, paired=False, n=None) \
        | _equivalence(welch, lambda: _ttost()[1](x, y, -margin, margin, usevar="unequal"), alpha, margin)


def _ttost():
    """statsmodels' (ttost_paired, ttost_ind), imported when a test needs them: the study runner
    imports this module's sample-size rules on a lent GPU machine, which has no statsmodels."""
    from statsmodels.stats.weightstats import ttost_ind, ttost_paired

    return ttost_paired, ttost_ind


def _one(df, arm, ref, metric, by, seed_col, paired, ci, n_resamples, seed, alpha, margin) -> dict:
    x, y = _seed_values(df, arm, metric, by, seed_col), _seed_values(df, ref, metric, by, seed_col)
    base = dict(arm=arm, reference=ref, metric=metric, n_arm=len(x), n_ref=len(y), estimate=None,
                ci_low=None, ci_high=None, p=None, sd=None, paired=False, n=None,
                equiv_ci_low=None, equiv_ci_high=None, tost_p=None)
    shared = set(x.index) & set(y.index) if seed_col in df else set()
    use_paired = paired if paired is not None else len(shared) >= 2 and len(shared) == min(len(x), len(y))
    if use_paired and len(shared) >= 2:
        return base | _paired(x, y, ci, alpha, margin)
    if len(x) >= 2 and len(y) >= 2 and (np.ptp(x.to_numpy()) > 0 or np.ptp(y.to_numpy()) > 0):
        return base | _bootstrap(x.to_numpy(), y.to_numpy(), ci, n_resamples, seed, alpha, margin)
    why = "none: n<2" if min(len(x), len(y)) < 2 else "none: zero variance"
    return base | dict(method=why, estimate=float(x.mean() - y.mean()) if len(x) and len(y) else None)


def _adjust(rows: list[dict], key: str) -> None:
    """``{key}_adj``: Holm over the rows whose ``key`` is defined (the others stay None)."""
    tested = [r for r in rows if r[key] is not None]
    for r in rows:
        r[f"{key}_adj"] = None
    for r, p in zip(tested, holm([r[key] for r in tested])):
        r[f"{key}_adj"] = p


def _dunnett(df, rows, metric, by, seed_col, ci) -> None:
    refs = {r["reference"] for r in rows}
    if len(refs) != 1:
        raise ModbenchError(f"Dunnett's test needs one shared reference; this family has {accepted(sorted(refs))}")
    ref = refs.pop()
    control = _seed_values(df, ref, metric, by, seed_col).to_numpy()
    samples = [_seed_values(df, r["arm"], metric, by, seed_col).to_numpy() for r in rows]
    res = stats.dunnett(*samples, control=control)
    band = res.confidence_interval(confidence_level=ci)
    for i, r in enumerate(rows):
        r.update(p=float(res.pvalue[i]), p_adj=float(res.pvalue[i]), ci_low=float(band.low[i]),
                 ci_high=float(band.high[i]), method="dunnett (simultaneous CI)", paired=False)


def verdict_class(estimate: float | None, p_adj: float | None, tost_p_adj: float | None, alpha: float,
                  lower_is_better: bool = True) -> str:
    """better / worse (two-sided test significant after correction; this wins when the TOST is
    significant too), else equivalent (TOST significant after correction), else inconclusive."""
    if estimate is not None and p_adj is not None and p_adj < alpha:
        return "better" if (estimate < 0) == lower_is_better else "worse"
    if tost_p_adj is not None and tost_p_adj < alpha:
        return "equivalent"
    return "inconclusive"


def _verdict(r: dict, alpha: float) -> str:
    if r["estimate"] is None or r["p_adj"] is None:
        return "not testable (" + r["method"].removeprefix("none: ") + ")"
    within = f" within ±{r['margin']:g}" if r["tost_p_adj"] is not None and r["tost_p_adj"] < alpha else ""
    if r["verdict_class"] in ("better", "worse"):
        return f"{r['arm']} {'lower' if r['estimate'] < 0 else 'higher'} ({r['verdict_class']}){within}"
    if r["verdict_class"] == "equivalent":
        return f"equivalent{within} (TOST p = {r['tost_p_adj']:.2g})"
    mde = f"; the design detects |Δ| ≥ {r['mde']:.3g} with 80 % power" if r["mde"] else ""
    return f"no difference detected{mde}"


def compare_effects(df: pd.DataFrame, metric: str, comparisons: Sequence[tuple[str, str]], *, by: str = "arm",
                    seed_col: str = "seed", paired: bool | None = None, alpha: float = 0.05, ci: float = 0.95,
                    correction: str = "holm", lower_is_better: bool = True, n_resamples: int = 9999,
                    seed: int = 0, margin: float | None = None) -> pd.DataFrame:
    """One row (the fields of :class:`Effect`) per (arm, reference) pair of the declared family.

    ``paired=None`` pairs by seed when both arms ran the same seeds. The family for the
    correction (of the two-sided and of the TOST p-values) and for the MDE's level is exactly
    ``comparisons``. ``margin``: the equivalence margin (metric units) of the TOST.
    """
    if correction not in CORRECTIONS:
        raise ModbenchError(f"unknown correction {correction!r}: expected {accepted(CORRECTIONS)}")
    if not 0 < alpha < 0.5 or not 0 < ci < 1:
        raise ModbenchError(f"alpha {alpha} must lie strictly between 0 and 0.5 and ci {ci} between 0 and 1")
    if margin is not None and not (math.isfinite(margin) and margin > 0):
        raise ModbenchError(f"margin {margin!r} must be a positive number (metric units) or None")
    arms = set(df[by].astype(str)) if by in df else set()
    missing = sorted({a for pair in comparisons for a in pair} - arms)
    if missing:
        raise ModbenchError(f"arm {missing[0]!r} is not in the results: expected one of {accepted(sorted(arms))}")
    if correction == "dunnett":
        paired = False  # Dunnett's test compares independent samples with one control
    rows = [_one(df, a, r, metric, by, seed_col, paired, ci, n_resamples, seed, alpha, margin) for a, r in comparisons]
    m = max(1, len(rows))
    _adjust(rows, "p")
    tested = [r for r in rows if r["p"] is not None]
    if correction == "dunnett" and tested:
        _dunnett(df, tested, metric, by, seed_col, ci)
    _adjust(rows, "tost_p")
    for r in rows:
        paired_r, sd = r.pop("paired"), r.pop("sd")
        n = r.pop("n")
        r["correction"] = correction
        r["margin"] = margin
        r["mde"] = min_detectable_effect(sd, n or r["n_arm"], n or r["n_ref"], paired=paired_r,
                                         alpha=alpha / m) if sd else None
        r["seeds_needed"] = seeds_needed(r["estimate"], sd, paired=paired_r, alpha=alpha / m) \
            if sd and r["estimate"] else None
        r["verdict_class"] = verdict_class(r["estimate"], r["p_adj"], r["tost_p_adj"], alpha, lower_is_better)
        r["verdict"] = _verdict(r, alpha)
    return pd.DataFrame([{k: r[k] for k in EFFECT_COLUMNS} for r in rows], columns=EFFECT_COLUMNS)


@dataclass(frozen=True)
class Agreement:
    """A causal rule's decisions scored against the top-k decisions (True = processed)."""

    n: int
    agreement: float
    chance: float  # an independent rule with the same marginals: p·q + (1−p)(1−q)
    always_skip: float  # agreement of a rule that processes nothing: 1 − q
    precision: float | None  # of the rule's "process" decisions, the share top-k also processed
    recall: float | None  # of top-k's processed tokens, the share the rule processed
    kappa: float | None  # Cohen's kappa: (agreement − chance) / (1 − chance)

    def to_dict(self) -> dict:
        return asdict(self)


def agreement(decided, reference) -> Agreement:
    """Agreement of boolean decisions with a reference, beside the chance levels."""
    a = np.asarray(decided, dtype=bool).ravel()
    b = np.asarray(reference, dtype=bool).ravel()
    if a.shape != b.shape or a.size == 0:
        raise ModbenchError(f"decisions and reference must be non-empty and equally long ({a.size} vs {b.size})")
    p, q = a.mean(), b.mean()
    agree = float((a == b).mean())
    chance = float(p * q + (1 - p) * (1 - q))
    both = float((a & b).sum())
    return Agreement(
        n=int(a.size), agreement=agree, chance=chance, always_skip=float(1 - q),
        precision=both / a.sum() if a.any() else None, recall=both / b.sum() if b.any() else None,
        kappa=(agree - chance) / (1 - chance) if chance < 1 else None,
    )
