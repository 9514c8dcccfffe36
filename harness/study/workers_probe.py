"""How many study workers should share one GPU? Measure it on the study's own trials.

    python -m modbench.study.workers_probe STUDY [--workers 1,2,4,8] [--compile off,on]
        [--trials-per-worker K] [--device cuda|cpu] [--budget BUDGET] [--threads T] [--no-warmup]
        [--out-dir DIR] [--json PATH] [--markdown PATH] [--timeout-s S]

What it measures. A small model's training process reached only 12–16 % of an H100's bf16 peak
FLOP/s (issue "Studies on one lent GPU"; that is model FLOP utilisation, not the share of time the
GPU was busy, which was not measured), so a study runs several worker processes on the one GPU, and
how much N of them gain is this probe's measurement. For every setting (compile off/on × N workers)
the probe starts N worker processes together; each trains K trials of the study (seed 0,
untracked, ``train(cfg, progress=False)``), worker w's trial k being the study's arm
(w + k) mod A of its A arms (``modbench.model.sizing.study_arms``: the declared arms and the
derived controls), so with K a multiple of A every worker, at every N, trains the same mix.
``--budget`` replaces every arm's budget (controls included) for the probe. Per trial it
reports the arm, the whole trial's seconds (model build, data, training, evaluation,
checkpoint), the trainer's train tokens/s, steps, tokens and the peak GPU memory the worker
reserved. Per setting:

- wall s: from the common start to the last worker's end (see below);
- trials/min = trials finished / wall minutes — the number that decides N;
- aggregate tokens/s = the finished trials' training tokens / wall seconds (evaluation and
  model building count as time, not as tokens: it is a throughput of the whole trial loop);
- median trial s: one trial's latency, which grows with N as the workers share the GPU;
- speed-up = trials/min ÷ trials/min of N = 1 with the same compile setting.

Why processes, not threads: a study worker is a process (``modbench study run`` started N
times), each with its own CUDA context, caching allocator, Python interpreter and GIL; threads
would share one GIL (the CPU-side launch overhead that leaves the GPU idle is exactly what N
processes overlap) and one allocator, and would measure something the study never does.

Why subprocesses of ``python -m modbench.study.workers_probe --worker SPEC.json`` rather than
``multiprocessing`` with "spawn": a worker runs exactly as a study worker does (a fresh
interpreter started from the command line, no pickled state); a worker that dies hard (CUDA
error, segfault, the kernel's OOM killer) only closes its pipe, where a dead participant of a
``multiprocessing.Barrier`` leaves the others waiting; each worker leads its own process
group, so a timeout ends it together with its torch.compile helper processes; and its stderr
goes to a file, from which a crash's last line becomes the one-line reason in the table.

The common start. Each worker imports torch, loads the study, creates its CUDA context
(``--device cuda``), with ``--warmup`` (the default) trains one step of its first arm with compile
off (a process's first trial pays about 2 s of imports — torch._dynamo through the optimizer —
and library handles, once per study worker, not per trial), then prints "ready" and waits for a
"go" line on stdin. When every worker
is ready (or has died) the parent notes the time and writes "go" to all of them: the per-process
start-up a long-running study worker pays once is left out, while everything a study pays per
trial — building the model, loading the data, compiling, training, evaluating, writing the
checkpoint, all while the other workers do the same — counts. The setting ends when the last
worker reports that it is done (its process teardown is not counted). Each worker gets
``--threads`` CPU threads (default: the CPUs / N, at least 1), as a study's workers would
share the machine's cores.

How to read it. Pick the setting with the highest trials/min whose status is "ok"; going from
N to 2N is worth it only while the speed-up keeps growing clearly (the median trial s says
how much slower each trial gets). A failed worker (say, CUDA out of memory at N = 8) marks the
setting "failed" with the worker's one-line reason; its finished trials still count, but the
setting is not a candidate. So that an N too large for the GPU's memory costs no setting, each N
after a clean CUDA setting is checked first (``fitting_workers``): if N workers, each holding the
highest peak a clean setting's worker reserved plus 0.75 GiB for its CUDA context, would pass 90 % of
the device's memory, the probe runs the most that fit instead (the table says "7 (for 8)" and why),
or skips N when that count was measured already. "incomplete" means ``--timeout-s`` ended it; its
numbers cover the trials finished by then. The probe's trials are untracked (no MLflow process per
trial), so a real study's trials/min is a little lower. With compile on, every setting gets its own empty
inductor/triton cache (under the out dir), so each setting pays the same cold compilation per
worker and the settings compare with each other; a long study with a warm cache pays less.

``--json`` holds every trial row and every setting's summary (see ``SCHEMA``), ``--markdown``
the table printed to stdout; both are rewritten after every setting, so a probe cut short
keeps the settings it finished.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import queue
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import IO, Any

from modbench.errors import ModbenchError, accepted

SCHEMA = "modbench.workers_probe/1"
PROG = "workers_probe"
MARK = "@@workers_probe "  # prefix of the worker's protocol lines on its stdout (anything else is ignored)
COMPILE_VALUES = ("off", "on")
DEVICES = ("cuda", "cpu")
REASON_CHARS = 160
MEMORY_SHARE = 0.9  # of the device's memory, what a setting's workers may be projected to hold together
CONTEXT_GIB = 0.75  # a CUDA process's memory outside its caching allocator (context, kernels): assumed
KILL_GRACE_S = 5.0
EXIT_WAIT_S = 30.0


# --- arguments ----------------------------------------------------------------------------------
class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse would print the usage and exit 2: keep it to one line
        raise ModbenchError(f"{message} (see '{PROG} --help')")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog=PROG, description="Trials/minute of a study for N workers sharing one device, "
                                       "with and without torch.compile.")
    p.add_argument("study", help="a study file or a shipped study's name (e.g. quick)")
    p.add_argument("--workers", default="1,2,4,8", help="comma-separated worker counts (default: 1,2,4,8)")
    p.add_argument("--compile", default="off,on", help="comma-separated torch.compile settings: off, on (default: off,on)")
    p.add_argument("--trials-per-worker", default="2", metavar="K", help="trials each worker trains (default: 2)")
    p.add_argument("--device", default="cuda", help=f"{' or '.join(DEVICES)} (default: cuda)")
    p.add_argument("--budget", default=None, help="replaces every arm's budget, e.g. steps=200 (default: the study's)")
    p.add_argument("--arms", default=None, help="only these of the study's arms, by label, separated by ';' (default: "
                   "all; one arm makes every N train the same mix)")
    p.add_argument("--warmup", default=True, action=argparse.BooleanOptionalAction,
                   help="before the common start, each worker trains one step of its first arm, compile off "
                        "(default: on)")
    p.add_argument("--threads", default="0", metavar="T", help="CPU threads per worker (default 0: CPUs / N, at least 1)")
    p.add_argument("--out-dir", default=None, help="where the trials write (default: a temporary folder, removed)")
    p.add_argument("--json", default=None, metavar="PATH", help="write every trial and setting here")
    p.add_argument("--markdown", default=None, metavar="PATH", help="write the table here")
    p.add_argument("--timeout-s", default="900", metavar="S", help="limit of each setting in seconds (default: 900)")
    return p


@dataclass(frozen=True)
class ProbeArgs:
    study: str
    workers: tuple[int, ...]
    compile: tuple[str, ...]
    trials_per_worker: int
    device: str
    budget: str | None
    arms: tuple[str, ...]
    threads: int
    warmup: bool
    out_dir: Path | None
    json: Path | None
    markdown: Path | None
    timeout_s: float


def parse_args(argv: Sequence[str]) -> ProbeArgs:
    a = build_parser().parse_args(list(argv))
    return ProbeArgs(
        study=a.study,
        workers=worker_counts("--workers", a.workers),
        compile=_compile_list(a.compile),
        trials_per_worker=_positive_int("--trials-per-worker", a.trials_per_worker),
        device=_device(a.device),
        budget=_budget(a.budget),
        arms=tuple(x.strip() for x in a.arms.split(";") if x.strip()) if a.arms else (),
        threads=_non_negative_int("--threads", a.threads),
        warmup=a.warmup,
        out_dir=Path(a.out_dir) if a.out_dir else None,
        json=Path(a.json) if a.json else None,
        markdown=Path(a.markdown) if a.markdown else None,
        timeout_s=_positive_float("--timeout-s", a.timeout_s),
    )


def worker_counts(flag: str, text: str) -> tuple[int, ...]:
    """A comma-separated list of worker counts, each given once, in the order given."""
    items = [s.strip() for s in str(text).split(",")]
    if not all(s.isdigit() and int(s) > 0 for s in items):
        raise ModbenchError(f"{flag} {text!r} is not accepted: expected a comma-separated list of positive "
                            "integers, such as 1,2,4,8")
    return tuple(dict.fromkeys(int(s) for s in items))


def _compile_list(text: str) -> tuple[str, ...]:
    items = [s.strip().lower() for s in str(text).split(",")]
    if not all(s in COMPILE_VALUES for s in items):
        raise ModbenchError(f"--compile {text!r} is not accepted: expected a comma-separated list of "
                            f"{accepted(COMPILE_VALUES)}, such as off,on")
    return tuple(dict.fromkeys(items))


def _positive_int(flag: str, text: str) -> int:
    if not str(text).strip().isdigit() or int(text) < 1:
        raise ModbenchError(f"{flag} {text!r} is not accepted: expected a positive integer")
    return int(text)


def _non_negative_int(flag: str, text: str) -> int:
    if not str(text).strip().isdigit():
        raise ModbenchError(f"{flag} {text!r} is not accepted: expected 0 (automatic) or a positive integer")
    return int(text)


def _positive_float(flag: str, text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise ModbenchError(f"{flag} {text!r} is not accepted: expected a positive number of seconds")
    return value


def _device(text: str) -> str:
    if text not in DEVICES:
        raise ModbenchError(f"--device {text!r} is not accepted: expected {accepted(DEVICES)}")
    return text


def _budget(text: str | None) -> str | None:
    if text is None:
        return None
    from modbench.config.budget import Budget

    try:
        return str(Budget.parse(text))
    except ModbenchError as e:
        raise ModbenchError(f"--budget: {e}") from None


# --- the study's trials -------------------------------------------------------------------------
@dataclass(frozen=True)
class ProbePlan:
    """What every setting runs: the study file, its arms (budget replaced) and their labels."""

    study_name: str
    study_file: str
    budget: str  # the override, or the study's [train] budget
    budget_override: bool
    arms: tuple[dict[str, Any], ...]  # Arm fields, so a worker rebuilds the very same arms
    labels: tuple[str, ...]


def make_plan(args: ProbeArgs) -> ProbePlan:
    from modbench.design.study_file import find_study, load_study
    from modbench.design.controls import study_arms

    path = find_study(args.study)
    study = load_study(path)
    arms = study_arms(study)
    if not arms:
        raise ModbenchError(f"study {study.name!r} has no arms to run")
    labels = tuple(study.label(a) for a in arms)  # the names the study itself gives them
    if args.arms:
        unknown = [x for x in args.arms if x not in labels]
        if unknown:
            raise ModbenchError(f"--arms: {unknown[0]!r} is not an arm of {study.name}: expected labels among "
                                + "; ".join(repr(x) for x in labels))
        arms, labels = zip(*[(a, lbl) for a, lbl in zip(arms, labels) if lbl in args.arms])
        arms, labels = list(arms), tuple(labels)
    if args.budget:
        arms = [replace(a, budget=args.budget) for a in arms]
    return ProbePlan(study.name, str(Path(path).resolve()), args.budget or study.base.train.budget,
                     bool(args.budget), tuple(a.to_dict() for a in arms), labels)


def check_device(device: str) -> None:
    """``--device cuda`` needs CUDA (``is_available`` creates no CUDA context in this process)."""
    import torch

    if device == "cuda" and not torch.cuda.is_available():
        raise ModbenchError("--device 'cuda' but no CUDA device is available: expected 'cuda' on a GPU machine, or 'cpu'")


def threads_for(args: ProbeArgs, n: int) -> int:
    return args.threads or thread_share(n)


def thread_share(workers: int) -> int:
    """One of ``workers`` processes' share of the CPUs this process may use (at least 1): the torch
    threads each worker of a study gets, as N processes that each took every core would contend."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cpus // workers)


# --- one worker (a subprocess) ------------------------------------------------------------------
def _emit(event: str, **data: Any) -> None:
    print(MARK + json.dumps({"event": event, **data}), flush=True)


def one_line(text: object) -> str:
    """The first non-empty line of ``text``, without '|' (a table cell), at most REASON_CHARS long."""
    lines = [s.strip() for s in str(text).splitlines() if s.strip()]
    line = (lines[0] if lines else "").replace("|", "/")
    return line if len(line) <= REASON_CHARS else line[: REASON_CHARS - 1] + "…"


def exception_reason(e: BaseException) -> str:
    return one_line(f"{type(e).__name__}: {e}" if str(e).strip() else type(e).__name__)


def worker_main(spec_path: str) -> int:
    """Run one worker: ready → wait for "go" → K trials → done. Never prints a traceback."""
    try:
        spec = json.loads(Path(spec_path).read_text())
        ctx = _worker_setup(spec)
        _emit("ready", **ctx["info"])
        if sys.stdin.readline().strip() != "go":
            return 0  # the parent gave up (timeout, interrupt) before the start
        ok = all(_worker_trial(spec, ctx, k) for k in range(spec["trials_per_worker"]))
        _emit("done", ok=ok)
        return 0 if ok else 1
    except BaseException as e:  # noqa: BLE001 - a worker reports every failure as one line
        _emit("error", reason=exception_reason(e))
        return 1


def _worker_setup(spec: dict[str, Any]) -> dict[str, Any]:
    import torch

    torch.set_num_threads(spec["threads"])
    from modbench.design.arm import Arm
    from modbench.design.study_file import load_study
    from modbench.run.train import train

    study = load_study(spec["study_file"])
    arms = [Arm(**a) for a in spec["arms"]]
    info: dict[str, Any] = {"torch_version": torch.__version__, "device_name": "cpu", "cuda_version": None}
    if spec["device"] == "cuda":
        torch.cuda.init()
        torch.zeros(1, device="cuda")  # the CUDA context, before the common start
        torch.cuda.synchronize()
        info.update(device_name=torch.cuda.get_device_name(0), cuda_version=torch.version.cuda,
                    device_memory_gib=round(torch.cuda.get_device_properties(0).total_memory / 2**30, 2))
    if spec["warmup"]:
        _warmup(spec, study, arms[spec["worker"] % len(arms)], train)
    return {"torch": torch, "study": study, "arms": arms, "train": train, "info": info}


def _warmup(spec: dict[str, Any], study: Any, arm: Any, train: Any) -> None:
    """One step of an arm, compile off: the imports a process's first trial pays (torch._dynamo through the
    optimizer, the evaluation's and checkpoint's modules, cuBLAS handles) fall before the common start."""
    cfg = study.run_config(replace(arm, budget="steps=1"), 0, out_dir=str(Path(spec["out_dir"]) / "warmup"),
                           run_name="warmup", track=False, device=spec["device"], compile=False)
    train(cfg, progress=False)


def _worker_trial(spec: dict[str, Any], ctx: dict[str, Any], k: int) -> bool:
    """Train trial k of this worker; emit its row; False when it failed (the worker then stops)."""
    torch, w = ctx["torch"], spec["worker"]
    index = (w + k) % len(ctx["arms"])
    arm = ctx["arms"][index]
    row: dict[str, Any] = {"worker": w, "trial": k, "arm": index, "label": spec["labels"][index],
                           "budget": arm.budget, "compile": spec["compile"]}
    cuda = spec["device"] == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    try:
        cfg = ctx["study"].run_config(arm, 0, out_dir=spec["out_dir"], run_name=f"w{w}-t{k}-arm{index}", track=False,
                                      device=spec["device"], compile=spec["compile"] == "on")
        result = ctx["train"](cfg, progress=False)
        if cuda:
            torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001 - CUDA out of memory, a diverged run, anything: one line
        _emit("trial", **row, status="failed", reason=exception_reason(e), seconds=time.perf_counter() - start,
              tokens_per_s=0.0, steps=0, tokens=0, flops=0.0, peak_mem_gib=_peak_gib(torch, cuda))
        return False
    _emit("trial", **row, status="ok", reason="", seconds=time.perf_counter() - start,
          tokens_per_s=float(result.tokens_per_s), steps=int(result.steps), tokens=int(result.tokens),
          flops=float(result.flops), peak_mem_gib=_peak_gib(torch, cuda))
    return True


def _peak_gib(torch: Any, cuda: bool) -> float | None:
    return round(torch.cuda.max_memory_reserved() / 2**30, 3) if cuda else None


# --- one setting (the parent) -------------------------------------------------------------------
@dataclass
class _Worker:
    index: int
    proc: subprocess.Popen
    stderr_path: Path
    ready: bool = False
    finished_at: float | None = None  # perf_counter of its "done"/"error" line, or of its stdout's end
    error: str = ""
    info: dict[str, Any] = field(default_factory=dict)
    reader: threading.Thread | None = None


@dataclass
class SettingResult:
    compile: str
    workers: int
    threads: int
    trials_expected: int
    rows: list[dict[str, Any]]
    wall_s: float
    status: str  # ok | failed | incomplete
    reasons: list[str]
    info: dict[str, Any]
    asked: dict[str, Any] | None = None  # the count asked for, when memory made it fewer (``fitting_workers``)


def run_setting(args: ProbeArgs, plan: ProbePlan, compile_: str, n: int, out_root: Path) -> SettingResult:
    """Start n workers, release them together, collect their trial rows; end them at the deadline."""
    setting_dir = out_root / f"compile-{compile_}-n{n}"
    setting_dir.mkdir(parents=True, exist_ok=True)
    threads = threads_for(args, n)
    events: queue.Queue = queue.Queue()
    deadline = time.perf_counter() + args.timeout_s
    workers: list[_Worker] = []
    try:
        for w in range(n):
            workers.append(_start_worker(args, plan, compile_, n, w, threads, setting_dir, events))
        go, timed_out, rows = _drive(workers, events, deadline)
    finally:
        _stop(workers)
    end = deadline if timed_out else max((w.finished_at for w in workers if w.finished_at and go and w.finished_at > go),
                                         default=go)
    wall = max(0.0, end - go) if go else 0.0
    reasons = _reasons(workers, timed_out)
    status = "incomplete" if timed_out else ("failed" if reasons else "ok")
    info = next((w.info for w in workers if w.info), {})
    return SettingResult(compile_, n, threads, n * args.trials_per_worker, rows, wall, status, reasons, info)


def _start_worker(args: ProbeArgs, plan: ProbePlan, compile_: str, n: int, w: int, threads: int, setting_dir: Path,
                  events: queue.Queue) -> _Worker:
    spec = {"study_file": plan.study_file, "arms": plan.arms, "labels": plan.labels, "worker": w, "workers": n,
            "trials_per_worker": args.trials_per_worker, "device": args.device, "compile": compile_,
            "threads": threads, "warmup": args.warmup, "out_dir": str(setting_dir / f"w{w}")}
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1"}
    if compile_ == "on":  # one cold cache per setting (see the module doc)
        env.update(TORCHINDUCTOR_CACHE_DIR=str(setting_dir / "inductor-cache"),
                   TRITON_CACHE_DIR=str(setting_dir / "triton-cache"))
    spec_path = setting_dir / f"worker-{w}.json"  # a file, not an argument: a big study's arms outgrow one
    spec_path.write_text(json.dumps(spec))
    stderr_path = setting_dir / f"worker-{w}.stderr"
    with open(stderr_path, "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "modbench.study.workers_probe", "--worker", str(spec_path)],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True, bufsize=1,
                                env=env, start_new_session=True)
    worker = _Worker(w, proc, stderr_path)
    worker.reader = threading.Thread(target=_pump, args=(w, proc.stdout, events), daemon=True)
    worker.reader.start()
    return worker


def _pump(w: int, stream: IO[str], events: queue.Queue) -> None:
    """Forward a worker's protocol lines (with their arrival time) to the parent; None at its end."""
    for line in stream:
        if line.startswith(MARK):
            try:
                events.put((w, time.perf_counter(), json.loads(line[len(MARK):])))
            except ValueError:
                continue
    events.put((w, time.perf_counter(), None))


def _drive(workers: list[_Worker], events: queue.Queue, deadline: float) -> tuple[float | None, bool, list[dict[str, Any]]]:
    """(the common start, whether the deadline ended the setting, the trial rows)."""
    rows: list[dict[str, Any]] = []
    waiting = lambda: [w for w in workers if not w.ready and w.finished_at is None]  # noqa: E731
    if not _consume(workers, events, deadline, rows, None, waiting):
        return None, True, rows
    go = time.perf_counter()
    for w in workers:
        if w.ready and w.finished_at is None:
            _send(w, "go\n")
    running = lambda: [w for w in workers if w.finished_at is None]  # noqa: E731
    return go, not _consume(workers, events, deadline, rows, go, running), rows


def _consume(workers: list[_Worker], events: queue.Queue, deadline: float, rows: list[dict[str, Any]],
             go: float | None, pending) -> bool:
    """Handle the workers' lines until ``pending()`` is empty; False when the deadline came first."""
    while pending():
        try:
            w, at, msg = events.get(timeout=max(0.0, deadline - time.perf_counter()))
        except queue.Empty:
            return False
        _handle(workers[w], at, msg, rows, go)
    return True


def _handle(worker: _Worker, at: float, msg: dict[str, Any] | None, rows: list[dict[str, Any]], go: float | None) -> None:
    if msg is None or msg.get("event") in ("done", "error"):
        if worker.finished_at is None:
            worker.finished_at = at
        if msg is not None and msg.get("event") == "error":
            worker.error = one_line(msg.get("reason", "")) or "failed"
        return
    if msg.get("event") == "ready":
        worker.ready = True
        worker.info = {k: v for k, v in msg.items() if k != "event"}
    elif msg.get("event") == "trial":
        row = {k: v for k, v in msg.items() if k != "event"}
        row["finished_at_s"] = round(at - go, 3) if go is not None else None
        rows.append(row)
        if row.get("status") == "failed":
            worker.error = one_line(row.get("reason", "")) or "failed"  # the worker stops after it


def _send(worker: _Worker, text: str) -> None:
    try:
        worker.proc.stdin.write(text)
        worker.proc.stdin.flush()
    except (BrokenPipeError, OSError, ValueError):
        pass  # it died meanwhile: its end of stdout tells


def _stop(workers: list[_Worker]) -> None:
    """Close every worker's stdin, let finished ones exit, end the rest with their process group."""
    for w in workers:
        try:
            w.proc.stdin.close()
        except (BrokenPipeError, OSError, ValueError):
            pass
    for w in workers:
        if w.finished_at is not None and w.proc.poll() is None:
            _wait(w.proc, EXIT_WAIT_S)
        if w.proc.poll() is None:
            _signal_group(w.proc, signal.SIGTERM)
            if not _wait(w.proc, KILL_GRACE_S):
                _signal_group(w.proc, signal.SIGKILL)
                w.proc.wait()
        _signal_group(w.proc, signal.SIGKILL)  # helpers it left behind (torch.compile's workers)
        if w.reader is not None:
            w.reader.join(timeout=5)


def _wait(proc: subprocess.Popen, seconds: float) -> bool:
    try:
        proc.wait(timeout=seconds)
        return True
    except subprocess.TimeoutExpired:
        return False


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _reasons(workers: list[_Worker], timed_out: bool) -> list[str]:
    """One line per failed worker: its own reason, else its stderr's last line, else its exit code."""
    out = []
    for w in workers:
        if w.error:
            out.append(f"worker {w.index}: {w.error}")
        elif not (timed_out and w.finished_at is None) and w.proc.returncode not in (0, None):
            out.append(f"worker {w.index}: {_stderr_reason(w)}")
    return out


def _stderr_reason(w: _Worker) -> str:
    try:
        lines = [s for s in w.stderr_path.read_text(errors="replace").splitlines() if s.strip()]
    except OSError:
        lines = []
    code = w.proc.returncode
    exit_text = f"killed by signal {-code}" if code is not None and code < 0 else f"exit code {code}"
    return f"{one_line(lines[-1])} ({exit_text})" if lines else exit_text


# --- summaries and output -----------------------------------------------------------------------
def summarize(s: SettingResult, timeout_s: float) -> dict[str, Any]:
    ok = [r for r in s.rows if r["status"] == "ok"]
    minutes = s.wall_s / 60
    reasons = list(s.reasons)
    if s.status == "incomplete":
        reasons.insert(0, f"timeout: ended after {timeout_s:g} s")
    peaks = [r["peak_mem_gib"] for r in s.rows if r.get("peak_mem_gib") is not None]
    return {
        "compile": s.compile, "workers": s.workers, "threads_per_worker": s.threads,
        "trials": len(ok), "trials_expected": s.trials_expected,
        "failed_trials": sum(r["status"] == "failed" for r in s.rows),
        "wall_s": round(s.wall_s, 3),
        "trials_per_min": round(len(ok) / minutes, 4) if minutes > 0 else 0.0,
        "tokens_per_s": round(sum(r["tokens"] for r in ok) / s.wall_s, 1) if s.wall_s > 0 else 0.0,
        "median_trial_s": round(statistics.median(r["seconds"] for r in ok), 3) if ok else None,
        "speedup": None,
        "peak_mem_gib": max(peaks) if peaks else None,
        "status": s.status, "reasons": reasons, "asked": s.asked,
    }


def add_speedups(summaries: list[dict[str, Any]]) -> None:
    """speed-up = trials/min ÷ trials/min of N = 1 with the same compile setting (None without one)."""
    base = {s["compile"]: s["trials_per_min"] for s in summaries if s["workers"] == 1 and s["trials_per_min"] > 0}
    for s in summaries:
        b = base.get(s["compile"])
        s["speedup"] = round(s["trials_per_min"] / b, 3) if b else None


def best_setting(summaries: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The setting with the highest trials/min among the "ok" ones (any, when none is ok)."""
    pool = [s for s in summaries if s["status"] == "ok" and s["trials"]] or [s for s in summaries if s["trials"]]
    return max(pool, key=lambda s: s["trials_per_min"], default=None)


def markdown(summaries: list[dict[str, Any]], plan: ProbePlan, args: ProbeArgs, device_name: str | None) -> str:
    head = ["compile", "N", "trials", "wall s", "trials/min", "aggregate tokens/s", "median trial s", "speed-up",
            "peak GiB a worker", "status"]
    lines = [f"Workers probe: study {plan.study_name}, budget {plan.budget}, {args.trials_per_worker} trial(s) per worker, "
             f"device {device_name or args.device}.", "",
             "| " + " | ".join(head) + " |", "|" + "|".join("---" if i in (0, len(head) - 1) else "---:" for i in range(len(head))) + "|"]
    for s in summaries:
        cells = [s["compile"], str(s["workers"]) + (f" (for {s['asked']['workers']})" if s.get("asked") else ""),
                 f"{s['trials']}/{s['trials_expected']}", f"{s['wall_s']:.1f}",
                 f"{s['trials_per_min']:.2f}", f"{s['tokens_per_s']:,.0f}",
                 "–" if s["median_trial_s"] is None else f"{s['median_trial_s']:.2f}",
                 "–" if s["speedup"] is None else f"{s['speedup']:.2f}×",
                 "–" if s["peak_mem_gib"] is None else f"{s['peak_mem_gib']:.1f}", _status_cell(s)]
        lines.append("| " + " | ".join(cells) + " |")
    lines += [f"\nN = {s['workers']} for {s['asked']['workers']}: {s['asked']['why']} (peak reserved memory of the "
              f"settings before, plus {CONTEXT_GIB:g} GiB a process for its CUDA context)." for s in summaries if s.get("asked")]
    best = best_setting(summaries)
    lines += ["", f"Highest trials/minute: compile {best['compile']}, N = {best['workers']} "
                  f"({best['trials_per_min']:.2f} trials/min, status {best['status']})." if best
              else "Highest trials/minute: none (no setting finished a trial)."]
    return "\n".join(lines) + "\n"


def _status_cell(s: dict[str, Any]) -> str:
    if s["status"] == "ok":
        return "ok"
    return f"{s['status']}: " + "; ".join(s["reasons"][:2]) + (f" (+{len(s['reasons']) - 2} more)" if len(s["reasons"]) > 2 else "")


def report(args: ProbeArgs, plan: ProbePlan, results: list[SettingResult], started: str) -> tuple[dict[str, Any], str]:
    summaries = [summarize(r, args.timeout_s) for r in results]
    add_speedups(summaries)
    info = next((r.info for r in results if r.info), {})
    import torch

    device_name = info.get("device_name") or (args.device if args.device == "cpu" else None)
    data = {
        "schema": SCHEMA, "started_at": started, "study": plan.study_name, "study_file": plan.study_file,
        "budget": plan.budget, "budget_override": plan.budget_override, "arms": list(plan.labels),
        "device": args.device, "device_name": device_name, "cuda_version": info.get("cuda_version"),
        "device_memory_gib": info.get("device_memory_gib"),
        "torch_version": info.get("torch_version", torch.__version__),
        "python_version": platform.python_version(), "platform": platform.platform(),
        "trials_per_worker": args.trials_per_worker, "workers": list(args.workers), "compile": list(args.compile),
        "timeout_s": args.timeout_s, "warmup": args.warmup,
        "settings": summaries,
        "trials": [{"compile": r.compile, "workers": r.workers, **row} for r in results for row in r.rows],
        "best": _best_ref(best_setting(summaries)),
    }
    return data, markdown(summaries, plan, args, device_name)


def _best_ref(best: dict[str, Any] | None) -> dict[str, Any] | None:
    return None if best is None else {k: best[k] for k in ("compile", "workers", "trials_per_min", "status")}


def write_outputs(args: ProbeArgs, data: dict[str, Any], table: str) -> None:
    for path, text in ((args.json, json.dumps(data, indent=2) + "\n"), (args.markdown, table)):
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)


# --- the command --------------------------------------------------------------------------------
def probe(args: ProbeArgs) -> tuple[dict[str, Any], str]:
    """Run every setting (compile × N, in the order given); returns the JSON data and the markdown table."""
    plan = make_plan(args)
    check_device(args.device)
    started = datetime.now(timezone.utc).isoformat(timespec="seconds")
    out_root = args.out_dir or Path(tempfile.mkdtemp(prefix="workers_probe-"))
    results: list[SettingResult] = []
    data: dict[str, Any] = {}
    table = ""
    try:
        for compile_ in args.compile:
            for asked in args.workers:
                done = [r for r in results if r.compile == compile_]
                n, why = fitting_workers(asked, done)
                if n in {r.workers for r in done}:
                    _log(f"compile {compile_}, N = {asked}: skipped ({why}; N = {n} was measured)")
                    continue
                results.append(run_setting(args, plan, compile_, n, out_root))
                if n != asked:
                    results[-1].asked = {"workers": asked, "why": why}
                data, table = report(args, plan, results, started)
                write_outputs(args, data, table)  # after every setting: a probe cut short keeps what it measured
                _log(f"compile {compile_}, N = {n}{f' (for {asked}: {why})' if n != asked else ''}: "
                     f"{data['settings'][-1]['trials_per_min']:.2f} trials/min ({data['settings'][-1]['status']})")
    finally:
        if args.out_dir is None:
            shutil.rmtree(out_root, ignore_errors=True)
    return data, table


def fitting_workers(asked: int, done: list[SettingResult]) -> tuple[int, str]:
    """(``asked``, "") or, where its workers would not fit in the device's memory, (the most that
    would, why). A worker is projected to hold the highest peak any clean setting's workers reserved
    (the same arm, so the same shapes) plus ``CONTEXT_GIB``; a setting's workers together at most
    ``MEMORY_SHARE`` of the device. Without a clean CUDA setting measured yet, ``asked`` is run as it is:
    an out-of-memory then fails that setting, at the cost of its time."""
    peaks = [row["peak_mem_gib"] for r in done if r.status == "ok" for row in r.rows if row.get("peak_mem_gib")]
    device_gib = next((r.info["device_memory_gib"] for r in done if r.info.get("device_memory_gib")), None)
    if not peaks or not device_gib:
        return asked, ""
    per_worker = max(peaks) + CONTEXT_GIB
    fits = max(1, int(MEMORY_SHARE * device_gib // per_worker))
    if asked <= fits:
        return asked, ""
    return fits, (f"{asked} × {per_worker:.1f} GiB would exceed {MEMORY_SHARE:.0%} of the device's "
                  f"{device_gib:.1f} GiB")


def _log(text: str) -> None:
    print(f"{PROG}: {text}", file=sys.stderr, flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--worker"] and len(argv) == 2:
        return worker_main(argv[1])
    try:
        args = parse_args(argv)
        print(probe(args)[1], end="")
        return 0
    except ModbenchError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
