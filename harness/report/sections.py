"""A report's numbers: every section's data, computed from the trials and the measurements.

The report is built in three steps, one module each: this module computes what every section
says (the data ``summary.json`` and the CSVs hold), ``modbench.report.render`` turns that into
markdown, and ``modbench.report.figures`` draws the figures from the same data. No section
computes while it renders, so a report re-rendered from its saved data
(``modbench.report.data_files``) says exactly what the first build said.

``compute(data, measured, tuning)`` returns :class:`Sections`:

    claims:    [Claim]: id, statement, verdict, estimate, CI, seeds, margin, class, … (the regime gate applied)
    arms:      per arm: test causal bpb and CI, top-k bpb, realised fraction, train and decode FLOPs/token
    baselines: n-gram and compressor bits per byte on val and test, and on the arms' own windows
    effects:   every compared pair's difference with CI, Holm p, TOST p, MDE; ``per_seed`` its dots
    ties:      each tie at different cost and who wins it by the declared ``tie_break``
    tuning:    per family: LR grid, best value, bracketed, won by, seed SD (studies with [tune])
    isoflop:   the dense profile: each size at its best LR, the fit, the reference and what it is
    compute:   trials, complete, wall and trial seconds, training FLOPs
and the per-group top-k diagnostics (``topk_arms``, ``comparisons``, Pareto fronts, causal gaps).

Every number here is computed from the study's trials by the command that writes the report.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np
import pandas as pd

from modbench.config.model import lr_scale, wd_scale
from modbench.data import load_corpus
from modbench.design.study_file import StudySpec
from modbench.design.vocabulary import DENSE, HEADLINE, SELECT
from modbench.model.sizing import non_embedding_params
from modbench.report import claims as claims_module
from modbench.report.baselines import WINDOW_ORDER, Baselines, fit_ngrams, sanity_baselines
from modbench.report.claims import arm_summary, test_claims
from modbench.report.collect import ReportData, row_arm
from modbench.report.effects import compare_effects
from modbench.report.isoflop import MIN_SIZES, best_lr_points, dense_reference, profiles
from modbench.report.measure import Measurements
from modbench.report.stats import compare_to_baseline, holm, pareto_front, summarize
from modbench.report.stats_text import describe_comparison
from modbench.track.optuna_store import SLOT_ATTR

SUMMARY_VERSION = 4  # 3: decode_costs; 4: provenance, searches, like_for_like, decision, versus_dense
ALPHA = 0.05
TOPK = "test/bpb"  # the training-time (top-k) rule on the same test windows
LEARNED_VS_RANDOM = "C2"
MOD_VS_DENSE = "C1"
REGIME_NOT_REACHED = "regime not reached"  # a claim's class when its compared arms do not beat counting
CLAIM_KINDS = {"C1": "mod_vs_best_dense", "C2": "learned_vs_random", "C4": "methods_vs_sigmoid"}  # claims.py's ids
TIE_COST = {"decode_flops": ("decode_flops_per_token", "decode FLOPs/token"),
            "train_flops": ("flops_per_token", "training FLOPs/token")}

TuningTable = Callable[[StudySpec, pd.DataFrame], pd.DataFrame]


@dataclass
class IsoflopData:
    """The dense isoFLOP profile (paper §4.1) and the C1 reference, as the section shows them."""
    budget: float
    best_dense: str  # the best dense arm (lowest validation causal bpb)
    chosen_on: str  # "on the tuning seed 0" or "mean over each size's seeds"
    c1: str | None  # the dense arm C1 compares against, if it made that comparison
    changes: pd.DataFrame  # per size: params, depth, width, best lr_mult, peak LR, weight decay, steps, val, bracketed
    val_column: str  # the name of the compared validation column
    n_sizes: int
    fits: pd.DataFrame  # every family's fit (isoflop_fits.csv)
    dense_fit: pd.DataFrame
    versus: pd.DataFrame  # optimum against optimum
    points: pd.DataFrame  # the dense sizes at their best LR (the figure's points)
    others: pd.DataFrame  # the dense models at another LR (the figure's faint points)
    mod: pd.DataFrame  # the MoD arms C1 compares (the figure's diamonds)
    record: dict  # summary.json's ``isoflop``


@dataclass
class ClaimsData:
    """The opening and the claims sections of a study that declares claims (or any study's arm table)."""
    arms: pd.DataFrame
    baselines: dict[str, Baselines]
    tuning: pd.DataFrame
    claims: list
    effects: pd.DataFrame
    causal_tables: list[pd.DataFrame]
    compared: pd.DataFrame  # the rows the effects were computed on
    flagged: dict[str, str]  # degenerate arms and why
    ties: list[dict]
    registration: dict
    costs: pd.DataFrame
    compute: dict
    per_seed: pd.DataFrame  # each compared pair's per-seed differences (the forest plot's dots)
    topk_c2: pd.DataFrame  # C2 on top-k beside causal
    cost_pairs: pd.DataFrame  # decode and training FLOPs of every compared pair
    isoflop: IsoflopData | None
    curves_reference: str | None
    decision: dict = field(default_factory=dict)  # which claims the study decided, and what deciding the rest would take
    versus_dense: pd.DataFrame = field(default_factory=pd.DataFrame)  # a study without claims: each routed arm − its dense
    like_for_like: pd.DataFrame = field(default_factory=pd.DataFrame)  # what each primary contrast holds equal
    searches: dict = field(default_factory=dict)  # search group -> {"sizes", "lr_runs", "families"}


@dataclass
class Diagnostics:
    """The per-group diagnostics on validation top-k bpb (the report's "Details")."""
    arms: pd.DataFrame
    comparisons: pd.DataFrame
    notes: list[str]
    summary: pd.DataFrame
    sentences: list[str]
    front_flops: pd.Series
    front_speed: pd.Series
    causal_gaps: pd.DataFrame


@dataclass
class Sections:
    data: ReportData
    measured: Measurements
    claims: ClaimsData | None
    diagnostics: Diagnostics | None
    routing_hard: pd.DataFrame = field(default_factory=pd.DataFrame)  # arithmetic: routing against ground truth


def compute(data: ReportData, measured: Measurements, tuning: pd.DataFrame) -> Sections:
    """Every section's data (``tuning``: ``tuning_table(data, …)``, empty without [tune])."""
    if data.done.empty:
        return Sections(data, measured, None, None)
    return Sections(data, measured, claims_data(data, measured, tuning), diagnostics(data), routing_hard(data.done))


# --- baselines and the regime ----------------------------------------------------------------------
def baselines_for(data: ReportData) -> dict[str, Baselines]:
    """The sanity baselines of each split, the n-grams also on the arms' own evaluation windows.

    A corpus that depends on the seed (``arithmetic``) gives each seed its own windows: the
    baselines are then the mean over the study's seeds, as the arms' numbers are."""
    t = data.study.base.train
    corpora = {}
    for seed in data.study.settings.seeds:
        corpus = load_corpus(t.dataset, seed=int(seed))
        corpora.setdefault(corpus.sha256, corpus)
    per_corpus = []
    for corpus in corpora.values():
        models = fit_ngrams(corpus.split("train"))
        per_corpus.append({split: sanity_baselines(corpus.split("train"), corpus.split(split), split,
                                                   windows=(t.seq_len, t.eval_windows), models=models)
                           for split in ("val", "test")})
    return {split: _mean_baselines([b[split] for b in per_corpus]) for split in ("val", "test")}


def _mean_baselines(found: list[Baselines]) -> Baselines:
    if len(found) == 1:
        return found[0]
    rows = [b.to_dict() for b in found]
    mean = {k: (float(np.mean([r[k] for r in rows])) if isinstance(rows[0][k], float) else rows[0][k]) for k in rows[0]}
    return Baselines(**mean)


def count_bar(base: Baselines) -> tuple[float, str]:
    """The count model the arms must beat: the 4-gram on their own test windows when computed."""
    if base.window_fourgram is not None:
        return base.window_fourgram, (f"count {WINDOW_ORDER}-gram model (Kneser–Ney, fit on train) scored on the same "
                                      f"{base.window_bytes} test bytes the arms are scored on")
    return base.trigram, "count trigram model on the test split"


def regime_gate(claims: list, effects: pd.DataFrame, arms: pd.DataFrame, base: dict[str, Baselines]) -> list:
    """The claims, each whose compared arms do not all beat the count bar (``count_bar``) re-classed
    "regime not reached" with its verdict replaced (issue "Best against best": verdicts only where
    the models have learned more than short byte statistics; the numbers stay in the tables). A
    claim's compared arms are its primary contrast's arm and reference; a claim without an effect row
    (C3's within-run quantities) is gated when no arm beats the bar."""
    bar, name = count_bar(base["test"])
    score = arms.set_index("arm")["causal_bpb"]
    out = []
    for claim in claims:
        if claim.verdict_class == claims_module.FLAGGED:  # a degenerate arm is the stronger reason: it stays
            out.append(claim)
            continue
        rows = rows_of(effects, claim.id)
        compared = [rows.iloc[0]["arm"], rows.iloc[0]["reference"]] if len(rows) else list(score.index)
        short = [a for a in compared if a in score and not score[a] < bar]
        if not short or (not len(rows) and len(short) < len(compared)):
            out.append(claim)
            continue
        if len(rows):
            listed = ", ".join(f"{a} ({score[a]:.3f})" for a in short)
            who = f"{listed} do{'es' if len(short) == 1 else ''} not beat the"
        else:  # a within-run claim: no arm beats the bar, and naming every arm would bury the point
            who = "no arm beats the"
        best = "" if len(rows) else f"; the best arm, {score.idxmin()}, reaches {score.min():.3f}"
        out.append(replace(claim, verdict_class=REGIME_NOT_REACHED,
                           verdict=f"regime not reached: {who} {name} ({bar:.3f} bpb{best}): no verdict"))
    return out


def tie_records(claims: list, effects: pd.DataFrame, arms: pd.DataFrame, study) -> list[dict]:
    """For each primary claim that ties ("equivalent") two arms of different cost: what each costs,
    relative to the reference, and who wins by the claim's declared ``tie_break`` ("" when none was
    declared; winner None: no winner)."""
    cost = arms.set_index("arm")
    records = []
    for claim in claims:
        rows = rows_of(effects, claim.id)
        if claim.verdict_class != "equivalent" or not claim.primary or rows.empty:
            continue
        arm, ref = rows.iloc[0]["arm"], rows.iloc[0]["reference"]
        if arm not in cost.index or ref not in cost.index:
            continue
        ratios = {rule: cost.loc[arm, col] / cost.loc[ref, col] - 1 for rule, (col, _) in TIE_COST.items()}
        kind = CLAIM_KINDS.get(claim.id[:2], "")
        rule = getattr(study.claim_settings.get(kind), "tie_break", "")
        winner = None
        if rule:
            column = TIE_COST[rule][0]
            a, r = cost.loc[arm, column], cost.loc[ref, column]
            winner = arm if a < r else ref if r < a else None
        records.append({"claim": claim.id, "arm": arm, "reference": ref, "rule": rule, "winner": winner, **ratios})
    return records


def rows_of(effects: pd.DataFrame, claim_id: str) -> pd.DataFrame:
    """The effect rows of one claim: its own id, or (C4a, C4b, …) its place in its family."""
    if effects.empty or "claim" not in effects:
        return effects
    if "claim_id" in effects:  # claims.py names each row's Claim (C4's flagged sub-ids have no row)
        return effects[effects["claim_id"] == claim_id]
    own = effects[effects["claim"] == claim_id]
    if len(own) or len(claim_id) < 3:
        return own
    family = effects[effects["claim"] == claim_id[:2]].reset_index(drop=True)
    i = _letter_index(claim_id[2:])
    return family.iloc[i:i + 1] if i < len(family) else family.iloc[:0]


def _letter_index(letters: str) -> int:
    i = 0
    for ch in letters:
        i = i * 26 + (ord(ch) - ord("a") + 1)
    return i - 1


def degenerate(done: pd.DataFrame, study) -> dict[str, str]:
    """Arms whose router collapsed (``claims.degenerate_arms``) and why."""
    return dict(claims_module.degenerate_arms(done, study))


def compute_summary(trials: pd.DataFrame, slot_calls: list[dict] | None = None) -> dict:
    """Trials, training FLOPs of the finished ones, worker time (sum of trial durations) and wall
    time (first start to last finish), from Optuna's timestamps; for a study that ran on lent GPUs,
    its slot calls (``modbench.study.slot.call_summary``: device, minutes, workers, the probe)."""
    out: dict = {"trials": int(len(trials)),
                 "complete": int((trials["state"] == "COMPLETE").sum()) if len(trials) else 0,
                 "train_flops": None, "trial_s": None, "wall_s": None, "slot_calls": list(slot_calls or [])}
    if "perf/total_flops" in trials:
        flops = pd.to_numeric(trials.loc[trials["state"] == "COMPLETE", "perf/total_flops"], errors="coerce")
        out["train_flops"] = float(flops.sum()) if flops.notna().any() else None
    if {"started", "finished"} <= set(trials.columns):
        start, end = pd.to_datetime(trials["started"]), pd.to_datetime(trials["finished"])
        timed = start.notna() & end.notna()
        if timed.any():
            out["trial_s"] = float((end[timed] - start[timed]).dt.total_seconds().sum())
            out["wall_s"] = float((end[timed].max() - start[timed].min()).total_seconds())
    return out


def seed_differences(done: pd.DataFrame, effects: pd.DataFrame, metric: str = HEADLINE) -> pd.DataFrame:
    """Per compared pair, arm − reference on each seed both ran (the forest plot's dots)."""
    rows = []
    by_seed = done.groupby(["arm", "seed"])[metric].mean()
    for _, e in effects.iterrows():
        if e["arm"] not in by_seed.index.get_level_values(0) or e["reference"] not in by_seed.index.get_level_values(0):
            continue
        a, r = by_seed.loc[e["arm"]], by_seed.loc[e["reference"]]
        for seed in a.index.intersection(r.index):
            rows.append({"claim": e.get("claim", ""), "arm": e["arm"], "reference": e["reference"], "seed": seed,
                         "diff": float(a[seed] - r[seed])})
    return pd.DataFrame(rows, columns=["claim", "arm", "reference", "seed", "diff"])


def topk_beside_causal(done: pd.DataFrame, effects: pd.DataFrame) -> pd.DataFrame:
    """C2 on the training-time top-k rule beside the deployable causal rule: per pair, both
    differences and the share of the top-k advantage the causal rule keeps (None: no advantage)."""
    if effects.empty or "claim" not in effects or TOPK not in done:
        return pd.DataFrame()
    c2 = effects[effects["claim"] == LEARNED_VS_RANDOM]
    if c2.empty:
        return pd.DataFrame()
    topk = compare_effects(done, TOPK, list(zip(c2["arm"], c2["reference"])))
    rows = []
    for (_, c), (_, t) in zip(c2.iterrows(), topk.iterrows()):
        kept = c["estimate"] / t["estimate"] if t["estimate"] and np.isfinite(t["estimate"]) and t["estimate"] < 0 else None
        rows.append({"arm": c["arm"], "reference": c["reference"], "causal": c["estimate"], "causal_low": c["ci_low"],
                     "causal_high": c["ci_high"], "topk": t["estimate"], "topk_low": t["ci_low"],
                     "topk_high": t["ci_high"], "kept": kept})
    return pd.DataFrame(rows)


def cost_pairs(arms: pd.DataFrame, effects: pd.DataFrame) -> pd.DataFrame:
    """Forward (decode) and training FLOPs per token of every compared pair, beside its Δ bpb."""
    if effects.empty:
        return pd.DataFrame()
    by = arms.set_index("arm")
    rows = []
    for _, e in effects.iterrows():
        if e["arm"] not in by.index or e["reference"] not in by.index:
            continue
        a, r = by.loc[e["arm"]], by.loc[e["reference"]]
        rows.append({"claim": e.get("claim", ""), "arm": e["arm"], "reference": e["reference"],
                     "estimate": e["estimate"],
                     "decode FLOPs/token (arm)": a["decode_flops_per_token"],
                     "decode FLOPs/token (reference)": r["decode_flops_per_token"],
                     "decode cost ratio": a["decode_flops_per_token"] / r["decode_flops_per_token"],
                     "train FLOPs/token ratio": a["flops_per_token"] / r["flops_per_token"]})
    return pd.DataFrame(rows)


# --- tuning -----------------------------------------------------------------------------------------
def tuning_table(data: ReportData, table: TuningTable | None) -> pd.DataFrame:
    """The per-family tuning table of a study with ``[tune]``, from ``table`` (the study runner's
    ``modbench.study.tuning.family_table`` over the trials, passed in by the caller: a report may
    not import ``study``); empty otherwise."""
    if table is None or not getattr(getattr(data.study, "tune", None), "lr_mult", ()) or data.done.empty:
        return pd.DataFrame()
    trials = data.trials.copy()
    metrics = [m for m in (SELECT, HEADLINE) if m in data.done and m not in trials]
    if metrics and "number" in trials:
        trials = trials.merge(data.done[["number", *metrics]], on="number", how="left")
    return table(data.study, trials)


def confirmed_arms(table: pd.DataFrame) -> list[str] | None:
    """The arms a study with ``[tune]`` compares (the tuning table's ``confirmed_arm``), or None
    without a tuning table (every arm, still on the confirmation seeds only)."""
    if table.empty or "confirmed_arm" not in table:
        return None
    return [str(a) for a in table["confirmed_arm"].dropna()]


def compared_rows(data: ReportData, tuning: pd.DataFrame) -> pd.DataFrame:
    """The trials the claims compare (the confirmation rows of the confirmed arms): what the
    effects are computed on, and whose checkpoints the decode costs are measured on."""
    done = _with_control(data.done)
    return claims_module.confirmation_rows(done, data.study, confirmed_arms(tuning)) if HEADLINE in done else done.iloc[:0]


def _with_control(done: pd.DataFrame) -> pd.DataFrame:
    if "control" not in done:
        done["control"] = ""
    return done


# --- the claims and the opening -------------------------------------------------------------------
def claims_data(data: ReportData, measured: Measurements, tuning: pd.DataFrame) -> ClaimsData | None:
    """The opening's and the claims sections' data (None when the trials hold no headline metric)."""
    done = _with_control(data.done)
    if HEADLINE not in done:
        return None
    arms = arm_summary(done, data.study)
    base = baselines_for(data)
    claims, effects, tables = test_claims(done, data.study, confirmed_arms(tuning))
    claims = regime_gate(claims, effects, arms, base)
    compared = compared_rows(data, tuning)
    tuning = flag_collapsed_runs(tuning, done, data.study)
    searches = search_groups(tuning, done, data.study)
    claims = [with_search(c, rows_of(effects, c.id), searches, done) for c in claims]
    return ClaimsData(
        arms=arms, baselines=base, tuning=tuning, claims=claims, effects=effects, causal_tables=tables,
        compared=compared, flagged=degenerate(compared, data.study), ties=tie_records(claims, effects, arms, data.study),
        registration=preregistration(data.attrs), costs=measured.decode_costs,
        compute=compute_summary(data.trials, (data.attrs.get(SLOT_ATTR) or {}).get("calls", [])),
        per_seed=seed_differences(compared, effects) if len(effects) else pd.DataFrame(),
        topk_c2=topk_beside_causal(compared, effects), cost_pairs=cost_pairs(arms, effects),
        isoflop=isoflop_data(data, effects), curves_reference=c1_reference(effects, done),
        like_for_like=like_for_like(data, compared, effects, claims), searches=searches,
        decision=decision_summary(claims, effects, arms),
        versus_dense=pd.DataFrame() if data.study.settings.claims else versus_dense(compared))


def preregistration(attrs: dict) -> dict:
    """What the runner recorded of the claims' settings (``modbench.study.points.preregister``): the
    settings, the commit and time they were fixed at, and any amendment since ({} when none)."""
    record = attrs.get("preregistered")
    if not record:
        return {}
    return {**record, "amendments": attrs.get("preregistration_amendments", []),
            "protocol_amendments": attrs.get("protocol_amendments", [])}


def provenance(data: ReportData) -> dict:
    """Where the numbers come from (lm-evaluation-harness's results carry the same): the commits the
    trials ran from, the study file's hash and text, the dataset and its hash, the trials' torch and
    python, and the versions of the packages that computed the report."""
    from importlib.metadata import PackageNotFoundError, version

    def installed(name: str) -> str:
        try:
            return version(name)
        except PackageNotFoundError:
            return "not installed"

    shas = sorted({s for s in data.done.get("git_sha", pd.Series(dtype=object)).dropna().astype(str)}) \
        or ([data.tags["git_sha"]] if data.tags.get("git_sha") else [])
    return {"trials_git_sha": shas, "study_file_sha256": data.study.file_sha256,
            "dataset": data.study.base.train.dataset, "dataset_sha256": data.tags.get("dataset_sha256"),
            "device": data.tags.get("device"), "torch_trials": data.tags.get("torch_version"),
            "python_trials": data.tags.get("python_version"),
            "packages_report": {n: installed(n) for n in PROVENANCE_PACKAGES}}


PROVENANCE_PACKAGES = ("modbench", "torch", "numpy", "scipy", "pandas", "statsmodels", "matplotlib", "mlflow", "optuna")


def summary_json(c: ClaimsData, data: ReportData) -> dict:
    """summary.json: the claims with the commit their settings were fixed at, the arms, baselines,
    compute, isoFLOP reference, tuning, decode costs, and the provenance of it all."""
    iso = c.isoflop.record if c.isoflop else {}
    study_name = data.study.name
    return {"version": SUMMARY_VERSION, "study": study_name, "headline_metric": HEADLINE,
            "provenance": provenance(data),
            "claims": [{**cl.to_dict(), "fixed_at_commit": c.registration.get("commit")} for cl in c.claims],
            "preregistration": c.registration, "ties": c.ties,
            "arms": c.arms.drop(columns=["variant"]).to_dict(orient="records"),
            "baselines": c.baselines["test"].to_dict(), "degenerate_arms": c.flagged, "compute": c.compute,
            "reference": iso.get("reference"), "isoflop": iso,
            "tuning": c.tuning.to_dict(orient="records"), "decode_costs": c.costs.to_dict(orient="records"),
            "searches": c.searches, "like_for_like": c.like_for_like.to_dict(orient="records"),
            "decision": c.decision, "versus_dense": c.versus_dense.to_dict(orient="records")}


def versus_dense(done: pd.DataFrame) -> pd.DataFrame:
    """A study that declares no claims still answers the first question: each routed arm against
    the dense arm of its group (same depth, budget and LR multiplier), on test causal bpb, paired by
    seed, with a 95 % CI and Holm across the arms. Empty when a group has no dense arm."""
    pairs = []
    for _, g in done.groupby("group"):
        dense = g[g["variant"] == DENSE]["arm"].unique()
        if len(dense):
            pairs += [(a, str(dense[0])) for a in g[g["variant"] != DENSE]["arm"].unique()]
    return compare_effects(done, HEADLINE, pairs) if pairs and HEADLINE in done else pd.DataFrame()


DECIDED = ("better", "worse", "equivalent")


def decision_summary(claims: list, effects: pd.DataFrame, arms: pd.DataFrame) -> dict:
    """Which claims the study decided (better, worse or equivalent), which it did not and why (the
    regime not reached; an interval too wide for its margin), what deciding them would take (the
    seeds per arm to detect each undecided contrast's observed difference with 80 % power), and
    whether the best arm on test causal bpb is a random control."""
    from modbench.design.vocabulary import CONTROL_VARIANTS

    decided = [c.id for c in claims if c.verdict_class in DECIDED]
    undecided = [c for c in claims if c.verdict_class not in DECIDED and c.verdict_class != claims_module.FLAGGED]
    need = []
    for c in undecided:
        rows = rows_of(effects, c.id)
        # an interval too wide for its claim (the test itself undecided), not only a gated verdict
        if (len(rows) and "seeds_needed" in rows and pd.notna(rows.iloc[0]["seeds_needed"])
                and rows.iloc[0].get("verdict_class") == "inconclusive"):
            need.append(int(rows.iloc[0]["seeds_needed"]))
    best = arms.sort_values("causal_bpb").iloc[0] if len(arms) else None
    return {"decided": decided, "undecided": [c.id for c in undecided],
            "regime_not_reached": [c.id for c in undecided if c.verdict_class == REGIME_NOT_REACHED],
            "seeds_needed": [min(need), max(need)] if need else None,
            "best_arm": None if best is None else str(best["arm"]),
            "best_arm_is_random_control": bool(best is not None and best["variant"] in CONTROL_VARIANTS)}


# --- equal search, collapsed tuning runs, like for like -------------------------------------------------
def _family_arms(done: pd.DataFrame, study) -> dict[str, object]:
    """Each tuning family's label (the study's label of the arm at lr×1) and that family's Arm."""
    out = {}
    for _, r in done.drop_duplicates("arm").iterrows():
        family = row_arm(r).family
        out.setdefault(study.label(family), family)
    return out


def flag_collapsed_runs(tuning: pd.DataFrame, done: pd.DataFrame, study) -> pd.DataFrame:
    """The tuning table with each family's collapsed tuning runs (a router that processed almost no
    token, or almost every one: ``claims.degenerate_arms`` on the tuning seed's runs) in ``collapsed``,
    and ``collapsed_bracket``: the best value's bracket on some side is only such a run, so the
    bracket says the router broke there, not that the learning rate was worse."""
    if tuning.empty:
        return tuning
    runs = done[done["seed"] == study.tune.seed]
    flagged = claims_module.degenerate_arms(runs, study) if len(runs) else {}
    by_family: dict[str, dict[float, str]] = {}
    for _, r in runs[runs["arm"].isin(flagged)].drop_duplicates("arm").iterrows():
        by_family.setdefault(study.label(row_arm(r).family), {})[float(r["lr_mult"])] = flagged[r["arm"]].split(" (")[0]
    collapsed, bracket = [], []
    for row in tuning.itertuples():
        bad = by_family.get(row.family, {})
        collapsed.append("; ".join(f"lr×{m:g}: {why}" for m, why in sorted(bad.items())))
        grid = sorted(float(v) for v in str(row.grid).split(", ") if v) if row.grid else []
        best = row.best_lr_mult
        below = [m for m in grid if best is not None and m < best]
        above = [m for m in grid if best is not None and m > best]
        bracket.append(bool(bad) and best is not None and (
            (below and all(m in bad for m in below)) or (above and all(m in bad for m in above))))
    return tuning.assign(collapsed=collapsed, collapsed_bracket=bracket)


def search_groups(tuning: pd.DataFrame, done: pd.DataFrame, study) -> dict[str, dict]:
    """How much each compared family was searched: per isoFLOP family (dense; a routed variant at
    its capacity; a recursive model), the sizes tuned and the learning-rate runs on the tuning seed.
    Followers (random controls, the positive control) are not searched and not counted."""
    if tuning.empty:
        return {}
    arms = _family_arms(done, study)
    out: dict[str, dict] = {}
    for row in tuning[tuning["grid"].astype(str) != ""].itertuples():
        family = arms.get(row.family)
        if family is None:
            continue
        g = out.setdefault(profile_family(family), {"sizes": 0, "lr_runs": 0, "families": []})
        g["sizes"] += 1
        g["lr_runs"] += len(str(row.grid).split(", "))
        g["families"].append(row.family)
    return out


def _search_group(arm_label: str, done: pd.DataFrame) -> str | None:
    rows = done[done["arm"] == arm_label]
    return profile_family(row_arm(rows.iloc[0])) if len(rows) else None


def with_search(claim, rows: pd.DataFrame, searches: dict, done: pd.DataFrame):
    """The claim, its verdict saying so when its two sides were searched unequally (issue "Best
    against best": best against best means the same search for both families)."""
    if rows.empty or not searches or claim.verdict_class == claims_module.FLAGGED:
        return claim
    a, r = _search_group(rows.iloc[0]["arm"], done), _search_group(rows.iloc[0]["reference"], done)
    sa, sr = searches.get(a), searches.get(r)
    if a == r or sa is None or sr is None or (sa["sizes"], sa["lr_runs"]) == (sr["sizes"], sr["lr_runs"]):
        return claim
    said = (f"the two sides were searched unequally: {r} over {sr['sizes']} size{'s' * (sr['sizes'] != 1)} "
            f"({sr['lr_runs']} learning-rate runs), {a} over {sa['sizes']} size{'s' * (sa['sizes'] != 1)} "
            f"({sa['lr_runs']} runs), so the better-searched side had more chances to find its best")
    return replace(claim, verdict=f"{claim.verdict}; **{said}**", caveat=said)


def like_for_like(data: ReportData, compared: pd.DataFrame, effects: pd.DataFrame, claims: list) -> pd.DataFrame:
    """What each primary contrast holds equal and what it does not: both arms train at the study's
    FLOP budget (equal FLOPs); their training tokens and non-embedding parameters as ratios arm /
    reference; the arms of the study with the arm's parameter count (an equal-parameter partner);
    and the difference in validation top-k bpb at equal FLOPs (both runs' ends) beside the same
    difference at equal tokens (the longer run read off its curve at the shorter run's last token
    count, linear between evaluations; mid-schedule, so its learning rate had not annealed there,
    which flatters the shorter run), paired by seed, mean and t 95 % CI."""
    if effects.empty or compared.empty:
        return pd.DataFrame()
    params = _params_by_arm(data)
    confirmed = set(compared["arm"])
    rows = []
    for claim in claims:
        e = rows_of(effects, claim.id)
        if e.empty or not claim.primary:
            continue
        arm, ref = e.iloc[0]["arm"], e.iloc[0]["reference"]
        tok_a, tok_r = _tokens(compared, arm), _tokens(compared, ref)
        pa, pr = params.get(arm), params.get(ref)
        partners = [a for a, p in params.items() if pa and a not in (arm, ref) and a in confirmed
                    and _search_group(a, compared) != _search_group(arm, compared) and abs(p / pa - 1) < 0.02]
        flops, tokens = _equal_flops_and_tokens(data.curves, arm, ref)
        rows.append({"claim": claim.id, "arm": arm, "reference": ref,
                     "tokens ratio": tok_a / tok_r if tok_a and tok_r else None,
                     "params ratio": pa / pr if pa and pr else None,
                     "same-parameter arms": ", ".join(partners), **_interval("Δ val top-k, equal FLOPs", flops),
                     **_interval("Δ val top-k, equal tokens", tokens)})
    return pd.DataFrame(rows)


def _params_by_arm(data: ReportData) -> dict[str, float]:
    out = {}
    for _, r in data.done.drop_duplicates("arm").iterrows():
        cfg = data.study.run_config(row_arm(r), int(r["seed"]))
        out[str(r["arm"])] = float(non_embedding_params(cfg.model, cfg.routing))
    return out


def _tokens(done: pd.DataFrame, arm: str) -> float | None:
    """An arm's training tokens per trial: its training FLOPs over its FLOPs per token (seed mean)."""
    rows = done[done["arm"] == arm]
    if rows.empty or "perf/total_flops" not in rows:
        return None
    return float((pd.to_numeric(rows["perf/total_flops"]) / pd.to_numeric(rows["perf/flops_per_token"])).mean())


def _equal_flops_and_tokens(curves: pd.DataFrame, arm: str, ref: str) -> tuple[list[float], list[float]]:
    """Per seed both ran: arm − reference in validation top-k bpb at both runs' ends, and at the
    shorter run's last token count."""
    at_end, at_tokens = [], []
    if curves.empty:
        return at_end, at_tokens
    for seed in sorted(set(curves.loc[curves["arm"] == arm, "seed"]) & set(curves.loc[curves["arm"] == ref, "seed"])):
        a = curves[(curves["arm"] == arm) & (curves["seed"] == seed)].sort_values("tokens")
        r = curves[(curves["arm"] == ref) & (curves["seed"] == seed)].sort_values("tokens")
        at_end.append(float(a["val/bpb"].iloc[-1] - r["val/bpb"].iloc[-1]))
        t = min(a["tokens"].iloc[-1], r["tokens"].iloc[-1])
        at_tokens.append(float(np.interp(t, a["tokens"], a["val/bpb"]) - np.interp(t, r["tokens"], r["val/bpb"])))
    return at_end, at_tokens


def _interval(name: str, x: list[float]) -> dict[str, float | None]:
    """Mean and Student-t 95 % CI of paired differences (None where fewer than two)."""
    from scipy import stats

    v = np.asarray(x, dtype=float)
    if v.size == 0:
        return {name: None, f"{name} CI low": None, f"{name} CI high": None}
    if v.size < 2 or not v.std() > 0:
        return {name: float(v.mean()), f"{name} CI low": None, f"{name} CI high": None}
    low, high = stats.t.interval(0.95, v.size - 1, loc=v.mean(), scale=stats.sem(v))
    return {name: float(v.mean()), f"{name} CI low": float(low), f"{name} CI high": float(high)}


# --- the dense isoFLOP profile and the C1 reference ---------------------------------------------------
def profile_points(data: ReportData) -> pd.DataFrame:
    """One row per finished trial at a FLOP budget: its family, its size (the architecture, "L3 d160":
    two sizes with one parameter count stay two sizes), parameters, LR multiplier, validation causal
    bpb, and what else changes with size (depth, width, peak LR, weight decay, steps). The family of
    every vanilla dense model (derived controls included) is ``dense``: the dense profile; a
    recursive dense model is a family of its own ("dense middle_cycle N_R=3"), as is each routed
    variant at its capacity, so neither is ever a size of the dense profile."""
    done = data.done
    rows = []
    for _, r in done[done["budget"].astype(str).str.startswith("flops=")].iterrows():
        arm = row_arm(r)
        cfg = data.study.run_config(arm, int(r["seed"]))
        t = cfg.train
        rows.append({"family": profile_family(arm), "arm": r["arm"], "variant": r["variant"],
                     "size": " ".join(filter(None, (f"L{cfg.model.layers} d{cfg.model.width}", arm.recursion_text))),
                     "budget": float(str(r["budget"]).split("=")[1]), "params": non_embedding_params(cfg.model, cfg.routing),
                     "lr_mult": float(r["lr_mult"]), "seed": int(r["seed"]), "loss": r.get(SELECT),
                     "depth": cfg.model.layers, "width": cfg.model.width,
                     "peak LR": t.lr * (lr_scale(cfg.model.width) if t.scale_hparams else 1.0),
                     "weight decay": t.weight_decay * (wd_scale(cfg.model.layers) if t.scale_hparams else 1.0),
                     "steps": r.get("steps")})
    columns = ["family", "arm", "variant", "size", "budget", "params", "lr_mult", "seed", "loss", "depth", "width",
               "peak LR", "weight decay", "steps"]
    points = pd.DataFrame(rows, columns=columns)
    return points[np.isfinite(pd.to_numeric(points["loss"], errors="coerce"))]


def profile_family(arm) -> str:
    """The isoFLOP family of an arm: ``dense`` for a vanilla dense model, else what sets it apart."""
    what = DENSE if arm.variant == DENSE else f"{arm.variant} C={arm.capacity:g}"
    return f"{what} {arm.recursion_text}" if arm.recursion_text else what


def reference_name(sizes: pd.DataFrame) -> str:
    """What the best dense model is: the best of the sizes trained, with how its LRs were found."""
    n = len(sizes)
    bracketed = int(sizes["bracketed"].sum())
    lr = ("each LR bracketed" if bracketed == n else
          f"LR bracketed at {bracketed} of {n} sizes" if bracketed else "no size's LR bracketed")
    return f"best of {n} trained dense size{'s' if n != 1 else ''}, {lr}"


def isoflop_data(data: ReportData, effects: pd.DataFrame) -> IsoflopData | None:
    """The dense isoFLOP profile (paper §4.1): each size at its own best LR, the quadratic fit in
    log size with a CI from its residuals, the fitted optimum against the sizes trained, and what
    else changes with size (None when the study trained no dense model at its own budget)."""
    points = profile_points(data)
    tuning_seed = data.study.tune.seed if getattr(getattr(data.study, "tune", None), "lr_mult", ()) else None
    best, sizes = best_lr_points(points, tuning_seed)
    # The dense profile is the study's own budget: another budget (the positive control's) is another
    # profile, never averaged into a size of this one.
    budget = float(str(data.study.base.train.budget).split("=")[1])
    dense_sizes = sizes[(sizes["family"] == DENSE) & (sizes["budget"] == budget)]
    if dense_sizes.empty:
        return None
    dense_best, compared, best_dense = dense_reference(best, budget, tuning_seed, family=DENSE)
    on = f"on the tuning seed {tuning_seed}" if compared is not dense_best else "mean over each size's seeds"
    fitted = best[best.groupby(["family", "budget"])["size"].transform("nunique") >= MIN_SIZES]
    if tuning_seed is not None and (fitted["seed"] == tuning_seed).any():
        fitted = fitted[fitted["seed"] == tuning_seed]
    fits, versus = profiles(fitted, reference=DENSE) if len(fitted) else (pd.DataFrame(), pd.DataFrame())
    record = {"reference": reference_name(dense_sizes), "reference_arm": best_dense, "chosen": on,
              "sizes": dense_sizes.to_dict(orient="records"), "fits": fits.to_dict(orient="records") if len(fits) else []}
    c1 = c1_reference(effects, data.done) if len(effects) and (effects.get("claim") == MOD_VS_DENSE).any() else None
    changes = (dense_best.groupby("size", sort=False)
               .agg(params=("params", "first"), depth=("depth", "first"), width=("width", "first"),
                    lr_mult=("lr_mult", "first"),
                    peak_lr=("peak LR", "first"), weight_decay=("weight decay", "first"), steps=("steps", "mean"),
                    val_mean=("loss", "mean"), seeds=("seed", "nunique")).reset_index())
    changes.insert(changes.columns.get_loc("val_mean"), "val_compared",
                   changes["size"].map(compared.groupby("size")["loss"].mean()))
    changes = changes.merge(dense_sizes[["size", "lr grid", "bracketed"]], on="size")
    changes = changes.sort_values("params", kind="stable").drop(columns="size").reset_index(drop=True)
    others = points.merge(best[["arm", "seed"]], on=["arm", "seed"], how="left", indicator=True)
    others = others[(others["_merge"] == "left_only") & (others["family"] == DENSE) & (others["budget"] == budget)]
    dense_fit = fits[fits["family"] == DENSE] if len(fits) else fits
    val_column = f"val causal bpb ({'tuning seed' if compared is not dense_best else 'mean'})"
    return IsoflopData(budget, best_dense, on, c1, changes, val_column, len(dense_sizes), fits, dense_fit, versus,
                       dense_best, others, _mod_points(points, effects), record)


def _mod_points(points: pd.DataFrame, effects: pd.DataFrame) -> pd.DataFrame:
    """The learned MoD arms C1 compares, at their own size (the isoFLOP figure's diamonds)."""
    if effects.empty or "claim" not in effects:
        return points.iloc[:0]
    arms = effects[effects["claim"] == MOD_VS_DENSE]["arm"].unique()
    return points[points["arm"].isin(arms) & (points["variant"] != DENSE)]


def c1_reference(effects: pd.DataFrame, done: pd.DataFrame) -> str | None:
    """The dense arm C1 compares against (its first row), else the best dense arm on validation."""
    if len(effects) and "claim" in effects and (effects["claim"] == MOD_VS_DENSE).any():
        return str(effects[effects["claim"] == MOD_VS_DENSE].iloc[0]["reference"])
    dense = done[done["variant"] == DENSE]
    return str(dense.groupby("arm")[SELECT].mean().idxmin()) if len(dense) and SELECT in dense else None


# --- the per-group diagnostics (validation top-k) -----------------------------------------------------
def diagnostics(data: ReportData) -> Diagnostics:
    arms = arm_table(data)
    comp, notes = comparisons(data)
    table, sentences = summary_rows(arms, comp)
    m = arms.assign(m=arms["mean"].astype(float))
    return Diagnostics(arms, comp, notes, table, sentences,
                       pareto_front(m, minimize=["m", "flops_per_token"]),
                       pareto_front(m, minimize=["m"], maximize=["tokens_per_s"]), causal_gaps(data.done))


def arm_table(data: ReportData) -> pd.DataFrame:
    done = data.done
    if done.empty:
        return pd.DataFrame()
    summary = summarize(done, "val/bpb", by="arm", ci=0.95, method="t")
    extra = done.groupby("arm").agg(variant=("variant", "first"), capacity=("capacity", "first"), group=("group", "first"),
                                    flops_per_token=("perf/flops_per_token", "mean"),
                                    tokens_per_s=("perf/train_tokens_per_s", "max"),
                                    slowest_tokens_per_s=("perf/train_tokens_per_s", "min"),
                                    steps=("steps", "mean"), test_bpb=("test/bpb", "mean"))
    # Other processes can only slow a run down, so the fastest seed is the least disturbed
    # measurement of an arm's speed (as pytest-benchmark takes the minimum time); the spread
    # between its fastest and slowest seed shows how quiet the machine was.
    extra["tokens_per_s_spread"] = extra["tokens_per_s"] / extra.pop("slowest_tokens_per_s")
    failed = data.trials[data.trials.state == "FAIL"].groupby("arm").size().rename("n_failed_trials")
    out = summary.merge(extra, left_on="arm", right_index=True).merge(failed, left_on="arm", right_index=True, how="left")
    out["n_failed_trials"] = out["n_failed_trials"].fillna(0).astype(int)
    return out.sort_values(["group", "mean"]).reset_index(drop=True)


def comparisons(data: ReportData) -> tuple[pd.DataFrame, list[str]]:
    """Each group's routed arms vs its dense arm; Holm over the whole report's family."""
    frames, notes = [], []
    for group, g in data.done.groupby("group"):
        dense = g[g.variant == DENSE]["arm"].unique()
        if len(dense) == 0:
            notes.append(f"group {group}: no dense baseline in this study, so no comparison against dense is possible")
            continue
        c = compare_to_baseline(g, "val/bpb", baseline=dense[0], by="arm", alpha=ALPHA, correction="holm")
        c["group"] = group
        frames.append(c)
    if not frames:
        return pd.DataFrame(), notes
    comp = pd.concat(frames, ignore_index=True)
    for raw, adj in (("welch_p", "welch_p_adj"), ("mwu_p", "mwu_p_adj")):
        defined = comp[raw].notna()
        comp[adj] = None
        if defined.any():
            comp.loc[defined, adj] = holm(comp.loc[defined, raw].astype(float).tolist())
    m = int(comp["mwu_p"].notna().sum()) or 1
    comp["mwu_min_p_adj"] = (comp["mwu_min_p"] * m).clip(upper=1.0)
    comp["can_reach_significance"] = (comp["mwu_min_p_adj"] <= ALPHA) & (comp["n_arm"] >= 2) & (comp["n_base"] >= 2)
    comp["correction"] = "holm"
    return comp, notes


def summary_rows(arms: pd.DataFrame, comp: pd.DataFrame) -> tuple[pd.DataFrame, list[str]]:
    rows, sentences = [], []
    for group, g in arms.groupby("group"):
        g = g[g["mean"].notna()]
        if g.empty:
            continue
        best = g.sort_values("mean").iloc[0]
        row = {"group": group, "best arm": best["arm"], "val bpb": best["mean"],
               "95% CI": f"[{fmt(best['ci_low'])}, {fmt(best['ci_high'])}]" if best["ci_low"] is not None and not pd.isna(best["ci_low"]) else "n/a (n<2)",
               "n": int(best["n"]), "Holm p vs dense (Welch)": "baseline" if best["variant"] == DENSE else "n/a"}
        if best["variant"] != DENSE and not comp.empty:
            c = comp[(comp.group == group) & (comp.arm == best["arm"])]
            if len(c):
                row["Holm p vs dense (Welch)"] = fmt(c.iloc[0]["welch_p_adj"])
        rows.append(row)
    if not comp.empty:
        for _, c in comp.sort_values("mean_diff", na_position="last").iterrows():
            sentences.append(describe_comparison(c, unit="bpb"))
    return pd.DataFrame(rows), sentences


def causal_gaps(done: pd.DataFrame) -> pd.DataFrame:
    """Per routed arm, the means over seeds of the train/inference gap quantities."""
    cols = ["val/causal_gap", "val/dense_gap", "val/causal_agreement", "val/causal_fraction", "val/topk_leak_rate"]
    present = [c for c in cols if c in done]
    routed = done[done.variant != DENSE]
    if not present or routed.empty:
        return pd.DataFrame()
    return routed.groupby("arm")[present].mean().reset_index()


def routing_hard(done: pd.DataFrame) -> pd.DataFrame:
    """Routing against ground truth (the arithmetic task's hard tokens), per routed arm."""
    cols = ["val/hard_precision", "val/hard_recall", "val/hard_base_rate"]
    if "val/hard_precision" not in done:
        return pd.DataFrame()
    return done[done.variant != DENSE].groupby("arm")[cols].mean().reset_index()


def fmt(x, digits: int = 4) -> str:
    """A number as the report's tables print it ("n/a" for a missing one)."""
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "n/a"
    if isinstance(x, float):
        return f"{x:.{digits}g}" if abs(x) < 1e4 else f"{x:.3g}"
    return str(x)
