"""``dtrnet``: DTRNet (Dynamic Token Routing Network, arXiv:2509.00925): attention's token mixing routed,
every token updated.

Mixture-of-Depths skips a whole block for the unrouted tokens. DTRNet skips only the quadratic part:
a routed token goes through attention with the other routed tokens; an unrouted one gets a token-local
update instead, its attention with itself as the only key (the value and output projections,
W_O·W_V·norm(x)); and every token goes through the MLP. So every token is updated at every layer
while only the routed ones pay for (and appear in) attention. As the authors' code runs it
(Aman26Sharma/DTRNet at commit f5e7f07cf10b1517d19de52be021cb2806bae7ab,
``src/transformers_extra/models/DTRNet_smollm/modeling_llama_DTRNet.py``, read for the parts below):

- Router (``TokenRouter``): an MLP on the layer's input (before its norm), d → d/2 → SiLU → 2 logits,
  softmax over (attention, bypass); initialised N(0, 0.02) with zero biases (``_init_weights``,
  ``initializer_range`` 0.02). Here r = l_attention − l_bypass, so p = softmax(l)[0] = sigmoid(r).
- Rule: a token goes to attention iff p > 0.5 (``layer_mask = token_weights[..., 0] > 0.5``; here p ≥ 0.5,
  as every variable-count router: a tie has probability 0): each token decides from its own state, so
  the training rule is the decode rule (token choice, no top-k).
- Routed tokens: attention among the routed tokens of their sequence only (the gathered tokens in
  flash-attention's varlen layout, per-sequence ``cu_seq_lens``, causal, at their own RoPE positions),
  output x + p·attn. Unrouted tokens: x + (1 − p)·W_O·W_V·norm(x) (``unselected_value_states`` through
  ``v_proj`` then ``o_proj``). Then x + MLP(norm(x)) on every token (``post_attention_layernorm``, ``mlp``).
- The KV cache: only the routed tokens go through ``self_attn``, whose ``past_key_value.update`` appends
  their keys and values; the bypass path computes no key. So an unrouted token writes no K/V and no
  later token sees it: exactly modbench's causal routing mask and decoders (skipped tokens write no K/V).
- Loss: the L1 norm of p, mean |p| over the layer's tokens (``aux_loss``), averaged over the DTRNet
  layers weighted by each layer's routed share (a constant: ``k / (batch_size * seq_len)``), added with
  ``aux_loss_coeff`` λ = 0.0008 (``experiments/smollm_360M_fineweb_15B_PT.yaml``): it pushes tokens off
  attention, towards the ~10 % the paper reports. No capacity: the share is whatever p > 0.5 gives.

In modbench (scope "attention", ``Mixing(skip="local")``: ``RoutedBlock.post_route`` runs the MLP on
every token, ``Block.local_update`` is the bypass): the rule and the weights are the code's; the
routed tokens run in the fixed slots of ``VariableCountRouter`` (k_max = min(T, ⌈slack·k⌉) highest p
per sequence, k = max(1, ⌊C·T⌋), static shapes), so capacity C only sizes the slots, and a sequence
with more than k_max tokens above 0.5 sends its lowest-p ones down the bypass (the ``overflow``
statistic; the released code has no cap). The batched forward computes the bypass for every token
and keeps it for the unrouted ones (counted: 2·2d² FLOPs per token); decoding computes it for the
unrouted ones only, which is what its FLOPs at the realised share count. The loss is the plain mean
of mean p over the routed layers (the router learns their number from ``GPT``, ``place``): the released
share weighting, a per-batch constant over layers, is not applied (equal shares give the same loss).

Not mapped: the training fallback that routes a random 15 % of the batch to attention when no token
of any sequence was routed (a guard of the ragged varlen path, drawn from the global RNG; here an
empty selection is an all-masked slot set), grouped-query attention (SmolLM's 5 KV heads for 15 query
heads), SwiGLU and the SmolLM shapes, and the layer placement: the released model makes every layer
*not* listed in ``dtrnet_layers`` a DTRNet layer (``LlamaModel.__init__``: listed layers are built with
``sparse=False``), i.e. layers 0, 1, 3, 5, …, 31 of the 32 in the shipped 360M configuration; here a
layer pattern decides (``alternate``: every second layer).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .base import Mixing, Provenance, VariantConfig, check_interval, check_nonnegative
from .registry import register_variant
from .token_choice import VariableCountRouter

COMMIT = "f5e7f07"  # Aman26Sharma/DTRNet, the commit read


@dataclass(frozen=True)
class DTRNetConfig(VariantConfig):
    # λ of the L1 loss on p, mean p over the tokens and routed layers (``aux_loss_coeff``,
    # experiments/smollm_360M_fineweb_15B_PT.yaml).
    aux_weight: float = 0.0008
    slack: float = 2.0  # k_max = min(T, ⌈slack · k⌉) attention slots per sequence, k = max(1, ⌊C·T⌋)

    def __post_init__(self) -> None:
        check_nonnegative(self, "aux_weight")
        check_interval(self, "slack", "[1, 64]")


class DTRNetScorer(nn.Module):
    """DTRNet's ``TokenRouter``: d → d/2 → SiLU → (l_attention, l_bypass); the score is their difference,
    the logit of the softmax's attention probability."""

    def __init__(self, d_model: int) -> None:
        super().__init__()
        self.hidden = nn.Linear(d_model, max(1, d_model // 2))
        self.head = nn.Linear(self.hidden.out_features, 2)  # (attention, bypass)
        for layer in (self.hidden, self.head):  # the released ``_init_weights``: N(0, 0.02), zero biases
            nn.init.normal_(layer.weight, std=0.02)
            nn.init.zeros_(layer.bias)

    def forward(self, x: Tensor) -> Tensor:
        logits = self.head(F.silu(self.hidden(x)))
        return logits[..., 0] - logits[..., 1]  # softmax(l)[0] = sigmoid(l_0 − l_1)

    def flops(self, d_model: int) -> tuple[float, float]:
        """(forward, backward) per token: two linears (2·d·h + 2·h·2); the backward computes input and
        weight gradients (2 × forward): the LM loss reaches the layer's input through p."""
        h = self.hidden.out_features
        fwd = 2.0 * d_model * h + 2.0 * h * 2
        return fwd, 2.0 * fwd


class DTRNetRouter(VariableCountRouter):
    """Attention for tokens with p > 0.5 (x + p·attn), W_O·W_V for the rest (x + (1 − p)·local); the MLP for all."""

    scope = "attention"
    mixing = Mixing(skip="local")  # routed: x + p·attn; unrouted: x + (1 − p)·W_O·W_V·norm(x)


    def make_scorer(self, d_model: int) -> nn.Module:
        return DTRNetScorer(d_model)

    # --- the weights: p for the routed tokens, 1 − p for the bypass --------------------------------
    def selected_weight(self, p: Tensor, valid: Tensor) -> Tensor:
        return p

    def causal_weight(self, x: Tensor, decide: Tensor) -> Tensor:
        return self.probability(x)

    def skip_scale_of(self, scores: Tensor) -> Tensor:
        return torch.sigmoid(-self.decision_logit(scores))  # 1 − p: the softmax's bypass probability

    # --- the loss ---------------------------------------------------------------------------------
    def load_losses(self, p: Tensor, capacity: float) -> dict[str, Tensor]:
        return {"attention_l1": p.abs().mean() / self.routed_layers}  # summed over layers by the model: their mean

    def aux_weights(self, step: int) -> dict[str, float]:
        return {"attention_l1": self.config.aux_weight}


register_variant("dtrnet", DTRNetRouter, config=DTRNetConfig,
                 source=f"DTRNet (arXiv:2509.00925) and its released code, Aman26Sharma/DTRNet @{COMMIT}",
                 # The rule, the weights p and 1 − p, the bypass and the L1 loss are the code's; the slots (a
                 # cap on the routed count) and the unweighted mean over layers are modbench's adaptation.
                 provenance=Provenance("paper's recipe", "paper", "paper",
                                       ((f"Aman26Sharma/DTRNet @{COMMIT} modeling_llama_DTRNet.py (TokenRouter, "
                                         "LlamaDecoderLayer.forward), experiments/smollm_360M_fineweb_15B_PT.yaml",
                                         "released code"),
                                        ("DTRNet (arXiv:2509.00925) abstract and Figure 1, as the authors' README "
                                         "quotes them", "secondary"))))
