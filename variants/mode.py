"""``mode_staged``: Mixture-of-Depths-and-Experts, staged (Raposo et al. 2024 §4.3 / Figure 7).

Source: Raposo et al. 2024 (arXiv:2404.02258), "Mixture-of-Depths-and-Experts (MoDE)": MoD
combined with a mixture-of-experts MLP. In the *staged* form the MoD router first decides
which tokens go through the block at all (here ``sigmoid``'s router: top-k of r, delta ×
sigmoid(r), causal rule r > 0 taught by the auxiliary BCE); the tokens that do then run
attention and a top-1 mixture of ``experts`` MLPs (Switch-style token choice with its
load-balancing loss, ``modbench.model.gpt.TopOneMoE``). FLOPs: each processed token runs one
expert (one MLP's FLOPs) plus the expert gate, so the count is exact for any assignment.

``mode_integrated`` (the paper's *integrated* MoDE) is below, with its own docstring.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor, nn

from .base import Mixing, PositiveScoreRule, Provenance, VariantConfig, check_interval, check_nonnegative
from .registry import register_variant
from .sigmoid import SigmoidConfig, SigmoidRouter


@dataclass(frozen=True)
class ModeConfig(SigmoidConfig):
    experts: int = 4  # MLP experts per routed block (top-1)
    balance_weight: float = 0.01  # weight of the experts' load-balancing loss

    def __post_init__(self) -> None:
        super().__post_init__()
        check_interval(self, "experts", "[2, 64]")
        check_nonnegative(self, "balance_weight")


class ModeStagedRouter(SigmoidRouter):
    """MoD routing (sigmoid), then a top-1 mixture of expert MLPs on the processed tokens."""

    def __init__(self, d_model: int, config: ModeConfig) -> None:
        super().__init__(d_model, config)
        self.mlp_experts = config.experts

    def aux_weights(self, step: int) -> dict[str, float]:
        return {**super().aux_weights(step), "expert_balance": self.config.balance_weight}


register_variant("mode_staged", ModeStagedRouter, config=ModeConfig,
                 source="Raposo et al. 2024 §4.3, Mixture-of-Depths-and-Experts (staged), arXiv:2404.02258",
                 # The paper gives no equations for MoDE: the Switch-style top-1 mixture and its balance loss are ours.
                 provenance=Provenance("paper's recipe", "paper's recipe", "paper's recipe",
                                       (("Raposo et al. 2024 §4.3 / Figure 7", "secondary"),
                                        ("Switch Transformer (arXiv:2101.03961) §2.1-2.2", "secondary"))))


# --- integrated MoDE -----------------------------------------------------------------------------
@dataclass(frozen=True)
class ModeIntegratedConfig(VariantConfig):
    experts: int = 4  # real MLP experts per routed block; the gate has experts + 1 outputs (+ the no-op)
    aux_weight: float = 0.01  # weight of BCE(margin, top-k membership): teaches the causal rule; 0 turns it off
    balance_weight: float = 0.01  # weight of the real experts' load-balancing loss

    def __post_init__(self) -> None:
        check_interval(self, "experts", "[2, 64]")
        check_nonnegative(self, "aux_weight", "balance_weight")


class ModeIntegratedRouter(PositiveScoreRule):
    """One softmax over E expert MLPs + a no-op: top-k tokens by the experts' margin over the no-op run their top-1 expert.

    ``mode_integrated``: Mixture-of-Depths-and-Experts, integrated (Raposo et al. 2024,
    arXiv:2404.02258, §4.3 "Mixture-of-Depths-and-Experts (MoDE)" and Figure 7, its integrated panel).

    What the paper describes (§4.3 text and Figure 7; it gives no equations for MoDE): *integrated*
    MoDE implements MoD routing by putting "no-op" experts among the conventional MLP experts, so
    one routing operation sends each token to an expert MLP or to a no-op (the residual path
    around the MLP); the paper contrasts it with the staged form, which routes before
    self-attention and so lets tokens skip it, and reports it better than shrinking expert
    capacity and relying on token dropping. Figure 7's integrated panel (the part of the paper the
    stored search copies here hold; the text above is as we read it) draws normalise →
    self-attention on every token, then one route over the experts. So the integrated router sits
    where an MoE's router sits, after attention: every token runs attention and the no-op saves the
    MLP, hence ``scope = "mlp"`` (attention on all T tokens, the MLP on the routed ones).

    What modbench builds:

    - One gate, softmax over E real experts + 1 no-op expert on the MLP's input: logits
      l = W·RMSNorm(x) + b, W of shape (E + 1, d). The gate and the norm *are* the block's
      ``norm2`` and its ``TopOneMoE(noop=True)`` gate (``attach`` binds them), so the router and the
      mixture read one softmax.
    - Expert-choice capacity as everywhere in modbench: the k = C·T tokens with the largest margin
      m = max_e l_e − l_noop (the best real expert's log-odds over the no-op, log(p_e*/p_noop)) go
      through the MLP, each to its top-1 real expert e*, output × p_e* (its probability in the
      softmax over all E + 1: the no-op's share scales the update down, and carries the LM loss's
      gradient to the no-op logit); the other tokens keep x + attention bit for bit.
    - Causal rule at decode time: m > 0, i.e. the token's argmax is a real expert, not the no-op —
      the integrated-MoDE decision itself. Top-k and the rule use the same m, and the auxiliary
      BCE(m, top-k membership) (``sigmoid``'s recipe, ``PositiveScoreRule``: on the scores themselves,
      Raposo et al. §3.5 method 1) teaches m > 0 exactly for the top-k members.
    - Switch load balancing over the real experts, on the processed tokens (``TopOneMoE``'s loss,
      the probabilities renormalised over the real experts so that it cannot be lowered by
      shifting mass onto the no-op).

    Where it departs from the paper, or fills in what it leaves open: one no-op expert (the paper
    says "no-op experts", number unstated); the share processed is fixed by one top-k at C
    (static shapes, a FLOP count exact and comparable with every other variant) instead of
    whatever per-expert capacities the paper's MoE used; the processed tokens' experts have no
    capacity limit (no token dropping); top-k is on the margin m
    rather than on 1 − p_noop (monotone in Σ_e p_e/p_noop rather than max_e p_e/p_noop), so that
    the trained selection and the causal argmax rule threshold one and the same number.

    FLOPs (``RoutedBlock.flops``): the gate over E + 1 outputs on every token (the router), one
    MLP per processed token, and the gate again on the k processed tokens, where the mixture
    recomputes its softmax from its own input (2·d·(E + 1) per processed token, counted; this keeps
    the mixture a function of its input on every path: top-k, causal mode, KV-cached decoding).
    """

    scope = "mlp"
    mixing = Mixing(weight="none")  # x + Δ: the mixture weights its own output by p_e*
    mlp_noop_expert = True

    def __init__(self, d_model: int, config: ModeIntegratedConfig) -> None:
        super().__init__(config)
        self.mlp_experts = config.experts
        self.norm = nn.RMSNorm(d_model)  # becomes the block's norm2
        # The last output is the no-op. A bias (zero at init) lets the no-op's share shift as a whole: the
        # causal rule m > 0 needs the k-th largest margin near 0, and a normed input has no constant part.
        self.gate = nn.Linear(d_model, config.experts + 1)
        nn.init.normal_(self.gate.weight, std=0.02)
        nn.init.zeros_(self.gate.bias)

    def attach(self, block: nn.Module) -> None:
        block.norm2 = self.norm
        block.mlp.gate = self.gate

    def logits(self, x: Tensor) -> Tensor:
        """(B, T, E + 1) gate logits, the no-op last."""
        return self.gate(self.norm(x)).float()

    def score(self, x: Tensor) -> Tensor:
        l = self.logits(x)
        return l[..., :-1].amax(-1) - l[..., -1]

    def aux_weights(self, step: int) -> dict[str, float]:
        return {**super().aux_weights(step), "expert_balance": self.config.balance_weight}

    def flops_per_token(self, d_model: int) -> tuple[float, float]:
        out = self.config.experts + 1
        # Backward: input and weight gradients, which exist only through the BCE (top-k itself
        # passes no gradient; the processed tokens' weights come from the mixture's own gate call).
        return 2.0 * d_model * out, (4.0 * d_model * out if self.config.aux_weight > 0 else 0.0)


register_variant("mode_integrated", ModeIntegratedRouter, config=ModeIntegratedConfig,
                 source="Raposo et al. 2024 §4.3 / Figure 7, Mixture-of-Depths-and-Experts (integrated), arXiv:2404.02258",
                 provenance=Provenance("paper's recipe", "paper's recipe", "paper's recipe",
                                       (("Raposo et al. 2024 §4.3 / Figure 7", "secondary"),)))
