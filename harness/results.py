"""The results record: the metrics a run produces, declared once, and the record of one run.

Every place that names a result — the MLflow metric, the Optuna objective and user attribute,
the report's columns, the CLI summary — uses the names declared here, spelled one way
(``val/bpb``). Each declared metric has a unit and a direction, so a study objective, a
Pareto front or a report's "better" follow from the declaration, never from a guess.

Older study files named objectives ``val_bpb``, ``test_bpb``, ``flops_per_token`` and
``tokens_per_s``; those spellings are accepted as aliases and mapped here, once.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from modbench.errors import ModbenchError, accepted

DIRECTIONS = ("minimize", "maximize")


@dataclass(frozen=True)
class Metric:
    name: str
    unit: str
    direction: str  # "minimize" | "maximize"
    description: str


_DECLARED = (
    Metric("val/bpb", "bits/byte", "minimize", "validation, training-time top-k routing (not deployable: it sees the future)"),
    Metric("val/causal_bpb", "bits/byte", "minimize", "validation, decode-time causal routing: the deployable number"),
    Metric("val/dense_bpb", "bits/byte", "minimize", "validation, routing switched off (every token through every layer)"),
    Metric("val/causal_gap", "bits/byte", "minimize", "val/causal_bpb − val/bpb: the train/inference gap"),
    Metric("val/causal_fraction", "fraction", "minimize", "share of tokens the causal rule processes at routed layers"),
    Metric("val/causal_agreement", "fraction", "maximize", "causal decisions that match top-k's"),
    Metric("val/causal_precision", "fraction", "maximize", "tokens the causal rule processes that top-k also selects"),
    Metric("val/causal_recall", "fraction", "maximize", "top-k selections the causal rule also processes"),
    Metric("val/causal_chance_agreement", "fraction", "minimize",
           "agreement of a rule processing the same fraction independently of top-k: q·c + (1 − q)(1 − c)"),
    Metric("test/causal_fraction", "fraction", "minimize", "test split: share of tokens the causal rule processes"),
    Metric("val/topk_leak_rate", "fraction", "minimize", "top-k decisions at t that change when only the future changes"),
    Metric("test/bpb", "bits/byte", "minimize", "test split, top-k routing"),
    Metric("test/causal_bpb", "bits/byte", "minimize", "test split, decode-time causal routing"),
    Metric("perf/flops_per_token", "FLOPs/token", "minimize", "analytic training FLOPs per token (forward + backward)"),
    Metric("perf/train_tokens_per_s", "tokens/s", "maximize", "training throughput, evaluation excluded"),
    Metric("perf/total_flops", "FLOPs", "minimize", "training FLOPs spent"),
)
METRICS: dict[str, Metric] = {m.name: m for m in _DECLARED}
ALIASES = {"val_bpb": "val/bpb", "test_bpb": "test/bpb", "flops_per_token": "perf/flops_per_token",
           "tokens_per_s": "perf/train_tokens_per_s", "causal_bpb": "val/causal_bpb"}


def metric(name: str) -> Metric:
    """The declared metric ``name`` (or an old alias of it); a one-line error otherwise."""
    canonical = ALIASES.get(name, name)
    if canonical not in METRICS:
        raise ModbenchError(f"unknown metric {name!r}: expected one of {accepted(list(METRICS))}")
    return METRICS[canonical]


@dataclass
class RunRecord:
    """One finished run: what it was, what it measured, where its checkpoint is."""

    run_id: str | None
    status: str  # FINISHED | FAILED | KILLED
    config: dict[str, Any]  # the flat config (the MLflow params)
    metrics: dict[str, float] = field(default_factory=dict)  # final values, declared names only
    steps: int = 0
    tokens: int = 0
    checkpoint: str | None = None  # MLflow artifact path of the run, or a local file when untracked
    tags: dict[str, str] = field(default_factory=dict)  # the run's own tags (MLflow's "mlflow.*" left out)

    def __post_init__(self) -> None:
        unknown = sorted(set(self.metrics) - set(METRICS))
        if unknown:
            raise ModbenchError(f"run record metric {unknown[0]!r} is not declared in modbench.results")

    def value(self, name: str) -> float:
        return self.metrics[metric(name).name]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "RunRecord":
        return cls(**data)


def declared(metrics: dict[str, float]) -> dict[str, float]:
    """The subset of ``metrics`` that is declared here (a run logs more, the record keeps these)."""
    return {k: float(v) for k, v in metrics.items() if k in METRICS}
