"""Held-out evaluation: loss in nats, bits per byte, and routing against ground truth.

Every arm is evaluated on the same fixed windows of the split (``data.eval_windows``), so
differences between arms are differences between models, not between samples. On the
``arithmetic`` corpus the router's selections are scored against the hard-byte labels: the
computation at position t serves the prediction of byte t+1, so position t counts as hard
when its *target* byte is hard.

With ``modes=True`` (the final evaluation of a run) the model is also scored in the two
other routing modes of ``GPT.forward`` on the same windows — ``causal`` (each token routed
by ``decide_causal``: what decoding computes) and ``dense`` (MoD switched off) — giving
``causal_bpb``, ``dense_bpb`` and the gaps ``causal_gap`` = causal − topk and
``dense_gap`` = dense − topk, plus the causal predictor's agreement with top-k, the
realised causal fraction and the top-k leak rate (``modbench.run.causal_eval.causal_metrics``).

``evaluate_causal`` (the periodic evaluations during training) scores the causal mode alone:
``causal_bpb``, ``causal_fraction`` and ``causal_gap``, summed on the same windows exactly as the
final evaluation sums them, without the dense pass and the agreement and leak probes (reported
once per run). The caller calibrates the causal rules first (``modbench.run.train``).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from modbench.model.gpt import GPT
from modbench.run.causal_eval import causal_metrics, kept_rng, mode_loss, training_mode
from modbench.run.windows import windowed_forward


@torch.no_grad()
def evaluate(
    model: GPT,
    x: Tensor,
    y: Tensor,
    *,
    batch_size: int,
    device: torch.device,
    autocast: torch.autocast | None = None,
    hard_labels: Tensor | None = None,
    modes: bool = False,
) -> dict[str, float]:
    with kept_rng(device), training_mode(model, False):
        result = _evaluate(model, x, y, batch_size, device, autocast, hard_labels)
        if modes:
            result.update(causal_metrics(model, x, y, batch_size=batch_size, device=device, autocast=autocast))
            result["causal_gap"] = result["causal_bpb"] - result["bpb"]
            result["dense_gap"] = result["dense_bpb"] - result["bpb"]
        return result


def _evaluate(model, x, y, batch_size, device, autocast, hard_labels) -> dict[str, float]:
    want_routing = hard_labels is not None and bool(model.routers)
    model.set_collect_stats(want_routing)
    total, count = 0.0, 0
    hits = torch.zeros(len(model.routers))
    chosen = torch.zeros(len(model.routers))
    hard_total = 0.0
    try:
        for xb, i, out in windowed_forward(model, x, y, batch_size, device, autocast):
            total += out.loss.float().item() * xb.numel()
            count += xb.numel()
            if want_routing:
                hard = hard_labels[i : i + batch_size].to(device).bool()
                hard_total += hard.sum().item()
                for layer, stats in enumerate(out.stats):
                    sel = stats["layer_processed"]
                    hits[layer] += (sel & hard).sum().item()
                    chosen[layer] += sel.sum().item()
    finally:
        model.set_collect_stats(False)
    loss = total / count
    result = {"loss": loss, "bpb": loss / math.log(2)}
    if want_routing:
        precision = hits / chosen.clamp_min(1)
        recall = hits / max(hard_total, 1.0)
        result["hard_precision"] = precision.mean().item()
        result["hard_recall"] = recall.mean().item()
        result["hard_base_rate"] = hard_total / count
        for layer in range(len(model.routers)):
            result[f"hard_precision_L{layer}"] = precision[layer].item()
            result[f"hard_recall_L{layer}"] = recall[layer].item()
    return result


@torch.no_grad()
def evaluate_causal(
    model: GPT,
    x: Tensor,
    y: Tensor,
    *,
    batch_size: int,
    device: torch.device,
    topk_bpb: float,
    autocast: torch.autocast | None = None,
) -> dict[str, float]:
    """Causal-mode bpb, realised fraction and gap to ``topk_bpb`` (the same windows' top-k bpb).

    A model with no routed layer is the same model in every mode: its top-k value is the causal
    one, not measured again.
    """
    if not model.routers:
        return {"causal_bpb": topk_bpb, "causal_fraction": 1.0, "causal_gap": 0.0}
    with training_mode(model, False), kept_rng(device):  # a training-mode forward would move the routers' calibration
        loss, processed, total = mode_loss(model, x, y, batch_size, device, autocast, "causal")
    causal = loss / math.log(2)  # as causal_metrics: one series with the final value
    return {"causal_bpb": causal, "causal_fraction": processed / total if total else 1.0, "causal_gap": causal - topk_bpb}
