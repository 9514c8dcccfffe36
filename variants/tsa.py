"""``tsa``: Token-Selective Attention (TSA; "Adaptive Computation Depth via Learned Token Routing in
Transformers", A. Abdelmuniem Abdalla Mohammed, arXiv:2605.05222): a per-token halting gate, a two-layer
MLP, on each block's residual update; soft in training, a hard threshold at inference.

What was read: the paper's LaTeX source as its author released it beside the code, AhmedHamadto/TSA at
commit 7c12855d5c676617f8f4f7ae0d85a15eb1e9fd3b (``docs/paper/tsa_paper_arxiv.tex``: §2 Method, eqs. 2–5;
§3 with Tables 2, 3 and 6; §3.6; Appendix A. The repository's ``CITATION.cff`` and the LaTeX author block
name the arXiv paper's author, and its abstract and introduction are word for word those of
arXiv:2605.05222v1, whose own rendering was read only up to the introduction), and the code at the same
commit: ``src/tsa/modules/topological_attention/graph_router.py`` (``TokenRouter``), ``sparse_attention.py``
(``SparseTransformerBlock``), ``variable_depth.py`` (``TSATransformer``), ``src/tsa/mlx/tsa.py``,
``src/tsa/mlx/sparse_infer.py`` (``GatherSparseBlock``) and the experiment scripts
``scripts/phase6_language.py``, ``scripts/phase7_enwik8_mlx.py``. No other implementation was found. What
they define:

- Placement (§2.1): blocks f_0 … f_{L−1}; the stem f_0 always runs; router r_l, after block f_l, gates
  f_{l+1} (l = 0 … L − 2, L − 1 routers), reading the hidden state that enters f_{l+1}.
- Router (§2.2, ``TokenRouter``): p = σ(W₂·ReLU(W₁h + b₁) + b₂), hidden width max(d/4, 16), d²/4 + d/2 + 1
  parameters each (≈83K for the five routers of the d = 256, L = 6 model: 1.7 % of its 4.78M), PyTorch's
  default ``nn.Linear`` initialisation with b₂ = −1 (p = σ(−1) ≈ 0.27 at the start). p is the token's
  *halting* probability, from its own hidden state only (so the rule is causal as it stands).
- Training, a soft gate (§2.3, eqs. 3–4, ``SparseTransformerBlock.forward``): every token runs the block,
  h ← h + (1 − p)·attn(LN(h)), then h ← h + (1 − p)·ffn(LN(h)): both residual updates scaled by the token's
  active weight 1 − p, the FFN reading the gated state. Nothing is skipped ("During training, all layers
  execute fully", §2.5), and the reported validation losses are this soft model's.
- Loss (§2.4, eq. 5): λ·(1/(L − 1))·Σ_l mean(1 − p_l), the active fraction averaged over batch, positions
  and routing points, added to the task loss; λ = 0.001 in the language experiments (the PyTorch
  ``TSAConfig`` default is 0.01, the MLX one and ``phase6_language.py`` 0.001).
- Inference, sparse-TSA (§3.6, Figure 1, ``GatherSparseBlock``): a token with p > 0.5 (code: p ≥ 0.5) is
  halted at that block and keeps its state; an active token gets the *unweighted* update (the attention
  residual "gated by the same binary mask as the FFN", the FFN added as it is). Attention stays dense: a
  halted token's keys and values stay visible to the active tokens; only its FFN is skipped.

In modbench: a ``VariableCountRouter`` (the decode rule is each token's own) that is a soft gate
(``Router.soft_gate``): its training ``route`` gives every position (no top-k, no slots) with weight
w = 1 − p, which ``Mixing(weight="sublayers")`` applies as eqs. 3–4 (``Block.delta``):
x + w·attn + w·mlp(x + w·attn). The score is the active logit r = −z (z the router's halting logit), so the
variable-count rule sigmoid(r) ≥ 0.5 is p ≤ 0.5 (a tie has probability 0). The router is the released one
(sizes, default initialisation, b₂ = −1) on the routed layer's input; the loss is the paper's, mean(1 − p) per
routed layer over the number of routed layers (``place``), weighted by ``depth_weight`` (λ = 0.001). The
paper's placement is the layer pattern ``fixed:1,0`` (the first layer dense, every later one routed).

modbench's own, or not mapped:

- Halted tokens' keys and values. modbench's causal rule and decoders drop a skipped token from the layer's
  attention (it writes no K/V), as for every variant; sparse-TSA keeps attention dense. So the decode rule
  here is the paper's threshold and weight under modbench's K/V semantics: its ``val/causal_bpb`` measures a
  model the paper did not evaluate (it reports the soft model's loss, and timed sparse-TSA with synthetic
  routers, not a trained model's quality).
- ``decode_weight = "soft"`` (modbench's own option): the processed tokens keep the trained weight 1 − p
  in decoding instead of the paper's binary mask.
- Capacity C plays no part: training routes every token and decoding thresholds p, so any C < 1 builds the
  same model (C = 1 builds the dense one). Decode FLOPs are charged at the rule's realised share
  (``modbench.model.sizing.decode_flops_per_token``).
- The architecture around the gate is modbench's (RMSNorm, RoPE, an untied head, no dropout, bytes), not the
  paper's (LayerNorm, learned positions, tied embeddings, dropout 0.1, characters).

FLOPs: training runs the block on every token (the dense block's FLOPs) plus the router (2·d·h + 2·h forward
per token, twice that backward: the LM loss reaches the layer's input through p); decoding at a realised
share f runs the block on f·T tokens (``tokens_run`` is k when counting as decoding runs) and the router on
every token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .base import Mixing, Provenance, Routing, VariantConfig, check_choice, check_nonnegative
from .registry import register_variant
from .token_choice import VariableCountRouter

COMMIT = "7c12855"  # AhmedHamadto/TSA, the commit read (7c12855d5c676617f8f4f7ae0d85a15eb1e9fd3b)
HALT_BIAS = -1.0  # b₂ at initialisation: p = σ(−1) ≈ 0.27 (§2.2; ``TokenRouter``)
DECODE_WEIGHTS = ("hard", "soft")


@dataclass(frozen=True)
class TSAConfig(VariantConfig):
    # λ of the depth regularisation λ·mean(1 − p) over the tokens and routed layers (eq. 5); 0.001 is the
    # paper's for its language experiments (its λ sweep: 0 to 0.1 within 1.04 % validation loss).
    depth_weight: float = 0.001
    # The decode rule's weight on a processed token's update: "hard", 1 (the paper's sparse inference, a binary
    # mask); "soft", the trained 1 − p on each sublayer (modbench's own).
    decode_weight: str = "hard"

    def __post_init__(self) -> None:
        check_nonnegative(self, "depth_weight")
        check_choice(self, "decode_weight", DECODE_WEIGHTS)


class TSAScorer(nn.Module):
    """TSA's ``TokenRouter``: d → max(d/4, 16) → ReLU → 1, the halting logit z (p = σ(z)); the score is −z, the
    logit of the active weight 1 − p. PyTorch's default initialisation, the final bias −1."""

    def __init__(self, d_model: int) -> None:
        super().__init__()
        self.hidden = nn.Linear(d_model, max(d_model // 4, 16))
        self.head = nn.Linear(self.hidden.out_features, 1)
        nn.init.constant_(self.head.bias, HALT_BIAS)

    def halting_logit(self, x: Tensor) -> Tensor:
        return self.head(F.relu(self.hidden(x))).squeeze(-1)

    def forward(self, x: Tensor) -> Tensor:
        return -self.halting_logit(x)  # σ(−z) = 1 − p

    def flops(self, d_model: int) -> tuple[float, float]:
        """(forward, backward) per token: two linears (2·d·h + 2·h); the backward computes input and weight
        gradients (2 × forward): the LM loss reaches the layer's input through p."""
        h = self.hidden.out_features
        fwd = 2.0 * d_model * h + 2.0 * h
        return fwd, 2.0 * fwd


class TSARouter(VariableCountRouter):
    """Every token in training, each update gated by its 1 − p (a two-layer MLP halting gate); p ≤ 0.5 at decode time."""

    scope = "block"
    soft_gate = True
    mixing = Mixing(weight="sublayers")  # x + w·attn + w·mlp(x + w·attn), w = 1 − p (eqs. 3–4)


    def make_scorer(self, d_model: int) -> nn.Module:
        return TSAScorer(d_model)

    def halting_probability(self, x: Tensor) -> Tensor:
        """(B, T) p, the paper's halting probability: 1 − ``probability``."""
        return torch.sigmoid(self.scorer.halting_logit(x))

    def tokens_run(self, k: int, seq_len: int) -> int:
        """Every token in the training forward (the soft gate skips none); k when counting as decoding runs
        (``count_batched_slots`` off: ``decode_flops_per_token`` sets k from the realised share)."""
        return seq_len if self.count_batched_slots else k

    def route(self, x: Tensor, k: int, previous: Tensor | None = None) -> Routing:
        """The soft gate: every position, ascending, weight w = 1 − p; ``k`` (the capacity) plays no part."""
        B, T = x.shape[:2]
        scores = self.score(x)
        active = torch.sigmoid(scores)  # 1 − p
        index = torch.arange(T, device=x.device).expand(B, T)
        aux = self.load_losses(active, k / T) if self.training else {}
        stats = {}
        if self.collect_stats:
            stats = self.routing_stats(scores, index)
            stats["fraction"] = (active >= self.threshold).float().mean()  # what the decode rule processes
            stats["active_fraction"] = active.detach().float().mean()  # the paper's α, mean(1 − p)
            if self.collect_causal:
                stats["causal_decide"] = self.decide_causal(x)
        return Routing(index=index, weight=active.unsqueeze(-1), aux_losses=aux, stats=stats)

    def selected_weight(self, p: Tensor, valid: Tensor) -> Tensor:
        return p  # (the soft ``route`` above weights every token by its 1 − p)

    def causal_weight(self, x: Tensor, decide: Tensor) -> Tensor | None:
        return self.probability(x) if self.config.decode_weight == "soft" else None

    def load_losses(self, p: Tensor, capacity: float) -> dict[str, Tensor]:
        """The depth regularisation: ``p`` here is the active weight 1 − p, its mean over this layer's tokens
        divided by the routed layers (summed over layers by the model: their mean, eq. 5)."""
        return {"depth": p.mean() / self.routed_layers}

    def aux_weights(self, step: int) -> dict[str, float]:
        return {"depth": self.config.depth_weight}


register_variant("tsa", TSARouter, config=TSAConfig,
                 source=f"Token-Selective Attention (arXiv:2605.05222) and its released code, AhmedHamadto/TSA @{COMMIT}",
                 # The gate, its soft training on every token, the sublayer weighting, the loss and the threshold
                 # are the paper's and the code's; the decode rule drops halted tokens' keys (modbench's K/V
                 # semantics), where the paper's sparse inference keeps attention dense.
                 provenance=Provenance("paper", "paper", "paper's recipe",
                                       ((f"arXiv:2605.05222 §2 (eqs. 2-5), §3.6, Tables 2-3, as its LaTeX source in "
                                         f"AhmedHamadto/TSA @{COMMIT} docs/paper/tsa_paper_arxiv.tex", "paper's text"),
                                        (f"AhmedHamadto/TSA @{COMMIT} graph_router.py (TokenRouter), sparse_attention.py "
                                         "(SparseTransformerBlock), variable_depth.py, mlx/sparse_infer.py "
                                         "(GatherSparseBlock)", "released code"))))
