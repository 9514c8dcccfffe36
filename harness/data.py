"""Byte-level corpora with fixed splits and seeded batches.

Corpora (``load_corpus(name)``):

- ``stdlib``          -- the running Python's own standard-library ``*.py`` sources (tests and
  site-packages excluded), concatenated in sorted path order. Offline; cached per Python version.
- ``tinyshakespeare`` -- Karpathy's char-rnn Tiny Shakespeare, 1,115,394 bytes, sha256-verified.
- ``enwik8``          -- the first 10^8 bytes of English Wikipedia (Hutter prize), 90M/5M/5M split.
- ``arithmetic``      -- synthetic ``a+b=c`` / ``a*b=c`` lines generated from ``seed``, with a
  per-byte difficulty label (see :func:`make_arithmetic`).
- any other string is read as the path of a local, non-empty file.

Every corpus is split contiguously by bytes: 90% train, then 5% val, then the rest test
(for enwik8 this is exactly 90M/5M/5M). File-backed corpora are ``np.memmap``-ed read-only.
Downloads go to :func:`data_dir`; ``MODBENCH_<NAME>_URL`` replaces the full download URL of a
dataset (e.g. ``MODBENCH_TINYSHAKESPEARE_URL``), which is how the tests serve a local copy.
"""

from __future__ import annotations

import functools
import hashlib
import http.client
import json
import os
import platform
import sysconfig
import tempfile
import urllib.request
import zipfile
from dataclasses import dataclass
from pathlib import Path, PurePath

import numpy as np
import torch

from modbench.errors import ModbenchError, accepted

KNOWN_DATASETS: tuple[str, ...] = ("stdlib", "tinyshakespeare", "enwik8", "arithmetic")
SPLITS: tuple[str, ...] = ("train", "val", "test")
# Directories of the stdlib tree that hold test code or third-party packages, not the library.
_EXCLUDED_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "dist-packages"})
_MIN_ARITHMETIC_BYTES = 1_000


@dataclass(frozen=True)
class Source:
    """Where a downloadable corpus comes from and what the verified file must look like."""

    url: str
    size: int
    sha256: str | None  # None: no checksum we can vouch for; size is still verified
    kind: str = "raw"  # "raw": the URL is the file; "zip": the URL is a zip holding `member`
    member: str | None = None
    filename: str = ""  # name of the verified file in the data dir


_KARPATHY = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data"
SOURCES: dict[str, Source] = {
    "tinyshakespeare": Source(
        f"{_KARPATHY}/tinyshakespeare/input.txt", 1_115_394,
        "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed",
        filename="tinyshakespeare.txt"),
    # We have no sha256 of enwik8 that we could verify independently, and a made-up checksum
    # would be worse than none, so only the exact size (10^8 bytes) is checked.
    "enwik8": Source("http://mattmahoney.net/dc/enwik8.zip", 100_000_000, None,
                     kind="zip", member="enwik8", filename="enwik8"),
}


def data_dir() -> Path:
    """``$MODBENCH_DATA_DIR`` if set, else ``~/.cache/modbench``; created on demand."""
    env = os.environ.get("MODBENCH_DATA_DIR")
    return _ensure_dir(Path(env).expanduser() if env else Path.home() / ".cache" / "modbench")


def _ensure_dir(path: Path) -> Path:
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ModbenchError(f"cannot create data directory {path} ({_one_line(exc)}); "
                            "set MODBENCH_DATA_DIR to a writable directory") from exc
    return path


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


@dataclass(frozen=True, eq=False)  # eq=False: comparing ndarray fields with == is ambiguous
class Corpus:
    """A byte corpus and its fixed train/val/test split."""

    name: str
    train: np.ndarray
    val: np.ndarray
    test: np.ndarray
    sha256: str
    labels: dict[str, np.ndarray] | None = None

    def split(self, name: str) -> np.ndarray:
        """The bytes of split ``name`` ('train', 'val' or 'test')."""
        if name not in SPLITS:
            raise ModbenchError(f"unknown split {name!r}: expected {accepted(SPLITS)}")
        return getattr(self, name)

    def unigram_entropy_bits(self, split: str = "train") -> float:
        """Shannon entropy of the split's byte histogram, in bits per byte."""
        data = self.split(split)
        if len(data) == 0:
            raise ModbenchError(f"split {split!r} of {self.name} is empty; use a larger corpus")
        counts = np.bincount(np.asarray(data), minlength=256)
        p = counts[counts > 0] / len(data)
        return float(-(p * np.log2(p)).sum())


def check_dataset(name: str) -> Path | None:
    """Fail early, in one line, on a dataset that is neither built in nor a readable file.

    Returns the file's path for a local file, ``None`` for a built-in name. Config
    classes call this so a typo stops a run before anything is printed or tracked.
    """
    if name in KNOWN_DATASETS:
        return None
    path = Path(name).expanduser()
    known = ", ".join(map(repr, KNOWN_DATASETS))  # accepted() would quote the last phrase
    if not path.exists():
        if os.sep in name or "." in name:
            raise ModbenchError(f"dataset file {name!r} does not exist: give an existing file, or one of {known}")
        raise ModbenchError(f"unknown dataset {name!r}: expected {known} or a path to a file")
    if not path.is_file():
        raise ModbenchError(f"dataset path {path} is not a regular file: expected a path to a file")
    if path.stat().st_size == 0:
        raise ModbenchError(f"dataset file {path} is empty: expected a non-empty file")
    return path


def load_corpus(name: str, *, root: Path | None = None, seed: int = 0,
                arithmetic_bytes: int = 2_000_000) -> Corpus:
    """Load a corpus by name (one of ``KNOWN_DATASETS``) or from the path of a local file.

    ``root`` replaces :func:`data_dir` for downloads and caches. ``seed`` and
    ``arithmetic_bytes`` only affect ``arithmetic``.
    """
    if name == "arithmetic":
        data, labels = make_arithmetic(seed, arithmetic_bytes)
        cuts = _line_cuts(data)
        parts = np.split(data, cuts)
        label_parts = dict(zip(SPLITS, np.split(labels, cuts)))
        sha = hashlib.sha256(data.tobytes()).hexdigest()
        return Corpus(f"arithmetic(seed={seed})", *parts, sha256=sha, labels=label_parts)
    if name in KNOWN_DATASETS:
        base = _ensure_dir(Path(root)) if root is not None else data_dir()
        path = _build_stdlib(base) if name == "stdlib" else _fetch(name, base)
        return _file_corpus(name, path, _sha256_cached(path))
    path = check_dataset(name).resolve()
    return _file_corpus(str(path), path, _sha256_memo(path, tuple(_stat_key(path))))


def _split_points(n: int) -> tuple[int, int]:
    return n * 90 // 100, n * 95 // 100


def _file_corpus(name: str, path: Path, sha: str) -> Corpus:
    data = np.memmap(path, dtype=np.uint8, mode="r")
    a, b = _split_points(len(data))
    return Corpus(name, data[:a], data[a:b], data[b:], sha256=sha)


def _sha256_file(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _stat_key(path: Path) -> list[int]:
    st = path.stat()
    # ctime too: it changes on every write and, unlike mtime, cannot be set back by a tool.
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def _sha256_cached(path: Path) -> str:
    """sha256 of a file in the data dir, remembered in ``<file>.sha256`` until the file changes."""
    sidecar = path.with_name(path.name + ".sha256")
    try:
        rec = json.loads(sidecar.read_text())
        if rec["stat"] == _stat_key(path):
            return str(rec["sha256"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    sha = _sha256_file(path)
    try:
        _atomic_write(sidecar, json.dumps({"sha256": sha, "stat": _stat_key(path)}).encode())
    except OSError:
        pass  # a read-only data dir only costs a re-hash next time
    return sha


@functools.lru_cache(maxsize=32)
def _sha256_memo(path: Path, stat_key: tuple[int, ...]) -> str:
    # For a user's own file: never write beside it, remember the hash for this process only.
    return _sha256_file(path)


def _atomic_write(path: Path, payload: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".part")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(payload)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def stdlib_files() -> list[Path]:
    """The standard library's ``*.py`` files, without tests and site-packages, sorted by path."""
    root = Path(sysconfig.get_paths()["stdlib"])
    rels = [p.relative_to(root) for p in root.rglob("*.py") if p.is_file()]
    keep = [r for r in rels if not _EXCLUDED_DIRS.intersection(r.parts[:-1])]
    return [root / r for r in sorted(keep, key=PurePath.as_posix)]


def _build_stdlib(base: Path) -> Path:
    path = base / f"stdlib-{platform.python_version()}.bin"
    if path.exists():
        return path
    payload = b"".join(p.read_bytes() for p in stdlib_files())
    _atomic_write(path, payload)
    return path


def _fetch(name: str, base: Path) -> Path:
    """Path of the verified file for a downloadable dataset, downloading it if absent."""
    src = SOURCES[name]
    path = base / src.filename
    if path.exists():
        problem = _verify(path, src, _sha256_cached)
        if problem:
            raise ModbenchError(f"cached {name} at {path} is corrupt ({problem}); "
                                "delete it to download it again")
        return path
    url = os.environ.get(f"MODBENCH_{name.upper()}_URL") or src.url
    fd, tmp_name = tempfile.mkstemp(dir=base, prefix=f".{src.filename}.", suffix=".part")
    os.close(fd)
    tmp = Path(tmp_name)
    extracted = tmp.with_name(tmp.name + ".member")
    try:
        try:
            with urllib.request.urlopen(url, timeout=60) as resp, open(tmp, "wb") as out:
                while chunk := resp.read(1 << 20):
                    out.write(chunk)
        # URLError/HTTPError/timeouts are OSErrors; a short body is IncompleteRead; a bad
        # override URL is a ValueError.
        except (OSError, http.client.HTTPException, ValueError) as exc:
            raise ModbenchError(f"could not download {name} from {url} ({_one_line(exc)}); "
                                f"place a copy at {path}") from exc
        got = tmp
        if src.kind == "zip":
            got = _extract(tmp, extracted, src, name, url, path)
        problem = _verify(got, src, _sha256_file)
        if problem:
            raise ModbenchError(f"downloaded {name} from {url} is corrupt ({problem}); nothing "
                                f"was saved, retry or place a verified copy at {path}")
        os.replace(got, path)
    finally:
        tmp.unlink(missing_ok=True)
        extracted.unlink(missing_ok=True)
    _sha256_cached(path)
    return path


def _extract(archive: Path, dest: Path, src: Source, name: str, url: str, final: Path) -> Path:
    try:
        with zipfile.ZipFile(archive) as zf, zf.open(src.member) as fin, open(dest, "wb") as out:
            # One byte past the expected size is enough to fail verification; don't fill the disk.
            out.write(fin.read(src.size + 1))
    except (zipfile.BadZipFile, KeyError, EOFError) as exc:
        raise ModbenchError(f"downloaded {name} from {url} is not a zip holding {src.member!r} "
                            f"({_one_line(exc)}); place a verified copy at {final}") from exc
    return dest


def _verify(path: Path, src: Source, sha_of) -> str | None:
    """A description of what is wrong with ``path``, or None if it matches ``src``."""
    size = path.stat().st_size
    if size != src.size:
        return f"{size} bytes, expected {src.size}"
    if src.sha256 is not None:
        sha = sha_of(path)
        if sha != src.sha256:
            return f"sha256 {sha}, expected {src.sha256}"
    return None


def make_arithmetic(seed: int, n_bytes: int) -> tuple[np.ndarray, np.ndarray]:
    """Synthetic lines ``a+b=c`` / ``a*b=c`` (a, b uniform in 0..99, ``+``/``*`` 50/50).

    Labelling rule: a byte is hard (1) iff it is a digit of the result of a multiplication,
    i.e. a digit after ``=`` on a ``*`` line. Everything else is easy (0): operands are random
    so no computation predicts them, ``+``/``*``/``=``/newline follow from the format, and the
    results of additions are labelled easy too, to keep the contrast between the classes sharp.

    Whole lines are generated until at least ``n_bytes`` bytes exist, so the length is
    ``n_bytes`` plus less than one line. Same seed -> identical bytes and labels.
    """
    if not _is_int(seed) or seed < 0:
        raise ModbenchError(f"arithmetic seed must be a non-negative integer, got {seed!r}")
    if not _is_int(n_bytes) or n_bytes < _MIN_ARITHMETIC_BYTES:
        raise ModbenchError(f"arithmetic_bytes must be an integer >= {_MIN_ARITHMETIC_BYTES}, "
                            f"got {n_bytes!r}")
    rng = np.random.Generator(np.random.PCG64(int(seed)))
    n_lines = int(n_bytes) // 6 + 1  # the shortest line, "0+0=0\n", has 6 bytes
    a = rng.integers(0, 100, n_lines).tolist()
    b = rng.integers(0, 100, n_lines).tolist()
    mul = (rng.integers(0, 2, n_lines) == 1).tolist()
    text, labels, total = [], [], 0
    for x, y, m in zip(a, b, mul):
        head = f"{x}{'*' if m else '+'}{y}="
        result = str(x * y if m else x + y)
        text.append(f"{head}{result}\n")
        labels.append(b"\0" * len(head) + (b"\1" if m else b"\0") * len(result) + b"\0")
        total += len(head) + len(result) + 1
        if total >= n_bytes:
            break
    data = np.frombuffer("".join(text).encode("ascii"), dtype=np.uint8).copy()
    return data, np.frombuffer(b"".join(labels), dtype=np.uint8).copy()


def _line_cuts(data: np.ndarray) -> list[int]:
    """90%/95% cut points moved forward to the next line start, so no split begins mid-line."""
    starts = np.flatnonzero(data == ord("\n")) + 1
    return [int(starts[min(np.searchsorted(starts, c), len(starts) - 1)])
            for c in _split_points(len(data))]


def _is_int(value: object) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _check_positive(what: str, value: object) -> None:
    if not _is_int(value) or value < 1:
        raise ModbenchError(f"{what} must be a positive integer, got {value!r}")


def _check_window(data: np.ndarray, seq_len: int) -> int:
    _check_positive("seq_len", seq_len)
    if len(data) < seq_len + 1:
        raise ModbenchError(f"split has {len(data)} bytes, too short for seq_len={seq_len}: "
                            f"expected seq_len <= {len(data) - 1}")
    return len(data)


def _gather(data: np.ndarray, starts: np.ndarray, seq_len: int) -> tuple[torch.Tensor, ...]:
    idx = starts[:, None] + np.arange(seq_len + 1)
    rows = torch.from_numpy(np.asarray(data[idx], dtype=np.int64))
    return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()


def get_batch(
    data: np.ndarray, batch_size: int, seq_len: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random windows: ``x`` (B, T) int64 bytes and ``y`` = the next byte at every position.

    Start offsets come from ``torch.randint(..., generator=generator)``, so a seeded generator
    fixes the data order; every offset in ``[0, len(data) - T - 1]`` is equally likely.
    """
    _check_positive("batch_size", batch_size)
    n = _check_window(data, seq_len)
    starts = torch.randint(0, n - seq_len, (batch_size,), generator=generator).numpy()
    return _gather(data, starts, seq_len)


def window_starts(n: int, seq_len: int, n_windows: int) -> np.ndarray:
    """Evenly spaced window starts from 0 to ``n - seq_len - 1``, at most ``(n-1)//seq_len``.

    The cap is the number of windows that fit without predicting any byte twice, so windows
    never overlap and, at the cap, they tile the split.
    """
    _check_positive("n_windows", n_windows)
    k = min(int(n_windows), (n - 1) // seq_len)
    return np.arange(k, dtype=np.int64) * (n - seq_len - 1) // max(k - 1, 1)


def eval_windows(
    data: np.ndarray, seq_len: int, n_windows: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fixed, evenly spaced windows over the whole split (no RNG): ``x``, ``y`` of shape (n, T).

    ``n`` is ``n_windows`` capped by :func:`window_starts`; the first window starts at byte 0
    and the last ends at the split's last byte, so every arm is scored on the same bytes.
    """
    n = _check_window(data, seq_len)
    return _gather(data, window_starts(n, seq_len, n_windows), seq_len)


def eval_windows_with_labels(
    corpus: Corpus, split: str, seq_len: int, n_windows: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`eval_windows` plus difficulty labels: ``x, y, labels_of_x, labels_of_y``.

    ``labels_of_y`` marks targets that are hard to predict (per-byte loss on hard bytes);
    ``labels_of_x`` marks hard input tokens (what a router chose for them). Only for corpora
    with labels (``arithmetic``).
    """
    if corpus.labels is None:
        raise ModbenchError(f"corpus {corpus.name} has no difficulty labels: expected 'arithmetic'")
    data = corpus.split(split)
    n = _check_window(data, seq_len)
    starts = window_starts(n, seq_len, n_windows)
    x, y = _gather(data, starts, seq_len)
    lx, ly = _gather(corpus.labels[split], starts, seq_len)
    return x, y, lx, ly
