"""isoFLOP profiles: at a fixed training budget, which model size is best, and how good is it?

Raposo et al. 2024 (§4.1, Figure 3) compare MoD with the *isoFLOP-optimal* dense model: for
each FLOP budget, train several sizes, fit loss against log model size, and take the minimum
(the "approach 2" profile of Hoffmann et al. 2022). This module does that per family (dense,
a MoD variant at one capacity) and budget:

- **each size at its own best learning rate**: among the LR multipliers a size was trained at,
  the one with the lowest validation loss on the tuning seed (the seed every multiplier ran;
  the mean over seeds where no seed is common to all), and whether that best value is
  *bracketed* (a worse multiplier trained on each side of it);
- **the fit**: loss = a·u² + b·u + c in u = log10(parameters), ordinary least squares over the
  seed means of the sizes (one point per size: a size is its architecture, not its parameter
  count), residual df = sizes − 3;
- **uncertainty from the fit's residuals**, not from seeds: s² = RSS / df, cov(a, b, c) =
  s²·(XᵀX)⁻¹, and the delta method for the optimum u* = −b / 2a and its loss c − b² / 4a, with
  a Student-t quantile at the residual df. With three sizes the parabola passes exactly through
  them (0 residual df): the optimum is reported without a CI and flagged as an exact fit.
  An optimum outside the sizes trained (or a = 0 or a < 0) is no optimum: flagged, the sweep
  must be widened.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np
import pandas as pd
from scipy import stats

from modbench.errors import ModbenchError

MIN_SIZES = 3  # a parabola needs three sizes; a CI needs a fourth (residual df ≥ 1)
CONFIDENCE = 0.95


@dataclass(frozen=True)
class ProfileFit:
    family: str
    budget: float
    sizes: int
    df: int  # residual degrees of freedom of the fit (sizes − 3)
    a: float
    b: float
    c: float
    opt_params: float  # NaN when the optimum is not inside the sweep
    opt_low: float  # NaN without residual df
    opt_high: float
    opt_loss: float
    loss_low: float
    loss_high: float
    loss_se: float  # standard error of the optimum's loss (delta method); NaN without residual df
    inside: bool  # the fitted minimum lies strictly inside the sizes trained
    nearest_trained: float  # the trained size closest (in log size) to the optimum
    note: str  # "exact fit (0 residual df): no CI", "optimum at the edge of the sweep", …

    def to_dict(self) -> dict:
        return asdict(self)


def sized(points: pd.DataFrame) -> pd.DataFrame:
    """``points`` with a ``size`` column: its own, else each parameter count a size (a synthetic
    profile, or the tuning stage's one model per depth)."""
    return points if "size" in points else points.assign(size=points["params"].map(lambda p: f"{p:g} params"))


def best_lr_points(points: pd.DataFrame, tuning_seed: int | None = None) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Each (family, budget, size) at its own best LR multiplier.

    ``points``: family, budget, size (the architecture, e.g. "L3 d160"), params, lr_mult, seed, loss
    (one row per trial). A size is its architecture, never its parameter count: two models with one
    count (a recursive model and a vanilla one) are two sizes. Returns the rows at each size's best
    multiplier, and one row per size: the multipliers tried, the best, and whether it is bracketed."""
    keep, table = [], []
    points = sized(points)
    for (family, budget, size), g in points.groupby(["family", "budget", "size"], sort=False):
        best = _best_multiplier(g, tuning_seed)
        grid = sorted(g["lr_mult"].unique())
        keep.append(g[g["lr_mult"] == best])
        table.append({"family": family, "budget": budget, "size": size, "params": g["params"].iloc[0],
                      "lr grid": ", ".join(f"{m:g}" for m in grid),
                      "best lr_mult": best, "bracketed": 0 < grid.index(best) < len(grid) - 1,
                      "seeds at best": int((g["lr_mult"] == best).sum())})
    columns = ["family", "budget", "size", "params", "lr grid", "best lr_mult", "bracketed", "seeds at best"]
    table = pd.DataFrame(table, columns=columns).sort_values(["family", "budget", "params"], kind="stable")
    return (pd.concat(keep, ignore_index=True) if keep else points.iloc[:0]), table.reset_index(drop=True)


def dense_reference(best: pd.DataFrame, budget: float, tuning_seed: int | None, *,
                    family: str) -> tuple[pd.DataFrame, pd.DataFrame, str]:
    """The dense profile at ``budget`` and its best model: (the dense rows at each size's best LR at
    that budget, the rows the sizes are compared on, the best arm).

    Another budget (a positive control's) is another profile and never enters this one. The sizes
    are compared on the same data: the tuning seed, which every size and multiplier ran and on which
    a tuned study chose C1's reference; a size's mean over more seeds is not comparable with
    another's single seed. Without a tuning seed (or rows on it), each size's mean over its seeds."""
    dense = best[(best["family"] == family) & (best["budget"] == budget)]
    compared = dense[dense["seed"] == tuning_seed] if tuning_seed is not None else dense
    compared = compared if len(compared) else dense
    return dense, compared, str(compared.groupby("arm")["loss"].mean().idxmin()) if len(compared) else ""


def _best_multiplier(g: pd.DataFrame, tuning_seed: int | None) -> float:
    """Chosen on the seed every multiplier ran (the tuning seed when given), so each multiplier
    is judged on the same data; the mean over seeds when no seed is common to all."""
    per_lr = {m: set(s["seed"]) for m, s in g.groupby("lr_mult")}
    common = set.intersection(*per_lr.values())
    seed = tuning_seed if tuning_seed in common else (min(common) if common else None)
    scored = g[g["seed"] == seed] if seed is not None else g
    return float(scored.groupby("lr_mult")["loss"].mean().idxmin())


def _design(u: np.ndarray) -> np.ndarray:
    return np.column_stack([u**2, u, np.ones_like(u)])


def fit_profile(points: pd.DataFrame, family: str, budget: float) -> ProfileFit:
    """Fit one (family, budget) profile over the seed means of its sizes (``points`` already at
    each size's best LR: family, budget, params, loss)."""
    g = sized(points[(points["family"] == family) & (points["budget"] == budget)])
    g = g[np.isfinite(pd.to_numeric(g["loss"], errors="coerce"))]
    means = g.groupby(["size", "params"])["loss"].mean().droplevel("size").sort_index()  # one point per size
    if len(means) < MIN_SIZES:
        raise ModbenchError(f"isoFLOP profile {family} at {budget:g} FLOPs has {len(means)} model sizes: "
                            f"a parabola needs at least {MIN_SIZES}")
    u, y = np.log10(means.index.to_numpy(dtype=float)), means.to_numpy(dtype=float)
    X = _design(u)
    (a, b, c), *_ = np.linalg.lstsq(X, y, rcond=None)
    df = len(u) - 3
    inside = bool(a > 0 and u.min() < -b / (2 * a) < u.max())
    u_opt = -b / (2 * a) if inside else float(u[np.argmin(X @ np.array([a, b, c]))])
    loss_opt = float(np.array([u_opt**2, u_opt, 1.0]) @ np.array([a, b, c]))
    nearest = float(10 ** u[np.argmin(np.abs(u - u_opt))])
    nan = float("nan")
    u_lo = u_hi = l_lo = l_hi = l_se = nan
    if df >= 1 and inside:
        cov = float(np.sum((y - X @ np.array([a, b, c])) ** 2)) / df * np.linalg.inv(X.T @ X)
        t = stats.t.ppf(0.5 + CONFIDENCE / 2, df)
        grad_u = np.array([b / (2 * a**2), -1 / (2 * a), 0.0])  # ∂u*/∂(a, b, c)
        grad_l = np.array([b**2 / (4 * a**2), -b / (2 * a), 1.0])  # ∂(c − b²/4a)/∂(a, b, c)
        u_se, l_se = float(np.sqrt(grad_u @ cov @ grad_u)), float(np.sqrt(grad_l @ cov @ grad_l))
        u_lo, u_hi, l_lo, l_hi = u_opt - t * u_se, u_opt + t * u_se, loss_opt - t * l_se, loss_opt + t * l_se
    note = ("no interior minimum: the optimum is at an edge of the sizes trained (widen the sweep)" if not inside
            else "exact fit (0 residual df): no CI" if df == 0 else f"least squares, {df} residual df")
    return ProfileFit(family, float(budget), len(u), df, float(a), float(b), float(c),
                      float(10**u_opt) if inside else nan, float(10**u_lo), float(10**u_hi), loss_opt,
                      l_lo, l_hi, l_se, inside, nearest, note)


def profiles(points: pd.DataFrame, *, reference: str) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Every (family, budget) fit with at least three sizes, and each family's optimum loss minus
    the reference's at the same budget, with a CI only when both fits have residual df (standard
    errors combined in quadrature, t at the smaller df: conservative)."""
    points = sized(points)
    fits = {key: fit_profile(points, *key) for key, g in points.groupby(["family", "budget"])
            if g["size"].nunique() >= MIN_SIZES}
    rows = []
    for (family, budget), fit in fits.items():
        ref = fits.get((reference, budget))
        if family == reference or ref is None:
            continue
        diff = fit.opt_loss - ref.opt_loss
        row = dict(family=family, reference=reference, budget=budget, estimate=diff, ci_low=None, ci_high=None,
                   method="no CI: a fit without residual df")
        if np.isfinite(fit.loss_se) and np.isfinite(ref.loss_se):
            half = stats.t.ppf(0.5 + CONFIDENCE / 2, min(fit.df, ref.df)) * float(np.hypot(fit.loss_se, ref.loss_se))
            row.update(ci_low=diff - half, ci_high=diff + half, method="fit residuals (delta method), t at the smaller df")
        rows.append(row)
    columns = [f.name for f in ProfileFit.__dataclass_fields__.values()]
    return pd.DataFrame([f.to_dict() for f in fits.values()], columns=columns), pd.DataFrame(rows)
