"""The contract between the model and a routing variant.

A variant decides *which* tokens a routed layer processes and *how* the block's output is
mixed back (its declared ``Mixing`` policy); the model (``modbench.model.gpt.RoutedBlock``) executes. Expert-choice routing as in
Raposo et al. 2024 (arXiv:2404.02258, §3.3): each routed layer keeps the top-k tokens of a
per-token score, k = capacity · T, and the selected positions are sorted ascending so that a
causal mask on the gathered subset is exact.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any, ClassVar, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .linear_router import AuxPredictor, LinearScorer  # linear_router imports nothing from here

# What a router gates: the whole block, the MLP alone (attention on every token first), or attention's token
# mixing alone (the MLP on every token after; DTRNet); "none": nothing (dense).
Scope = Literal["block", "mlp", "attention", "none"]
WeightScope = Literal["block", "mlp", "none", "sublayers"]
SkipRule = Literal["keep", "scale", "local"]
WEIGHT_SCOPES = ("block", "mlp", "none", "sublayers")
SKIP_RULES = ("keep", "scale", "local")

# Where a part of a variant comes from (``Provenance``).
ORIGINS = ("paper", "paper's recipe", "modbench's own")
# How a citation was checked: against the cited work's own text, against its authors' released
# code, or taken from a secondary source (a summary, another implementation, our reading of it
# elsewhere) without re-reading the work itself.
CHECKS = ("paper's text", "released code", "secondary")


@dataclass(frozen=True)
class Provenance:
    """Where a variant's selection, output weighting and decode-time rule come from, and how each
    citation behind them was checked (shown in ``modbench variants`` and the README tables).

    selection / weighting / decode: "paper" (as the cited work defines it), "paper's recipe" (the
    cited work's idea, adapted here: another setting, a stated change), or "modbench's own" (not in
    any cited work; controls and baselines are modbench's own throughout).
    citations: (citation, check) pairs, check one of ``CHECKS``; empty for a control.
    """

    selection: str
    weighting: str
    decode: str
    citations: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        for part in ("selection", "weighting", "decode"):
            if getattr(self, part) not in ORIGINS:
                raise ValueError(f"provenance {part} must be one of {ORIGINS}, got {getattr(self, part)!r}")
        for citation, check in self.citations:
            if check not in CHECKS:
                raise ValueError(f"citation {citation!r}: check must be one of {CHECKS}, got {check!r}")

    def cell(self) -> str:
        """One line: what the README tables' provenance column and ``modbench variants`` show."""
        parts = f"selection: {self.selection}; weighting: {self.weighting}; decode: {self.decode}"
        cites = "; ".join(f"{citation} ({check})" for citation, check in self.citations)
        return f"{parts}; cited: {cites}" if cites else parts


@dataclass(frozen=True)
class VariantConfig:
    """Base of every variant's hyper-parameter config (frozen, flat, loggable)."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]


# --- the checks a config's ``__post_init__`` makes, each with its one message ---------------------
def check_nonnegative(config: VariantConfig, *names: str) -> None:
    """Each named option is >= 0 (a loss weight, a count): "<name> must be >= 0, got <value>"."""
    for name in names:
        if getattr(config, name) < 0:
            raise ValueError(f"{name} must be >= 0, got {getattr(config, name)}")


def check_interval(config: VariantConfig, name: str, interval: str, why: str = "") -> None:
    """The option lies in ``interval``, written as the message writes it: "(0, 1]", "[1, 64]" (a NaN
    lies in none): "<name> must be in <interval><why>, got <value>"."""
    value = getattr(config, name)
    low, high = (float(bound) for bound in interval[1:-1].split(","))
    above = value > low if interval[0] == "(" else value >= low
    below = value < high if interval[-1] == ")" else value <= high
    if not (above and below):
        raise ValueError(f"{name} must be in {interval}{why}, got {value}")


def check_choice(config: VariantConfig, name: str, choices: tuple[str, ...]) -> None:
    """The option is one of ``choices``: "<name> must be one of 'a', 'b', got <value>"."""
    value = getattr(config, name)
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, choices))}, got {value!r}")


@dataclass(frozen=True)
class Mixing:
    """How a routed block combines its output with the residual stream: a router's declared policy
    (``Router.mixing``), applied by one method, ``modbench.model.gpt.RoutedBlock.mix``, on every path
    (the top-k forward, the causal routing mode, KV-cached decoding). A new way of mixing is a new
    policy (or a new field here, with its case in ``RoutedBlock.mix``), not a branch in the forward.

    With Δ what the routed layer computes (attention + MLP; the MLP alone for scope "mlp"; attention
    alone for scope "attention", whose MLP then runs on every token's mixed stream) and w the
    router's weight (``mix_weight`` in top-k, ``causal_weight`` causally; a policy that expects one
    still adds unweighted where the router gives None):

    weight:  what w multiplies. "block": Δ, a processed token becomes x + w·Δ (Raposo et al. 2024);
             "mlp": the MLP output alone, x + attn + w·mlp (p-MoD's released code; scope "block"
             only); "none": nothing, x + Δ (the router gives no weight); "sublayers": each sublayer's output
             in turn, x' = x + w·attn(x), then x' + w·mlp(x') (TSA's gated block update, arXiv:2605.05222
             eqs. 3–4; scope "block" only).
    output:  w multiplies the block's *output* x + Δ instead of Δ: x + w·(x + Δ) (``mor``'s
             update="output", the Mixture-of-Recursions code's scatter_add of g·block(x)). Needs
             weight "block".
    handoff: the routing hands over each processed token's base b and weight: b + w·(x + Δ)
             (``mor_token_choice``: ``Routing.base`` in top-k; causally the router's ``assign_causal``
             returns them with the decision, and the next routed layer receives that handoff as
             ``previous``). Needs output.
    skip:    what a skipped token becomes. "keep": x, bit for bit; "scale": s·x, s from the router's
             ``skip_scale_of`` (p-MoD's STRing), not with a variable count; "local": x + s·local(x),
             local(x) = W_O·W_V·norm1(x), the token's attention with only itself as key (a softmax over
             one key is 1, so each head returns its own value), s from ``skip_scale_of`` (DTRNet's
             bypass path; scope "attention" only). None of them with a handoff.

    A variable count's unused slots (``Routing.valid``) add nothing under every policy: no Δ, and
    no w·x where the output is weighted; an unused slot under a handoff keeps its row's x.
    """

    weight: WeightScope = "block"
    output: bool = False
    handoff: bool = False
    skip: SkipRule = "keep"

    def __post_init__(self) -> None:
        if self.weight not in WEIGHT_SCOPES:
            raise ValueError(f"mixing weight must be one of {', '.join(map(repr, WEIGHT_SCOPES))}, got {self.weight!r}")
        if self.skip not in SKIP_RULES:
            raise ValueError(f"mixing skip must be one of {', '.join(map(repr, SKIP_RULES))}, got {self.skip!r}")
        for name in ("output", "handoff"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"mixing {name} must be True or False, got {getattr(self, name)!r}")
        if self.output and self.weight != "block":
            raise ValueError(f"mixing output=True weights the block's output x + Δ: it needs weight='block', "
                             f"got weight={self.weight!r}")
        if self.handoff and not self.output:
            raise ValueError("mixing handoff=True makes a processed token base + w·(x + Δ): it needs output=True")
        if self.handoff and self.skip != "keep":
            raise ValueError("mixing handoff=True writes its processed tokens whole and keeps the skipped ones: "
                             f"skip must be 'keep', got {self.skip!r}")

    def check(self, scope: str, variable_count: bool) -> Mixing:
        """This policy, for a router of ``scope`` and count kind; a combination the block cannot
        apply is a ValueError (a variant's error, found when its routed layer is built)."""
        if scope != "block" and self.weight in ("mlp", "sublayers"):
            alone = "the MLP" if scope == "mlp" else "attention's token mixing"
            inside = "the MLP output" if self.weight == "mlp" else "each sublayer's output"
            raise ValueError(f"mixing weight={self.weight!r} weights {inside} inside the block: a scope {scope!r} router "
                             f"routes {alone} alone, so its weight is weight='block'")
        if self.skip == "local" and scope != "attention":
            raise ValueError(f"mixing skip='local' gives a skipped token attention with only itself: that replaces "
                             f"the token mixing of a scope 'attention' router, got scope {scope!r}")
        if variable_count and self.skip == "scale":
            raise ValueError(f"mixing skip={self.skip!r} rewrites every skipped row from the routing's per-token "
                             "scale, which only a fixed count gives: a variable-count router's skip must be 'keep' "
                             "or 'local'")
        return self

    @property
    def formula(self) -> tuple[str, str]:
        """(processed, skipped): what a token becomes, in the notation above."""
        if self.weight == "mlp":
            processed = "x + attn + w·mlp"
        elif self.weight == "sublayers":
            processed = "x + w·attn + w·mlp(x + w·attn)"
        elif self.weight == "none":
            processed = "x + Δ"
        elif self.output:
            processed = f"{'b' if self.handoff else 'x'} + w·(x + Δ)"
        else:
            processed = "x + w·Δ"
        return processed, {"keep": "x", "scale": "s·x", "local": "x + s·local(x)"}[self.skip]


@dataclass(frozen=True)
class Routing:
    """One routed layer's decision for a batch.

    index:      (B, k) int64 positions to process, ascending (keeps causality).
    weight:     (B, k, 1) the router's weight w, or None (an unweighted add); what it multiplies is
                the router's ``Mixing``.
    aux_losses: unweighted auxiliary losses by name (weights come from the variant config
                through ``Router.aux_weights``, so every variant adds them the same way).
    stats:      detached statistics for logging; empty unless the model asked for them.
    valid:      (B, k) bool, for variants whose processed count varies per row (token choice,
                threshold routing): which of the k slots are processed. Invalid slots are
                neither keys nor written back. None: all k are processed.
    """

    index: Tensor
    weight: Tensor | None
    aux_losses: dict[str, Tensor]
    stats: dict[str, Tensor]
    valid: Tensor | None = None
    # (B, T) s of the skipped tokens: s·x under ``Mixing(skip="scale")`` (p-MoD's STRing), x + s·local(x) under "local"
    skip_scale: Tensor | None = None
    # With ``Mixing(handoff=True)`` (``mor_token_choice``): per slot, what a processed token's w·(x + Δ) is
    # added to instead of x ((B, k, d)), and what the next routed layer receives as ``previous`` instead of
    # the processed mask (its ``DepthAssignment``).
    base: Tensor | None = None
    handoff: Any = None

    def processed(self, seq_len: int) -> Tensor:
        """(B, T) bool: the positions this layer processes."""
        mask = torch.zeros(self.index.shape[0], seq_len, dtype=torch.bool, device=self.index.device)
        return mask.scatter_(1, self.index, True if self.valid is None else self.valid)


class RunningMean(nn.Module):
    """Exponential moving average of a statistic seen in training forwards.

    Updated without gradient or host sync; the first observations get weight 1/n so the
    estimate is unbiased from the start. Causal routing rules calibrate against it.
    """

    def __init__(self, momentum: float = 0.01) -> None:
        super().__init__()
        self.momentum = momentum
        self.register_buffer("value", torch.zeros(()))
        self.register_buffer("count", torch.zeros(()))

    @torch.no_grad()
    def reset(self) -> None:
        """Forget the history: the next update sets the value (rate 1)."""
        self.count.zero_()

    @torch.no_grad()
    def update(self, observed: Tensor) -> None:
        self.count.add_(1)
        rate = torch.clamp(1.0 / self.count, min=self.momentum)
        self.value.lerp_(observed.float().mean(), rate)


class QuantileThreshold(RunningMean):
    """Running estimate of the k-th largest score, the causal stand-in for top-k.

    At decode time a token cannot see the scores of later tokens, so top-k is unavailable;
    thresholding at the training-time k-th score selects about the same fraction of tokens
    using only the token's own score. The estimate is an exponential moving average of the
    per-sequence k-th score, updated in training forwards (no gradient, no host sync).
    """

    def forward(self, scores: Tensor) -> Tensor:
        return scores >= self.value


class StepMean(nn.Module):
    """Mean of a statistic over the training forwards of one optimizer step.

    State that the *training* forward reads (a budget controller's bias, ``expert_threshold``'s
    threshold) must not move inside a step, and must be equal on every data-parallel rank. So its
    forwards only add their observation here (no gradient, no host sync), the trainer averages the
    sums over ranks once per step (``modbench.run.distributed.grad_sync``), and the owner consumes
    the mean in the per-step hook (``Router.set_step``, called by ``GPT.set_step``).
    """

    rank_equal = True  # averaged over ranks every step: ``distributed.average_buffers`` leaves it alone

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("total", torch.zeros(()))
        self.register_buffer("count", torch.zeros(()))

    @torch.no_grad()
    def add(self, observed: Tensor) -> None:
        self.total.add_(observed.detach().float().mean())
        self.count.add_(1)

    @torch.no_grad()
    def take(self) -> tuple[Tensor, Tensor]:
        """(mean, any): the mean of this step's observations (0 when none) and whether there were
        any, as tensors (no host sync); the sums start again from zero."""
        seen = self.count > 0
        mean = self.total / self.count.clamp_min(1)
        self.total.zero_()
        self.count.zero_()
        return mean, seen


class BudgetController(nn.Module):
    """A per-layer bias that makes a variable-count router's realised share track its capacity C.

    The budget control of LongCat-Flash's zero-computation experts (arXiv:2509.01322, §2.1): after
    each step the bias moves by μ times the gap between the target and the realised load,
    Δb = μ·(C − share) (LongCat-Flash's Δbᵢ = μ(K_e/K · 1/N − Tᵢ/(K·T_all)) with one routed
    "expert", the block, and K_e/K = C), an integral controller of the bias (the report calls its
    controller PID; the update it prints is this integral term, and no P or D term is used here).
    modbench's own: the bias acts on a MoD router's decision (added to its logit, or for
    ``expert_threshold`` to the quantile level its threshold estimates); for a logit bias the gap
    is scaled by σ, the spread (std) of the layer's logits over the forward's tokens, Δb = μ·σ·(C −
    share), because MoD router logits span orders of magnitude (~0.003 at a fresh token_choice
    router, units after training): with σ the loop gain is μ times the density of the standardised
    logits at the threshold (≤ 0.4 for a Gaussian), whatever their scale; the share is the rule's
    (before the k_max slot cap: what decoding processes); the gap is averaged over the step's
    micro-batches and data-parallel ranks and applied once per step (``Router.set_step``); and a
    warm start: a logit bias's first update sets it to the bias that would have given the first
    step's batches a share of C exactly (``start``), where LongCat-Flash starts from 0 (a fresh
    router's logits are centred, a share near 0.5, and an integral controller fast enough to hold
    the share overshoots from there to ~0 for tens of steps).

    Not a ``RunningMean``: the final calibration (``calibrate_causal_rules``) must not reset it,
    since the training forward reads it (resetting it would change the top-k model itself).
    """

    rank_equal = True  # updated identically on every rank from the rank-averaged gap

    def __init__(self, gain: float) -> None:
        super().__init__()
        self.gain = gain
        self.register_buffer("bias", torch.zeros(()))
        self.register_buffer("updates", torch.zeros(()))  # steps applied so far
        self.gap = StepMean()  # C − share (× scale), per training forward
        self.start = StepMean()  # the bias that would have given each forward a share of C (warm start)
        self.register_load_state_dict_pre_hook(self._convert_old_checkpoint)

    @torch.no_grad()
    def observe(self, target: float, share: Tensor, scale: Tensor | float = 1.0, start: Tensor | None = None) -> None:
        """A training forward's target share (k/T), realised share (a tensor: no host sync), the
        scale of one unit of gap in the bias's units (σ for a logit bias) and, for a warm start, the
        bias that would have made this forward's share C."""
        self.gap.add((target - share.float()) * scale)
        if start is not None:
            self.start.add(start)

    @torch.no_grad()
    def step(self) -> None:
        """Δb = μ · the last step's mean (scaled) gap, or the warm start at the first update; nothing
        when no training forward ran since the last call."""
        gap, seen = self.gap.take()
        start, started = self.start.take()
        moved = torch.where(started & (self.updates == 0), start, self.bias + self.gain * gap)
        self.bias.copy_(torch.where(seen, moved, self.bias))
        self.updates.add_(seen.to(self.updates.dtype))

    @staticmethod
    def _convert_old_checkpoint(module, state_dict, prefix, *args) -> None:
        # A checkpoint from before the controller existed (threshold's default turned it on) loads as a
        # controller at bias 0 with nothing pending: exactly the model it was trained as.
        keys = {f"{prefix}{name}": buf for name, buf in module.named_buffers()}
        if not keys.keys() & state_dict.keys():
            state_dict.update({k: torch.zeros_like(v) for k, v in keys.items()})


class Router(nn.Module):
    """Base class of all routers.

    Subclasses set ``scope`` and implement ``score`` (a (B, T) tensor whose top-k is the
    selection) and ``decide_causal``; they declare ``mixing`` (a ``Mixing``: how the block's
    output meets the residual stream) and may override the hooks below it: ``mix_weight`` (the
    weight w in top-k), ``causal_weight`` (w when routing causally), ``skip_scale_of`` (s of a
    ``Mixing(skip="scale")``), ``assign_causal`` (the decision and handoff of a
    ``Mixing(handoff=True)``), ``decide_causal_given``, ``aux_losses``, ``aux_weights``,
    ``observe`` (per-forward bookkeeping such as calibration), ``set_step``, ``attach``,
    ``tokens_run``, ``flops_per_token``, and ``route`` itself (the top-k template).
    """

    scope: ClassVar[Scope] = "block"
    # >0: the routed block's MLP is a top-1 mixture of this many experts (MoDE); the model builds it.
    mlp_experts: int = 0
    # True: that mixture's gate has one more output, a no-op expert (integrated MoDE, ``mode_integrated``).
    mlp_noop_expert: bool = False
    # True: each token decides for itself, so the processed count varies per sequence (Routing.valid).
    variable_count: ClassVar[bool] = False
    # True: a soft gate (``tsa``, arXiv:2605.05222): the training forward runs the block on every token and
    # scales its update by the router's continuous weight, so no token is skipped in training (``route``
    # gives every position, ``Routing.valid`` None); only the causal rule (decode time) skips tokens.
    soft_gate: ClassVar[bool] = False
    # How many routed layers the model has (``place``, called by ``GPT`` once built): a loss that is a mean
    # over the routed layers divides by it (dtrnet's L1, tsa's depth loss); 1 for a router built alone.
    routed_layers: int = 1
    # Set by evaluation (modbench.model.decode.causal_agreement): with collect_stats, ``route``
    # also returns decide_causal on the same hidden state, to score it against top-k.
    collect_causal: bool = False
    # True during the final calibration pass (modbench.model.decode.calibrate_causal_rules), for
    # routers whose causal rule needs more than ``observe`` sees (see the random control).
    calibrating: bool = False
    # True: the router scores by the previous layer's attention (``amod``). The model then makes that
    # layer expose it and passes its ``AttentionSummary`` as ``previous`` (to ``route`` and
    # ``decide_causal_given``), and sets ``attention_source`` on routers that have a previous layer.
    reads_attention: ClassVar[bool] = False
    attention_source: bool = False
    # False: count FLOPs as decoding runs the layer — exactly the tokens the rule processes, so a
    # variable-count router costs what a fixed-count one does at the same share (set on throwaway
    # models by ``modbench.model.sizing.decode_flops_per_token``). True: as the batched training
    # forward runs it (a variable-count router's k_max slots, what ``FlopCounterMode`` sees).
    count_batched_slots: bool = True
    # How the routed block's output meets the residual stream (``Mixing``): x + w·Δ by default; a router
    # declares its own, on the class or (when its config decides) in ``__init__``. Weight "mlp" or "sublayers"
    # only for a weight elementwise in the token's own score (the causal paths recompute it from the token's
    # state inside the block; see ``RoutedBlock.routed_delta``).
    mixing: Mixing = Mixing()
    # Why this router cannot decode with the static, sync-free step (``modbench.model.static_decode``),
    # or "" when it can. That step runs the block on every sequence and mixes by the causal decision on
    # the device, so any rule written as tensor code qualifies, whatever count it picks (a variable
    # count included); a rule that reads the device on the host (``.item()``, a Python branch on a
    # tensor) or needs a shape that depends on the decision says why here, and then decodes with the
    # dynamic ``modbench.model.decode.Decoder`` (``generate(step="auto")`` falls back to it).
    static_decode_refusal: ClassVar[str] = ""

    @property
    def training_host_read(self) -> str:
        """Why this router's training forward reads the device on the host, or "" when it does not. Such a
        forward still compiles to one graph (``modbench.model.gpt.compile_settings`` captures the read), but it
        waits for the device once per routed layer, so it is not sync-free and no CUDA graph can hold it."""
        if self.mlp_experts:  # the model's TopOneMoE
            return ("in full precision its top-1 mixture of experts sizes each expert's slice of tokens on the "
                    "host, one read per routed layer (torch's grouped kernel runs bf16 only); under bf16 "
                    "autocast, as CUDA trains, it runs grouped GEMMs and reads nothing")
        return ""

    def __init__(self, config: VariantConfig) -> None:
        super().__init__()
        self.config = config
        self.collect_stats = False
        # The flags evaluation and calibration switch, as instance attributes from the start: one that a later
        # call first creates changes the module's __dict__, and a compiled model's guard on it recompiles.
        self.collect_causal = False
        self.calibrating = False
        # Raposo et al. 2024 (arXiv:2404.02258) §3.5's second method, on any fixed-count variant (the
        # "<name>+aux" aliases, ``enable_aux_decoding``): None, or the predictor that then decides at
        # decode time. (An instance attribute: a class-level None would shadow the registered module.)
        self.aux_decoder: nn.Module | None = None
        self.aux_threshold: QuantileThreshold | None = None
        self.aux_decode_weight = 0.0

    # --- the hooks a variant implements -------------------------------------------------
    def score(self, x: Tensor) -> Tensor:
        raise NotImplementedError

    def mix_weight(self, selected_scores: Tensor, scores: Tensor) -> Tensor | None:
        return None

    def aux_losses(self, x: Tensor, scores: Tensor, index: Tensor) -> dict[str, Tensor]:
        return {}

    def aux_weights(self, step: int) -> dict[str, float]:
        """Weight of each auxiliary loss at a training step (warm-up lives here)."""
        return {}

    def observe(self, scores: Tensor, topk_values: Tensor) -> None:
        """Called on training forwards with the scores and the selected scores."""

    def set_step(self, step: int) -> None:
        """The per-step hook (``GPT.set_step``, before each training step's forwards): routers whose
        training forward reads state updated once per step (``StepMean``) update it here. Idempotent:
        the trainer also calls ``GPT.set_step`` for FLOP accounting, and a second call finds nothing
        pending. No host sync."""

    def decide_causal(self, x: Tensor) -> Tensor:
        """(B, T) bool: process this token? Uses only the token's own hidden state."""
        raise NotImplementedError

    def attach(self, block: nn.Module) -> None:
        """Called once by the model with the ``modbench.model.gpt.Block`` this router drives, before
        initialisation. A router whose score is part of the block binds the shared modules here
        (``mode_integrated``: the block's MLP norm and expert gate are the router's); others do nothing."""

    def decide_causal_given(self, x: Tensor, previous: Tensor | None) -> Tensor:
        """``decide_causal`` given what the previous routed layer processed ((B, T) bool, or None
        at the first routed layer). Only routers that nest their selection (``nested``) use it, and
        those that read the previous layer's attention (``reads_attention``), for which ``previous`` is
        that layer's ``modbench.model.gpt.AttentionSummary``."""
        return self.decide_causal(x)

    def place(self, index: int, count: int) -> None:
        """Called by ``GPT`` once built: this router is routed layer ``index`` of ``count``."""
        self.routed_layers = count

    def skip_scale_of(self, scores: Tensor) -> Tensor:
        """(B, T) s from this layer's scores: the multiplier on skipped tokens' residual stream under a
        ``Mixing(skip="scale")`` (p-MoD's STRing), on their token-local update under "local" (DTRNet);
        called only under those policies."""
        raise NotImplementedError(f"{type(self).__name__} declares Mixing(skip='scale') but implements no skip_scale_of")

    def assign_causal(self, x: Tensor, previous: object) -> tuple[Tensor, Any]:
        """(decide, handoff) of a ``Mixing(handoff=True)``, called by ``RoutedBlock.decide`` instead of
        ``decide_causal_given``: the (B, T) decision and what the block mixes with and the next routed
        layer receives as ``previous`` (``weight`` (B, T) and ``base`` (B, T, d); ``mor_token_choice``'s
        ``DepthAssignment``)."""
        raise NotImplementedError(f"{type(self).__name__} declares Mixing(handoff=True) but implements no assign_causal")

    def tokens_run(self, k: int, seq_len: int) -> int:
        """How many tokens the routed block runs for a nominal k (the static slot count; a
        variable-count router runs a fixed k_max and masks the slots it does not use, unless
        ``count_batched_slots`` is off)."""
        return k

    def causal_weight(self, x: Tensor, decide: Tensor) -> Tensor | None:
        """(B, T) multiplier on the delta of causally routed tokens, or None (unweighted).

        Default: ``mix_weight`` with each token as its own one-token selection, so a
        token's weight sees only its own score — causal by construction, and exactly the
        training weight when that weight is elementwise in the token's score (sigmoid(r),
        sigmoid(r/τ)). A weight normalised over the selection (a softmax) would become 1
        here: such variants override this (see ``linear_softmax``). Variants that keep
        ``mix_weight``'s default get None without their score being computed (the
        ``random`` control's score would draw from the global RNG). A score that reads the
        position off ``x.shape`` cannot be used here unchanged: a KV-cached decode step
        sees one token at a time (``modbench.model.decode``), so override this instead.
        """
        if type(self).mix_weight is Router.mix_weight:
            return None
        s = self.score(x)
        flat = s.reshape(-1, 1)
        w = self.mix_weight(flat, flat)
        return None if w is None else w.reshape(s.shape)

    def flops_per_token(self, d_model: int) -> tuple[float, float]:
        """(forward, backward) FLOPs per token of scoring, incl. auxiliary predictors."""
        return 0.0, 0.0

    # --- not hooks: views of ``mixing`` ------------------------------------------------------
    def skip_scale(self, x: Tensor) -> Tensor | None:
        """(B, T) s of the tokens this layer skips (``skip_scale_of`` of their scores), or None when the
        policy keeps them (bit-identical): then no score is computed (causal mode and every KV-cached
        decode step ask per routed layer; the random control's score would draw from the global RNG)."""
        return self.skip_scale_of(self.score(x)) if self.mixing.skip != "keep" else None

    # --- decoding by an auxiliary predictor (the "+aux" aliases) --------------------------
    def enable_aux_decoding(self, d_model: int, hidden: int, weight: float) -> None:
        """Decode with Raposo et al. 2024 (arXiv:2404.02258) §3.5's second method: a small MLP on the
        detached hidden state, trained by BCE against this layer's top-k membership (loss
        "aux_decode_bce", weight ``weight``), replaces the variant's causal rule (and, for a router
        that nests its selection, the token must also have been processed by the previous routed
        layer). The causal *weight* stays the variant's own ``causal_weight``.

        The rule is the predictor's logit ≥ a threshold calibrated like every other causal threshold
        here (``QuantileThreshold``: the running per-sequence k-th largest predictor logit in training
        forwards, re-estimated on the final weights by ``calibrate_causal_rules``), so it processes about
        C of the tokens. modbench's own: the paper thresholds the predictor's probability at 0.5;
        with only C of the targets positive, a BCE predictor early in training puts every logit below
        0 (measured: share 0 after 40 steps at C = 0.25, every token skipped).

        The top-k forward is untouched: the predictor's input is detached, so its loss reaches only
        its own parameters (the trainer also clips its gradient on its own: ``GPT.predictor_parameters``),
        and it is initialised from a stream of its own (seeded from the global RNG under
        ``fork_rng``), so a model built with it draws exactly the base variant's initial weights under
        the same seed."""
        # Nesting routers (nested, mor) AND their own rule with the previous layer's bool decision;
        # routers reading attention (amod) get an AttentionSummary there instead, which is no decision.
        self._aux_nests = type(self).decide_causal_given is not Router.decide_causal_given and not self.reads_attention
        with torch.random.fork_rng(devices=[]):
            # an explicit CPU draw: models are also built under a meta-device context (FLOP sizing)
            torch.manual_seed(int(torch.randint(0, 2**62, (), device="cpu")) ^ 0x5EED_A0C5)
            self.aux_decoder = AuxPredictor(d_model, hidden or max(1, d_model // 2))
        self.aux_threshold = QuantileThreshold()
        self.aux_decode_weight = float(weight)
        # This instance's causal rule (the class's stays the base variant's).
        self.decide_causal = self._aux_decide_causal
        self.decide_causal_given = self._aux_decide_causal_given

    def _aux_decide_causal(self, x: Tensor) -> Tensor:
        return self.aux_threshold(self.aux_decoder(x))

    def _aux_decide_causal_given(self, x: Tensor, previous: object) -> Tensor:
        decide = self._aux_decide_causal(x)
        return decide & previous if self._aux_nests and isinstance(previous, Tensor) else decide

    def _aux_decode_loss(self, x: Tensor, scores: Tensor, index: Tensor) -> Tensor:
        """The predictor's BCE against top-k membership; its per-sequence k-th largest logit feeds the
        causal threshold (no gradient, no host sync)."""
        logits = self.aux_decoder(x)
        self.aux_threshold.update(torch.topk(logits.detach(), index.shape[-1], dim=-1, sorted=False).values.amin(-1))
        return F.binary_cross_entropy_with_logits(logits, topk_membership(scores, index))

    def loss_weights(self, step: int) -> dict[str, float]:
        """``aux_weights`` and, with an auxiliary decoder, its BCE's weight: what ``GPT.weighted_aux_loss`` uses."""
        weights = self.aux_weights(step)
        if self.aux_decoder is not None:
            weights = {**weights, "aux_decode_bce": self.aux_decode_weight}
        return weights

    def scoring_flops(self, d_model: int) -> tuple[float, float]:
        """``flops_per_token`` plus the auxiliary decoder's (forward, backward) FLOPs, if any: what the
        model counts as this router's cost per token."""
        fwd, bwd = self.flops_per_token(d_model)
        if self.aux_decoder is not None:
            af, ab = self.aux_decoder.flops(d_model)
            fwd, bwd = fwd + af, bwd + ab
        return fwd, bwd

    # --- the template every variant shares ----------------------------------------------
    def route(self, x: Tensor, k: int, previous: Tensor | None = None) -> Routing:
        """Top-k of ``score``; ``previous`` is what the previous routed layer processed (see
        ``decide_causal_given``)."""
        scores = self.score(x)
        values, top = torch.topk(scores, k, dim=-1, sorted=False)
        index, order = torch.sort(top, dim=-1)
        selected = values.gather(-1, order)
        if self.training:
            self.observe(scores, values)
        weight = self.mix_weight(selected, scores)
        if weight is not None:
            weight = weight.unsqueeze(-1)
        aux = self.aux_losses(x, scores, index) if self.training else {}
        if self.training and self.aux_decoder is not None:
            aux = {**aux, "aux_decode_bce": self._aux_decode_loss(x, scores, index)}
        stats = self.routing_stats(scores, index) if self.collect_stats else {}
        if self.collect_stats and self.collect_causal:
            stats["causal_decide"] = self.decide_causal_given(x, previous)
        skip_scale = self.skip_scale_of(scores) if self.mixing.skip != "keep" else None
        return Routing(index=index, weight=weight, aux_losses=aux, stats=stats, skip_scale=skip_scale)

    @torch.no_grad()
    def routing_stats(self, scores: Tensor, index: Tensor, n_buckets: int = 8) -> dict[str, Tensor]:
        T = scores.shape[-1]
        s = scores.detach().float()
        # Entropy of softmax(scores) over the sequence, normalised by log T: 1 = flat scores.
        p = F.softmax(s - s.amax(-1, keepdim=True), dim=-1)
        entropy = -(p * torch.log(p.clamp_min(1e-30))).sum(-1).mean() / math.log(max(T, 2))
        buckets = torch.div(index * n_buckets, T, rounding_mode="floor").flatten()
        # Counted by comparison, a fixed-size op: bincount's output size depends on the data (a host sync, and
        # a graph break that sent a compiled training step's logging steps back to eager); no scatter, so the
        # count is deterministic on CUDA too.
        hits = buckets.unsqueeze(-1) == torch.arange(n_buckets, device=index.device)
        hist = hits.sum(0).float() / buckets.numel()
        return {
            "fraction": torch.tensor(index.shape[-1] / T),
            "mean_position": index.float().mean() / max(T - 1, 1),
            "score_entropy": entropy,
            "score_mean": s.mean(),
            "score_std": s.std(),
            "position_hist": hist,
        }


class LinearRouter(Router):
    """A router whose score is one logit per token, r = w·x + b (``LinearScorer``, as ``scorer``; a subclass
    may build another scorer, ``make_scorer``).

    The scorer is the router's first module, built right after ``Router.__init__``: a subclass
    builds its own modules after it (its ``__init__`` calls this one first), so the order of the
    initialisation draws is scorer first, then the subclass's, and so are the state_dict keys."""

    def __init__(self, d_model: int, config: VariantConfig) -> None:
        super().__init__(config)
        self.scorer = self.make_scorer(d_model)

    def make_scorer(self, d_model: int) -> nn.Module:
        """The module that gives one logit per token, with a ``flops(d_model)`` method: ``LinearScorer``, or a
        subclass's own (DTRNet's two-layer router)."""
        return LinearScorer(d_model)

    def score(self, x: Tensor) -> Tensor:
        return self.scorer(x)

    def flops_per_token(self, d_model: int) -> tuple[float, float]:
        return self.scorer.flops(d_model)


# --- causal rules several variants share ---------------------------------------------------
class PositiveScoreRule(Router):
    """The causal rule "process iff the score is > 0", taught by Raposo et al. 2024 (arXiv:2404.02258)
    §3.5's first method: an auxiliary BCE of the scores against top-k membership ("router_bce",
    weight ``config.aux_weight``; 0 turns it off), so that the score is positive exactly for the
    top-k members. For a router whose ``score`` is that logit and whose config has ``aux_weight``."""

    def aux_losses(self, x: Tensor, scores: Tensor, index: Tensor) -> dict[str, Tensor]:
        if self.config.aux_weight == 0:
            return {}
        return {"router_bce": F.binary_cross_entropy_with_logits(scores, topk_membership(scores, index))}

    def aux_weights(self, step: int) -> dict[str, float]:
        return {"router_bce": self.config.aux_weight}

    def decide_causal(self, x: Tensor) -> Tensor:
        return self.score(x) > 0


class QuantileRule(Router):
    """The causal rule "process iff the score is >= the running per-sequence k-th largest score of
    the training forwards" (``QuantileThreshold``, which the router builds as ``self.threshold``,
    where it belongs in its initialisation order): about C of the tokens, from the token's own score."""

    threshold: QuantileThreshold

    def observe(self, scores: Tensor, topk_values: Tensor) -> None:
        self.threshold.update(topk_values.amin(-1))

    def decide_causal(self, x: Tensor) -> Tensor:
        return self.threshold(self.score(x))


def topk_membership(scores: Tensor, index: Tensor) -> Tensor:
    """(B, T) float 0/1 target: was this position among the top-k?"""
    return torch.zeros_like(scores).scatter_(-1, index, 1.0)


def linear_ramp(step: int, warmup_steps: int) -> float:
    """0 → 1 over ``warmup_steps`` training steps (1 immediately when warmup is 0)."""
    if warmup_steps <= 0:
        return 1.0
    return min(1.0, max(step, 0) / warmup_steps)
