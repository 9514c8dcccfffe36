"""Shared machinery of the speed benchmarks (pytest-benchmark).

Every benchmark here is also a correctness test: with ``--benchmark-disable`` (how CI runs
them) the timed closure runs exactly once, at full size, and the test's checks run on its
result, so the benchmarks cannot rot. With ``--benchmark-enable`` the closure is warmed up,
then timed for about ``budget_s`` seconds (at least ``MIN_ROUNDS`` rounds); a routed entry's
every round is preceded by a call of its dense reference, so its time ratio comes from
adjacent calls (``paired_time_ratio``, what ``modbench.bench.table`` reports; see
``run_bench``).

    pytest tests/bench --benchmark-enable --benchmark-json=reports/bench/cpu.json \
        --benchmark-group-by=group
    python -m modbench.bench.table reports/bench/cpu.json --markdown reports/bench/cpu.md

CPU runs use fp32 and 2 threads (the issue's reference point). CUDA runs (only where a GPU
is present; skipped otherwise) use bf16 autocast and ``torch.compile``, synchronise after
every call, and get extra warm-up rounds for the compilation.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable

import pytest
import torch

# The reference point is 2 threads. MODBENCH_BENCH_THREADS overrides it: on a machine
# shared with other jobs, a 2-thread parallel region waits for its descheduled thread at every op
# (measured here at load average 10-14 on 2 cores: a batch-64 decode step at 819 ms with 2 threads,
# 124 ms with 1), which times the scheduler rather than the code. Recorded in extra_info["threads"].
CPU_THREADS = int(os.environ.get("MODBENCH_BENCH_THREADS", "2"))
MIN_ROUNDS = 5
MAX_ROUNDS = 100
CUDA_WARMUP_ROUNDS = 3  # the first calls compile

DEVICES = [  # every test with a ``device`` argument runs on each (pytest_generate_tests)
    pytest.param("cpu", id="cpu"),
    pytest.param(
        "cuda", id="cuda",
        marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA not available"),
    ),
]


def pytest_generate_tests(metafunc):
    if "device" in metafunc.fixturenames:
        metafunc.parametrize("device", DEVICES)


def group_name(kind: str, seq_len: int, device: str) -> str:
    """'block T=512 scope=block', 'model T=2048 scope=model' (+ ' device=cuda' on a GPU)."""
    name = f"{kind} T={seq_len} scope={kind}"
    return name if device == "cpu" else f"{name} device={device}"


def _cpu_seconds() -> tuple[float, float, float] | None:
    """(machine busy, machine total, this process) CPU seconds; None off Linux."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    hz = os.sysconf("SC_CLK_TCK")
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    total = sum(fields[:8])  # user nice system idle iowait irq softirq steal (guest is in user)
    t = os.times()
    return (total - idle) / hz, total / hz, t.user + t.system


def foreign_cpu_share(before, after) -> float | None:
    """Share of the machine's CPU used by *other* processes between two ``_cpu_seconds``.

    On a shared machine another process on one of the 2 cores stalls every parallel region
    of ours; this number says how disturbed a measurement was (0 = we were alone).
    """
    if before is None or after is None or after[1] <= before[1]:
        return None
    busy, total, own = (a - b for a, b in zip(after, before))
    return max(0.0, min(1.0, (busy - own) / total))


@pytest.fixture(autouse=True)
def _bench_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(min(CPU_THREADS, os.cpu_count() or 1))
    yield
    torch.set_num_threads(before)


def _synced(fn: Callable[[], object], device: str) -> Callable[[], object]:
    if device != "cuda":
        return fn

    def call():
        result = fn()
        torch.cuda.synchronize()
        return result

    return call


def _timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _median(xs: list[float]) -> float:
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])


@pytest.fixture
def run_bench(benchmark):
    """``run_bench(fn, kind=, seq_len=, device=, extra_info=, budget_s=, reference=, min_rounds=,
    seconds_of=)`` -> fn's result.

    Sets the group (``group_name``) and ``extra_info`` (plus kind, scope, seq_len, device,
    threads, torch version).

    Disabled: one call of ``fn``, nothing else (``reference`` is never built). Enabled:
    warm-up (1 call on CPU, ``CUDA_WARMUP_ROUNDS`` on CUDA), then ``benchmark.pedantic`` with
    enough rounds to fill ``budget_s`` (at least ``min_rounds``); every round is one call
    (iterations=1), synchronised on CUDA. ``extra_info["foreign_cpu"]`` records the share of
    the machine's CPU that other processes used during the timed rounds.

    ``reference`` (for a routed entry: a factory of the dense closure of the same size):
    every round first calls the reference in pytest-benchmark's untimed ``setup`` — timed
    here — then ``fn``, so each round is an adjacent (dense, routed) pair.
    ``extra_info["paired_time_ratio"]`` = min over rounds of t_fn / min of t_reference
    (``paired_median_ratio``: the median of the per-round ratios). ``seconds_of`` (optional): the
    time a round counts, read off the call's result instead of the call's wall time (decoding:
    the decode steps alone, ``Generation.seconds − prefill_seconds``); pytest-benchmark's own
    statistics stay the wall time of the whole call. ``extra_info["loadavg"]``: the 1-minute load
    average (``os.getloadavg``) after the timed rounds. On a shared, virtualised
    machine the speed of the whole machine drifts by tens of percent over seconds to minutes
    (measured here: the same dense block at 424-617 ms, other processes using ~1 % of the
    CPU), so a ratio of two entries timed minutes apart (``raw_ratio`` in bench_table) is
    off by that much; adjacent calls see the same machine. ``modbench.bench.table`` reports
    the paired ratio.
    """

    def run(
        fn: Callable[[], object], *, kind: str, seq_len: int, device: str, extra_info: dict,
        budget_s: float, reference: Callable[[], Callable[[], object]] | None = None,
        min_rounds: int = MIN_ROUNDS, seconds_of: Callable[[object], float] | None = None,
    ):
        benchmark.group = group_name(kind, seq_len, device)
        benchmark.extra_info.update(kind=kind, scope=kind, seq_len=seq_len)
        benchmark.extra_info.update(extra_info)
        benchmark.extra_info["device"] = device
        benchmark.extra_info["threads"] = torch.get_num_threads() if device == "cpu" else None
        benchmark.extra_info["torch"] = torch.__version__

        call = _synced(fn, device)
        if benchmark.disabled:
            return benchmark.pedantic(call, rounds=1)  # one call, no timing, no reference
        ref = _synced(reference(), device) if reference is not None else None
        warmup = CUDA_WARMUP_ROUNDS if device == "cuda" else 1
        for _ in range(warmup - 1):
            call()
            if ref is not None:
                ref()
        probe = _timed(call)  # the last warm-up calls, timed to size the rounds
        if ref is not None:
            probe += _timed(ref)
        rounds = max(min_rounds, min(MAX_ROUNDS, math.ceil(budget_s / max(probe, 1e-6))))
        benchmark.extra_info["rounds_planned"] = rounds

        t_fn: list[float] = []
        t_ref: list[float] = []

        def counted(fn: Callable[[], object], into: list[float]) -> object:
            t0 = time.perf_counter()
            result = fn()
            into.append(time.perf_counter() - t0 if seconds_of is None else seconds_of(result))
            return result

        def timed_call():
            return counted(call, t_fn)

        def reference_call():  # pytest-benchmark's setup: runs before every round, untimed
            counted(ref, t_ref)

        before = _cpu_seconds()
        result = benchmark.pedantic(
            timed_call, setup=reference_call if ref is not None else None,
            rounds=rounds, warmup_rounds=0, iterations=1,
        )
        share = foreign_cpu_share(before, _cpu_seconds())
        benchmark.extra_info["foreign_cpu"] = None if share is None else round(share, 3)
        benchmark.extra_info["loadavg"] = round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None
        if seconds_of is not None:
            benchmark.extra_info["counted_fn_s"] = [round(t, 6) for t in t_fn]
        if ref is not None:
            benchmark.extra_info.update(
                paired_rounds=len(t_fn),
                paired_time_ratio=min(t_fn) / min(t_ref),
                paired_median_ratio=_median([a / b for a, b in zip(t_fn, t_ref)]),
                paired_fn_s=[round(t, 6) for t in t_fn],
                paired_reference_s=[round(t, 6) for t in t_ref],
            )
        return result

    run.disabled = benchmark.disabled
    return run
