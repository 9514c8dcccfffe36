"""Time ratio vs FLOP ratio from a pytest-benchmark JSON of ``tests/bench``.

    python -m modbench.bench.table reports/bench/cpu.json [more.json …] [--markdown reports/bench/cpu.md]
        [--stat min|median|mean] [--baseline older.json] [--fail-on-bar] [--write-json merged.json]

Several JSONs (tests/bench run in parts, e.g. ``make gpu-bench``) are read as one: the first
file's machine information, every file's entries (``--write-json`` saves that union).

Each routed entry is paired with the dense entry of the same (kind, T, device, batch,
dtype, width) — kind is ``block`` (one layer, forward + backward), ``model`` (a GPT training
step) or ``decode`` (a KV-cached generation, tests/bench/test_decode_speed.py); where the suite
timed the dense reference twice (before and after the variants) the faster of the two — and
reported as

- time ratio  = t_routed / t_dense from adjacent calls: tests/bench precedes every timed
  round of a routed entry with a call of its dense reference (tests/bench/conftest.py) and
  records min(t_routed) / min(t_dense) over those rounds (``paired_time_ratio``); entries
  without it fall back to ``raw_ratio``;
- raw ratio   = the routed entry's statistic / the dense entry's (``--stat``, ``min`` by
  default), two measurements taken minutes apart: on a virtualised machine whose speed
  drifts (measured here: ±20 % on the same dense block) this one is the noisier;
- FLOP ratio  = analytic FLOPs routed / dense (causal, forward + backward; from extra_info);
- efficiency  = FLOP ratio / time ratio = achieved speed-up (t_dense / t_routed) ÷
  theoretical speed-up (FLOPs_dense / FLOPs_routed); 1.0 means the saving is all real;
- gain        = (1/time ratio − 1) / (1/FLOP ratio − 1): the fraction of the theoretical
  *extra* speed-up achieved (stricter than efficiency when both are below 1);
- others_cpu: the share of the machine's CPU that other processes used while the entry's
  rounds ran (for a raw ratio, the larger of the two entries'); above ~10 % a ratio is suspect;
- decode rows (tests/bench/test_decode_speed.py): the time a round counts is the decode steps
  alone (prefill excluded; ``counted_fn_s``), and the time ratio is the *median* of the per-round
  ratios (``paired_median_ratio``), so speedup = 1 / time ratio is the decode speed-up in tokens/s;
  tok_s = decode tokens (B·(N − 1)) / the median counted time, dense_tok_s the same for the dense
  calls of those rounds, e2e_tok_s = all new tokens / the whole call's time (prefill included);
  share = the routed layers' realised processed share; roofline = the attainable speed-up at that
  batch (``modbench.bench.decode_roofline``: per step and layer max(FLOPs/peak, bytes/bandwidth),
  a routed layer's weights read whenever any sequence processes the token); realised = speedup /
  roofline; load = the 1-minute load average after the entry's rounds;
- mfu (``mfu`` rows, tests/bench/test_mfu.py: dense training steps) = analytic training FLOPs
  per step / step time / the GPU's bf16 peak (``mfu``);
- bar (reported, never asserted unless ``--fail-on-bar``): blocks at T ≥ 1024 need
  time ratio ≤ 1.15 × FLOP ratio at C = 0.5 and ≤ 1.25 × at C = 0.125; the model
  (alternate pattern, C = 0.125) needs efficiency ≥ 0.85; decoding with every middle layer
  routed (sigmoid, fixed:1,1, C = 0.125) needs ≥ 1.5 × the dense tokens/s at batch 64 and ≥ 2.5 × at
  batch 1, and every routed decode entry at batch 1 realises ≥ 70 % of its roofline speed-up; the dense
  training step needs MFU ≥ 40 %.

``--baseline`` adds the change of each time ratio against an older JSON (regressions show
as positive percentages); pytest-benchmark's own ``--benchmark-compare`` compares raw times.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pandas as pd

BLOCK_BAR = {0.5: 1.15, 0.125: 1.25}  # capacity -> max time ratio / FLOP ratio, T >= 1024
BLOCK_BAR_MIN_T = 1024
MODEL_BAR = {("alternate", 0.125): 0.85}  # (pattern, capacity) -> min efficiency
# (variant, pattern, C, batch) -> min decode speed-up (issue 28's bar is on the sigmoid router it measured)
DECODE_BAR = {("sigmoid", "fixed:1,1", 0.125, 64): 1.5, ("sigmoid", "fixed:1,1", 0.125, 1): 2.5}
DECODE_REALISED_BAR = {1: 0.70}  # batch -> min share of the roofline speed-up realised (every routed entry)
MFU_BAR = 0.40  # dense training step, bf16
KINDS = ("block", "model", "decode", "mfu")
STATS = ("min", "median", "mean")

COLUMNS = [
    "kind", "variant", "C", "T", "B", "device", "time_ms", "dense_ms", "time_ratio", "pairs",
    "raw_ratio", "flop_ratio", "efficiency", "gain", "bar", "others_cpu",
]
# Shown only where some row has a value (decode and mfu entries).
OPTIONAL = ["tok_s", "dense_tok_s", "e2e_tok_s", "speedup", "share", "roofline", "realised", "load", "mfu"]


def load(path: str | Path) -> dict[str, Any]:
    with open(path) as f:
        data = json.load(f)
    if "benchmarks" not in data:
        raise SystemExit(f"{path}: not a pytest-benchmark JSON (no 'benchmarks' key)")
    return data


def merge(parts: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Several runs' JSONs as one: the first's machine information and date, every entry."""
    merged = dict(parts[0])
    merged["benchmarks"] = [b for part in parts for b in part["benchmarks"]]
    return merged


def mfu(flops_per_step: float, step_seconds: float, peak_flops: float) -> float:
    """Model FLOPs utilisation: achieved FLOP/s (FLOPs per step / step time) ÷ peak FLOP/s
    (Chowdhery et al. 2022, PaLM, appendix B)."""
    return flops_per_step / step_seconds / peak_flops


def _key(info: dict[str, Any]) -> tuple:
    # The width too: entries of different model sizes (test_mfu's) never pair.
    return (info.get("kind"), info.get("seq_len"), info.get("device"), info.get("batch"), info.get("dtype"),
            info.get("d_model"))


def _label(info: dict[str, Any]) -> str:
    """The row's variant column: the variant, plus what tells a row of its group apart."""
    label = info.get("variant", "?")
    if info.get("kind") == "decode" and label != "dense":
        label += f" {info.get('pattern')}"  # two patterns per (C, T, B)
    if info.get("kind") == "mfu":
        label += f" d={info.get('d_model')}"  # one dense model per width
    return label + (" (repeat)" if info.get("repeat") else "")


DECODE_COLUMNS = ("tok_s", "dense_tok_s", "e2e_tok_s", "speedup", "share", "roofline", "realised", "load")


def _median(values: Sequence[float]) -> float:
    return float(pd.Series(values, dtype=float).median()) if values else math.nan


def decode_columns(info: dict[str, Any], wall_s: float, time_ratio: float) -> dict[str, float]:
    """A decode entry's tokens/s, speed-up and roofline columns (see the module doc)."""
    counted = info.get("counted_fn_s") or []
    decode_tokens = info.get("decode_tokens", info.get("tokens", math.nan))
    speedup = 1 / time_ratio if info.get("variant") != "dense" else math.nan
    roofline = float(info.get("roofline_speedup", math.nan))
    return dict(
        tok_s=decode_tokens / _median(counted) if counted else info.get("tokens", math.nan) / wall_s,
        dense_tok_s=decode_tokens / _median(info.get("paired_reference_s") or []),
        e2e_tok_s=info.get("tokens", math.nan) / wall_s,
        speedup=speedup, share=float(info.get("realised_share", math.nan)), roofline=roofline,
        realised=speedup / roofline, load=float(info.get("loadavg") or math.nan),
    )


def mfu_verdict(value: float) -> str:
    return f"{'met' if value >= MFU_BAR else 'MISSED'} ({value:.1%} ≥ {MFU_BAR:.0%}?)"


def bar_verdict(kind: str, capacity: float, seq_len: int, pattern: str | None, time_ratio: float,
                flop_ratio: float, batch: int | None = None, realised: float = math.nan,
                variant: str | None = None) -> str:
    """'' where no bar applies, else 'met …' / 'MISSED …' with the numbers."""
    if kind == "block" and seq_len >= BLOCK_BAR_MIN_T and capacity in BLOCK_BAR:
        limit = BLOCK_BAR[capacity]
        x = time_ratio / flop_ratio
        return f"{'met' if x <= limit else 'MISSED'} ({x:.2f}× ≤ {limit}×?)"
    if kind == "model" and (pattern, capacity) in MODEL_BAR:
        need = MODEL_BAR[(pattern, capacity)]
        eff = flop_ratio / time_ratio
        return f"{'met' if eff >= need else 'MISSED'} ({eff:.0%} ≥ {need:.0%}?)"
    if kind == "decode":
        return decode_verdict(variant, capacity, pattern, batch, 1 / time_ratio, realised)
    return ""


def decode_verdict(variant: str | None, capacity: float, pattern: str | None, batch: int | None, speedup: float,
                   realised: float) -> str:
    """The decode bars at this entry's point, joined: the speed-up bar, the realised-share bar."""
    parts = []
    if (variant, pattern, capacity, batch) in DECODE_BAR:
        need = DECODE_BAR[(variant, pattern, capacity, batch)]
        parts.append(f"{'met' if speedup >= need else 'MISSED'} ({speedup:.2f}× ≥ {need}× dense tokens/s?)")
    if batch in DECODE_REALISED_BAR and not math.isnan(realised):
        need = DECODE_REALISED_BAR[batch]
        parts.append(f"{'met' if realised >= need else 'MISSED'} ({realised:.0%} ≥ {need:.0%} of the roofline speed-up?)")
    if any(p.startswith("MISSED") for p in parts):  # the row's verdict leads with a miss
        parts.sort(key=lambda p: not p.startswith("MISSED"))
    return "; ".join(parts)


def table(data: dict[str, Any], stat: str = "min") -> pd.DataFrame:
    """One row per benchmark of ``tests/bench`` (dense rows included, ratio 1)."""
    if stat not in STATS:
        raise ValueError(f"stat must be one of {STATS}, got {stat!r}")
    entries = [b for b in data["benchmarks"] if b.get("extra_info", {}).get("kind") in KINDS]
    dense: dict[tuple, dict] = {}  # the best of the dense entries (tests/bench times two per T)
    for b in entries:
        if b["extra_info"].get("variant") == "dense":
            k = _key(b["extra_info"])
            if k not in dense or b["stats"][stat] < dense[k]["stats"][stat]:
                dense[k] = b
    rows = []
    for b in entries:
        info = b["extra_info"]
        t = b["stats"][stat]
        ref = dense.get(_key(info))
        t_dense = ref["stats"][stat] if ref else math.nan
        raw_ratio = t / t_dense if ref else math.nan
        paired = info.get("paired_median_ratio" if info["kind"] == "decode" else "paired_time_ratio")
        time_ratio = float(paired) if paired is not None else raw_ratio
        flop_ratio = float(info.get("flop_ratio", math.nan))
        efficiency = flop_ratio / time_ratio
        gain = ((1 / time_ratio - 1) / (1 / flop_ratio - 1)) if flop_ratio < 1 else math.nan
        decode = decode_columns(info, t, time_ratio) if info["kind"] == "decode" else {}
        mfu_value = (mfu(float(info["analytic_flops"]), t, float(info["peak_flops"]))
                     if info["kind"] == "mfu" and info.get("peak_flops") and info.get("analytic_flops") else math.nan)
        if info["kind"] == "mfu":
            verdict = "" if math.isnan(mfu_value) else mfu_verdict(mfu_value)
        elif not math.isnan(time_ratio) and info.get("variant") != "dense":
            verdict = bar_verdict(info["kind"], float(info["capacity"]), int(info["seq_len"]), info.get("pattern"),
                                  time_ratio, flop_ratio, batch=info.get("batch"),
                                  realised=decode.get("realised", math.nan), variant=info.get("variant"))
        else:
            verdict = ""
        # A paired ratio comes from this entry's own rounds; a raw one from two entries.
        sources = (b,) if paired is not None else (b, ref)
        others = [x.get("extra_info", {}).get("foreign_cpu") for x in sources if x]
        others = [o for o in others if o is not None]
        variant = _label(info)
        rows.append(dict(
            kind=info["kind"], variant=variant, C=float(info.get("capacity", math.nan)),
            T=int(info["seq_len"]), B=info.get("batch"), device=info.get("device"),
            time_ms=1e3 * t, dense_ms=1e3 * t_dense, time_ratio=time_ratio, raw_ratio=raw_ratio,
            pairs=info.get("paired_rounds"), flop_ratio=flop_ratio,
            efficiency=efficiency, gain=gain, bar=verdict, rounds=b["stats"].get("rounds"),
            others_cpu=max(others) if others else math.nan, name=b.get("name"), mfu=mfu_value,
            **{c: decode.get(c, math.nan) for c in DECODE_COLUMNS},
        ))
    df = pd.DataFrame(rows)
    if df.empty:
        return df
    df["_dense_first"] = ~df["variant"].str.startswith("dense")
    df = df.sort_values(["device", "kind", "T", "B", "_dense_first", "variant", "C"], kind="stable")
    df = df.drop(columns="_dense_first")
    return df.reset_index(drop=True)


def with_baseline(df: pd.DataFrame, base: pd.DataFrame) -> pd.DataFrame:
    """Adds ``vs_baseline``: relative change of the time ratio (positive = slower)."""
    keys = ["kind", "variant", "C", "T", "B", "device"]
    merged = df.merge(base[keys + ["time_ratio"]].rename(columns={"time_ratio": "_base"}), on=keys, how="left")
    merged["vs_baseline"] = merged["time_ratio"] / merged["_base"] - 1
    return merged.drop(columns="_base")


def formatted(df: pd.DataFrame) -> pd.DataFrame:
    out = pd.DataFrame()
    cols = COLUMNS + [c for c in OPTIONAL if c in df and df[c].notna().any()]
    cols += ["vs_baseline"] if "vs_baseline" in df else []
    for c in cols:
        s = df[c]
        if c in ("time_ms", "dense_ms"):
            out[c] = s.map(lambda v: "" if pd.isna(v) else f"{v:.1f}")
        elif c in ("time_ratio", "raw_ratio", "flop_ratio", "efficiency", "gain"):
            out[c] = s.map(lambda v: "" if pd.isna(v) else f"{v:.3f}")
        elif c == "pairs":
            out[c] = s.map(lambda v: "" if v is None or pd.isna(v) else str(int(v)))
        elif c == "others_cpu":
            out[c] = s.map(lambda v: "" if pd.isna(v) else f"{v:.0%}")
        elif c in ("tok_s", "dense_tok_s", "e2e_tok_s"):
            out[c] = s.map(lambda v: "" if pd.isna(v) else f"{v:,.0f}")
        elif c in ("speedup", "roofline"):
            out[c] = s.map(lambda v: "" if pd.isna(v) else f"{v:.2f}×")
        elif c in ("share", "realised"):
            out[c] = s.map(lambda v: "" if pd.isna(v) else f"{v:.1%}" if c == "share" else f"{v:.0%}")
        elif c == "load":
            out[c] = s.map(lambda v: "" if pd.isna(v) else f"{v:.2f}")
        elif c == "mfu":
            out[c] = s.map(lambda v: "" if pd.isna(v) else f"{v:.1%}")
        elif c == "vs_baseline":
            out[c] = s.map(lambda v: "" if pd.isna(v) else f"{v:+.1%}")
        elif c == "C":
            out[c] = s.map(lambda v: f"{v:g}")
        else:
            out[c] = s.astype(str)
    return out


def _measured(r: pd.Series) -> str:
    """What a bar line reports, by kind."""
    if r["kind"] == "mfu":
        return f"MFU {r['mfu']:.1%}"
    if r["kind"] == "decode":
        roofline = "" if pd.isna(r["roofline"]) else f", roofline {r['roofline']:.2f}× (realised {r['realised']:.0%})"
        load = "" if pd.isna(r["load"]) else f", load average {r['load']:.1f}"
        return (f"{r['tok_s']:,.0f} decode tokens/s, {1 / r['time_ratio']:.2f}× the dense tokens/s, "
                f"FLOP ratio {r['flop_ratio']:.3f}{roofline}{load}")
    return (f"time ratio {r['time_ratio']:.3f}, FLOP ratio {r['flop_ratio']:.3f}, "
            f"efficiency {r['efficiency']:.2f}, gain {r['gain']:.2f}")


def bar_summary(df: pd.DataFrame) -> list[str]:
    lines = []
    for _, r in df[df["bar"] != ""].iterrows():
        lines.append(
            f"{r['kind']} {r['variant']} C={r['C']:g} T={r['T']} B={r['B']} {r['device']}: "
            f"{_measured(r)} -> {r['bar']}"
            + ("" if pd.isna(r["others_cpu"]) else f"; other processes used {r['others_cpu']:.0%} of the CPU")
        )
    return lines


def header(data: dict[str, Any], path: str, stat: str) -> str:
    m = data.get("machine_info", {})
    cpu = m.get("cpu", {}) or {}
    bench = next((b for b in data["benchmarks"] if b.get("extra_info", {}).get("kind")), {})
    info = bench.get("extra_info", {})
    gpu = next((b["extra_info"]["gpu"] for b in data["benchmarks"] if b.get("extra_info", {}).get("gpu")), None)
    text = (
        f"{path}: {data.get('datetime', '?')}, {cpu.get('brand_raw', m.get('processor', '?'))}"
        f"{f', {gpu}' if gpu else ''}, "
        f"python {m.get('python_version', '?')}, torch {info.get('torch', '?')}, "
        f"threads {info.get('threads', '?')}; statistic: {stat} over rounds"
    )
    measured = conditions(data)
    return f"{text}; {measured}" if measured else text


def _span(values: list[float], fmt: str) -> str:
    lo, hi = min(values), max(values)
    return format(lo, fmt) if format(lo, fmt) == format(hi, fmt) else f"{format(lo, fmt)}–{format(hi, fmt)}"


def conditions(data: dict[str, Any]) -> str:
    """The conditions the entries ran under, read off their ``extra_info`` (nothing typed by hand):
    logical CPUs, the thread counts set, the load average and other processes' CPU share after and
    during the rounds, paired rounds per entry, the decode shape and the roofline's measured machine."""
    infos = [b.get("extra_info", {}) for b in data.get("benchmarks", []) if b.get("extra_info", {}).get("kind")]
    if not infos:
        return ""
    parts = []
    cpus = (data.get("machine_info", {}).get("cpu", {}) or {}).get("count")
    if cpus:
        parts.append(f"{cpus} logical CPUs")
    threads = sorted({i["threads"] for i in infos if i.get("threads")})
    if threads:
        parts.append(f"torch threads {'/'.join(map(str, threads))}")
    loads = [i["loadavg"] for i in infos if isinstance(i.get("loadavg"), (int, float))]
    if loads:
        parts.append(f"load average {_span(loads, '.1f')} after the entries' rounds")
    foreign = [i["foreign_cpu"] for i in infos if isinstance(i.get("foreign_cpu"), (int, float))]
    if foreign:
        parts.append(f"other processes used {_span(foreign, '.0%')} of the CPU during them")
    rounds = [i["paired_rounds"] for i in infos if isinstance(i.get("paired_rounds"), int)]
    if rounds:
        parts.append(f"{_span(rounds, 'd')} paired rounds per routed entry")
    decode = [i for i in infos if i.get("kind") == "decode"]
    if decode:
        shapes = sorted({(i.get("d_model"), i.get("depth"), i.get("prompt"), i.get("new_tokens"), i.get("dtype"))
                         for i in decode}, key=str)
        parts.append("decode " + ", ".join(f"d={d}, depth {L}, prompt {P} + {N} new tokens, {dt}"
                                           for d, L, P, N, dt in shapes))
        machine = next((i for i in decode if i.get("peak_flops") and i.get("bandwidth")), None)
        if machine:
            parts.append(f"roofline machine measured: peak {machine['peak_flops'] / 1e9:.1f} GFLOP/s, "
                         f"bandwidth {machine['bandwidth'] / 1e9:.1f} GB/s")
    return "run conditions: " + "; ".join(parts)


def print_rich(df: pd.DataFrame, title: str) -> None:
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:  # pragma: no cover - rich is a dependency
        print(title)
        print(formatted(df).to_string(index=False))
        return
    t = Table(title=title, title_justify="left")
    shown = formatted(df)
    for c in shown.columns:
        t.add_column(c, justify="left" if c in ("kind", "variant", "device", "bar") else "right")
    for _, row in shown.iterrows():
        style = "red" if row["bar"].startswith("MISSED") else ("green" if row["bar"].startswith("met") else None)
        t.add_row(*row.tolist(), style=style)
    Console(width=200).print(t)


def _kind_notes(df: pd.DataFrame) -> list[str]:
    """The markdown's explanation of the decode and mfu rows, where there are any."""
    notes = []
    if (df["kind"] == "decode").any():
        notes.append("decode rows (KV-cached generation): a round counts the decode steps alone (prefill excluded); "
                     "time ratio = the median over `pairs` rounds of t_routed / t_dense (adjacent calls, the same "
                     "tokens), speedup = 1 / time ratio; tok_s = decode tokens B·(N − 1) / the median counted time, "
                     "dense_tok_s the same for those rounds' dense calls, e2e_tok_s = all new tokens / the whole "
                     "call (prefill included); FLOP ratio = analytic forward FLOPs per token at the realised "
                     "processed share; roofline = attainable speed-up at that batch: per decode step and layer, "
                     "time = max(FLOPs / peak, bytes / bandwidth), a routed layer processing b ~ Binomial(B, share) "
                     "tokens and reading its weights only when b > 0 (expected fraction 1 − (1 − share)^B of steps), "
                     "peak and bandwidth measured on this machine (fp32 1024³ matmul, 256 MiB copy); realised = "
                     "speedup / roofline; load = 1-minute load average after the entry's rounds "
                     "(modbench.bench.decode_roofline).\n")
    if (df["kind"] == "mfu").any():
        notes.append("mfu rows (dense training step): mfu = analytic causal forward + backward FLOPs per step / "
                     "step time / the GPU's dense bf16 peak.\n")
    return notes


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m modbench.bench.table", description=__doc__.split("\n\n")[0])
    p.add_argument("json", nargs="+", help="pytest-benchmark JSON (pytest tests/bench --benchmark-json=...); "
                   "several are read as one")
    p.add_argument("--markdown", help="also write the table as markdown to this file")
    p.add_argument("--stat", default="min", choices=STATS, help="benchmark statistic (default: min)")
    p.add_argument("--baseline", help="an older JSON: show the change of each time ratio")
    p.add_argument("--fail-on-bar", action="store_true", help="exit 1 when a bar is missed")
    p.add_argument("--write-json", help="also write the (merged) input as one pytest-benchmark JSON to this file")
    a = p.parse_args(argv)

    data = merge([load(path) for path in a.json])
    source = ", ".join(a.json)
    if a.write_json:
        Path(a.write_json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.write_json).write_text(json.dumps(data, indent=2))
    df = table(data, a.stat)
    if df.empty:
        print(f"{source}: no tests/bench entries (extra_info.kind {'/'.join(KINDS)})", file=sys.stderr)
        return 1
    if a.baseline:
        df = with_baseline(df, table(load(a.baseline), a.stat))
    title = header(data, source, a.stat)
    print_rich(df, title)
    bars = bar_summary(df)
    print("\nBar (reported, not asserted):")
    for line in bars or ["(no entry at a bar point)"]:
        print("  " + line)
    if a.markdown:
        md = [
            "# tests/bench: time ratio vs FLOP ratio\n",
            title + "\n",
            "time ratio = min t_routed / min t_dense over `pairs` rounds that each time a dense "
            "call and then a routed call (adjacent, so machine-speed drift cancels); raw_ratio = the routed entry's statistic / the dense entry's (separate "
            "runs, minutes apart); FLOP ratio = analytic causal forward + backward FLOPs routed / "
            "dense; efficiency = FLOP ratio / time ratio (= achieved ÷ theoretical speed-up); "
            "gain = (1/time ratio − 1) / (1/FLOP ratio − 1); others_cpu = share of the machine's "
            "CPU used by other processes while timing.\n",
            *_kind_notes(df),
            formatted(df).to_markdown(index=False),
            "\n## Bar (reported, not asserted)\n",
            *(f"- {line}" for line in bars or ["(no entry at a bar point)"]),
            "",
        ]
        Path(a.markdown).parent.mkdir(parents=True, exist_ok=True)
        Path(a.markdown).write_text("\n".join(md))
        print(f"\nwrote {a.markdown}")
    if a.fail_on_bar and df["bar"].str.startswith("MISSED").any():
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
