"""One training run: FLOP-budgeted, evaluated on fixed windows, tracked in MLflow.

``train(cfg)`` builds the model from ``RunConfig``, resolves the budget to steps with this
model's analytic FLOPs (iso-FLOP: a cheaper MoD model trains more steps), and runs AdamW with
warm-up + cosine decay and gradient clipping. Router parameters sit in their own group
without weight decay. Seeds fix data order, initialisation and routing; CPU reruns give the
same losses bit for bit, and ``resume=True`` continues from the last checkpoint exactly.

Under ``torchrun`` (``modbench.run.distributed``) one run trains data-parallel: ``batch_size`` is
the global batch, every process draws it from the same seeded stream and trains on its own
contiguous slice, DDP averages the gradients, so each update is the single-process update on
the global batch and the budget resolves to the same number of steps. Rank 0 alone tracks,
evaluates, prints and writes checkpoints.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from modbench import interrupts
from modbench.run import distributed, step_metrics
from modbench.run.heatmap import log_routing_heatmap
from modbench.run.step_metrics import Window, cumulative_flops, mean_logged
from modbench.config.budget import Budget
from modbench.track.checkpoint import check_writable, load_checkpoint, save_checkpoint
from modbench.data import Corpus, dataset_origin, eval_windows, eval_windows_with_labels, get_batch, load_corpus
from modbench.errors import ModbenchError
from modbench.run.evaluate import evaluate, evaluate_causal
from modbench.run.causal_eval import calibrate_causal_rules
from modbench.model.gpt import GPT, RoutedBlock, compile_settings
from modbench.config.patterns import pattern_string
from modbench.config.run import RunConfig
from modbench.results import RunRecord, declared
from modbench.track.records import CHECKPOINT_ARTIFACT_DIR, CHECKPOINT_TAG
from modbench.track.tracking import RunTracker

CALIBRATION_BATCHES = 8  # training batches of the final causal-rule calibration (forward only)
# A periodic evaluation calibrates on the first batches of the same stream: a quarter of the
# forwards, so the causal metric at every evaluation costs about 1 % of a quick trial, not 4 %.
PERIODIC_CALIBRATION_BATCHES = 2
CALIBRATION_SEED_OFFSET = 7919  # its own data stream: training's data order is untouched
# Every periodic evaluation also scores the decode-time causal rule (val/causal_bpb, the deployable
# number), so its curve can be compared across arms, not only its final point.
PERIODIC_CAUSAL = True


class TrainingDiverged(ModbenchError):
    """The loss became NaN or infinite."""


@dataclass
class TrainResult:
    run_id: str | None
    steps: int
    tokens: int
    flops: float
    flops_per_token: float
    val: dict[str, float]
    test: dict[str, float]
    tokens_per_s: float
    logging_overhead: float
    history: list[dict[str, float]] = field(default_factory=list)
    checkpoint: Path | None = None
    record: RunRecord | None = None  # the one results record (modbench.results)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ModbenchError("train.device is 'cuda' but no CUDA device is available: use 'cpu' or 'auto'")
    return torch.device(name)


def build_optimizer(model: GPT, cfg: RunConfig) -> torch.optim.AdamW:
    t = cfg.train
    lr, wd = cfg.effective_lr(), cfg.effective_weight_decay()  # what --print-config says it trains with
    decay, no_decay, router = [], [], []
    router_ids = {id(p) for p in model.router_parameters()}  # by identity: see GPT.router_parameters
    for p in model.parameters():
        if id(p) in router_ids:
            router.append(p)
        elif p.dim() >= 2:
            decay.append(p)
        else:
            no_decay.append(p)
    groups = [
        {"params": decay, "weight_decay": wd, "name": "decay"},
        {"params": no_decay, "weight_decay": 0.0, "name": "no_decay"},
        {"params": router, "weight_decay": 0.0, "name": "router"},
    ]
    groups = [g for g in groups if g["params"]]
    return torch.optim.AdamW(groups, lr=lr, betas=(t.beta1, t.beta2), fused=False)


def lr_at(progress: float, base_lr: float, cfg: RunConfig) -> float:
    """Linear warm-up then cosine decay to min_lr_ratio · base_lr; progress ∈ [0, 1]."""
    t = cfg.train
    if t.warmup_frac > 0 and progress < t.warmup_frac:
        return base_lr * (progress / t.warmup_frac)
    span = max(1e-12, 1.0 - t.warmup_frac)
    cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, (progress - t.warmup_frac) / span)))
    return base_lr * (t.min_lr_ratio + (1 - t.min_lr_ratio) * cosine)


def default_run_name(cfg: RunConfig) -> str:
    """``--run-name``, else the arm and seed plus a hash of the whole config: a rerun with
    another budget or lr gets its own folder (and checkpoint); the same config resumes its own."""
    if cfg.train.run_name:
        return cfg.train.run_name
    r = cfg.routing
    digest = hashlib.sha256(json.dumps(cfg.to_toml_dict(), sort_keys=True).encode()).hexdigest()[:8]
    name = f"{r.variant}_C{r.capacity:g}_{r.schedule}_{r.pattern}_d{cfg.model.depth}_s{cfg.train.seed}_{digest}"
    return name.replace(":", "-").replace(",", "-")


def train(
    cfg: RunConfig,
    *,
    tracker: Any = None,
    tracking_uri: str | None = None,
    resume: bool = False,
    progress: bool = True,
    on_eval: Callable[[int, dict[str, float]], None] | None = None,
) -> TrainResult:
    """Train one run; under torchrun, data-parallel over its processes (see the module doc).

    Every rank returns rank 0's result. ``tracker``, ``progress`` and ``on_eval`` only
    act on rank 0. With no ``tracker`` and ``train.track`` on, the run is logged to
    ``tracking_uri`` (default: ``resolve_tracking_uri()``, what a CLI command resolves once).
    """
    device = resolve_device(cfg.train.device)
    distributed.check_batch_size(cfg.train.batch_size)  # before any process waits for another
    with distributed.process_group(device) as device, _compiling(cfg.train.compile, device):
        return _train(cfg, device, tracker=tracker, tracking_uri=tracking_uri, resume=resume, progress=progress,
                      on_eval=on_eval)


@contextmanager
def _compiling(on: bool, device: torch.device):
    """What a compiled run (``on``) trains under, restored after: the model's ``compile_settings`` (one graph
    for every variant) and, on the CPU, deterministic algorithms."""
    if not on:
        yield
        return
    with compile_settings(), _deterministic_compile(device.type == "cpu"):
        yield


@contextmanager
def _deterministic_compile(on: bool):
    """Deterministic algorithms for the run, when ``on`` (a compiled run on the CPU), as they were after.

    Inductor's CPU kernels are not deterministic by default (its parallel backward accumulates in an
    order that varies): two compiled runs of one seed differed after 80 steps (val bpb 3.70958 against
    3.70973), where eager reruns match bit for bit. Under ``torch.use_deterministic_algorithms`` its
    kernels are, and the reruns match again (tests/test_train.py). Not on CUDA: there the flag also
    makes cuBLAS refuse to run without a workspace setting, and modbench promises bitwise reruns on the CPU.
    """
    if not on:
        yield
        return
    before = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])


@dataclass
class _Run:
    """The state every phase of one run shares (built by ``_setup``)."""

    cfg: RunConfig
    device: torch.device
    main: bool
    corpus: Corpus
    model: GPT
    step_model: torch.nn.Module  # DDP-wrapped under torchrun, else the model
    fwd_model: Callable  # compiled when train.compile
    optimizer: torch.optim.Optimizer
    base_lrs: list[float]
    autocast: torch.autocast | None
    tokens_per_step: int
    flops_per_token: float
    budget: Budget
    total_steps: int | None
    data_gen: torch.Generator
    val: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]
    routed_ids: list[int]
    run_dir: Path
    ckpt_path: Path
    tracker: RunTracker | None = None
    step: int = 0
    start_step: int = 0
    elapsed_before: float = 0.0
    history: list[dict[str, float]] = field(default_factory=list)
    run_id: str | None = None
    run_start: float = 0.0
    train_seconds: float = 0.0  # wall time in training steps, excluding evaluation
    window_steps: int = 0
    window_start: float = 0.0
    lm_acc: torch.Tensor | None = None
    aux_acc: dict[str, torch.Tensor] = field(default_factory=dict)
    route_stats: list[dict[str, torch.Tensor]] = field(default_factory=list)
    grad_norm: torch.Tensor | None = None
    logged_step: int = -1  # the step of the keys in ``logged_keys`` (``_log_once``)
    logged_keys: set[str] = field(default_factory=set)


# --- the phases -----------------------------------------------------------------------------
def _train(cfg: RunConfig, device: torch.device, *, tracker: RunTracker | None, tracking_uri: str | None, resume: bool,
           progress: bool, on_eval: Callable[[int, dict[str, float]], None] | None) -> TrainResult:
    run = _setup(cfg, device)
    if resume:
        _restore(run)
    run.tracker, owns_tracker = _open_tracker(run, tracker, tracking_uri)
    with run.tracker if owns_tracker else nullcontext(run.tracker):
        if run.start_step == 0:
            _log_start(run)
        bar = _progress(progress and run.main, run.total_steps, run.start_step, run.run_dir.name)
        run.window_start = time.perf_counter()
        run.run_start = time.perf_counter() - run.elapsed_before
        try:
            while (frac := _progress_fraction(run)) is not None:
                interrupts.check()  # Ctrl-C/SIGTERM stop here, between two steps (modbench.interrupts)
                log_now = _train_step(run, frac)
                if log_now:
                    bar.set_postfix(**_log_step(run))
                _checkpoint_phase(run)
                _evaluate_phase(run, on_eval)
                bar.update(1)
        finally:  # now, not when the bar is collected: its last line would come after the error line
            bar.close()
        if not run.main:
            return distributed.broadcast_object(None)  # rank 0's result, once it has finished
        result = _finish(run)
    return distributed.broadcast_object(result)


def _setup(cfg: RunConfig, device: torch.device) -> _Run:
    """Seed, data, model, optimizer, budget: everything before the first step."""
    t = cfg.train
    torch.manual_seed(t.seed)
    corpus = load_corpus(t.dataset, seed=t.seed)
    model = GPT(cfg.model, cfg.routing).to(device)
    step_model = distributed.wrap_model(model, device)  # `model` stays the plain GPT: its methods, eval, saving
    optimizer = build_optimizer(model, cfg)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    tokens_per_step = t.batch_size * t.seq_len * t.grad_accum
    flops_per_token = model.flops_per_token(t.seq_len)
    budget = Budget.parse(t.budget)
    run_dir = Path(t.out_dir) / default_run_name(cfg)
    total_steps = _budget_steps(model, budget, t.seq_len, tokens_per_step)  # a budget under one step fails here
    if distributed.is_main():
        check_writable(Path(t.out_dir), "--out-dir")  # now, not after the whole run has trained (and nothing earlier)
    return _Run(
        cfg=cfg, device=device, main=distributed.is_main(), corpus=corpus, model=model, step_model=step_model,
        fwd_model=torch.compile(step_model) if t.compile else step_model, optimizer=optimizer,
        base_lrs=[g["lr"] for g in optimizer.param_groups],
        autocast=torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else None,
        tokens_per_step=tokens_per_step, flops_per_token=flops_per_token, budget=budget,
        total_steps=total_steps,
        data_gen=torch.Generator().manual_seed(t.seed), val=_eval_set(corpus, "val", t),
        routed_ids=[i for i, layer in enumerate(model.layers) if isinstance(layer, RoutedBlock)],
        run_dir=run_dir, ckpt_path=run_dir / "checkpoint.pt", lm_acc=torch.zeros((), device=device),
    )


def _budget_steps(model: GPT, budget: Budget, seq_len: int, tokens_per_step: int) -> int | None:
    """Optimizer steps the budget allows. A FLOP budget with a capacity warm-up counts each step
    at its own capacity: the largest n whose cumulative FLOPs fit (the warm-up only costs more)."""
    flops_per_step = model.flops_per_token(seq_len) * tokens_per_step
    steps = budget.steps(tokens_per_step, flops_per_step)
    if budget.kind != "flops" or not model.routing.capacity_warmup_steps:
        return steps
    low, high = 0, steps  # cost(high) >= budget's steady-state count: search down
    while low < high:
        mid = (low + high + 1) // 2
        if model.training_flops_per_token(seq_len, mid) * tokens_per_step <= budget.amount * (1 + 1e-12):
            low = mid
        else:
            high = mid - 1
    if low < 1:
        raise ModbenchError(f"budget {budget} is smaller than one training step with the capacity warm-up: raise it")
    return low


def _restore(run: _Run) -> None:
    """Continue from the run's checkpoint exactly: weights, optimizer, data and RNG states."""
    state = load_checkpoint(run.ckpt_path)
    if state["config"] != run.cfg.to_toml_dict():
        raise ModbenchError(f"checkpoint {run.ckpt_path} was written by a different config: resume with the same flags")
    run.model.load_state_dict(state["model"])
    run.optimizer.load_state_dict(state["optimizer"])
    run.data_gen.set_state(state["data_rng"])
    torch.set_rng_state(state["torch_rng"])
    run.start_step, run.elapsed_before, run.history, run.run_id = state["step"], state["elapsed"], state["history"], state["run_id"]
    run.step = run.start_step
    if run.start_step >= (run.total_steps or math.inf):
        raise ModbenchError(f"run {run.run_dir.name} already finished its {run.total_steps} steps: nothing to resume")


def _open_tracker(run: _Run, tracker: RunTracker | None, tracking_uri: str | None) -> tuple[RunTracker, bool]:
    """(tracker, whether this run owns it): rank 0 tracks; a caller's tracker is the caller's."""
    from modbench.track.background import TrackerProcess
    from modbench.track.store import resolve_tracking_uri
    from modbench.track.tracking import NullTracker

    if not run.main:
        return NullTracker(), False  # one MLflow run per trial, written by rank 0
    if tracker is not None:
        return tracker, False
    t = run.cfg.train
    if not t.track:
        return NullTracker(), True
    uri = tracking_uri or resolve_tracking_uri()
    # The store is checked now; MLflow opens it and writes the run in a second process, so that
    # its imports and writes cost training nothing (modbench.track.background).
    return TrackerProcess(t.experiment, run_name=run.run_dir.name, run_id=run.run_id, uri=uri).start(), True


def _log_start(run: _Run) -> None:
    t = run.cfg.train
    resolved = {
        "budget.resolved_steps": run.total_steps if run.total_steps is not None else "time",
        "budget.tokens_per_step": run.tokens_per_step,
        "budget.flops_per_token": run.flops_per_token,
        "budget.total_flops": run.model.training_flops_per_token(run.cfg.train.seq_len, run.total_steps or 0) * run.tokens_per_step,
        "model.params": run.model.num_params(),
        "routing.resolved_pattern": pattern_string(run.model.routed_flags),
    }
    run.tracker.log_params({**run.cfg.to_dict(), **resolved})
    run.tracker.set_tags({"dataset_sha256": run.corpus.sha256, "device": _device_name(run.device), "dataset": t.dataset})
    run.tracker.log_dataset(run.corpus.name, run.corpus.sha256, dataset_origin(t.dataset), "training")
    run.tracker.monitor_system(t.system_metrics_s)
    run.tracker.log_dict(run.cfg.to_toml_dict(), "config.json")


def _progress_fraction(run: _Run) -> float | None:
    """Where the run is in its budget, in [0, 1), or None when the budget is spent."""
    elapsed = time.perf_counter() - run.run_start
    if run.total_steps is None:
        # A time budget must stop every rank at the same step and give each the same LR.
        elapsed = distributed.broadcast_float(elapsed)
        return None if elapsed >= run.budget.amount else elapsed / run.budget.amount
    return None if run.step >= run.total_steps else run.step / run.total_steps


def _clip_gradients(model: GPT, max_norm: float) -> torch.Tensor:
    """Clip the language model's gradient norm (returned, for logging); decode-time predictors
    (``GPT.predictor_parameters``) are clipped on their own, so a "+aux" arm trains the very LM of its
    base variant."""
    predictors = model.predictor_parameters()
    if predictors:
        torch.nn.utils.clip_grad_norm_(predictors, max_norm)
    own = {id(p) for p in predictors}
    return torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if id(p) not in own], max_norm)


def _train_step(run: _Run, frac: float) -> bool:
    """One optimizer step over grad_accum micro-batches; returns whether to log after it."""
    t = run.cfg.train
    for g, base in zip(run.optimizer.param_groups, run.base_lrs):
        g["lr"] = lr_at(frac, base, run.cfg)
    log_now = (run.step + 1) % t.log_every == 0 or (run.total_steps is not None and run.step + 1 == run.total_steps)
    run.model.set_step(run.step)  # the capacity warm-up, if any
    step_start = time.perf_counter()
    for micro in range(t.grad_accum):
        _micro_step(run, micro, collect_stats=log_now and micro == 0)
    run.model.set_collect_stats(False)
    run.grad_norm = _clip_gradients(run.model, t.grad_clip)
    run.optimizer.step()
    run.optimizer.zero_grad(set_to_none=True)
    run.step += 1
    run.window_steps += 1
    if run.device.type == "cuda" and log_now:
        torch.cuda.synchronize(run.device)
    run.train_seconds += time.perf_counter() - step_start
    return log_now


def _micro_step(run: _Run, micro: int, *, collect_stats: bool) -> None:
    t = run.cfg.train
    # Every rank draws the whole global batch (same generator, same state) and keeps its own
    # slice, so the data order is the single-process one at any world size.
    x, y = get_batch(run.corpus.train, t.batch_size, t.seq_len, run.data_gen)
    x, y = distributed.local_slice(x), distributed.local_slice(y)
    x, y = x.to(run.device, non_blocking=True), y.to(run.device, non_blocking=True)
    run.model.set_collect_stats(collect_stats)
    # A compiled forward is specialised on each routed layer's k. Through a capacity warm-up k changes
    # nearly every step: Dynamo would recompile until its limit, then run the whole rest of training
    # eagerly. So the warm-up runs eagerly, and the compiled forward (one graph from then on) after it.
    forward = run.fwd_model if run.step >= run.cfg.routing.capacity_warmup_steps else run.step_model
    with distributed.grad_sync(run.step_model, micro + 1 == t.grad_accum):
        with run.autocast or nullcontext():
            out = forward(x, y)
        aux = run.model.weighted_aux_loss(out.aux_losses, run.step)
        loss = out.loss if aux is None else out.loss + aux
        (loss / t.grad_accum).backward()
    run.lm_acc += out.loss.detach() / t.grad_accum
    for k, v in out.aux_losses.items():
        run.aux_acc[k] = run.aux_acc.get(k, 0.0) + v.detach() / t.grad_accum
    if out.stats:
        run.route_stats = out.stats


def _log_step(run: _Run) -> dict[str, str]:
    """Average the window, check for divergence, log every registered per-step metric."""
    lm_mean, aux_mean, stats = mean_logged(run.lm_acc, run.aux_acc, run.route_stats)
    loss = lm_mean.item() / run.window_steps
    if not math.isfinite(loss):
        raise TrainingDiverged(
            f"training loss became {loss} at step {run.step}: lower --lr (now {run.cfg.train.lr:g}) "
            f"or --capacity, or raise --grad-clip; the run is marked FAILED"
        )
    window = Window(run.window_steps, time.perf_counter() - run.window_start, loss,
                     {k: v.item() / run.window_steps for k, v in aux_mean.items()}, run.grad_norm.item(), stats)
    metrics: dict[str, float] = {}
    for fn in step_metrics.STEP_METRICS:
        metrics.update(fn(run, window))
    _log_once(run, metrics)
    run.history.append({"step": run.step, **metrics})
    run.lm_acc.zero_()
    run.aux_acc, run.route_stats = {}, []
    run.window_steps, run.window_start = 0, time.perf_counter()
    return {"loss": f"{loss:.4f}", "tok_s": f"{metrics['perf/tokens_per_s']:,.0f}"}


def _log_once(run: _Run, metrics: dict[str, float]) -> None:
    """Log ``metrics`` at the run's step, leaving out the keys already logged at this step.

    Why: an evaluation (and the final one) falls on a step the training log has already written,
    and both carry the chart axes (``perf/cum_flops``, ``perf/cum_tokens``, ``perf/flops_per_token``).
    MLflow keeps every copy, so a chart whose x-axis is ``perf/cum_flops`` got two points per
    evaluation step (vertical stair-steps, and grouped lines that end at the wrong value)."""
    if run.logged_step != run.step:
        run.logged_step, run.logged_keys = run.step, set()
    fresh = {k: v for k, v in metrics.items() if k not in run.logged_keys}
    run.logged_keys.update(fresh)
    if fresh:
        run.tracker.log_metrics(fresh, run.step)


def _checkpoint_phase(run: _Run) -> None:
    every = run.cfg.train.checkpoint_every
    if every and run.step % every == 0:
        distributed.average_buffers(run.model.routers)  # see distributed.wrap_model
        if run.main:
            _save(run)


def _evaluate_phase(run: _Run, on_eval: Callable[[int, dict[str, float]], None] | None) -> None:
    """Rank 0 evaluates the plain module on the whole eval set (single-process numbers); the
    others go on and wait for it at the next gradient all-reduce."""
    t = run.cfg.train
    if not run.main or run.step % t.eval_every or (run.total_steps is not None and run.step >= run.total_steps):
        return
    val_x, val_y, val_hard = run.val
    val = evaluate(run.model, val_x, val_y, batch_size=t.batch_size, device=run.device, autocast=run.autocast,
                   hard_labels=val_hard)
    if PERIODIC_CAUSAL:
        # Calibrated as the final evaluation calibrates (on fewer batches of the same stream), so
        # val/causal_bpb is one series to the last point; undone before training goes on.
        with _calibration_undone(run.model):
            _calibrate(run, PERIODIC_CALIBRATION_BATCHES)
            val.update(evaluate_causal(run.model, val_x, val_y, batch_size=t.batch_size, device=run.device,
                                       topk_bpb=val["bpb"], autocast=run.autocast))
    logged = {f"val/{k}": v for k, v in val.items()}
    logged.update({"perf/cum_flops": cumulative_flops(run),
                   "perf/cum_tokens": run.step * run.tokens_per_step})
    _log_once(run, logged)
    run.history.append({"step": run.step, **logged})
    if on_eval is not None:
        on_eval(run.step, val)
    run.window_start = time.perf_counter()


def _calibrate(run: _Run, n_batches: int = CALIBRATION_BATCHES) -> None:
    """Re-estimate the causal rules on the current weights (``calibrate_causal_rules``) from the
    first ``n_batches`` training batches of their own seeded stream, the same ones at every
    evaluation; training's data order is untouched."""
    if not run.model.routers:
        return
    t = run.cfg.train
    calib_gen = torch.Generator().manual_seed(t.seed + CALIBRATION_SEED_OFFSET)
    batches = [get_batch(run.corpus.train, t.batch_size, t.seq_len, calib_gen)[0] for _ in range(n_batches)]
    calibrate_causal_rules(run.model, batches, autocast=run.autocast)


@contextmanager
def _calibration_undone(model: GPT) -> Iterator[None]:
    """Restore every buffer of the model on exit. Calibration rewrites the routers' running
    statistics; training resumes from the ones its own forwards left (so a run's trajectory and
    checkpoints do not depend on how often it was evaluated). Learned weights are never touched."""
    saved = {name: buf.clone() for name, buf in model.named_buffers()}
    try:
        yield
    finally:
        with torch.no_grad():
            for name, value in saved.items():
                model.get_buffer(name).copy_(value)


def _finish(run: _Run) -> TrainResult:
    """Calibrate the causal rules, evaluate val (all routing modes) and test, log, save."""
    t = run.cfg.train
    run.model.set_step(1 << 62)  # evaluate (and save) the model at its final capacity, past any warm-up
    # The causal rules' running thresholds lag behind drifting scores: re-estimate them on the
    # final weights from training batches of their own stream (modbench.run.causal_eval), then the
    # final validation also scores the causal and dense routing modes (train/inference gap).
    _calibrate(run)
    val_x, val_y, val_hard = run.val
    val = evaluate(run.model, val_x, val_y, batch_size=t.batch_size, device=run.device, autocast=run.autocast,
                   hard_labels=val_hard, modes=True)
    test_x, test_y, test_hard = _eval_set(run.corpus, "test", t)
    test = evaluate(run.model, test_x, test_y, batch_size=t.batch_size, device=run.device, autocast=run.autocast,
                    hard_labels=test_hard, modes=True)
    tokens_done = run.step * run.tokens_per_step
    tokens_per_s = (run.step - run.start_step) * run.tokens_per_step / max(run.train_seconds, 1e-9)
    final = {**{f"val/{k}": v for k, v in val.items()}, **{f"test/{k}": v for k, v in test.items()},
             "perf/train_tokens_per_s": tokens_per_s,
             "perf/total_flops": cumulative_flops(run), "perf/flops_per_token": run.flops_per_token}
    _log_once(run, final)
    log_routing_heatmap(run.model, val_x, run.device, run.tracker, run.run_dir, run.routed_ids)
    _save(run)
    checkpoint = _publish_checkpoint(run)
    run.tracker.flush()
    # Measured last, after the artifacts are written and the queue drained, so the waits for
    # them count; only this one metric and the run's end come after it.
    wall = time.perf_counter() - run.run_start - run.elapsed_before
    overhead = run.tracker.seconds / max(wall, 1e-9)
    final["perf/logging_overhead"] = overhead
    _log_once(run, {"perf/logging_overhead": overhead})  # sent by the tracker's end
    record = RunRecord(run.tracker.run_id, "FINISHED", run.cfg.to_dict(), declared(final), run.step, tokens_done,
                       checkpoint)
    return TrainResult(record=record, 
        run_id=run.tracker.run_id, steps=run.step, tokens=tokens_done, flops=cumulative_flops(run),
        flops_per_token=run.flops_per_token, val=val, test=test, tokens_per_s=tokens_per_s, logging_overhead=overhead,
        history=run.history, checkpoint=run.ckpt_path,
    )


def _eval_set(corpus: Corpus, split: str, t) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    if corpus.labels is not None:
        x, y, _, hard_y = eval_windows_with_labels(corpus, split, t.seq_len, t.eval_windows)
        return x, y, hard_y
    x, y = eval_windows(corpus.split(split), t.seq_len, t.eval_windows)
    return x, y, None


def _publish_checkpoint(run: _Run) -> str:
    """Where the record says the checkpoint is: the run's MLflow artifact (so `report` and
    `generate` find it from any machine with the tracking server), or the local file untracked."""
    if run.tracker.run_id is None:
        return str(run.ckpt_path.resolve())
    run.tracker.log_artifact(run.ckpt_path, CHECKPOINT_ARTIFACT_DIR)
    artifact = f"{CHECKPOINT_ARTIFACT_DIR}/{run.ckpt_path.name}"
    run.tracker.set_tags({CHECKPOINT_TAG: artifact})
    return artifact


def _save(run: _Run) -> None:
    save_checkpoint(
        run.ckpt_path,
        {
            "model": run.model.state_dict(),
            "optimizer": run.optimizer.state_dict(),
            "data_rng": run.data_gen.get_state(),
            "torch_rng": torch.get_rng_state(),
            "step": run.step,
            "elapsed": time.perf_counter() - run.run_start,
            "history": run.history,
            "run_id": run.tracker.run_id,
            "config": run.cfg.to_toml_dict(),
        },
    )


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


class _NoBar:
    def set_postfix(self, **kw):  # noqa: D401
        pass

    def update(self, n):
        pass

    def close(self):
        pass


def _progress(enabled: bool, total: int | None, initial: int, desc: str):
    if not enabled:
        return _NoBar()
    import sys

    from modbench.progress import progress_bar

    # In a log, not a terminal, each redraw is a line of its own: a bar nested under another (a trial's
    # steps under `study run`'s trials) must not move the cursor up to its row, which writes ESC[A lines.
    nested = {} if sys.stderr.isatty() else {"position": 0}
    return progress_bar(total=total, initial=initial, desc=desc, unit="step", **nested)
