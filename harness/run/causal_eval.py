"""The train/inference gap of top-k routing: calibrating the causal rules and measuring them.

Calibration (``calibrate_causal_rules``, run by ``modbench.run.train`` before the final evaluation)
    Threshold rules compare a token's score with a running estimate of the training-time
    k-th largest score (the state a training forward reads, such as budget-controller biases, is
    kept out of it). Over a run whose scores drift (short runs, a large learning rate:
    residual norms and router logits move a lot) an EMA lags behind, and the causal rule
    then processes almost every token or almost none (seen on 300-step runs: 0 % processed
    at C = 0.25). The final pass re-estimates every running statistic on the final weights.

Metrics (``causal_metrics``, used by ``modbench.run.evaluate``)
    bpb in the three routing modes, the causal predictor's agreement with top-k membership,
    the realised fraction processed under the causal rule, and the top-k leak rate. Decoding
    itself (KV cache, generation) is ``modbench.model.decode``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from contextlib import contextmanager, nullcontext

import torch
from torch import Tensor, nn

from modbench.variants import RunningMean

from modbench.run.windows import windowed_forward
from modbench.model.gpt import GPT, RoutedBlock


# --- what every evaluation leaves as it found it ------------------------------------------------
def kept_rng(device: torch.device):
    """A block after which the global RNG (the CPU's, and ``device``'s when it is a GPU) is where it
    was: the ``random`` control draws its scores from it, and evaluating must not shift training's draws."""
    return torch.random.fork_rng(devices=[device] if device.type == "cuda" else [])


@contextmanager
def training_mode(model: nn.Module, on: bool) -> Iterator[None]:
    """A block with ``model`` in training (``on``) or eval mode, its own mode restored after."""
    was_training = model.training
    model.train(on)
    try:
        yield
    finally:
        model.train(was_training)


# --- calibration --------------------------------------------------------------------------
@torch.no_grad()
def calibrate_causal_rules(model: GPT, batches: Iterable[Tensor], *, autocast: torch.autocast | None = None) -> None:
    """Re-estimate the causal rules' running statistics on the current weights.

    Every ``RunningMean`` in the routers (thresholds, linear_softmax's normaliser) is reset
    and becomes the plain mean over ``batches`` of training-mode top-k forwards without
    gradient, with ``Router.calibrating`` set (the random control calibrates its hyperplane
    then). Learned weights are untouched, so the top-k model is the same model; the global
    RNG is left where it was.

    State that the *training* forward reads is not a ``RunningMean`` and is left exactly as training
    left it: the budget controllers' biases (``variants.base.BudgetController``) and
    expert_threshold's threshold. Re-estimating it here would change the top-k model itself (for
    those routers the training rule is the decoding rule); calibrating forwards add nothing to its
    per-step statistics either (``VariableCountRouter.route`` skips them while ``calibrating``).
    """
    routers = model.routers
    batches = list(batches)
    if not routers or not batches:
        return
    for stat in (m for r in routers for m in r.modules() if isinstance(m, RunningMean)):
        stat.reset()
    device = model.head.weight.device
    with training_mode(model, True):
        for r in routers:
            r.calibrating = True
        try:
            with kept_rng(device):
                for x in batches:
                    with autocast or nullcontext():
                        model(x.to(device))
        finally:
            for r in routers:
                r.calibrating = False


# --- train/inference gap metrics ----------------------------------------------------------
@torch.no_grad()
def causal_decisions(model: GPT, x: Tensor) -> list[tuple[Tensor, Tensor]]:
    """Per routed layer: (``decide_causal``, top-k membership), (B, T) bool each.

    Both are evaluated on the same teacher-forced (top-k mode) hidden state of each layer:
    the question is how well the causal rule imitates the rule the model was trained with.
    """
    routers = model.routers
    if not routers:
        return []
    model.set_collect_stats(True)
    for r in routers:
        r.collect_causal = True
    try:
        out = model(x)
    finally:
        model.set_collect_stats(False)
        for r in routers:
            r.collect_causal = False
    return [(s["causal_decide"], s["layer_processed"]) for s in out.stats]


def causal_agreement(model: GPT, x: Tensor) -> list[float]:
    """Per routed layer: accuracy of ``decide_causal`` against top-k membership."""
    return [(decide == member).float().mean().item() for decide, member in causal_decisions(model, x)]


def causal_confusion(model: GPT, x: Tensor) -> dict[str, float]:
    """The causal rule as a predictor of top-k membership, pooled over routed layers.

    precision: processed tokens that top-k also selects; recall: top-k selections the rule
    also processes; chance: the agreement of a rule that processes the same fraction q of
    tokens independently of top-k (whose fraction is c): q·c + (1 − q)(1 − c). At C = 0.125
    an always-skip rule already agrees on 87.5 % of tokens, so agreement means little without it.
    """
    pairs = causal_decisions(model, x)
    if not pairs:
        return {}
    decide = torch.cat([d.flatten() for d, _ in pairs])
    member = torch.cat([m.flatten() for _, m in pairs])
    q, c = decide.float().mean().item(), member.float().mean().item()
    both = (decide & member).sum().item()
    return {"causal_precision": both / max(decide.sum().item(), 1), "causal_recall": both / max(member.sum().item(), 1),
            "causal_chance_agreement": q * c + (1 - q) * (1 - c)}


@torch.no_grad()
def leak_rate(model: GPT, x: Tensor, *, routing_mode: str = "topk", cuts: int = 2, seed: int = 0) -> float:
    """Fraction of kept positions whose logits change when the future is perturbed.

    For each window and each of ``cuts`` random cut points t (positions 0 … T−2), every
    token after t is replaced by a random byte; a position ≤ t *leaks* when any of its
    logits differs from the unperturbed forward. The comparison is exact: with a causal rule
    the computation at ≤ t is bit-identical (same shapes, same values, masked keys count as
    exact zeros), so any difference is information from the future. A causal model scores
    exactly 0. The perturbation, the cuts and the global RNG (the ``random`` control draws
    its scores from it) are seeded, so the measurement is reproducible.
    """
    n, T = x.shape
    if T < 2:
        return 0.0
    g = torch.Generator().manual_seed(seed)
    base = x.cpu().repeat_interleave(cuts, dim=0)
    t = torch.randint(0, T - 1, (base.shape[0], 1), generator=g)
    after = torch.arange(T).unsqueeze(0) > t
    noise = torch.randint(0, model.cfg.vocab_size, base.shape, generator=g)
    perturbed = torch.where(after, noise, base)
    device = model.head.weight.device
    with kept_rng(device):
        torch.manual_seed(seed)
        a = model(base.to(device), routing_mode=routing_mode).logits
        torch.manual_seed(seed)
        b = model(perturbed.to(device), routing_mode=routing_mode).logits
    changed = (a != b).any(-1).cpu()
    kept = ~after
    return ((changed & kept).sum() / kept.sum()).item()


@torch.no_grad()
def causal_metrics(
    model: GPT,
    x: Tensor,
    y: Tensor,
    *,
    batch_size: int,
    device: torch.device,
    autocast: torch.autocast | None = None,
    probe_windows: int = 16,
) -> dict[str, float]:
    """bpb in causal and dense mode on all windows; agreement and leak on a few of them.

    Returns causal_bpb, dense_bpb, causal_fraction (realised fraction processed under the
    causal rule, over routed layers and positions: MLPs only for mlp_skip),
    causal_agreement (mean over routed layers) with one causal_agreement_L{i} per routed
    layer, and topk_leak_rate. The caller adds the gaps to its top-k bpb. A model with no
    routed layer is the same model in every mode: its values are filled in, not measured.
    Runs in eval mode (a training-mode top-k forward would move the routers' calibration).
    """
    with training_mode(model, False):
        return _causal_metrics(model, x, y, batch_size, device, autocast, probe_windows)


def mode_loss(model: GPT, x: Tensor, y: Tensor, batch_size: int, device: torch.device,
              autocast: torch.autocast | None, mode: str) -> tuple[float, int, int]:
    """Mean loss per token (nats) over the windows with routing ``mode``, and in causal mode the
    routed layers' processed and total decisions (0, 0 otherwise)."""
    loss_sum, count, processed, total = 0.0, 0, 0, 0
    model.set_collect_stats(mode == "causal")
    try:
        for xb, _, out in windowed_forward(model, x, y, batch_size, device, autocast, routing_mode=mode):
            loss_sum += out.loss.float().item() * xb.numel()
            count += xb.numel()
            for s in out.stats:
                processed += int(s["decide"].sum())
                total += s["decide"].numel()
    finally:
        model.set_collect_stats(False)
    return loss_sum / count, processed, total


def _causal_metrics(model, x, y, batch_size, device, autocast, probe_windows) -> dict[str, float]:
    losses: dict[str, float] = {}
    processed, total = 0, 0
    for mode in ("causal", "dense"):
        losses[mode], p, t = mode_loss(model, x, y, batch_size, device, autocast, mode)
        processed, total = processed + p, total + t
        if not model.routers:
            losses["dense"] = losses["causal"]
            break
    probe = x[:probe_windows].to(device)
    with autocast or nullcontext():
        agreement = causal_agreement(model, probe)
        confusion = causal_confusion(model, probe)
        leak = leak_rate(model, probe) if model.routers else 0.0
    result = {
        "causal_bpb": losses["causal"] / math.log(2),
        "dense_bpb": losses["dense"] / math.log(2),
        "causal_fraction": processed / total if total else 1.0,
        "causal_agreement": sum(agreement) / len(agreement) if agreement else 1.0,
        "topk_leak_rate": leak,
        **confusion,
    }
    routed_ids = [i for i, layer in enumerate(model.layers) if isinstance(layer, RoutedBlock)]
    for layer_id, value in zip(routed_ids, agreement):
        result[f"causal_agreement_L{layer_id}"] = value
    return result
