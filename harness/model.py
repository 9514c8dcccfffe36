"""A byte-level GPT with Mixture-of-Depths routing.

Read top to bottom. Notable features:

- Decoder-only transformer over bytes (vocab 256 by default): token embedding, rotary
  position embeddings (Su et al. 2021), pre-norm RMSNorm, causal
  ``scaled_dot_product_attention``, a 4× GELU MLP and an untied output head.
- Depth parameterisation from seed 004 (``ModelConfig``).
- Routed layers (Raposo et al. 2024, arXiv:2404.02258): a variant's router picks the top-k
  tokens (k from the capacity schedule); the block gathers them in ascending position
  order together with the RoPE angles of their *original* positions, runs attention among
  the selected tokens only (a causal mask on the sorted subset is exact), runs the MLP, and
  adds ``weight · delta`` back with one batched ``index_add``. Unselected tokens are never
  written, so they come out bit-identical. ``mlp_skip`` routes the MLP alone.
- Capacity 1.0 (and the ``dense`` variant) builds plain blocks: no router, no overhead.
- No host-device synchronisation in the forward pass: k is a Python int from static
  shapes, and nothing calls ``.item()``; the model compiles with ``fullgraph=True``.
- Analytic FLOPs as model methods (``flops_per_token``), documented in ``harness.flops``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from variants import Router, build_router

from . import flops as flop_math
from .capacity import CapacitySchedule
from .config import ModelConfig, RoutingConfig
from .errors import ModbenchError


# --- rotary position embeddings -----------------------------------------------------------
def rope_tables(max_seq_len: int, head_dim: int, base: float) -> tuple[Tensor, Tensor]:
    """cos, sin of shape (max_seq_len, head_dim / 2) (Su et al. 2021, RoFormer eq. 34)."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float64), inv_freq)
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate (x1, x2) halves of each head by the angles of the tokens' positions.

    x: (B, H, T, hd); cos, sin: broadcastable to (B, 1, T, hd / 2).
    """
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


# --- the transformer block ----------------------------------------------------------------
class Attention(nn.Module):
    def __init__(self, d: int, n_head: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.proj = nn.Linear(d, d, bias=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        B, T, d = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.n_head, d // self.n_head).permute(2, 0, 3, 1, 4)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, d))


class MLP(nn.Module):
    def __init__(self, d: int, ratio: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d, ratio * d, bias=False)
        self.proj = nn.Linear(ratio * d, d, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))


class Block(nn.Module):
    """Pre-norm block; ``delta`` is what it adds to the residual stream."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.norm1 = nn.RMSNorm(cfg.width)
        self.attn = Attention(cfg.width, cfg.heads)
        self.norm2 = nn.RMSNorm(cfg.width)
        self.mlp = MLP(cfg.width, cfg.mlp_ratio)

    def delta(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        a = self.attn(self.norm1(x), cos, sin)
        return a + self.mlp(self.norm2(x + a))

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        return x + self.delta(x, cos, sin)


@dataclass
class LayerOutput:
    x: Tensor
    aux_losses: dict[str, Tensor] = field(default_factory=dict)
    stats: dict[str, Tensor] = field(default_factory=dict)


class RoutedBlock(nn.Module):
    """A block whose router picks the k tokens it processes (scope 'block' or 'mlp')."""

    def __init__(self, cfg: ModelConfig, router: Router, capacity: CapacitySchedule) -> None:
        super().__init__()
        self.block = Block(cfg)
        self.router = router
        self.capacity = capacity

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> LayerOutput:
        B, T, d = x.shape
        if self.router.scope == "mlp":
            # mlp_skip: attention sees every token, the MLP only the selected ones.
            x = x + self.block.attn(self.block.norm1(x), cos[:T], sin[:T])
        r = self.router.route(x, self.capacity.k(T))
        k = r.index.shape[-1]
        # Flat row ids into the (B·T, d) view: batched gather/scatter, no loop over the batch.
        rows = (r.index + torch.arange(B, device=x.device).unsqueeze(1) * T).reshape(-1)
        flat = x.reshape(B * T, d)
        xs = flat.index_select(0, rows).view(B, k, d)
        if self.router.scope == "mlp":
            delta = self.block.mlp(self.block.norm2(xs))
        else:
            pos = r.index.reshape(-1)
            cs = cos.index_select(0, pos).view(B, 1, k, -1)
            sn = sin.index_select(0, pos).view(B, 1, k, -1)
            delta = self.block.delta(xs, cs, sn)
        if r.weight is not None:
            delta = delta * r.weight.to(delta.dtype)
        out = flat.index_add(0, rows, delta.reshape(B * k, d)).view(B, T, d)
        stats = dict(r.stats, layer_index=r.index) if self.router.collect_stats else r.stats
        return LayerOutput(out, r.aux_losses, stats)


class DenseLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.block = Block(cfg)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> LayerOutput:
        T = x.shape[1]
        return LayerOutput(self.block(x, cos[:T], sin[:T]))


@dataclass
class ModelOutput:
    logits: Tensor
    loss: Tensor | None  # mean next-byte cross-entropy in nats
    aux_losses: dict[str, Tensor]  # unweighted, summed over routed layers
    stats: list[dict[str, Tensor]]  # per routed layer, when collect_stats is on


# --- the model ----------------------------------------------------------------------------
class GPT(nn.Module):
    def __init__(self, cfg: ModelConfig, routing: RoutingConfig | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.routing = routing or RoutingConfig(variant="dense", capacity=1.0)
        schedule = self.routing.capacity_schedule(cfg.max_seq_len)
        with torch.random.fork_rng(devices=[]):  # the probe must not shift the init RNG
            probe = build_router(self.routing.variant, cfg.width, self.routing.options)
        self.routed_flags = self.routing.routed_layers(cfg.layers)
        if probe.scope == "none" or schedule.is_dense:
            self.routed_flags = tuple(False for _ in self.routed_flags)
        self.schedule = schedule

        self.embed = nn.Embedding(cfg.vocab_size, cfg.width)
        layers = []
        for routed in self.routed_flags:
            if routed:
                router = build_router(self.routing.variant, cfg.width, self.routing.options)
                layers.append(RoutedBlock(cfg, router, schedule))
            else:
                layers.append(DenseLayer(cfg))
        self.layers = nn.ModuleList(layers)
        self.norm = nn.RMSNorm(cfg.width)
        self.head = nn.Linear(cfg.width, cfg.vocab_size, bias=False)
        cos, sin = rope_tables(cfg.max_seq_len, cfg.width // cfg.heads, cfg.rope_base)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self._init_weights()

    def _init_weights(self) -> None:
        # GPT-2 init: N(0, 0.02), residual projections scaled by 1/√(2·n_layer).
        for name, p in self.named_parameters():
            if ".router." in name:
                continue  # routers initialise themselves
            if p.dim() == 2:
                std = 0.02 / math.sqrt(2 * self.cfg.layers) if name.endswith("proj.weight") else 0.02
                nn.init.normal_(p, mean=0.0, std=std)

    @property
    def routers(self) -> list[Router]:
        return [layer.router for layer in self.layers if isinstance(layer, RoutedBlock)]

    def set_collect_stats(self, on: bool) -> None:
        for r in self.routers:
            r.collect_stats = on

    def forward(self, idx: Tensor, targets: Tensor | None = None) -> ModelOutput:
        B, T = idx.shape
        if T > self.cfg.max_seq_len:
            raise ModbenchError(
                f"sequence length {T} exceeds the model's max_seq_len {self.cfg.max_seq_len}: "
                f"use T <= {self.cfg.max_seq_len} or raise model.max_seq_len"
            )
        x = self.embed(idx)
        aux: dict[str, Tensor] = {}
        stats: list[dict[str, Tensor]] = []
        for layer in self.layers:
            out = layer(x, self.rope_cos, self.rope_sin)
            x = out.x
            for name, value in out.aux_losses.items():
                aux[name] = aux[name] + value if name in aux else value
            if out.stats:
                stats.append(out.stats)
        logits = self.head(self.norm(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(B * T, -1).float(), targets.reshape(-1))
        return ModelOutput(logits, loss, aux, stats)

    def weighted_aux_loss(self, aux: dict[str, Tensor], step: int) -> Tensor | None:
        """Σ_name weight(name, step) · aux[name]: the one path by which aux losses enter."""
        if not aux:
            return None
        weights = self.routers[0].aux_weights(step)
        total = None
        for name, value in aux.items():
            term = weights.get(name, 0.0) * value
            total = term if total is None else total + term
        return total

    # --- FLOPs ---------------------------------------------------------------------------
    def flops_per_token(self, seq_len: int, *, causal: bool = True, backward: bool = True) -> float:
        """Analytic training (or forward-only) FLOPs per token; see ``harness.flops``."""
        return flop_math.model_flops(self, seq_len, causal=causal, backward=backward).per_token

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())
