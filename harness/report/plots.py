"""The report's figures (matplotlib, Agg, PNG). Each function writes one file and returns it."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from scipy import stats  # noqa: E402


def _save(fig: Figure, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def _colors(labels: list[str]) -> dict[str, tuple]:
    """Distinct colours; dense is always black so the baseline reads at a glance."""
    cmap = matplotlib.colormaps["tab10" if len(labels) <= 11 else "tab20"]
    others = [label for label in sorted(labels) if not label.startswith("dense")]
    colors = {label: cmap(i % cmap.N) for i, label in enumerate(others)}
    colors.update({label: (0, 0, 0, 1) for label in labels if label.startswith("dense")})
    return colors


def validation_curves(curves: pd.DataFrame, path: Path) -> Path:
    """Mean validation bpb per arm over training FLOPs, with a 95% t-interval band across seeds."""
    fig = Figure(figsize=(8, 5))
    ax = fig.add_subplot()
    colors = _colors(list(curves.arm.unique()))
    for arm, g in curves.groupby("arm"):
        agg = g.groupby("step").agg(flops=("flops", "mean"), mean=("val/bpb", "mean"), std=("val/bpb", "std"), n=("val/bpb", "size"))
        ax.plot(agg.flops, agg["mean"], label=arm, color=colors[arm], lw=1.5)
        ok = agg.n > 1
        if ok.any():
            half = stats.t.ppf(0.975, agg.n[ok] - 1) * agg["std"][ok] / np.sqrt(agg.n[ok])
            ax.fill_between(agg.flops[ok], agg["mean"][ok] - half, agg["mean"][ok] + half, color=colors[arm], alpha=0.15)
    ax.set_xlabel("training FLOPs")
    ax.set_ylabel("validation bits per byte")
    ax.set_title("Validation curves (mean, 95% t-interval across seeds)")
    ax.legend(fontsize=7, ncol=2)
    ax.grid(alpha=0.3)
    return _save(fig, path)


def pareto_scatter(arms: pd.DataFrame, x: str, xlabel: str, front: pd.Series, path: Path, log_x: bool = False) -> Path:
    fig = Figure(figsize=(7, 5))
    ax = fig.add_subplot()
    ax.errorbar(arms[x], arms["mean"], yerr=[arms["mean"] - arms["ci_low"].fillna(arms["mean"]), arms["ci_high"].fillna(arms["mean"]) - arms["mean"]],
                fmt="o", color="tab:blue", alpha=0.6, ms=4, lw=1)
    on = arms[front.values]
    ax.plot(on.sort_values(x)[x], on.sort_values(x)["mean"], "r-o", ms=6, label="Pareto front")
    for _, r in arms.iterrows():
        ax.annotate(r["arm"], (r[x], r["mean"]), fontsize=6, xytext=(3, 3), textcoords="offset points")
    if log_x:
        ax.set_xscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("validation bpb (mean, 95% CI)")
    ax.legend()
    ax.grid(alpha=0.3)
    return _save(fig, path)


def capacity_vs_bpb(arms: pd.DataFrame, path: Path) -> Path:
    fig = Figure(figsize=(7, 5))
    ax = fig.add_subplot()
    dense = arms[arms.variant == "dense"]
    for _, d in dense.iterrows():
        ax.axhline(d["mean"], color="black", ls="--", lw=1, label=f"dense ({d['arm']})" if len(dense) > 1 else "dense")
    for variant, g in arms[arms.variant != "dense"].groupby("variant"):
        g = g.sort_values("capacity")
        ax.errorbar(g.capacity, g["mean"], yerr=[g["mean"] - g["ci_low"].fillna(g["mean"]), g["ci_high"].fillna(g["mean"]) - g["mean"]],
                    marker="o", capsize=3, label=variant)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("capacity C")
    ax.set_ylabel("validation bpb (mean, 95% CI)")
    ax.set_title("Capacity vs quality at equal training FLOPs")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return _save(fig, path)


def throughput_bars(arms: pd.DataFrame, path: Path) -> Path:
    arms = arms.sort_values("tokens_per_s")
    fig = Figure(figsize=(7, max(3, 0.3 * len(arms) + 1)))
    ax = fig.add_subplot()
    ax.barh(arms["arm"], arms["tokens_per_s"], color=["black" if v == "dense" else "tab:blue" for v in arms.variant])
    ax.set_xlabel("training tokens / s (fastest seed)")
    ax.tick_params(axis="y", labelsize=7)
    ax.grid(alpha=0.3, axis="x")
    return _save(fig, path)


def routing_by_position(positions: pd.DataFrame, path: Path) -> Path:
    """Processing rate per position bucket, one line per arm (averaged over routed layers)."""
    fig = Figure(figsize=(7, 4.5))
    ax = fig.add_subplot()
    for arm, g in positions.groupby("arm"):
        rate = g.groupby("bucket")["rate"].mean()
        ax.plot(rate.index + 0.5, rate.values, marker="o", ms=3, label=arm)
    ax.set_xlabel("position in the sequence (eighths)")
    ax.set_ylabel("fraction of tokens processed")
    ax.set_title("Where routers spend compute")
    ax.legend(fontsize=7, ncol=2)
    ax.grid(alpha=0.3)
    return _save(fig, path)
