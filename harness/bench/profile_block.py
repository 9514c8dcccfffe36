"""Where the time of one routed block goes: build, count and profile forward + backward.

    python -m modbench.bench.profile_block --variant sigmoid --capacity 0.125 --seq-len 1024

builds one ``RoutedBlock`` (d = 256, 4 heads of 64, B = 8 by default, fp32, 2 threads; with
``--device cuda`` d = 1024, 8 heads of 128, bf16 autocast, eager, synchronised timing) and
the ``DenseLayer`` with the *same block weights*, times forward + backward of both, prints
the measured time ratio next to the analytic FLOP ratio, then profiles the routed block with
``torch.profiler`` and prints the top ops by self CPU time (router linear, topk, sort,
index_select, index_add, attention, the MLP's linears and their backward nodes…).

The same helpers build and count the blocks of the speed benchmarks (``tests/bench``):

- ``bench_config``: the benchmark model shape (depth 4; d = 256 on CPU, 1024 on CUDA).
- ``build_block``: a routed block (or the dense reference) with seeded, shared weights.
- FLOPs: each layer's own ``flops(seq_len)`` (``modbench.model.gpt``), the model's counter.
- ``fwd_bwd``: the closure the block benchmarks time; ``train_step``: the model benchmarks'.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext

import torch
from torch import Tensor, nn

from modbench import variants

from modbench.config.capacity import CapacitySchedule
from modbench.config.model import ModelConfig
from modbench.model.gpt import DenseLayer, RoutedBlock, rope_tables

# (width, head_dim) per device: d = 256 is the CPU point; on a GPU a d = 256 block is a few
# microseconds of tensor-core work and kernel launches would time the framework, not routing,
# so CUDA entries use d = 1024 (8 heads of 128, FlashAttention's best head size on Hopper).
BENCH_SHAPE = {"cpu": (256, 64), "cuda": (1024, 128)}
BENCH_WIDTH, BENCH_HEAD_DIM = BENCH_SHAPE["cpu"]


def bench_config(max_seq_len: int = 2048, depth: int = 4, device: str = "cpu") -> ModelConfig:
    """The benchmark shape of ``device`` (``BENCH_SHAPE``): d = 256, 4 heads of 64 on CPU;
    d = 1024, 8 heads of 128 on CUDA; MLP ratio 4."""
    width, head_dim = BENCH_SHAPE["cuda" if device.startswith("cuda") else "cpu"]
    return ModelConfig(depth=depth, n_embd=width, head_dim=head_dim, max_seq_len=max_seq_len)


def build_block(variant: str, capacity: float, cfg: ModelConfig, seed: int = 0) -> nn.Module:
    """One layer in training mode: ``DenseLayer`` for ``dense``, else a ``RoutedBlock``.

    The block weights come from a ``DenseLayer`` built under ``seed``, so every variant and
    capacity at that seed runs the very same attention and MLP weights as the dense
    reference. A routed block is built at every capacity, 1.0 included (k = T: what the
    routing machinery costs when it saves nothing); ``GPT`` itself builds plain blocks at
    C = 1.0, which the model-scope benchmark measures.
    """
    torch.manual_seed(seed)
    dense = DenseLayer(cfg)
    if variants.is_baseline(variant):
        return dense.train()
    router = variants.build_router(variant, cfg.width)
    if router.scope == "none":
        raise ValueError(f"variant {variant!r} builds no routed block")
    routed = RoutedBlock(cfg, router, CapacitySchedule(capacity, max_seq_len=cfg.max_seq_len))
    # The same weights as the dense reference; a mixture-of-experts MLP (MoDE) has its own, so only
    # attention and the norms are shared there.
    routed.block.load_state_dict(dense.block.state_dict(), strict=not router.mlp_experts)
    return routed.train()


def fwd_bwd(
    layer: nn.Module, x: Tensor, grad: Tensor, cos: Tensor, sin: Tensor, *,
    autocast: torch.dtype | None = None,
) -> Callable[[], Tensor]:
    """The timed closure: forward, then backward of ``out`` with the fixed ``grad``.

    Auxiliary losses (the router's BCE, a detached predictor's loss…) are backpropagated
    too, with unit weight, since a training step pays for them. Gradients are reset to
    None first, so every call does the same work (allocation, never accumulation).
    ``autocast`` runs the forward under ``torch.autocast`` with that dtype (bf16 on CUDA).
    """
    params = [p for p in layer.parameters() if p.requires_grad]

    def step() -> Tensor:
        x.grad = None
        for p in params:
            p.grad = None
        if autocast is None:
            out = layer(x, cos, sin)
        else:
            with torch.autocast(x.device.type, dtype=autocast):
                out = layer(x, cos, sin)
        tensors = [out.x, *out.aux_losses.values()]
        grads = [grad, *(None for _ in out.aux_losses)]
        torch.autograd.backward(tensors, grads)
        return out.x

    return step


def train_step(model: nn.Module, idx: Tensor, targets: Tensor, *, forward: Callable | None = None,
               autocast: torch.dtype | None = None, aux_step: int = 10**6) -> Callable[[], Tensor]:
    """The timed closure of a whole-model training step: zero grads, ``forward`` (the model, or a
    compiled view of it) under ``autocast``, the LM loss plus the aux losses weighted at ``aux_step``
    (past any warm-up: the step pays for every aux loss), backward, AdamW step; returns the LM loss."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)
    forward = model if forward is None else forward
    device = idx.device.type

    def step() -> Tensor:
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device, dtype=autocast) if autocast is not None else nullcontext():
            out = forward(idx, targets)
        loss = out.loss
        aux = model.weighted_aux_loss(out.aux_losses, aux_step)
        if aux is not None:
            loss = loss + aux
        loss.backward()
        opt.step()
        return out.loss.detach()

    return step


def block_inputs(cfg: ModelConfig, batch: int, seq_len: int, device: str = "cpu", seed: int = 1):
    """(x requiring grad, fixed output grad, cos, sin) for a block benchmark."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, seq_len, cfg.width, generator=g).to(device).requires_grad_(True)
    grad = torch.randn(batch, seq_len, cfg.width, generator=g).to(device)
    cos, sin = rope_tables(cfg.max_seq_len, cfg.width // cfg.heads, cfg.rope_base)
    return x, grad, cos.to(device), sin.to(device)


def time_call(fn: Callable[[], object], rounds: int, warmup: int = 1) -> list[float]:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def time_interleaved(fns: Sequence[Callable[[], object]], rounds: int, warmup: int = 1) -> list[list[float]]:
    """Per function, ``rounds`` timings taken in alternation (a b a b …), after ``warmup``
    calls of each: drifts in machine load hit every function alike, so ratios of their
    minima (or medians) are steadier than ratios of separate runs."""
    for fn in fns:
        for _ in range(warmup):
            fn()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(rounds):
        for fn, ts in zip(fns, times):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
    return times


def _median(xs: Sequence[float]) -> float:
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])


# --- the script ---------------------------------------------------------------------------
def _synchronised(fn: Callable[[], Tensor], cuda: bool) -> Callable[[], Tensor]:
    """``fn``, waiting for the GPU after each call so that wall time is the kernels' time."""
    if not cuda:
        return fn

    def call() -> Tensor:
        result = fn()
        torch.cuda.synchronize()
        return result

    return call


def profile_block(
    variant: str = "sigmoid",
    capacity: float = 0.125,
    seq_len: int = 1024,
    batch: int = 8,
    *,
    threads: int | None = 2,
    rounds: int = 5,
    steps: int = 3,
    top: int = 25,
    sort_by: str = "self_cpu_time_total",
    compare_dense: bool = True,
    shapes: bool = False,
    device: str = "cpu",
    out=sys.stdout,
) -> dict[str, float]:
    """Time (routed vs dense) and profile forward + backward of one block; print a report.

    On CUDA: bf16 autocast, eager (the profile shows every kernel, where a compiled block would
    show fused ones), every timed call synchronised, ops sorted by their GPU time."""
    if threads:
        torch.set_num_threads(threads)
    cuda = device.startswith("cuda")
    cfg = bench_config(max_seq_len=max(seq_len, 1), device=device)
    layer = build_block(variant, capacity, cfg).to(device)
    x, grad, cos, sin = block_inputs(cfg, batch, seq_len, device)
    autocast = torch.bfloat16 if cuda else None
    step = _synchronised(fwd_bwd(layer, x, grad, cos, sin, autocast=autocast), cuda)
    fl = layer.flops(seq_len)
    if cuda and sort_by == "self_cpu_time_total":
        sort_by = "self_device_time_total"

    print(
        f"{variant} C={capacity} T={seq_len} B={batch} d={cfg.width} heads={cfg.heads} "
        f"k={fl.tokens_processed} {'bf16 autocast on ' + torch.cuda.get_device_name() if cuda else 'fp32'} "
        f"threads={torch.get_num_threads()} torch {torch.__version__}",
        file=out,
    )
    summary: dict[str, float] = {}
    if compare_dense and not variants.is_baseline(variant):
        dense = build_block(variants.baseline_variant(), 1.0, cfg).to(device)
        dfl = dense.flops(seq_len)
        dense_step = _synchronised(fwd_bwd(dense, x, grad, cos, sin, autocast=autocast), cuda)
        routed_t, dense_t = time_interleaved([step, dense_step], rounds, warmup=3 if cuda else 1)
        t_routed, t_dense = min(routed_t), min(dense_t)
        ratio, flop_ratio = t_routed / t_dense, fl.total / dfl.total
        median_ratio = _median(routed_t) / _median(dense_t)
        summary.update(
            time_ms=1e3 * t_routed, dense_ms=1e3 * t_dense, time_ratio=ratio,
            median_time_ratio=median_ratio, flop_ratio=flop_ratio, efficiency=flop_ratio / ratio,
        )
        print(
            f"fwd+bwd, min of {rounds} interleaved calls: routed {1e3 * t_routed:.1f} ms, dense "
            f"{1e3 * t_dense:.1f} ms; time ratio {ratio:.3f} (of medians {median_ratio:.3f}), "
            f"causal FLOP ratio {flop_ratio:.3f}, time/FLOP {ratio / flop_ratio:.2f}× "
            f"(efficiency {flop_ratio / ratio:.2f})",
            file=out,
        )
    else:
        t_routed = min(time_call(step, rounds))
        summary["time_ms"] = 1e3 * t_routed
        print(f"fwd+bwd (min of {rounds}): {1e3 * t_routed:.1f} ms", file=out)

    summary["profiled_self_cpu_ms_per_step"] = _print_profile(
        step, cuda=x.is_cuda, steps=steps, full_numel=batch * seq_len * cfg.width, top=top, sort_by=sort_by,
        shapes=shapes, out=out)
    return summary


def _print_profile(step: Callable[[], Tensor], *, cuda: bool, steps: int, full_numel: int, top: int, sort_by: str,
                   shapes: bool, out) -> float:
    """Profile ``steps`` calls of ``step`` with ``torch.profiler``, print self CPU time by region and
    the top ops; returns the profiled self CPU milliseconds per step."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if cuda:
        activities.append(ProfilerActivity.CUDA)
    step()  # warm
    with profile(activities=activities, record_shapes=True) as prof:
        for _ in range(steps):
            step()
    by_shape = prof.key_averages(group_by_input_shape=True)
    regions = region_times(by_shape, full_numel=full_numel)
    total_self = sum(regions.values())
    print(f"\ntorch.profiler, {steps} steps of forward + backward: self CPU time per step by region", file=out)
    for name, us in sorted(regions.items(), key=lambda kv: -kv[1]):
        print(f"  {name:<64} {us / 1e3 / steps:8.2f} ms  {us / total_self:6.1%}", file=out)
    if top:
        print(f"\ntop {top} ops by {sort_by}:", file=out)
        print(prof.key_averages().table(sort_by=sort_by, row_limit=top, max_name_column_width=48), file=out)
    if top and shapes:
        print(f"\ntop {top} (op, input shapes) by {sort_by}:", file=out)
        print(
            by_shape.table(sort_by=sort_by, row_limit=top, max_name_column_width=40, max_shapes_column_width=60),
            file=out,
        )
    return total_self / 1e3 / steps


_ROUTING_OPS = {
    "aten::topk", "aten::sort", "aten::gather", "aten::index_select", "aten::index_add",
    "aten::index_add_", "aten::scatter", "aten::scatter_", "aten::scatter_add", "aten::scatter_add_",
    "aten::index", "aten::take_along_dim", "aten::index_put_", "aten::_index_put_impl_",
}
_MATMUL_OPS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::matmul", "aten::linear"}


def region_of(name: str, input_shapes: Sequence[Sequence[int]] | None, full_numel: int = 0) -> str:
    """Where an op's self time belongs, from its name and input shapes.

    ``full_numel`` = B·T·d: an elementwise op on a tensor that size touches the whole
    sequence — in a routed block, the price of routing beyond its FLOPs (the out-of-place
    ``index_add`` copy, the zero-filled gradient of ``index_select``, gradient sums).
    """
    if name in _ROUTING_OPS:
        return "routing: top-k, sort, gather, index_select/index_add"
    if "scaled_dot_product" in name:
        return "attention kernel (SDPA forward + backward)"
    if name in _MATMUL_OPS:
        two_d = [s for s in (input_shapes or []) if len(s) == 2]
        if any(1 in s for s in two_d):
            return "router linear d→1 (forward + backward)"
        return "block matmuls: qkv, out proj, MLP (fwd + bwd)"
    if name in ("aten::gelu", "aten::gelu_backward"):
        return "GELU (forward + backward)"
    if name.startswith("aten::"):
        if full_numel and any(_numel(s) == full_numel for s in (input_shapes or [])):
            return "elementwise on all B·T tokens: copies, zero-fill, grad sums"
        return "elementwise on processed tokens: norms, RoPE, residual, grads"
    return "autograd engine and other framework overhead"


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for v in shape:
        n *= v
    return n if len(shape) else 0


def region_times(events, full_numel: int = 0) -> dict[str, float]:
    """Self CPU microseconds per ``region_of`` region (events grouped by input shape)."""
    regions: dict[str, float] = {}
    for e in events:
        region = region_of(e.key, getattr(e, "input_shapes", None), full_numel)
        regions[region] = regions.get(region, 0.0) + e.self_cpu_time_total
    return regions


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m modbench.bench.profile_block", description=__doc__.split("\n\n")[0])
    p.add_argument("--variant", default="sigmoid", help="a registered variant, or 'dense'")
    p.add_argument("--capacity", type=float, default=0.125)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (0: leave as is)")
    p.add_argument("--rounds", type=int, default=5, help="timed calls per block (min is reported)")
    p.add_argument("--steps", type=int, default=3, help="profiled forward + backward steps")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--sort-by", default="self_cpu_time_total")
    p.add_argument("--no-dense", action="store_true", help="skip timing the dense reference")
    p.add_argument("--shapes", action="store_true", help="also list the top ops by (op, input shapes)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cuda: d = 1024, bf16 autocast, ops sorted by GPU time")
    a = p.parse_args(argv)
    if a.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device is available; accepted: cpu")
    profile_block(
        a.variant, a.capacity, a.seq_len, a.batch, threads=a.threads or None, rounds=a.rounds,
        steps=a.steps, top=a.top, sort_by=a.sort_by, compare_dense=not a.no_dense, shapes=a.shapes,
        device=a.device,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
