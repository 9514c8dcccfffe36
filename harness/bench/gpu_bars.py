"""The routed block's and the whole model's speed bars on a GPU, eager, compiled and under CUDA graphs.

    python -m modbench.bench.gpu_bars --out reports/bench           # on a CUDA machine (make gpu-bars)
    python -m modbench.bench.gpu_bars --dry-run --out /tmp/bars     # on a CPU: tiny shapes, seconds

Issue "GPU speed" (38) measured the routed block at about 3x its FLOP ratio on an H100 and traced it
to the host: a C = 0.125 block's kernels take 1.5-2 ms and issuing them 4-6 ms (3.8 ms even compiled,
whose Inductor wrapper still launches every kernel from Python). A CUDA graph takes the host out of
the loop. This command times, in one process, each bar in three modes:

- ``eager``: the modules as they are;
- ``compile``: ``torch.compile(fullgraph=True)``, Inductor's default mode (fused kernels, host launches);
- ``cudagraphs``: ``torch.compile(fullgraph=True, mode="reduce-overhead")``: Inductor's kernels
  replayed from CUDA graphs (forward and backward; ``torch.compiler.cudagraph_mark_step_begin``
  before each step).

The bars (issue 38):

- **block**: one ``sigmoid`` routed block at C = 0.125, forward + backward, B 32, T 2048, d 1024 (8
  heads of 128), bf16 autocast, against the ``DenseLayer`` with the same weights
  (``modbench.bench.profile_block``): time ratio = median over paired rounds of t_routed / t_dense;
  bar: time ratio ≤ 1.5 × the analytic FLOP ratio (each layer's ``flops``, causal, forward +
  backward). ``norm`` (the paper's recipe) is timed too.
- **model**: a training step (forward, backward, AdamW) of the GPT of tests/bench/test_model_speed.py
  (depth 4, pattern ``alternate``, C = 0.125, T 2048, B 8, d 1024, bf16 autocast) against the dense
  GPT; bar: efficiency = FLOP ratio / time ratio ≥ 0.90 (90 % of the theoretical speed-up).

Each round calls the dense step and then the routed one, each synchronised, after warm-up calls
(compiles and CUDA-graph recording); the table gives both medians in ms and the median of the
per-round ratios. A cell that fails (a compile error, memory) records its error in one line and the
run goes on; the table and the JSON are rewritten after every cell. What compiling costs once per
shape (``setup_s``: the warm-up calls' time) is what a study trial would pay for ``train.compile``.

``--dry-run``: the same code on the CPU, tiny shapes (d 64, T 64, B 2, depth 2), fp32, "compile"
traced by Dynamo's "eager" backend, "cudagraphs" recorded as not available: tests/bench/test_gpu_bars.py
runs it, so the command cannot rot between GPU sessions. Needs only torch.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from modbench.bench.gpu_decode import environment, fmt
from modbench.bench.profile_block import block_inputs, build_block, fwd_bwd, time_interleaved, train_step
from modbench.config.model import ModelConfig, RoutingConfig
from modbench.model.gpt import GPT

MODES = ("eager", "compile", "cudagraphs")
CAPACITY = 0.125
BLOCK_VARIANTS = ("sigmoid", "norm")
MODEL_VARIANT, MODEL_PATTERN, MODEL_DEPTH = "sigmoid", "alternate", 4
BLOCK_BAR = 1.5  # time ratio ≤ BLOCK_BAR × FLOP ratio
MODEL_BAR = 0.90  # efficiency ≥ MODEL_BAR


@dataclass(frozen=True)
class Shape:
    """The sizes of one run."""

    d_model: int
    head_dim: int
    seq_len: int
    block_batch: int
    model_batch: int
    model_depth: int
    rounds: int
    warmup: int


GPU = Shape(1024, 128, 2048, 32, 8, MODEL_DEPTH, 30, 3)
DRY = Shape(64, 16, 64, 2, 2, 2, 3, 1)


@dataclass
class Cell:
    bar: str  # "block" or "model"
    variant: str
    mode: str
    time_ms: float | None = None  # median routed step
    dense_ms: float | None = None  # median dense step
    time_ratio: float | None = None  # median over rounds of t_routed / t_dense
    flop_ratio: float | None = None
    setup_s: float | None = None  # warm-up calls of both (compiles, CUDA-graph recording)
    ratios: list[float] = field(default_factory=list)
    error: str | None = None

    @property
    def verdict(self) -> str:
        if self.time_ratio is None or self.flop_ratio is None:
            return "—"
        if self.bar == "block":
            x = self.time_ratio / self.flop_ratio
            return f"{x:.2f}× FLOP ratio: {'met' if x <= BLOCK_BAR else 'MISSED'} (≤ {BLOCK_BAR}×)"
        eff = self.flop_ratio / self.time_ratio
        return f"{eff:.0%} of the speed-up: {'met' if eff >= MODEL_BAR else 'MISSED'} (≥ {MODEL_BAR:.0%})"


def compiled(module: torch.nn.Module, mode: str, dry_run: bool) -> Callable:
    """``module`` as ``mode`` runs it (module doc); the dry run traces with Dynamo's "eager" backend."""
    if mode == "eager":
        return module
    if dry_run:
        return torch.compile(module, fullgraph=True, backend="eager")
    return torch.compile(module, fullgraph=True, mode="reduce-overhead" if mode == "cudagraphs" else None)


def _stepped(step: Callable[[], Tensor], mode: str, cuda: bool) -> Callable[[], None]:
    """``step`` as a timed call: a new CUDA-graph step begins first (cudagraphs), the GPU is waited
    for after, and the output is checked finite before the next replay can overwrite it."""

    def call() -> None:
        if mode == "cudagraphs":
            torch.compiler.cudagraph_mark_step_begin()
        out = step()
        if cuda:
            torch.cuda.synchronize()
        if not torch.isfinite(out).all():
            raise FloatingPointError("a non-finite output")

    return call


def block_steps(variant: str, shape: Shape, mode: str, device: str, dry_run: bool):
    """(routed, dense) forward + backward closures of one block, the same weights, and the FLOP ratio."""
    cfg = ModelConfig(depth=4, n_embd=shape.d_model, head_dim=shape.head_dim, max_seq_len=shape.seq_len)
    autocast = torch.bfloat16 if device == "cuda" else None

    def step_and_flops(v: str, capacity: float):
        layer = build_block(v, capacity, cfg).to(device)
        x, grad, cos, sin = block_inputs(cfg, shape.block_batch, shape.seq_len, device)
        return fwd_bwd(compiled(layer, mode, dry_run), x, grad, cos, sin, autocast=autocast), layer.flops(shape.seq_len).total

    routed, routed_flops = step_and_flops(variant, CAPACITY)
    dense, dense_flops = step_and_flops("dense", 1.0)
    return routed, dense, routed_flops / dense_flops


def model_steps(variant: str, shape: Shape, mode: str, device: str, dry_run: bool):
    """(routed, dense) training-step closures of the GPT and the dense GPT, one batch, and the FLOP ratio."""
    cfg = ModelConfig(depth=shape.model_depth, n_embd=shape.d_model, head_dim=shape.head_dim, max_seq_len=shape.seq_len)
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, cfg.vocab_size, (shape.model_batch, shape.seq_len), generator=g).to(device)
    targets = torch.randint(0, cfg.vocab_size, (shape.model_batch, shape.seq_len), generator=g).to(device)
    autocast = torch.bfloat16 if device == "cuda" else None
    steps, flops = [], []
    for routing in (RoutingConfig(variant, capacity=CAPACITY, pattern=MODEL_PATTERN), RoutingConfig("dense", capacity=1.0)):
        torch.manual_seed(0)
        model = GPT(cfg, routing).to(device).train()
        steps.append(train_step(model, idx, targets, forward=compiled(model, mode, dry_run), autocast=autocast))
        flops.append(model.flop_report(shape.seq_len).total)
    return steps[0], steps[1], flops[0] / flops[1]


def measure(cell: Cell, shape: Shape, device: str, dry_run: bool) -> None:
    """Fill ``cell``: warm-up calls (timed as set-up), then ``shape.rounds`` paired rounds."""
    build = block_steps if cell.bar == "block" else model_steps
    routed, dense, cell.flop_ratio = build(cell.variant, shape, cell.mode, device, dry_run)
    cuda = device == "cuda"
    calls = [_stepped(dense, cell.mode, cuda), _stepped(routed, cell.mode, cuda)]
    t0 = time.perf_counter()
    for call in calls:
        for _ in range(shape.warmup):
            call()
    cell.setup_s = time.perf_counter() - t0
    dense_t, routed_t = time_interleaved(calls, rounds=shape.rounds, warmup=0)
    cell.ratios = [r / d for r, d in zip(routed_t, dense_t)]
    cell.time_ratio = statistics.median(cell.ratios)
    cell.time_ms, cell.dense_ms = 1e3 * statistics.median(routed_t), 1e3 * statistics.median(dense_t)


def markdown(env: dict, shape: Shape, cells: list[Cell]) -> str:
    lines = [
        f"# Routed block and model step: eager, compiled, CUDA graphs ({env['device']})",
        "",
        f"torch {env['torch']} (CUDA {env['cuda']}), Python {env['python']}, {env['date']}, commit {env['commit']}. d {shape.d_model} "
        f"(heads of {shape.head_dim}), T {shape.seq_len}, C = {CAPACITY}; block: forward + backward, B "
        f"{shape.block_batch}, against the dense layer with the same weights; model: training step (AdamW) of "
        f"depth {shape.model_depth}, pattern {MODEL_PATTERN}, B {shape.model_batch}, against the dense GPT. Median "
        f"of {shape.rounds} paired rounds (dense, then routed, each synchronised) after {shape.warmup} warm-up "
        f"calls each (set-up: their time, compiles included). `python -m modbench.bench.gpu_bars`.",
        "",
        "| bar | variant | mode | routed ms | dense ms | time ratio | FLOP ratio | bar | set-up s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for c in cells:
        if c.error:
            lines.append(f"| {c.bar} | {c.variant} | {c.mode} | error: {c.error[:80]} | | | | | |")
            continue
        lines.append(f"| {c.bar} | {c.variant} | {c.mode} | {fmt(c.time_ms, 2)} | {fmt(c.dense_ms, 2)} | "
                     f"{fmt(c.time_ratio, 3)} | {fmt(c.flop_ratio, 3)} | {c.verdict} | {fmt(c.setup_s, 1)} |")
    return "\n".join(lines) + "\n"


def write(out: Path, name: str, env: dict, shape: Shape, cells: list[Cell], dry_run: bool) -> None:
    out.mkdir(parents=True, exist_ok=True)
    record = {"environment": env, "shape": asdict(shape), "capacity": CAPACITY, "dry_run": dry_run,
              "bars": {"block_max_flop_multiple": BLOCK_BAR, "model_min_efficiency": MODEL_BAR},
              "cells": [asdict(c) for c in cells]}
    (out / f"{name}.json").write_text(json.dumps(record, indent=2) + "\n")
    (out / f"{name}.md").write_text(markdown(env, shape, cells))


def run(out: Path, name: str, *, bars: list[str], modes: list[str], dry_run: bool = False, log=print) -> list[Cell]:
    """Every (bar, variant, mode) cell, written after each one (module doc)."""
    device = "cpu" if dry_run else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("gpu_bars: no CUDA device (use --dry-run for the CPU check)")
    shape = DRY if dry_run else GPU
    env = environment(device)
    cells: list[Cell] = []
    for mode in modes:  # mode by mode: the compiles (slowest to set up) after every eager cell
        for bar in bars:
            for variant in (BLOCK_VARIANTS if bar == "block" else (MODEL_VARIANT,)):
                cell = Cell(bar, variant, mode)
                cells.append(cell)
                if mode == "cudagraphs" and device != "cuda":
                    cell.error = "n/a: CUDA graphs need a CUDA device"
                else:
                    try:
                        measure(cell, shape, device, dry_run)
                    except Exception as e:  # one failed cell (compile, memory) must not lose the others
                        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
                        cell.error = f"{type(e).__name__}: {first}"[:200]
                    finally:
                        torch._dynamo.reset()  # each cell compiles its own modules
                        if device == "cuda":
                            torch.cuda.empty_cache()
                log(f"{bar:>5} {variant:>8} {mode:>10}: {cell.error or cell.verdict}")
                write(out, name, env, shape, cells, dry_run)
    return cells


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m modbench.bench.gpu_bars", description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("reports/bench"), help="output folder (default: reports/bench)")
    p.add_argument("--name", default=None, help="file name without suffix (default: bars-<gpu> or bars-dry)")
    p.add_argument("--bars", default="block,model", help="comma-separated, among block, model (default: both)")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, among {', '.join(MODES)} (default: all)")
    p.add_argument("--dry-run", action="store_true", help="the CPU check: tiny shapes, seconds")
    args = p.parse_args(argv)
    bars = [b.strip() for b in args.bars.split(",") if b.strip()]
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not bars or any(b not in ("block", "model") for b in bars):
        p.error(f"--bars {args.bars!r}: expected a comma-separated list of block, model")
    if not modes or any(m not in MODES for m in modes):
        p.error(f"--modes {args.modes!r}: expected a comma-separated list of {', '.join(MODES)}")
    if args.name is None:
        gpu = "dry" if args.dry_run or not torch.cuda.is_available() else \
            torch.cuda.get_device_name().lower().replace("nvidia", "").strip().split()[0]
        args.name = f"bars-{gpu}"
    threads = torch.get_num_threads()
    if args.dry_run:
        torch.set_num_threads(1)
    try:
        run(args.out, args.name, bars=bars, modes=modes, dry_run=args.dry_run)
    finally:
        torch.set_num_threads(threads)
    print(f"gpu_bars: {args.out / (args.name + '.md')} and .json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
