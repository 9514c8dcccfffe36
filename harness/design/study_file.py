"""Declarative study files (studies/*.toml), validated before anything is written.

    [study]                      # how the study runs
    name = "quick"               # also the MLflow experiment and the Optuna study name
    description = "…"
    seeds = [0, 1, 2]            # every arm runs every seed, so statistics compare like with like
    sampler = "grid"             # grid | tpe | nsga2 | random
    pruner = "none"              # none | median | hyperband (single-objective studies only)
    objectives = ["val/bpb"]     # val/bpb, val/causal_bpb, test/bpb, test/causal_bpb, perf/flops_per_token, perf/train_tokens_per_s
    n_trials = 0                 # model-based samplers: arms to sample (each runs every seed)
    timeout_s = 0                # stop starting new trials after this long (0: no limit)
    controls = []                # derived control arms for each routed arm of [space] (grid only):
                                 #   "matched_dense": a dense model whose FLOPs per token are within
                                 #     3 % of the routed arm's (shallower and/or narrower), same budget;
                                 #   "iso_token_dense": the base dense model trained on as many
                                 #     tokens as the routed arm (more FLOPs; flops budgets only);
                                 #   "param_matched_dense": for each recursive arm, the vanilla
                                 #     model with its parameters (its physical depth, same width)
    claims = []                  # claims the report tests, with verdicts and summary.json
                                 # (modbench.report.claims): "mod_vs_best_dense",
                                 # "learned_vs_random", "causal_rule", "methods_vs_sigmoid"

    [model]  …                   # ModelConfig fields, shared by every arm
    [train]  …                   # TrainConfig fields (dataset, budget, seq_len, …)
    [options.sigmoid]  …         # a variant's own config fields, for every arm of that variant

    [space]                      # what varies; each key is a list of choices
    variant  = ["dense", "norm", "sigmoid"]
    capacity = [0.125, 0.5]      # or {low = 0.05, high = 0.5, log = true} with a model-based sampler
    pattern  = ["alternate"]
    schedule = ["constant"]      # "log" = the nanochat fork's log-scaled capacity
    lr_mult  = [1.0]
    depth    = [4]               # model sizes (iso-FLOP studies)
    width    = [0]               # n_embd override (0: the [model] width); heads = width / head_dim
    mlp_ratio = [0]              # MLP expansion factor (0: the [model]'s mlp_ratio)
    capacity_first = [0.0]       # capacity of the first routed layer, decaying to `capacity` over
                                 # depth (p-MoD's progressive decay; 0: every layer at `capacity`)
    budget   = ["flops=1e13"]    # training budgets (iso-FLOP studies)
    recursion  = ["none"]        # weight sharing (ModelConfig.recursion): none | cycle | middle_cycle
    recursions = [3]             # N_R of a recursive arm (2, 3 or 4; ignored by recursion "none")
    capacities = ["1,2/3,1/3"]   # mor only: one capacity per routed layer (RoutingConfig.capacities);
                                 #   the arm's capacity is the last entry ("": `capacity` decides)

    [[space.also]]               # more grids, unioned with [space]; a key left out takes [space]'s list
    variant = ["dense"]          #   e.g. a dense size sweep for the isoFLOP-optimal dense baseline
    depth   = [2, 3, 4, 6]

    [tune]                       # the learning rate is tuned, not declared (grid studies; no lr_mult in [space])
    lr_mult = [1, 2, 4]          # the grid every compared family gets, on one seed (modbench.study.tuning)
    seed = 0                     # the tuning seed; the study's other seeds confirm at each family's best value
    min_lr_mult = 0.125          # a best value at an edge extends the grid ÷2 / ×2, never past these
    max_lr_mult = 32

    [claims.mod_vs_best_dense]   # how one claim (listed in study.claims) is decided
    margin = 0.05                # equivalence margin (bpb): "equivalent" when the 90 % CI lies inside ±margin
    primary = "sigmoid"          # the pre-registered primary contrast's variant
    ci_half_width = 0.03         # after the confirmation seeds, queue the seeds the primary contrast needs
    max_seeds = 8                #   for this CI half-width (and the margin's equivalence test), at most this many
    positive_control = "flops=3.5e12"  # mod_vs_best_dense only: the best dense model also trained at this
                                 #   smaller budget, a contrast whose sign is known (it must come out "worse")
    tie_break = "decode_flops"   # who wins an "equivalent" verdict at different cost: the arm with fewer
                                 #   decode FLOPs/token ("decode_flops") or training FLOPs/token ("train_flops")

An *arm* is one point of the space (``modbench.design.arm``: every axis declared once, with
what an arm ignores). Control arms (``study.controls``) are sized by the model's analytic FLOPs,
in ``modbench.design.controls`` (``study_arms``): this module only declares them. The file's
schema and its one loader are here (``StudySpec``, ``load_study``): "study" alone means the
Optuna study a spec runs as.
"""

from __future__ import annotations

import hashlib
import itertools
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from modbench import variants
from modbench.config.budget import Budget
from modbench.config.io import from_mapping, read_toml
from modbench.config.model import RoutingConfig, heads_for
from modbench.config.run import RunConfig, load_run
from modbench.data import check_dataset
from modbench.design.arm import (FIXED_IN_SAMPLED, RANGED_KEYS, SPACE_KEYS, Arm, Range, budget_text, choice_check,
                                 positive_number, space_defaults)
from modbench.errors import ModbenchError, accepted
from modbench.results import ALIASES, metric
from modbench.design.vocabulary import DENSE

SAMPLERS = ("grid", "tpe", "nsga2", "random")
PRUNERS = ("none", "median", "hyperband")
# Study objectives are declared metrics of modbench.results (old spellings such as val_bpb are aliases).
OBJECTIVES = ("val/bpb", "val/causal_bpb", "test/bpb", "test/causal_bpb", "perf/flops_per_token", "perf/train_tokens_per_s")
CAPACITIES_VARIANTS = ("mor", "mor_token_choice")  # per-step capacities are Mixture-of-Recursions' (variants/mor.py, mor_token_choice.py)
CONTROLS = ("matched_dense", "iso_token_dense", "param_matched_dense")
CLAIMS = ("mod_vs_best_dense", "learned_vs_random", "causal_rule", "methods_vs_sigmoid")  # see modbench.report.claims
TOP_KEYS = ("study", "model", "train", "options", "space", "tune", "claims")


@dataclass(frozen=True)
class StudySettings:
    name: str = ""
    description: str = ""
    seeds: list = field(default_factory=lambda: [0])
    sampler: str = "grid"
    pruner: str = "none"
    objectives: list = field(default_factory=lambda: ["val/bpb"])
    n_trials: int = 0
    timeout_s: float = 0.0
    controls: list = field(default_factory=list)
    claims: list = field(default_factory=list)


@dataclass(frozen=True)
class ClaimSettings:
    """[claims.<kind>]: how one claim is decided (``modbench.report.claims``)."""
    margin: float | None = None  # equivalence margin in the headline metric's units (bpb); None: no equivalence test
    primary: str = ""  # the pre-registered primary contrast's variant (its own family, m = 1); "": the claim's default
    ci_half_width: float | None = None  # target half-width of the primary contrast's CI (two-stage seed rule)
    max_seeds: int = 0  # cap on the primary contrast's confirmation seeds the two-stage rule may add up to (0: no extra seeds)
    positive_control: str = ""  # mod_vs_best_dense: a smaller budget the best dense model is also trained at ("": none)
    tie_break: str = ""  # who wins a tie at different cost: "decode_flops" | "train_flops" (the cheaper arm); "": no rule


@dataclass(frozen=True)
class TuneSettings:
    """[tune]: the tuning grid every compared family gets (tuned on one seed, bracketed)."""
    lr_mult: tuple = ()  # the initial grid, e.g. (1.0, 2.0, 4.0); () : no tuning stage
    seed: int = 0  # the tuning seed; the confirmation seeds are the study's other seeds
    min_lr_mult: float = 0.125  # extension limits: the grid is never extended past these
    max_lr_mult: float = 32.0


@dataclass(frozen=True)
class StudySpec:
    path: Path
    settings: StudySettings
    base: RunConfig
    options: dict[str, dict[str, Any]]
    space: dict[str, Any]  # key -> list of choices, or Range for capacity / lr_mult
    file_sha256: str
    also: tuple[dict[str, Any], ...] = ()  # [[space.also]]: more grids, each a full space like ``space``
    tune: TuneSettings = TuneSettings()  # [tune]: empty lr_mult means no tuning stage
    claim_settings: dict[str, ClaimSettings] = field(default_factory=dict)  # [claims.<kind>], by claim kind

    @property
    def name(self) -> str:
        return self.settings.name

    @property
    def directions(self) -> list[str]:
        return [metric(o).direction for o in self.settings.objectives]

    def main_arms(self) -> list[Arm]:
        """The arms of [space] alone: the ones ``study.controls`` derive controls for."""
        return _grid(self.space)

    def arms(self) -> list[Arm]:
        """Every distinct declared arm of a grid ([space] and [[space.also]]), in a stable order.
        Derived control arms are added by ``modbench.model.sizing.study_arms``."""
        seen: dict[Arm, None] = {}
        for space in (self.space, *self.also):
            for arm in _grid(space):
                seen.setdefault(arm, None)
        return list(seen)

    def label(self, arm: Arm) -> str:
        """The arm's name in this study: ``arm.label`` plus its depth and budget where they are
        not the study's own (the run names and the report's rows)."""
        parts = [arm.label]
        if arm.depth != self.base.model.depth and not arm.width:
            parts.append(f"L{arm.depth}")
        if arm.budget != self.base.train.budget and not arm.control:
            parts.append(arm.budget)
        return " ".join(parts)

    def run_config(self, arm: Arm, seed: int, **train_overrides: Any) -> RunConfig:
        """The run an arm is: where each axis takes effect (``modbench.design.arm``)."""
        model = replace(self.base.model, depth=arm.depth, recursion=arm.recursion, recursions=arm.recursions,
                        kv_sharing=self.base.model.kv_sharing and arm.recursion != "none")  # sharing needs recursion
        if arm.mlp_ratio:
            model = replace(model, mlp_ratio=arm.mlp_ratio)
        if arm.width:
            model = replace(model, n_embd=arm.width, n_head=heads_for(arm.width, self.base.model))
        routing = RoutingConfig(arm.variant, arm.capacity, arm.schedule, arm.pattern if arm.pattern != "-" else "alternate",
                                dict(self.options.get(arm.variant, {})), arm.capacity_first or None,
                                capacities=arm.capacities)
        train = replace(self.base.train, seed=seed, budget=arm.budget, lr=self.base.train.lr * arm.lr_mult, **train_overrides)
        return RunConfig(model, routing, train)

    def derived_control_count(self) -> int:
        """How many control arms ``study.controls`` derive (``modbench.model.sizing.control_arms``),
        counted without building a model (``modbench study list`` must be instant): one per kind
        for each routed shape of [space] (the iso-token control only at a FLOP budget), and one
        param-matched model for each recursive shape of [space] (its physical depth and width)."""
        wanted, arms = self.settings.controls, self.main_arms()
        routed = {(a.shape, a.lr_mult): a.budget for a in arms if a.variant != DENSE}
        count = len(routed) if "matched_dense" in wanted else 0
        if "iso_token_dense" in wanted:
            count += sum(Budget.parse(budget).kind == "flops" for budget in routed.values())
        if "param_matched_dense" in wanted:
            models = {a: self.run_config(a, self.settings.seeds[0]).model for a in arms if a.recursion != "none"}
            count += len({(m.physical_layers, m.width, m.layers, a.recursion_text, a.budget, a.lr_mult) for a, m in models.items()})
        return count


def _grid(space: dict[str, Any]) -> list[Arm]:
    seen: dict[Arm, None] = {}
    for combo in itertools.product(*(space[k] for k in SPACE_KEYS)):
        seen.setdefault(Arm(**dict(zip(SPACE_KEYS, combo))), None)
    return list(seen)


def _fail(path: Path, key: str, problem: str) -> ModbenchError:
    return ModbenchError(f"{path}: {key}: {problem}")


def _choices(path: Path, key: str, value: Any, check) -> list[Any]:
    if not isinstance(value, list) or not value:
        raise _fail(path, key, f"expected a non-empty list of choices, got {value!r}")
    out = []
    for v in value:
        try:
            out.append(check(v))
        except ModbenchError as e:
            raise _fail(path, key, str(e)) from None
    if len(set(map(str, out))) != len(out):
        raise _fail(path, key, f"lists a choice twice: {value!r}")
    return out


def _load_settings(p: Path, raw: dict[str, Any]) -> StudySettings:
    """The [study] table: name, sampler, pruner, objectives (declared names), seeds, limits."""
    settings = from_mapping(StudySettings, raw.get("study", {}), f"{p}: study")
    # ASCII only: the name is also every trial's MLflow experiment (train.experiment), which takes ASCII
    # names alone; a name str.isalnum() accepts beyond ASCII ('études') passed here and failed every trial.
    if (not settings.name or len(settings.name) > 100 or settings.name.startswith(".")
            or not all(c.isascii() and (c.isalnum() or c in "-_.") for c in settings.name)):
        raise _fail(p, "study.name", f"{settings.name[:40]!r} must be a name of 1 to 100 ASCII letters (A-Z, a-z), digits, "
                                     "'-', '_' or '.', not starting with '.' (it names folders and the MLflow experiment)")
    if settings.sampler not in SAMPLERS:
        raise _fail(p, "study.sampler", f"{settings.sampler!r} is unknown: expected {accepted(SAMPLERS)}")
    if settings.pruner not in PRUNERS:
        raise _fail(p, "study.pruner", f"{settings.pruner!r} is unknown: expected {accepted(PRUNERS)}")
    if not isinstance(settings.objectives, list) or not settings.objectives or any(
            ALIASES.get(o, o) not in OBJECTIVES for o in settings.objectives):
        raise _fail(p, "study.objectives", f"{settings.objectives!r}: expected a non-empty list of {accepted(list(OBJECTIVES))}")
    settings = replace(settings, objectives=[ALIASES.get(o, o) for o in settings.objectives])
    if len(set(settings.objectives)) != len(settings.objectives):
        raise _fail(p, "study.objectives", "lists an objective twice")
    multi = len(settings.objectives) > 1
    if multi and settings.pruner != "none":
        raise _fail(p, "study.pruner", f"{settings.pruner!r} with {len(settings.objectives)} objectives: Optuna cannot prune multi-objective studies; use pruner = \"none\"")
    if not multi and settings.sampler == "nsga2":
        raise _fail(p, "study.sampler", "'nsga2' is for multi-objective studies: list two objectives or use 'tpe', 'grid' or 'random'")
    seeds = settings.seeds
    if not isinstance(seeds, list) or not seeds or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in seeds):
        raise _fail(p, "study.seeds", f"expected a non-empty list of non-negative integers, got {seeds!r}")
    if len(set(seeds)) != len(seeds):
        raise _fail(p, "study.seeds", "lists a seed twice")
    if settings.n_trials < 0 or settings.timeout_s < 0 or math.isnan(settings.timeout_s):
        raise _fail(p, "study", "n_trials and timeout_s must be >= 0")
    claims = settings.claims
    if not isinstance(claims, list) or any(c not in CLAIMS for c in claims) or len(set(claims)) != len(claims):
        raise _fail(p, "study.claims", f"{claims!r}: expected a list of distinct names from {accepted(CLAIMS)}")
    controls = settings.controls
    if not isinstance(controls, list) or any(c not in CONTROLS for c in controls) or len(set(controls)) != len(controls):
        raise _fail(p, "study.controls", f"{controls!r}: expected a list of distinct names from {accepted(CONTROLS)}")

    return settings


def shipped_studies() -> dict[str, Path]:
    """The study files that ship inside the package (``modbench.studies``), by name."""
    from importlib.resources import files

    root = files("modbench.studies")
    return {Path(str(f)).stem: Path(str(f)) for f in root.iterdir() if str(f).endswith(".toml")}


def find_study(text: str | Path) -> Path:
    """A study file: the path if it exists, else the shipped study of that name (``quick``)."""
    path = Path(text)
    if path.is_file():
        return path
    shipped = shipped_studies()
    if str(text) in shipped:
        return shipped[str(text)]
    if path.suffix == ".toml" and path.stem in shipped and not path.parent.exists():
        return shipped[path.stem]
    raise ModbenchError(f"no study file {str(text)!r}, and no shipped study of that name: give a study file, "
                        f"or one of {accepted(sorted(shipped))} (see 'modbench study list')")


def load_study(path: str | Path) -> StudySpec:
    """Read and fully validate a study file (or a shipped study's name); one-line errors name file and key."""
    p = find_study(path)
    raw = read_toml(p)
    for key in raw:
        if key not in TOP_KEYS:
            raise _fail(p, key, f"unknown section; accepted sections are {accepted(TOP_KEYS)}")
    settings = _load_settings(p, raw)
    base = RunConfig.from_dict({"model": raw.get("model", {}), "train": raw.get("train", {})}, where=str(p))
    try:
        check_dataset(base.train.dataset)  # once, at load (the dataclasses never touch files)
    except ModbenchError as e:
        raise _fail(p, "train.dataset", str(e)) from None
    options_raw = raw.get("options", {})
    if not isinstance(options_raw, dict):
        raise _fail(p, "options", "expected tables such as [options.sigmoid]")
    options: dict[str, dict[str, Any]] = {}
    for variant, table in options_raw.items():
        try:
            options[variant] = variants.get_variant(variant).make_config(table).to_dict()
        except ModbenchError as e:
            raise _fail(p, f"options.{variant}", str(e)) from None

    space_raw = raw.get("space", {})
    if not isinstance(space_raw, dict) or not space_raw:
        raise _fail(p, "space", f"is empty: give at least 'variant'; accepted keys are {accepted(SPACE_KEYS)}")
    space_raw = dict(space_raw)
    also_raw = space_raw.pop("also", [])
    defaults = space_defaults(base.model, base.train)
    space = _parse_space(p, "space", space_raw, defaults, base)
    if not isinstance(also_raw, list) or not all(isinstance(t, dict) and t for t in also_raw):
        raise _fail(p, "space.also", "expected [[space.also]] tables, each a grid such as variant = [\"dense\"], depth = [2, 4]")
    also = tuple(_parse_space(p, f"space.also[{i}]", t, space, base) for i, t in enumerate(also_raw))
    ranged = [k for k in RANGED_KEYS if any(isinstance(sp[k], Range) for sp in (space, *also))]
    if ranged and settings.sampler == "grid":
        raise _fail(p, f"space.{ranged[0]}", "a {low, high} range needs a model-based sampler ('tpe', 'random' or 'nsga2'); a grid needs a list of choices")
    if settings.sampler != "grid" and (also or settings.controls):
        raise _fail(p, "space.also" if also else "study.controls", f"sampler {settings.sampler!r} samples one space: "
                    "[[space.also]] grids and controls need sampler = \"grid\"")
    if settings.sampler != "grid" and settings.n_trials < 1:
        raise _fail(p, "study.n_trials", f"sampler {settings.sampler!r} needs n_trials >= 1 (arms to sample)")
    sampled_fixed = [k for k in FIXED_IN_SAMPLED if k in space_raw and space[k] != defaults[k]]
    if settings.sampler != "grid" and sampled_fixed:
        raise _fail(p, f"space.{sampled_fixed[0]}", f"sampler {settings.sampler!r} samples variant, capacity, pattern, "
                    "schedule, lr_mult, depth and budget only: recursive arms need sampler = \"grid\"")
    tune = _load_tune(p, raw.get("tune"), settings, [("space", space_raw)] + [(f"space.also[{i}]", t) for i, t in enumerate(also_raw)])
    claim_settings = _load_claims(p, raw.get("claims"), settings, tune, [space, *also], base.train.budget)
    digest = hashlib.sha256(p.read_bytes()).hexdigest()
    study = StudySpec(p, settings, base, options, space, digest, also, tune, claim_settings)
    if "param_matched_dense" in settings.controls and not any(a.recursion != "none" for a in study.main_arms()):
        raise _fail(p, "study.controls", "'param_matched_dense' is the vanilla model with a recursive arm's parameters: "
                                         "[space] has no recursive arm (recursion 'cycle' or 'middle_cycle')")
    if settings.sampler == "grid":
        for arm in study.arms():  # build every arm's config once, through the one loader: bad ones fail now
            try:
                load_run(study.run_config(arm, settings.seeds[0]))
            except ModbenchError as e:
                raise _fail(p, "space", f"arm {arm.label!r}: {e}") from None
    return study


def check_arms_train(study: StudySpec) -> None:
    """Refuse, before a study creates any storage, the arms the trainer would refuse only once it
    builds their model: by then the study, its MLflow parent run and the trial's run exist, and
    every trial of the arm fails in turn. ``load_study`` does not do this itself because building
    every arm's model costs about a second (``modbench study list`` loads every shipped study).
    A model-based sampler's arms are drawn later: only a grid's are known here."""
    if study.settings.sampler != "grid":
        return
    for arm in study.arms():
        try:
            _check_trains(study.run_config(arm, study.settings.seeds[0]))
        except ModbenchError as e:
            raise _fail(study.path, "space", f"arm {study.label(arm)!r}: {e}") from None


def _check_trains(cfg: RunConfig) -> None:
    """The model builds (a variant's own rule on the routed layout, e.g. ``mor_token_choice`` with
    ``min_depth = 1`` needs two routed layers) and the budget buys at least one optimizer step (the
    first step at its own capacity, as the trainer counts a FLOP budget). Built on the meta
    device: no memory, no RNG draw."""
    import torch

    from modbench.model.gpt import GPT

    with torch.device("meta"):
        model = GPT(cfg.model, cfg.routing)
    t = cfg.train
    budget = Budget.parse(t.budget)
    if budget.kind != "flops":
        return  # steps and tokens: load_run checks them; seconds: no step count
    first_step = model.training_flops_per_token(t.seq_len, 1) * t.batch_size * t.seq_len * t.grad_accum
    if budget.amount < first_step * (1 - 1e-12):
        raise ModbenchError(f"budget {t.budget!r} is smaller than one training step of this model ({first_step:.3g} "
                            "FLOPs): raise the budget, or shrink batch_size or seq_len")


TUNE_KEYS = ("lr_mult", "seed", "min_lr_mult", "max_lr_mult")
CLAIM_KEYS = ("margin", "primary", "ci_half_width", "max_seeds", "positive_control", "tie_break")
TIE_BREAKS = ("decode_flops", "train_flops")


def _number(p: Path, key: str, value: Any) -> float:
    """A positive finite number (a TOML boolean is not a number)."""
    try:
        return positive_number(value)
    except ModbenchError as e:
        raise _fail(p, key, f"{e}: expected a positive number") from None


def _count(p: Path, key: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise _fail(p, key, f"{value!r} is not a non-negative integer")
    return value


def _load_tune(p: Path, table: Any, settings: StudySettings, spaces: list[tuple[str, dict]]) -> TuneSettings:
    """[tune]: the learning-rate grid every compared family gets (``modbench.study.tuning``)."""
    if table is None:
        return TuneSettings()
    if not isinstance(table, dict):
        raise _fail(p, "tune", f"expected a table such as lr_mult = [1, 2, 4]; accepted keys are {accepted(TUNE_KEYS)}")
    for key in table:
        if key not in TUNE_KEYS:
            raise _fail(p, f"tune.{key}", f"unknown key; accepted keys are {accepted(TUNE_KEYS)}")
    if settings.sampler != "grid":
        raise _fail(p, "tune", f"tuning stages need sampler = \"grid\", not {settings.sampler!r}")
    for where, space in spaces:
        if "lr_mult" in space:
            raise _fail(p, f"{where}.lr_mult", "with [tune] the learning rate is tuned, not declared: "
                                               "leave lr_mult out and list the grid in tune.lr_mult")
    grid = _choices(p, "tune.lr_mult", table.get("lr_mult"), positive_number)
    low = _number(p, "tune.min_lr_mult", table.get("min_lr_mult", TuneSettings.min_lr_mult))
    high = _number(p, "tune.max_lr_mult", table.get("max_lr_mult", TuneSettings.max_lr_mult))
    if not low <= min(grid) <= max(grid) <= high:
        raise _fail(p, "tune", f"the grid {grid} must lie within min_lr_mult {low:g} and max_lr_mult {high:g}")
    seed = _count(p, "tune.seed", table.get("seed", TuneSettings.seed))
    if not [s for s in settings.seeds if s != seed]:
        raise _fail(p, "study.seeds", f"{settings.seeds!r} has no confirmation seed besides the tuning seed {seed}: "
                                      "list at least one other seed")
    return TuneSettings(tuple(sorted(grid)), seed, low, high)


def _load_claims(p: Path, table: Any, settings: StudySettings, tune: TuneSettings,
                 spaces: list[dict[str, Any]], base_budget: str) -> dict[str, ClaimSettings]:
    """[claims.<kind>] tables, one per claim kind the study lists in study.claims."""
    if table is None:
        return {}
    if not isinstance(table, dict):
        raise _fail(p, "claims", "expected tables such as [claims.mod_vs_best_dense]")
    variants_declared = {v for space in spaces for v in space["variant"]}
    out = {}
    for kind, entry in table.items():
        where = f"claims.{kind}"
        if kind not in settings.claims:
            raise _fail(p, where, f"{kind!r} is not a claim of this study: study.claims lists {accepted(settings.claims) or 'none'}")
        if not isinstance(entry, dict):
            raise _fail(p, where, f"expected a table; accepted keys are {accepted(CLAIM_KEYS)}")
        for key in entry:
            if key not in CLAIM_KEYS:
                raise _fail(p, f"{where}.{key}", f"unknown key; accepted keys are {accepted(CLAIM_KEYS)}")
        margin = _number(p, f"{where}.margin", entry["margin"]) if "margin" in entry else None
        half = _number(p, f"{where}.ci_half_width", entry["ci_half_width"]) if "ci_half_width" in entry else None
        primary = entry.get("primary", "")
        if not isinstance(primary, str) or (primary and primary not in variants_declared):
            raise _fail(p, f"{where}.primary", f"{primary!r} is not a variant of this study: expected {accepted(sorted(variants_declared))}")
        max_seeds = _count(p, f"{where}.max_seeds", entry.get("max_seeds", 0))
        if max_seeds and not tune.lr_mult:
            raise _fail(p, f"{where}.max_seeds", "adding seeds after the first ones is a study stage: it needs a [tune] table")
        if max_seeds and half is None and margin is None:
            raise _fail(p, f"{where}.max_seeds", "says how many seeds at most, but not for what: give ci_half_width or margin")
        confirm = len([s for s in settings.seeds if s != tune.seed])
        if max_seeds and max_seeds < confirm:
            raise _fail(p, f"{where}.max_seeds", f"{max_seeds} is below the {confirm} confirmation seeds the study runs anyway")
        positive = entry.get("positive_control", "")
        if positive:
            if kind != "mod_vs_best_dense":
                raise _fail(p, f"{where}.positive_control", "only [claims.mod_vs_best_dense] has a positive control "
                                                            "(the best dense model at a smaller budget)")
            if not tune.lr_mult:
                raise _fail(p, f"{where}.positive_control", "the positive control follows the tuned best dense model: it needs a [tune] table")
            try:
                smaller, full = Budget.parse(budget_text(positive)), Budget.parse(base_budget)
            except ModbenchError as e:
                raise _fail(p, f"{where}.positive_control", str(e)) from None
            if smaller.kind != full.kind or not smaller.amount < full.amount:
                raise _fail(p, f"{where}.positive_control", f"{positive!r} must be a smaller budget of the same kind "
                                                            f"as train.budget {base_budget!r} (its sign is then known)")
        elif not isinstance(positive, str):
            raise _fail(p, f"{where}.positive_control", f"{positive!r} is not a budget such as 'flops=3.5e12'")
        tie_break = entry.get("tie_break", "")
        if tie_break and (tie_break not in TIE_BREAKS or kind == "causal_rule"):
            raise _fail(p, f"{where}.tie_break", f"{tie_break!r}: expected {accepted(TIE_BREAKS)} "
                                                 "(a claim comparing two arms: not causal_rule)")
        if tie_break and margin is None:
            raise _fail(p, f"{where}.tie_break", "decides an 'equivalent' verdict, which needs a margin: declare margin")
        out[kind] = ClaimSettings(margin, primary, half, max_seeds, positive, tie_break)
    return out


def _parse_space(p: Path, where: str, raw: dict[str, Any], defaults: dict[str, Any], base: RunConfig) -> dict[str, Any]:
    """One grid's table: every key a validated list of choices (or a Range); missing keys take ``defaults``."""
    for key in raw:
        if key not in SPACE_KEYS:
            raise _fail(p, f"{where}.{key}", f"unknown key; accepted keys are {accepted(SPACE_KEYS)}"
                        + (" (and [[space.also]] in [space])" if where == "space" else ""))

    def choices(key: str, depths: list[int]) -> Any:
        if key not in raw:
            return defaults[key]
        check, value = choice_check(key, base.model, depths), raw[key]
        if isinstance(value, dict) and key in RANGED_KEYS:
            return _range(p, f"{where}.{key}", value, check)
        return _choices(p, f"{where}.{key}", value, check)

    depths = choices("depth", [])  # first: a pattern must fit every depth of its grid
    space = {key: depths if key == "depth" else choices(key, depths) for key in SPACE_KEYS}
    _check_capacities_variants(p, where, raw, space)
    return space


def _check_capacities_variants(p: Path, where: str, raw: dict[str, Any], space: dict[str, Any]) -> None:
    """Per-step capacities are Mixture-of-Recursions' (one per recursion step): a grid that gives
    them to another routed variant is refused rather than quietly running a per-layer schedule
    nobody declared for it (dense ignores capacities, as it ignores capacity)."""
    if not any(space["capacities"]):
        return
    others = [v for v in space["variant"] if v != DENSE and v not in CAPACITIES_VARIANTS]
    if others:
        inherited = "" if "capacities" in raw or where == "space" else " (a key left out takes [space]'s list)"
        raise _fail(p, f"{where}.capacities", f"{space['capacities']!r} would apply to variant {accepted(others)}{inherited}: "
                                              f"per-step capacities are for {accepted(CAPACITIES_VARIANTS)}; give the "
                                              "other variants their own grid with capacities = [\"\"]")


def _range(path: Path, key: str, table: dict, check) -> Range:
    extra = set(table) - {"low", "high", "log"}
    if extra or "low" not in table or "high" not in table:
        raise _fail(path, key, f"a range is {{low = …, high = …, log = true|false}}, got {table!r}")
    try:
        low, high = check(table["low"]), check(table["high"])
    except ModbenchError as e:
        raise _fail(path, key, str(e)) from None
    if not low < high:
        raise _fail(path, key, f"low {low} must be below high {high}")
    log = table.get("log", False)
    if not isinstance(log, bool):
        raise _fail(path, key, "log must be true or false")
    return Range(low, high, log)
