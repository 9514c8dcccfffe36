"""Training budgets: ``steps=N``, ``tokens=N``, ``flops=X`` or ``seconds=S``.

A FLOP budget is converted to steps with the analytic FLOPs of *this* model, so a cheaper
MoD model trains proportionally more steps for the same compute: the iso-FLOP comparison of
Raposo et al. 2024 (§4.1). A seconds budget stops on wall-clock time; its learning-rate
schedule follows elapsed time instead of steps.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from modbench.errors import ModbenchError

KINDS = ("steps", "tokens", "flops", "seconds")
FORM = "'steps=N', 'tokens=N', 'flops=X' or 'seconds=S' with a positive amount, e.g. 'flops=3e13'"


@dataclass(frozen=True)
class Budget:
    kind: str
    amount: float

    @classmethod
    def parse(cls, text: str) -> "Budget":
        m = re.fullmatch(r"\s*(\w+)\s*=\s*([0-9.eE+\-_]+)\s*", str(text))
        if not m or m[1] not in KINDS:
            raise ModbenchError(f"budget {text!r} is not understood: expected {FORM}")
        try:
            amount = float(m[2].replace("_", ""))
        except ValueError:
            raise ModbenchError(f"budget {text!r} has no valid amount: expected {FORM}") from None
        if not amount > 0 or math.isinf(amount):
            raise ModbenchError(f"budget {text!r} must be positive and finite: expected {FORM}")
        if m[1] == "steps" and amount < 1:
            raise ModbenchError(f"budget {text!r} is smaller than one training step: expected steps=N with N >= 1")
        return cls(m[1], amount)

    def steps(self, tokens_per_step: int, flops_per_step: float) -> int | None:
        """Optimizer steps this budget allows (None for a time budget)."""
        if self.kind == "seconds":
            return None
        per_step = {"steps": 1.0, "tokens": float(tokens_per_step), "flops": flops_per_step}[self.kind]
        n = math.floor(self.amount / per_step + 1e-9)
        if n < 1:
            raise ModbenchError(
                f"budget {self.kind}={self.amount:g} is smaller than one training step "
                f"({per_step:.3g} {self.kind}): raise the budget or shrink the batch"
            )
        return n

    def __str__(self) -> str:
        return f"{self.kind}={self.amount:g}"
