"""The report's first sections: the plain answers, claims with verdicts, causal-first arm table.

Written for every study (the regime check, the sanity baselines and the causal-first arm
table) and, when the study declares ``claims``, the claims, their effects with a forest plot,
C2 on top-k beside causal, the decode cost of the compared arms, the causal-rule table, the
dense isoFLOP profile, the tuning table and ``summary.json``:

    claims:    [{id, statement, verdict, estimate, ci_low, ci_high, n_seeds, detail, (margin, verdict_class, …)}]
    arms:      [{arm, causal_bpb, causal_ci_low, causal_ci_high, topk_bpb, realised_fraction,
                 flops_per_token, decode_flops_per_token, n_seeds, …}]
    baselines: {unigram, bigram, trigram, fourgram, zstd, gzip, xz, split, n_bytes,
                window_trigram, window_fourgram, window_bytes}   (bits per byte, test split)
    reference: the C1 dense reference and what it is ("best of N trained dense sizes, …")
    isoflop:   {fits: […], sizes: […]}                          (when the dense sweep has ≥ 3 sizes)
    tuning:    [{family, grid, best_lr_mult, bracketed, …}]      (studies with [tune])
    compute:   {trials, complete, wall_s, trial_s, train_flops}

The opening also holds, per compared arm, its measured decode costs (``modbench.report.decode_costs``
on the arm's first compared seed's checkpoint): KV bytes per token and KV-cached tokens/s, beside its
parameters and its training and decode FLOPs per token (``decode_costs`` in summary.json).

Every number here is computed from the study's trials by this command.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pandas as pd

from modbench.config.model import lr_scale, wd_scale
from modbench.design.study_file import StudySpec
from modbench.data import load_corpus
from modbench.model.sizing import non_embedding_params
from modbench.report import claims as claims_module
from modbench.report import figures
from modbench.report.baselines import WINDOW_ORDER, Baselines, fit_ngrams, sanity_baselines
from modbench.design.vocabulary import DENSE, HEADLINE, SELECT
from modbench.report.claims import arm_summary, test_claims
from modbench.report.collect import ReportData, row_arm
from modbench.report.decode_costs import BATCH, THREADS, measure_arms
from modbench.report.effects import compare_effects
from modbench.report.isoflop import MIN_SIZES, best_lr_points, dense_reference, profiles

SUMMARY_VERSION = 3  # 3: decode_costs
TOPK = "test/bpb"  # the training-time (top-k) rule on the same test windows
LEARNED_VS_RANDOM = "C2"
MOD_VS_DENSE = "C1"


def _fmt(x, digits: int = 4) -> str:
    if x is None or (isinstance(x, float) and x != x):
        return "n/a"
    return f"{x:.{digits}g}" if isinstance(x, float) else str(x)


def _signed(x) -> str:
    return "n/a" if x is None or (isinstance(x, float) and not math.isfinite(x)) else figures.signed(float(x))


def _ci(low, high) -> str:
    return "n/a (n<2)" if low is None or high is None or low != low else f"[{_signed(low)}, {_signed(high)}]"


def _table(df: pd.DataFrame) -> str:
    return df.map(lambda v: _fmt(v) if isinstance(v, float) else v).to_markdown(index=False)


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


def _bar(base: Baselines) -> tuple[float, str]:
    """The count model the arms must beat: the 4-gram on their own test windows when computed."""
    if base.window_fourgram is not None:
        return base.window_fourgram, (f"count {WINDOW_ORDER}-gram model (Kneser–Ney, fit on train) scored on the same "
                                      f"{base.window_bytes} test bytes the arms are scored on")
    return base.trigram, "count trigram model on the test split"


def regime_lines(arms: pd.DataFrame, base: dict[str, Baselines]) -> list[str]:
    """The first lines of the report: do the models beat counting? If not, say so plainly."""
    bar, name = _bar(base["test"])
    worse = arms[~(arms["causal_bpb"] < bar)]
    listed = ", ".join(f"{r.arm} ({_fmt(r.causal_bpb)})" for r in worse.itertuples())
    routed = arms[arms["variant"] != DENSE]
    if len(worse) == len(arms):
        return [f"> **Under-trained regime: routing conclusions are unreliable.** No arm beats a {name} "
                f"({bar:.3f} bpb); the best arm reaches {arms['causal_bpb'].min():.3f}. These models have not yet "
                "learned more than short byte statistics.", ""]
    if len(worse) and (worse["variant"] == DENSE).all() and len(routed) and (routed["causal_bpb"] < bar).all():
        margin = bar - routed["causal_bpb"].max()
        return [f"> **Under-trained: {len(worse)} of {len(arms)} arms do not beat a {name}** "
                f"({bar:.3f} bpb): {listed}. All of them are dense models (the large end of a size sweep trains too few "
                f"tokens at this budget, which an isoFLOP sweep must show); conclusions about those arms are unreliable. "
                f"Every routed arm beats it (the worst by {margin:.3f} bpb).", ""]
    if len(worse):
        return [f"> **Under-trained regime: routing conclusions are unreliable.** {len(worse)} of {len(arms)} arms do "
                f"not beat a {name} ({bar:.3f} bpb): {listed}.", ""]
    return [f"Every arm beats the {name} ({bar:.3f} bpb; best arm {arms['causal_bpb'].min():.3f}), so the models "
            "have learned more than short byte statistics.", ""]


REGIME_NOT_REACHED = "regime not reached"  # a claim's class when its compared arms do not beat counting


def regime_gate(claims: list, effects: pd.DataFrame, arms: pd.DataFrame, base: dict[str, Baselines]) -> list:
    """The claims, each whose compared arms do not all beat the count bar (``_bar``) re-classed
    "regime not reached" with its verdict replaced (issue "Best against best": verdicts only where
    the models have learned more than short byte statistics; the numbers stay in the tables). A
    claim's compared arms are its primary contrast's arm and reference; a claim without an effect row
    (C3's within-run quantities) is gated when no arm beats the bar."""
    bar, name = _bar(base["test"])
    score = arms.set_index("arm")["causal_bpb"]
    out = []
    for claim in claims:
        if claim.verdict_class == claims_module.FLAGGED:  # a degenerate arm is the stronger reason: it stays
            out.append(claim)
            continue
        rows = _rows_of(effects, claim.id)
        compared = [rows.iloc[0]["arm"], rows.iloc[0]["reference"]] if len(rows) else list(score.index)
        short = [a for a in compared if a in score and not score[a] < bar]
        if not short or (not len(rows) and len(short) < len(compared)):
            out.append(claim)
            continue
        listed = ", ".join(f"{a} ({score[a]:.3f})" for a in short)
        out.append(replace(claim, verdict_class=REGIME_NOT_REACHED,
                           verdict=f"regime not reached: {listed} do{'es' if len(short) == 1 else ''} not beat the "
                                   f"{name} ({bar:.3f} bpb): no verdict"))
    return out


CLAIM_KINDS = {"C1": "mod_vs_best_dense", "C2": "learned_vs_random", "C4": "methods_vs_sigmoid"}  # claims.py's ids
TIE_COST = {"decode_flops": ("decode_flops_per_token", "decode FLOPs/token"),
            "train_flops": ("flops_per_token", "training FLOPs/token")}


def tie_lines(claims: list, effects: pd.DataFrame, arms: pd.DataFrame, study) -> tuple[list[str], list[dict]]:
    """For each primary claim that ties ("equivalent") two arms of different cost: what each costs,
    and who wins by the claim's declared ``tie_break`` (or that none was declared)."""
    cost = arms.set_index("arm")
    lines, records = [], []
    for claim in claims:
        rows = _rows_of(effects, claim.id)
        if claim.verdict_class != "equivalent" or not claim.primary or rows.empty:
            continue
        arm, ref = rows.iloc[0]["arm"], rows.iloc[0]["reference"]
        if arm not in cost.index or ref not in cost.index:
            continue
        ratios = {rule: cost.loc[arm, col] / cost.loc[ref, col] - 1 for rule, (col, _) in TIE_COST.items()}
        costs = (f"{arm} costs {ratios['decode_flops']:+.0%} decode FLOPs/token and {ratios['train_flops']:+.0%} "
                 f"training FLOPs/token against {ref}")
        kind = CLAIM_KINDS.get(claim.id[:2], "")
        rule = getattr(study.claim_settings.get(kind), "tie_break", "")
        if not rule:
            lines.append(f"- **{claim.id} ties at different cost**: {costs}; the study declares no rule for a tie "
                         "(`tie_break`), so the tie alone names no winner.")
            records.append({"claim": claim.id, "arm": arm, "reference": ref, "rule": "", "winner": None, **ratios})
            continue
        column, what = TIE_COST[rule]
        a, r = cost.loc[arm, column], cost.loc[ref, column]
        winner = arm if a < r else ref if r < a else None
        verdict = f"**{winner} wins**" if winner else "neither is cheaper: no winner"
        lines.append(f"- **{claim.id} ties at different cost**: {costs}; by its declared rule (fewer {what} wins a tie) "
                     f"{verdict}.")
        records.append({"claim": claim.id, "arm": arm, "reference": ref, "rule": rule, "winner": winner, **ratios})
    return (lines + [""] if lines else []), records


def baseline_lines(base: dict[str, Baselines]) -> list[str]:
    table = pd.DataFrame([{"split": b.split, "bytes": b.n_bytes, "unigram": b.unigram, "bigram": b.bigram,
                           "trigram": b.trigram, "4-gram": b.fourgram, "trigram (arms' windows)": b.window_trigram,
                           "4-gram (arms' windows)": b.window_fourgram, "gzip": b.gzip, "xz": b.xz, "zstd": b.zstd}
                          for b in base.values()])
    return ["## Sanity baselines", "",
            "Bits per byte of count n-gram models (interpolated Kneser–Ney with one absolute discount per order, "
            "fit on train, sparse counts) on the whole split and on the arms' own evaluation windows (each window "
            "scored as the model scores it: every byte after its first, context only from inside the window), and "
            "of general-purpose compressors applied to the whole split. The compressors exploit repeats anywhere "
            "in the split; a model with a fixed context cannot, so they are a reference, not a bar.", "",
            _table(table), ""]


# --- the first lines: one sentence per claim, degenerate arms, compute ------------------------------
def _rows_of(effects: pd.DataFrame, claim_id: str) -> pd.DataFrame:
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


def claim_sentence(claim, effects: pd.DataFrame) -> str:
    """One plain sentence: who against whom, which way, by how much, how sure."""
    cls, margin = getattr(claim, "verdict_class", None), getattr(claim, "margin", None)
    rows = _rows_of(effects, claim.id)
    if cls is None or rows.empty:  # no effect row (C3's within-run quantities), or no verdict class yet
        numbers = (f"estimate {_signed(claim.estimate)}, 95 % CI {_ci(claim.ci_low, claim.ci_high)}, "
                   if claim.estimate is not None else "")
        return f"**{claim.id}**: {claim.verdict} ({numbers}{claim.n_seeds} seeds)."
    numbers = f"Δ = {_signed(claim.estimate)} bpb, 95 % CI {_ci(claim.ci_low, claim.ci_high)}, {claim.n_seeds} seeds"
    arm, ref = rows.iloc[0]["arm"], rows.iloc[0]["reference"]
    within = f" within ±{margin:g} bpb" if margin else ""
    if cls == REGIME_NOT_REACHED:
        return f"**{claim.id}**: {arm} against {ref}: {claim.verdict} ({numbers})."
    phrase = {"better": f"{arm} is better than {ref} on test causal bpb",
              "worse": f"{arm} is worse than {ref} on test causal bpb",
              "equivalent": f"{arm} ties {ref}{within} on test causal bpb",
              "inconclusive": f"{arm} against {ref}: inconclusive, " + (
                  f"neither a difference nor equivalence within ±{margin:g} bpb is shown" if margin
                  else "no difference is shown (and no equivalence margin was declared)")}.get(cls, claim.verdict)
    return f"**{claim.id}**: {phrase} ({numbers})."


def degenerate_lines(done: pd.DataFrame, study) -> tuple[list[str], dict[str, str]]:
    """Arms whose router collapsed (``claims.degenerate_arms``, when the statistics provide it)."""
    find = getattr(claims_module, "degenerate_arms", None)
    found = dict(find(done, study)) if find is not None else {}
    if not found:
        return [], found
    listed = "; ".join(f"{arm} ({reason})" for arm, reason in found.items())
    return [f"**Degenerate arms, excluded from every claim family:** {listed}.", ""], found


def compute_summary(trials: pd.DataFrame) -> dict[str, float | int | None]:
    """Trials, training FLOPs of the finished ones, worker time (sum of trial durations) and wall
    time (first start to last finish), from Optuna's timestamps."""
    out: dict[str, float | int | None] = {"trials": int(len(trials)),
                                           "complete": int((trials["state"] == "COMPLETE").sum()) if len(trials) else 0,
                                           "train_flops": None, "trial_s": None, "wall_s": None}
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


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "n/a"
    return f"{seconds / 60:.1f} min" if seconds < 7200 else f"{seconds / 3600:.2f} h"


def compute_line(c: dict) -> str:
    flops = f"{c['train_flops']:.3g} training FLOPs" if c["train_flops"] else "training FLOPs not recorded"
    return (f"The study ran {c['trials']} trials ({c['complete']} complete): {flops} (complete trials), "
            f"{_duration(c['trial_s'])} of trial time summed over workers, {_duration(c['wall_s'])} of wall time "
            "(first trial start to last trial end, from the trials' timestamps).")


def _claim_table(claims) -> str:
    rows = []
    for c in claims:
        row = {"id": c.id, "claim": c.statement}
        if getattr(c, "primary", None) is not None:
            row["primary"] = "yes" if c.primary else "secondary"
        if getattr(c, "verdict_class", None) is not None:
            row["class"] = c.verdict_class
        if getattr(c, "margin", None) is not None:
            row["margin"] = f"±{c.margin:g}"
        row.update({"verdict": c.verdict, "estimate": _signed(c.estimate), "95% CI": _ci(c.ci_low, c.ci_high),
                    "seeds": c.n_seeds})
        if getattr(c, "tost_p", None) is not None:
            row["TOST p"] = _fmt(c.tost_p)
        rows.append(row)
    return pd.DataFrame(rows).fillna("").to_markdown(index=False)


# --- the body ---------------------------------------------------------------------------------------
def _arm_ci(arms: pd.DataFrame) -> list[str]:
    """Each arm's test causal bpb interval as the arm tables print it."""
    return ["n/a (n<2)" if lo is None or lo != lo else f"[{lo:.3f}, {hi:.3f}]"
            for lo, hi in zip(arms.causal_ci_low, arms.causal_ci_high)]


def arm_lines(arms: pd.DataFrame) -> list[str]:
    show = arms.assign(**{"95% CI": _arm_ci(arms)})
    show = show[["arm", "causal_bpb", "95% CI", "topk_bpb", "val_causal_bpb", "realised_fraction", "decode_flops_per_token",
                 "flops_per_token", "n_seeds"]].rename(columns={
        "causal_bpb": "test causal bpb", "topk_bpb": "test top-k bpb",
        "val_causal_bpb": "val causal bpb", "realised_fraction": "realised fraction",
        "decode_flops_per_token": "decode FLOPs/token", "flops_per_token": "train FLOPs/token", "n_seeds": "seeds"})
    return ["## Arms (deployable metric first)", "",
            "Test causal bpb: the decode-time causal routing rule on the fixed test windows (mean over seeds, "
            "Student-t 95 % CI). Top-k bpb sees the future and is shown second. Realised fraction: share of routed-layer "
            "token computations the causal rule performs; decode FLOPs/token: the forward cost at that fraction.", "",
            _table(show), ""]


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


def effect_lines(effects: pd.DataFrame, done: pd.DataFrame, dest: Path, claims_declared: bool = False) -> list[str]:
    if effects.empty:
        return (["## Effects", "", "No comparison could be made: the arms of every declared comparison are missing or "
                 "were excluded (see the degenerate arms above).", ""] if claims_declared else [])
    margins = ({str(k): float(v) for k, v in effects.groupby("claim")["margin"].first().dropna().items()}
               if "margin" in effects else {})
    figures.forest_plot(effects, dest / "effects.png", per_seed=seed_differences(done, effects), margins=margins or None,
                        metric_label="Δ test causal bpb (arm − reference)")
    wanted = ["claim", "arm", "reference", "estimate", "ci_low", "ci_high", "method", "p_adj", "margin", "tost_p_adj",
              "verdict_class", "mde", "seeds_needed", "verdict"]
    show = effects[[c for c in wanted if c in effects]].rename(columns={
        "p_adj": "Holm p", "tost_p_adj": "Holm TOST p", "mde": "MDE", "seeds_needed": "seeds for 80% power"})
    return ["## Effects", "",
            "Differences arm − reference in test causal bpb (negative: the arm is better). Paired by seed where both "
            "arms ran the same seeds (a seed fixes the data order), else a BCa bootstrap over seeds; p-values "
            "Holm-corrected within each claim's family; MDE: the smallest |Δ| this design detects with 80 % power. "
            "The figure shows each comparison's per-seed paired differences beside its estimate and CI.", "",
            _table(show), "", "![effects](effects.png)", ""]


def topk_beside_causal_lines(done: pd.DataFrame, effects: pd.DataFrame) -> list[str]:
    """C2 on the training-time top-k rule beside the deployable causal rule: how much of the
    learned-routing advantage the causal rule keeps."""
    if effects.empty or "claim" not in effects or TOPK not in done:
        return []
    c2 = effects[effects["claim"] == LEARNED_VS_RANDOM]
    if c2.empty:
        return []
    topk = compare_effects(done, TOPK, list(zip(c2["arm"], c2["reference"])))
    rows = []
    for (_, c), (_, t) in zip(c2.iterrows(), topk.iterrows()):
        kept = c["estimate"] / t["estimate"] if t["estimate"] and np.isfinite(t["estimate"]) and t["estimate"] < 0 else None
        rows.append({"arm": c["arm"], "reference": c["reference"], "Δ causal": _signed(c["estimate"]),
                     "causal 95% CI": _ci(c["ci_low"], c["ci_high"]), "Δ top-k": _signed(t["estimate"]),
                     "top-k 95% CI": _ci(t["ci_low"], t["ci_high"]),
                     "share of the top-k advantage kept by the causal rule": "n/a (no top-k advantage)" if kept is None else f"{kept:.0%}"})
    return ["## Learned against random routing: top-k beside causal (C2)", "",
            "The same C2 comparisons on test top-k bpb (the training-time rule, which sees the future) and on test "
            "causal bpb (the decode-time rule): the difference between the two is what the causal rule costs of the "
            "learned router's advantage.", "", pd.DataFrame(rows).to_markdown(index=False), ""]


def arm_cost_lines(arms: pd.DataFrame, costs: pd.DataFrame, flagged: dict[str, str]) -> list[str]:
    """The opening's per-arm answer: score and what the arm costs to train and to run (a degenerate
    arm, ``flagged``, is marked: the claims leave it out)."""
    if costs.empty:
        return []
    t = arms.merge(costs, on="arm")
    show = pd.DataFrame({
        "arm": [f"{a} (degenerate: in no claim)" if a in flagged else a for a in t["arm"]], "test causal bpb": t["causal_bpb"],
        "95% CI": _arm_ci(t),
        "non-embedding params": t["params"].astype(int), "train FLOPs/token": t["flops_per_token"],
        "decode FLOPs/token": t["decode_flops_per_token"], "KV bytes/token": t["kv_bytes_per_token"].round(1),
        "decode share": t["decode_share"], f"KV-cached tokens/s ({THREADS} CPU thread)": t["decode_tokens_per_s"].round(0)})
    seeds = sorted(set(costs["seed"]))
    return [f"Per compared arm: its score, and what it costs to train and to run. Decode FLOPs/token: the forward "
            "cost at the arm's realised causal share (analytic). Measured on each arm's checkpoint of seed "
            f"{', '.join(map(str, seeds))}, decoding {BATCH} test prompts (the windows' first halves) greedily "
            "to the full context with the KV cache and the causal rule: KV bytes/token counts the valid cache slots "
            "(what a skipped token or a shared K/V saves); decode share is the share of routed-layer token "
            "computations the rule ran. Tokens/s at this width on a CPU is dominated by per-op overhead, not FLOPs: "
            "it orders the arms on this machine and predicts no accelerator's speed.", "", _table(show), ""]


def decode_cost_lines(arms: pd.DataFrame, effects: pd.DataFrame) -> list[str]:
    """Forward (decode) and training FLOPs per token of every compared pair, beside its Δ bpb."""
    if effects.empty:
        return []
    by = arms.set_index("arm")
    rows = []
    for _, e in effects.iterrows():
        if e["arm"] not in by.index or e["reference"] not in by.index:
            continue
        a, r = by.loc[e["arm"]], by.loc[e["reference"]]
        rows.append({"claim": e.get("claim", ""), "arm": e["arm"], "reference": e["reference"],
                     "Δ test causal bpb": _signed(e["estimate"]),
                     "decode FLOPs/token (arm)": a["decode_flops_per_token"],
                     "decode FLOPs/token (reference)": r["decode_flops_per_token"],
                     "decode cost ratio": a["decode_flops_per_token"] / r["decode_flops_per_token"],
                     "train FLOPs/token ratio": a["flops_per_token"] / r["flops_per_token"]})
    if not rows:
        return []
    return ["## Decode cost of the compared arms", "",
            "Forward FLOPs per token at each arm's realised causal fraction (analytic, `modbench.model.sizing`), for "
            "both sides of every comparison: a tie in bpb at a lower decode cost is a win for the cheaper arm.", "",
            _table(pd.DataFrame(rows)), ""]


def causal_lines(tables: list[pd.DataFrame]) -> list[str]:
    if not tables or tables[0].empty:
        return []
    t = tables[0].drop(columns=["variant"])
    return ["## The causal rule against top-k (validation)", "",
            "Agreement of each layer's causal decision with top-k membership on the same hidden states, beside the "
            "agreement of an independent rule with the same marginals (chance: at C = 0.125 always-skip already "
            "agrees on 87.5 %); the causal − top-k bpb gap within each run. CIs: one-sample t over seeds.", "",
            _table(t), ""]


TuningTable = Callable[[StudySpec, pd.DataFrame], pd.DataFrame]


def tuning_table(data: ReportData, table: TuningTable | None) -> pd.DataFrame:
    """The per-family tuning table of a study with ``[tune]``, from ``table`` (the study runner's
    ``modbench.study.tuning.family_table`` over the trials, passed in by the caller: a report may
    not import ``study``); empty otherwise."""
    if table is None or not getattr(getattr(data.study, "tune", None), "lr_mult", ()):
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


def tuning_lines(table: pd.DataFrame) -> list[str]:
    if table.empty:
        return []
    show = table.assign(bracketed=table["bracketed"].map({True: "yes", False: "**no**"}).fillna(""))
    unbracketed = show[table["bracketed"] == False]["family"].tolist()  # noqa: E712 (None: a follower)
    note = (f"**Unbracketed (best value at an edge of what was tried): {', '.join(unbracketed)}.** A claim that "
            "compares one of these compares a learning rate that may not be its best." if unbracketed
            else "Every tuned family's best value is bracketed (a worse value was tried on each side).")
    noisy = table[table["within_noise"] == True] if "within_noise" in table else table.iloc[:0]  # noqa: E712
    if len(noisy):
        listed = ", ".join(f"{r.family} (won by {r.won_by:.3f}, seed SD {r.seed_sd:.3f})" for r in noisy.itertuples())
        note += (f" **Chosen within the seed noise: {listed}.** The best value beat the runner-up on the tuning seed "
                 "by less than the confirmation seeds' SD: another tuning seed may have chosen another value.")
    return ["## Learning-rate tuning", "",
            "Each family's grid of LR multipliers on the tuning seed, its best value (on validation), whether it "
            "is bracketed, by how much it beat the runner-up (won by) and the confirmed arm's SD over its "
            "confirmation seeds (seed SD); the confirmation seeds run at the best value.", "", note, "",
            _table(show.astype(object).where(show.notna(), "")), ""]


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


def isoflop_lines(data: ReportData, dest: Path, effects: pd.DataFrame) -> tuple[list[str], dict]:
    """The dense isoFLOP profile (paper §4.1): each size at its own best LR, the quadratic fit in
    log size with a CI from its residuals, the fitted optimum against the sizes trained, and what
    else changes with size. Returns the lines and the summary's ``isoflop`` record."""
    points = profile_points(data)
    tuning_seed = data.study.tune.seed if getattr(getattr(data.study, "tune", None), "lr_mult", ()) else None
    best, sizes = best_lr_points(points, tuning_seed)
    # The dense profile is the study's own budget: another budget (the positive control's) is another
    # profile, never averaged into a size of this one.
    budget = float(str(data.study.base.train.budget).split("=")[1])
    dense_sizes = sizes[(sizes["family"] == DENSE) & (sizes["budget"] == budget)]
    if dense_sizes.empty:
        return [], {}
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
    changes["bracketed"] = changes["bracketed"].map({True: "yes", False: "**no**"})
    agrees = c1 is None or c1 == best_dense
    out = ["## isoFLOP profiles", "",
           f"The best dense model is **{best_dense}**, the {record['reference']} (lowest validation causal bpb "
           f"{on}), not a fitted optimum"
           + (f"; C1 compares against {c1}." if c1 and agrees else
              f"; **C1 compares against {c1}, which is not it**." if c1 else "; no C1 comparison was made.")
           + " Each size below is at its own best LR multiplier (chosen on the tuning seed where every multiplier "
           f"ran it), at the study's budget ({budget:.3g} FLOPs).", "",
           _table(changes.rename(columns={"lr_mult": "best lr_mult", "peak_lr": "peak LR", "weight_decay": "weight decay",
                                          "val_compared": f"val causal bpb ({'tuning seed' if compared is not dense_best else 'mean'})",
                                          "val_mean": "val causal bpb (mean over seeds)"})), "",
           "Size is not the only thing that changes along this profile: the weight decay scales as 1/depth² and the "
           "base learning rate as width^−0.5 (nanochat's rules, `train.scale_hparams`, study-wide), and a fixed FLOP "
           "budget buys fewer steps for a larger model. The LR multiplier is tuned per size on top of these rules; "
           "weight decay and the schedule are not. The profile is the optimum under these rules.", ""]
    mod = _mod_points(points, effects)
    others = points.merge(best[["arm", "seed"]], on=["arm", "seed"], how="left", indicator=True)
    others = others[(others["_merge"] == "left_only") & (others["family"] == DENSE) & (others["budget"] == budget)]
    dense_fit = fits[fits["family"] == DENSE] if len(fits) else fits
    if len(dense_fit):
        fits.to_csv(dest / "isoflop_fits.csv", index=False)
        out += _fit_lines(fits, versus)
    else:
        out += [f"No fit: the dense sweep has {len(dense_sizes)} size{'s' if len(dense_sizes) != 1 else ''}; "
                f"a parabola needs {MIN_SIZES} and a CI needs {MIN_SIZES + 1} (residual df ≥ 1).", ""]
    figures.isoflop_profile(dense_best, dense_fit, dest / "isoflop.png", others=others, mod=mod)
    return out + ["![isoFLOP profile](isoflop.png)", ""], record


def _fit_lines(fits: pd.DataFrame, versus: pd.DataFrame) -> list[str]:
    show = fits.assign(**{
        "optimum (params)": fits["opt_params"],
        "95% CI (params)": [f"[{lo:.3g}, {hi:.3g}]" if np.isfinite(lo) else "none" for lo, hi in zip(fits.opt_low, fits.opt_high)],
        "loss at optimum": fits["opt_loss"],
        "95% CI (loss)": [f"[{lo:.4g}, {hi:.4g}]" if np.isfinite(lo) else "none" for lo, hi in zip(fits.loss_low, fits.loss_high)],
        "nearest trained size": fits["nearest_trained"],
        "trained?": ["yes" if np.isfinite(o) and abs(np.log(o / n)) < np.log(1.1) else "no" if np.isfinite(o) else "n/a"
                     for o, n in zip(fits.opt_params, fits.nearest_trained)]})
    out = ["Quadratic fit of validation causal bpb in log10(non-embedding parameters) over the sizes (on the tuning "
           "seed in a tuned study, the one seed every size ran; else each size's seed mean) "
           "(Hoffmann et al. 2022, approach 2), residual df = sizes − 3. The CIs come from the fit's residuals "
           "(s² = RSS/df, delta method, Student t at the residual df), not from resampling seeds; a fit through "
           "exactly three sizes has no residual df and no CI, and is flagged. 'trained?': whether a trained size lies "
           "within 10 % of the fitted optimum.", "",
           _table(show[["family", "budget", "sizes", "df", "optimum (params)", "95% CI (params)", "loss at optimum",
                        "95% CI (loss)", "nearest trained size", "trained?", "note"]]), ""]
    if len(versus):
        out += ["Optimum against optimum (a MoD family's fitted loss − the dense one's at the same budget):", "",
                _table(versus), ""]
    return out


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


def curve_lines(data: ReportData, dest: Path, reference: str | None) -> list[str]:
    curves = data.curves
    if curves.empty:
        return []
    c = curves.rename(columns={"val/bpb": "val_bpb"})
    reference = reference if reference in set(c["arm"]) else None
    label = f"C1 reference: {reference}" if reference else None
    figures.small_multiples(c, dest / "curves_flops.png", reference=reference, reference_label=label)
    figures.small_multiples(c, dest / "curves_tokens.png", x="tokens", xlabel="training tokens", reference=reference,
                            reference_label=label)
    drawn = reference or figures.best_dense_arm(c)
    return ["## Learning curves", "",
            "Validation top-k bpb (the training-time rule; the causal number is measured at the end) per variant, mean "
            f"over seeds, against training FLOPs and against training tokens; dashed in every panel: {drawn}"
            + (" (C1's reference)." if reference else " (the best dense arm)."), "",
            "![curves vs FLOPs](curves_flops.png)", "", "![curves vs tokens](curves_tokens.png)", ""]


def preregistration(attrs: dict) -> dict:
    """What the runner recorded of the claims' settings (``modbench.study.points.preregister``): the
    settings, the commit and time they were fixed at, and any amendment since ({} when none)."""
    record = attrs.get("preregistered")
    if not record:
        return {}
    return {**record, "amendments": attrs.get("preregistration_amendments", [])}


def preregistration_lines(registration: dict) -> list[str]:
    """One line: when the claims' margins and primary contrasts were fixed, and whether they changed."""
    if not registration:
        return ["The claims' margins and primary contrasts were **not recorded before the data** (a study that "
                "predates pre-registration): they may have been chosen after results were seen.", ""]
    line = (f"Margins and primary contrasts were pre-registered at commit `{registration['commit'][:12]}` "
            f"({registration['at']}), before the first confirmation trial")
    amended = registration["amendments"]
    if not amended:
        return [line + ", and have not changed since.", ""]
    listed = "; ".join(f"{', '.join(a['changed'])} at `{a['commit'][:12]}` ({a['at']})" for a in amended)
    return [line + f"; **amended after that** (`--amend-claims`): {listed}.", ""]


def protocol_lines(study, done: pd.DataFrame) -> list[str]:
    """A study without a [tune] table compares every arm at the learning rates it declares: say so
    before any claim, with the multipliers that ran, since a gap may then be a learning-rate effect."""
    if study.tune.lr_mult:
        return []
    mults = sorted({float(v) for v in pd.to_numeric(done.get("lr_mult", pd.Series(dtype=float)), errors="coerce").dropna()})
    ran = f" (lr × {', '.join(f'{m:g}' for m in mults)})" if mults else ""
    return ["> **Not tuned: the arms are not compared best against best.** This study declares its learning "
            f"rates{ran} instead of tuning each arm's (no [tune] table), so a difference between two arms "
            "may be a learning-rate effect, and an arm may sit at the edge of its grid.", ""]


def claims_sections(data: ReportData, dest: Path, tuning: TuningTable | None = None) -> list[str]:
    """The report's opening: the regime, one sentence per claim, degenerate arms, the study's
    compute; then claims, tuning, arms, baselines, effects, top-k beside causal, decode cost,
    the causal rule, the dense profile and curves."""
    done = data.done
    if "control" not in done:
        done["control"] = ""
    if HEADLINE not in done:
        return []
    arms = arm_summary(done, data.study)
    base = baselines_for(data)
    tuning = tuning_table(data, tuning)
    confirmed = confirmed_arms(tuning)
    claims, effects, tables = test_claims(done, data.study, confirmed)
    claims = regime_gate(claims, effects, arms, base)
    compared = claims_module.confirmation_rows(done, data.study, confirmed)  # what the effects were computed on
    degenerate, flagged = degenerate_lines(compared, data.study)
    compute = compute_summary(data.trials)
    lines = regime_lines(arms, base) + protocol_lines(data.study, done)
    lines += [f"- {claim_sentence(c, effects)}" for c in claims] + ([""] if claims else [])
    ties, tie_records = tie_lines(claims, effects, arms, data.study)
    lines += ties
    registration = preregistration(data.attrs)
    lines += preregistration_lines(registration) if claims else []
    costs = measure_arms(data.uri, compared)
    lines += arm_cost_lines(arms, costs, flagged)
    control = claims_module.positive_control_line(claims)
    lines += ([control, ""] if control else []) + degenerate + [compute_line(compute), ""]
    if claims:
        lines += ["## Claims", "", _claim_table(claims), ""]
    lines += tuning_lines(tuning)
    lines += arm_lines(arms) + baseline_lines(base) + effect_lines(effects, compared, dest, bool(claims))
    lines += topk_beside_causal_lines(compared, effects) + decode_cost_lines(arms, effects) + causal_lines(tables)
    profile, isoflop = isoflop_lines(data, dest, effects)
    lines += profile + curve_lines(data, dest, c1_reference(effects, done))
    arms.to_csv(dest / "arms_causal.csv", index=False)
    if len(effects):
        effects.to_csv(dest / "effects.csv", index=False)
    summary = {"version": SUMMARY_VERSION, "study": data.study.name, "headline_metric": HEADLINE,
               "claims": [{**c.to_dict(), "fixed_at_commit": registration.get("commit")} for c in claims],
               "preregistration": registration, "ties": tie_records,
               "arms": arms.drop(columns=["variant"]).to_dict(orient="records"),
               "baselines": base["test"].to_dict(), "degenerate_arms": flagged, "compute": compute,
               "reference": isoflop.get("reference"), "isoflop": isoflop,
               "tuning": tuning.to_dict(orient="records"), "decode_costs": costs.to_dict(orient="records")}
    (dest / "summary.json").write_text(json.dumps(_plain(summary), indent=2, allow_nan=False))
    return lines


def _plain(x):
    """JSON-safe: numpy scalars to Python, NaN and inf to null."""
    if isinstance(x, dict):
        return {str(k): _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    if hasattr(x, "item"):
        x = x.item()
    if isinstance(x, float) and (x != x or x in (float("inf"), float("-inf"))):
        return None
    return x
