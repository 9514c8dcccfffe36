"""Model and routing configs: small frozen dataclasses that flatten for MLflow.

Depth parameterisation (nanochat's, karpathy/nanochat): one number sets the shape,

    n_layer = depth
    n_embd  = round_up(depth · aspect_ratio, head_dim)
    n_head  = n_embd / head_dim

with explicit overrides for each, and the hyper-parameter scalings tuned at depth 12,
lr × (n_embd / 768)^-0.5 and weight decay × (12 / depth)².

Recursion (Mixture-of-Recursions, arXiv:2507.10524 §2.1; ``modbench.model.recursion``):
``recursion`` = "cycle" or "middle_cycle" ties the stack's weights into one shared block applied
``recursions`` = N_R times. ``depth``/``n_layer`` stay the *effective* depth (block applications,
``layers``); ``physical_layers`` counts the distinct blocks that hold parameters. The effective
depth drives all three depth rules, so a recursive model and its vanilla twin differ only in the
sharing:

- width (depth × aspect_ratio): MoR derives its recursive models from the vanilla model of the
  same depth and width (authors' code, raymin0223/mixture_of_recursions, sharing_strategy), which
  keeps FLOPs per token equal and the parameter count N_R-fold smaller in the shared part;
- init std 0.02/√(2·layers) of the residual projections: GPT-2 scales by the number of residual
  additions a token's stream receives, one per application, shared or not;
- LR (by width) and weight decay (12/depth)²: the trainer scales by ``width`` and ``layers``, so the
  twin pair trains with the same hyper-parameters (a physical-depth WD would give the recursive
  model up to N_R²-fold more decay on the block that receives N_R gradient contributions).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import math

from modbench.config.capacity import CapacitySchedule, check_capacity
from modbench.config.io import bounded, check_bounds
from modbench.errors import ModbenchError
from modbench.config.patterns import parse_pattern, pattern_string


RECURSION_MODES = ("none", "cycle", "middle_cycle")
RECURSIONS = (2, 3, 4)  # N_R of a recursive model: MoR trains 2, 3 and 4


def unshared_layers(mode: str) -> int:
    """Layers outside the cycled block: the first and the last for middle_cycle."""
    return 2 if mode == "middle_cycle" else 0


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
    recursion: str = "none"  # weight sharing: 'none', 'cycle' or 'middle_cycle' (MoR's)
    recursions: int = bounded(1, 1, 4)  # N_R: applications of the shared block (1 without recursion)
    # Recursive KV sharing (MoR §2.3): every later application of the shared block attends to the keys and
    # values its first application computed, and computes none of its own (``modbench.model.kv_sharing.KVShare``).
    # False: each application computes and caches its own (recursion-wise caching, MoR §2.2).
    kv_sharing: bool = False

    def __post_init__(self) -> None:
        check_bounds(self, "model")
        self._check_recursion()
        if self.kv_sharing and self.recursion == "none":
            raise ModbenchError("model.kv_sharing needs a shared block: set model.recursion to 'cycle' or "
                                "'middle_cycle', or kv_sharing to false")
        if self.width > 65536:
            raise ModbenchError(f"model width {self.width} (depth × aspect_ratio) is out of range: expected at most 65536")
        if self.heads > self.width:
            raise ModbenchError(f"model.n_head {self.heads} exceeds the width {self.width}: expected at most {self.width}")
        if self.width % self.heads:
            raise ModbenchError(f"model.n_embd {self.width} is not divisible by n_head {self.heads}")
        if (self.width // self.heads) % 2:
            raise ModbenchError(f"head dimension {self.width // self.heads} must be even for RoPE")

    def _check_recursion(self) -> None:
        if self.recursion not in RECURSION_MODES:
            raise ModbenchError(f"model.recursion {self.recursion!r} is unknown: expected one of "
                                f"{', '.join(map(repr, RECURSION_MODES))}")
        if self.recursion == "none":
            if self.recursions != 1:
                raise ModbenchError(f"model.recursions = {self.recursions} needs a shared block: set model.recursion to "
                                    "'cycle' or 'middle_cycle', or recursions to 1")
            return
        if self.recursions not in RECURSIONS:
            raise ModbenchError(f"model.recursions = {self.recursions} is out of range for recursion "
                                f"{self.recursion!r}: expected one of {', '.join(map(str, RECURSIONS))}")
        cycled = self.layers - unshared_layers(self.recursion)
        if cycled < self.recursions or cycled % self.recursions:
            extra = " + 2 unshared" if self.recursion == "middle_cycle" else ""
            raise ModbenchError(f"model depth {self.layers} does not split into {self.recursions} applications of one "
                                f"shared block under recursion {self.recursion!r}: expected depth = "
                                f"{self.recursions}·b{extra} for a block of b >= 1 layers")

    @property
    def layers(self) -> int:
        """Effective depth: block applications on a token's residual stream (the unrolled stack)."""
        return self.n_layer if self.n_layer is not None else self.depth

    @property
    def physical_layers(self) -> int:
        """Distinct blocks holding parameters: the shared block's b layers (plus the two unshared
        ones of middle_cycle); ``layers`` without recursion."""
        if self.recursion == "none":
            return self.layers
        unshared = unshared_layers(self.recursion)
        return (self.layers - unshared) // self.recursions + unshared

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
        d.update(resolved_n_layer=self.layers, resolved_n_embd=self.width, resolved_n_head=self.heads,
                 resolved_physical_layers=self.physical_layers)
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
    # Per routed layer, an explicit list: "1,2/3,1/3" (fractions allowed), one entry per routed layer
    # in order, the last equal to ``capacity``. Mixture-of-Recursions' per-recursion-step capacities
    # (the released code's comma-separated ``mor.capacity``, one per step); "" (default): ``capacity``
    # and ``capacity_first`` decide. Exclusive with ``capacity_first``.
    capacities: str = ""

    def __post_init__(self) -> None:
        check_bounds(self, "routing")
        if self.capacity_first is not None:
            try:
                check_capacity(self.capacity_first)
            except ModbenchError:
                raise ModbenchError(f"routing.capacity_first = {self.capacity_first!r} is out of range: expected a "
                                    "fraction in (0, 1] (the first routed layer's capacity)") from None
        if self.capacities:
            per_layer = self.capacity_list
            if self.capacity_first is not None:
                raise ModbenchError("routing.capacities and routing.capacity_first both set the routed layers' "
                                    "capacities: expected one of them")
            if per_layer[-1] != self.capacity:
                raise ModbenchError(f"routing.capacities {self.capacities!r} ends at {per_layer[-1]:g}, not at "
                                    f"routing.capacity {self.capacity:g}: expected capacity = the last entry")

    @property
    def capacity_list(self) -> tuple[float, ...]:
        """``capacities`` parsed: one capacity per routed layer (empty when not set)."""
        if not self.capacities:
            return ()
        out = []
        for item in self.capacities.split(","):
            num, slash, den = item.strip().partition("/")
            try:
                value = float(num) / float(den) if slash else float(num)
                out.append(check_capacity(value))
            except (ValueError, ZeroDivisionError, ModbenchError):
                raise ModbenchError(f"routing.capacities {self.capacities!r} has the entry {item.strip()!r}: expected "
                                    "comma-separated fractions in (0, 1] such as '1,2/3,1/3'") from None
        return tuple(out)

    def capacity_at(self, i: int, n_routed: int) -> float:
        """Capacity of the i-th of ``n_routed`` routed layers (0-based)."""
        if self.capacities:
            return self.capacity_list[i]
        if self.capacity_first is None or n_routed <= 1:
            return self.capacity
        t = i / (n_routed - 1)
        return self.capacity + (self.capacity_first - self.capacity) * (1 + math.cos(math.pi * t)) / 2

    def capacity_schedule(self, max_seq_len: int, i: int = 0, n_routed: int = 1) -> CapacitySchedule:
        """The schedule of routed layer ``i`` of ``n_routed`` (the first, by default)."""
        return CapacitySchedule(self.capacity_at(i, n_routed), self.schedule, max_seq_len)

    @property
    def is_dense(self) -> bool:
        return self.capacity == 1.0 and self.capacity_first in (None, 1.0) and all(c == 1.0 for c in self.capacity_list)

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
        if self.capacities and len(self.capacity_list) != sum(flags):
            raise ModbenchError(f"routing.capacities {self.capacities!r} has {len(self.capacity_list)} entries for "
                                f"{sum(flags)} routed layers (pattern {self.pattern!r}, {n_layer} layers): expected one per routed layer")
        return flags

    def to_dict(self) -> dict[str, Any]:
        d = {k: v for k, v in asdict(self).items() if k != "options"}
        d.update({f"options.{k}": v for k, v in sorted(self.options.items())})
        return d


def describe(model: ModelConfig, routing: RoutingConfig) -> str:
    flags = routing.routed_layers(model.layers)
    shared = "" if model.recursion == "none" else \
        f" ({model.physical_layers} physical, {model.recursion} × {model.recursions})"
    return (
        f"{model.layers} layers{shared} × d={model.width} ({model.heads} heads), "
        f"variant={routing.variant} C={routing.capacity} ({routing.schedule}) "
        f"pattern={pattern_string(flags)}"
    )


def heads_for(width: int, base: ModelConfig) -> int:
    """Heads of a model ``width`` (even) wide: the head count whose head dimension is even (RoPE)
    and closest to the base model's head_dim (ties: more heads)."""
    return min((h for h in range(1, width // 2 + 1) if width % h == 0 and (width // h) % 2 == 0),
               key=lambda h: (abs(width // h - base.head_dim), -h))
