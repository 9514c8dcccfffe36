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
