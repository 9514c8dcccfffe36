"""Every figure of a report, in one style: PNG at 200 dpi and the same figure as PDF.

- One colour per *variant* in every figure (``dense`` black, the random controls in greys; the
  arms of one variant shades of it), one marker per *capacity*, so a reader learns the legend once.
- Small multiples of learning curves: one panel per variant, the claim's dense reference
  (the arm the claim compares against, not any dense arm) dashed in each.
- A forest plot of effects: per claim family a block, each comparison's estimate, its CI and
  its per-seed paired differences; labels outside the axes, never clipped, with true minus signs.
- The isoFLOP profile: per-seed points at each size's best LR, the seed means, the quadratic
  fit in log size labelled with its residual df (Hoffmann et al. 2022, approach 2; the MoD
  paper's Figure 3 is drawn the same way), the optimum with its CI when the fit has one, and
  the MoD arms at their own size.
- Diagnostics: validation curves, Pareto scatters, capacity, throughput, routing by position,
  and the routing heatmap redrawn from a checkpoint.

Each function writes ``<name>.png`` and ``<name>.pdf`` and returns the PNG path.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib
import matplotlib.ticker

matplotlib.use("Agg")
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.transforms import blended_transform_factory  # noqa: E402
from scipy import stats  # noqa: E402

from modbench.report.isoflop import sized  # noqa: E402

DPI = 200
MINUS = "\u2212"  # a true minus sign: a hyphen reads as a dash in a table of signed numbers
_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")
# The colour of each role: the baseline black, each random control a grey of its own. Written here, not
# read from the registry, because the statistics path (tests/test_effects.py under .ci/min_versions.sh)
# runs without torch, which the registry imports; tests/test_arm.py checks both against the registry's roles.
DENSE = "dense"
_CONTROL_GREYS = {"random": "0.45", "random_gated": "0.6", "random_mlp": "0.75"}


def _learned_palette() -> list:
    """23 distinct colours, none grey (grey is the controls'): tab10 without its grey, then tab20's
    light shades without theirs, then the darkest shade of each of tab20b's five hues."""
    tab10, tab20, tab20b = (matplotlib.colormaps[name] for name in ("tab10", "tab20", "tab20b"))
    return ([tab10(i) for i in range(10) if i != 7] + [tab20(i) for i in range(1, 20, 2) if i != 15]
            + [tab20b(i) for i in range(0, 20, 4)])


def variant_colors(variants: list[str]) -> dict[str, object]:
    """Stable colours: dense black, controls grey, learned variants from a grey-free palette in name
    order (distinct up to 23 learned variants in one figure)."""
    palette = _learned_palette()
    learned = sorted(v for v in set(variants) if v != DENSE and v not in _CONTROL_GREYS)
    colors: dict[str, object] = {v: palette[i % len(palette)] for i, v in enumerate(learned)}
    colors.update({v: g for v, g in _CONTROL_GREYS.items() if v in variants})
    if DENSE in variants:
        colors[DENSE] = "black"
    return colors


def capacity_markers(capacities) -> dict[float, str]:
    return {c: _MARKERS[i % len(_MARKERS)] for i, c in enumerate(sorted({float(c) for c in capacities}))}


def signed(x: float, digits: int = 3) -> str:
    """``+0.012`` / ``−0.034`` with a true minus sign."""
    return f"{x:+.{digits}f}".replace("-", MINUS)


def save_figure(fig: Figure, png: Path) -> Path:
    """Write ``png`` at 200 dpi and the same figure as PDF beside it; the bounding box is fitted to
    everything drawn (labels placed outside the axes included), so nothing is clipped."""
    png = Path(png)
    png.parent.mkdir(parents=True, exist_ok=True)
    if fig.get_layout_engine() is None:
        fig.tight_layout()
    fig.savefig(png, dpi=DPI, bbox_inches="tight", pad_inches=0.05)
    fig.savefig(png.with_suffix(".pdf"), bbox_inches="tight", pad_inches=0.05)
    return png


def _numeric(s: pd.Series) -> np.ndarray:
    return pd.to_numeric(s, errors="coerce").to_numpy(dtype=float)


def _forest_rows(effects: pd.DataFrame) -> tuple[list[tuple[str, pd.DataFrame]], int]:
    """The comparisons in blocks, one per claim family, in the order given; and the row count
    with one header row per block."""
    rows = effects.reset_index(drop=True)
    family = rows["claim"].astype(str) if "claim" in rows else pd.Series("", index=rows.index)
    blocks = [(f, rows[family == f]) for f in dict.fromkeys(family)]
    return blocks, len(rows) + sum(1 for f, _ in blocks if f)


def forest_plot(effects: pd.DataFrame, png: Path, *, per_seed: pd.DataFrame | None = None,
                margins: dict[str, float] | None = None,
                metric_label: str = "Δ causal bpb (arm − reference)") -> Path:
    """One row per comparison: the estimate (square), its CI (bar) and, where given, the per-seed
    paired differences (dots; ``per_seed``: arm, reference, diff and optionally claim). Claim
    families are separate blocks; a family's equivalence margin (``margins``) is shaded. Left of
    zero: the arm is lower (better). Numbers are printed right of the axes, never clipped."""
    blocks, n_rows = _forest_rows(effects)
    longest = max((len(f"{a} − {r}") for a, r in zip(effects["arm"], effects["reference"])), default=0)
    fig = Figure(figsize=(max(7.5, 5.5 + 0.07 * longest), 0.42 * n_rows + 1.5))  # room for the labels and the axes
    ax = fig.add_subplot()
    label_at = blended_transform_factory(ax.transAxes, ax.transData)
    ticks, names, xs = [], [], [0.0]
    y = n_rows
    for family, block in blocks:
        if family:
            y -= 1
            ax.text(-0.01, y, family, transform=label_at, ha="right", va="center", fontsize=9, fontweight="bold")
            if y < n_rows - 1:
                ax.axhline(y + 0.5, color="0.8", lw=0.8)
            margin = (margins or {}).get(family)
            if margin:
                top, bottom = y + 0.45, y - len(block) - 0.45
                ax.fill_betweenx([bottom, top], -margin, margin, color="tab:green", alpha=0.12, lw=0)
                xs += [-margin, margin]
        for _, r in block.iterrows():
            y -= 1
            est, lo, hi = (float(pd.to_numeric(pd.Series([r.get(k)]), errors="coerce").iloc[0])
                           for k in ("estimate", "ci_low", "ci_high"))
            if np.isfinite(lo) and np.isfinite(hi):
                ax.hlines(y, lo, hi, color="black", lw=1.5)
                xs += [lo, hi]
            if np.isfinite(est):
                ax.plot([est], [y], "s", color="black", ms=5, zorder=3)
                xs.append(est)
            dots = _seed_diffs(per_seed, family, r["arm"], r["reference"])
            if len(dots):
                jitter = np.linspace(-0.15, 0.15, len(dots)) if len(dots) > 1 else np.zeros(1)
                ax.plot(dots, y + jitter, "o", color="tab:blue", ms=3, alpha=0.7, zorder=2)
                xs += list(dots)
            ci = f" [{signed(lo)}, {signed(hi)}]" if np.isfinite(lo) and np.isfinite(hi) else " (no CI)"
            ax.text(1.02, y, (signed(est) + ci) if np.isfinite(est) else "n/a", transform=label_at,
                    va="center", fontsize=7, family="DejaVu Sans")
            ticks.append(y)
            names.append(f"{r['arm']} − {r['reference']}")
    ax.axvline(0.0, color="0.5", ls="--", lw=1)
    ax.set_yticks(ticks, names, fontsize=7)
    ax.set_ylim(-0.6, n_rows - 0.4)
    span = max(xs) - min(xs) or 0.1
    ax.set_xlim(min(xs) - 0.06 * span, max(xs) + 0.06 * span)
    ax.set_xlabel(metric_label)
    ax.grid(alpha=0.3, axis="x")
    ax.set_title("Effects: ■ estimate, bar 95 % CI, ● per-seed paired differences"
                 + (", shaded ± equivalence margin" if margins else ""), fontsize=8)
    return save_figure(fig, png)


def _seed_diffs(per_seed: pd.DataFrame | None, family: str, arm: str, reference: str) -> np.ndarray:
    if per_seed is None or per_seed.empty:
        return np.array([])
    hit = (per_seed["arm"] == arm) & (per_seed["reference"] == reference)
    if "claim" in per_seed and family:
        hit &= per_seed["claim"].astype(str) == family
    return _numeric(per_seed.loc[hit, "diff"])


def best_dense_arm(curves: pd.DataFrame, y: str = "val_bpb") -> str | None:
    """The dense arm with the lowest final mean value: the strongest dense, never the weakest."""
    dense = curves[curves["variant"] == DENSE]
    if dense.empty:
        return None
    runs = ["arm", "seed"] if "seed" in dense else ["arm"]  # each run's final value, then the mean over seeds
    last = dense.sort_values("step").groupby(runs)[y].last().groupby("arm").mean()
    return str(last.idxmin())


def small_multiples(curves: pd.DataFrame, png: Path, *, x: str = "flops", y: str = "val_bpb",
                    xlabel: str = "training FLOPs", ylabel: str = "validation bpb", reference: str | None = None,
                    reference_label: str | None = None) -> Path:
    """One panel per variant, one line per arm (mean over seeds; marker = capacity, line style =
    the arm's order within its variant); the ``reference`` arm dashed in every panel. Pass the
    claim's reference; without one, the best dense arm (lowest final value) is drawn. Dense arms
    other than the reference get their own panel."""
    reference = reference if reference is not None else best_dense_arm(curves, y)
    others = curves[curves["arm"] != reference]
    variants = sorted(others["variant"].unique(), key=lambda v: (v == DENSE, v)) or [DENSE]
    colors = variant_colors(list(curves["variant"].unique()))
    markers = capacity_markers(curves["capacity"].unique())
    cols = min(2, len(variants))
    rows = -(-len(variants) // cols)
    # Legends go under their panel, never over the curves; the figure is sized so each panel stays
    # readable at print size (ticks 8 pt, labels 9 pt on a 5-inch-wide panel).
    most = max((others[others["variant"] == v]["arm"].nunique() for v in variants), default=0) + 1
    fig = Figure(figsize=(5.2 * cols, (3.4 + 0.17 * most) * rows), layout="constrained")
    ref = curves[curves["arm"] == reference].groupby("step")[[x, y]].mean()
    axes = [fig.add_subplot(rows, cols, i + 1) for i in range(len(variants))]
    # One y-range for every panel, from every arm's mean curve: panels (and the FLOPs and tokens
    # figures, drawn from the same curves) compare at a glance.
    means = curves.groupby(["arm", "step"])[y].mean()
    pad = 0.04 * float(means.max() - means.min() or 1.0)
    ylim = (float(means.min()) - pad, float(means.max()) + pad)
    for ax, variant in zip(axes, variants):
        if len(ref):
            ax.plot(ref[x], ref[y], color="black", ls="--", lw=1.2, label=reference_label or f"reference: {reference}")
        panel = list(others[others["variant"] == variant].groupby("arm", sort=False))
        for i, (arm, g) in enumerate(panel):
            mean = g.groupby("step")[[x, y]].mean()
            ax.plot(mean[x], mean[y], color=_shade(colors[variant], i, len(panel)),
                    marker=markers[float(g["capacity"].iloc[0])], ms=3.5, lw=1.4,
                    ls=("-", ":", "-.", (0, (5, 1)))[i % 4], label=arm)
        ax.set_title(variant, fontsize=10)
        ax.set_ylim(*ylim)
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.grid(alpha=0.3)
        ax.tick_params(labelsize=8)
        ax.set_xlabel(xlabel, fontsize=9)
        ax.set_ylabel(ylabel, fontsize=9)
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.2), frameon=False, ncol=1)
    return save_figure(fig, png)


def _shade(color, i: int, n: int):
    """The ``i``-th of ``n`` shades of a variant's colour, from the colour itself towards white (at
    most 60 % of the way), so the arms of one panel stay the variant's colour yet tell apart."""
    rgb = np.array(matplotlib.colors.to_rgb(color))
    return tuple(rgb + (1 - rgb) * (0.6 * i / max(n - 1, 1)))


def _fit_label(family: str, fit: pd.Series) -> str:
    if int(fit["df"]) == 0:
        return f"{family}: quadratic fit through 3 sizes (exact, 0 residual df, no CI)"
    return f"{family}: least-squares quadratic fit in log size ({int(fit['df'])} residual df)"


def isoflop_profile(points: pd.DataFrame, fits: pd.DataFrame, png: Path, *, others: pd.DataFrame | None = None,
                    mod: pd.DataFrame | None = None) -> Path:
    """Loss against parameters per (family, budget).

    ``points``: family, budget, params, seed, loss — the trials at each size's best LR (dots: one
    per seed; circles: the seed means); ``others``: the same columns for the trials at the other
    LRs tried (faint crosses); ``fits``: family, budget, df, a, b, c (loss = a·u² + b·u + c in
    u = log10 params), opt_params, opt_low, opt_high, opt_loss; ``mod``: arm, variant, params,
    seed, loss — the MoD arms compared with the dense optimum, drawn at their own size."""
    fig = Figure(figsize=(7.5, 6.5))
    ax = fig.add_subplot()
    families = list(points["family"].unique()) + (list(mod["variant"].unique()) if mod is not None else [])
    colors = {DENSE: "black", **variant_colors(families)}
    styles = {b: s for b, s in zip(sorted(points["budget"].unique()), ("-", "--", ":", "-."))}
    if others is not None and len(others):
        ax.plot(others["params"], others["loss"], "x", color="0.7", ms=4, label="other LR multipliers tried (not the size's best)")
    for (family, budget), g in points.groupby(["family", "budget"]):
        color = colors.get(family, "tab:blue")
        ax.plot(g["params"], g["loss"], ".", color=color, alpha=0.5, ms=5)
        mean = sized(g).groupby(["size", "params"])["loss"].mean().droplevel("size").sort_index()  # a size: an architecture
        ax.plot(mean.index, mean.values, "o", mfc="none", color=color, ms=7,
                label=f"{family} at {budget:.2g} FLOPs: seeds (dots), mean (circle), each size at its best LR")
        # No fit at all (one dense size: nothing to fit) is an empty frame without columns.
        fit = fits[(fits["family"] == family) & (fits["budget"] == budget)] if len(fits) else fits
        if not len(fit):
            continue
        f = fit.iloc[0]
        u = np.linspace(np.log10(mean.index.min()) - 0.05, np.log10(mean.index.max()) + 0.05, 200)
        ax.plot(10**u, f.a * u**2 + f.b * u + f.c, styles[budget], color=color, lw=1.2, label=_fit_label(family, f))
        if np.isfinite(f.opt_params):
            has_ci = np.isfinite(f.opt_low) and np.isfinite(f.opt_high)
            xerr = [[f.opt_params - f.opt_low], [f.opt_high - f.opt_params]] if has_ci else None
            ax.errorbar([f.opt_params], [f.opt_loss], xerr=xerr, fmt="*", color=color, ms=12, capsize=3,
                        label=f"fitted optimum {f.opt_params:.3g} params" + (" (95 % CI from the fit's residuals)" if has_ci else " (no CI)"))
    for arm, g in (mod.groupby("arm", sort=False) if mod is not None else []):
        color = colors.get(g["variant"].iloc[0], "tab:red")
        ax.plot(g["params"], g["loss"], "d", color=color, alpha=0.5, ms=4)
        ax.plot([g["params"].mean()], [g["loss"].mean()], "D", color=color, ms=8, mfc="none", mew=1.5, label=f"{arm} (MoD)")
    ax.set_xscale("log")
    ax.set_xlabel("parameters (non-embedding)")
    ax.set_ylabel("validation causal bpb")
    sizes = sized(points).groupby(["family", "budget"])["size"].nunique().max() if len(points) else 0
    ax.set_title("isoFLOP profile: trials are points, the curve is a fit" if len(fits) else
                 f"isoFLOP profile: each size at its best LR ({sizes} size{'s' if sizes != 1 else ''}: too few to fit)",
                 fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=1, frameon=False)
    return save_figure(fig, png)


def validation_curves(curves: pd.DataFrame, png: Path) -> Path:
    """Mean validation bpb per arm over training FLOPs, with a 95 % t-interval band across seeds."""
    fig = Figure(figsize=(8, 5))
    ax = fig.add_subplot()
    # The variant's colour as in every other figure, each arm of a variant its own shade; dense dashed.
    colors = variant_colors(list(curves["variant"].unique()))
    rank = {arm: (i, n) for _, v in curves.groupby("variant") for n in [v["arm"].nunique()]
            for i, arm in enumerate(sorted(v["arm"].unique()))}
    for arm, g in curves.groupby("arm"):
        agg = g.groupby("step").agg(flops=("flops", "mean"), mean=("val/bpb", "mean"), std=("val/bpb", "std"),
                                    n=("val/bpb", "size"))
        color = _shade(colors[g["variant"].iloc[0]], *rank[arm])
        ax.plot(agg.flops, agg["mean"], label=arm, color=color, lw=1.5, ls="--" if g["variant"].iloc[0] == DENSE else "-")
        ok = agg.n > 1
        if ok.any():
            half = stats.t.ppf(0.975, agg.n[ok] - 1) * agg["std"][ok] / np.sqrt(agg.n[ok])
            ax.fill_between(agg.flops[ok], agg["mean"][ok] - half, agg["mean"][ok] + half, color=color, alpha=0.15)
    ax.set_xlabel("training FLOPs")
    ax.set_ylabel("validation bits per byte (top-k)")
    ax.set_title("Validation curves (mean, 95% t-interval across seeds)")
    ax.legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.grid(alpha=0.3)
    return save_figure(fig, png)


def pareto_scatter(arms: pd.DataFrame, x: str, xlabel: str, front: pd.Series, png: Path, log_x: bool = False) -> Path:
    fig = Figure(figsize=(7, 5))
    ax = fig.add_subplot()
    ax.errorbar(arms[x], arms["mean"], yerr=[arms["mean"] - arms["ci_low"].fillna(arms["mean"]),
                                            arms["ci_high"].fillna(arms["mean"]) - arms["mean"]],
                fmt="o", color="tab:blue", alpha=0.6, ms=4, lw=1)
    on = arms[front.values].sort_values(x)
    ax.plot(on[x], on["mean"], "r-o", ms=6, label="Pareto front")
    for _, r in arms.iterrows():
        ax.annotate(r["arm"], (r[x], r["mean"]), fontsize=6, xytext=(3, 3), textcoords="offset points")
    if log_x:
        ax.set_xscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("validation bpb (mean, 95% CI)")
    ax.legend()
    ax.grid(alpha=0.3)
    return save_figure(fig, png)


def capacity_vs_bpb(arms: pd.DataFrame, png: Path) -> Path:
    fig = Figure(figsize=(7, 5))
    ax = fig.add_subplot()
    dense = arms[arms.variant == DENSE]
    for _, d in dense.iterrows():
        ax.axhline(d["mean"], color="black", ls="--", lw=1, label=f"dense ({d['arm']})" if len(dense) > 1 else "dense")
    colors = variant_colors(list(arms["variant"].unique()))
    for variant, g in arms[arms.variant != DENSE].groupby("variant"):
        g = g.sort_values("capacity")
        ax.errorbar(g.capacity, g["mean"], yerr=[g["mean"] - g["ci_low"].fillna(g["mean"]), g["ci_high"].fillna(g["mean"]) - g["mean"]],
                    marker="o", capsize=3, label=variant, color=colors[variant])
    ax.set_xscale("log", base=2)
    ax.set_xlabel("capacity C")
    ax.set_ylabel("validation bpb (mean, 95% CI)")
    ax.set_title("Capacity vs quality at equal training FLOPs")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    return save_figure(fig, png)


def throughput_bars(arms: pd.DataFrame, png: Path) -> Path:
    arms = arms.sort_values("tokens_per_s")
    fig = Figure(figsize=(7, max(3, 0.3 * len(arms) + 1)))
    ax = fig.add_subplot()
    ax.barh(arms["arm"], arms["tokens_per_s"], color=["black" if v == DENSE else "tab:blue" for v in arms.variant])
    ax.set_xlabel("training tokens / s (fastest seed)")
    ax.tick_params(axis="y", labelsize=7)
    ax.grid(alpha=0.3, axis="x")
    return save_figure(fig, png)


def routing_by_position(positions: pd.DataFrame, png: Path) -> Path:
    """Processing rate per position bucket, one line per arm (averaged over routed layers). Arms
    with the same rates (a random control and its gated twin route alike) would hide each other:
    each arm gets its own marker and line style, and its points are dodged sideways by a few
    hundredths of a bucket, so every line stays visible; the legend sits outside the axes."""
    fig = Figure(figsize=(8.5, 4.8), layout="constrained")
    ax = fig.add_subplot()
    arms = list(positions.groupby("arm"))
    styles = ("-", "--", "-.", ":")
    for i, (arm, g) in enumerate(arms):
        rate = g.groupby("bucket")["rate"].mean()
        dodge = (i - (len(arms) - 1) / 2) * min(0.04, 0.3 / max(len(arms), 1))
        ax.plot(rate.index + 0.5 + dodge, rate.values, marker=_MARKERS[i % len(_MARKERS)], ms=4, lw=1.3,
                ls=styles[(i // len(_MARKERS)) % len(styles)], label=arm, zorder=3 + len(arms) - i)
    ax.set_xlabel("position in the sequence (eighths; points dodged sideways per arm)", fontsize=9)
    ax.set_ylabel("fraction of tokens processed", fontsize=9)
    ax.tick_params(labelsize=8)
    ax.set_title("Where routers spend compute", fontsize=10)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    ax.grid(alpha=0.3)
    return save_figure(fig, png)


def routing_heatmap(masks: list[np.ndarray], png: Path, *, title: str = "") -> Path:
    """Which positions each routed layer processed on one validation window (``masks``: one
    boolean array per routed layer over the window's positions), drawn from a checkpoint at report
    time: processed dark, skipped light, layer 0 at the top. (The training-time artifact of the
    same picture is ``modbench.run.heatmap``; a report may not import ``run``.)"""
    from matplotlib.colors import ListedColormap

    mask = np.stack([np.asarray(m, dtype=bool) for m in masks])
    n_layers, seq_len = mask.shape
    fig = Figure(figsize=(min(16.0, max(5.0, 3.0 + seq_len * 0.04)), min(10.0, max(2.2, 1.4 + n_layers * 0.35))))
    ax = fig.add_subplot()
    ax.imshow(mask.astype(np.uint8), cmap=ListedColormap(["#eef1f6", "#1f3b73"]), vmin=0, vmax=1, aspect="auto",
              interpolation="nearest", origin="upper")
    ax.set_xlabel("position")
    ax.set_ylabel("routed layer")
    ax.set_yticks(range(0, n_layers, max(1, int(np.ceil(n_layers / 16)))))
    share = mask.mean(axis=1)
    subtitle = f"processed fraction per layer: {share.min():.2f}–{share.max():.2f}"
    ax.set_title(f"{title}\n{subtitle}" if title else subtitle, fontsize=9)
    return save_figure(fig, png)
