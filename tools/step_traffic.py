"""What one training step computes and moves, counted on the CPU: the floor it sets on a GPU.

    python tools/step_traffic.py paper_claims_gpu [--arms "dense;sigmoid C=0.125 alternate L8"]
        [--batch 8] [--peak-tflops 989] [--bandwidth-tbs 3.35]

Why: a study on a lent GPU runs several worker processes on the one GPU, which pays only while one
process leaves the GPU idle. Issue "Studies on one lent GPU" measured one process at 12–16 % of an
H100's bf16 peak FLOP/s; whether the rest of the time is idle (launch-bound: more processes help) or
spent in memory-bound kernels (the GPU is busy: more processes do not help, fusion by
``torch.compile`` does) is what this counts.

How: for each arm, one eager training step as the trainer runs it on CUDA (bf16 autocast; forward,
backward, gradient clipping, AdamW; a first step untimed so that the optimizer's state exists) is
dispatched under two counters:

- ``FlopCounterMode`` (torch's) counts the FLOPs of the ops that have a FLOP formula: the matmuls and
  attention, the compute-bound work;
- a ``TorchDispatchMode`` here adds, for every other op that is not a view, the bytes of its tensor
  inputs and outputs: what an eager kernel reads from and writes to the GPU's memory, unfused (an
  in-place op's tensor counts as read and written).

Forward and backward are counted at ``--batch`` and half of it and extrapolated to the study's batch:
their cost is affine in the batch (the activations' traffic grows with it, the weights' casts and
gradients do not; tests/test_step_traffic.py checks the extrapolation against a direct count);
clipping and the optimizer do not depend on the batch and are counted once.

The floor of the step on a device is FLOPs / peak + bytes / bandwidth (each op bound by one or the
other, run one after another), at the device's datasheet numbers (defaults: an H100 SXM's dense bf16
989 TFLOP/s and 3.35 TB/s): a lower bound on the time the GPU is busy. Against a measured step time it says how much of the step the GPU could be idle at most.

Why hand-written: no library counts an eager step's memory traffic per op (torch.profiler reports
no DRAM bytes on a CPU; on a GPU that is Nsight Compute's job, one kernel at a time). The CPU's
dispatch differs from CUDA's in a few ops (its attention kernel, some autocast casts); the counts are
of the CPU's ops.
"""

from __future__ import annotations

import argparse
import collections
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import FlopCounterMode, flop_registry


class ByteCounter(TorchDispatchMode):
    """Bytes of the tensor inputs and outputs of every op that has no FLOP formula and is not a view."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes: collections.Counter[str] = collections.Counter()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops += 1
        if func.is_view or func.overloadpacket in flop_registry:
            return out
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        outputs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        if not func._schema.is_mutable and outputs and all(_aliases(o, inputs) for o in outputs):
            return out  # a view by another name (``_unsafe_view``, ``alias``): no data moved
        self.bytes[func.overloadpacket.__name__] += sum(t.numel() * t.element_size() for t in inputs + outputs)
        return out


def _aliases(t: torch.Tensor, others: list[torch.Tensor]) -> bool:
    ptr = t.untyped_storage().data_ptr()
    return any(o.untyped_storage().data_ptr() == ptr for o in others)


@dataclass
class Count:
    flops: float = 0.0
    bytes: collections.Counter = field(default_factory=collections.Counter)
    ops: int = 0

    def add(self, other: "Count") -> None:
        self.flops += other.flops
        self.ops += other.ops
        self.bytes.update(other.bytes)  # Counter.update adds

    @staticmethod
    def affine(small: "Count", b1: int, large: "Count", b2: int, target: int) -> "Count":
        """The count at batch ``target`` of a cost affine in the batch, from its counts at b1 < b2."""
        out = Count(ops=large.ops)
        k = (target - b2) / (b2 - b1)
        out.flops = large.flops + (large.flops - small.flops) * k
        for name in set(small.bytes) | set(large.bytes):
            out.bytes[name] = large.bytes[name] + (large.bytes[name] - small.bytes[name]) * k
        return out


def counted(fn) -> Count:
    """``fn()`` under both counters."""
    flops, traffic = FlopCounterMode(display=False), ByteCounter()
    with flops, traffic:
        fn()
    return Count(float(flops.get_total_flops()), traffic.bytes, traffic.ops)


def step_count(model, optimizer, x: torch.Tensor, y: torch.Tensor, grad_clip: float) -> tuple[Count, Count]:
    """(forward + backward, clipping + optimizer) of one training step on (x, y), bf16 autocast as on
    CUDA, after an uncounted one (the optimizer's state)."""

    def forward_backward() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(x, y)
        out.loss.backward()

    def update() -> None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    forward_backward()  # the untimed first step: the optimizer's state
    update()
    return counted(forward_backward), counted(update)


def arm_count(study, label: str, batch: int) -> tuple[Count, int]:
    """The study arm's step at its own batch, forward and backward counted at ``batch`` and half of it
    and extrapolated (directly, when ``batch`` is the study's); (count, the study's batch)."""
    from modbench.design.controls import study_arms
    from modbench.model.gpt import GPT
    from modbench.run.train import build_optimizer

    cfg = study.run_config({study.label(a): a for a in study_arms(study)}[label], 0)
    torch.manual_seed(0)
    model = GPT(cfg.model, cfg.routing)
    optimizer = build_optimizer(model, cfg)
    t = cfg.train
    tokens = torch.randint(0, cfg.model.vocab_size, (t.batch_size, t.seq_len + 1))
    batches = [t.batch_size] if batch >= t.batch_size else [max(1, batch // 2), batch]
    counts = [step_count(model, optimizer, tokens[:b, :-1], tokens[:b, 1:], t.grad_clip) for b in batches]
    fb = counts[0][0] if len(counts) == 1 else Count.affine(counts[0][0], batches[0], counts[1][0], batches[1],
                                                            t.batch_size)
    fb.add(counts[-1][1])
    return fb, t.batch_size


def floor_ms(c: Count, peak_tflops: float, bandwidth_tbs: float) -> tuple[float, float]:
    """(compute ms, memory ms) of the step's floor on the device."""
    return c.flops / (peak_tflops * 1e12) * 1e3, sum(c.bytes.values()) / (bandwidth_tbs * 1e12) * 1e3


def markdown(rows: list[tuple[str, Count, int]], seq_len: int, peak: float, bandwidth: float) -> str:
    lines = [f"One eager training step (bf16 autocast, T {seq_len}), counted on this CPU; the floor at "
             f"{peak:g} TFLOP/s and {bandwidth:g} TB/s.", "",
             "| arm | batch | ops | matmul + attention FLOPs | other ops' bytes | floor: compute + memory | largest byte ops |",
             "|---|---:|---:|---:|---:|---:|---|"]
    for label, c, batch in rows:
        compute, memory = floor_ms(c, peak, bandwidth)
        top = ", ".join(f"{name} {b / 2**30:.1f}" for name, b in c.bytes.most_common(4))
        lines.append(f"| {label} | {batch} | {c.ops:,} | {c.flops:.3g} | {sum(c.bytes.values()) / 2**30:.1f} GiB | "
                     f"{compute:.1f} + {memory:.1f} = {compute + memory:.1f} ms | {top} (GiB) |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python tools/step_traffic.py", description=__doc__.split("\n\n")[0])
    p.add_argument("study", help="a study file, or the name of a shipped study")
    p.add_argument("--arms", default=None, help="';'-separated arm labels (default: every arm)")
    p.add_argument("--batch", type=int, default=8,
                   help="sequences counted (and half of them), extrapolated to the study's batch (default 8; >= 2)")
    p.add_argument("--peak-tflops", type=float, default=989.0, help="the device's dense bf16 peak (default: H100 SXM)")
    p.add_argument("--bandwidth-tbs", type=float, default=3.35, help="its memory bandwidth (default: H100 SXM)")
    args = p.parse_args(argv)
    if args.batch < 2 or args.peak_tflops <= 0 or args.bandwidth_tbs <= 0:
        p.error("--batch must be at least 2, --peak-tflops and --bandwidth-tbs positive")
    from modbench.design.controls import study_arms
    from modbench.design.study_file import find_study, load_study
    from modbench.errors import ModbenchError

    try:
        study = load_study(find_study(args.study))
    except ModbenchError as e:
        p.error(str(e))
    known = [study.label(a) for a in study_arms(study)]
    labels = [x.strip() for x in args.arms.split(";") if x.strip()] if args.arms else known
    unknown = [x for x in labels if x not in known]
    if unknown:
        p.error(f"--arms: {unknown[0]!r} is not an arm of {study.name}: expected labels among "
                + "; ".join(repr(x) for x in known))
    rows = [(label, *arm_count(study, label, args.batch)) for label in labels]
    print(markdown(rows, study.base.train.seq_len, args.peak_tflops, args.bandwidth_tbs), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
