"""Sanity baselines for a byte corpus: what a model must beat before its routing means anything.

A transformer trained for a few minutes can be worse than counting. Every report therefore
puts two kinds of reference beside its arms, both in bits per byte on the same split:

- **Count n-gram models** (orders 1, 2 and 3), fit on the train split and scored on the
  evaluation split: interpolated Kneser–Ney smoothing (Kneser & Ney 1995; the interpolated
  form of Chen & Goodman 1998, §3.5) with one absolute discount per order,
  D = n₁ / (n₁ + 2·n₂) (Ney, Essen & Kneser 1994), where n₁ and n₂ count the n-grams seen once
  and twice. The highest order uses raw counts, lower orders continuation counts (how many
  distinct bytes precede a suffix), and order 0 is uniform over the 256 byte values, so no
  byte ever gets probability 0. The first n − 1 bytes of the split are scored with the
  shorter contexts they have.
- **General-purpose compressors** (gzip, xz, zstd at their strongest settings) applied to the
  evaluation split alone: 8 · compressed size / raw size. They see no training data, so they
  are a weak bar on a small split; they are here because every reader knows them.

A report whose best arm does not beat the trigram says so in its first lines: such models
have not learned enough for routing comparisons to be trusted.
"""

from __future__ import annotations

import gzip
import lzma
from dataclasses import asdict, dataclass

import numpy as np

from modbench.errors import ModbenchError

VOCAB = 256
MAX_ORDER = 3  # dense count tables: 256**3 cells at order 3


@dataclass(frozen=True)
class Baselines:
    """Bits per byte of each baseline on one split."""

    split: str
    n_bytes: int
    unigram: float
    bigram: float
    trigram: float
    gzip: float
    xz: float
    zstd: float

    def to_dict(self) -> dict[str, float | int | str]:
        return asdict(self)


def _ngram_counts(data: np.ndarray, order: int) -> np.ndarray:
    """Counts of every ``order``-gram, shape (256**(order-1), 256): row = context, column = byte."""
    x = np.asarray(data, dtype=np.int64)
    codes = np.zeros(len(x) - order + 1, dtype=np.int64)
    for i in range(order):
        codes = codes * VOCAB + x[i: len(x) - order + 1 + i]
    return np.bincount(codes, minlength=VOCAB**order).reshape(VOCAB ** (order - 1), VOCAB)


def _continuation(counts_above: np.ndarray) -> np.ndarray:
    """N₁₊(• w): for each (order-1)-gram w, how many distinct bytes precede it in the data."""
    order_above = round(np.log(counts_above.size) / np.log(VOCAB))
    per_prefix = counts_above.reshape(VOCAB, VOCAB ** (order_above - 1)) > 0
    return per_prefix.sum(axis=0).reshape(VOCAB ** (order_above - 2), VOCAB)


def _discount(counts: np.ndarray) -> float:
    n1, n2 = int((counts == 1).sum()), int((counts == 2).sum())
    return n1 / (n1 + 2 * n2) if n1 + n2 else 0.5


class KneserNey:
    """An interpolated Kneser–Ney byte model of order 1–3, fit once on ``train``."""

    def __init__(self, train: np.ndarray, order: int) -> None:
        if not 1 <= order <= MAX_ORDER:
            raise ModbenchError(f"n-gram order {order} is not supported: expected 1, 2 or 3")
        if len(train) < order:
            raise ModbenchError(f"the train split has {len(train)} bytes: too few for a {order}-gram model")
        self.order = order
        raw = [_ngram_counts(train, m) for m in range(1, order + 1)]
        # tables[m-1]: the counts used at order m (raw at the top, continuation below).
        self.tables = [_continuation(raw[m]) if m < order else raw[m - 1] for m in range(1, order + 1)]
        self.discounts = [_discount(t) for t in self.tables]

    def prob(self, data: np.ndarray) -> np.ndarray:
        """P(x_t | up to order-1 preceding bytes) for every position t of ``data``."""
        x = np.asarray(data, dtype=np.int64)
        p = np.full(len(x), 1.0 / VOCAB)
        for m in range(1, self.order + 1):
            table, d = self.tables[m - 1], self.discounts[m - 1]
            ctx = np.zeros(len(x), dtype=np.int64)
            for back in range(m - 1, 0, -1):  # context code of the m-1 preceding bytes
                prev = np.concatenate([np.zeros(back, dtype=np.int64), x[:-back]]) if back else x
                ctx = ctx * VOCAB + prev
            row_total = table.sum(axis=1)[ctx].astype(float)
            row_types = (table > 0).sum(axis=1)[ctx].astype(float)
            count = table[ctx, x].astype(float)
            seen = row_total > 0
            higher = np.where(seen, np.maximum(count - d, 0.0) / np.where(seen, row_total, 1.0)
                              + d * row_types / np.where(seen, row_total, 1.0) * p, p)
            # Positions with fewer than m-1 preceding bytes keep the lower-order estimate.
            p = np.where(np.arange(len(x)) >= m - 1, higher, p)
        return p

    def bits_per_byte(self, data: np.ndarray) -> float:
        if len(data) == 0:
            raise ModbenchError("cannot score an empty split")
        return float(-np.log2(self.prob(data)).mean())


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


def sanity_baselines(train: np.ndarray, evaluate: np.ndarray, split: str = "val") -> Baselines:
    """Every baseline, fit on ``train`` where it learns, scored on ``evaluate``."""
    ngram = {order: KneserNey(train, order).bits_per_byte(evaluate) for order in (1, 2, 3)}
    return Baselines(split, int(len(evaluate)), ngram[1], ngram[2], ngram[3], **compressed_bits_per_byte(evaluate))
