"""A report's markdown, written from its computed sections (``modbench.report.sections``).

Nothing here computes a statistic: each function formats data it is given into lines, and asks
``modbench.report.figures`` for the figure drawn from the same data. ``render(sections, dest)`` is
the whole body of report.md, from the regime and the claims to the routing analysis.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd

from modbench.design.vocabulary import DENSE
from modbench.errors import redact
from modbench.report import claims as claims_module
from modbench.report import figures
from modbench.report.baselines import Baselines
from modbench.report.decode_costs import BATCH, THREADS
from modbench.report.measure import Measurements
from modbench.report.sections import (ALPHA, MIN_SIZES, REGIME_NOT_REACHED, TIE_COST, ClaimsData, Diagnostics,
                                      IsoflopData, Sections, count_bar, fmt, rows_of)

SPEED_SPREAD_TOLERANCE = 1.25  # fastest / slowest seed of one arm above this: the machine was busy


def render(s: Sections, dest: Path) -> list[str]:
    """report.md's body after its title and counts: the claims' opening and sections, then the
    per-group diagnostics, curves, Pareto fronts, throughput, gaps and routing."""
    data = s.data
    lines = failed_arm_lines(data.trials)
    lines += claims_lines(s.claims, data, dest) if s.claims else []
    d = s.diagnostics
    lines += topk_lines(data.study, d)
    if len(data.curves):
        figures.validation_curves(data.curves, dest / "curves.png")
        lines += ["## Validation curves", "", "![validation curves](curves.png)", ""]
    lines += pareto_lines(d, dest) + throughput_lines(d.arms, dest)
    lines += causal_gap_lines(d.causal_gaps)
    lines += routing_lines(s.measured, s.routing_hard, dest, routed=bool((data.done.variant != DENSE).any()))
    return lines


def md_table(df: pd.DataFrame) -> str:
    return df.map(lambda v: fmt(v) if not isinstance(v, str) else v).to_markdown(index=False)


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


# --- the opening and the claims -----------------------------------------------------------------------
def claims_lines(c: ClaimsData, data, dest: Path) -> list[str]:
    """The report's opening: the regime, one sentence per claim, ties, pre-registration, per-arm
    costs, the positive control, degenerate arms, the study's compute; then claims, tuning, arms,
    baselines, effects, top-k beside causal, decode cost, the causal rule, the dense profile and curves."""
    claims, effects = c.claims, c.effects
    compared = set(c.compared["arm"]) if len(c.compared) and claims else set()
    lines = (regime_lines(c.arms, c.baselines, compared) + versus_dense_lines(c.versus_dense, c.flagged)
             + protocol_lines(data.study, data.done))
    lines += [f"- {claim_sentence(cl, effects, c.cost_pairs)}" for cl in claims] + ([""] if claims else [])
    lines += decision_lines(c.decision, bool(claims))
    lines += tie_lines(c.ties)
    lines += preregistration_lines(c.registration) if claims else []
    lines += arm_cost_lines(c.arms, c.costs, c.flagged)
    control = claims_module.positive_control_line(claims)
    lines += ([control, ""] if control else []) + degenerate_lines(c.flagged, bool(claims)) + [compute_line(c.compute), ""]
    if claims:
        lines += ["## Claims", "", _claim_table(claims), ""]
    lines += tuning_lines(c.tuning)
    lines += arm_lines(c.arms) + baseline_lines(c.baselines) + effect_lines(effects, c.per_seed, dest, bool(claims))
    lines += like_for_like_lines(c.like_for_like)
    lines += topk_beside_causal_lines(c.topk_c2) + decode_cost_lines(c.cost_pairs) + causal_lines(c.causal_tables)
    lines += isoflop_lines(c.isoflop, dest) if c.isoflop else []
    has_c1 = bool(len(effects)) and "claim" in effects and bool((effects["claim"] == "C1").any())
    return lines + curve_lines(data.curves, dest, c.curves_reference, has_c1)


def regime_lines(arms: pd.DataFrame, base: dict[str, Baselines], compared: set[str] | None = None) -> list[str]:
    """The first lines of the report: do the models beat counting? If not, say so plainly. When
    every arm the claims compare beats it and only others (sizes or learning rates tuning tried) do
    not, the claims stand in a learned regime and the line says that."""
    bar, name = count_bar(base["test"])
    worse = arms[~(arms["causal_bpb"] < bar)]
    listed = ", ".join(f"{r.arm} ({_fmt(r.causal_bpb)})" for r in worse.itertuples())
    beaten = arms[arms["arm"].isin(compared or set())]
    if compared and len(worse) and len(beaten) and (beaten["causal_bpb"] < bar).all():
        return [f"Every arm the claims compare beats the {name} ({bar:.3f} bpb; the worst of them reaches "
                f"{beaten['causal_bpb'].max():.3f}), so they have learned more than short byte statistics. "
                f"{len(worse)} of {len(arms)} arms, all outside the claims, do not: {listed}.", ""]
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


def versus_dense_lines(eff: pd.DataFrame, flagged: dict[str, str]) -> list[str]:
    """A study without claims: one line per routed arm, arm − its group's dense on test causal bpb
    (an arm whose router collapsed or saturated, ``flagged``, says so)."""
    if eff.empty:
        return []
    out = []
    for r in eff.itertuples():
        p = r.p_adj if r.p_adj is not None and r.p_adj == r.p_adj else None
        test = ("not testable with these seeds" if p is None else
                f"Holm p = {p:.2g}: " + ("no difference detected" if p >= ALPHA else "better" if r.estimate < 0 else "worse"))
        out.append(f"- **{r.arm}** − {r.reference}: Δ test causal bpb = {_signed(r.estimate)}, 95 % CI "
                   f"{_ci(r.ci_low, r.ci_high)}, {min(r.n_arm, r.n_ref)} seeds ({r.method}; {test})"
                   + (f"; **degenerate**: {flagged[r.arm]}" if r.arm in flagged else ""))
    return ["Each routed arm against the dense model of its group (same depth, budget and learning rate), on the "
            "deployable metric (test causal bpb; negative: the routed arm is better):", "", *out, ""]


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


def claim_sentence(claim, effects: pd.DataFrame, costs: pd.DataFrame | None = None) -> str:
    """One plain sentence: who against whom, which way, by how much, how sure; and, where the pair's
    costs are known (``costs``: ``sections.cost_pairs``), what the arm costs to decode against its
    reference, since a verdict on quality alone hides the trade MoD exists to make."""
    cls, margin = getattr(claim, "verdict_class", None), getattr(claim, "margin", None)
    rows = rows_of(effects, claim.id)
    if cls is None or rows.empty:  # no effect row (C3's within-run quantities), or no verdict class yet
        numbers = (f"estimate {_signed(claim.estimate)}, 95 % CI {_ci(claim.ci_low, claim.ci_high)}, "
                   if claim.estimate is not None else "")
        return f"**{claim.id}**: {claim.verdict} ({numbers}{claim.n_seeds} seeds)."
    numbers = f"Δ = {_signed(claim.estimate)} bpb, 95 % CI {_ci(claim.ci_low, claim.ci_high)}, {claim.n_seeds} seeds"
    arm, ref = rows.iloc[0]["arm"], rows.iloc[0]["reference"]
    within = f" within ±{margin:g} bpb" if margin else ""
    if cls == REGIME_NOT_REACHED:
        return f"**{claim.id}**: {arm} against {ref}: {claim.verdict} ({numbers})."  # the verdict holds any caveat
    phrase = {"better": f"{arm} is better than {ref} on test causal bpb",
              "worse": f"{arm} is worse than {ref} on test causal bpb",
              "equivalent": f"{arm} ties {ref}{within} on test causal bpb",
              "inconclusive": f"{arm} against {ref}: inconclusive, " + (
                  f"neither a difference nor equivalence within ±{margin:g} bpb is shown" if margin
                  else "no difference is shown (and no equivalence margin was declared)")}.get(cls, claim.verdict)
    caveat = f" **Note: {claim.caveat}.**" if getattr(claim, "caveat", "") and claim.caveat not in phrase else ""
    return f"**{claim.id}**: {phrase} ({numbers}).{_decode_cost(costs, arm, ref)}{caveat}"


def _decode_cost(costs: pd.DataFrame | None, arm: str, ref: str) -> str:
    """" It decodes at r× the reference's FLOPs per token (… vs …)." for a pair with known costs."""
    if costs is None or costs.empty:
        return ""
    row = costs[(costs["arm"] == arm) & (costs["reference"] == ref)]
    if row.empty:
        return ""
    r = row.iloc[0]
    if r["decode cost ratio"] == 1 and r["train FLOPs/token ratio"] == 1:
        return ""  # the same model (a positive control): nothing to trade
    return (f" It decodes at {r['decode cost ratio']:.2f}× the reference's FLOPs per token "
            f"({r['decode FLOPs/token (arm)']:.3g} vs {r['decode FLOPs/token (reference)']:.3g}) and trains at "
            f"{r['train FLOPs/token ratio']:.2f}× its FLOPs per token.")


def decision_lines(d: dict, claims_declared: bool) -> list[str]:
    """When the study decides none of its claims: say so, why, and what would decide them; and
    whether a random control scored the best arm."""
    out = []
    if claims_declared and d and not d["decided"] and d["undecided"]:
        why = []
        if d["regime_not_reached"]:
            why.append("the compared models do not beat the count model (a larger FLOP budget per trial would "
                       "put them in a regime where they have learned something)")
        if d["seeds_needed"]:
            low, high = d["seeds_needed"]
            span = f"{low}" if low == high else f"{low}–{high}"
            why.append(f"the intervals are too wide: detecting the observed differences with 80 % power would take "
                       f"{span} seeds per arm")
        out.append("**This study decides none of its claims**" + (": " + "; and ".join(why) if why else "") + ".")
    if d and d.get("best_arm_is_random_control"):
        out.append(f"The best arm on test causal bpb is a random control, **{d['best_arm']}**: here learned routing "
                   "did not beat routing at random.")
    return out + [""] if out else []


def tie_lines(ties: list[dict]) -> list[str]:
    """For each tie at different cost: what each arm costs and who wins by the declared rule."""
    lines = []
    for t in ties:
        costs = (f"{t['arm']} costs {t['decode_flops']:+.0%} decode FLOPs/token and {t['train_flops']:+.0%} "
                 f"training FLOPs/token against {t['reference']}")
        if not t["rule"]:
            lines.append(f"- **{t['claim']} ties at different cost**: {costs}; the study declares no rule for a tie "
                         "(`tie_break`), so the tie alone names no winner.")
            continue
        verdict = f"**{t['winner']} wins**" if t["winner"] else "neither is cheaper: no winner"
        lines.append(f"- **{t['claim']} ties at different cost**: {costs}; by its declared rule (fewer "
                     f"{TIE_COST[t['rule']][1]} wins a tie) {verdict}.")
    return lines + [""] if lines else []


def preregistration_lines(registration: dict) -> list[str]:
    """One line: when the claims' margins and primary contrasts were fixed, and whether they changed."""
    if not registration:
        return ["The claims' margins and primary contrasts were **not recorded before the data** (a study that "
                "predates pre-registration): they may have been chosen after results were seen.", ""]
    line = (f"Margins and primary contrasts were pre-registered at commit `{registration['commit'][:12]}` "
            f"({registration['at']}), before the first confirmation trial")
    amended = registration["amendments"]
    protocol = [f"**The protocol was amended during the study** at `{a['commit'][:12]}` ({a['at']}): {a['what']}."
                for a in registration.get("protocol_amendments", [])]
    if not amended:
        return [line + ", and have not changed since.", "", *(protocol and [*protocol, ""])]
    listed = "; ".join(f"{', '.join(a['changed'])} at `{a['commit'][:12]}` ({a['at']})" for a in amended)
    return [line + f"; **amended after that** (`--amend-claims`): {listed}.", "", *(protocol and [*protocol, ""])]


def degenerate_lines(flagged: dict[str, str], claims_declared: bool = True) -> list[str]:
    if not flagged:
        return []
    listed = "; ".join(f"{arm} ({reason})" for arm, reason in flagged.items())
    what = "excluded from every claim family" if claims_declared else "their router collapsed or saturated"
    return [f"**Degenerate arms, {what}:** {listed}.", ""]


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "n/a"
    return f"{seconds / 60:.1f} min" if seconds < 7200 else f"{seconds / 3600:.2f} h"


def compute_line(c: dict) -> str:
    flops = f"{c['train_flops']:.3g} training FLOPs" if c["train_flops"] else "training FLOPs not recorded"
    line = (f"The study ran {c['trials']} trials ({c['complete']} complete): {flops} (complete trials), "
            f"{_duration(c['trial_s'])} of trial time summed over workers, {_duration(c['wall_s'])} of wall time "
            "(first trial start to last trial end, from the trials' timestamps).")
    calls = c.get("slot_calls") or []
    if calls:
        line += (f" It ran in {len(calls)} slot call{'s' if len(calls) > 1 else ''} (`modbench study slot`, the "
                 "lent-GPU path): " + "; ".join(_slot_call_text(call) for call in calls) + ".")
    return line


def _slot_call_text(call: dict) -> str:
    """One slot call: its device, its bound and wall time, its workers and how they were chosen."""
    parts = [str(call.get("device", "device not recorded"))]
    if call.get("minutes") is not None:
        wall = f", {call['wall_s'] / 60:.1f} min used" if call.get("wall_s") is not None else ""
        parts.append(f"{call['minutes']:g} min bound{wall}")
    if call.get("workers") is not None:
        parts.append(f"{call['workers']} worker{'s' if call['workers'] != 1 else ''}{_probe_text(call.get('probe'))}")
    return ", ".join(parts)


def _probe_text(probe: dict | None) -> str:
    """How a call's worker count was chosen (``modbench study slot --workers auto``), if it was."""
    if not probe:
        return ""
    if probe.get("reused"):
        return " (an earlier call's probe on this device)"
    if probe.get("skipped") or probe.get("failed"):
        return f" (the probe {'had no time' if probe.get('skipped') else 'failed'}: the fallback count)"
    rows = probe.get("settings", [])
    rates = ", ".join(_probe_rate(r) for r in rows)
    peaks = [r["peak_mem_gib"] for r in rows if r.get("peak_mem_gib")]
    peak = f"; at most {max(peaks):.1f} GiB reserved a worker" if peaks else ""
    return f" (chosen by a probe on the heaviest arm, trials/min by workers: {rates}{peak})"


def _probe_rate(row: dict) -> str:
    asked = f" for {row['asked']}" if row.get("asked") else ""
    status = "" if row.get("status") == "ok" else f" ({row.get('status')})"
    return f"{row['workers']}{asked}: {row['trials_per_min']:.2f}{status}"


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


def _arm_ci(arms: pd.DataFrame) -> list[str]:
    """Each arm's test causal bpb interval as the arm tables print it."""
    return ["n/a (n<2)" if lo is None or lo != lo else f"[{lo:.3f}, {hi:.3f}]"
            for lo, hi in zip(arms.causal_ci_low, arms.causal_ci_high)]


def arm_cost_lines(arms: pd.DataFrame, costs: pd.DataFrame, flagged: dict[str, str]) -> list[str]:
    """The opening's per-arm answer: score and what the arm costs to train and to run (a degenerate
    arm, ``flagged``, is marked: the claims leave it out)."""
    if costs.empty:
        return []
    t = arms.merge(costs, on="arm")
    # Only what the arms table below does not show: the score and the FLOPs are there, once.
    show = pd.DataFrame({
        "arm": [f"{a} (degenerate: in no claim)" if a in flagged else a for a in t["arm"]],
        "non-embedding params": t["params"].astype(int), "KV bytes/token": t["kv_bytes_per_token"].round(1),
        "decode share": t["decode_share"], f"KV-cached tokens/s ({THREADS} CPU thread)": t["decode_tokens_per_s"].round(0)})
    seeds = sorted(set(costs["seed"]))
    return [f"What each compared arm costs to run (its score and FLOPs per token are in the arms table). Measured on "
            "each arm's checkpoint of seed "
            f"{', '.join(map(str, seeds))}, decoding {BATCH} test prompts (the windows' first halves) greedily "
            "to the full context with the KV cache and the causal rule: KV bytes/token counts the valid cache slots "
            "(what a skipped token or a shared K/V saves); decode share is the share of routed-layer token "
            "computations the rule ran. Tokens/s at this width on a CPU is dominated by per-op overhead, not FLOPs: "
            "it orders the arms on this machine and predicts no accelerator's speed.", "", _table(show), ""]


def tuning_lines(table: pd.DataFrame) -> list[str]:
    if table.empty:
        return []
    show = table.assign(bracketed=table["bracketed"].map({True: "yes", False: "**no**"}).fillna(""))
    show = show.drop(columns=[c for c in ("collapsed_bracket",) if c in show])
    unbracketed = show[table["bracketed"] == False]["family"].tolist()  # noqa: E712 (None: a follower)
    note = (f"**Unbracketed (best value at an edge of what was tried): {', '.join(unbracketed)}.** A claim that "
            "compares one of these compares a learning rate that may not be its best." if unbracketed
            else "Every tuned family's best value is bracketed (a worse value was tried on each side).")
    broken = table[table["collapsed_bracket"] == True] if "collapsed_bracket" in table else table.iloc[:0]  # noqa: E712
    if len(broken):
        note += (f" **Bracketed only by a collapsed run: {', '.join(broken['family'])}.** On one side of the best value "
                 "every run's router collapsed (column `collapsed`): that side shows the router broke at that "
                 "learning rate, not that the rate was worse for a working router.")
    elif "collapsed" in table and (table["collapsed"] != "").any():
        note += " Some tuning runs' routers collapsed (column `collapsed`); none of them is a best value's only bracket."
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


def effect_lines(effects: pd.DataFrame, per_seed: pd.DataFrame, dest: Path, claims_declared: bool = False) -> list[str]:
    if effects.empty:
        return (["## Effects", "", "No comparison could be made: the arms of every declared comparison are missing or "
                 "were excluded (see the degenerate arms above).", ""] if claims_declared else [])
    margins = ({str(k): float(v) for k, v in effects.groupby("claim")["margin"].first().dropna().items()}
               if "margin" in effects else {})
    figures.forest_plot(effects, dest / "effects.png", per_seed=per_seed, margins=margins or None,
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


def like_for_like_lines(t: pd.DataFrame) -> list[str]:
    """What each primary contrast holds equal (training FLOPs) and what it does not (tokens,
    parameters), with the difference read at equal tokens beside the one at equal FLOPs."""
    if t.empty:
        return []
    def ci(row, name):
        return _ci(row[f"{name} CI low"], row[f"{name} CI high"])
    show = pd.DataFrame([{
        "claim": r["claim"], "arm": r["arm"], "reference": r["reference"],
        "tokens (arm / ref)": "n/a" if r["tokens ratio"] is None else f"{r['tokens ratio']:.2f}×",
        "params (arm / ref)": "n/a" if r["params ratio"] is None else f"{r['params ratio']:.2f}×",
        "Δ val top-k at equal FLOPs": f"{_signed(r['Δ val top-k, equal FLOPs'])} {ci(r, 'Δ val top-k, equal FLOPs')}",
        "Δ val top-k at equal tokens": f"{_signed(r['Δ val top-k, equal tokens'])} {ci(r, 'Δ val top-k, equal tokens')}",
        "arms with the arm's parameters": r["same-parameter arms"] or "none"} for _, r in t.iterrows()])
    return ["## What each primary contrast compares", "",
            "Every arm trains at the study's FLOP budget, so each claim compares at **equal training FLOPs**; it does "
            "not compare at equal tokens or equal parameters. Per primary contrast: the arm's training tokens and "
            "non-embedding parameters relative to its reference; the arms of the study that have the arm's parameter "
            "count (within 2 %), if any (an equal-parameter contrast); and the difference in validation top-k bpb at "
            "equal FLOPs (both runs' ends) beside the same difference at **equal tokens** (the longer run read off its "
            "validation curve at the shorter run's last token count). The equal-token reading is mid-schedule for the "
            "longer run, whose learning rate had not yet decayed there: it flatters the shorter run. Paired by seed, "
            "mean and t 95 % CI.", "", show.to_markdown(index=False), ""]


def topk_beside_causal_lines(rows: pd.DataFrame) -> list[str]:
    """C2 on the training-time top-k rule beside the deployable causal rule."""
    if rows.empty:
        return []
    show = pd.DataFrame([{
        "arm": r.arm, "reference": r.reference, "Δ causal": _signed(r.causal), "causal 95% CI": _ci(r.causal_low, r.causal_high),
        "Δ top-k": _signed(r.topk), "top-k 95% CI": _ci(r.topk_low, r.topk_high),
        "share of the top-k advantage kept by the causal rule": "n/a (no top-k advantage)" if r.kept is None or r.kept != r.kept
        else f"{r.kept:.0%}"} for r in rows.itertuples()])
    return ["## Learned against random routing: top-k beside causal (C2)", "",
            "The same C2 comparisons on test top-k bpb (the training-time rule, which sees the future) and on test "
            "causal bpb (the decode-time rule): the difference between the two is what the causal rule costs of the "
            "learned router's advantage.", "", show.to_markdown(index=False), ""]


def decode_cost_lines(pairs: pd.DataFrame) -> list[str]:
    """Forward (decode) and training FLOPs per token of every compared pair, beside its Δ bpb."""
    if pairs.empty:
        return []
    show = pairs.assign(estimate=pairs["estimate"].map(_signed)).rename(columns={"estimate": "Δ test causal bpb"})
    return ["## Decode cost of the compared arms", "",
            "Forward FLOPs per token at each arm's realised causal fraction (analytic, `modbench.model.sizing`), for "
            "both sides of every comparison: a tie in bpb at a lower decode cost is a win for the cheaper arm.", "",
            _table(show), ""]


def causal_lines(tables: list[pd.DataFrame]) -> list[str]:
    if not tables or tables[0].empty:
        return []
    t = tables[0].drop(columns=["variant"])
    return ["## The causal rule against top-k (validation)", "",
            "Agreement of each layer's causal decision with top-k membership on the same hidden states, beside the "
            "agreement of an independent rule with the same marginals (chance: always-skip alone already agrees on "
            "a share 1 − C of the decisions); the causal − top-k bpb gap within each run. CIs: one-sample t over "
            "seeds.", "",
            _table(t), ""]


def isoflop_lines(iso: IsoflopData, dest: Path) -> list[str]:
    """The dense isoFLOP profile: the best dense model and what it is, each size at its best LR, the
    fit and its figure."""
    c1 = iso.c1
    agrees = c1 is None or c1 == iso.best_dense
    changes = iso.changes.assign(bracketed=iso.changes["bracketed"].map({True: "yes", False: "**no**"}))
    out = ["## isoFLOP profiles", "",
           f"The best dense model is **{iso.best_dense}**, the {iso.record['reference']} (lowest validation causal bpb "
           f"{iso.chosen_on}), not a fitted optimum"
           + (f"; C1 compares against {c1}." if c1 and agrees else
              f"; **C1 compares against {c1}, which is not it**." if c1 else "; no C1 comparison was made.")
           + " Each size below is at its own best LR multiplier (chosen on the tuning seed where every multiplier "
           f"ran it), at the study's budget ({iso.budget:.3g} FLOPs).", "",
           _table(changes.rename(columns={"lr_mult": "best lr_mult", "peak_lr": "peak LR", "weight_decay": "weight decay",
                                          "val_compared": iso.val_column,
                                          "val_mean": "val causal bpb (mean over seeds)"})), "",
           "Size is not the only thing that changes along this profile: the weight decay scales as 1/depth² and the "
           "base learning rate as width^−0.5 (nanochat's rules, `train.scale_hparams`, study-wide), and a fixed FLOP "
           "budget buys fewer steps for a larger model. The LR multiplier is tuned per size on top of these rules; "
           "weight decay and the schedule are not. The profile is the optimum under these rules.", ""]
    if len(iso.dense_fit):
        out += _fit_lines(iso.fits, iso.versus)
    else:
        out += [f"No fit: the dense sweep has {iso.n_sizes} size{'s' if iso.n_sizes != 1 else ''}; "
                f"a parabola needs {MIN_SIZES} and a CI needs {MIN_SIZES + 1} (residual df ≥ 1).", ""]
    figures.isoflop_profile(iso.points, iso.dense_fit, dest / "isoflop.png", others=iso.others, mod=iso.mod)
    return out + ["![isoFLOP profile](isoflop.png)", ""]


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


def curve_lines(curves: pd.DataFrame, dest: Path, reference: str | None, is_c1: bool = True) -> list[str]:
    """Learning curves per variant; dashed in each panel C1's reference (``is_c1``), else the best
    dense arm, labelled as what it is."""
    if curves.empty:
        return []
    c = curves.rename(columns={"val/bpb": "val_bpb"})
    reference = reference if reference in set(c["arm"]) else None
    label = (f"C1 reference: {reference}" if is_c1 else f"best dense: {reference}") if reference else None
    figures.small_multiples(c, dest / "curves_flops.png", reference=reference, reference_label=label)
    figures.small_multiples(c, dest / "curves_tokens.png", x="tokens", xlabel="training tokens", reference=reference,
                            reference_label=label)
    drawn = reference or figures.best_dense_arm(c)
    return ["## Learning curves", "",
            "Validation top-k bpb (the training-time rule; the causal number is measured at the end) per variant, mean "
            f"over seeds, against training FLOPs and against training tokens; dashed in every panel: {drawn}"
            + (" (C1's reference)." if reference and is_c1 else " (the best dense arm)."), "",
            "![curves vs FLOPs](curves_flops.png)", "", "![curves vs tokens](curves_tokens.png)", ""]


# --- the per-group diagnostics ------------------------------------------------------------------------
def failed_arm_lines(trials: pd.DataFrame) -> list[str]:
    """Arms with no finished trial, and why: an arm whose every seed failed is never silently absent."""
    if trials.empty or "arm" not in trials:
        return []
    rows = []
    for arm, g in trials.groupby("arm", sort=False):
        if (g.state == "COMPLETE").any() or not (g.state == "FAIL").any():
            continue
        reasons = g.get("fail_reason", pd.Series(dtype=object)).dropna().astype(str).unique().tolist()
        rows.append({"arm": arm, "failed trials": int((g.state == "FAIL").sum()),
                     "reasons": "; ".join(redact(r) for r in reasons) or "not recorded"})
    if not rows:
        return []
    return ["## Arms with no finished trial", "",
            "Every trial of these arms failed, so they have no number in any table below:", "",
            pd.DataFrame(rows).to_markdown(index=False), ""]


def topk_lines(study, d: Diagnostics) -> list[str]:
    """The per-group diagnostics on validation top-k bpb: the summary, the arm table and the
    comparisons against each group's dense arm."""
    arms, comp = d.arms, d.comparisons
    lines = []
    if study.settings.claims:
        lines += ["# Details", "", "The sections below are per-group diagnostics on validation top-k bpb (the training-time "
                  "rule); the claims above are the study's answers.", ""]
    lines += ["## Top-k validation summary by group", "", md_table(d.summary), ""]
    if not study.settings.claims:  # a claims study says it once, in its claims table
        lines += [f"- {s}" for s in d.sentences]
    lines += [f"- {n}" for n in d.notes]
    if (arms["n"] < 2).any():
        lines.append("- Arms with fewer than two successful seeds have no interval and no test: "
                     + ", ".join(arms[arms["n"] < 2]["arm"]) + ".")
    if arms["n_failed"].sum() or arms["n_failed_trials"].sum():
        lines.append("- Failed trials are excluded from every statistic; see the arm table's failure counts.")
    lines += ["", "Method: mean over seeds with a 95% t-interval; Welch's t-test and Mann–Whitney U (exact where "
              "possible) against the dense arm of the same group (same depth, FLOP budget and LR multiplier), "
              "effect size Hedges' g; p-values Holm-corrected across all comparisons in this report. "
              f"'can reach significance' is false when even a perfect separation could not give a corrected "
              f"Mann–Whitney p ≤ {ALPHA} with the seeds given.", ""]

    lines += ["## Arms (validation top-k)", "", md_table(arms[["arm", "group", "n", "n_failed_trials", "mean", "std", "ci_low", "ci_high", "test_bpb",
                                          "flops_per_token", "tokens_per_s", "tokens_per_s_spread", "steps"]].rename(columns={"mean": "val bpb", "ci_low": "CI low", "ci_high": "CI high"})), ""]
    if not comp.empty:
        show = comp[["arm", "baseline", "n_arm", "n_base", "mean_diff", "hedges_g", "welch_p", "welch_p_adj", "mwu_p", "mwu_p_adj",
                     "mwu_min_p_adj", "can_reach_significance", "note"]]
        lines += _comparison_heading(bool(study.settings.claims), comp)
        lines += [md_table(show.assign(can_reach_significance=show.can_reach_significance.map({True: "yes", False: "no"}))), ""]
    return lines


def _comparison_heading(claims_study: bool, comp: pd.DataFrame) -> list[str]:
    """In a claims study these rows are not the claims' comparisons: say which dense each row uses,
    so no reader takes a same-shape dense for the claim's (stronger) reference."""
    if not claims_study:
        return ["## Comparisons against dense", ""]
    used = ", ".join(sorted(comp["baseline"].astype(str).unique()))
    return ["## Comparisons against the same-shape dense of each group (diagnostic)", "",
            f"Each routed arm against the dense arm of its group (same depth, budget and LR multiplier: {used}). "
            "This is **not** the claims' reference: C1 compares against the best trained dense model (see Claims and "
            "the isoFLOP section), which may be stronger than the dense used here.", ""]


def pareto_lines(d: Diagnostics, dest: Path) -> list[str]:
    """The Pareto fronts (bpb against FLOPs per token and against measured tokens/s), with their figures."""
    arms = d.arms
    figures.pareto_scatter(arms, "flops_per_token", "training FLOPs per token", d.front_flops, dest / "pareto_flops.png")
    figures.pareto_scatter(arms, "tokens_per_s", "training tokens / s", d.front_speed, dest / "pareto_speed.png")
    return ["## Pareto fronts", "",
            "Arms not dominated in (validation bpb ↓, FLOPs per token ↓): " + ", ".join(arms[d.front_flops.values]["arm"]) + ".", "",
            "![bpb vs FLOPs](pareto_flops.png)", "",
            "Arms not dominated in (validation bpb ↓, tokens/s ↑) — wall-clock on this machine: " + ", ".join(arms[d.front_speed.values]["arm"]) + ".", "",
            "![bpb vs tokens/s](pareto_speed.png)", ""]


def throughput_lines(arms: pd.DataFrame, dest: Path) -> list[str]:
    """The capacity figure (several capacities only) and the measured throughput bars."""
    lines = []
    if arms[arms.variant != DENSE]["capacity"].nunique() > 1:
        figures.capacity_vs_bpb(arms, dest / "capacity.png")
        lines += ["## Capacity", "", "![capacity vs bpb](capacity.png)", ""]
    figures.throughput_bars(arms, dest / "throughput.png")
    return lines + ["## Throughput", "", "Measured training throughput: tokens/s of each arm's fastest seed (other processes "
                    "can only slow a run down); FLOPs are analytic (see modbench.model.flops).", "",
                    "![throughput](throughput.png)", ""] + throughput_caveat(arms)


def throughput_caveat(arms: pd.DataFrame, tolerance: float = SPEED_SPREAD_TOLERANCE) -> list[str]:
    """A warning, from the data, when seeds of one arm ran at very different speeds."""
    spread = arms["tokens_per_s_spread"].astype(float)
    if not (spread > tolerance).any():
        return []
    worst = arms.loc[spread.idxmax()]
    return [f"**Throughput is noisy in this study**: the fastest seed of {(spread > tolerance).sum()} of {len(arms)} arms "
            f"ran more than {tolerance:g}× faster than its slowest (worst: {worst['arm']}, "
            f"{worst['tokens_per_s_spread']:.2f}×), so the machine was not quiet while it ran. Tokens/s here and the "
            "speed Pareto front are indicative only; the controlled speed measurements are the benchmark suite's "
            "(`make bench`, reports/bench/). Losses and FLOPs are unaffected.", ""]


def causal_gap_lines(t: pd.DataFrame) -> list[str]:
    if t.empty:
        return []
    return ["## Train/inference gap", "",
            "bpb under the causal decode-time rule and with MoD switched off, minus the training-time top-k bpb "
            "(means over seeds); agreement of the causal rule with top-k membership; realised causal fraction; "
            "top-k leak rate (how often future tokens change a past routing decision).", "", md_table(t), ""]


def routing_lines(measured: Measurements, hard: pd.DataFrame, dest: Path, routed: bool) -> list[str]:
    """The routing analysis measured on the checkpoints (``modbench.report.measure``)."""
    r = measured.routing
    if not routed:
        return []
    if r is None:
        return ["## Routing", "", measured.routing_missing, ""]
    figures.routing_by_position(r.positions, dest / "routing_positions.png")
    cls = r.classes.groupby(["arm", "byte_class"])["rate"].mean().unstack()
    out = ["## Routing", "", "Measured on 16 fixed validation windows with each arm's first seed.", "",
           "![routing by position](routing_positions.png)", "",
           "Fraction of tokens processed, by byte class of the token (mean over routed layers):", "",
           cls.reset_index().pipe(md_table), ""]
    if len(r.overlaps):
        out += ["Overlap of the selected sets between routed layers (1 = the same tokens every layer):", "",
                md_table(r.overlaps), ""]
    if len(hard):
        out += ["Routing against ground truth (arithmetic task: hard = answer digits of multiplications):", "", md_table(hard), ""]
    if r.heatmap:
        figures.routing_heatmap(r.heatmap, dest / "routing_heatmap.png", title=r.heatmap_title)
        out += [f"Processed positions on one validation window ({r.heatmap_arm}, first seed; drawn from its checkpoint):", "",
                "![routing heatmap](routing_heatmap.png)", ""]
    return out
