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
        info.update(paired_time_ratio=paired, paired_median_ratio=paired, paired_rounds=3)
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


# --- the decode table: roofline, realised share, every variant ---------------------------------
def test_roofline_on_a_hand_computed_example():
    """Two layers at peak 100 FLOP/s and bandwidth 10 B/s, batch 2.

    Dense layer: every step 2 tokens × 30 FLOPs = 60 FLOPs (0.6 s) vs 40 B weights + 2 × 5 B of
    cache = 50 B (5 s): 5 s. Routed layer, share 0.5: b = 0, 1, 2 with probability 1/4, 1/2, 1/4;
    always 2 tokens × 10 FLOPs (router) and 10 B of router weights; b > 0 adds 200 FLOPs and 5 B
    per token and reads 100 B of weights. b = 0: max(0.2, 1) = 1 s; b = 1: max(2.2, 11.5) = 11.5 s;
    b = 2: max(4.2, 12) = 12 s. Expected 0.25 + 5.75 + 3 = 9 s."""
    from modbench.bench import decode_roofline as rl

    m = rl.Machine(peak_flops=100.0, bandwidth=10.0)
    dense = rl.LayerCost(routed_flops=30.0, routed_bytes=40.0, routed_token_bytes=5.0)
    routed = rl.LayerCost(share=0.5, always_flops=10.0, always_bytes=10.0, routed_flops=200.0, routed_bytes=100.0,
                          routed_token_bytes=5.0)
    assert rl.layer_time(dense, 2, m) == pytest.approx(5.0)
    assert rl.layer_time(routed, 2, m) == pytest.approx(9.0)
    # batch 1: the weights are read on a fraction 1 − (1 − s)^1 = s of the steps (b = 0: the router's 10 B, 1 s)
    assert rl.layer_time(routed, 1, m) == pytest.approx(0.5 * 1.0 + 0.5 * 11.5)
    assert rl.speedup_limit([dense, dense], [dense, routed], 2, m) == pytest.approx(10.0 / 14.0)
    # a mixture of 4 experts of 8 B each: 2 tokens use 4·(1 − (3/4)²) = 1.75 distinct experts
    moe = rl.LayerCost(share=1.0, routed_flops=1.0, experts=4, expert_bytes=8.0)
    assert rl.layer_time(moe, 2, m) == pytest.approx(1.75 * 8.0 / 10.0)


def test_model_costs_read_off_the_modules():
    """A dense layer's FLOPs are 2 per linear weight + 4·d per cached key; a routed block-scope
    layer at share s reads its weights (and runs its FLOPs) only for processed tokens."""
    import torch

    from modbench.bench import decode_roofline as rl
    from modbench.config.model import ModelConfig, RoutingConfig
    from modbench.model.gpt import GPT

    cfg = ModelConfig(depth=2, n_embd=32, head_dim=8, max_seq_len=16)
    with torch.device("meta"):
        dense, routed = GPT(cfg), GPT(cfg, RoutingConfig("sigmoid", capacity=0.25, pattern="DM"))
    d = 32
    block_w = 4 * d * d + 8 * d * d  # qkv + proj + the 4× MLP
    c = rl.model_costs(dense, context=10.0)
    assert len(c) == 3 and c[0].routed_flops == pytest.approx(2 * block_w + 4 * d * 10.0)
    assert c[0].routed_bytes == 4 * block_w and c[0].routed_token_bytes == 4 * 2 * d * 10.0
    assert c[-1].always_flops == 2 * 256 * d  # the head
    r = rl.model_costs(routed, context=10.0, shares=[0.25])
    assert r[1].share == 0.25 and r[1].routed_bytes == 4 * block_w and r[1].always_flops == 2 * d  # the router
    assert r[1].routed_token_bytes == pytest.approx(4 * 2 * d * 10.0 * 0.25)  # its cache holds a quarter


def _decode_row(variant, batch, *, ratio, roofline, counted, reference, share=0.125):
    entry = _decode(variant, "fixed:1,1" if variant != "dense" else "-", batch, 1.0, paired=ratio)
    entry["extra_info"].update(decode_tokens=batch * 127, counted_fn_s=counted, paired_reference_s=reference,
                               roofline_speedup=roofline, realised_share=share, loadavg=1.5, device="cpu")
    entry["extra_info"]["paired_time_ratio"] = 0.01  # min/min: not what decode rows report
    return entry


def test_decode_rows_report_median_speedup_roofline_share_and_both_bars(tmp_path):
    data = {"machine_info": {}, "datetime": "now", "benchmarks": [
        _decode("dense", "-", 1, 1.0) | {"extra_info": _decode("dense", "-", 1, 1.0)["extra_info"] | {"device": "cpu"}},
        _decode_row("sigmoid", 1, ratio=0.4, roofline=2.8, counted=[0.3, 0.5, 0.4], reference=[1.0, 1.1, 0.9]),
        _decode_row("norm", 1, ratio=0.6, roofline=2.8, counted=[0.6], reference=[1.0]),
    ]}
    path = tmp_path / "decode.json"
    path.write_text(json.dumps(data))
    df = bench_table.table(bench_table.load(path)).set_index(["variant", "B"])
    s = df.loc[("sigmoid fixed:1,1", 1)]
    assert s.time_ratio == pytest.approx(0.4) and s.speedup == pytest.approx(2.5)  # the median ratio, not min/min
    assert s.tok_s == pytest.approx(127 / 0.4) and s.dense_tok_s == pytest.approx(127 / 1.0)
    assert s.realised == pytest.approx(2.5 / 2.8) and s.load == 1.5 and s.share == 0.125
    assert s.bar == "met (2.50× ≥ 2.5× dense tokens/s?); met (89% ≥ 70% of the roofline speed-up?)"
    n = df.loc[("norm fixed:1,1", 1)]
    assert n.bar == "MISSED (60% ≥ 70% of the roofline speed-up?)"  # 1.67 / 2.8; the speed bar is sigmoid's
    md = tmp_path / "decode.md"
    assert bench_table.main([str(path), "--markdown", str(md)]) == 0
    head = next(line for line in md.read_text().splitlines() if line.startswith("| kind"))
    for col in ("tok_s", "dense_tok_s", "e2e_tok_s", "speedup", "roofline", "realised", "share", "load"):
        assert col in head


# Routed variants registered after reports/bench/cpu_decode.json was measured, with why they have no row yet.
# The suite times them (tests/bench/test_decode_speed.py checks them untimed); the committed table gets their
# rows from ``make cpu-decode-bench`` on a quiet machine, and then they leave this list (the test below fails
# on a listed variant that has rows).
NOT_YET_IN_TABLE: dict[str, str] = {}  # none: the table of 2026-11-27 has every registered variant


def test_committed_cpu_decode_table_has_every_variant_at_every_batch():
    """reports/bench/cpu_decode.json (the committed decode table) has, at batch 1, 8 and 64, a dense
    row and a row per registered routed variant the suite times (test_decode_speed.NOT_TIMED says
    which it cannot, and why; ``NOT_YET_IN_TABLE`` which were registered after it was measured), each
    with its roofline and realised share."""
    from pathlib import Path

    from modbench import variants

    path = Path(__file__).resolve().parents[2] / "reports" / "bench" / "cpu_decode.json"
    df = bench_table.table(bench_table.load(path))
    df = df[df["kind"] == "decode"]
    from test_decode_speed import NOT_TIMED

    routed = [v for v in variants.list_variants() if variants.get_variant(v).scope != "none" and v not in NOT_TIMED
              and v not in NOT_YET_IN_TABLE]
    assert set(NOT_YET_IN_TABLE) <= set(variants.list_variants())
    for batch in (1, 8, 64):
        rows = df[df["B"] == batch]
        assert "dense" in set(rows["variant"]), batch
        for v in NOT_YET_IN_TABLE:
            assert not len(rows[rows["variant"] == f"{v} fixed:1,1"]), f"{v} has rows now: remove it from NOT_YET_IN_TABLE"
        for v in routed:
            row = rows[rows["variant"] == f"{v} fixed:1,1"]
            assert len(row) == 1, (v, batch)
            r = row.iloc[0]
            assert r.roofline > 1 and 0 < r.realised and r.tok_s > 0 and 0 < r.share < 0.5, (v, batch)


def test_header_states_the_run_conditions_from_the_entries_not_from_typed_notes():
    """The conditions line is computed from extra_info (load, other processes, threads, rounds, the
    decode shape and the roofline machine); a hand-typed ``note`` in the JSON is not printed."""
    def entry(load, foreign, rounds):
        return dict(name="d", extra_info=dict(kind="decode", variant="sigmoid", threads=1, loadavg=load,
                                              foreign_cpu=foreign, paired_rounds=rounds, d_model=512, depth=8,
                                              prompt=32, new_tokens=32, dtype="fp32", peak_flops=9.85e10,
                                              bandwidth=2.47e10, torch="2.13.0"),
                    stats=dict(min=1.0, median=1.0, mean=1.0, rounds=rounds))
    data = {"machine_info": {"cpu": {"count": 2, "brand_raw": "AMD EPYC"}}, "note": "typed by hand",
            "benchmarks": [entry(4.3, 0.55, 3), entry(5.2, 0.59, 5)]}
    text = bench_table.header(data, "x.json", "min")
    assert "typed by hand" not in text
    for part in ("2 logical CPUs", "torch threads 1", "load average 4.3–5.2", "55%–59% of the CPU", "3–5 paired rounds",
                 "d=512, depth 8, prompt 32 + 32 new tokens, fp32", "peak 98.5 GFLOP/s", "bandwidth 24.7 GB/s"):
        assert part in text, part


@pytest.mark.parametrize("gpu", ["h100", "h200"])
def test_committed_gpu_tables_are_what_the_table_command_makes_of_their_json(gpu, tmp_path):
    """reports/bench/<gpu>.md (issue 30's lent-machine measurements) is the table command's output
    for reports/bench/<gpu>.json, the merged JSON of the session's parts: every row and every bar
    line, so no figure in it was typed or left stale; and it answers the decode bar at batch 64."""
    from pathlib import Path

    bench = Path(__file__).resolve().parents[2] / "reports" / "bench"
    md = tmp_path / f"{gpu}.md"
    assert bench_table.main([str(bench / f"{gpu}.json"), "--markdown", str(md)]) == 0

    def rows(text: str) -> list[str]:
        return [line for line in text.splitlines() if line.startswith(("| ", "- "))]

    committed = rows((bench / f"{gpu}.md").read_text())
    assert committed and committed == rows(md.read_text())
    bars = [line for line in committed if line.startswith("- ")]
    assert any(line.startswith("- decode sigmoid") and "B=64" in line for line in bars), bars
    assert any(line.startswith("- mfu dense d=1024") for line in bars), bars
