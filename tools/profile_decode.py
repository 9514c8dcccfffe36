"""Where a KV-cached decode step's time goes on the device (issue 30, the decode bar): dense vs routed.

    PYTHONPATH=build/gpu-pkg python3 tools/profile_decode.py --device cuda --batch 64

Builds the decode benchmark's models (tests/bench/test_decode_speed.py: on CUDA d = 1024, depth 12,
bf16 weights, prompt 64; routers calibrated to C = 0.125 with the pattern fixed:1,1), generates
``--new`` tokens once to warm, times ``--rounds`` generations, then profiles one with
``torch.profiler`` and prints, per decode step: wall time, the summed device-kernel time (what the
GPU was busy for), kernel launches, host syncs, and the top ops by self CPU time. Wall time far
above kernel time is a launch-bound decoder: the host's dispatch, not the GPU, sets the speed, and
every op a routed layer adds (router, index_select, index_copy, the host read of its decisions)
costs as much as the block work it saves.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]


def _bench_module():
    """tests/bench/test_decode_speed.py, for its model shapes and router calibration (one source)."""
    spec = importlib.util.spec_from_file_location("decode_bench", REPO / "tests" / "bench" / "test_decode_speed.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _device_us(event) -> float:
    # torch ≥ 2.4 names it self_device_time_total (self_cuda_time_total before)
    return float(getattr(event, "self_device_time_total", getattr(event, "self_cuda_time_total", 0.0)))


def profile_variant(bench, variant: str, device: str, batch: int, new: int, rounds: int, top: int) -> None:
    from torch.profiler import ProfilerActivity, profile

    from modbench.model.decode import generate

    size = "cuda" if device == "cuda" else "cpu"
    cfg = bench._config(size)
    pattern = None if variant == "dense" else "fixed:1,1"
    model = bench._model(cfg, variant, pattern, device)
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, cfg.vocab_size, (batch, bench.PROMPT[size]), generator=g).to(device)

    def run():
        return generate(model, prompt, new, mode="causal", temperature=1.0, seed=3)

    run()  # warm: allocator, cuBLAS handles, first-call dispatch
    steps = new - 1
    per_step = []
    for _ in range(rounds):
        _sync(device)
        gen = run()
        _sync(device)
        per_step.append((gen.seconds - gen.prefill_seconds) / steps)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        gen = run()
        _sync(device)
    events = prof.key_averages()
    # kernel time: the device-side events (kernels, memcpy/memset) — the leaves of the device timeline
    kernel_us = sum(_device_us(e) for e in events if getattr(e, "device_type", None) is not None
                    and "CUDA" in str(e.device_type))
    launches = sum(e.count for e in events if e.key in ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel"))
    syncs = sum(e.count for e in events if e.key in ("cudaStreamSynchronize", "cudaDeviceSynchronize",
                                                     "cudaMemcpyAsync", "cudaEventSynchronize"))
    aten_ops = sum(e.count for e in events if e.key.startswith("aten::"))
    P = bench.PROMPT[size]
    best = min(per_step)
    share = 1 - gen.skipped_fraction
    print(f"\n== {variant} (d={cfg.width}, depth {cfg.layers}, batch {batch}, prompt {P}, {new} new tokens, "
          f"{device}, realised share {share:.3f}) ==")
    print(f"decode step wall: best {best * 1e3:.3f} ms, median {sorted(per_step)[len(per_step) // 2] * 1e3:.3f} ms "
          f"over {rounds} generations; {batch / best:,.0f} tokens/s")
    whole = (gen.seconds) * 1e3
    print(f"profiled generation (prefill included, profiler on): {whole:.1f} ms; device-kernel time "
          f"{kernel_us / 1e3:.1f} ms ({kernel_us / 1e3 / whole:.0%} of the wall); per generated token (prefill "
          f"included): {launches / new:.0f} kernel launches, {syncs / new:.1f} host syncs/copies, "
          f"{aten_ops / new:.0f} aten ops")
    if top:
        print(events.table(sort_by="self_cpu_time_total", row_limit=top, max_name_column_width=40))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--new", type=int, default=64, help="new tokens per generation")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--top", type=int, default=20)
    p.add_argument("--variants", default="dense,sigmoid")
    a = p.parse_args(argv)
    if a.device == "cuda" and not torch.cuda.is_available():
        print("profile_decode: no CUDA device", file=sys.stderr)
        return 2
    bench = _bench_module()
    t0 = time.perf_counter()
    for variant in a.variants.split(","):
        profile_variant(bench, variant, a.device, a.batch, a.new, a.rounds, a.top)
    print(f"\n({time.perf_counter() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
