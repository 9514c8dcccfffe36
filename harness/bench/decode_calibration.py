"""Routers moved to a capacity for timing decoding: each routed layer's causal rule processes C of the tokens.

Decoding routes each token by the variant's causal rule (Raposo et al. 2024, arXiv:2404.02258 §3.5), which a
trained router's auxiliary loss or threshold calibration makes hold for a share ≈ C of the tokens; an untrained
router would time some other capacity. ``move_cuts_to_capacity`` moves each routed layer's cut (the number its
rule compares against, ``cut``), layer by layer in order, so that it processes ``capacity`` of the tokens of
given sequences in causal mode: bisection on the shift (the share is monotone in it). Layer by layer because a
layer's decisions change what every later router scores. Used by tests/bench/test_decode_speed.py (after the
trainer's own calibration, ``modbench.run.causal_eval.calibrate_causal_rules``) and by
``modbench.bench.gpu_decode``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from modbench.model.gpt import GPT, RoutedBlock
from modbench.variants import RunningMean


def cut(router) -> tuple[Tensor, float]:
    """The number the router's causal rule compares against, as a tensor to shift in place, and
    the direction (+1: raising it processes more tokens)."""
    threshold = getattr(router, "threshold", None)
    if isinstance(threshold, RunningMean):  # score >= threshold: norm, amod, learned_temperature, mlp_skip, random*
        threshold.count.fill_(max(float(threshold.count), 1.0))  # (random: a threshold counts once calibrated)
        return threshold.value, -1.0
    if hasattr(router, "aux"):  # linear_softmax: the auxiliary predictor's logit > 0
        return router.aux.net[-1].bias, 1.0
    if hasattr(router, "gate"):  # mode_integrated: best expert's logit − the no-op's > 0
        return router.gate.bias[-1:], -1.0
    if hasattr(router.scorer, "halting_logit"):  # tsa: process iff the halting logit z ≤ 0, so raising it processes fewer
        return router.scorer.head.bias, -1.0
    if hasattr(router.scorer, "head"):  # dtrnet: l_attention − l_bypass > 0 (a shared shift of both cancels)
        return router.scorer.head.bias[:1], 1.0
    return router.scorer.proj.bias, 1.0  # a linear logit against a fixed cut (sigmoid, token_choice, …)


class _Captured(Exception):
    """Stops a forward at the routed layer whose router input was wanted (the rest is not needed)."""


@torch.no_grad()
def router_input(model: GPT, router, idx: Tensor) -> tuple[Tensor, object]:
    """(x, previous) that ``router.decide_causal_given`` sees in the causal pass over ``idx``."""
    seen = []

    def capture(x, previous):
        seen.append((x, previous))
        raise _Captured

    router.decide_causal_given = capture  # an instance attribute shadows the method for one pass
    try:
        model(idx, routing_mode="causal")
    except _Captured:
        pass
    finally:
        del router.decide_causal_given
    return seen[0]


@torch.no_grad()
def move_cuts_to_capacity(model: GPT, idx: Tensor, capacity: float, steps: int = 40) -> None:
    """Move each routed layer's cut so that its causal rule processes ``capacity`` of the tokens of
    ``idx`` (module doc)."""
    for layer in model.layers:
        if not isinstance(layer, RoutedBlock):
            continue
        router = layer.router
        x, previous = router_input(model, router, idx)
        value, direction = cut(router)
        base = value.clone()

        def share(shift: float) -> float:
            value.copy_(base + direction * shift)
            return router.decide_causal_given(x, previous).float().mean().item()

        low, high = -1.0, 1.0
        while share(low) > capacity and low > -1e6:
            low *= 2
        while share(high) < capacity and high < 1e6:
            high *= 2
        for _ in range(steps):
            mid = 0.5 * (low + high)
            low, high = (mid, high) if share(mid) < capacity else (low, mid)
        share(high)
