"""Model and routing configs: small frozen dataclasses that flatten for MLflow.

Depth parameterisation (nanochat's, karpathy/nanochat): one number sets the shape,

    n_layer = depth
    n_embd  = round_up(depth · aspect_ratio, head_dim)
    n_head  = n_embd / head_dim

with explicit overrides for each, and the hyper-parameter scalings tuned at depth 12,
lr × (n_embd / 768)^-0.5 and weight decay × (12 / depth)².
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import math

from modbench.config.capacity import CapacitySchedule, check_capacity
from modbench.config.io import bounded, check_bounds
from modbench.errors import ModbenchError
from modbench.config.patterns import parse_pattern, pattern_string


def round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def lr_scale(n_embd: int) -> float:
    """nanochat (karpathy/nanochat): learning rate ∝ 1/√n_embd, tuned at n_embd = 768."""
    return (n_embd / 768) ** -0.5


def wd_scale(depth: int) -> float:
    """nanochat (karpathy/nanochat): weight decay ∝ 1/depth², tuned at depth = 12."""
    return (12 / depth) ** 2


@dataclass(frozen=True)
class ModelConfig:
    depth: int = bounded(4, 1, 256)
    aspect_ratio: int = bounded(64, 1, 4096)
    head_dim: int = bounded(64, 2, 1024)
    n_layer: int | None = bounded(None, 1, 256)  # overrides depth
    n_embd: int | None = bounded(None, 2, 65536)  # overrides depth × aspect_ratio
    n_head: int | None = bounded(None, 1, 1024)  # overrides n_embd / head_dim
    vocab_size: int = bounded(256, 256, 1 << 20)  # the data are bytes: at least 256
    max_seq_len: int = bounded(1024, 1, 1 << 17)
    mlp_ratio: int = bounded(4, 1, 64)
    rope_base: float = bounded(10000.0, 1.0, 1e12, low_open=True)

    def __post_init__(self) -> None:
        check_bounds(self, "model")
        if self.width > 65536:
            raise ModbenchError(f"model width {self.width} (depth × aspect_ratio) is out of range: expected at most 65536")
        if self.heads > self.width:
            raise ModbenchError(f"model.n_head {self.heads} exceeds the width {self.width}: expected at most {self.width}")
        if self.width % self.heads:
            raise ModbenchError(f"model.n_embd {self.width} is not divisible by n_head {self.heads}")
        if (self.width // self.heads) % 2:
            raise ModbenchError(f"head dimension {self.width // self.heads} must be even for RoPE")

    @property
    def layers(self) -> int:
        return self.n_layer if self.n_layer is not None else self.depth

    @property
    def width(self) -> int:
        if self.n_embd is not None:
            return self.n_embd
        return round_up(self.depth * self.aspect_ratio, self.head_dim)

    @property
    def heads(self) -> int:
        return self.n_head if self.n_head is not None else max(1, self.width // self.head_dim)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(resolved_n_layer=self.layers, resolved_n_embd=self.width, resolved_n_head=self.heads)
        return d


@dataclass(frozen=True)
class RoutingConfig:
    variant: str = "dense"
    capacity: float = 0.125
    schedule: str = "constant"  # 'constant' | 'log' (the log-scaled capacity of the nanochat fork's MoD docs)
    pattern: str = "alternate"
    options: dict[str, Any] = field(default_factory=dict)  # the variant's own config fields
    # Capacity over depth: None keeps every routed layer at ``capacity``; a value is the first
    # routed layer's capacity, decaying to ``capacity`` at the last along a cosine: a
    # reparameterisation, by its two end points, of p-MoD's progressive ratio decay (Zhang et al.
    # 2024, arXiv:2412.04449 §3.3; its code decays over every layer index). Every variant can use it.
    capacity_first: float | None = None
    # Capacity warm-up: every routed layer starts at capacity 1.0 and falls to its own capacity
    # along a cosine over this many training steps (0: none). Training FLOPs count each step at
    # its own capacity (``GPT.training_flops``), so FLOP budgets stay exact.
    capacity_warmup_steps: int = bounded(0, 0, 1 << 40)

    def __post_init__(self) -> None:
        check_bounds(self, "routing")
        if self.capacity_first is not None:
            try:
                check_capacity(self.capacity_first)
            except ModbenchError:
                raise ModbenchError(f"routing.capacity_first = {self.capacity_first!r} is out of range: expected a "
                                    "fraction in (0, 1] (the first routed layer's capacity)") from None

    def capacity_at(self, i: int, n_routed: int) -> float:
        """Capacity of the i-th of ``n_routed`` routed layers (0-based)."""
        if self.capacity_first is None or n_routed <= 1:
            return self.capacity
        t = i / (n_routed - 1)
        return self.capacity + (self.capacity_first - self.capacity) * (1 + math.cos(math.pi * t)) / 2

    def capacity_schedule(self, max_seq_len: int, i: int = 0, n_routed: int = 1) -> CapacitySchedule:
        """The schedule of routed layer ``i`` of ``n_routed`` (the first, by default)."""
        return CapacitySchedule(self.capacity_at(i, n_routed), self.schedule, max_seq_len)

    @property
    def is_dense(self) -> bool:
        return self.capacity == 1.0 and self.capacity_first in (None, 1.0)

    def routed_layers(self, n_layer: int) -> tuple[bool, ...]:
        """Per-layer flags, True where routed. A routed config (a variant other than ``dense``,
        capacity below 1) whose pattern routes no layer of the model is refused: it would
        silently train the dense model under the variant's name."""
        flags = parse_pattern(self.pattern, n_layer)
        if not any(flags) and self.variant != "dense" and not self.is_dense:
            raise ModbenchError(
                f"routing.pattern {self.pattern!r} routes no layer of a {n_layer}-layer model, so variant "
                f"{self.variant!r} would train dense: expected a pattern that routes at least one layer "
                f"('all', 'alternate' at depth >= 2, 'every:K' with K <= {n_layer}, a D/M string with an M in its first {n_layer})"
            )
        return flags

    def to_dict(self) -> dict[str, Any]:
        d = {k: v for k, v in asdict(self).items() if k != "options"}
        d.update({f"options.{k}": v for k, v in sorted(self.options.items())})
        return d


def describe(model: ModelConfig, routing: RoutingConfig) -> str:
    flags = routing.routed_layers(model.layers)
    return (
        f"{model.layers} layers × d={model.width} ({model.heads} heads), "
        f"variant={routing.variant} C={routing.capacity} ({routing.schedule}) "
        f"pattern={pattern_string(flags)}"
    )
