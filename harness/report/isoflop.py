"""isoFLOP profiles: at a fixed training budget, which model size is best, and how good is it?

Raposo et al. 2024 (§4.1, Figure 3) compare MoD with the *isoFLOP-optimal* dense model: for
each FLOP budget, train several sizes, fit loss against log model size, and take the minimum
(the "approach 2" profile of Hoffmann et al. 2022). This module does that per family (dense,
a MoD variant at one capacity) and budget:

- the fit: loss = a·u² + b·u + c in u = log10(parameters), least squares over the seed means
  of each size (``numpy.polyfit``); the optimum u* = −b / 2a when a > 0 and u* lies inside
  the sizes trained (otherwise the optimum is at an edge of the sweep and is reported as
  such: the sweep must be widened before a conclusion is drawn);
- uncertainty: a bootstrap over seeds (each size's seeds resampled with replacement, the fit
  repeated; 2,000 resamples, fixed RNG), giving percentile CIs of the optimum's size and loss;
- comparison optimum vs optimum: the bootstrap distribution of loss*(family) − loss*(dense).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np
import pandas as pd

from modbench.errors import ModbenchError

RESAMPLES = 2000


@dataclass(frozen=True)
class ProfileFit:
    family: str
    budget: float
    sizes: int
    a: float
    b: float
    c: float
    opt_params: float  # NaN when the optimum is not inside the sweep
    opt_low: float
    opt_high: float
    opt_loss: float
    loss_low: float
    loss_high: float
    inside: bool  # the fitted minimum lies strictly inside the sizes trained

    def to_dict(self) -> dict:
        return asdict(self)


def _fit(u: np.ndarray, loss: np.ndarray) -> tuple[float, float, float, float, float, bool]:
    a, b, c = np.polyfit(u, loss, 2)
    if a > 0 and u.min() < -b / (2 * a) < u.max():
        u_opt = -b / (2 * a)
        return a, b, c, u_opt, a * u_opt**2 + b * u_opt + c, True
    # No interior minimum: the best size trained is the best estimate, flagged as an edge.
    i = int(np.argmin(a * u**2 + b * u + c))
    return a, b, c, float(u[i]), float(a * u[i] ** 2 + b * u[i] + c), False


def _resample_means(groups: list[np.ndarray], rng: np.random.Generator) -> np.ndarray:
    return np.array([g[rng.integers(0, len(g), len(g))].mean() for g in groups])


def _bootstrap(u: np.ndarray, groups: list[np.ndarray], rng: np.random.Generator) -> np.ndarray:
    """(RESAMPLES, 2): the optimum's u and loss under resampled seeds."""
    out = np.empty((RESAMPLES, 2))
    for i in range(RESAMPLES):
        _, _, _, u_opt, l_opt, _ = _fit(u, _resample_means(groups, rng))
        out[i] = u_opt, l_opt
    return out


def fit_profile(points: pd.DataFrame, family: str, budget: float, *, seed: int = 0) -> tuple[ProfileFit, np.ndarray]:
    """Fit one (family, budget) profile; also returns the bootstrap draws of the optimum's loss."""
    g = points[(points["family"] == family) & (points["budget"] == budget)]
    g = g[np.isfinite(pd.to_numeric(g["loss"], errors="coerce"))]
    by_size = [(p, s["loss"].to_numpy(dtype=float)) for p, s in g.groupby("params")]
    if len(by_size) < 3:
        raise ModbenchError(f"isoFLOP profile {family} at {budget:g} FLOPs has {len(by_size)} model sizes: "
                            "a parabola needs at least 3")
    u = np.log10([p for p, _ in by_size])
    groups = [v for _, v in by_size]
    a, b, c, u_opt, l_opt, inside = _fit(u, np.array([v.mean() for v in groups]))
    draws = _bootstrap(u, groups, np.random.default_rng(seed))
    (u_lo, u_hi), (l_lo, l_hi) = np.percentile(draws[:, 0], [2.5, 97.5]), np.percentile(draws[:, 1], [2.5, 97.5])
    fit = ProfileFit(family, float(budget), len(by_size), float(a), float(b), float(c),
                     float(10**u_opt) if inside else float("nan"), float(10**u_lo), float(10**u_hi),
                     float(l_opt), float(l_lo), float(l_hi), inside)
    return fit, draws[:, 1]


def profiles(points: pd.DataFrame, *, reference: str = "dense", seed: int = 0) -> tuple[pd.DataFrame, pd.DataFrame]:
    """All fits, and each family's optimum minus the reference's at the same budget (with CI)."""
    fits, draws = [], {}
    for (family, budget), _ in points.groupby(["family", "budget"]):
        fit, d = fit_profile(points, family, budget, seed=seed)
        fits.append(fit.to_dict())
        draws[(family, budget)] = d
    rows = []
    for (family, budget), d in draws.items():
        if family == reference or (reference, budget) not in draws:
            continue
        diff = d - draws[(reference, budget)]
        rows.append(dict(family=family, reference=reference, budget=budget,
                         estimate=float(np.median(diff)), ci_low=float(np.percentile(diff, 2.5)),
                         ci_high=float(np.percentile(diff, 97.5)), method="bootstrap over seeds (optimum vs optimum)"))
    return pd.DataFrame(fits), pd.DataFrame(rows)
