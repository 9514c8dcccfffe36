"""The arm: one point of a study's space, every axis declared once.

An arm is what a study compares: a variant at a capacity and pattern, a learning-rate
multiplier, a model size, a budget, a weight-sharing mode... Each axis is a field of
:class:`Arm`, declared with :func:`axis`, and everything else a study needs of the arm is derived
from those declarations, never spelled again:

- the keys a study file's ``[space]`` accepts (``SPACE_KEYS``), their default choices
  (``space_defaults``) and their checks (``check_choice``);
- the arm's identity: settings an arm ignores take one value (dense ignores capacity, pattern,
  schedule and per-step capacities; recursion "none" ignores recursions; with per-step capacities
  the capacity is the last one), applied by ``Arm.__post_init__``, so every ``Arm`` is canonical;
- how an arm is stored with a trial (``Arm.params``: axes a vanilla arm leaves at their default are
  not stored, so an arm's identity in a storage does not change when an axis is added) and read
  back (``Arm.from_params``, from trial attributes or a row of the trials frame);
- its label (``Arm.label``: each axis's fragment, in its declared place), its family (the arm at
  lr×1: what the tuning protocol tunes) and its shape (every axis but the variant, the learning
  rate and the control label: what a random control must share with its learned arm).

Where an axis takes effect is one place: ``StudySpec.run_config`` (``modbench.design.study_file``),
which turns an arm into the run's config. Adding an axis is a field here and a line there
(``mlp_ratio`` was added that way).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace
from typing import Any, Callable

from modbench import variants
from modbench.config.budget import Budget
from modbench.config.capacity import check_capacity
from modbench.config.model import RECURSION_MODES, RECURSIONS, ModelConfig, RoutingConfig
from modbench.config.patterns import parse_pattern
from modbench.design.vocabulary import DENSE
from modbench.errors import ModbenchError, accepted


@dataclass(frozen=True)
class Range:
    """A sampled axis's interval (model-based samplers): ``{low = …, high = …, log = true}``."""

    low: float
    high: float
    log: bool = False


# --- the axes' checks: one choice of a [space] list, a one-line error otherwise -----------------------
def positive_number(v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0 or math.isinf(v):
        raise ModbenchError(f"{v!r} is not a positive number")
    return float(v)


def budget_text(v: Any) -> str:
    if not isinstance(v, str):
        raise ModbenchError(f"budget {v!r} is not a string such as 'flops=1e13'")
    Budget.parse(v)
    return v


def _variant(v: Any) -> str:
    return variants.get_variant(v).name


def _depth(v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ModbenchError(f"depth {v!r} is not a positive integer")
    return v


def _schedule(v: Any) -> str:
    if v not in ("constant", "log"):
        raise ModbenchError(f"schedule {v!r} is unknown: expected 'constant' or 'log'")
    return v


def _width(v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 0 or v % 2 or v > 65536:
        raise ModbenchError(f"width {v!r} is not accepted: expected 0 (the [model] width) or an even number "
                            "up to 65536 (heads: the even head dimension closest to model.head_dim)")
    return v


def _capacity_first(v: Any) -> float:
    return 0.0 if v == 0 and v is not False else check_capacity(v)


def _recursion(v: Any) -> str:
    if v not in RECURSION_MODES:
        raise ModbenchError(f"recursion {v!r} is unknown: expected {accepted(RECURSION_MODES)}")
    return v


def _recursions(v: Any) -> int:
    if isinstance(v, bool) or v not in (1, *RECURSIONS) or not isinstance(v, int):
        raise ModbenchError(f"recursions {v!r} is not accepted: expected N_R = {accepted(RECURSIONS)} "
                            "(or 1, which recursion 'none' takes)")
    return v


def _capacities(v: Any) -> str:
    if not isinstance(v, str):
        raise ModbenchError(f"capacities {v!r} is not a string such as '1,2/3,1/3' (or '' for none)")
    text = ",".join(item.strip() for item in v.split(",")) if v.strip() else ""
    if text:
        capacity_values(text)  # RoutingConfig's parse: each entry a fraction in (0, 1]
    return text


def _mlp_ratio(v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= 64:
        raise ModbenchError(f"mlp_ratio {v!r} is not accepted: expected 0 (the [model]'s) or an MLP expansion "
                            "factor from 1 to 64")
    return v


def capacity_values(capacities: str) -> tuple[float, ...]:
    """A ``capacities`` list parsed as the routing config parses it ("1,2/3,1/3" → 1, 0.667, 0.333)."""
    last = capacities.split(",")[-1].strip()
    num, slash, den = last.partition("/")
    try:
        value = float(num) / float(den) if slash else float(num)
    except (ValueError, ZeroDivisionError):
        value = 1.0  # a bad last entry: RoutingConfig names it below
    return RoutingConfig(capacity=value, capacities=capacities).capacity_list


# --- the declaration -------------------------------------------------------------------------------
def axis(default: Any, *, check: Callable[[Any], Any] | None, choices: list | Callable[[ModelConfig, Any], list] | None,
         dense: Any = None, stored: str = "set", label: Callable[["Arm"], str] | None = None, rank: int = 0,
         sampled: bool = False, ranged: bool = False, doc: str = "") -> Any:
    """One axis of the arm (a dataclass field with its metadata):

    ``check``: one choice of the study file's list (None: not a [space] key); ``choices``: the
    [space] default, a list or ``f(model, train) -> list`` (the [model]'s or [train]'s own value);
    ``dense``: the one value a dense arm takes (None: dense keeps it); ``stored``: when the axis is
    stored with a trial, "always", "routed" (a routed arm's) or "set" (away from its default);
    ``label`` and ``rank``: its fragment of the arm's label and the fragment's place; ``sampled``:
    a model-based sampler suggests it; ``ranged``: it may be a {low, high} range there."""
    meta = dict(check=check, choices=choices, dense=dense, stored=stored, label=label, rank=rank, sampled=sampled,
                ranged=ranged, doc=doc)
    return field(default=default, metadata=meta)


def _routed(text: Callable[["Arm"], str]) -> Callable[["Arm"], str]:
    return lambda arm: "" if arm.variant == DENSE else text(arm)


@dataclass(frozen=True)
class Arm:
    variant: str = axis(DENSE, check=_variant, choices=[DENSE], stored="always", label=lambda a: a.variant,
                        rank=0, sampled=True, doc="a registered variant (modbench variants)")
    capacity: float = axis(0.125, check=check_capacity, choices=[0.125], dense=1.0, stored="routed",
                           label=_routed(lambda a: a.capacity_text), rank=10, sampled=True, ranged=True,
                           doc="share of tokens a routed layer processes")
    pattern: str = axis("alternate", check=None, choices=["alternate"], dense="-", stored="routed",
                        label=_routed(lambda a: a.pattern), rank=20, sampled=True,
                        doc="which layers route (checked against each depth of the grid)")
    schedule: str = axis("constant", check=_schedule, choices=["constant"], dense="constant", stored="routed",
                         label=_routed(lambda a: "log" if a.schedule == "log" else ""), rank=30, sampled=True,
                         doc="'log': the nanochat fork's log-scaled capacity")
    lr_mult: float = axis(1.0, check=positive_number, choices=[1.0], stored="always",
                          label=lambda a: f"lr×{a.lr_mult:g}" if a.lr_mult != 1.0 else "", rank=60, sampled=True,
                          ranged=True, doc="learning-rate multiplier (tuned instead under [tune])")
    depth: int = axis(4, check=_depth, choices=lambda model, train: [model.depth], stored="always", sampled=True,
                      doc="model depth (the [model]'s by default); the study labels it where it differs")
    budget: str = axis("", check=budget_text, choices=lambda model, train: [train.budget], stored="always",
                       sampled=True, doc="training budget (the [train]'s by default)")
    width: int = axis(0, check=_width, choices=[0],
                      label=lambda a: f"L{a.depth} d{a.width}" if a.width else "", rank=50,
                      doc="n_embd override (0: the [model] width); heads: the even head dimension closest to head_dim")
    control: str = axis("", check=None, choices=None, label=lambda a: f"({a.control})" if a.control else "", rank=90,
                        doc="for a derived control arm: what it controls (modbench.design.controls)")
    capacity_first: float = axis(0.0, check=_capacity_first, choices=[0.0], dense=0.0,
                                 doc="capacity of the first routed layer, decaying to capacity over depth (p-MoD)")
    recursion: str = axis("none", check=_recursion, choices=lambda model, train: [model.recursion],
                          label=lambda a: a.recursion_text, rank=40, doc="weight sharing: none | cycle | middle_cycle")
    recursions: int = axis(1, check=_recursions, choices=lambda model, train: [model.recursions],
                           doc="N_R of a recursive arm (ignored by recursion 'none')")
    capacities: str = axis("", check=_capacities, choices=[""], dense="",
                           doc="mor only: one capacity per routed layer; the arm's capacity is the last entry")
    mlp_ratio: int = axis(0, check=_mlp_ratio, choices=[0],
                          label=lambda a: f"mlp×{a.mlp_ratio}" if a.mlp_ratio else "", rank=55,
                          doc="MLP expansion factor (0: the [model]'s mlp_ratio)")

    def __post_init__(self) -> None:
        """The arm's identity rules (module docstring): what an arm ignores takes one value."""
        def put(name: str, value: Any) -> None:
            object.__setattr__(self, name, value)

        if self.variant == DENSE:
            for f in fields(self):
                if f.metadata["dense"] is not None:
                    put(f.name, f.metadata["dense"])
        if self.recursion == "none":
            put("recursions", 1)
        if self.capacities:
            put("capacity", capacity_values(self.capacities)[-1])
        for name, kind in (("capacity", float), ("capacity_first", float), ("lr_mult", float), ("depth", int),
                           ("width", int), ("recursions", int), ("mlp_ratio", int)):
            put(name, kind(getattr(self, name)))

    # --- derived --------------------------------------------------------------------------------
    @property
    def capacity_text(self) -> str:
        """"C=0.125", "C=0.25→0.125" (decaying over depth) or "C=1,2/3,1/3" (one per routed layer)."""
        if self.capacities:
            return f"C={self.capacities}"
        return f"C={self.capacity_first:g}→{self.capacity:g}" if self.capacity_first else f"C={self.capacity:g}"

    @property
    def recursion_text(self) -> str:
        """"middle_cycle N_R=3" for a recursive arm, "" otherwise."""
        return "" if self.recursion == "none" else f"{self.recursion} N_R={self.recursions}"

    @property
    def label(self) -> str:
        """Each axis's fragment in its declared place ("sigmoid C=0.125 alternate lr×2")."""
        ranked = sorted((f.metadata["rank"], f.metadata["label"]) for f in fields(self) if f.metadata["label"])
        return " ".join(text for text in (label(self) for _, label in ranked) if text)

    @property
    def family(self) -> "Arm":
        """The arm at lr×1: what the tuning protocol tunes (``modbench.study.tuning``)."""
        return replace(self, lr_mult=1.0)

    @property
    def shape(self) -> tuple:
        """Every axis but the variant, the learning rate and the control label."""
        return tuple(getattr(self, f.name) for f in fields(self) if f.name not in ("variant", "lr_mult", "control"))

    def params(self) -> dict[str, Any]:
        """The arm as stored with a trial: each axis by its ``stored`` rule (module docstring)."""
        out = {}
        for f in fields(self):
            value, rule = getattr(self, f.name), f.metadata["stored"]
            if rule == "always" or (rule == "routed" and self.variant != DENSE) or (rule == "set" and value != f.default):
                out[f.name] = value
        return out

    def to_dict(self) -> dict[str, Any]:
        """Every axis (MLflow params ``arm.*``)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_params(cls, params: dict[str, Any]) -> "Arm":
        """The arm of ``params`` (``Arm.params``, or a row of the trials frame: unknown keys ignored)."""
        return cls(**{f.name: params[f.name] for f in fields(cls) if f.name in params})


ARM_KEYS: tuple[str, ...] = tuple(f.name for f in fields(Arm))
SPACE_KEYS: tuple[str, ...] = tuple(f.name for f in fields(Arm) if f.metadata["choices"] is not None)
SAMPLED_KEYS: tuple[str, ...] = tuple(f.name for f in fields(Arm) if f.metadata["sampled"])
RANGED_KEYS: tuple[str, ...] = tuple(f.name for f in fields(Arm) if f.metadata["ranged"])
DENSE_IGNORES: tuple[str, ...] = tuple(f.name for f in fields(Arm) if f.metadata["dense"] is not None)
FIXED_IN_SAMPLED = ("recursion", "recursions", "capacities")  # a sampled space has one value of each (grid only)


def space_defaults(model: ModelConfig, train: Any) -> dict[str, list[Any]]:
    """Each [space] key's choices when a grid leaves it out."""
    out = {}
    for f in fields(Arm):
        choices = f.metadata["choices"]
        if choices is not None:
            out[f.name] = list(choices(model, train) if callable(choices) else choices)
    return out


def choice_check(name: str, model: ModelConfig, depths: list[int]) -> Callable[[Any], Any]:
    """The check of one choice of [space] key ``name`` (the pattern is checked at every depth of its grid)."""
    if name == "pattern":
        def pattern(v: Any) -> str:
            if not isinstance(v, str):
                raise ModbenchError(f"pattern {v!r} is not a string")
            for d in depths:
                parse_pattern(v, model.n_layer or d)
            return v

        return pattern
    return next(f for f in fields(Arm) if f.name == name).metadata["check"]
