"""Sanity baselines for a byte corpus: what a model must beat before its routing means anything.

A transformer trained for a few minutes can be worse than counting. Every report therefore
puts two kinds of reference beside its arms, both in bits per byte:

- **Count n-gram models** (orders 1 to 4 here, any order up to ``MAX_ORDER``), fit on the train
  split: interpolated Kneser–Ney smoothing (Kneser & Ney 1995; the interpolated form of
  Chen & Goodman 1998, §3.5) with one absolute discount per order, D = n₁ / (n₁ + 2·n₂)
  (Ney, Essen & Kneser 1994), where n₁ and n₂ count the n-grams seen once and twice. The
  highest order uses raw counts, lower orders continuation counts (how many distinct bytes
  precede a suffix), and order 0 is uniform over the 256 byte values, so no byte ever gets
  probability 0. A position with fewer than n − 1 preceding bytes is scored with the shorter
  context it has. Counts are sparse (the sorted distinct n-gram codes and their counts, looked
  up with ``numpy.searchsorted``): a dense table of 256ⁿ cells stops at order 3.
- **The same n-gram on the arms' own evaluation windows** (``window_bits_per_byte``): the
  fixed windows of ``modbench.data.eval_windows`` that every arm's test bpb is measured on,
  each window scored like the model scores it — every byte after the window's first, with
  context only from inside the window. This is the bar the report's first lines use: a
  number on exactly the bytes the arms are scored on.
- **General-purpose compressors** (gzip, xz, zstd at their strongest settings) applied to the
  evaluation split alone: 8 · compressed size / raw size. They see no training data, so they
  are a weak bar on a small split; they are here because every reader knows them.
"""

from __future__ import annotations

import gzip
import lzma
from dataclasses import asdict, dataclass

import numpy as np

from modbench.errors import ModbenchError

VOCAB = 256
MAX_ORDER = 7  # an n-gram's code is a base-256 number: 256**7 = 2**56 fits in int64
WINDOW_ORDER = 4  # the report's bar: the count 4-gram on the arms' evaluation windows


@dataclass(frozen=True)
class Baselines:
    """Bits per byte of each baseline on one split; the window fields are the count n-grams on
    the arms' evaluation windows of that split (None when not computed)."""

    split: str
    n_bytes: int
    unigram: float
    bigram: float
    trigram: float
    gzip: float
    xz: float
    zstd: float
    fourgram: float | None = None
    window_trigram: float | None = None
    window_fourgram: float | None = None
    window_bytes: int | None = None  # bytes scored on the windows (targets, summed over windows)

    def to_dict(self) -> dict[str, float | int | str | None]:
        return asdict(self)


def _codes(x: np.ndarray, order: int) -> np.ndarray:
    """Base-256 code of the ``order``-gram ending at each position along the last axis; a
    position with fewer than order − 1 preceding bytes gets a code that is never looked up."""
    x = np.asarray(x, dtype=np.int64)
    codes = x.copy()
    for back in range(1, order):
        prev = np.zeros_like(x)
        prev[..., back:] = x[..., :-back]
        codes += prev * VOCAB**back
    return codes


class _Table:
    """Sparse counts of one order: the sorted distinct n-gram codes with their counts, and per
    context (the code without its last byte) the total count and the number of distinct bytes."""

    def __init__(self, codes: np.ndarray, counts: np.ndarray) -> None:
        self.codes, self.counts = codes, counts.astype(np.float64)
        self.contexts, inverse = np.unique(codes // VOCAB, return_inverse=True)
        self.totals = np.bincount(inverse, weights=self.counts, minlength=len(self.contexts))
        self.types = np.bincount(inverse, minlength=len(self.contexts)).astype(np.float64)
        n1, n2 = int((counts == 1).sum()), int((counts == 2).sum())
        self.discount = n1 / (n1 + 2 * n2) if n1 + n2 else 0.5

    @staticmethod
    def _find(keys: np.ndarray, sorted_keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        i = np.minimum(np.searchsorted(sorted_keys, keys), max(len(sorted_keys) - 1, 0))
        return i, (sorted_keys[i] == keys) if len(sorted_keys) else np.zeros(keys.shape, bool)

    def lookup(self, codes: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """count(context, byte), total(context), distinct bytes after context; 0 where unseen."""
        i, hit = self._find(codes, self.codes)
        j, seen = self._find(codes // VOCAB, self.contexts)
        return (np.where(hit, self.counts[i], 0.0), np.where(seen, self.totals[j], 0.0),
                np.where(seen, self.types[j], 0.0))


class KneserNey:
    """An interpolated Kneser–Ney byte model of order 1 to ``MAX_ORDER``, fit once on ``train``."""

    def __init__(self, train: np.ndarray, order: int) -> None:
        if not 1 <= order <= MAX_ORDER:
            raise ModbenchError(f"n-gram order {order} is not supported: expected 1 to {MAX_ORDER}")
        if len(train) < order:
            raise ModbenchError(f"the train split has {len(train)} bytes: too few for a {order}-gram model")
        self.order = order
        x = np.asarray(train, dtype=np.int64)
        self.tables = [self._table(x, m) for m in range(1, order + 1)]  # tables[m-1]: order m
        self.discounts = [t.discount for t in self.tables]

    def _table(self, x: np.ndarray, m: int) -> _Table:
        """Raw counts at the top order; below it continuation counts N₁₊(• w): how many distinct
        bytes precede the m-gram w, i.e. the distinct (m+1)-grams ending in w."""
        if m == self.order:
            return _Table(*np.unique(_codes(x, m)[m - 1:], return_counts=True))
        above = np.unique(_codes(x, m + 1)[m:])
        return _Table(*np.unique(above % VOCAB**m, return_counts=True))

    def prob(self, data: np.ndarray) -> np.ndarray:
        """P(x_t | up to order − 1 preceding bytes) at every position along the last axis of
        ``data`` (a sequence, or a 2-D array of windows scored independently)."""
        x = np.asarray(data, dtype=np.int64)
        p = np.full(x.shape, 1.0 / VOCAB)
        position = np.arange(x.shape[-1])
        for m, table in enumerate(self.tables, start=1):
            count, total, types = table.lookup(_codes(x, m))
            seen, denom = total > 0, np.where(total > 0, total, 1.0)
            d = table.discount
            higher = np.where(seen, np.maximum(count - d, 0.0) / denom + d * types / denom * p, p)
            p = np.where(position >= m - 1, higher, p)  # too few preceding bytes: the lower order's
        return p

    def bits_per_byte(self, data: np.ndarray) -> float:
        if len(data) == 0:
            raise ModbenchError("cannot score an empty split")
        return float(-np.log2(self.prob(data)).mean())


def window_bits_per_byte(model: KneserNey, split: np.ndarray, seq_len: int, n_windows: int) -> tuple[float, int]:
    """Bits per byte of ``model`` on the evaluation windows an arm is scored on (the windows of
    ``modbench.data.eval_windows`` for ``seq_len`` and ``n_windows``), and the bytes scored.

    Each window is the model's input plus its last target (seq_len + 1 bytes); its first byte
    is context only, as it is for the model, and no byte before the window is used."""
    from modbench.data import window_starts  # the arms' own window rule (modbench.data imports torch)

    data = np.asarray(split)
    if len(data) <= seq_len:
        raise ModbenchError(f"the split has {len(data)} bytes: too few for windows of {seq_len}")
    starts = window_starts(len(data), seq_len, n_windows)
    rows = data[starts[:, None] + np.arange(seq_len + 1)]
    p = model.prob(rows)[:, 1:]
    return float(-np.log2(p).mean()), int(p.size)


def compressed_bits_per_byte(data: np.ndarray) -> dict[str, float]:
    """8 · compressed size / raw size for gzip -9, xz -9e and zstd -19."""
    import zstandard

    raw = np.asarray(data, dtype=np.uint8).tobytes()
    if not raw:
        raise ModbenchError("cannot compress an empty split")
    sizes = {
        "gzip": len(gzip.compress(raw, compresslevel=9, mtime=0)),
        "xz": len(lzma.compress(raw, preset=9 | lzma.PRESET_EXTREME)),
        "zstd": len(zstandard.ZstdCompressor(level=19).compress(raw)),
    }
    return {name: 8.0 * size / len(raw) for name, size in sizes.items()}


def fit_ngrams(train: np.ndarray, orders: tuple[int, ...] = (1, 2, 3, WINDOW_ORDER)) -> dict[int, KneserNey]:
    """One Kneser–Ney model per order, fit on ``train`` (fit once, score every split)."""
    return {order: KneserNey(train, order) for order in orders}


def sanity_baselines(train: np.ndarray, evaluate: np.ndarray, split: str = "val", *,
                     windows: tuple[int, int] | None = None, models: dict[int, KneserNey] | None = None) -> Baselines:
    """Every baseline, fit on ``train`` where it learns (or ``models`` already fit on it), scored
    on ``evaluate``; with ``windows`` = (seq_len, n_windows), also the trigram and 4-gram on the
    arms' evaluation windows of ``evaluate``."""
    models = models or fit_ngrams(train)
    whole = {order: m.bits_per_byte(evaluate) for order, m in models.items()}
    on_windows: dict[str, float | int | None] = {}
    if windows is not None:
        tri, _ = window_bits_per_byte(models[3], evaluate, *windows)
        four, n = window_bits_per_byte(models[WINDOW_ORDER], evaluate, *windows)
        on_windows = {"window_trigram": tri, "window_fourgram": four, "window_bytes": n}
    return Baselines(split, int(len(evaluate)), whole[1], whole[2], whole[3], **compressed_bits_per_byte(evaluate),
                     fourgram=whole.get(WINDOW_ORDER), **on_windows)
