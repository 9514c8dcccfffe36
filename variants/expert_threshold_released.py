"""``expert_threshold_released``: Expert-Threshold routing (arXiv:2603.11535) as its authors' code trains it.

``expert_threshold`` is the rule of the paper's abstract and §3 (eq. 6: route iff r > c, one rule in
training and inference). The released code, MasterGodzilla/Expert-Threshold-Routing (a nanochat fork;
read at commit 534360cc08ae2d850c4d91646f5976381423a231), trains differently, and a benchmark should be
able to run both and measure the difference. What it does, by file:

1. The cutoff c. Every training forward records the k-th largest router logit of the micro-batch's
   N = B·T tokens, k = k_target (``src/models/engines/common.py``, ``_build_routing_plan``: the last of
   ``topk(k_target)`` under expert choice, ``topk_values[:, k_target - 1]`` under thresholds); a step's
   records are averaged (``_accumulate_cutoffs``) and folded in once per optimizer step
   (``finalize_cutoff_accumulation``, called by ``ModelBase.step_complete``):

       c ← α·c + (1 − α)·mean,  n ← n + 1,   and the threshold read is  θ = c / (1 − αⁿ)

   (``_effective_cutoff``: Adam's bias correction, so θ is the first cutoff after one step rather than
   (1 − α) of it; c itself, 0, before any step). α is ``cutoff_ema_alpha``: 0.99 by default
   (``src/models/model_base.py``), 0.999 in every ET run of ``script/run_configs.sh`` and in the paper
   (§4.2, β = 0.999; its Algorithm 1 writes the EMA without the bias correction).
2. The warm-up. ``configs/mlp/et.yaml`` ships ``threshold_warmup_steps: 4000``: training selects by
   expert choice (top-k, not causal) until that step, when ``train.py`` switches every layer to
   thresholds (``set_routing_mode("threshold")``) for good; the EMA runs from step 0
   (``ema_start_steps: 0``), so θ has 4000 steps of history at the switch (paper §3 "Warmup", App. E.1).
   −1 never switches: the paper's EC arms, trained by top-k and decoded by the cutoff EMA (§4.2).
3. Capacity clamps (``expert_capacity_factor`` f; −1, off, by default; 0.25 in the run catalog's "ET
   with capacity constraints", which also drops the warm-up (``script/train.sh``); 0.5 in the paper,
   App. F.1): under thresholds in training, the count is clamped to [⌊k(1 − f)⌋, ⌊k(1 + f)⌋], the
   highest logits kept (``k_actual = clamp(above_counts, k_min, k_max)``, then ``topk_indices[:k]``).
4. Evaluation routes by thresholds alone, with no clamps: ``ExpertThresholdChoiceMLP.forward`` picks the
   threshold policy whenever ``not self.training``, and the clamps sit under ``if self.training``.
5. The gate is the router's activation, sigmoid(r) (``router_activation: sigmoid``,
   ``src/models/router_utils.py``; paper §4.1), under both policies.

Mapped onto a Mixture-of-Depths router (one router per routed layer, its one "expert" the whole
block): score r = w·x + b (modbench's linear scorer); the cutoff over the training forward's B·T
scores with k = max(1, ⌊C·B·T⌋), capacity C in the role of the released k_target / N (1/16 per routed
expert at the shipped G = 2, E = 8 with a shared expert); processed iff r ≥ θ (the code's ``>=``;
the paper's eq. 6 writes >); output x + sigmoid(r)·Δ. The selection runs per sequence, in the fixed
slots of ``VariableCountRouter`` (static shapes, no host sync): warm-up, the k = max(1, ⌊C·T⌋)
highest of each sequence (MoD's expert choice); thresholds, the tokens with r ≥ θ among the
k_max = min(T, ⌈slack·k⌉) highest; clamped thresholds, among the ⌊k(1 + f)⌋ highest, the top ⌊k(1 − f)⌋
always. Both phases run the same slots, so switching changes no shape, and FLOPs count them.

Not mapped: the experts (G, E, the shared expert and its G = 2 minimum, ``model_base.py``; the paper's
G = 1, E = 16 is not what ``configs/mlp/et.yaml`` ships), the router's input (the released router reads
the MLP's normed input and has no bias; here the block's residual input, with a bias), expert choice
and clamps over the whole micro-batch (here per sequence: MoD's top-k, and a bound on each sequence's
count, stricter than the released bound on the micro-batch's), ``ema_start_steps`` (0, as shipped),
``routing_chunk_seqs``, the first dense layer (a layer pattern does that), and the ranks' sync: the
released code averages c over ranks after each step once thresholds are on; here every rank folds in
the same rank-averaged cutoffs (``StepMean``), so c is equal on every rank at every step.

The training step. The rule the training forward applies depends on how many steps have run, so the
router keeps that count: ``BiasCorrectedCutoff.updates``, a buffer (checkpointed with the model), the
released ``cutoff_ema_updates``. Training forwards add their cutoffs to the step's ``StepMean``; the
per-step hook (``Router.set_step`` ← ``GPT.set_step``, which the trainer calls before each step) folds
them in and advances the count by one when a training forward ran since the last call. So it counts
optimizer steps, not micro-batches or calibration passes, every micro-batch of a step reads the same
phase, the extra ``GPT.set_step`` calls (FLOP accounting, the final ``set_step(2**62)``) move nothing,
and no trainer code knows about it. During step s the count is s: steps 0 … W − 1 select by top-k,
step W and later by thresholds, as ``train.py`` switches ``if step == threshold_warmup_steps``.

When the decode rule becomes the training rule (``causal_training_from``): at step W when the clamps
are off (up to the k_max slot overflow that every variable-count router has, logged as ``overflow``);
never with clamps on (a clamp reads the sequence's other tokens) or W = −1. Before that the causal gap,
causal bpb − top-k bpb (``modbench.run.evaluate``), is the gap of an expert-choice model decoded by its
cutoff EMA; ``tests/test_expert_threshold_released.py`` measures it on both sides of the switch.
modbench's ``val/bpb`` is the training rule's, as for every variant (in eval mode too); the released
code's evaluation number is ``val/causal_bpb``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from .base import Provenance, Routing, StepMean, VariantConfig, check_interval
from .registry import register_variant
from .token_choice import VariableCountRouter

RULES = ("topk", "threshold", "clamped_threshold")  # what a training forward selects by, by phase


@dataclass(frozen=True)
class ReleasedExpertThresholdConfig(VariantConfig):
    # EMA decay α of the cutoff (``cutoff_ema_alpha``, src/models/model_base.py); the run catalog and the paper: 0.999.
    ema_alpha: float = 0.99
    # Training steps of expert-choice (top-k) selection before thresholds (configs/mlp/et.yaml); −1: never switch.
    threshold_warmup_steps: int = 4000
    # f of the training clamps [⌊k(1 − f)⌋, ⌊k(1 + f)⌋] under thresholds (``expert_capacity_factor``); −1: none.
    capacity_factor: float = -1.0
    slack: float = 2.0  # without clamps: k_max = min(T, ⌈slack · k⌉) slots per sequence, k = max(1, ⌊C·T⌋)

    def __post_init__(self) -> None:
        check_interval(self, "ema_alpha", "[0, 1)")
        if self.threshold_warmup_steps < -1:
            raise ValueError(f"threshold_warmup_steps must be -1 (never switch) or >= 0, got {self.threshold_warmup_steps}")
        if self.capacity_factor != -1.0:
            check_interval(self, "capacity_factor", "[0, 1]", " (or -1: no clamps)")
        check_interval(self, "slack", "[1, 64]")

    @property
    def clamped(self) -> bool:
        return self.capacity_factor >= 0


class BiasCorrectedCutoff(nn.Module):
    """θ = c / (1 − αⁿ), c the EMA (decay α) of the steps' k-th largest score and n the steps folded in
    (``common.py``'s ``_effective_cutoff``); n is also the router's count of training steps."""

    rank_equal = True  # moved once per step from the rank-averaged cutoffs

    def __init__(self, alpha: float) -> None:
        super().__init__()
        self.alpha = alpha
        self.register_buffer("raw", torch.zeros(()))  # c (``cutoff_ema_raw``)
        self.register_buffer("updates", torch.zeros((), dtype=torch.long))  # n (``cutoff_ema_updates``)
        self.step_cutoff = StepMean()  # the k-th largest score of each training forward of the step

    def value(self) -> Tensor:
        """θ, a () tensor (no host read): c before the first update, then c / (1 − αⁿ)."""
        correction = (1.0 - self.alpha ** self.updates.float()).clamp_min(1e-12)
        return torch.where(self.updates > 0, self.raw / correction, self.raw)

    @torch.no_grad()
    def observe(self, scores: Tensor, capacity: float) -> None:
        """The k-th largest of the forward's B·T scores, k = max(1, ⌊C·B·T⌋) (a static k: no host sync)."""
        flat = scores.detach().float().flatten()
        k = min(flat.numel(), max(1, math.floor(capacity * flat.numel() + 1e-6)))
        self.step_cutoff.add(torch.topk(flat, k, sorted=False).values.amin())

    @torch.no_grad()
    def step(self) -> None:
        """c ← α·c + (1 − α)·(the step's mean cutoff), n ← n + 1; nothing when no training forward ran."""
        q, seen = self.step_cutoff.take()
        self.raw.copy_(torch.where(seen, self.alpha * self.raw + (1.0 - self.alpha) * q, self.raw))
        self.updates.add_(seen.to(self.updates.dtype))


class ReleasedExpertThresholdRouter(VariableCountRouter):
    """Expert choice for a warm-up, then r ≥ θ (bias-corrected cutoff EMA); delta × sigmoid(r); decode by r ≥ θ."""

    def __init__(self, d_model: int, config: ReleasedExpertThresholdConfig) -> None:
        super().__init__(d_model, config)
        self.cutoff = BiasCorrectedCutoff(config.ema_alpha)

    # --- the phase: which rule the next training step selects by -------------------------------------
    @property
    def steps(self) -> Tensor:
        """Training steps folded in so far (a () long buffer): during step s it is s."""
        return self.cutoff.updates

    def warming_up(self) -> Tensor:
        """() bool, on the device: the training forward selects by top-k (steps < W, or W = −1)."""
        warmup = self.config.threshold_warmup_steps
        if warmup < 0:
            return torch.ones((), dtype=torch.bool, device=self.steps.device)
        return self.steps < warmup

    def training_rule(self) -> str:
        """The rule of the training forward now, one of ``RULES`` (reads the device: for logs and tests)."""
        if bool(self.warming_up()):
            return "topk"
        return "clamped_threshold" if self.config.clamped else "threshold"

    @property
    def causal_training_from(self) -> int | None:
        """The first training step whose rule is the decode rule r ≥ θ (up to the k_max overflow), or None
        when no step's is: clamps read the sequence's other tokens, and W = −1 never leaves top-k."""
        warmup = self.config.threshold_warmup_steps
        return None if warmup < 0 or self.config.clamped else warmup

    # --- the rule ----------------------------------------------------------------------------------
    def margin(self, scores: Tensor) -> Tensor:
        """r − θ: a token passes the threshold iff this is ≥ 0 (``above_mask``: logits >= cutoff)."""
        return scores - self.cutoff.value().to(scores.dtype)

    def decide_causal(self, x: Tensor) -> Tensor:
        return self.margin(self.score(x)) >= 0  # evaluation's rule: thresholds alone, no clamps

    def causal_weight(self, x: Tensor, decide: Tensor) -> Tensor:
        return torch.sigmoid(self.score(x))

    def tokens_run(self, k: int, seq_len: int) -> int:
        """Slots per sequence: ⌊k(1 + f)⌋ with clamps (the upper clamp), else ⌈slack·k⌉, at most T; k when
        counting as decoding runs (no slots)."""
        if not self.count_batched_slots:
            return k
        if self.config.clamped:
            return min(seq_len, math.floor(k * (1.0 + self.config.capacity_factor) + 1e-9))
        return super().tokens_run(k, seq_len)

    def selection(self, above: Tensor, k: int) -> Tensor:
        """Which slots are processed, slots ranked by score (slot j the (j+1)-th highest): the top k in
        the warm-up; after it those above θ, or with clamps those above θ and the top ⌊k(1 − f)⌋ anyway
        (the slots bound the count by ⌊k(1 + f)⌋). One tensor expression: the phase is read on the device."""
        rank = torch.arange(above.shape[-1], device=above.device)
        rule = above
        if self.config.clamped:
            rule = above | (rank < math.floor(k * (1.0 - self.config.capacity_factor) + 1e-9))
        return torch.where(self.warming_up(), rank < k, rule)

    def route(self, x: Tensor, k: int, previous: Tensor | None = None) -> Routing:
        T = x.shape[1]
        scores = self.score(x)
        margin = self.margin(scores)
        values, top = torch.topk(margin, self.tokens_run(k, T), dim=-1, sorted=True)
        chosen = self.selection(values >= 0, k)
        index, order = torch.sort(top, dim=-1)
        valid = chosen.gather(-1, order)
        weight = torch.sigmoid(scores.gather(-1, index))  # the gate sigmoid(r), under both rules
        if self.training and not self.calibrating:
            self.cutoff.observe(scores, k / T)
        stats = {}
        if self.collect_stats:
            stats = self.routing_stats(scores, index)
            stats["fraction"] = valid.float().sum(-1).mean() / T
            stats["overflow"] = ((margin >= 0).sum(-1) > valid.sum(-1)).float().mean()  # above θ beyond the slots
            stats.update(self.state_stats())
            if self.collect_causal:
                stats["causal_decide"] = self.decide_causal(x)
        return Routing(index=index, weight=weight.unsqueeze(-1), aux_losses={}, stats=stats, valid=valid)

    # --- the per-step state ------------------------------------------------------------------------
    def set_step(self, step: int) -> None:
        self.cutoff.step()  # the step counter too: the trainer's ``step`` argument is not read

    def state_stats(self) -> dict[str, Tensor]:
        return {"threshold": self.cutoff.value().detach().clone()}

    def selected_weight(self, p: Tensor, valid: Tensor) -> Tensor:
        raise NotImplementedError("route computes the gate sigmoid(r) itself")

    def load_losses(self, p: Tensor, capacity: float) -> dict[str, Tensor]:
        return {}  # none: the threshold holds the share


register_variant("expert_threshold_released", ReleasedExpertThresholdRouter, config=ReleasedExpertThresholdConfig,
                 source="Expert-Threshold routing (arXiv:2603.11535) as released: MasterGodzilla/Expert-Threshold-Routing @534360c",
                 # Selection per sequence in fixed slots (the released EC and clamps act on the micro-batch): adapted.
                 # The gate sigmoid(r) and the decode rule r >= bias-corrected cutoff EMA are the code's.
                 provenance=Provenance("paper's recipe", "paper", "paper",
                                       (("MasterGodzilla/Expert-Threshold-Routing @534360c src/models/engines/common.py, "
                                         "engine.py, configs/mlp/et.yaml, train.py", "released code"),
                                        ("Expert-Threshold routing (arXiv:2603.11535) §3 (eq. 6, Algorithm 1, Warmup), "
                                         "§4.1, App. E.1, F.1", "paper's text"))))
