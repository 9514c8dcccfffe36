"""Model sizes from analytic FLOPs: what the control arms a study derives are sized by
(``modbench.design.controls`` derives the arms).

A MoD model costs fewer FLOPs per token than the dense model of the same shape, so under one
FLOP budget it trains on more tokens. Two dense controls separate "routing helps" from "a
cheaper model sees more data" (Raposo et al. 2024 §4.1 compare against isoFLOP-optimal
dense models for the same reason):

- *matched dense*: the dense model, no deeper and no wider than the routed arm's, whose
  training FLOPs per token are closest to the routed arm's, within ``MATCH_TOLERANCE``
  (depths 1…L). Shapes that keep the routed model's head dimension (widths its multiples) come
  first; only when none is within tolerance, every even width (heads from ``heads_for``: the even
  head dimension closest to the routed model's). It trains
  on the same FLOP budget, so it sees about as many tokens as the routed arm.
- *iso-token dense*: the routed arm's own dense shape trained for exactly as many steps
  (tokens) as the routed arm gets from its FLOP budget: more compute than the budget.

A recursive model (``ModelConfig.recursion``, Mixture-of-Recursions, arXiv:2507.10524 §2.1) costs
FLOPs per block *application* but holds parameters per *physical* block, so it has two vanilla
twins (issue 29's baselines), both without weight sharing:

- *FLOP-matched*: the matched dense above, sized by the recursive arm's FLOPs per token (which
  ``GPT.flop_report`` counts per application); for a recursive *dense* arm that is its own shape
  unshared, the study's vanilla dense arm of the same depth and width (equal FLOPs exactly).
- *param-matched* (``param_matched_dense``): the vanilla model of the recursive arm's physical
  depth at its width (``param_matched_vanilla``): block for block the same modules, so the
  non-embedding parameters are equal exactly (a routed arm's routers, d + 1 per routed layer, are
  the only difference); it costs 1/N_R of the shared part's FLOPs and trains on the same budget.

FLOPs come from ``GPT.flop_report`` (built on the meta device: no memory, no RNG draw), the
same count the trainer converts budgets with.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from modbench.config.budget import Budget
from modbench.config.model import ModelConfig, RoutingConfig, heads_for
from modbench.config.run import RunConfig
from modbench.errors import ModbenchError
from modbench.model.gpt import GPT

MATCH_TOLERANCE = 0.03  # |FLOPs per token of the matched dense / routed − 1|


def flops_per_token(model: ModelConfig, routing: RoutingConfig, seq_len: int) -> float:
    """Training FLOPs per token of this model (forward + backward), as the trainer counts them."""
    with torch.device("meta"):
        return GPT(model, routing).flops_per_token(seq_len)


def decode_flops_per_token(model: ModelConfig, routing: RoutingConfig, seq_len: int, fraction: float) -> float:
    """Forward FLOPs per token when routed layers process ``fraction`` of the tokens: the cost of
    the causal (decode-time) rule at its realised fraction rather than at the nominal capacity.
    A fraction of 1 (or a dense model) is the dense forward cost. Decoding runs exactly the tokens
    the rule processes, so a variable-count router (``token_choice``, ``threshold``) is charged
    what a fixed-count router pays at the same share, not its training-time k_max slots."""
    fraction = min(1.0, max(fraction, 1.0 / seq_len))
    with torch.device("meta"):
        # (an explicit per-layer list gives way to the realised share, uniform over the routed layers)
        gpt = GPT(model, replace(routing, capacity=fraction, capacities=""))
    for router in gpt.routers:
        router.count_batched_slots = False
    return gpt.flops_per_token(seq_len, backward=False)


def non_embedding_params(model: ModelConfig, routing: RoutingConfig) -> int:
    """Parameters outside the token embedding and the output head (the isoFLOP profiles' size axis)."""
    with torch.device("meta"):
        gpt = GPT(model, routing)
    return sum(p.numel() for name, p in gpt.named_parameters() if not name.startswith(("embed.", "head.")))


def param_matched_vanilla(model: ModelConfig) -> ModelConfig:
    """The vanilla (unshared) model with a recursive model's parameters: its physical depth at its
    width and heads (depth no longer drives the width, so both are pinned). Block for block the same
    modules, so the non-embedding parameters are equal; it costs 1/N_R of the shared part's FLOPs.
    The FLOP-matched vanilla model is the recursive model's own shape unshared (same FLOPs per token)."""
    return replace(model, n_layer=model.physical_layers, n_embd=model.width, n_head=model.heads,
                   recursion="none", recursions=1, kv_sharing=False)


def matched_dense_shape(cfg: RunConfig, tolerance: float = MATCH_TOLERANCE) -> tuple[int, int, float]:
    """(depth, width, FLOP ratio dense/routed) of the dense model matched to ``cfg``'s routed model.

    Shapes with the routed model's head dimension first (the closest, ties to the deeper); every
    even width only when none of those is within ``tolerance``. Raises when no shape is within
    tolerance (the error names the closest).
    """
    target = flops_per_token(cfg.model, cfg.routing, cfg.train.seq_len)
    hd = cfg.model.head_dim
    same_head = _closest(cfg, target, range(cfg.model.width - cfg.model.width % hd, hd - 1, -hd))
    best = same_head if same_head[0] <= tolerance else min(
        same_head, _closest(cfg, target, range(cfg.model.width - cfg.model.width % 2, 1, -2)))
    if best[0] > tolerance:
        raise ModbenchError(
            f"no dense model of at most {cfg.model.layers} layers and width {cfg.model.width} costs within "
            f"{tolerance:.0%} of the routed model's FLOPs per token: the closest, {best[1]} layers × d={best[2]}, "
            f"is off by {best[0]:.1%}; try another capacity or pattern"
        )
    return best[1], best[2], best[3]


def _closest(cfg: RunConfig, target: float, widths) -> tuple[float, int, int, float]:
    """(|ratio − 1|, depth, width, ratio) of the dense shape closest to ``target`` FLOPs per token;
    ties go to the deeper, then the wider shape."""
    best = None
    for depth in range(cfg.model.layers, 0, -1):
        for width in widths:
            # a vanilla model (no weight sharing): the FLOP-matched control of a recursive arm too
            shape = replace(cfg.model, depth=depth, n_layer=None, n_embd=width, n_head=heads_for(width, cfg.model),
                            recursion="none", recursions=1, kv_sharing=False)
            ratio = flops_per_token(shape, RoutingConfig(), cfg.train.seq_len) / target
            if best is None or abs(ratio - 1) < best[0]:
                best = (abs(ratio - 1), depth, width, ratio)
    assert best is not None
    return best


def iso_token_budget(cfg: RunConfig) -> str:
    """The routed run's own training length as a ``steps=N`` budget (its FLOP budget's steps)."""
    t = cfg.train
    tokens_per_step = t.batch_size * t.seq_len * t.grad_accum
    fpt = flops_per_token(cfg.model, cfg.routing, t.seq_len)
    steps = Budget.parse(t.budget).steps(tokens_per_step, fpt * tokens_per_step)
    return f"steps={steps}"
