"""Figures a paper could print: one style for every figure of a report.

- One colour per *variant* in every figure (``dense`` black, the random controls in greys),
  one marker per *capacity*, so a reader learns the legend once.
- Small multiples: one panel per variant, the dense reference drawn in each.
- A forest plot of effects (arm − reference, with the CI each comparison was tested with).
- The isoFLOP profile: loss against model size per family and budget, the fitted parabola in
  log size and each optimum with its bootstrap CI (Hoffmann et al. 2022, approach 2; the MoD
  paper's Figure 3 is drawn the same way).

Every figure is written twice, PNG at 200 dpi and PDF; each function returns the PNG path.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib
import matplotlib.ticker

matplotlib.use("Agg")
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

DPI = 200
_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")
_CONTROL_GREYS = {"random": "0.45", "random_gated": "0.6", "random_mlp": "0.75"}


def _learned_palette() -> list:
    """18 distinct colours, none grey (grey is the controls'): tab10 without its grey, then tab20's
    light shades without theirs."""
    tab10, tab20 = matplotlib.colormaps["tab10"], matplotlib.colormaps["tab20"]
    return [tab10(i) for i in range(10) if i != 7] + [tab20(i) for i in range(1, 20, 2) if i != 15]


def variant_colors(variants: list[str]) -> dict[str, object]:
    """Stable colours: dense black, controls grey, learned variants from a grey-free palette in name
    order (distinct up to 18 learned variants in one figure)."""
    palette = _learned_palette()
    learned = sorted(v for v in set(variants) if v != "dense" and v not in _CONTROL_GREYS)
    colors: dict[str, object] = {v: palette[i % len(palette)] for i, v in enumerate(learned)}
    colors.update({v: g for v, g in _CONTROL_GREYS.items() if v in variants})
    if "dense" in variants:
        colors["dense"] = "black"
    return colors


def capacity_markers(capacities) -> dict[float, str]:
    return {c: _MARKERS[i % len(_MARKERS)] for i, c in enumerate(sorted({float(c) for c in capacities}))}


def save_figure(fig: Figure, png: Path) -> Path:
    """Write ``png`` (200 dpi) and the same figure as PDF beside it."""
    fig.tight_layout()
    fig.savefig(png, dpi=DPI)
    fig.savefig(png.with_suffix(".pdf"))
    return png


def forest_plot(effects: pd.DataFrame, png: Path, *, metric_label: str = "Δ causal bpb (arm − reference)") -> Path:
    """One row per comparison: the estimate and its CI; left of zero means the arm is lower."""
    rows = effects.reset_index(drop=True)
    fig = Figure(figsize=(7.5, 0.45 * len(rows) + 1.4))
    ax = fig.add_subplot()
    y = np.arange(len(rows))[::-1]
    ok = rows["ci_low"].notna() & rows["ci_high"].notna()
    est = pd.to_numeric(rows["estimate"], errors="coerce").to_numpy(dtype=float)
    lo = pd.to_numeric(rows["ci_low"], errors="coerce").to_numpy(dtype=float)
    hi = pd.to_numeric(rows["ci_high"], errors="coerce").to_numpy(dtype=float)
    ax.hlines(y[ok], lo[ok], hi[ok], color="black", lw=1.5)
    ax.plot(est, y, "s", color="black", ms=5)
    ax.axvline(0.0, color="0.5", ls="--", lw=1)
    ax.set_yticks(y, [f"{a} − {r}" for a, r in zip(rows["arm"], rows["reference"])], fontsize=8)
    ax.set_xlabel(metric_label)
    for yi, e, l, h in zip(y, est, lo, hi):
        if np.isfinite(e):
            ci = f" [{l:+.3f}, {h:+.3f}]" if np.isfinite(l) and np.isfinite(h) else ""
            ax.annotate(f"{e:+.3f}{ci}", (np.nanmax(hi[np.isfinite(hi)]) if np.isfinite(hi).any() else e, yi),
                        xytext=(6, -3), textcoords="offset points", fontsize=7)
    ax.grid(alpha=0.3, axis="x")
    ax.set_title("Effects with 95 % CIs (Holm-corrected p in the table)", fontsize=9)
    return save_figure(fig, png)


def small_multiples(curves: pd.DataFrame, png: Path, *, x: str = "flops", y: str = "val_bpb",
                    xlabel: str = "training FLOPs", ylabel: str = "validation bpb", reference: str | None = None) -> Path:
    """One panel per variant, one line per arm (mean over seeds; marker = capacity, line style =
    the arm's order within its variant); the ``reference`` arm (default: the arm labelled
    "dense", if any) dashed in every panel. Dense arms other than the reference get a panel."""
    reference = reference if reference is not None else ("dense" if (curves["arm"] == "dense").any() else None)
    others = curves[curves["arm"] != reference]
    variants = sorted(others["variant"].unique(), key=lambda v: (v == "dense", v)) or ["dense"]
    colors = variant_colors(list(curves["variant"].unique()))
    markers = capacity_markers(curves["capacity"].unique())
    cols = min(3, len(variants))
    rows = -(-len(variants) // cols)
    fig = Figure(figsize=(3.6 * cols, 2.8 * rows))
    ref = curves[curves["arm"] == reference].groupby("step")[[x, y]].mean()
    axes = [fig.add_subplot(rows, cols, i + 1) for i in range(len(variants))]
    for ax, variant in zip(axes, variants):
        if len(ref):
            ax.plot(ref[x], ref[y], color="black", ls="--", lw=1, label=reference)
        for i, (arm, g) in enumerate(others[others["variant"] == variant].groupby("arm", sort=False)):
            mean = g.groupby("step")[[x, y]].mean()
            ax.plot(mean[x], mean[y], color=colors[variant], marker=markers[float(g["capacity"].iloc[0])], ms=3, lw=1.2,
                    ls=("-", ":", "-.", (0, (5, 1)))[i % 4], label=arm)
        ax.set_title(variant, fontsize=9)
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.grid(alpha=0.3)
        ax.tick_params(labelsize=7)
        ax.legend(fontsize=6)
    for ax in axes[-cols:]:
        ax.set_xlabel(xlabel, fontsize=8)
    for ax in axes[::cols]:
        ax.set_ylabel(ylabel, fontsize=8)
    return save_figure(fig, png)


def isoflop_profile(points: pd.DataFrame, fits: pd.DataFrame, png: Path) -> Path:
    """Loss vs parameters per (family, budget): seed means, the parabola fit, each optimum ± CI.

    ``points``: family, budget, params, loss (one row per trial); ``fits``: family, budget,
    a, b, c (loss = a·u² + b·u + c in u = log10 params), opt_params, opt_low, opt_high, opt_loss.
    """
    fig = Figure(figsize=(7, 4.8))
    ax = fig.add_subplot()
    colors = {"dense": "black", **{f: c for f, c in variant_colors(list(points["family"].unique())).items()}}
    styles = {b: s for b, s in zip(sorted(points["budget"].unique()), ("-", "--", ":", "-."))}
    for (family, budget), g in points.groupby(["family", "budget"]):
        mean = g.groupby("params")["loss"].mean()
        color, style = colors.get(family, "tab:blue"), styles[budget]
        ax.plot(mean.index, mean.values, "o", color=color, ms=4)
        fit = fits[(fits["family"] == family) & (fits["budget"] == budget)]
        if len(fit):
            f = fit.iloc[0]
            u = np.linspace(np.log10(mean.index.min()), np.log10(mean.index.max()), 100)
            ax.plot(10**u, f.a * u**2 + f.b * u + f.c, style, color=color, lw=1.2,
                    label=f"{family}, {budget:.2g} FLOPs")
            if np.isfinite(f.opt_params):
                ax.errorbar([f.opt_params], [f.opt_loss], xerr=[[f.opt_params - f.opt_low], [f.opt_high - f.opt_params]],
                            fmt="*", color=color, ms=11, capsize=3)
    ax.set_xscale("log")
    ax.set_xlabel("parameters (non-embedding)")
    ax.set_ylabel("validation bpb")
    ax.set_title("isoFLOP profiles: ★ = fitted optimum, bar = 95 % bootstrap CI over seeds", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return save_figure(fig, png)
