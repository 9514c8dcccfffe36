"""Per-step training metrics: one registered function each, logged every ``log_every`` steps.

Adding a metric is one function: decorate ``fn(run, window) -> {name: value}`` with
``@step_metric``. ``run`` is the trainer's state (its optimizer, step, device, FLOPs per token),
``window`` what the steps since the last log line left: their count, wall time, mean loss and
auxiliary losses (averaged over ranks under torchrun), gradient norm and route statistics.
"""

from __future__ import annotations

import math
import resource
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from modbench.run import distributed

# Dense bf16 tensor-core peaks (FLOP/s) for MFU; unknown devices report no MFU.
PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 125e12, "L4": 121e12}


def peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_BF16.items() if k in name), None)


def peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


@dataclass
class Window:
    """What the steps since the last log line leave for the per-step metrics."""

    steps: int
    seconds: float
    loss: float
    aux: dict[str, float]
    grad_norm: float
    route_stats: list[dict[str, torch.Tensor]]


# --- per-step metrics: one function each, registered in order -------------------------------
StepMetric = Callable[[Any, Window], dict[str, float]]
STEP_METRICS: list[StepMetric] = []


def step_metric(fn: StepMetric) -> StepMetric:
    """Register a per-step metric: ``fn(run, window) -> {name: value}``, logged every log_every."""
    STEP_METRICS.append(fn)
    return fn


@step_metric
def _loss_metrics(run: Any, w: Window) -> dict[str, float]:
    return {"train/loss": w.loss, "train/bpb": w.loss / math.log(2), "train/lr": run.optimizer.param_groups[0]["lr"],
            "train/grad_norm": w.grad_norm, **{f"train/aux/{k}": v for k, v in w.aux.items()}}


def cumulative_flops(run: Any) -> float:
    """Training FLOPs spent in the run's steps so far, each step at its own capacity (a capacity
    warm-up makes early steps dearer): the one count behind every ``perf/cum_flops``."""
    return run.model.training_flops_per_token(run.cfg.train.seq_len, run.step) * run.tokens_per_step


@step_metric
def _perf_metrics(run: Any, w: Window) -> dict[str, float]:
    tok_s = w.steps * run.tokens_per_step / max(w.seconds, 1e-9)
    metrics = {
        "perf/tokens_per_s": tok_s,
        "perf/step_time_s": w.seconds / w.steps,
        "perf/flops_per_token": run.flops_per_token,
        "perf/cum_flops": cumulative_flops(run),
        "perf/cum_tokens": run.step * run.tokens_per_step,
        "perf/peak_mem_mb": peak_memory_mb(run.device),
    }
    peak = peak_flops(run.device)
    if peak:
        metrics["perf/mfu"] = run.flops_per_token * tok_s / peak
    return metrics


# Route statistics logged per routed layer (route/L{i}/{key}): measured on each rank's slice, so
# averaged over ranks; and the per-step state a router's training forward reads, equal on every rank
# (modbench.run.distributed.sync_step_statistics), logged when the router has it: a budget
# controller's bias (``controller_bias``, variants.base.BudgetController) and expert_threshold's
# threshold (``threshold``).
ROUTE_KEYS = ("fraction", "mean_position", "score_entropy")
ROUTE_STATE_KEYS = ("controller_bias", "threshold")


@step_metric
def _route_metrics(run: Any, w: Window) -> dict[str, float]:
    return {f"route/L{layer_id}/{key}": s[key].item()
            for layer_id, s in zip(run.routed_ids, w.route_stats)
            for key in (*ROUTE_KEYS, *ROUTE_STATE_KEYS) if key in s}


def mean_logged(lm_acc: torch.Tensor, aux_acc: dict[str, torch.Tensor], stats: list[dict[str, torch.Tensor]]):
    """The logged training scalars averaged over ranks: every rank saw an equal slice, so the
    mean of the slice means is the global-batch mean. One all-reduce for all of them. The routers'
    per-step state (``ROUTE_STATE_KEYS``) is equal on every rank and passes through unaveraged."""
    if not distributed.is_distributed():
        return lm_acc, aux_acc, stats
    parts = [lm_acc.reshape(1), *(v.reshape(1) for v in aux_acc.values()),
             *(s[k].reshape(1).to(lm_acc) for s in stats for k in ROUTE_KEYS)]
    mean = distributed.mean_over_ranks(torch.cat([p.float() for p in parts])).unbind()
    lm, rest = mean[0], list(mean[1:])
    aux = {k: rest.pop(0) for k in aux_acc}
    stats = [{**{k: rest.pop(0) for k in ROUTE_KEYS}, **{k: s[k] for k in ROUTE_STATE_KEYS if k in s}} for s in stats]
    return lm, aux, stats
