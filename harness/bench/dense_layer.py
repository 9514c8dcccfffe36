"""Where modbench's dense layer spends time that a minimal block of the same matmuls does not.

    python -m modbench.bench.dense_layer                      # CPU: d 256, T 512, B 4, fp32
    python -m modbench.bench.dense_layer --device cuda        # d 1024, T 2048, B 32, bf16 autocast

Issue 38 timed modbench's dense layer forward + backward at 20.6 ms against nanoGPT's block at
15.0 ms (eager, H100, B 32, T 2048, d 1024, bf16 autocast; compiled 12.8 vs 13.0 ms). The two
blocks do the same matmuls; they differ in what surrounds them. This module times, interleaved in
one process, a ladder of blocks that share one set of weights, each adding one of modbench's
differences to the last:

1. ``reference``: nanoGPT's block shape: x + attn(ln(x)), x + mlp(ln(x)); LayerNorm without
   bias, causal SDPA, GELU MLP, no position encoding in the block (nanoGPT's positions are a
   learned table added once below the first block).
2. ``+ rmsnorm``: RMSNorm in place of LayerNorm (modbench's norm).
3. ``+ rope fp32``: RoPE on q and k with fp32 tables, the way modbench rotated them until
   issue 38: under autocast the rotation promotes bf16 q and k to fp32 and SDPA casts them back.
4. ``+ rope``: RoPE in the activations' dtype (``modbench.model.gpt.apply_rope`` now).
5. ``modbench``: ``modbench.model.gpt.DenseLayer`` itself, whose arithmetic is step 4's (the test
   checks they agree), so its gap to step 4 is the cost of modbench's structure (the ``delta``
   form, ``LayerOutput``), if any.

Each row: the median time of forward + backward, its ratio to ``reference``, and the profiler's
device (CUDA) or CPU time per category (matmul, attention, dtype casts and copies, norms, other
elementwise). The steps are hand-written here because they are the measurement itself: no library
builds "modbench's block minus one feature".
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from modbench.bench.profile_block import bench_config, block_inputs, time_interleaved
from modbench.config.model import ModelConfig
from modbench.model.gpt import Block, DenseLayer

STEPS = ("reference", "+ rmsnorm", "+ rope fp32", "+ rope", "modbench")
# Profiler op names by category (the first category whose key appears in the op's name wins).
CATEGORIES = (
    ("attention", ("attention", "sdpa", "flash", "cudnn")),
    ("matmul", ("mm", "addmm", "linear", "matmul", "nvjet", "gemm", "cutlass")),
    ("casts and copies", ("copy", "_to_copy", "cat", "contiguous", "memcpy")),
    ("norms", ("norm",)),
)


def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """RoPE on (B, H, T, hd) with the tables as given: fp32 tables promote a bf16 x (step 3)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


class LadderBlock(nn.Module):
    """Steps 1-4: the reference block with modbench's norm and RoPE switched on one at a time,
    on the weights of a modbench ``Block`` (its ``qkv``, ``proj``, ``fc``, ``proj`` linears)."""

    def __init__(self, block: Block, cfg: ModelConfig, step: str) -> None:
        super().__init__()
        self.attn, self.mlp, self.n_head = block.attn, block.mlp, cfg.heads
        if step == "reference":
            self.norm1 = nn.LayerNorm(cfg.width, bias=False)
            self.norm2 = nn.LayerNorm(cfg.width, bias=False)
        else:
            self.norm1, self.norm2 = block.norm1, block.norm2
        self.rope = {"reference": None, "+ rmsnorm": None, "+ rope fp32": "fp32", "+ rope": "activations"}[step]

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        B, T, d = x.shape
        qkv = self.attn.qkv(self.norm1(x)).view(B, T, 3, self.n_head, d // self.n_head)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        if self.rope is not None:
            c, s = cos[:T], sin[:T]
            if self.rope == "activations":
                c, s = c.to(q.dtype), s.to(q.dtype)
            q, k = rotate(q, c, s), rotate(k, c, s)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.attn.proj(y.transpose(1, 2).reshape(B, T, d))
        return x + self.mlp(self.norm2(x))


def build_ladder(cfg: ModelConfig, seed: int = 0) -> dict[str, Callable[[Tensor, Tensor, Tensor], Tensor]]:
    """Every step of the ladder as a function (x, cos, sin) → output, on one set of weights."""
    torch.manual_seed(seed)
    dense = DenseLayer(cfg).train()
    ladder: dict[str, Callable[[Tensor, Tensor, Tensor], Tensor]] = {
        step: LadderBlock(dense.block, cfg, step).train() for step in STEPS[:-1]}
    ladder["modbench"] = lambda x, cos, sin: dense(x, cos, sin).x
    return ladder


def step_call(fn: Callable, params: list[Tensor], x: Tensor, grad: Tensor, cos: Tensor, sin: Tensor,
              autocast: torch.dtype | None) -> Callable[[], None]:
    """Forward then backward with a fixed output gradient; gradients reset first (same work each call)."""

    def call() -> None:
        x.grad = None
        for p in params:
            p.grad = None
        with torch.autocast(x.device.type, dtype=autocast or torch.float32, enabled=autocast is not None):
            out = fn(x, cos, sin)
        out.backward(grad)

    return call


def category(name: str) -> str:
    low = name.lower()
    for label, keys in CATEGORIES:
        if any(k in low for k in keys):
            return label
    return "other elementwise"


def profile_categories(call: Callable[[], None], device: torch.device, steps: int = 3) -> dict[str, float]:
    """Milliseconds per call by category: CUDA kernel time on a GPU, self CPU time of aten ops on a CPU."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            call()
        if cuda:
            torch.cuda.synchronize()
    totals: dict[str, float] = {}
    for e in prof.key_averages():
        if cuda:
            us = e.self_device_time_total if e.device_type == torch.autograd.DeviceType.CUDA else 0.0
        else:
            us = e.self_cpu_time_total if e.key.startswith("aten::") else 0.0
        if us:
            label = category(e.key)
            totals[label] = totals.get(label, 0.0) + us / 1e3 / steps
    return totals


@dataclass
class Row:
    step: str
    median_ms: float
    ratio: float  # median time / the reference's
    by_category_ms: dict[str, float]


def measure(device: str = "cpu", batch: int | None = None, seq_len: int | None = None, rounds: int = 10,
            seed: int = 0) -> tuple[list[Row], dict[str, object]]:
    """Time and profile every step of the ladder; returns the rows and the settings."""
    cuda = device.startswith("cuda")
    batch = batch or (32 if cuda else 4)
    seq_len = seq_len or (2048 if cuda else 512)
    cfg = bench_config(max_seq_len=seq_len, depth=1, device=device)
    dev = torch.device(device)
    ladder = build_ladder(cfg, seed)
    x, grad, cos, sin = block_inputs(cfg, batch, seq_len, device)
    autocast = torch.bfloat16 if cuda else None
    calls = {}
    for step, fn in ladder.items():
        if isinstance(fn, nn.Module):
            fn.to(dev)
    params = [p for fn in ladder.values() if isinstance(fn, nn.Module) for p in fn.parameters()]
    for step, fn in ladder.items():
        calls[step] = step_call(fn, params, x, grad, cos, sin, autocast)

    def synced(call: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            call()
            if cuda:
                torch.cuda.synchronize()
        return run

    times = time_interleaved([synced(calls[s]) for s in STEPS], rounds=rounds, warmup=2)
    medians = {s: statistics.median(t) * 1e3 for s, t in zip(STEPS, times)}
    rows = [Row(s, round(medians[s], 3), round(medians[s] / medians["reference"], 3),
                {k: round(v, 3) for k, v in sorted(profile_categories(calls[s], dev).items())}) for s in STEPS]
    settings = {"device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
                "batch": batch, "seq_len": seq_len, "width": cfg.width, "heads": cfg.heads,
                "dtype": "bf16 autocast" if cuda else "fp32", "rounds": rounds, "threads": torch.get_num_threads()}
    return rows, settings


def markdown(rows: list[Row], settings: dict[str, object]) -> str:
    cats = sorted({c for r in rows for c in r.by_category_ms})
    head = ("| step | median ms | × reference | " + " | ".join(cats) + " |\n"
            + "|---|---:|---:|" + "---:|" * len(cats) + "\n")
    body = "".join(f"| {r.step} | {r.median_ms:.2f} | {r.ratio:.3f} | "
                   + " | ".join(f"{r.by_category_ms.get(c, 0.0):.2f}" for c in cats) + " |\n" for r in rows)
    where = ", ".join(f"{k} {v}" for k, v in settings.items())
    return (f"Dense layer forward + backward, one process, interleaved ({where}); the category columns are "
            f"profiled ms per call ({'CUDA kernel time' if settings['device'] != 'cpu' else 'self CPU time of aten ops'}).\n\n"
            + head + body)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m modbench.bench.dense_layer", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--batch", type=int, default=None, help="default 32 on CUDA, 4 on CPU")
    p.add_argument("--seq-len", type=int, default=None, help="default 2048 on CUDA, 512 on CPU")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--json", default=None, help="also write the rows and settings to this file")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("dense_layer: --device cuda but no CUDA device is available: use --device cpu", file=sys.stderr)
        return 2
    for name in ("batch", "seq_len", "rounds"):
        value = getattr(args, name)
        if value is not None and value < 1:
            print(f"dense_layer: --{name.replace('_', '-')} must be >= 1, got {value}", file=sys.stderr)
            return 2
    rows, settings = measure(args.device, args.batch, args.seq_len, args.rounds)
    print(markdown(rows, settings))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"settings": settings, "rows": [asdict(r) for r in rows]}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
