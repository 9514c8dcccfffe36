"""``mor_token_choice``: Mixture-of-Recursions' token-choice router — each token's depth chosen up front.

Source: Bae et al. 2025, Mixture-of-Recursions (arXiv:2507.10524) §2.2 "token-choice routing", as its
authors' released code implements it (raymin0223/mixture_of_recursions
``model/mor_model/token_choice_router.py`` ``MoRLlamaDecoderLayer``, the loss weights in
``util/trainer_pt.py`` and the token-choice config
``conf/pretrain/…_mor_token_softmax_bal_loss_coeff_0.1_linear_zloss_1e-5.yaml``). The upstream
repository is not stored where this was written; those files were read in public forks of it that
keep them (sudeshmu/mixture_of_recursions, anxi710/mixture_of_recursions), hence "secondary" in the
provenance. The expert-choice router of the same paper is ``mor``.

Where it sits: the routed layers of the model, in order, are the steps s = 0 … M−1 a token may run
(on a recursive model, ``ModelConfig.recursion``, the applications of the shared block; route them
with a one-layer block, as for ``mor``). ``GPT`` tells each router its place (``place``).

- Depth, chosen once (the code's top-1 over ``num_recursion`` experts): at the first routed layer a
  linear router without bias, r = W·(x/τ) (the code's ``LinearRouter``, N(0, 0.02) init, and its
  ``mor_router(x / temp)``), gives N logits; the token's depth is d = min_depth + argmax r, the number
  of routed layers it runs, and it is processed at step s iff d > s *and* it was processed at s − 1.
  ``min_depth = 1`` is the released code exactly: N = M choices, every token runs the first step
  (route every application of the shared block, pattern ``fixed:1,1`` under middle_cycle, with the
  first step's capacity 1, e.g. ``capacities = "1,2/3,1/3"``). ``min_depth = 0`` (the default,
  modbench's own) adds the choice "none", N = M + 1, so the first routed layer routes too (a single
  routed layer is then a plain token-choice layer, as the registry's sweeps build it).
- Weighting, as in the code: g = α·softmax(r)_chosen (``router_func = "softmax"``, the released
  config's α = 1.0; option ``"sigmoid"``: α·sigmoid(r)_chosen, where the code's default α is 0.1).
  A token's steps run unweighted, x ← x + Δ (the code's ``updates``), except the step where it leaves:
  there it becomes entry + g·(x + Δ), entry its state at the first routed layer (the code's
  ``final_x = x.clone()`` at the layer's input, ``scatter_add`` of g times the block's output). On a
  recursive model whose first routed layer is the first application this is the code's arithmetic;
  a token of depth 0 leaves the stream untouched. ``GPT`` passes the choice on: the first routed layer
  returns a ``DepthAssignment`` (logits, depth, g, entry, what it processed) that the next routed
  layers receive as ``previous`` (top-k forward, causal forward and KV-cached decoding alike), and
  each step's weight and base come from it: the router's mixing policy is ``Mixing(output=True,
  handoff=True)``, base + weight·(x + Δ) (``RoutedBlock.mix``).
- Balancing loss, the code's ``balancing == "loss"`` (Switch-style): N·Σᵢ fᵢ·Pᵢ over the B·T tokens,
  fᵢ the share of tokens choosing i, Pᵢ the mean of α·softmax(r)ᵢ, weight ``balance_weight`` (the
  config's ``coeff`` 0.1; the trainer adds ``coeff · balancing_loss``). The code divides it by
  ``num_items_in_batch / (bs · seq_len)``, the Hugging Face trainer's gradient-accumulation
  normaliser; modbench's trainer averages the micro-batches itself, so that factor is 1 here. Its
  minimum is uniform depths: with ``min_depth = 1`` and M = 3 steps, shares 1, 2/3, 1/3, the
  ``capacities`` to give (they set the slots below; no loss targets them).
- Router z-loss, the code's: mean over tokens of logsumexp(r)², weight ``z_weight`` (``z_coeff`` 1e-5,
  ``z_loss: true`` in the released token config).
- Not implemented: the code's ``loss_free`` balancing (a router bias moved outside the loss), its
  ``bal_warmup_step`` (every token at full depth during a warm-up) and the MLP routers.

Causal by construction: the depth comes from the token's own state at the first routed layer, so the
rule (process iff d > s and processed at s − 1) is the same in training and at decode time — no
predictor to train, no train/decode gap. **Batched execution** (modbench's own; the code pads every
step to the batch's longest row, one host sync per step): ``token_choice``'s slots
(``VariableCountRouter``): k_max = min(T, ⌈slack·k⌉) per step, k = max(1, ⌊C·T⌋) that step's capacity,
the processed tokens among them marked ``valid``; default slack 3 (``token_choice``: 2), since no loss
pulls a step's share towards its capacity here (with slack 2 a fresh router filled every slot of the
registry sweep's one-layer block at C = 1/4: its balanced share there is 1/2). A sequence with more eligible tokens than k_max
drops those with the smallest margin (below), logged as ``overflow``: only then does training differ
from decoding, and a dropped token keeps its last unweighted output (it never reaches its exit
step). Slot priority at step s (modbench's own): the margin max_{i > s−min_depth} rᵢ −
max_{i ≤ s−min_depth} rᵢ, positive exactly when d > s. Training FLOPs count the k_max slots and the
router at the first routed layer (2·d·N per token; later steps compute no score); decoding runs
exactly the processed tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from modbench.errors import ModbenchError

from .base import Mixing, Provenance, Router, Routing, VariantConfig, check_choice, check_interval, check_nonnegative
from .registry import register_variant
from .token_choice import VariableCountRouter

ROUTER_FUNCS = ("softmax", "sigmoid")
_MASK = 1e4  # subtracted from the priority of tokens the previous step did not process
_ALWAYS = 1e4  # the margin of a step every token runs (step s < min_depth)


@dataclass(frozen=True)
class MorTokenChoiceConfig(VariantConfig):
    alpha: float = 1.0  # g = α·softmax(r)_chosen (the released token config: softmax, α = 1.0)
    router_func: str = "softmax"  # or "sigmoid": g = α·sigmoid(r)_chosen
    temperature: float = 1.0  # τ in r = W·(x/τ)
    balance_weight: float = 0.1  # N·Σ fᵢ·Pᵢ (the code's coeff)
    z_weight: float = 1e-5  # mean logsumexp(r)² (the code's z_coeff)
    min_depth: int = 0  # 1: every token runs the first routed layer (the released code); 0: may run none
    # k_max = min(T, ⌈slack · k⌉) slots per step. 3, not token_choice's 2: no loss pulls a step's share
    # towards its capacity here (the balancing aims at uniform depths), so the slots need more headroom.
    slack: float = 3.0

    def __post_init__(self) -> None:
        check_interval(self, "alpha", "(0, 10]")
        check_choice(self, "router_func", ROUTER_FUNCS)
        check_interval(self, "temperature", "(0, 100]")
        check_nonnegative(self, "balance_weight", "z_weight")
        if self.min_depth not in (0, 1):
            raise ValueError(f"min_depth must be 0 or 1, got {self.min_depth}")
        check_interval(self, "slack", "[1, 64]")


@dataclass
class DepthAssignment:
    """What a ``mor_token_choice`` layer hands to the next routed layer (its ``previous``), for the
    tokens of one forward (or one decode step): the first routed layer's choice and this step's mix."""

    logits: Tensor  # (B, T, N) the first routed layer's router logits, detached (every later decision reads them)
    depth: Tensor  # (B, T) long: routed layers the token runs
    gate: Tensor  # (B, T) g = α·softmax(r)_chosen, with its gradient
    entry: Tensor  # (B, T, d) the token's state at the first routed layer
    processed: Tensor  # (B, T) bool: processed at this step
    step: int  # this step's index among the routed layers
    # Read by ``RoutedBlock.mix_causal``: a processed token becomes base + weight·(x + Δ) — entry + g·(x + Δ)
    # where it leaves at this step, 0 + 1·(x + Δ) where it goes on.
    weight: Tensor  # (B, T)
    base: Tensor  # (B, T, d)


class MorTokenChoiceRouter(VariableCountRouter):
    """Depth d = argmax of a linear router at the first routed layer; step s runs the tokens with d > s; entry + g·(x + Δ) at the last.

    Token-choice depth at the first routed layer; later routed layers follow it (see module doc)."""

    scope = "block"
    # base + weight·(x + Δ), both handed over with the routing (top-k: ``Routing.base``; causally
    # ``assign_causal``'s ``DepthAssignment``)
    mixing = Mixing(weight="block", output=True, handoff=True)

    def __init__(self, d_model: int, config: MorTokenChoiceConfig) -> None:
        # Not VariableCountRouter.__init__: no one-logit scorer and no budget controller; the slots
        # (``tokens_run``, ``variable_count``) are what this router shares with it.
        Router.__init__(self, config)
        self.controller = None
        self.d_model = d_model
        self.step_index = 0
        self.steps = 1  # a router on its own is the only routed layer until ``place`` says otherwise
        self.depth_router: nn.Linear | None = self._linear(self.choices)

    @property
    def choices(self) -> int:
        """N: the depths a token may choose, min_depth … steps."""
        return self.steps + 1 - self.config.min_depth

    def _linear(self, n: int) -> nn.Linear:
        layer = nn.Linear(self.d_model, n, bias=False)  # the code's LinearRouter: no bias, N(0, 0.02)
        nn.init.normal_(layer.weight, std=0.02)
        return layer

    def place(self, step: int, steps: int) -> None:
        """Called by ``GPT`` once built: this is routed layer ``step`` of ``steps``. Only the first owns a
        router (N outputs); the later ones follow the depth it assigns."""
        super().place(step, steps)
        self.step_index, self.steps = step, steps
        if self.choices < 2:
            raise ModbenchError(f"mor_token_choice with min_depth = 1 needs at least 2 routed layers, got {steps}: "
                                "route more layers or use min_depth = 0")
        if step > 0:
            self.depth_router = None
        elif self.depth_router is None or self.depth_router.out_features != self.choices:
            self.depth_router = self._linear(self.choices)

    # --- the choice at the first routed layer -----------------------------------------------------
    def logits(self, x: Tensor) -> Tensor:
        """(B, T, N) r = W·(x/τ)."""
        if self.depth_router is None:
            raise RuntimeError(f"routed layer {self.step_index} of mor_token_choice follows the first one's choice: it has no router")
        return self.depth_router(x / self.config.temperature)

    def probabilities(self, logits: Tensor) -> Tensor:
        f = F.softmax(logits.float(), dim=-1) if self.config.router_func == "softmax" else torch.sigmoid(logits.float())
        return self.config.alpha * f

    def choose(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """(logits, depth, gate, probabilities) of the first routed layer."""
        logits = self.logits(x)
        probs = self.probabilities(logits)
        index = logits.detach().argmax(-1)  # top-1 (softmax and sigmoid keep the order of the logits)
        gate = probs.gather(-1, index.unsqueeze(-1)).squeeze(-1)
        return logits, index + self.config.min_depth, gate, probs

    def margin(self, logits: Tensor, step: int) -> Tensor:
        """(B, T): max_{i > c} rᵢ − max_{i ≤ c} rᵢ with c = step − min_depth; > 0 exactly when the chosen
        depth exceeds ``step`` (argmax takes the first of equal maxima, and so does the strict >)."""
        c = step - self.config.min_depth
        r = logits.detach().float()
        if c < 0:
            return torch.full(r.shape[:-1], _ALWAYS, dtype=r.dtype, device=r.device)
        return r[..., c + 1 :].amax(-1) - r[..., : c + 1].amax(-1)

    def score(self, x: Tensor) -> Tensor:
        """The first routed layer's slot priority: the margin of running it."""
        return self.margin(self.logits(x), 0)

    # --- one step --------------------------------------------------------------------------------
    def _start(self, x: Tensor, previous: object) -> tuple[DepthAssignment | None, Tensor, Tensor, Tensor, Tensor, int, Tensor | None]:
        if isinstance(previous, DepthAssignment):
            a = previous
            return a, a.logits, a.depth, a.gate, a.entry, a.step + 1, None
        logits, depth, gate, probs = self.choose(x)
        return None, logits, depth, gate, x, 0, probs

    def _assignment(self, logits: Tensor, depth: Tensor, gate: Tensor, entry: Tensor, processed: Tensor,
                    step: int) -> DepthAssignment:
        leaving = processed & (depth == step + 1)
        weight = torch.where(leaving, gate, torch.ones_like(gate))
        base = torch.where(leaving.unsqueeze(-1), entry, torch.zeros_like(entry))
        return DepthAssignment(logits.detach(), depth, gate, entry, processed, step, weight, base)

    def assign_causal(self, x: Tensor, previous: object) -> tuple[Tensor, DepthAssignment]:
        """(decide, assignment): process iff the chosen depth exceeds this step and the previous step
        processed the token — the token's own state only. Read by ``RoutedBlock.decide``."""
        before, logits, depth, gate, entry, step, _ = self._start(x, previous)
        decide = self.margin(logits, step) > 0
        if before is not None:
            decide = decide & before.processed
        return decide, self._assignment(logits, depth, gate, entry, decide, step)

    def decide_causal(self, x: Tensor) -> Tensor:
        return self.assign_causal(x, None)[0]

    def decide_causal_given(self, x: Tensor, previous: object) -> Tensor:
        return self.assign_causal(x, previous)[0]

    def route(self, x: Tensor, k: int, previous: object = None) -> Routing:
        before, logits, depth, gate, entry, step, probs = self._start(x, previous)
        B, T, d = x.shape
        margin = self.margin(logits, step)
        key = margin if before is None else torch.where(before.processed, margin, margin - _MASK)
        values, top = torch.topk(key, self.tokens_run(k, T), dim=-1, sorted=False)
        index, order = torch.sort(top, dim=-1)
        valid = values.gather(-1, order) > 0  # eligible: chosen depth > step and processed at step − 1
        processed = torch.zeros(B, T, dtype=torch.bool, device=x.device).scatter_(1, index, valid)
        a = self._assignment(logits, depth, gate, entry, processed, step)
        weight = a.weight.gather(1, index).unsqueeze(-1)
        base = a.base.gather(1, index.unsqueeze(-1).expand(-1, -1, d))
        aux = self.balance_losses(logits, depth, probs) if self.training and probs is not None else {}
        stats = {}
        if self.collect_stats:
            wanting = key > 0  # the rule's decisions before the k_max cap: what decoding processes
            stats = self.routing_stats(margin, index)
            stats["fraction"] = valid.float().sum(-1).mean() / T
            stats["overflow"] = (wanting.sum(-1) > valid.sum(-1)).float().mean()
            if step == 0:
                stats["mean_depth"] = depth.float().mean()
            if self.collect_causal:
                stats["causal_decide"] = self.decide_causal_given(x, previous)
        return Routing(index=index, weight=weight, aux_losses=aux, stats=stats, valid=valid, base=base, handoff=a)

    # --- losses, FLOPs ---------------------------------------------------------------------------
    def balance_losses(self, logits: Tensor, depth: Tensor, probs: Tensor) -> dict[str, Tensor]:
        """The code's balancing loss N·Σᵢ fᵢ·Pᵢ and router z-loss mean(logsumexp(r)²), over all tokens."""
        cfg = self.config
        out = {}
        if cfg.balance_weight:
            n = probs.shape[-1]
            share = F.one_hot(depth - cfg.min_depth, n).float().mean((0, 1))  # fᵢ / N: no gradient, no host sync
            out["balance"] = n * (share * probs.mean((0, 1))).sum()
        if cfg.z_weight:
            out["router_z"] = torch.logsumexp(logits.float(), dim=-1).square().mean()
        return out

    def aux_weights(self, step: int) -> dict[str, float]:
        return {"balance": self.config.balance_weight, "router_z": self.config.z_weight}

    def flops_per_token(self, d_model: int) -> tuple[float, float]:
        if self.depth_router is None:
            return 0.0, 0.0
        n = self.depth_router.out_features  # forward 2·d·N; backward input and weight grads, 2 × forward
        return 2.0 * d_model * n, 4.0 * d_model * n

    def extra_repr(self) -> str:
        return f"step={self.step_index}, steps={self.steps}, choices={self.choices}"


register_variant("mor_token_choice", MorTokenChoiceRouter, config=MorTokenChoiceConfig,
                 source="Mixture-of-Recursions, Bae et al. 2025 (arXiv:2507.10524) §2.2, token-choice routing: "
                        "each token's recursion depth chosen at the first step",
                 # Selection and weighting follow the released token_choice_router.py (read in forks that keep it);
                 # min_depth = 0 (the default), the k_max slots and their priority are modbench's own. Decoding needs
                 # no rule of its own: the training rule is causal.
                 provenance=Provenance("paper's recipe", "paper", "paper",
                                       (("Mixture-of-Recursions §2.2", "secondary"),
                                        ("raymin0223/mixture_of_recursions token_choice_router.py, via forks", "secondary"))))
