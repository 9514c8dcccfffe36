"""Tests for modbench.data: corpora, verified downloads, splits, batches and eval windows."""

from __future__ import annotations

import functools
import hashlib
import http.server
import io
import platform
import re
import shutil
import socket

import sysconfig
import threading
import urllib.request
import zipfile
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from modbench import data as D
from modbench.errors import ModbenchError

SHAKESPEARE = Path(__file__).resolve().parents[2] / "shared" / "data" / "tinyshakespeare.txt"
SHAKESPEARE_SIZE = 1_115_394
SHAKESPEARE_SHA = "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"

needs_shakespeare = pytest.mark.skipif(
    not SHAKESPEARE.is_file(), reason=f"{SHAKESPEARE} is missing"
)


def one_line(exc: pytest.ExceptionInfo) -> str:
    msg = str(exc.value)
    assert "\n" not in msg and msg.strip() == msg and msg
    return msg


@pytest.fixture
def data_home(tmp_path, monkeypatch) -> Path:
    home = tmp_path / "data"
    monkeypatch.setenv("MODBENCH_DATA_DIR", str(home))
    for name in D.SOURCES:
        monkeypatch.delenv(f"MODBENCH_{name.upper()}_URL", raising=False)
    return home


@pytest.fixture
def no_network(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("modbench.data tried to use the network")

    monkeypatch.setattr(urllib.request, "urlopen", refuse)


@pytest.fixture
def serve(tmp_path):
    """serve(name, payload) -> URL of `payload` on a local HTTP server (127.0.0.1 only)."""
    root = tmp_path / "www"
    root.mkdir()

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(Quiet, directory=str(root))
    )
    thread = threading.Thread(
        target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
    )
    thread.start()

    def publish(name: str, payload: bytes) -> str:
        (root / name).write_bytes(payload)
        return f"http://127.0.0.1:{server.server_address[1]}/{name}"

    yield publish
    server.shutdown()
    server.server_close()
    thread.join(5)


def leftovers(home: Path) -> list[str]:
    return sorted(p.name for p in home.iterdir()) if home.exists() else []


# --- data dir and known sources ------------------------------------------------------------

def test_data_dir_follows_env_and_is_created(tmp_path, monkeypatch):
    target = tmp_path / "a" / "b"
    monkeypatch.setenv("MODBENCH_DATA_DIR", str(target))
    assert D.data_dir() == target and target.is_dir()
    monkeypatch.delenv("MODBENCH_DATA_DIR")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert D.data_dir() == tmp_path / "home" / ".cache" / "modbench"


def test_sources_match_the_published_files():
    ts = D.SOURCES["tinyshakespeare"]
    assert ts.url.endswith("karpathy/char-rnn/master/data/tinyshakespeare/input.txt")
    assert (ts.size, ts.sha256, ts.kind) == (SHAKESPEARE_SIZE, SHAKESPEARE_SHA, "raw")
    en = D.SOURCES["enwik8"]
    assert en.url == "http://mattmahoney.net/dc/enwik8.zip"
    assert (en.size, en.kind, en.member) == (100_000_000, "zip", "enwik8")
    assert D.KNOWN_DATASETS == ("stdlib", "tinyshakespeare", "enwik8", "arithmetic")


# --- tiny shakespeare ----------------------------------------------------------------------

@needs_shakespeare
def test_tinyshakespeare_offline_from_seeded_data_dir(data_home, no_network):
    data_home.mkdir()
    shutil.copy(SHAKESPEARE, data_home / "tinyshakespeare.txt")
    c = D.load_corpus("tinyshakespeare")
    assert c.name == "tinyshakespeare" and c.sha256 == SHAKESPEARE_SHA
    sizes = [len(c.train), len(c.val), len(c.test)]
    assert sum(sizes) == SHAKESPEARE_SIZE
    assert sizes == [1_003_854, 55_770, 55_770]  # floor(90%), floor(95%) - floor(90%), rest
    assert all(isinstance(s, np.memmap) and s.dtype == np.uint8 and s.ndim == 1
               for s in (c.train, c.val, c.test))
    # contiguous, in order, covering the file exactly
    joined = np.concatenate([c.split("train"), c.split("val"), c.split("test")]).tobytes()
    assert joined == SHAKESPEARE.read_bytes()
    # the checksum is remembered beside the file and reused
    assert (data_home / "tinyshakespeare.txt.sha256").is_file()
    assert D.load_corpus("tinyshakespeare").sha256 == SHAKESPEARE_SHA


@needs_shakespeare
def test_tinyshakespeare_unigram_entropy(data_home, no_network):
    data_home.mkdir()
    shutil.copy(SHAKESPEARE, data_home / "tinyshakespeare.txt")
    c = D.load_corpus("tinyshakespeare")
    # measured: 4.77935 bits/byte for the whole file, 4.77400 for the train split
    assert c.unigram_entropy_bits() == pytest.approx(4.774, abs=2e-3)
    assert 4.70 < c.unigram_entropy_bits("test") < 4.85


def test_unigram_entropy_exact_values(tmp_path):
    two = tmp_path / "two.bin"
    two.write_bytes(b"ab" * 1000)
    assert D.load_corpus(str(two)).unigram_entropy_bits() == pytest.approx(1.0)
    flat = tmp_path / "flat.bin"
    flat.write_bytes(bytes(range(256)) * 40)
    assert D.load_corpus(str(flat)).unigram_entropy_bits("val") == pytest.approx(8.0)
    const = tmp_path / "const.bin"
    const.write_bytes(b"z" * 100)
    assert D.load_corpus(str(const)).unigram_entropy_bits() == 0.0


# --- downloads -----------------------------------------------------------------------------

@needs_shakespeare
def test_download_success(data_home, serve, monkeypatch):
    url = serve("input.txt", SHAKESPEARE.read_bytes())
    monkeypatch.setenv("MODBENCH_TINYSHAKESPEARE_URL", url)
    c = D.load_corpus("tinyshakespeare")
    assert c.sha256 == SHAKESPEARE_SHA
    assert (data_home / "tinyshakespeare.txt").read_bytes() == SHAKESPEARE.read_bytes()
    assert leftovers(data_home) == ["tinyshakespeare.txt", "tinyshakespeare.txt.sha256"]


@needs_shakespeare
@pytest.mark.parametrize("damage", ["truncated", "flipped"])
def test_download_of_bad_file_saves_nothing(data_home, serve, monkeypatch, damage):
    good = SHAKESPEARE.read_bytes()
    bad = good[:-1000] if damage == "truncated" else good[:500] + b"#" + good[501:]
    monkeypatch.setenv("MODBENCH_TINYSHAKESPEARE_URL", serve("input.txt", bad))
    with pytest.raises(ModbenchError) as exc:
        D.load_corpus("tinyshakespeare")
    msg = one_line(exc)
    assert "corrupt" in msg and "tinyshakespeare" in msg
    assert leftovers(data_home) == []  # no partial or unverified file, no temp file


def test_download_network_failure_names_url_and_target(data_home, monkeypatch):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}/input.txt"
    monkeypatch.setenv("MODBENCH_TINYSHAKESPEARE_URL", url)
    with pytest.raises(ModbenchError) as exc:
        D.load_corpus("tinyshakespeare")
    msg = one_line(exc)
    assert msg.startswith(f"could not download tinyshakespeare from {url} (")
    assert msg.endswith(f"place a copy at {data_home / 'tinyshakespeare.txt'}")
    assert leftovers(data_home) == []


def test_download_http_error(data_home, serve, monkeypatch):
    missing = serve("other.txt", b"x").replace("other.txt", "missing.txt")
    monkeypatch.setenv("MODBENCH_TINYSHAKESPEARE_URL", missing)
    with pytest.raises(ModbenchError, match="could not download tinyshakespeare.*404"):
        D.load_corpus("tinyshakespeare")
    assert leftovers(data_home) == []


@needs_shakespeare
@pytest.mark.parametrize("damage", ["short", "same_size"])
def test_corrupt_cached_file_is_never_used(data_home, no_network, damage):
    good = SHAKESPEARE.read_bytes()
    bad = good[:1000] if damage == "short" else b"X" + good[1:]
    data_home.mkdir()
    cached = data_home / "tinyshakespeare.txt"
    cached.write_bytes(bad)
    with pytest.raises(ModbenchError) as exc:
        D.load_corpus("tinyshakespeare")
    msg = one_line(exc)
    assert "corrupt" in msg and str(cached) in msg and "delete" in msg
    assert cached.read_bytes() == bad  # reported, not silently replaced


@needs_shakespeare
def test_file_corrupted_after_verification_is_caught(data_home, no_network):
    data_home.mkdir()
    cached = data_home / "tinyshakespeare.txt"
    shutil.copy(SHAKESPEARE, cached)
    D.load_corpus("tinyshakespeare")  # writes the checksum sidecar
    raw = bytearray(cached.read_bytes())
    raw[123] ^= 0xFF  # same size, so only the checksum can notice
    cached.write_bytes(bytes(raw))
    with pytest.raises(ModbenchError, match="corrupt"):
        D.load_corpus("tinyshakespeare")


def _zip_of(member: str, payload: bytes) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr(member, payload)
    return buf.getvalue()


@pytest.fixture
def fake_enwik8(monkeypatch):
    """A small stand-in for enwik8, with SOURCES pointing at its true size and checksum."""
    payload = np.random.default_rng(1).integers(32, 127, 200_000, dtype=np.uint8).tobytes()
    src = replace(D.SOURCES["enwik8"], size=len(payload),
                  sha256=hashlib.sha256(payload).hexdigest())
    monkeypatch.setitem(D.SOURCES, "enwik8", src)
    return payload


def test_enwik8_zip_download(data_home, serve, monkeypatch, fake_enwik8):
    monkeypatch.setenv("MODBENCH_ENWIK8_URL", serve("enwik8.zip", _zip_of("enwik8", fake_enwik8)))
    c = D.load_corpus("enwik8", root=data_home / "elsewhere")
    assert np.concatenate([c.train, c.val, c.test]).tobytes() == fake_enwik8
    assert (len(c.train), len(c.val), len(c.test)) == (180_000, 10_000, 10_000)
    assert c.sha256 == hashlib.sha256(fake_enwik8).hexdigest()
    assert leftovers(data_home / "elsewhere") == ["enwik8", "enwik8.sha256"]


@pytest.mark.parametrize("bad", ["wrong_member", "short_member", "not_a_zip"])
def test_enwik8_bad_zip_saves_nothing(data_home, serve, monkeypatch, fake_enwik8, bad):
    body = {"wrong_member": _zip_of("other", fake_enwik8),
            "short_member": _zip_of("enwik8", fake_enwik8[:-1]),
            "not_a_zip": fake_enwik8}[bad]
    monkeypatch.setenv("MODBENCH_ENWIK8_URL", serve("enwik8.zip", body))
    with pytest.raises(ModbenchError) as exc:
        D.load_corpus("enwik8")
    assert "enwik8" in one_line(exc)
    assert leftovers(data_home) == []


def test_enwik8_without_checksum_still_checks_size(data_home, no_network, monkeypatch):
    monkeypatch.setitem(D.SOURCES, "enwik8", replace(D.SOURCES["enwik8"], size=1000))
    data_home.mkdir()
    (data_home / "enwik8").write_bytes(b"a" * 999)
    with pytest.raises(ModbenchError, match="999 bytes, expected 1000"):
        D.load_corpus("enwik8")
    (data_home / "enwik8").write_bytes(b"a" * 1000)
    assert len(D.load_corpus("enwik8").train) == 900


# --- stdlib --------------------------------------------------------------------------------

def test_stdlib_file_list_excludes_tests_and_is_sorted():
    root = Path(sysconfig.get_paths()["stdlib"])
    files = D.stdlib_files()
    rels = [f.relative_to(root) for f in files]
    assert [r.as_posix() for r in rels] == sorted(r.as_posix() for r in rels)
    names = {r.as_posix() for r in rels}
    assert {"os.py", "json/__init__.py", "collections/__init__.py"} <= names
    for r in rels:
        dirs = set(r.parts[:-1])
        assert not dirs & {"test", "tests", "idle_test", "site-packages"}, r
        assert r.suffix == ".py"
    if (root / "test" / "test_grammar.py").exists():  # the excluded tree really exists here
        assert "test/test_grammar.py" not in names


def test_stdlib_corpus_builds_once_and_is_deterministic(tmp_path, monkeypatch, no_network):
    monkeypatch.setenv("MODBENCH_DATA_DIR", str(tmp_path))
    files = D.stdlib_files()
    expected = hashlib.sha256(b"".join(f.read_bytes() for f in files)).hexdigest()
    c1 = D.load_corpus("stdlib")
    cache = tmp_path / f"stdlib-{platform.python_version()}.bin"
    assert cache.is_file() and cache.stat().st_size == sum(f.stat().st_size for f in files)
    assert cache.stat().st_size > 1_000_000 and c1.sha256 == expected
    assert [p.name for p in tmp_path.iterdir() if p.suffix == ".part"] == []
    mtime = cache.stat().st_mtime_ns
    c2 = D.load_corpus("stdlib")
    assert c2.sha256 == c1.sha256 and cache.stat().st_mtime_ns == mtime  # reused, not rebuilt
    cache.unlink()
    assert D.load_corpus("stdlib", root=tmp_path / "other").sha256 == expected
    assert isinstance(c2.train, np.memmap)
    assert b"def " in c2.train[:200_000].tobytes()


# --- arithmetic ----------------------------------------------------------------------------

def _check_arithmetic(c: D.Corpus) -> None:
    for split in D.SPLITS:
        text = c.split(split).tobytes().decode("ascii")
        labels = c.labels[split]
        assert len(labels) == len(text) and labels.dtype == np.uint8
        assert text.endswith("\n") and set(np.unique(labels)) <= {0, 1}
        pos = 0
        for line in text.split("\n")[:-1]:
            m = re.fullmatch(r"(\d+)([+*])(\d+)=(\d+)", line)
            assert m, line
            a, op, b, r = int(m[1]), m[2], int(m[3]), int(m[4])
            assert 0 <= a < 100 and 0 <= b < 100 and r == (a * b if op == "*" else a + b)
            hard_from = len(line) - len(m[4])
            want = [int(op == "*" and i >= hard_from) for i in range(len(line))] + [0]
            assert labels[pos:pos + len(line) + 1].tolist() == want, line
            pos += len(line) + 1


def test_arithmetic_is_correct_and_labelled():
    c = D.load_corpus("arithmetic", seed=3, arithmetic_bytes=20_000)
    _check_arithmetic(c)
    total = sum(len(c.split(s)) for s in D.SPLITS)
    assert 20_000 <= total < 20_000 + 10
    assert abs(len(c.train) - 0.9 * total) < 10 and abs(len(c.val) - 0.05 * total) < 10
    hard = np.concatenate([c.labels[s] for s in D.SPLITS])
    assert 0.1 < hard.mean() < 0.3  # both classes, hard ones a minority
    assert not isinstance(c.train, np.memmap)


def test_arithmetic_default_size_and_operator_balance():
    c = D.load_corpus("arithmetic")
    data = np.concatenate([c.train, c.val, c.test]).tobytes()
    assert 2_000_000 <= len(data) < 2_000_010
    plus, times = data.count(b"+"), data.count(b"*")
    assert abs(plus - times) / (plus + times) < 0.02


def test_arithmetic_is_deterministic_per_seed():
    a = D.load_corpus("arithmetic", seed=7, arithmetic_bytes=5_000)
    b = D.load_corpus("arithmetic", seed=7, arithmetic_bytes=5_000)
    other = D.load_corpus("arithmetic", seed=8, arithmetic_bytes=5_000)
    assert a.sha256 == b.sha256 and a.sha256 != other.sha256
    for s in D.SPLITS:
        assert np.array_equal(a.split(s), b.split(s))
        assert np.array_equal(a.labels[s], b.labels[s])
    assert a.train.tobytes() != other.train.tobytes()


def test_arithmetic_windows_carry_labels():
    c = D.load_corpus("arithmetic", seed=1, arithmetic_bytes=20_000)
    x, y, lx, ly = D.eval_windows_with_labels(c, "train", 32, 10)
    ex, ey = D.eval_windows(c.train, 32, 10)
    assert torch.equal(x, ex) and torch.equal(y, ey)
    assert lx.shape == x.shape and torch.equal(lx[:, 1:], ly[:, :-1])
    starts = D.window_starts(len(c.train), 32, 10)
    for row, s in enumerate(starts):
        assert lx[row].tolist() == c.labels["train"][s:s + 32].tolist()
    hard_targets = y[ly == 1]
    assert len(hard_targets) > 0
    assert bool(((hard_targets >= ord("0")) & (hard_targets <= ord("9"))).all())
    with pytest.raises(ModbenchError, match="no difficulty labels"):
        D.eval_windows_with_labels(D.Corpus("x", c.train, c.val, c.test, "0"), "val", 8, 1)


# --- batches -------------------------------------------------------------------------------

def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


RAMP = (np.arange(10_000) % 251).astype(np.uint8)  # each byte determines its neighbours


def test_get_batch_shapes_and_shift():
    x, y = D.get_batch(RAMP, 8, 64, _gen(0))
    assert x.shape == y.shape == (8, 64) and x.dtype == y.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    # every row is a contiguous window of the data
    assert bool((((y - x) % 251) == 1).all())
    starts = x[:, 0].numpy()
    for row, s in zip(x.numpy(), starts):
        offsets = np.flatnonzero(RAMP[: len(RAMP) - 64] == s)
        assert any(np.array_equal(RAMP[o:o + 64], row) for o in offsets)


def test_get_batch_seeding():
    a = D.get_batch(RAMP, 4, 16, _gen(42))
    b = D.get_batch(RAMP, 4, 16, _gen(42))
    c = D.get_batch(RAMP, 4, 16, _gen(43))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[0], c[0])
    g = _gen(5)
    assert not torch.equal(D.get_batch(RAMP, 4, 16, g)[0], D.get_batch(RAMP, 4, 16, g)[0])


def test_get_batch_on_memmap_and_exact_fit(tmp_path):
    f = tmp_path / "f.bin"
    f.write_bytes(bytes(range(100)) * 10)
    c = D.load_corpus(str(f))
    x, y = D.get_batch(c.val, 3, 49, _gen(0))  # val is 50 bytes: one possible window
    assert x.tolist() == [list(c.val[:49])] * 3 and y.tolist() == [list(c.val[1:50])] * 3
    with pytest.raises(ModbenchError) as exc:
        D.get_batch(c.val, 3, 50, _gen(0))
    msg = one_line(exc)
    assert "50 bytes" in msg and "seq_len=50" in msg


@settings(max_examples=60, deadline=None)
@given(n=st.integers(2, 400), seq_len=st.integers(1, 64), batch=st.integers(1, 16),
       seed=st.integers(0, 2**31))
def test_get_batch_windows_in_bounds(n, seq_len, batch, seed):
    data = np.arange(n)  # int64 positions instead of bytes, so each value is its own offset
    if n < seq_len + 1:
        with pytest.raises(ModbenchError):
            D.get_batch(data, batch, seq_len, _gen(seed))
        return
    x, y = D.get_batch(data, batch, seq_len, _gen(seed))
    assert x.shape == (batch, seq_len)
    assert torch.equal(x, x[:, :1] + torch.arange(seq_len)) and torch.equal(y, x + 1)
    assert int(x[:, 0].min()) >= 0 and int(y[:, -1].max()) <= n - 1


def test_eval_windows_deterministic_even_and_bounded():
    x1, y1 = D.eval_windows(RAMP, 100, 20)
    x2, y2 = D.eval_windows(RAMP, 100, 20)
    assert torch.equal(x1, x2) and torch.equal(y1, y2) and x1.shape == (20, 100)
    assert torch.equal(x1[:, 1:], y1[:, :-1])
    starts = D.window_starts(len(RAMP), 100, 20)
    assert starts[0] == 0 and starts[-1] == len(RAMP) - 101  # first byte to last byte
    gaps = np.diff(starts)
    assert gaps.min() >= 100 and gaps.max() - gaps.min() <= 1
    for row, s in zip(x1.numpy(), starts):
        assert np.array_equal(row, RAMP[s:s + 100])


@settings(max_examples=80, deadline=None)
@given(n=st.integers(2, 2000), seq_len=st.integers(1, 300), want=st.integers(1, 500))
def test_window_starts_cap_and_no_overlap(n, seq_len, want):
    if n < seq_len + 1:
        return
    starts = D.window_starts(n, seq_len, want)
    assert len(starts) == min(want, (n - 1) // seq_len)
    assert starts[0] == 0 and starts[-1] + seq_len + 1 <= n
    assert (np.diff(starts) >= seq_len).all()
    if len(starts) > 1:
        assert starts[-1] == n - seq_len - 1


def test_eval_windows_caps_and_rejects_short_split():
    x, _ = D.eval_windows(RAMP[:1001], 100, 50)
    assert x.shape == (10, 100)  # ten windows tile the 1000 predicted bytes
    with pytest.raises(ModbenchError, match="10 bytes, too short for seq_len=10"):
        D.eval_windows(RAMP[:10], 10, 1)


@pytest.mark.parametrize("call", [
    lambda: D.get_batch(RAMP, 0, 8, _gen(0)),
    lambda: D.get_batch(RAMP, 2, 0, _gen(0)),
    lambda: D.eval_windows(RAMP, 8, 0),
    lambda: D.load_corpus("arithmetic", seed=-1),
    lambda: D.load_corpus("arithmetic", arithmetic_bytes=10),
])
def test_bad_sizes_are_user_errors(call):
    with pytest.raises(ModbenchError) as exc:
        call()
    assert "must be" in one_line(exc)


# --- bad input -----------------------------------------------------------------------------

def test_unknown_name_lists_known_datasets(tmp_path):
    with pytest.raises(ModbenchError) as exc:
        D.load_corpus("foo")
    assert one_line(exc) == ("unknown dataset 'foo': expected 'stdlib', 'tinyshakespeare', "
                             "'enwik8', 'arithmetic' or a path to a file")
    with pytest.raises(ModbenchError, match="dataset file .* does not exist: give an existing file"):
        D.load_corpus(str(tmp_path / "missing.txt"))


def test_empty_file_and_directory_are_rejected(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    with pytest.raises(ModbenchError, match="empty"):
        D.load_corpus(str(empty))
    with pytest.raises(ModbenchError, match="not a regular file"):
        D.load_corpus(str(tmp_path))


def test_local_file_corpus(tmp_path):
    f = tmp_path / "corpus.txt"
    payload = bytes(range(256)) * 4
    f.write_bytes(payload)
    c = D.load_corpus(str(f))
    assert c.name == str(f.resolve()) and c.labels is None
    assert c.sha256 == hashlib.sha256(payload).hexdigest()
    assert (len(c.train), len(c.val), len(c.test)) == (921, 51, 52)
    assert isinstance(c.train, np.memmap) and not c.train.flags.writeable
    assert list(tmp_path.iterdir()) == [f]  # nothing written beside a user's file
    with pytest.raises(ModbenchError) as exc:
        c.split("validation")
    assert one_line(exc) == "unknown split 'validation': expected 'train', 'val' or 'test'"
