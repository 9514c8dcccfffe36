"""How many tokens a routed layer processes.

*capacity* C ∈ (0, 1] is the fraction of tokens processed at a routed layer. With a constant
schedule k = ⌊C·T⌋; with the log-scaled schedule of the nanochat fork's MoD documentation the effective
capacity falls from 1 at T = 1 to C at T = max_T:

    C_eff(T) = 1 − (ln T / ln max_T) · (1 − C)

so short sequences are processed almost densely and long ones at C. In both cases
k = max(1, ⌊C_eff·T⌋): never 0, and never k−1 through a floating-point product that lands
a hair below an integer (0.57 · 100 = 56.999…).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from modbench.errors import ModbenchError

SCHEDULES = ("constant", "log")


def check_capacity(capacity: float) -> float:
    if isinstance(capacity, bool):  # float(True) is 1.0: a TOML `capacity = true` is a mistake, not dense
        raise ModbenchError(f"capacity {capacity!r} is not a number: expected a fraction in (0, 1]")
    try:
        c = float(capacity)
    except (TypeError, ValueError):
        raise ModbenchError(f"capacity {capacity!r} is not a number: expected a fraction in (0, 1]") from None
    if not (0.0 < c <= 1.0) or math.isnan(c):
        raise ModbenchError(f"capacity {capacity!r} is out of range: expected a fraction in (0, 1]")
    return c


@dataclass(frozen=True)
class CapacitySchedule:
    capacity: float = 1.0
    schedule: str = "constant"
    max_seq_len: int = 1024

    def __post_init__(self) -> None:
        check_capacity(self.capacity)
        if self.schedule not in SCHEDULES:
            raise ModbenchError(
                f"capacity schedule {self.schedule!r} is unknown: expected 'constant' or 'log'"
            )
        if self.max_seq_len < 1:
            raise ModbenchError(f"max_seq_len must be >= 1, got {self.max_seq_len}")

    @property
    def is_dense(self) -> bool:
        return self.capacity == 1.0

    def effective(self, seq_len: int) -> float:
        if self.schedule == "constant" or self.max_seq_len == 1:
            return self.capacity
        log_ratio = min(1.0, math.log(max(seq_len, 1)) / math.log(self.max_seq_len))
        return 1.0 - log_ratio * (1.0 - self.capacity)

    def warmed(self, step: int, warmup_steps: int) -> "CapacitySchedule":
        """This schedule at a training step of a capacity warm-up: the capacity falls from 1.0 to
        its own value along a cosine over ``warmup_steps`` steps (then stays)."""
        if warmup_steps <= 0 or step >= warmup_steps:
            return self
        c = self.capacity + (1.0 - self.capacity) * (1 + math.cos(math.pi * step / warmup_steps)) / 2
        return CapacitySchedule(min(1.0, c), self.schedule, self.max_seq_len)

    def k(self, seq_len: int) -> int:
        """Tokens processed out of ``seq_len`` (a Python int: shapes stay static)."""
        return max(1, min(seq_len, math.floor(round(self.effective(seq_len) * seq_len, 9))))
