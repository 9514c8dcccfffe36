"""``null_experts``: null experts in a token-choice mixture (Kilian et al. 2026, arXiv:2601.15370), the causal
generalisation of ``mode_integrated``.

What was read, and how. Of the paper itself only its abstract and the opening paragraph of §1 (the stored
copy of arxiv.org/html/2601.15370v1 available here holds no more); no code released by its authors was
found. The abstract: expert-choice routing gives data sparsity (each expert processes a subset of the
tokens) but "violates causality in autoregressive models"; the paper recovers it "within causal
token-choice MoE by leveraging zero-compute (null) experts within the routing pool. When a token routes
to null experts, those slots consume no compute. The standard load balancing objective trains the model
to uniformly use all experts (real and null) therefore creating data sparsity in expectation". The
mechanism below comes from secondary sources, not re-read in the paper:

- an AI-written review of the paper (themoonlight.io): the router outputs logits for N real experts and
  one null expert, E_null(x) = 0; the null logit is duplicated M = N·(1 − ρ)/ρ times (ρ the target data
  sparsity, the expected share of real slots), top-K is taken over the N + M entries, and the gate is the
  softmax over that augmented vector;
- a third-party implementation, hemant-ship-it/mixture-of-expert-with-null-experts @00e6b82 ``train.py``
  (``MoELayer``): the same construction, the loss (N + M)·Σᵢ fᵢ·Pᵢ over the N + M slots (its "Eq. 6"),
  a router z-loss ("Eq. 7"), an always-on shared expert, top-4, and the gates softmaxed over the selected
  slots, the nulls' zeroed and the real ones renormalised to sum to 1.

What modbench builds (scope "mlp", as ``mode_integrated``: attention on every token, the MLP routed):

- Real experts: the routed block's MLP is a top-1 mixture of E = ``experts`` MLPs
  (``modbench.model.gpt.TopOneMoE(noop=True)``), and its gate has one more output, the null's logit. The
  gate and the RMSNorm before it *are* the block's (``attach`` binds them), so the router and the mixture
  read one softmax, exactly as in ``mode_integrated``. Why the MLP and not the whole block: the paper's
  null experts sit in an MoE FFN's routing pool, and attention runs for every token there; ``mode_integrated``,
  which this generalises, routes the same mixture after attention; and a block-scope router with E real
  experts would decide before attention while the mixture picks its expert after it (two routing
  decisions: ``mode_staged``'s form). E = 1 is the minimal form, the MLP itself the one real expert.
- M null experts: one null logit standing for M = E·(T − k)/k copies, k = max(1, ⌊C·T⌋) the layer's
  count at capacity C, so that the balanced share of the real slots, E/(E + M), is k/T ≈ C (the paper's ρ
  is modbench's capacity). The copies tie, so the top-1 slot is a real expert iff max_e l_e ≥ l_null
  (m = max_e l_e − l_null ≥ 0: ``mode_integrated``'s decode rule), and in the softmax over the E + M slots
  the M copies count as the null logit plus ln M (``NullExpertGate``: its forward adds ln M to the null's
  output; M need not be an integer, every formula takes it as a number). M follows the layer's capacity:
  every training forward sets it from k/T (a buffer, ``log_copies``, saved with the model and read by the
  mixture, by decoding and by evaluation; a calibration pass leaves it); before the first one it is E.
  A layer at k = T (a capacity warm-up's first steps) has no null slot: every token runs a real expert.
- The rule, per token and causal: process (run the top-1 real expert) iff m ≥ 0. No top-k over the
  sequence, so the training rule is the decode rule. The processed tokens run in the fixed k_max =
  min(T, ⌈``slack``·k⌉) slots of the variable-count routers (``VariableCountRouter``: static shapes, the
  highest m first); a sequence with more than k_max tokens at m ≥ 0 drops its lowest ones in training
  (the ``overflow`` statistic), the only way a later token changes an earlier decision.
- Output: x + attn + p_e*·MLP_e*(norm(x + attn)), p_e* the chosen expert's probability in the softmax
  over all E + M slots (the mixture's own gate call, ``Mixing(weight="none")``); a null-routed token keeps
  x + attn, bit for bit.
- Balancing (loss ``null_balance``, weight ``balance_weight``): Switch's (N + M)·Σᵢ fᵢ·Pᵢ over the E + M
  slots, computed on the layer's B·T tokens with the rule's decisions (before the slot cap: what decoding
  processes): fᵢ the fraction of tokens whose top-1 slot is i, Pᵢ the mean probability of slot i; the M
  copies share one logit, so their terms sum to f_null·q_null, f_null the fraction routed to a null and
  q_null one copy's probability. At the uniform use of all E + M slots it is 1, its minimum, and the real
  share is C.

modbench's own, where the sources leave it open or differ: top-1 (Switch) rather than top-K, since a
routed MoD unit runs or not (the paper's top-K gives each token 0…K real experts; the third-party code
uses top-4); the gate value p_e* of the softmax over all slots rather than the third-party code's
renormalisation over the selected real experts (at top-1 that weight would be 1, and the null-or-real
decision would be trained by the balancing loss alone); the gate's bias (zero at start, as
``mode_integrated``'s: it lets the null's share move as a whole); M from the capacity; the k_max slots;
Switch's α = 0.01 as the default weight (the paper's coefficient was not read; the third-party code and a
Marin speedrun config of the method use 0.02). Not mapped: a router z-loss and an always-on shared expert
(in the third-party code; not verified in the paper), expert-parallel dispatch, and the paper's setting
(vision-language training with many experts).

FLOPs (``RoutedBlock.flops``): attention and the router's gate (2·d·(E + 1), and 4·d·(E + 1) backward
through the balancing loss) on every token; one expert MLP and the mixture's gate call on each of the
k_max slots in training (unused slots included: the batched forward runs them), on the processed tokens
alone when decoding (``modbench.model.sizing.decode_flops_per_token`` at the realised share). In eval mode
the mixture runs every expert on every token for exact fixed shapes (``TopOneMoE``), as for ``mode_*``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .base import Mixing, Provenance, Routing, VariantConfig, check_interval, check_nonnegative
from .registry import register_variant
from .token_choice import VariableCountRouter

THIRD_PARTY = "hemant-ship-it/mixture-of-expert-with-null-experts @00e6b82"  # the third-party implementation read


@dataclass(frozen=True)
class NullExpertsConfig(VariantConfig):
    experts: int = 4  # E real MLP experts per routed block (a top-1 mixture); the gate's E + 1 outputs end with a null
    # weight of the load-balancing loss (E + M)·Σᵢ fᵢ·Pᵢ over the E real and M null slots (Switch's α)
    balance_weight: float = 0.01
    slack: float = 2.0  # k_max = min(T, ⌈slack · k⌉) slots per sequence, k = max(1, ⌊C·T⌋)

    def __post_init__(self) -> None:
        check_interval(self, "experts", "[1, 64]")
        check_nonnegative(self, "balance_weight")
        check_interval(self, "slack", "[1, 64]")


class NullExpertGate(nn.Linear):
    """The gate over E real experts and M null ones: a linear layer with E + 1 outputs (the null's logit last),
    whose forward adds ln M to the null's output, so that a softmax over its outputs is the softmax over the
    E + M slots (M copies of one logit) and the null's entry is the mass of all M copies. ``raw`` is the
    linear layer alone: the logits whose top-1 slot decides."""

    def __init__(self, d_model: int, experts: int) -> None:
        super().__init__(d_model, experts + 1)
        nn.init.normal_(self.weight, std=0.02)
        nn.init.zeros_(self.bias)
        # ln M, set from the layer's capacity by each training forward (``NullExpertsRouter.route``); −inf: no null
        self.register_buffer("log_copies", torch.tensor(math.log(experts)))

    def raw(self, h: Tensor) -> Tensor:
        return super().forward(h)

    def forward(self, h: Tensor) -> Tensor:
        out = super().forward(h)
        return torch.cat([out[..., :-1], out[..., -1:] + self.log_copies.to(out.dtype)], dim=-1)


class NullExpertsRouter(VariableCountRouter):
    """Token choice over E expert MLPs + M null experts (one softmax): each token runs its top-1 expert, or nothing."""

    scope = "mlp"
    mixing = Mixing(weight="none")  # x + attn + p_e*·MLP_e*: the mixture weights its own output
    mlp_noop_expert = True

    def __init__(self, d_model: int, config: NullExpertsConfig) -> None:
        super().__init__(d_model, config)  # builds the gate (``make_scorer``) first
        self.mlp_experts = config.experts
        self.norm = nn.RMSNorm(d_model)  # becomes the block's norm2

    def make_scorer(self, d_model: int) -> nn.Module:
        return NullExpertGate(d_model, self.config.experts)

    @property
    def gate(self) -> NullExpertGate:
        """The gate (registered once, as ``scorer``); the block's mixture reads the same module."""
        return self.scorer

    def attach(self, block: nn.Module) -> None:
        block.norm2 = self.norm
        block.mlp.gate = self.scorer

    # --- the null experts' multiplicity, from the layer's capacity ---------------------------------
    @staticmethod
    def copies(k: int, seq_len: int, experts: int) -> float:
        """M = E·(T − k)/k: the balanced real share E/(E + M) is then k/T."""
        return experts * (seq_len - k) / k

    def has_null(self) -> Tensor:
        """() bool: whether the layer has a null slot at all (M > 0)."""
        return ~torch.isneginf(self.scorer.log_copies)

    # --- the rule ----------------------------------------------------------------------------------
    def logits(self, x: Tensor) -> Tensor:
        """(B, T, E + 1) raw gate logits on the MLP's input, the null last."""
        return self.scorer.raw(self.norm(x)).float()

    @staticmethod
    def margin(raw: Tensor) -> Tensor:
        return raw[..., :-1].amax(-1) - raw[..., -1]

    def score(self, x: Tensor) -> Tensor:
        """m = max_e l_e − l_null: the top-1 of the E + M slots is a real expert iff m ≥ 0."""
        return self.margin(self.logits(x))

    def decide_causal(self, x: Tensor) -> Tensor:
        return (self.score(x) >= 0) | ~self.has_null()

    def route(self, x: Tensor, k: int, previous: Tensor | None = None) -> Routing:
        T = x.shape[1]
        E = self.config.experts
        if self.training and not self.calibrating:
            copies = self.copies(k, T, E)
            self.scorer.log_copies.fill_(math.log(copies) if copies > 0 else -math.inf)
        raw = self.logits(x)
        margin = self.margin(raw)
        no_null = ~self.has_null()
        values, top = torch.topk(margin, self.tokens_run(k, T), dim=-1, sorted=False)
        index, order = torch.sort(top, dim=-1)
        valid = (values.gather(-1, order) >= 0) | no_null
        wanting = (margin >= 0) | no_null  # the rule's decisions before the k_max cap: what decoding processes
        aux = {}
        if self.training and self.config.balance_weight > 0:
            aux["null_balance"] = self.balance_loss(raw, wanting)
        stats = {}
        if self.collect_stats:
            stats = self.routing_stats(margin, index)
            stats["fraction"] = valid.float().sum(-1).mean() / T
            stats["overflow"] = (wanting.sum(-1) > valid.sum(-1)).float().mean()
            if self.collect_causal:
                stats["causal_decide"] = self.decide_causal(x)
        return Routing(index=index, weight=None, aux_losses=aux, stats=stats, valid=valid)

    def balance_loss(self, raw: Tensor, real: Tensor) -> Tensor:
        """(E + M)·Σᵢ fᵢ·qᵢ over the E + 1 gate outputs: fᵢ the fraction of tokens whose top-1 slot is real
        expert i, or a null (f_null, all M copies); qᵢ the mean softmax probability of real expert i over the
        E + M slots, or of *one* null copy (the M copies' Σ fⱼ·qⱼ is f_null·q_null). Switch's
        (N + M)·Σ fᵢ·Pᵢ over the slots, written for M as a number."""
        E = self.config.experts
        log_copies = self.scorer.log_copies
        shifted = torch.cat([raw[..., :-1], raw[..., -1:] + log_copies], dim=-1)
        q = torch.exp(raw - torch.logsumexp(shifted, dim=-1, keepdim=True))  # a null copy's, not all M's
        slot = torch.where(real, raw[..., :-1].argmax(-1), E)
        f = F.one_hot(slot, E + 1).float().mean((0, 1))
        return (E + log_copies.exp()) * (f * q.mean((0, 1))).sum()

    def aux_weights(self, step: int) -> dict[str, float]:
        # The mixture's own Switch loss over the real experts (``expert_balance``, which the block adds for every
        # ``TopOneMoE``) is logged unweighted: ``null_balance`` balances the real experts too.
        return {"null_balance": self.config.balance_weight, "expert_balance": 0.0}

    def selected_weight(self, p: Tensor, valid: Tensor) -> Tensor:
        raise NotImplementedError("route routes: the mixture weights its own output")

    def load_losses(self, p: Tensor, capacity: float) -> dict[str, Tensor]:
        raise NotImplementedError("route computes the balancing loss from the gate's logits")

    def flops_per_token(self, d_model: int) -> tuple[float, float]:
        out = self.config.experts + 1
        # Backward: input and weight gradients, through the balancing loss alone (the rule passes no gradient;
        # the processed tokens' weights come from the mixture's own gate call, counted with the MLP).
        return 2.0 * d_model * out, (4.0 * d_model * out if self.config.balance_weight > 0 else 0.0)


register_variant("null_experts", NullExpertsRouter, config=NullExpertsConfig,
                 source="Null experts in token-choice MoE, Kilian et al. 2026 (arXiv:2601.15370); "
                        f"mechanism read in a review and a third-party implementation ({THIRD_PARTY})",
                 # The paper's text read: its abstract alone. The duplicated null logit, the slot softmax and the
                 # balancing loss over the slots are the secondary sources'; top-1, the MLP scope, M from the
                 # capacity and the slots are modbench's adaptation; the decode rule is the training rule.
                 provenance=Provenance("paper's recipe", "paper's recipe", "paper's recipe",
                                       (("Kilian et al. 2026 (arXiv:2601.15370) abstract and §1 opening",
                                         "paper's text"),
                                        ("Kilian et al. 2026 method (null logit duplicated M = N(1 − ρ)/ρ times, "
                                         "top-K and softmax over the N + M), as a themoonlight.io review states it",
                                         "secondary"),
                                        (f"{THIRD_PARTY} train.py (MoELayer)", "secondary"))))
