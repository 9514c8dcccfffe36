"""``mode_staged``: Mixture-of-Depths-and-Experts, staged (Raposo et al. 2024 §4 / Figure 7).

Source: Raposo et al. 2024 (arXiv:2404.02258), "Mixture-of-Depths-and-Experts (MoDE)": MoD
combined with a mixture-of-experts MLP. In the *staged* form the MoD router first decides
which tokens go through the block at all (here ``sigmoid``'s router: top-k of r, delta ×
sigmoid(r), causal rule r > 0 taught by the auxiliary BCE); the tokens that do then run
attention and a top-1 mixture of ``experts`` MLPs (Switch-style token choice with its
load-balancing loss, ``modbench.model.gpt.TopOneMoE``). FLOPs: each processed token runs one
expert (one MLP's FLOPs) plus the expert gate, so the count is exact for any assignment.

Not built: the paper's *integrated* MoDE (a no-op expert among the experts, routing and
expert choice in one softmax), whose processed count varies with the data.
"""

from __future__ import annotations

from dataclasses import dataclass

from .registry import register_variant
from .sigmoid import SigmoidConfig, SigmoidRouter


@dataclass(frozen=True)
class ModeConfig(SigmoidConfig):
    experts: int = 4  # MLP experts per routed block (top-1)
    balance_weight: float = 0.01  # weight of the experts' load-balancing loss

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 2 <= self.experts <= 64:
            raise ValueError(f"experts must be in [2, 64], got {self.experts}")
        if self.balance_weight < 0:
            raise ValueError(f"balance_weight must be >= 0, got {self.balance_weight}")


class ModeStagedRouter(SigmoidRouter):
    def __init__(self, d_model: int, config: ModeConfig) -> None:
        super().__init__(d_model, config)
        self.mlp_experts = config.experts

    def aux_weights(self, step: int) -> dict[str, float]:
        return {**super().aux_weights(step), "expert_balance": self.config.balance_weight}


@register_variant("mode_staged", config=ModeConfig,
                  source="Raposo et al. 2024 §4, Mixture-of-Depths-and-Experts (staged), arXiv:2404.02258")
def build_mode_staged(d_model: int, config: ModeConfig) -> ModeStagedRouter:
    """MoD routing (sigmoid), then a top-1 mixture of expert MLPs on the processed tokens."""
    return ModeStagedRouter(d_model, config)
