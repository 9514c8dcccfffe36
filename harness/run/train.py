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

import math
import resource
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from modbench.run import distributed
from modbench.config.budget import Budget
from modbench.track.checkpoint import load_checkpoint, save_checkpoint
from modbench.config.model import lr_scale, wd_scale
from modbench.data import Corpus, eval_windows, eval_windows_with_labels, get_batch, load_corpus
from modbench.errors import ModbenchError
from modbench.run.evaluate import evaluate
from modbench.run.causal_eval import calibrate_causal_rules
from modbench.model.gpt import GPT, RoutedBlock
from modbench.config.patterns import pattern_string
from modbench.config.run import RunConfig

# Dense bf16 tensor-core peaks (FLOP/s) for MFU; unknown devices report no MFU.
PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 125e12, "L4": 121e12}


CALIBRATION_BATCHES = 8  # training batches of the final causal-rule calibration (forward only)
CALIBRATION_SEED_OFFSET = 7919  # its own data stream: training's data order is untouched


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


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ModbenchError("train.device is 'cuda' but no CUDA device is available: use 'cpu' or 'auto'")
    return torch.device(name)


def peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_BF16.items() if k in name), None)


def peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def build_optimizer(model: GPT, cfg: RunConfig) -> torch.optim.AdamW:
    t = cfg.train
    lr = t.lr * (lr_scale(cfg.model.width) if t.scale_hparams else 1.0)
    wd = t.weight_decay * (wd_scale(cfg.model.layers) if t.scale_hparams else 1.0)
    decay, no_decay, router = [], [], []
    for name, p in model.named_parameters():
        if ".router." in name:
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
    r = cfg.routing
    return cfg.train.run_name or f"{r.variant}_C{r.capacity:g}_{r.schedule}_{r.pattern}_d{cfg.model.depth}_s{cfg.train.seed}".replace(":", "-").replace(",", "-")


def train(
    cfg: RunConfig,
    *,
    tracker: Any = None,
    resume: bool = False,
    progress: bool = True,
    on_eval: Callable[[int, dict[str, float]], None] | None = None,
) -> TrainResult:
    """Train one run; under torchrun, data-parallel over its processes (see the module doc).

    Every rank returns rank 0's result. ``tracker``, ``progress`` and ``on_eval`` only
    act on rank 0.
    """
    device = resolve_device(cfg.train.device)
    distributed.check_batch_size(cfg.train.batch_size)  # before any process waits for another
    with distributed.process_group(device) as device:
        return _train(cfg, device, tracker=tracker, resume=resume, progress=progress, on_eval=on_eval)


def _train(cfg: RunConfig, device: torch.device, *, tracker: Any, resume: bool, progress: bool,
           on_eval: Callable[[int, dict[str, float]], None] | None) -> TrainResult:
    t = cfg.train
    main = distributed.is_main()
    torch.manual_seed(t.seed)
    corpus = load_corpus(t.dataset, seed=t.seed)
    model = GPT(cfg.model, cfg.routing).to(device)
    step_model = distributed.wrap_model(model, device)  # `model` stays the plain GPT: its methods, eval, saving
    fwd_model = torch.compile(step_model) if t.compile else step_model
    optimizer = build_optimizer(model, cfg)
    base_lrs = [g["lr"] for g in optimizer.param_groups]
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else None
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True

    tokens_per_step = t.batch_size * t.seq_len * t.grad_accum
    flops_per_token = model.flops_per_token(t.seq_len)
    budget = Budget.parse(t.budget)
    total_steps = budget.steps(tokens_per_step, flops_per_token * tokens_per_step)
    data_gen = torch.Generator().manual_seed(t.seed)
    val_x, val_y, val_hard = _eval_set(corpus, "val", t)
    routed_ids = [i for i, layer in enumerate(model.layers) if isinstance(layer, RoutedBlock)]

    run_dir = Path(t.out_dir) / default_run_name(cfg)
    ckpt_path = run_dir / "checkpoint.pt"
    start_step, elapsed_before, history, run_id = 0, 0.0, [], None
    if resume:
        state = load_checkpoint(ckpt_path)
        if state["config"] != cfg.to_toml_dict():
            raise ModbenchError(f"checkpoint {ckpt_path} was written by a different config: resume with the same flags")
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        data_gen.set_state(state["data_rng"])
        torch.set_rng_state(state["torch_rng"])
        start_step, elapsed_before, history, run_id = state["step"], state["elapsed"], state["history"], state["run_id"]
        if start_step >= (total_steps or math.inf):
            raise ModbenchError(f"run {run_dir.name} already finished its {total_steps} steps: nothing to resume")

    if not main:
        from modbench.track.tracking import NullTracker

        tracker = NullTracker()  # one MLflow run per trial, written by rank 0
    owns_tracker = tracker is None  # a caller's tracker is started and ended by the caller
    if owns_tracker:
        from modbench.track.tracking import NullTracker, Tracker

        tracker = (
            Tracker(t.experiment, run_name=run_dir.name, run_id=run_id) if t.track else NullTracker()
        )
    resolved = {
        "budget.resolved_steps": total_steps if total_steps is not None else "time",
        "budget.tokens_per_step": tokens_per_step,
        "budget.flops_per_token": flops_per_token,
        "budget.total_flops": (total_steps or 0) * tokens_per_step * flops_per_token,
        "model.params": model.num_params(),
        "routing.resolved_pattern": pattern_string(model.routed_flags),
    }

    with tracker if owns_tracker else nullcontext(tracker):
        if start_step == 0:
            tracker.log_params({**cfg.to_dict(), **resolved})
            tracker.set_tags({"dataset_sha256": corpus.sha256, "device": _device_name(device), "dataset": t.dataset})
            tracker.log_dict(cfg.to_toml_dict(), "config.json")

        bar = _progress(progress and main, total_steps, start_step, run_dir.name)
        step = start_step
        t_train = 0.0  # wall time in training steps, excluding evaluation
        window_steps, window_start = 0, time.perf_counter()
        lm_acc = torch.zeros((), device=device)
        aux_acc: dict[str, torch.Tensor] = {}
        run_start = time.perf_counter() - elapsed_before

        while True:
            # A time budget must stop every rank at the same step and give each the same LR.
            elapsed = distributed.broadcast_float(time.perf_counter() - run_start) if total_steps is None \
                else time.perf_counter() - run_start
            if total_steps is not None and step >= total_steps:
                break
            if total_steps is None and elapsed >= budget.amount:
                break
            frac = step / total_steps if total_steps else elapsed / budget.amount
            for g, base in zip(optimizer.param_groups, base_lrs):
                g["lr"] = lr_at(frac, base, cfg)
            log_now = (step + 1) % t.log_every == 0 or (total_steps is not None and step + 1 == total_steps)
            step_start = time.perf_counter()
            stats: list[dict[str, torch.Tensor]] = []
            for micro in range(t.grad_accum):
                # Every rank draws the whole global batch (same generator, same state) and keeps
                # its own slice, so the data order is the single-process one at any world size.
                x, y = get_batch(corpus.train, t.batch_size, t.seq_len, data_gen)
                x, y = distributed.local_slice(x), distributed.local_slice(y)
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                model.set_collect_stats(log_now and micro == 0)
                with distributed.grad_sync(step_model, micro + 1 == t.grad_accum):
                    with autocast or nullcontext():
                        out = fwd_model(x, y)
                    aux = model.weighted_aux_loss(out.aux_losses, step)
                    loss = out.loss if aux is None else out.loss + aux
                    (loss / t.grad_accum).backward()
                lm_acc += out.loss.detach() / t.grad_accum
                for k, v in out.aux_losses.items():
                    aux_acc[k] = aux_acc.get(k, 0.0) + v.detach() / t.grad_accum
                if out.stats:
                    stats = out.stats
            model.set_collect_stats(False)
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            window_steps += 1
            if device.type == "cuda" and log_now:
                torch.cuda.synchronize(device)
            t_train += time.perf_counter() - step_start

            if log_now:
                lm_mean, aux_mean, stats = _mean_logged(lm_acc, aux_acc, stats)
                loss_value = lm_mean.item() / window_steps
                if not math.isfinite(loss_value):
                    raise TrainingDiverged(
                        f"training loss became {loss_value} at step {step}: lower --lr (now {t.lr:g}) "
                        f"or --capacity, or raise --grad-clip; the run is marked FAILED"
                    )
                now = time.perf_counter()
                tok_s = window_steps * tokens_per_step / max(now - window_start, 1e-9)
                metrics = {
                    "train/loss": loss_value,
                    "train/lr": optimizer.param_groups[0]["lr"],
                    "train/grad_norm": grad_norm.item(),
                    "perf/tokens_per_s": tok_s,
                    "perf/step_time_s": (now - window_start) / window_steps,
                    "perf/flops_per_token": flops_per_token,
                    "perf/cum_flops": step * tokens_per_step * flops_per_token,
                    "perf/peak_mem_mb": peak_memory_mb(device),
                }
                for k, v in aux_mean.items():
                    metrics[f"train/aux/{k}"] = v.item() / window_steps
                peak = peak_flops(device)
                if peak:
                    metrics["perf/mfu"] = flops_per_token * tok_s / peak
                for layer_id, s in zip(routed_ids, stats):
                    for key in ("fraction", "mean_position", "score_entropy"):
                        metrics[f"route/L{layer_id}/{key}"] = s[key].item()
                tracker.log_metrics(metrics, step)
                history.append({"step": step, **metrics})
                bar.set_postfix(loss=f"{loss_value:.4f}", tok_s=f"{tok_s:,.0f}")
                lm_acc.zero_()
                aux_acc = {}
                window_steps, window_start = 0, time.perf_counter()

            if t.checkpoint_every and step % t.checkpoint_every == 0:
                distributed.average_buffers(model.routers)  # see distributed.wrap_model
                if main:
                    _save(ckpt_path, model, optimizer, data_gen, step, time.perf_counter() - run_start, history, tracker, cfg)
            # Rank 0 evaluates the plain module on the whole eval set (single-process numbers);
            # the others go on and wait for it at the next gradient all-reduce.
            if main and step % t.eval_every == 0 and (total_steps is None or step < total_steps):
                val = evaluate(model, val_x, val_y, batch_size=t.batch_size, device=device, autocast=autocast, hard_labels=val_hard)
                tracker.log_metrics({f"val/{k}": v for k, v in val.items()}, step)
                history.append({"step": step, **{f"val/{k}": v for k, v in val.items()}})
                if on_eval is not None:
                    on_eval(step, val)
                window_start = time.perf_counter()
            bar.update(1)
        bar.close()
        if not main:
            return distributed.broadcast_object(None)  # rank 0's result, once it has finished

        # The causal rules' running thresholds lag behind drifting scores: re-estimate them on the
        # final weights from training batches of their own stream (modbench.run.causal_eval), then the
        # final validation also scores the causal and dense routing modes (train/inference gap).
        calib_gen = torch.Generator().manual_seed(t.seed + CALIBRATION_SEED_OFFSET)
        calibrate_causal_rules(
            model, [get_batch(corpus.train, t.batch_size, t.seq_len, calib_gen)[0] for _ in range(CALIBRATION_BATCHES)],
            autocast=autocast,
        )
        val = evaluate(model, val_x, val_y, batch_size=t.batch_size, device=device, autocast=autocast,
                       hard_labels=val_hard, modes=True)
        test_x, test_y, test_hard = _eval_set(corpus, "test", t)
        test = evaluate(model, test_x, test_y, batch_size=t.batch_size, device=device, autocast=autocast, hard_labels=test_hard)
        final = {**{f"val/{k}": v for k, v in val.items()}, **{f"test/{k}": v for k, v in test.items()}}
        tokens_done = step * tokens_per_step
        tokens_per_s = (step - start_step) * tokens_per_step / max(t_train, 1e-9)
        wall = time.perf_counter() - run_start - elapsed_before
        overhead = tracker.seconds / max(wall, 1e-9)
        final.update({"perf/train_tokens_per_s": tokens_per_s, "perf/logging_overhead": overhead, "perf/total_flops": tokens_done * flops_per_token})
        tracker.log_metrics(final, step)
        _log_heatmap(model, val_x, device, tracker, run_dir, routed_ids)
        _save(ckpt_path, model, optimizer, data_gen, step, time.perf_counter() - run_start, history, tracker, cfg)
        tracker.set_tags({"checkpoint": str(ckpt_path.resolve())})  # `modbench generate --run <id>` finds it here
        tracker.flush()
        run_id = tracker.run_id

    result = TrainResult(
        run_id=run_id,
        steps=step,
        tokens=tokens_done,
        flops=tokens_done * flops_per_token,
        flops_per_token=flops_per_token,
        val=val,
        test=test,
        tokens_per_s=tokens_per_s,
        logging_overhead=overhead,
        history=history,
        checkpoint=ckpt_path,
    )
    return distributed.broadcast_object(result)


def _mean_logged(lm_acc: torch.Tensor, aux_acc: dict[str, torch.Tensor], stats: list[dict[str, torch.Tensor]]):
    """The logged training scalars averaged over ranks: every rank saw an equal slice, so the
    mean of the slice means is the global-batch mean. One all-reduce for all of them."""
    if not distributed.is_distributed():
        return lm_acc, aux_acc, stats
    keys = ("fraction", "mean_position", "score_entropy")
    parts = [lm_acc.reshape(1), *(v.reshape(1) for v in aux_acc.values()),
             *(s[k].reshape(1).to(lm_acc) for s in stats for k in keys)]
    mean = distributed.mean_over_ranks(torch.cat([p.float() for p in parts])).unbind()
    lm, rest = mean[0], list(mean[1:])
    aux = {k: rest.pop(0) for k in aux_acc}
    stats = [{k: rest.pop(0) for k in keys} for _ in stats]
    return lm, aux, stats


def _eval_set(corpus: Corpus, split: str, t) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    if corpus.labels is not None:
        x, y, _, hard_y = eval_windows_with_labels(corpus, split, t.seq_len, t.eval_windows)
        return x, y, hard_y
    x, y = eval_windows(corpus.split(split), t.seq_len, t.eval_windows)
    return x, y, None


def _save(path, model, optimizer, data_gen, step, elapsed, history, tracker, cfg) -> None:
    save_checkpoint(
        path,
        {
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "data_rng": data_gen.get_state(),
            "torch_rng": torch.get_rng_state(),
            "step": step,
            "elapsed": elapsed,
            "history": history,
            "run_id": tracker.run_id,
            "config": cfg.to_toml_dict(),
        },
    )


@torch.no_grad()
def _log_heatmap(model: GPT, val_x: torch.Tensor, device, tracker, run_dir: Path, routed_ids: list[int]) -> None:
    if not model.routers:
        return
    from modbench.run.heatmap import routing_heatmap

    model.eval()
    model.set_collect_stats(True)
    try:
        with torch.random.fork_rng(devices=[]):  # keep the global RNG where training left it
            out = model(val_x[:1].to(device))
    finally:
        model.set_collect_stats(False)
        model.train()
    selected = [s["layer_index"][0].cpu().numpy() for s in out.stats]
    path = routing_heatmap(selected, val_x.shape[1], run_dir / "routing_heatmap.png",
                           title=f"{model.routing.variant} C={model.routing.capacity:g}: processed positions (layers {routed_ids})")
    tracker.log_artifact(path)


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
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=initial, desc=desc, unit="step", dynamic_ncols=True)
