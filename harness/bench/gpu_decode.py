"""KV-cached decode speed on a GPU, old decoder against the static step (issue 38, item 4): one command.

    python -m modbench.bench.gpu_decode --out reports/bench            # on a CUDA machine (make gpu-decode-bench)
    python -m modbench.bench.gpu_decode --dry-run --out /tmp/decode    # on a CPU: a tiny model, seconds

In one process, for the dense GPT and each routed variant (default ``sigmoid`` with the pattern
``fixed:1,1`` at C = 0.125, its routers' cuts moved so that each routed layer processes C of the
tokens, ``modbench.bench.decode_calibration``), at batch 1, 8 and 64: a prompt of 64 tokens is
prefilled and 128 new tokens sampled (127 one-token decode steps), d = 1024, depth 12, head 64, bf16
weights (the KV cache takes the weights' dtype), temperature 1. What a cell counts is decode
tokens/s, the decode steps alone (``Generation.decode_tokens_per_s``: prefill excluded, and a CUDA
graph's capture or a compile too: ``StaticDecoder.prepare``), median of ``--rounds`` generations after
one warm-up generation, with each decoder of ``modbench.model.decode.generate``:

- ``dynamic``: the old decoder (``modbench.model.decode.Decoder``): the block on the sequences that
  process the token, one host read per routed layer and step;
- ``static``: the static, sync-free step (``modbench.model.static_decode``), eager;
- ``graph``: that step captured once in a CUDA graph and replayed (what ``generate`` runs on CUDA);
- ``compile``: that step under ``torch.compile(fullgraph=True, mode="reduce-overhead")``;
- ``static-cond``, ``graph-cond``, ``compile-cond``: the same with each routed layer branching on
  "does any sequence process the token", so a layer no sequence routes to reads none of its weights
  (MoD's decode saving, ``modbench.model.static_decode``): "graph-cond" captures the eager step with
  each branch a CUDA graph conditional node (decided on the device); "compile-cond" compiles the
  step's parts with Inductor and captures them the same way on CUDA (on a CPU it branches on the
  host); "static-cond" branches on the host (a sync per routed layer on CUDA). For dense they equal
  their plain step. On a torch without CUDA graph conditional nodes (torch 2.11, the lent GPU's:
  ``cuda_graphs.branch_capture_missing``) the "graph-cond" and "compile-cond" cells say so as "n/a"
  at once, before any capture or compile;
- ``graph-split``, ``compile-split``: those branches without conditional nodes, so on any torch: the
  step (eager or compiled parts) captured as CUDA graphs split at each routed layer's branch, the host
  reading the branch's predicate between them and replaying the graph of the side it takes (a sync per
  routed layer and step, against whole layers' weight reads skipped);
- ``reference-graph``, ``reference-compile`` (dense only): issue 38's yardstick, a plain static-cache
  decoder of the same dense model (``modbench.bench.reference_decoder``), its step captured in a CUDA
  graph or compiled with "reduce-overhead": the dense bar is modbench's fastest dense step ≥ 0.7× the
  compiled one, measured here beside it.

The table ends with issue 38's bars: the fastest dense step at each batch (its bar is the issue's H100
figure), and each routed step's speed-up over it as a share of the roofline's (``decode_roofline``:
per layer max(FLOPs / peak, bytes / bandwidth), a routed layer reading its weights only when some
sequence processes the token, at the realised per-layer shares), peak and bandwidth measured on the
device in the weights' dtype (``measure_machine``).

One decoder per (variant, batch, step) serves its warm-up and timed generations (``reset``), so a
capture or a compile happens once. A cell that fails (a compile error, out of memory) records its
error in one line and the run goes on; the table and the JSON are rewritten after every cell, so a
run cut short keeps what it measured; the cells run step by step in ``--steps`` order, so the
compiles (each an Inductor compile of the whole 12-layer step, not yet timed on a GPU: expect tens of
seconds each) come after every other cell. On a lent GPU with little time: ``--steps dynamic,static,graph``
first. Written: ``<out>/<name>.md`` and ``<out>/<name>.json``, with
the device name, torch and Python versions and the shapes.

``--cpu``: the CPU decode table's shape (make cpu-decode-bench: d 512, depth 8, prompt 32 + 32, fp32)
on this machine, one thread, Inductor compiling the "compile" steps: what ``cond`` buys where a host
read is free (make cpu-decode-static → reports/bench/decode-static-cpu.md).

``--dry-run``: the same code path on the CPU with a tiny model (d 64, depth 4, prompt 8 + 8, batch 1
and 2, fp32), the "graph" and "graph-cond" steps recorded as not available (they need CUDA), the "-split"
steps' pieces run eagerly instead of captured (``cuda_graphs.eager_piece``) and the "compile" steps traced
by Dynamo's "eager" backend (fullgraph, no Inductor C++ compile), one thread: tests/bench/test_gpu_decode.py
runs it, so the command cannot rot between GPU sessions. Needs only torch (no MLflow, Optuna or network).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from modbench.bench import decode_roofline
from modbench.bench.decode_calibration import move_cuts_to_capacity
from modbench.bench.reference_decoder import ReferenceDecoder
from modbench.config.model import ModelConfig, RoutingConfig
from modbench.model.decode import CUDA_ONLY_STEPS, STEPS, generate
from modbench.model.gpt import GPT
from modbench.model.cuda_graphs import branch_capture_missing, eager_piece
from modbench.model.static_decode import BRANCH_CAPTURE_STEPS, StaticDecoder
from modbench.track.provenance import git_sha

CAPACITY = 0.125
PATTERN = "fixed:1,1"
DENSE_BAR_H100 = {1: 1_400, 8: 11_000, 64: 58_000}  # issue 38: dense decode tokens/s on an H100
REALISED_BAR = 0.60  # issue 38: a routed step's speed-up ≥ 60 % of its roofline speed-up over that dense
# the default order: the compiles (slowest to set up) last
# issue 38's yardstick, dense only: a plain static-cache decoder (``modbench.bench.reference_decoder``)
REFERENCE_STEPS = ("reference-graph", "reference-compile")
DEFAULT_STEPS = ("dynamic", "static", "static-cond", "graph", "graph-cond", "graph-split", "reference-graph", "compile",
                 "compile-cond", "compile-split", "reference-compile")
DENSE_BAR_REFERENCE = 0.7  # issue 38: modbench's dense decode ≥ 0.7× the compiled reference


@dataclass(frozen=True)
class Size:
    """The model and the generation of one run."""

    d_model: int
    depth: int
    head_dim: int
    prompt: int
    new_tokens: int
    batches: tuple[int, ...]
    dtype: str  # of the weights (and so of the KV cache)


GPU = Size(1024, 12, 64, 64, 128, (1, 8, 64), "bfloat16")
DRY = Size(64, 4, 16, 8, 8, (1, 2), "float32")
CPU = Size(512, 8, 64, 32, 32, (1, 8, 64), "float32")  # the shape of make cpu-decode-bench's table


@dataclass
class Cell:
    variant: str
    batch: int
    step: str
    decode_tokens_per_s: float | None = None
    rounds: list[float] = field(default_factory=list)  # decode tokens/s of each timed generation
    setup_s: float | None = None  # capture / compile (first generation's ``setup_seconds``)
    processed_share: float | None = None  # routed layers' realised share in the last generation
    layer_shares: list[float] | None = None  # per routed layer, in the last generation
    roofline: float | None = None  # attainable speed-up over dense at this batch (``decode_roofline``)
    error: str | None = None


def _model(size: Size, variant: str, device: torch.device, seed: int = 0) -> GPT:
    """The GPT to decode, routers moved to C on random sequences of the full context."""
    cfg = ModelConfig(depth=size.depth, n_embd=size.d_model, head_dim=size.head_dim,
                      max_seq_len=size.prompt + size.new_tokens)
    routing = RoutingConfig("dense", capacity=1.0) if variant == "dense" else \
        RoutingConfig(variant, capacity=CAPACITY, pattern=PATTERN)
    torch.manual_seed(seed)
    with torch.device(device):
        model = GPT(cfg, routing)
    model = model.to(getattr(torch, size.dtype)).eval()
    if model.routers:
        g = torch.Generator().manual_seed(2)
        idx = torch.randint(0, cfg.vocab_size, (8, cfg.max_seq_len), generator=g).to(device)
        move_cuts_to_capacity(model, idx, CAPACITY)
    return model


def _decoder(model: GPT, size: Size, batch: int, step: str, dry_run: bool) -> StaticDecoder | ReferenceDecoder | None:
    """One decoder for a cell's generations (None: the dynamic decoder, built per generation)."""
    if step in REFERENCE_STEPS:
        runner = step.removeprefix("reference-")
        return ReferenceDecoder(model, batch, size.prompt + size.new_tokens - 1, runner=runner,
                                compile_backend="eager" if dry_run and runner == "compile" else None)
    spec = STEPS[step]
    if spec is None:
        return None
    return StaticDecoder(model, batch, size.prompt + size.new_tokens - 1, **asdict(spec),
                         compile_backend="eager" if dry_run and spec.runner == "compile" else None,
                         capture_piece=eager_piece if dry_run and spec.split else None)


def roofline(model: GPT, size: Size, cell: Cell, machine: decode_roofline.Machine) -> float | None:
    """The routed model's attainable decode speed-up over dense at the cell's batch and realised
    per-layer shares (``modbench.bench.decode_roofline``, over the mean context of the decode steps)."""
    if cell.layer_shares is None:
        return None
    dense, routed = decode_roofline.dense_and_routed_costs(model, size.prompt + size.new_tokens / 2, cell.layer_shares,
                                                           bytes_per_value=getattr(torch, size.dtype).itemsize)
    return decode_roofline.speedup_limit(dense, routed, cell.batch, machine)


def measure(model: GPT, size: Size, cell: Cell, rounds: int, dry_run: bool) -> None:
    """Fill ``cell``: one warm-up generation, then ``rounds`` timed ones (their median)."""
    device = model.head.weight.device
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, model.cfg.vocab_size, (cell.batch, size.prompt), generator=g).to(device)
    decoder = _decoder(model, size, cell.batch, cell.step, dry_run)
    for i in range(rounds + 1):
        kw = {"decoder": decoder} if decoder is not None else {"step": "dynamic"}
        if isinstance(decoder, ReferenceDecoder):
            kw["mode"] = "dense"
        gen = generate(model, prompt, size.new_tokens, temperature=1.0, seed=3 + i, **kw)
        assert gen.step == cell.step and torch.isfinite(gen.tokens.float()).all()
        if i == 0:
            cell.setup_s = gen.setup_seconds
        else:
            cell.rounds.append(gen.decode_tokens_per_s)
        cell.processed_share = None if not model.routers else 1.0 - gen.skipped_fraction
        cell.layer_shares = list(gen.processed_shares) if model.routers else None
    cell.decode_tokens_per_s = statistics.median(cell.rounds)


def environment(device: torch.device | str) -> dict[str, str]:
    """What the numbers were measured on (this command's and ``gpu_bars``')."""
    device = torch.device(device)
    cpu = f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"
    return {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else cpu,
        "torch": torch.__version__,
        "cuda": str(torch.version.cuda),
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "commit": git_sha(),  # "-dirty": not from a committed tree, so not a table to commit
    }


def fmt(x: float | None, digits: int = 0) -> str:
    """A table cell: thousands separated, \"—\" for nothing."""
    return "—" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:,.{digits}f}"


def markdown(env: dict, size: Size, variants: list[str], steps: list[str], cells: list[Cell],
             machine: decode_roofline.Machine, dry_run: bool = False) -> str:
    """Decode tokens/s per (batch, step), one column per variant, routed ÷ dense, the static steps'
    speed-up over the old decoder, and the bars of issue 38."""
    at = {(c.variant, c.batch, c.step): c for c in cells}
    routed = [v for v in variants if v != "dense"]
    lines = [
        f"# KV-cached decode tokens/s: old decoder vs static step ({env['device']})",
        "",
        f"torch {env['torch']} (CUDA {env['cuda']}), Python {env['python']}, {env['date']}, commit {env['commit']}. d {size.d_model}, depth "
        f"{size.depth}, head {size.head_dim}, {size.dtype} weights; prompt {size.prompt} + {size.new_tokens - 1} decode "
        f"steps; decode tokens/s (prefill, capture and compile excluded), median of the timed generations. Routed: "
        f"pattern {PATTERN}, C = {CAPACITY} (realised share in brackets). `python -m modbench.bench.gpu_decode`." +
        (" Dry run: the -split steps' pieces run eagerly, not as CUDA graphs." if dry_run else ""),
        "",
        "| batch | step | " + " | ".join(f"{v} tok/s" for v in variants) + "".join(f" | {v} ÷ dense" for v in routed) + " |",
        "|---|---|" + "---|" * (len(variants) + len(routed)),
    ]
    for batch in size.batches:
        for step in steps:
            row = [str(batch), step]
            for v in variants:
                c = at.get((v, batch, step))
                if c is None:
                    row.append("—")
                elif c.error:
                    row.append(f"error: {c.error[:60]}")
                else:
                    share = "" if c.processed_share is None else f" ({c.processed_share:.3f})"
                    row.append(fmt(c.decode_tokens_per_s) + share)
            dense = at.get(("dense", batch, step))
            for v in routed:
                c = at.get((v, batch, step))
                ok = c and dense and c.decode_tokens_per_s and dense.decode_tokens_per_s
                row.append(f"{c.decode_tokens_per_s / dense.decode_tokens_per_s:.2f}×" if ok else "—")
            lines.append("| " + " | ".join(row) + " |")
    lines += ["", "Speed-up of each static step over the old decoder (same variant and batch):", "",
              "| variant | batch | " + " | ".join(s for s in steps if s != "dynamic") + " |",
              "|---|---|" + "---|" * sum(s != "dynamic" for s in steps)]
    for v in variants:
        for batch in size.batches:
            old = at.get((v, batch, "dynamic"))
            row = [v, str(batch)]
            for step in (s for s in steps if s != "dynamic"):
                c = at.get((v, batch, step))
                ok = c and old and c.decode_tokens_per_s and old.decode_tokens_per_s
                row.append(f"{c.decode_tokens_per_s / old.decode_tokens_per_s:.2f}×" if ok else "—")
            lines.append("| " + " | ".join(row) + " |")
    setups = [c for c in cells if c.setup_s and c.step not in ("dynamic", "static", "static-cond")]
    if setups:
        lines += ["", "Set-up (capture or compile, once per variant, batch and step): " +
                  ", ".join(f"{c.variant} B{c.batch} {c.step} {c.setup_s:.1f} s" for c in setups) + "."]
    return "\n".join(lines + bars(env, size, cells, machine)) + "\n"


def bars(env: dict, size: Size, cells: list[Cell], machine: decode_roofline.Machine) -> list[str]:
    """Issue 38's decode bars against this run: the fastest dense step at each batch (its bar is an
    H100 figure), and each routed step's speed-up over that dense, as a share of the roofline's."""
    timed = [c for c in cells if c.decode_tokens_per_s]
    lines = ["", f"Bars of issue 38. Roofline machine measured here: peak {machine.peak_flops / 1e12:.1f} TFLOP/s, "
             f"bandwidth {machine.bandwidth / 1e9:,.0f} GB/s ({size.dtype}); the dense bar: modbench's fastest dense step "
             f"≥ {DENSE_BAR_REFERENCE}× the compiled reference decoder (and the issue's H100 figures); a routed step's bar: its speed-up over the fastest dense step at "
             f"that batch ≥ {REALISED_BAR:.0%} of the roofline's.", "",
             "| batch | variant | step | tok/s | fastest dense (step) | speed-up | roofline | realised | bar |",
             "|---|---|---|---|---|---|---|---|---|"]
    for batch in size.batches:
        dense = max((c for c in timed if c.variant == "dense" and c.batch == batch and c.step not in REFERENCE_STEPS),
                    key=lambda c: c.decode_tokens_per_s, default=None)
        if dense is None:
            continue
        reference = next((c for c in timed if c.step == "reference-compile" and c.batch == batch), None)
        bar = DENSE_BAR_H100.get(batch)
        verdicts = []
        if reference is not None:
            share = dense.decode_tokens_per_s / reference.decode_tokens_per_s
            verdicts.append(f"{share:.2f}× the compiled reference ({fmt(reference.decode_tokens_per_s)}): "
                            f"{'met' if share >= DENSE_BAR_REFERENCE else 'MISSED'} (≥ {DENSE_BAR_REFERENCE}×)")
        if bar is not None and "H100" in env["device"]:
            verdicts.append(f"{'met' if dense.decode_tokens_per_s >= bar else 'MISSED'} (≥ {bar:,} on an H100)")
        elif bar is not None:
            verdicts.append(f"(H100: ≥ {bar:,}; not an H100)")
        verdict = "; ".join(verdicts) or "—"
        lines.append(f"| {batch} | dense | {dense.step} | {fmt(dense.decode_tokens_per_s)} | | | | | {verdict} |")
        for c in (c for c in timed if c.variant != "dense" and c.batch == batch):
            speedup = c.decode_tokens_per_s / dense.decode_tokens_per_s
            realised = speedup / c.roofline if c.roofline else None
            ok = "—" if realised is None else f"{'met' if realised >= REALISED_BAR else 'MISSED'}"
            lines.append(f"| {batch} | {c.variant} | {c.step} | {fmt(c.decode_tokens_per_s)} | "
                         f"{fmt(dense.decode_tokens_per_s)} ({dense.step}) | {speedup:.2f}× | {fmt(c.roofline, 2)}× | "
                         f"{'—' if realised is None else f'{realised:.0%}'} | {ok} |")
    return lines


def write(out: Path, name: str, env: dict, size: Size, variants: list[str], steps: list[str], cells: list[Cell],
          dry_run: bool, machine: decode_roofline.Machine) -> None:
    out.mkdir(parents=True, exist_ok=True)
    record = {"environment": env, "size": asdict(size), "capacity": CAPACITY, "pattern": PATTERN, "dry_run": dry_run,
              "machine": asdict(machine), "variants": variants, "steps": steps, "cells": [asdict(c) for c in cells]}
    (out / f"{name}.json").write_text(json.dumps(record, indent=2) + "\n")
    (out / f"{name}.md").write_text(markdown(env, size, variants, steps, cells, machine, dry_run))


def run(out: Path, name: str, *, variants: list[str], steps: list[str], batches: tuple[int, ...] | None = None,
        rounds: int = 3, dry_run: bool = False, cpu: bool = False, log=print) -> list[Cell]:
    """Every (variant, batch, step) cell, written after each one (module doc)."""
    device = torch.device("cpu" if dry_run or cpu else "cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("gpu_decode: no CUDA device (use --dry-run for the CPU check, --cpu for the CPU table's shape)")
    size = DRY if dry_run else CPU if cpu else GPU
    if batches:
        size = Size(**{**asdict(size), "batches": tuple(batches)})
    threads = torch.get_num_threads()
    if device.type == "cpu":  # (a shared CPU: a 2-thread region waits for its descheduled thread at every op)
        torch.set_num_threads(1)
    try:
        return _cells(out, name, size, device, variants, steps, rounds, dry_run, log)
    finally:
        torch.set_num_threads(threads)


def _cells(out: Path, name: str, size: Size, device: torch.device, variants: list[str], steps: list[str], rounds: int,
           dry_run: bool, log) -> list[Cell]:
    env = environment(device)
    machine = measure_machine(size, device, dry_run)
    models = {variant: _model(size, variant, device) for variant in variants}
    cells: list[Cell] = []
    for step in steps:  # step by step: the compiles (slowest to set up) come last, after every other cell
        for variant in variants:
            for batch in size.batches:
                cell = Cell(variant, batch, step)
                cells.append(cell)
                if step in REFERENCE_STEPS and variant != "dense":
                    cells.pop()  # the yardstick decodes the dense model alone
                    continue
                spec = STEPS.get(step)  # (None: the dynamic decoder or the reference one)
                rehearsed = dry_run and spec is not None and spec.split  # pieces run eagerly (eager_piece)
                if step in (*CUDA_ONLY_STEPS, "reference-graph") and device.type != "cuda" and not rehearsed:
                    cell.error = "n/a: a CUDA graph needs a CUDA device"
                elif step in BRANCH_CAPTURE_STEPS and device.type == "cuda" and (why := branch_capture_missing()):
                    cell.error = f"n/a: {why}"
                else:
                    try:
                        measure(models[variant], size, cell, rounds, dry_run)
                        cell.roofline = roofline(models[variant], size, cell, machine)
                    except Exception as e:  # one failed cell (compile, memory) must not lose the others
                        cell.error = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"[:200]
                    finally:  # each cell compiles its own decoder: Dynamo's recompile limit (8) is per code object
                        torch._dynamo.reset()
                        if device.type == "cuda":
                            torch.cuda.empty_cache()
                log(f"{variant:>10} B{batch:<3} {step:>8}: "
                    f"{cell.error or fmt(cell.decode_tokens_per_s) + ' tok/s'}")
                write(out, name, env, size, variants, steps, cells, dry_run, machine)
    return cells


def measure_machine(size: Size, device: torch.device, dry_run: bool) -> decode_roofline.Machine:
    """The roofline's peak and bandwidth in the weights' dtype: on a GPU a bf16 8192³ matmul and a 1 GiB
    copy; on a CPU the CPU decode table's fp32 1024³ and 256 MiB (the dry run: small and quick)."""
    big = device.type == "cuda"
    return decode_roofline.measure_machine(matmul_size=8192 if big else 256 if dry_run else 1024,
                                           copy_mib=1024 if big else 16 if dry_run else 256,
                                           device=device.type, dtype=getattr(torch, size.dtype))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m modbench.bench.gpu_decode", description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("reports/bench"), help="output folder (default: reports/bench)")
    p.add_argument("--name", default=None, help="file name without suffix (default: decode-static-<gpu> or decode-static-dry)")
    p.add_argument("--variants", default="dense,sigmoid", help="comma-separated, dense first (default: dense,sigmoid)")
    p.add_argument("--steps", default=",".join(DEFAULT_STEPS),
                   help=f"comma-separated decoders, run in this order (default: {','.join(DEFAULT_STEPS)})")
    p.add_argument("--batches", default=None, help="comma-separated batch sizes (default: 1,8,64; dry run 1,2)")
    p.add_argument("--rounds", type=int, default=3, help="timed generations per cell after one warm-up (default: 3)")
    p.add_argument("--dry-run", action="store_true", help="the CPU check: a tiny model, seconds")
    p.add_argument("--cpu", action="store_true",
                   help="on this CPU at the CPU decode table's shape (d 512, depth 8, prompt 32 + 32, fp32, one thread; Inductor compiles)")
    args = p.parse_args(argv)
    if args.dry_run and args.cpu:
        p.error("--dry-run and --cpu: expected one of them")
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    steps = [s.strip() for s in args.steps.split(",") if s.strip()]
    unknown = [s for s in steps if s not in STEPS and s not in REFERENCE_STEPS]
    if unknown or not variants or args.rounds < 1:
        p.error(f"steps must be among {', '.join(STEPS)} and rounds >= 1" if unknown or args.rounds < 1 else "no variant")
    batches = tuple(int(b) for b in args.batches.split(",")) if args.batches else None
    if args.name is None:
        gpu = "dry" if args.dry_run else "cpu" if args.cpu or not torch.cuda.is_available() else \
            torch.cuda.get_device_name().lower().replace("nvidia", "").strip().split()[0]
        args.name = f"decode-static-{gpu}"
    run(args.out, args.name, variants=variants, steps=steps, batches=batches, rounds=args.rounds, dry_run=args.dry_run,
        cpu=args.cpu)
    print(f"gpu_decode: {args.out / (args.name + '.md')} and .json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
