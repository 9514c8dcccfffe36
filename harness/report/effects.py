"""Effects that answer a study's questions: differences with confidence intervals, corrected
over the family of comparisons the study declares, with the power to see them.

A claim such as "MoD beats the matched dense model" is a difference, arm − reference, of a
metric over seeds. For each declared comparison this module gives:

- **the estimate and its 95 % CI**, by one of two methods, named in ``method``:
  *paired by seed* when both arms ran the same seeds (in modbench a seed fixes the data order,
  the initialisation and the routing noise, so seed s of two arms saw the same batches): the
  mean of the per-seed differences with its Student-t interval (``scipy.stats.ttest_rel``);
  otherwise *bootstrap over seeds*: the BCa bootstrap of the difference of means
  (``scipy.stats.bootstrap``, seeds resampled within each arm, fixed RNG seed), with Welch's
  test for the p-value;
- **the p-value corrected over the family**: Holm's step-down (any dependence; the default), or
  Dunnett's many-to-one test (``scipy.stats.dunnett``, unpaired only, one shared reference),
  whose confidence intervals are simultaneous;
- **the minimum detectable effect** (MDE): the smallest |difference| the same design detects
  with 80 % power at the family's per-comparison level (α/m, Bonferroni, which is what Holm
  demands of its smallest p-value), from the noncentral t distribution with the observed
  spread; and **the seeds needed** per arm to detect the observed difference with that power;
- **a verdict** in words: lower / higher / no difference detected (with the MDE).

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
from scipy import optimize, stats

from modbench.errors import ModbenchError, accepted

CORRECTIONS = ("holm", "dunnett")
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
    verdict: str


EFFECT_COLUMNS = [f.name for f in fields(Effect)]


def _finite(values) -> np.ndarray:
    x = np.asarray(values, dtype=float)
    return x[np.isfinite(x)]


def _seed_values(df: pd.DataFrame, arm: str, metric: str, by: str, seed_col: str) -> pd.Series:
    """The arm's metric indexed by seed, failed (non-finite) trials dropped."""
    rows = df[df[by] == arm]
    values = pd.to_numeric(rows[metric], errors="coerce").astype(float)
    series = pd.Series(values.to_numpy(), index=rows[seed_col].to_numpy()) if seed_col in rows else values
    return series[np.isfinite(series.to_numpy())]


def _power(delta: float, se: float, df: int, alpha: float) -> float:
    """Power of a two-sided t test at level ``alpha`` when the true difference is ``delta``."""
    t_crit = stats.t.ppf(1 - alpha / 2, df)
    nc = abs(delta) / se
    power = float(stats.nct.sf(t_crit, df, nc) + stats.nct.cdf(-t_crit, df, nc))
    if math.isnan(power):  # scipy's noncentral t fails far in the tail, where power is ~0 or ~1
        return 1.0 if nc > t_crit else 0.0
    return power


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
    for n in range(2, MAX_SEEDS + 1):
        df = n - 1 if paired else 2 * n - 2
        se = sd / math.sqrt(n) if paired else sd * math.sqrt(2 / n)
        if _power(effect, se, df, alpha) >= power - 1e-9:  # the MDE itself must map back to n
            return n
    return None


def _paired(x: pd.Series, y: pd.Series, ci: float) -> dict:
    seeds = sorted(set(x.index) & set(y.index))
    d = x.loc[seeds].to_numpy() - y.loc[seeds].to_numpy()
    res = stats.ttest_rel(x.loc[seeds].to_numpy(), y.loc[seeds].to_numpy())
    low, high = res.confidence_interval(confidence_level=ci)
    sd = float(np.std(d, ddof=1))
    return dict(estimate=float(d.mean()), ci_low=float(low), ci_high=float(high), p=float(res.pvalue),
                method="paired by seed (t)", sd=sd, paired=True, n=len(seeds))


def _bootstrap(x: np.ndarray, y: np.ndarray, ci: float, n_resamples: int, seed: int) -> dict:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        boot = stats.bootstrap((x, y), lambda a, b, axis=-1: a.mean(axis) - b.mean(axis), vectorized=True,
                               confidence_level=ci, method="BCa", n_resamples=n_resamples,
                               rng=np.random.default_rng(seed))
        welch = stats.ttest_ind(x, y, equal_var=False)
    pooled = math.sqrt(((x.size - 1) * x.var(ddof=1) + (y.size - 1) * y.var(ddof=1)) / (x.size + y.size - 2))
    return dict(estimate=float(x.mean() - y.mean()), ci_low=float(boot.confidence_interval.low),
                ci_high=float(boot.confidence_interval.high), p=float(welch.pvalue),
                method="bootstrap over seeds (BCa)", sd=pooled, paired=False, n=None)


def _one(df, arm, ref, metric, by, seed_col, paired, ci, n_resamples, seed) -> dict:
    x, y = _seed_values(df, arm, metric, by, seed_col), _seed_values(df, ref, metric, by, seed_col)
    base = dict(arm=arm, reference=ref, metric=metric, n_arm=len(x), n_ref=len(y), estimate=None,
                ci_low=None, ci_high=None, p=None, sd=None, paired=False, n=None)
    shared = set(x.index) & set(y.index) if seed_col in df else set()
    use_paired = paired if paired is not None else len(shared) >= 2 and len(shared) == min(len(x), len(y))
    if use_paired and len(shared) >= 2:
        return base | _paired(x, y, ci)
    if len(x) >= 2 and len(y) >= 2 and (np.ptp(x.to_numpy()) > 0 or np.ptp(y.to_numpy()) > 0):
        return base | _bootstrap(x.to_numpy(), y.to_numpy(), ci, n_resamples, seed)
    why = "none: n<2" if min(len(x), len(y)) < 2 else "none: zero variance"
    return base | dict(method=why, estimate=float(x.mean() - y.mean()) if len(x) and len(y) else None)


def _holm(p: Sequence[float]) -> list[float]:
    order = np.argsort(p, kind="mergesort")
    m = len(p)
    adjusted = np.minimum(1.0, np.maximum.accumulate((m - np.arange(m)) * np.asarray(p)[order]))
    out = np.empty(m)
    out[order] = adjusted
    return out.tolist()


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


def _verdict(r: dict, alpha: float, lower_is_better: bool) -> str:
    if r["estimate"] is None or r["p_adj"] is None:
        return "not testable (" + r["method"].removeprefix("none: ") + ")"
    if r["p_adj"] >= alpha:
        mde = f"; the design detects |Δ| ≥ {r['mde']:.3g} with 80 % power" if r["mde"] else ""
        return f"no difference detected{mde}"
    better = (r["estimate"] < 0) == lower_is_better
    return f"{r['arm']} {'lower' if r['estimate'] < 0 else 'higher'} ({'better' if better else 'worse'})"


def compare_effects(df: pd.DataFrame, metric: str, comparisons: Sequence[tuple[str, str]], *, by: str = "arm",
                    seed_col: str = "seed", paired: bool | None = None, alpha: float = 0.05, ci: float = 0.95,
                    correction: str = "holm", lower_is_better: bool = True, n_resamples: int = 9999,
                    seed: int = 0) -> pd.DataFrame:
    """One row (the fields of :class:`Effect`) per (arm, reference) pair of the declared family.

    ``paired=None`` pairs by seed when both arms ran the same seeds. The family for the
    correction and for the MDE's level is exactly ``comparisons``.
    """
    if correction not in CORRECTIONS:
        raise ModbenchError(f"unknown correction {correction!r}: expected {accepted(CORRECTIONS)}")
    if not 0 < alpha < 1 or not 0 < ci < 1:
        raise ModbenchError(f"alpha {alpha} and ci {ci} must lie strictly between 0 and 1")
    arms = set(df[by].astype(str)) if by in df else set()
    missing = sorted({a for pair in comparisons for a in pair} - arms)
    if missing:
        raise ModbenchError(f"arm {missing[0]!r} is not in the results: expected one of {accepted(sorted(arms))}")
    if correction == "dunnett":
        paired = False  # Dunnett's test compares independent samples with one control
    rows = [_one(df, a, r, metric, by, seed_col, paired, ci, n_resamples, seed) for a, r in comparisons]
    m = max(1, len(rows))
    tested = [r for r in rows if r["p"] is not None]
    for r in rows:
        r["p_adj"] = None
    if correction == "dunnett" and tested:
        _dunnett(df, tested, metric, by, seed_col, ci)
    else:
        for r, p in zip(tested, _holm([r["p"] for r in tested]) if tested else []):
            r["p_adj"] = p
    for r in rows:
        paired_r, sd = r.pop("paired"), r.pop("sd")
        n = r.pop("n")
        r["correction"] = correction
        r["mde"] = min_detectable_effect(sd, n or r["n_arm"], n or r["n_ref"], paired=paired_r,
                                         alpha=alpha / m) if sd else None
        r["seeds_needed"] = seeds_needed(r["estimate"], sd, paired=paired_r, alpha=alpha / m) \
            if sd and r["estimate"] else None
        r["verdict"] = _verdict(r, alpha, lower_is_better)
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
