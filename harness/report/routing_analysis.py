"""Where routers send tokens, measured on trained checkpoints and fixed validation windows.

For each arm (its first seed): the processing rate by position in the sequence, by byte class
of the token (letters, digits, whitespace, punctuation, other — the kind of analysis an unpublished enwik8 MoD report (2025)
asserts, here measured), and the overlap (Jaccard index) of the selected sets between routed
layers.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import torch

from modbench.data import eval_windows, load_corpus
from modbench.config.run import RunConfig
from modbench.model.restore import model_from_state
from modbench.track.checkpoint import load_checkpoint

BYTE_CLASSES = {
    "letter": lambda b: ((b >= 65) & (b <= 90)) | ((b >= 97) & (b <= 122)),
    "digit": lambda b: (b >= 48) & (b <= 57),
    "whitespace": lambda b: (b == 32) | (b == 9) | (b == 10) | (b == 13),
    "punctuation": lambda b: ((b >= 33) & (b <= 47)) | ((b >= 58) & (b <= 64)) | ((b >= 91) & (b <= 96)) | ((b >= 123) & (b <= 126)),
}
N_BUCKETS = 8


MASKS_ARTIFACT = "analysis/routing_masks.npz"  # a run's selection masks, computed where its checkpoint stayed
MASKS_TAG = "modbench.routing_masks"  # on such a run: the artifact path of its masks


@torch.no_grad()
def selection_masks(checkpoint: Path, n_windows: int = 16, device: str = "cpu") -> tuple[np.ndarray, list[np.ndarray], RunConfig]:
    """Input bytes (n, T) and one boolean (n, T) mask per routed layer (``device``: where the
    forward runs; a lent GPU computes them for the checkpoints its archive cannot hold)."""
    model, cfg = model_from_state(load_checkpoint(checkpoint), str(checkpoint))
    corpus = load_corpus(cfg.train.dataset, seed=cfg.train.seed)
    x, _ = eval_windows(corpus.val, cfg.train.seq_len, n_windows)
    model.to(device).set_collect_stats(True)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        out = model(x.to(device))
    masks = []
    for s in out.stats:
        masks.append(s["layer_processed"].cpu().numpy())
    return x.numpy(), masks, cfg


def save_masks(path: Path, x: np.ndarray, masks: list[np.ndarray]) -> None:
    """Input bytes and per-layer masks in one ``.npz`` (``load_masks`` reads it back)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(path, x=x, masks=np.stack(masks) if masks else np.zeros((0, *x.shape), dtype=bool))


def load_masks(path: Path) -> tuple[np.ndarray, list[np.ndarray]]:
    with np.load(path) as f:
        return f["x"], list(f["masks"])


def analyse(checkpoint: Path, n_windows: int = 16) -> dict[str, pd.DataFrame]:
    x, masks, _ = selection_masks(checkpoint, n_windows)
    return analyse_masks(x, masks)


def analyse_masks(x: np.ndarray, masks: list[np.ndarray]) -> dict[str, pd.DataFrame]:
    """The tables of :func:`analyse` from input bytes and per-layer selection masks."""
    T = x.shape[1]
    bucket = np.minimum(np.arange(T) * N_BUCKETS // T, N_BUCKETS - 1)
    pos_rows, class_rows, overlap_rows = [], [], []
    classes = {name: f(x) for name, f in BYTE_CLASSES.items()}
    classes["other"] = ~np.any(np.stack(list(classes.values())), axis=0)
    for layer, m in enumerate(masks):
        for b in range(N_BUCKETS):
            pos_rows.append({"layer": layer, "bucket": b, "rate": float(m[:, bucket == b].mean())})
        for name, c in classes.items():
            if c.any():
                class_rows.append({"layer": layer, "byte_class": name, "rate": float(m[c].mean()), "share_of_tokens": float(c.mean())})
    for i in range(len(masks)):
        for j in range(i + 1, len(masks)):
            inter = np.logical_and(masks[i], masks[j]).sum()
            union = np.logical_or(masks[i], masks[j]).sum()
            overlap_rows.append({"layer_a": i, "layer_b": j, "jaccard": float(inter / max(union, 1))})
    return {
        "positions": pd.DataFrame(pos_rows, columns=["layer", "bucket", "rate"]),
        "classes": pd.DataFrame(class_rows, columns=["layer", "byte_class", "rate", "share_of_tokens"]),
        "overlap": pd.DataFrame(overlap_rows, columns=["layer_a", "layer_b", "jaccard"]),
    }
