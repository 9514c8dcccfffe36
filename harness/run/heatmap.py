"""Routing heatmap: which positions each routed layer processed for one sequence.

The figure is built with ``matplotlib.figure.Figure`` directly rather than through
``pyplot``: no global figure registry to leak, no interactive backend to select, and it
is safe to call from worker threads. The Agg backend is still selected when pyplot has
not been imported yet, so any later pyplot use in the same headless process works.

matplotlib is imported when a figure is drawn, not with the trainer: a machine that only trains
(a GPU machine with a bare torch stack, see the Makefile's gpu-smoke) gets a warning at the end of
a routed run instead of an import error at its start.
"""

from __future__ import annotations

import importlib.util
import sys
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from matplotlib.figure import Figure

PROCESSED_COLOR = "#1f3b73"  # dark
SKIPPED_COLOR = "#eef1f6"  # light
DPI = 200  # as every report figure (modbench.report.figures)


def routing_mask(selected: list[np.ndarray], seq_len: int) -> np.ndarray:
    """``(n_routed_layers, seq_len)`` boolean mask, True where the layer processed the
    position. Raises ValueError for positions outside ``[0, seq_len)`` or non-1-D input."""
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    if len(selected) == 0:
        raise ValueError("selected is empty: need the positions of at least one routed layer")
    mask = np.zeros((len(selected), seq_len), dtype=bool)
    for layer, positions in enumerate(selected):
        pos = np.asarray(positions)
        if pos.ndim != 1:
            raise ValueError(
                f"selected[{layer}] must be a 1-D array of positions, got shape {pos.shape}"
            )
        if pos.size == 0:
            continue
        if not np.issubdtype(pos.dtype, np.integer):
            raise ValueError(f"selected[{layer}] must hold integer positions, got {pos.dtype}")
        if pos.min() < 0 or pos.max() >= seq_len:
            raise ValueError(
                f"selected[{layer}] has positions outside [0, {seq_len}): "
                f"min {int(pos.min())}, max {int(pos.max())}"
            )
        mask[layer, pos] = True
    return mask


def routing_heatmap_figure(selected: list[np.ndarray], seq_len: int, title: str = "") -> Figure:
    """The heatmap as a figure (for ``Tracker.log_figure``)."""
    import matplotlib

    if "matplotlib.pyplot" not in sys.modules:
        matplotlib.use("Agg")
    from matplotlib.colors import ListedColormap
    from matplotlib.figure import Figure

    mask = routing_mask(selected, seq_len)
    n_layers = mask.shape[0]
    width = min(16.0, max(5.0, 3.0 + seq_len * 0.04))
    height = min(10.0, max(2.2, 1.4 + n_layers * 0.35))
    fig = Figure(figsize=(width, height), dpi=DPI, layout="constrained")
    ax = fig.add_subplot()
    ax.imshow(
        mask.astype(np.uint8),
        cmap=ListedColormap([SKIPPED_COLOR, PROCESSED_COLOR]),
        vmin=0,
        vmax=1,
        aspect="auto",
        interpolation="nearest",
        origin="upper",
    )
    ax.set_xlabel("position")
    ax.set_ylabel("routed layer")
    ax.set_yticks(range(n_layers))
    if n_layers > 16:
        step = int(np.ceil(n_layers / 16))
        ax.set_yticks(range(0, n_layers, step))
    fractions = mask.mean(axis=1)
    subtitle = f"processed fraction per layer: {fractions.min():.2f}–{fractions.max():.2f}"
    ax.set_title(f"{title}\n{subtitle}" if title else subtitle, fontsize=10)
    return fig


def routing_heatmap(
    selected: list[np.ndarray], seq_len: int, path: Path, title: str = ""
) -> Path:
    """Save the heatmap of ``selected`` (per routed layer, the positions it processed for
    one fixed validation sequence) as a PNG at ``path``; processed is dark, skipped light.
    Returns ``path``."""
    path = Path(path)
    fig = routing_heatmap_figure(selected, seq_len, title)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png", dpi=DPI)
    # A pyplot-free Figure is freed with its last reference; drop the axes explicitly so
    # nothing lingers if a caller keeps a reference around.
    fig.clear()
    return path


@torch.no_grad()
def log_routing_heatmap(model, val_x: torch.Tensor, device, tracker, run_dir: Path, routed_ids: list[int]) -> None:
    if not model.routers:
        return
    if importlib.util.find_spec("matplotlib") is None:
        warnings.warn("matplotlib is not installed: the run has no routing heatmap", stacklevel=2)
        return
    model.eval()
    model.set_collect_stats(True)
    try:
        with torch.random.fork_rng(devices=[]):  # keep the global RNG where training left it
            out = model(val_x[:1].to(device))
    finally:
        model.set_collect_stats(False)
        model.train()
    selected = [s["layer_processed"][0].nonzero().squeeze(1).cpu().numpy() for s in out.stats]
    path = routing_heatmap(selected, val_x.shape[1], run_dir / "routing_heatmap.png",
                           title=f"{model.routing.variant} C={model.routing.capacity:g}: processed positions (layers {routed_ids})")
    tracker.log_artifact(path)
