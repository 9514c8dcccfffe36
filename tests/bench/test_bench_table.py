"""modbench.bench.table on a synthetic pytest-benchmark JSON."""

from __future__ import annotations

import json

import pytest

from modbench.bench import table as bench_table


def _entry(kind, variant, capacity, T, t_min, flop_ratio, *, batch=8, repeat=0, paired=None, pattern=None):
    info = dict(kind=kind, scope=kind, variant=variant, capacity=capacity, seq_len=T, batch=batch,
                device="cpu", dtype="fp32", flop_ratio=flop_ratio, repeat=repeat, foreign_cpu=0.01)
    if pattern:
        info["pattern"] = pattern
    if paired is not None:
        info.update(paired_time_ratio=paired, paired_rounds=5)
    stats = dict(min=t_min, median=t_min * 1.1, mean=t_min * 1.2, rounds=5)
    return dict(name=f"{kind}-{variant}-{capacity}-{T}-{repeat}", group=f"{kind} T={T} scope={kind}",
                extra_info=info, stats=stats)


@pytest.fixture
def report(tmp_path):
    data = {
        "machine_info": {"cpu": {"brand_raw": "test cpu"}, "python_version": "3.11"},
        "datetime": "now",
        "benchmarks": [
            _entry("block", "dense", 1.0, 1024, 0.60, 1.0),
            _entry("block", "dense", 1.0, 1024, 0.50, 1.0, repeat=1),  # the faster one is the reference
            _entry("block", "sigmoid", 0.125, 1024, 0.06, 0.098, paired=0.11),
            _entry("block", "sigmoid", 0.5, 1024, 0.30, 0.438, paired=0.55),
            _entry("block", "norm", 0.125, 512, 0.03, 0.109),  # no dense at T=512: no ratio
            _entry("model", "dense", 1.0, 512, 0.50, 1.0, batch=4, pattern="alternate"),
            _entry("model", "sigmoid", 0.125, 512, 0.32, 0.563, batch=4, pattern="alternate"),
            {"name": "unrelated", "extra_info": {}, "stats": {"min": 1.0}},
        ],
    }
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(data))
    return path


def test_pairs_ratios_and_bars(report):
    df = bench_table.table(bench_table.load(report)).set_index(["kind", "variant", "C", "T"])
    s = df.loc[("block", "sigmoid", 0.125, 1024)]
    assert s.dense_ms == pytest.approx(500.0)  # the faster of the two dense entries
    assert s.raw_ratio == pytest.approx(0.06 / 0.50)
    assert s.time_ratio == pytest.approx(0.11)  # the paired ratio wins over the raw one
    assert s.efficiency == pytest.approx(0.098 / 0.11)
    assert s.gain == pytest.approx((1 / 0.11 - 1) / (1 / 0.098 - 1))
    assert s.bar.startswith("met")  # 0.11 / 0.098 = 1.12 ≤ 1.25
    assert df.loc[("block", "sigmoid", 0.5, 1024)].bar.startswith("MISSED")  # 1.26 > 1.15
    assert df.loc[("block", "norm", 0.125, 512)].bar == ""  # no dense reference, no bar
    m = df.loc[("model", "sigmoid", 0.125, 512)]
    assert m.time_ratio == pytest.approx(0.64)  # raw: no paired ratio recorded
    assert m.bar.startswith("met")  # efficiency 0.563 / 0.64 = 0.88 ≥ 0.85


def test_cli_prints_writes_markdown_and_fails_on_a_missed_bar(report, tmp_path, capsys):
    md = tmp_path / "out" / "bench.md"
    assert bench_table.main([str(report), "--markdown", str(md)]) == 0
    out = capsys.readouterr().out
    assert "sigmoid" in out and "MISSED" in out
    text = md.read_text()
    assert "| kind" in text and "## Bar" in text
    assert bench_table.main([str(report), "--fail-on-bar"]) == 1


def test_baseline_column(report):
    df = bench_table.table(bench_table.load(report))
    both = bench_table.with_baseline(df, df)
    routed = both[both["variant"] == "sigmoid"]
    assert (routed["vs_baseline"].abs() < 1e-12).all()


def _decode(variant, pattern, batch, t_min, *, paired=None):
    info = dict(kind="decode", scope="decode", variant=variant, capacity=1.0 if variant == "dense" else 0.125,
                pattern=pattern, seq_len=192, batch=batch, device="cuda", dtype="bf16", d_model=1024,
                tokens=batch * 128, flop_ratio=1.0 if variant == "dense" else 0.3)
    if paired is not None:
        info.update(paired_time_ratio=paired, paired_rounds=3)
    return dict(name=f"decode-{variant}-{pattern}-{batch}", extra_info=info,
                stats=dict(min=t_min, median=t_min, mean=t_min, rounds=3))


def _mfu(d_model, t_min):
    info = dict(kind="mfu", scope="mfu", variant="dense", capacity=1.0, seq_len=2048, batch=8, device="cuda",
                dtype="bf16-autocast", d_model=d_model, analytic_flops=2e14, peak_flops=989e12, gpu="NVIDIA H100")
    return dict(name=f"mfu-{d_model}", extra_info=info, stats=dict(min=t_min, median=t_min, mean=t_min, rounds=5))


def test_decode_and_mfu_rows_bars_and_merged_files(tmp_path):
    """Decode rows: speed-up 1/time ratio against the 1.5× bar at fixed:1,1, C = 0.125, B = 64 only;
    mfu rows: FLOPs / time / peak against 40 %; two JSONs read as one."""
    base = {"machine_info": {}, "datetime": "now"}
    decode = dict(base, benchmarks=[
        _decode("dense", "-", 64, 1.0),
        _decode("sigmoid", "fixed:1,1", 64, 0.6, paired=0.625),  # 1.6× the dense tokens/s
        _decode("sigmoid", "alternate", 64, 0.9, paired=0.9),  # no bar at alternate
        _decode("dense", "-", 8, 0.5),
        _decode("sigmoid", "fixed:1,1", 8, 0.5, paired=1.0),  # no bar at B = 8
    ])
    mfu = dict(base, benchmarks=[_mfu(1024, 0.4), _mfu(2048, 0.6)])  # 2e14 FLOPs: 50.6 %, 33.7 % of 989e12
    paths = [tmp_path / "decode.json", tmp_path / "mfu.json"]
    for path, data in zip(paths, (decode, mfu)):
        path.write_text(json.dumps(data))
    df = bench_table.table(bench_table.merge([bench_table.load(p) for p in paths])).set_index(["kind", "variant", "B"])

    fixed = df.loc[("decode", "sigmoid fixed:1,1", 64)]
    assert fixed.dense_ms == pytest.approx(1000.0) and fixed.time_ratio == pytest.approx(0.625)
    assert fixed.tok_s == pytest.approx(64 * 128 / 0.6)
    assert fixed.bar.startswith("met") and "1.60×" in fixed.bar
    assert df.loc[("decode", "sigmoid alternate", 64)].bar == ""
    assert df.loc[("decode", "sigmoid fixed:1,1", 8)].bar == ""
    small, large = df.loc[("mfu", "dense d=1024", 8)], df.loc[("mfu", "dense d=2048", 8)]
    assert small.mfu == pytest.approx(2e14 / 0.4 / 989e12) and small.bar.startswith("met")
    assert large.mfu == pytest.approx(2e14 / 0.6 / 989e12) and large.bar.startswith("MISSED")

    md, merged = tmp_path / "gpu.md", tmp_path / "gpu.json"
    assert bench_table.main([*map(str, paths), "--markdown", str(md), "--write-json", str(merged)]) == 0
    text = md.read_text()
    head = next(line for line in text.splitlines() if line.startswith("| kind"))
    assert "tok_s" in head and "mfu" in head
    assert "mfu rows" in text and "decode rows" in text and "NVIDIA H100" in text
    assert "MFU 50.6%" in text and "1.60× the dense tokens/s" in text
    assert len(json.loads(merged.read_text())["benchmarks"]) == 7


def test_block_and_model_markdown_has_no_decode_or_mfu_columns(report, tmp_path):
    md = tmp_path / "bench.md"
    assert bench_table.main([str(report), "--markdown", str(md)]) == 0
    head = next(line for line in md.read_text().splitlines() if line.startswith("| kind"))
    assert "tok_s" not in head and "mfu" not in head
