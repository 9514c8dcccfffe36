"""The tuning protocol of a study with a ``[tune]`` table: which trials each stage queues.

Best against best (issue "Best against best"): every *family* a claim compares — an arm without
its learning-rate multiplier: each routed arm, each dense size, the FLOP-matched dense, a recursive
dense model and its param-matched vanilla twin — runs the study's grid of ``lr_mult`` on the tuning
seed. A family whose best value (on validation, ``SELECT``) sits at an edge of what it tried gets
the next value past that edge (×2 or ÷2) until the best is interior (*bracketed*) or the declared
limit is reached (*unbracketed*). A trial that failed or diverged counts as worse than every
finished one (its reason is kept), never as missing. The stages, in order (``plan``):

1. ``tune``: the grid, each tuned family, the tuning seed.
2. ``extend``: one value past each edge best (repeated while a family's best is at an edge).
3. ``optimum``: once, when the dense sizes are tuned: the isoFLOP parabola over each size at its
   best value (``modbench.report.isoflop.fit_profile``); when its optimum is nearer to a depth no
   size has, that depth becomes a dense family and is tuned like the others (back to 2).
4. ``confirm``: the study's seeds other than the tuning seed, each family at its best value —
   every tuned family but the dense sizes that are not their budget's best; the random controls
   of C2 at their learned arm's best value (``RANDOM_CONTROL``); the positive control (the best
   dense model at a smaller budget, ``[claims.mod_vs_best_dense] positive_control``).
5. ``seeds``: once, for each claim with ``max_seeds``: the seeds its primary contrast needs for
   its CI half-width / equivalence margin, from the paired SD of the confirmation seeds
   (``modbench.report.effects.seeds_for_half_width`` / ``seeds_for_equivalence``), capped; the
   positive control runs the new seeds of C1's reference too (it is paired with it by seed).

Everything here is a pure function of the study and its trials (``TrialPoint``): the runner
calls ``plan`` under a storage lock when no trial waits or runs, and queues what it returns;
since ``plan`` only returns (arm, seed) points that have no trial yet, planning twice queues
nothing twice.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterable

import numpy as np
import pandas as pd

from modbench.design.arm import ARM_KEYS, Arm
from modbench.design.study_file import StudySpec, TuneSettings
from modbench.model.sizing import non_embedding_params
from modbench.design.controls import study_arms
from modbench.design.vocabulary import (CONTROL_VARIANTS, DENSE, HEADLINE, METHODS_REFERENCE, POSITIVE_CONTROL,
                                        RANDOM_CONTROL, SELECT)

TUNE, EXTEND, OPTIMUM, CONFIRM, SEEDS, COMPLETE = "tune", "extend", "optimum", "confirm", "seeds", "complete"
TUNING_STAGES = (TUNE, EXTEND, OPTIMUM)  # trials on the tuning seed
FINISHED = ("COMPLETE", "FAIL", "PRUNED")


@dataclass(frozen=True)
class TrialPoint:
    """What planning needs of one trial (surplus and re-queued trials are left out by the caller)."""
    arm: Arm
    seed: int
    state: str  # an Optuna TrialState name
    stage: str = ""  # the stage that queued it ("" for trials of a study without [tune]; informative only)
    value: float | None = None  # the selection metric (validation); None unless COMPLETE and finite
    headline: float | None = None  # the reported metric (test), for the seed rule
    reason: str = ""  # why it failed


@dataclass(frozen=True)
class Decision:
    """One family's tuning state on the tuning seed."""
    grid: tuple[float, ...]  # every value tried (finished), ascending
    best: float | None  # None: nothing finished (or nothing tried yet)
    bracketed: bool
    extend: float | None  # the next value to try, None when done
    note: str  # "interior", "limit: …", "edge: extending to …"
    failed: tuple[str, ...] = ()  # "lr×8: reason" for every failed value


@dataclass(frozen=True)
class Plan:
    stage: str
    queue: tuple[tuple[Arm, int], ...] = ()
    record: dict[str, Any] = field(default_factory=dict)  # what the stage decided (a study user attr)


def _fmt(v: float) -> str:
    return f"lr×{v:g}"


def decide(values: dict[float, float | None], tune: TuneSettings, reasons: dict[float, str] | None = None) -> Decision:
    """Bracketing one family: ``values`` maps each finished multiplier to its validation value
    (None: failed or diverged, which counts as worse than any finished value).

    The best is the lowest value (ties: the smaller multiplier). It is bracketed when a value
    was tried on each side of it; at an edge the grid extends by ×2 (upper) or ÷2 (lower) unless
    that passes ``tune.max_lr_mult`` / ``tune.min_lr_mult``. With every trial failed, the grid
    extends downward (divergence is what a too-large rate does)."""
    reasons = reasons or {}
    grid = tuple(sorted(values))
    failed = tuple(f"{_fmt(v)}: {reasons.get(v) or 'failed'}" for v in grid if values[v] is None)
    if not grid:
        return Decision(grid, None, False, None, "not tuned yet", failed)
    scored = {v: x for v, x in values.items() if x is not None}
    if not scored:
        down = grid[0] / 2
        if down < tune.min_lr_mult:
            return Decision(grid, None, False, None, f"limit: every value failed down to {_fmt(grid[0])}", failed)
        return Decision(grid, None, False, down, f"every value failed: extending to {_fmt(down)}", failed)
    best = min(sorted(scored), key=lambda v: scored[v])
    if grid[0] < best < grid[-1]:
        return Decision(grid, best, True, None, "interior", failed)
    up, down = best * 2, best / 2
    if best == grid[-1] and up <= tune.max_lr_mult:
        return Decision(grid, best, False, up, f"best at the upper edge: extending to {_fmt(up)}", failed)
    if best == grid[0] and down >= tune.min_lr_mult:
        return Decision(grid, best, False, down, f"best at the lower edge: extending to {_fmt(down)}", failed)
    side = f"max_lr_mult {tune.max_lr_mult:g}" if best == grid[-1] else f"min_lr_mult {tune.min_lr_mult:g}"
    return Decision(grid, best, False, None, f"limit: best at the edge {_fmt(best)}, next value past {side}", failed)


# --- which families the protocol tunes, and which follow another family's best value ----------
def declared_families(study: StudySpec) -> list[Arm]:
    """Every family of the study's grid (declared arms and derived controls), at lr×1."""
    return list(dict.fromkeys(a.family for a in study_arms(study)))


def leader_of(family: Arm, families: Iterable[Arm]) -> Arm | None:
    """The learned family whose best value a random control (C2) runs at: the variant whose
    control it is (``RANDOM_CONTROL``), same shape; None for every other family."""
    if family.variant not in CONTROL_VARIANTS or family.control:
        return None
    learned = [v for v, c in RANDOM_CONTROL.items() if c == family.variant]
    return next((f for f in families if f.variant in learned and f.shape == family.shape), None)


def tuned_families(study: StudySpec, points: Iterable[TrialPoint] = ()) -> list[Arm]:
    """The families that get the grid: every declared family that follows no other, and the
    fitted dense optimum when the ``optimum`` stage added one (found by its trials on the tuning
    seed: followers and the positive control run the confirmation seeds only, so every family
    with a trial on the tuning seed is a tuned one)."""
    declared = declared_families(study)
    out = [f for f in declared if leader_of(f, declared) is None]
    out += [p.arm.family for p in points if p.seed == study.tune.seed and leader_of(p.arm.family, declared) is None]
    return list(dict.fromkeys(out))


def _plain_dense(f: Arm) -> bool:
    """A dense size of the isoFLOP comparison: a vanilla dense model, neither a derived control nor
    recursive (a recursive dense model is a family of its own, confirmed whichever size is best)."""
    return f.variant == DENSE and not f.control and f.recursion == "none"


def _learned(f: Arm) -> bool:
    return f.variant != DENSE and f.variant not in CONTROL_VARIANTS


# --- reading the trials ----------------------------------------------------------------------
def _tuning_values(points: list[TrialPoint], family: Arm, seed: int) -> tuple[dict[float, float | None], dict[float, str]]:
    """Each multiplier the family finished on the tuning seed: its value, None when it failed.
    A multiplier with one COMPLETE trial counts as finished even if an earlier try failed."""
    values: dict[float, float | None] = {}
    reasons: dict[float, str] = {}
    for p in points:
        if p.seed != seed or p.arm.family != family or p.state not in FINISHED:
            continue
        v = p.arm.lr_mult
        if p.state == "COMPLETE" and p.value is not None and math.isfinite(p.value):
            values[v] = p.value if values.get(v) is None else min(values[v], p.value)
        elif v not in values:
            values[v] = None
            reasons[v] = p.reason or ("diverged: non-finite validation value" if p.state == "COMPLETE" else p.state.lower())
    return values, reasons


def decisions(study: StudySpec, points: list[TrialPoint]) -> dict[Arm, Decision]:
    """Every tuned family's bracketing state on the tuning seed."""
    out = {}
    for family in tuned_families(study, points):
        values, reasons = _tuning_values(points, family, study.tune.seed)
        out[family] = decide(values, study.tune, reasons)
    return out


def _exists(points: list[TrialPoint]) -> set[tuple[Arm, int]]:
    return {(p.arm, p.seed) for p in points}


def _missing(wanted: Iterable[tuple[Arm, int]], points: list[TrialPoint]) -> tuple[tuple[Arm, int], ...]:
    have = _exists(points)
    return tuple(dict.fromkeys(w for w in wanted if w not in have))


def confirm_seeds(study: StudySpec) -> list[int]:
    return [s for s in study.settings.seeds if s != study.tune.seed]


def best_dense(study: StudySpec, dec: dict[Arm, Decision], points: list[TrialPoint], budget: str) -> Arm | None:
    """The isoFLOP-best dense family at ``budget``: the plain dense family (every size trained,
    the fitted optimum included) whose best value on the tuning seed is lowest."""
    scored = []
    for f, d in dec.items():
        if _plain_dense(f) and f.budget == budget and d.best is not None:
            values, _ = _tuning_values(points, f, study.tune.seed)
            scored.append((values[d.best], f))
    return min(scored, key=lambda x: x[0])[1] if scored else None


def best_sizes(study: StudySpec, dec: dict[Arm, Decision], points: list[TrialPoint]) -> set[Arm]:
    """Of each learned variant's size sweep (the same arm at other depths and widths), the size
    whose best value on the tuning seed is lowest: the one size of that family the confirmation
    seeds run, chosen by the rule that chooses the best dense size (``best_dense``). Confirming
    every routed size and picking among them afterwards would choose MoD's size on the
    confirmation seeds and dense's on the tuning seed alone: not the same search."""
    best: dict[Arm, tuple[float, Arm]] = {}
    for f, d in dec.items():
        if not _learned(f) or d.best is None:
            continue
        values, _ = _tuning_values(points, f, study.tune.seed)
        if values.get(d.best) is None:
            continue
        key = replace(f, depth=0, width=0)  # the family without its size
        if key not in best or values[d.best] < best[key][0]:
            best[key] = (values[d.best], f)
    return {f for _, f in best.values()}


def best_arms(study: StudySpec, points: list[TrialPoint]) -> dict[Arm, Arm]:
    """Family → the arm the confirmation seeds run: tuned families at their best value (of a size
    sweep, dense or routed, the best size only), random controls at their leader's, the positive
    control at the best dense model's. Families with no best value (every trial failed) are left out."""
    dec = decisions(study, points)
    out: dict[Arm, Arm] = {}
    budgets = {f.budget for f in dec if _learned(f)} | {study.base.train.budget}
    dense_best = {b: best_dense(study, dec, points, b) for b in budgets}
    routed_best = best_sizes(study, dec, points)
    for f, d in dec.items():
        if d.best is None or (_plain_dense(f) and f not in dense_best.values()) or (_learned(f) and f not in routed_best):
            continue
        out[f] = replace(f, lr_mult=d.best)
    declared = declared_families(study)
    for f in declared:
        leader = leader_of(f, declared)
        if leader is None:
            continue
        if leader in out:
            out[f] = replace(f, lr_mult=out[leader].lr_mult)
            continue
        # The leader is a size its sweep did not confirm: the control follows the confirmed size
        # (same gate and scope at the size the claim compares), at that size's value.
        size = next((a for a in routed_best if replace(a, depth=0, width=0) == replace(leader, depth=0, width=0)), None)
        if size is not None and size in out:
            moved = replace(f, depth=size.depth, width=size.width)
            out[moved] = replace(moved, lr_mult=out[size].lr_mult)
    settings = study.claim_settings.get("mod_vs_best_dense")
    reference = dense_best.get(study.base.train.budget)
    if settings and settings.positive_control and reference is not None and reference in out:
        control = replace(out[reference], budget=settings.positive_control,  # the same model, a smaller budget
                          control=f"{POSITIVE_CONTROL}: {study.label(reference)} at {settings.positive_control}")
        out[control.family] = control
    return out


# --- the isoFLOP optimum -----------------------------------------------------------------------
def fitted_optimum(study: StudySpec, points: list[TrialPoint]) -> tuple[Arm | None, dict[str, Any]]:
    """The dense depth nearest (in log parameters) to the isoFLOP parabola's optimum over the
    plain dense sizes at the study's budget, each at its best value; None when that depth is
    already a size (or the fit has no interior optimum, or fewer than three sizes finished)."""
    from modbench.report.isoflop import MIN_SIZES, fit_profile

    dec = decisions(study, points)
    budget = study.base.train.budget
    rows = []
    for f, d in dec.items():
        if _plain_dense(f) and f.budget == budget and d.best is not None:
            values, _ = _tuning_values(points, f, study.tune.seed)
            rows.append({"family": DENSE, "budget": 0.0, "params": _params(study, f), "loss": values[d.best],
                         "depth": f.depth, "width": f.width})
    if len(rows) < MIN_SIZES:
        return None, {"note": f"{len(rows)} dense sizes tuned: the fit needs {MIN_SIZES}"}
    fit = fit_profile(pd.DataFrame(rows), DENSE, 0.0)
    record = {"sizes": len(rows), "opt_params": fit.opt_params, "inside": fit.inside, "note": fit.note}
    if not fit.inside:
        return None, record
    max_depth = max(r["depth"] for r in rows)
    candidates = {d: _params(study, Arm(DENSE, depth=d, budget=budget)) for d in range(1, 2 * max_depth + 1)}
    depth = min(candidates, key=lambda d: abs(math.log(candidates[d]) - math.log(fit.opt_params)))
    record.update(nearest_depth=depth, nearest_params=candidates[depth])
    if any(r["depth"] == depth and not r["width"] for r in rows):
        record["note"] += f"; the nearest depth ({depth}) is a size already trained"
        return None, record
    return Arm(DENSE, depth=depth, budget=budget), record


def _params(study: StudySpec, arm: Arm) -> int:
    cfg = study.run_config(arm, study.tune.seed)
    return non_embedding_params(cfg.model, cfg.routing)


# --- extra seeds to a target precision -------------------------------------------------------
SeedRule = Callable[[str, float, float, int], int]  # (kind: "half_width"|"equivalence", sd, target, cap) -> seeds


def effects_seed_rule(kind: str, sd: float, target: float, cap: int) -> int:
    """The statistics module's two-stage rule (imported here: the report owns the statistics)."""
    from modbench.report.effects import seeds_for_equivalence, seeds_for_half_width

    if kind == "half_width":
        return int(seeds_for_half_width(sd, target, cap=cap))
    return int(seeds_for_equivalence(sd, target, cap=cap))


def primary_pair(study: StudySpec, kind: str, best: dict[Arm, Arm]) -> tuple[Arm, Arm] | None:
    """(arm, reference) of a claim's pre-registered primary contrast, among the confirmed arms."""
    families = list(best)
    settings = study.claim_settings.get(kind)
    learned = [f for f in families if _learned(f)]
    if kind == "methods_vs_sigmoid":  # the reference recipe is no method of its own claim
        learned = [f for f in learned if f.variant != METHODS_REFERENCE]
    primary = next((f for f in learned if not settings or not settings.primary or f.variant == settings.primary), None)
    if primary is None:
        return None
    if kind == "mod_vs_best_dense":
        ref = next((f for f in families if _plain_dense(f) and f.budget == primary.budget), None)
    elif kind == "learned_vs_random":
        ref = next((f for f in families if f.variant == RANDOM_CONTROL.get(primary.variant) and f.shape == primary.shape), None)
    elif kind == "methods_vs_sigmoid":
        ref = next((f for f in families if f.variant == METHODS_REFERENCE and f.shape == primary.shape), None)
    else:  # causal_rule: a within-run quantity, no pair
        return None
    return (best[primary], best[ref]) if ref is not None else None


def extra_seeds(study: StudySpec, points: list[TrialPoint], best: dict[Arm, Arm], rule: SeedRule) -> tuple[list[tuple[Arm, int]], dict]:
    """The seeds each claim's primary contrast needs beyond the confirmation seeds (two-stage
    rule), as (arm, seed) points, and what was computed."""
    values = {(p.arm, p.seed): p.headline for p in points if p.state == "COMPLETE" and p.headline is not None}
    first_new = max([*study.settings.seeds, study.tune.seed]) + 1
    queue, record = [], {}
    for kind, settings in study.claim_settings.items():
        if not settings.max_seeds:
            continue
        pair = primary_pair(study, kind, best)
        if pair is None:
            record[kind] = {"note": "no primary pair among the confirmed arms"}
            continue
        arm, ref = pair
        diffs = [values[(arm, s)] - values[(ref, s)] for s in confirm_seeds(study)
                 if (arm, s) in values and (ref, s) in values and math.isfinite(values[(arm, s)] - values[(ref, s)])]
        entry = {"arm": study.label(arm), "reference": study.label(ref), "pairs": len(diffs), "cap": settings.max_seeds,
                 "metric": HEADLINE}
        if len(diffs) < 2:
            record[kind] = {**entry, "note": "fewer than 2 paired confirmation seeds: no SD, no extra seeds"}
            continue
        sd = float(np.std(diffs, ddof=1))
        needed = []
        if settings.ci_half_width is not None:
            needed.append(rule("half_width", sd, settings.ci_half_width, settings.max_seeds))
        if settings.margin is not None:
            needed.append(rule("equivalence", sd, settings.margin, settings.max_seeds))
        target = min(max(needed), settings.max_seeds)
        add = list(range(first_new, first_new + max(0, target - len(diffs))))
        # The positive control is paired with C1's reference by seed: it runs the seeds the
        # reference runs, so its contrast has the primary contrast's precision.
        followers = [a for f, a in best.items() if f.control.startswith(POSITIVE_CONTROL)] if kind == "mod_vs_best_dense" else []
        queue += [(a, s) for s in add for a in (arm, ref, *followers)]
        record[kind] = {**entry, "sd": sd, "needed": target, "added_seeds": add,
                        **({"positive_control": study.label(followers[0])} if followers else {})}
    return queue, record


# --- the stages --------------------------------------------------------------------------------
def plan(study: StudySpec, points: list[TrialPoint], history: Iterable[str], rule: SeedRule = effects_seed_rule) -> Plan:
    """The next stage with something to do, given every trial (all finished) and the stages
    already recorded (``history``: ``optimum`` and ``seeds`` run once). A stage whose queue is
    empty (an optimum already trained, no seeds needed) is still returned so that it is recorded."""
    done = set(history)
    seed = study.tune.seed
    grid = [(replace(f, lr_mult=v), seed) for f in tuned_families(study) for v in study.tune.lr_mult]
    if queue := _missing(grid, points):
        return Plan(TUNE, queue)
    dec = decisions(study, points)
    extend = [(replace(f, lr_mult=d.extend), seed) for f, d in dec.items() if d.extend is not None]
    if queue := _missing(extend, points):
        return Plan(EXTEND, queue, {study.label(f): d.note for f, d in dec.items() if d.extend is not None})
    if OPTIMUM not in done:
        arm, record = fitted_optimum(study, points)
        queue = _missing([(replace(arm, lr_mult=v), seed) for v in study.tune.lr_mult], points) if arm else ()
        return Plan(OPTIMUM, queue, record)
    best = best_arms(study, points)
    if queue := _missing([(a, s) for a in best.values() for s in confirm_seeds(study)], points):
        return Plan(CONFIRM, queue, {study.label(f): _fmt(a.lr_mult) for f, a in best.items()})
    if SEEDS not in done and any(c.max_seeds for c in study.claim_settings.values()):
        wanted, record = extra_seeds(study, points, best, rule)
        return Plan(SEEDS, _missing(wanted, points), record)
    return Plan(COMPLETE)


# --- the per-family table for the report -----------------------------------------------------
def family_table(study: StudySpec, points: list[TrialPoint]) -> pd.DataFrame:
    """One row per tuned family: the grid tried on the tuning seed, the best value, bracketed
    yes/no (and why not), failed values with their reasons, and the value its confirmation
    seeds ran at (``confirmed_arm``: its label, the arm a claim compares); random controls and
    the positive control name the family they follow. ``won_by``: how far the best value beat the
    runner-up on the tuning seed; ``seed_sd``: the SD of the confirmed arm's validation value over its
    confirmation seeds; a choice won by less than that is within the seed noise (``within_noise``):
    another tuning seed might have picked another value."""
    dec = decisions(study, points)
    best = best_arms(study, points)
    rows = []
    for f, d in dec.items():
        won_by, sd = _winning_margin(study, points, f, d.best), _seed_sd(study, points, best.get(f))
        rows.append({"family": study.label(f), "variant": f.variant, "grid": ", ".join(f"{v:g}" for v in d.grid),
                     "best_lr_mult": d.best, "bracketed": d.bracketed, "note": d.note, "failed": "; ".join(d.failed),
                     "confirmed_at": best[f].lr_mult if f in best else None,
                     "confirmed_arm": study.label(best[f]) if f in best else None, "follows": "",
                     "won_by": won_by, "seed_sd": sd,
                     "within_noise": None if won_by is None or sd is None else bool(won_by < sd)})
    declared = declared_families(study)
    for f, arm in best.items():
        if f in dec:
            continue
        leader = leader_of(f, declared)
        rows.append({"family": study.label(f), "variant": f.variant, "grid": "", "best_lr_mult": None,
                     "bracketed": None, "note": "runs at the best value of the family it follows", "failed": "",
                     "confirmed_at": arm.lr_mult, "confirmed_arm": study.label(arm),
                     "follows": study.label(leader) if leader else "the best dense model (positive control)",
                     "won_by": None, "seed_sd": None, "within_noise": None})
    columns = ["family", "variant", "grid", "best_lr_mult", "bracketed", "note", "failed", "confirmed_at", "confirmed_arm",
               "follows", "won_by", "seed_sd", "within_noise"]
    return pd.DataFrame(rows, columns=columns)


def _winning_margin(study: StudySpec, points: list[TrialPoint], family: Arm, best: float | None) -> float | None:
    """The runner-up's validation value minus the best's, on the tuning seed (None: nothing to beat)."""
    values = {p.arm.lr_mult: p.value for p in points
              if p.seed == study.tune.seed and p.arm.family == family and p.value is not None}
    others = sorted(v for m, v in values.items() if m != best)
    return others[0] - values[best] if best in values and others else None


def _seed_sd(study: StudySpec, points: list[TrialPoint], arm: Arm | None) -> float | None:
    """SD of ``arm``'s validation value over its confirmation seeds (None: fewer than two)."""
    values = [p.value for p in points if arm is not None and p.arm == arm and p.seed != study.tune.seed
              and p.value is not None]
    return float(np.std(values, ddof=1)) if len(values) >= 2 else None


def points_from_frame(trials: pd.DataFrame) -> list[TrialPoint]:
    """``TrialPoint``s from a trials frame (``modbench.track.optuna_store.trials_frame``, the
    report's ``ReportData.trials``): arm columns, seed, state, metrics, fail_reason."""
    out = []
    for _, row in trials.iterrows():
        params = {k: row[k] for k in ARM_KEYS if k in row and not _missing_value(row[k])}
        if "variant" not in params or _missing_value(row.get("seed")):
            continue
        value, headline = finite_or_none(row.get(SELECT)), finite_or_none(row.get(HEADLINE))
        reason = row.get("fail_reason")
        out.append(TrialPoint(Arm.from_params(params), int(row["seed"]), str(row["state"]), str(row.get("stage") or ""),
                              value, headline, reason if isinstance(reason, str) else ""))
    return out


def _missing_value(x: Any) -> bool:
    return x is None or (isinstance(x, float) and math.isnan(x))


def finite_or_none(x: Any) -> float | None:
    """``x`` as a float when it is a finite number, else None (a failed or diverged trial's value)."""
    try:
        x = float(x)
    except (TypeError, ValueError):
        return None
    return x if math.isfinite(x) else None
