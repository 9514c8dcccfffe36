"""Claims a study declares (``study.claims``), each tested with its controls, one verdict each.

The headline metric is the deployable one, **causal bpb on the test split** (the decode-time
routing rule, Raposo et al. 2024 §3.5); top-k bpb, which sees the future, is secondary.
Every choice of "best" (model size, learning rate) is made on the validation split and
reported on test, so no number is chosen and reported on the same data.

Claim kinds (ids C1, C2, C3a/C3b, C4a, … in the order the study lists them):

- ``mod_vs_best_dense`` (paper §4.1, Figure 3): each learned MoD variant, at its best
  learning rate, against the isoFLOP-optimal dense model (the best dense size and learning
  rate at the same FLOP budget). Its secondary rows also hold the derived controls, against the
  primary variant: the FLOP-matched dense model and the iso-token dense model (``study.controls``).
- ``learned_vs_random``: each learned variant against the random control with the same gate
  and scope (``RANDOM_CONTROL``), at the same capacity, pattern and learning rate.
- ``causal_rule``: the causal rule as a predictor of top-k membership, agreement minus its
  chance level (an independent rule with the same marginals), with precision and recall
  (C3a); and the causal − top-k gap (C3b).
- ``methods_vs_sigmoid``: every other learned variant against the ``sigmoid`` recipe at the
  same capacity, pattern and learning rate (C4a, C4b, … in the order the study lists them),
  one claim each: does a method of the later literature route better than the seed recipe?
  The primary method's claim is its own family, the other methods' claims one Holm family.

Differences are arm − reference over seeds (``modbench.report.effects``): paired by seed when
both arms ran the same seeds (a seed fixes the data order), with the minimum detectable effect.
C3's quantities are within-run differences, so their CIs are one-sample t intervals over seeds.

**The primary contrast and the families.** Each claim has one pre-registered primary contrast
(``[claims.<kind>] primary``, a variant; default: the claim's first learned variant), tested
as its own family (m = 1: no correction), and the claim's statement and verdict are the
primary's. Its other rows (other variants, the derived controls) are secondary: one family,
Holm-corrected apart (``modbench.report.stats.holm``), each row with its own verdict. The
variant's arm in a contrast is its best arm on validation (C1, C2, C3).

**Verdict classes** (``Claim.verdict_class``), at α = 0.05 with ``[claims.<kind>] margin`` m:

- ``better`` / ``worse``: the two-sided test is significant after its family's correction;
- ``equivalent``: the margin's two one-sided tests (TOST) are, i.e. the 90 % (1 − 2α) CI lies
  inside ±m (statsmodels' ``ttost_paired``; Welch's ``ttost_ind`` when unpaired);
- ``inconclusive``: neither (also: nothing to test);
- ``flagged``: a contrast with a degenerate arm, not tested (below).

When an effect is both significant and inside the margin, **significance wins**: the class is
better/worse, since its sign is established, and the verdict adds "within the ±m margin" (a
real difference, smaller than the one declared to matter). Without a margin no claim can be
"equivalent"; absence of evidence stays "inconclusive".

**A study with ``[tune]``** (``modbench.study.tuning``): each family's arm in a claim is its
*confirmed* arm, the one its confirmation seeds ran at its best value, and every comparison uses
the confirmation seeds only: the tuning seed picked each best value, so a difference on it is
biased towards the arm that won there (:func:`confirmation_rows`). Which arms are confirmed is
the tuning protocol's decision, passed in by the caller (``test_claims(confirmed=…)``: ``report``
may not import ``study``, which imports it).

**The positive control** (``[claims.mod_vs_best_dense] positive_control``): C1's reference
trained at a smaller budget (``Arm.control`` starting with ``POSITIVE_CONTROL``), a contrast
whose sign is known in advance. It is in no C1 family; it is its own claim, ``C1+`` (m = 1,
C1's margin), against C1's reference paired by seed, and it must come out ``worse``: a design
that classes it "equivalent" or "inconclusive" cannot tell a real difference of this size from
none, which is what the report's first lines then say.

**Degenerate arms** (:func:`degenerate_arms`): a routed arm whose realised share of processed
tokens is far from its capacity C in any completed trial, share < C/4 (the router has
collapsed: it skips what it should process) or skipped share 1 − share < (1 − C)/4 (it
processes what it should skip), is excluded from every claim family, not compared as if it
worked; the report names it. The trials record the causal rule's share over all routed
layers, on validation and test (``val/causal_fraction``, ``test/causal_fraction``), and per
routed layer when a run logs ``…/causal_fraction_L{i}``. The mean over layers cannot hide a
collapse of every layer, and one below C/4 means at least one layer is below it, so a flag on
the mean is always a flag per layer; a single collapsed layer among healthy ones needs the
per-layer columns to be seen.
"""

from __future__ import annotations

import math
import re
from collections.abc import Collection
from dataclasses import asdict, dataclass, replace

import numpy as np
import pandas as pd
from scipy import stats

from modbench.config.capacity import CapacitySchedule
from modbench.design.study_file import ClaimSettings, StudySpec
from modbench.report.collect import row_arm
from modbench.design.controls import FLOP_MATCHED, PARAM_MATCHED
from modbench.design.vocabulary import (CONTROL_VARIANTS, DENSE, HEADLINE, METHODS_REFERENCE, POSITIVE_CONTROL,
                                        RANDOM_CONTROL, SELECT)
from modbench.model.sizing import decode_flops_per_token
from modbench.report.effects import compare_effects, verdict_class
from modbench.report.stats import holm

ALPHA = 0.05
DEGENERATE_FACTOR = 4.0  # realised share below C / 4 (or skipped share below (1 − C) / 4): degenerate
SHARE_COLUMN = re.compile(r"^(val|test)/causal_fraction(_L\d+)?$")
FLAGGED = "flagged"
POSITIVE_CONTROL_ID = "C1+"


@dataclass(frozen=True)
class Claim:
    id: str
    statement: str
    verdict: str
    estimate: float | None
    ci_low: float | None
    ci_high: float | None
    n_seeds: int
    detail: str = ""  # how it was computed, one line
    margin: float | None = None  # the claim's equivalence margin (bpb); None: none declared
    verdict_class: str = "inconclusive"  # better | worse | equivalent | inconclusive | flagged
    primary: bool = True  # the claim's pre-registered primary contrast (False: a secondary row, e.g. C4b)
    tost_p: float | None = None  # TOST p within ±margin (after the row's family correction)
    caveat: str = ""  # what the verdict must be read with (e.g. the two sides were searched unequally)

    def to_dict(self) -> dict:
        return asdict(self)


def _clean(x) -> float | None:
    return None if x is None or (isinstance(x, float) and not math.isfinite(x)) else float(x)


def _mean_by_arm(df: pd.DataFrame, metric: str) -> pd.Series:
    return df.groupby("arm")[metric].mean().dropna()


def _learned(done: pd.DataFrame) -> list[str]:
    """Learned routed variants in the order they appear."""
    seen = [v for v in done["variant"] if v != DENSE and v not in CONTROL_VARIANTS]
    return list(dict.fromkeys(seen))


def _plain(done: pd.DataFrame) -> pd.Series:
    """Rows of declared (not derived-control) arms."""
    control = done["control"].fillna("") if "control" in done else pd.Series("", index=done.index)
    return control.astype(str) == ""


# Derived dense controls trained at the study's own budget (``modbench.model.sizing.control_arms``):
# other dense sizes at the same training FLOPs, so candidates for the isoFLOP-optimal dense model.
# (The iso-token control and the positive control train on other budgets and never are.)
SAME_BUDGET_CONTROLS = (FLOP_MATCHED, PARAM_MATCHED)


def _dense_size_at_budget(done: pd.DataFrame) -> pd.Series:
    """Rows of dense-size candidates at the study's budget: declared arms and same-budget controls."""
    control = done["control"].fillna("").astype(str) if "control" in done else pd.Series("", index=done.index)
    return _plain(done) | control.str.startswith(SAME_BUDGET_CONTROLS)


def _best(done: pd.DataFrame, mask: pd.Series) -> str | None:
    means = _mean_by_arm(done[mask], SELECT)
    return None if means.empty else str(means.idxmin())


def _verdict(row: pd.Series, better: str, worse: str) -> str:
    if row["estimate"] is None or pd.isna(row["p_adj"]):
        return "not testable (" + str(row["method"]).removeprefix("none: ") + ")"
    margin, tost = row.get("margin"), _clean(row.get("tost_p_adj"))
    inside = tost is not None and tost < ALPHA
    p = f"{'p' if row.get('family') == 'primary' else 'Holm p'} = {row['p_adj']:.2g}"  # the primary is its own family
    if row["p_adj"] < ALPHA:
        within = (f" (within the ±{margin:g} margin: a real difference, smaller than the one declared to matter)"
                  if inside else "")
        return (better if row["estimate"] < 0 else worse) + within
    if inside:
        return (f"equivalent within ±{margin:g} bpb: the {1 - 2 * ALPHA:.0%} CI [{_fmt(row['equiv_ci_low'])}, "
                f"{_fmt(row['equiv_ci_high'])}] lies inside the margin (TOST p = {tost:.2g})")
    if margin is not None and not pd.isna(margin):
        mde = f"; with these seeds only |Δ| ≥ {row['mde']:.3g} bpb is detectable" if row["mde"] else ""
        return (f"inconclusive: no difference detected ({p}) and not shown equivalent within "
                f"±{margin:g} bpb (the {1 - 2 * ALPHA:.0%} CI [{_fmt(row['equiv_ci_low'])}, "
                f"{_fmt(row['equiv_ci_high'])}] crosses the margin){mde}")
    if row["ci_low"] is not None and (row["ci_low"] > 0 or row["ci_high"] < 0):
        return (f"not significant ({p}), though the unadjusted 95 % CI "
                f"excludes 0: {better.split(':')[-1].strip() if row['estimate'] < 0 else worse.split(':')[-1].strip()} "
                "at most weakly")
    mde = f"; with these seeds only |Δ| ≥ {row['mde']:.3g} bpb is detectable" if row["mde"] else ""
    return f"not supported: no difference detected ({p}){mde}"


def _same_setting_pairs(plain: pd.DataFrame, variant: str, reference: str) -> list[tuple[str, str]]:
    """(arm, reference arm) for each arm of ``variant`` and the ``reference`` variant's arm at the
    same capacity, pattern and learning rate — or, when the reference has a single arm at that
    capacity and pattern, that arm whatever its learning rate: in a study with ``[tune]`` the
    compared rows are each family at its own best value (best against best), so two tuned families
    rarely share a learning rate, and requiring one would silently drop the comparison."""
    pairs = []
    for _, arm in plain[plain["variant"] == variant].drop_duplicates("arm").iterrows():
        setting = plain[(plain["variant"] == reference) & (plain["capacity"] == arm["capacity"])
                        & (plain["pattern"] == arm["pattern"])]
        match = setting[setting["lr_mult"] == arm["lr_mult"]]
        if match.empty and setting["arm"].nunique() == 1:
            match = setting
        if len(match):
            pairs.append((arm["arm"], match["arm"].iloc[0]))
    return pairs


def _primary_variant(done: pd.DataFrame, settings: ClaimSettings, among=None) -> str | None:
    """The variant of the claim's primary contrast: the declared one, else the first learned one
    (of ``among``, the variants the claim can test, when given)."""
    if settings.primary:
        return settings.primary
    learned = [v for v in _learned(done) if among is None or v in among]
    return learned[0] if learned else None


def _split(pairs: list[tuple[str, str]], primary_arm: str | None) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """([the primary pair], the secondary pairs): the first pair whose arm is ``primary_arm``."""
    first = next((p for p in pairs if p[0] == primary_arm), None)
    return ([first] if first else []), [p for p in pairs if p != first]


def _family_effects(done: pd.DataFrame, primary: list[tuple[str, str]], secondary: list[tuple[str, str]],
                    settings: ClaimSettings, claim_id: str) -> pd.DataFrame:
    """The primary contrast as its own family (m = 1), the secondary rows as another (Holm).
    Column ``claim``: the claim family (C1, C2, C4); ``claim_id``: the Claim whose verdict the row
    is (the primary row: the claim's id; secondary rows of C1/C2: "", C4 sets its sub-ids)."""
    frames = [compare_effects(done, HEADLINE, pairs, margin=settings.margin).assign(family=family)
              for family, pairs in (("primary", primary), ("secondary", secondary)) if pairs]
    if not frames:
        return pd.DataFrame()
    eff = pd.concat(frames, ignore_index=True).assign(claim=claim_id)
    return eff.assign(claim_id=np.where(eff["family"] == "primary", claim_id, ""))


def _fields(row: pd.Series) -> dict:
    """The Claim fields that come from an effects row."""
    return dict(estimate=_clean(row["estimate"]), ci_low=_clean(row["ci_low"]), ci_high=_clean(row["ci_high"]),
                n_seeds=int(min(row["n_arm"], row["n_ref"])), margin=_clean(row["margin"]),
                verdict_class=str(row["verdict_class"]), tost_p=_clean(row["tost_p_adj"]))


def _families_text(eff: pd.DataFrame) -> str:
    k = int((eff["family"] == "secondary").sum())
    return "primary contrast, its own family (m = 1)" + (f"; {k} secondary rows Holm-corrected apart" if k else "")


def _excluded_text(flagged: dict[str, str], arms) -> str:
    hit = [a for a in dict.fromkeys(arms) if a in flagged]
    return f"; excluded as degenerate: {', '.join(hit)}" if hit else ""


def _flagged_of(done: pd.DataFrame, variant: str | None, flagged: dict[str, str]) -> list[str]:
    """The degenerate arms of ``variant``."""
    return sorted(a for a in flagged if variant and a in set(done.loc[done["variant"] == variant, "arm"]))


def _no_primary(claim_id: str, statement: str, variant: str | None, flagged_arms: list[str]) -> Claim:
    why = (f"the primary contrast's arms are degenerate ({', '.join(flagged_arms)})" if flagged_arms
           else f"no completed arm of {variant or 'a learned variant'} has a reference to compare with")
    return Claim(claim_id, statement, f"not testable: {why}", None, None, None, 0,
                 verdict_class=FLAGGED if flagged_arms else "inconclusive")


def mod_vs_best_dense(done: pd.DataFrame, settings: ClaimSettings = ClaimSettings(),
                      flagged: dict[str, str] | None = None) -> tuple[list[Claim], pd.DataFrame]:
    flagged = flagged or {}
    ok = done[~done["arm"].isin(flagged)]
    vanilla = ok["recursion"].fillna("none") == "none" if "recursion" in ok else True  # a recursive dense model is an arm
    # the best dense size at this budget on val: the declared dense arms and the same-budget controls
    dense_best = _best(ok, (ok["variant"] == DENSE) & _dense_size_at_budget(ok) & vanilla)
    bests = {v: _best(ok, (ok["variant"] == v) & _plain(ok)) for v in _learned(ok)}
    pairs = [(best, dense_best) for best in bests.values() if best and dense_best]
    variant = _primary_variant(done, settings)
    primary_arm = bests.get(variant)
    controls = [c for c in ok[~_plain(ok) & ~_positive_control(ok)]["arm"].unique().tolist() if c != dense_best]
    if primary_arm:
        pairs += [(primary_arm, c) for c in controls]
    primary, secondary = _split(pairs, primary_arm)
    statement = ("{arm} (the best of its family on val) has lower test causal bpb than the best trained dense model "
                 "({ref}, best size and LR on val) at the same training FLOPs")
    eff = _family_effects(ok, primary, secondary, settings, "C1")
    control, control_eff = positive_control(ok, dense_best, settings)
    both = pd.concat([eff, control_eff], ignore_index=True) if len(control_eff) else eff
    if not primary:
        gone = _flagged_of(done, variant, flagged)
        if not pairs and not gone:
            return control, both
        return [_no_primary("C1", statement.format(arm=variant, ref=dense_best), variant, gone)] + control, both
    first = eff.iloc[0]
    return [Claim(
        "C1", statement.format(arm=first["arm"], ref=first["reference"]),
        _verdict(first, "supported: the routed model is better", "reversed: the best dense model is better"),
        detail=f"Δ = MoD − dense, {first['method']}; {_families_text(eff)}"
               + _excluded_text(flagged, done["arm"]),
        **_fields(first))] + control, both


def _positive_control(done: pd.DataFrame) -> pd.Series:
    """Rows of the positive control (C1's reference at a smaller budget)."""
    control = done["control"].fillna("") if "control" in done else pd.Series("", index=done.index)
    return control.astype(str).str.startswith(POSITIVE_CONTROL)


def positive_control(done: pd.DataFrame, reference: str | None,
                     settings: ClaimSettings = ClaimSettings()) -> tuple[list[Claim], pd.DataFrame]:
    """C1+: the positive control against C1's reference, paired by seed, its own family (m = 1),
    at C1's margin. Its sign is known (less compute: worse), so the class it gets is a check of
    the design: anything but ``worse`` means the design cannot see a difference of this size."""
    arms = done.loc[_positive_control(done), "arm"].unique().tolist()
    if not arms or reference is None:
        return [], pd.DataFrame()
    eff = compare_effects(done, HEADLINE, [(str(arms[0]), reference)], margin=settings.margin)
    eff = eff.assign(family="primary", claim=POSITIVE_CONTROL_ID, claim_id=POSITIVE_CONTROL_ID)
    row = eff.iloc[0]
    statement = (f"positive control: the smaller-budget dense model ({row['arm']}) has higher test causal bpb than "
                 f"C1's reference ({reference}), a difference known in advance")
    return [Claim(POSITIVE_CONTROL_ID, statement,
                  _verdict(row, "failed: the smaller budget came out better", "passed: the smaller budget is worse"),
                  detail=f"Δ = control − reference, {row['method']}; its own family (m = 1), C1's margin; "
                         "the design must class it 'worse'", **_fields(row))], eff


def positive_control_line(found: list[Claim]) -> str:
    """The report's sentence on the positive control ('' when the study has none)."""
    claim = next((c for c in found if c.id == POSITIVE_CONTROL_ID), None)
    if claim is None:
        return ""
    if claim.verdict_class == "regime not reached":  # no verdict, so no check of the design either
        return f"**The positive control decides nothing here:** {claim.verdict}."
    if claim.verdict_class == "worse":
        return (f"**The design passed its positive control:** the smaller-budget dense model is classed "
                f"\"worse\" than C1's reference, as it must be (Δ = {_fmt(claim.estimate)} bpb, "
                f"{claim.n_seeds} seeds).")
    return (f"**The design failed its positive control:** the smaller-budget dense model, known to be worse, is "
            f"classed \"{claim.verdict_class}\" against C1's reference (Δ = {_fmt(claim.estimate)} bpb, "
            f"{claim.n_seeds} seeds), so a verdict of \"equivalent\" or \"inconclusive\" elsewhere in this report "
            "cannot be told from a design too weak to see a difference of this size.")


def learned_vs_random(done: pd.DataFrame, settings: ClaimSettings = ClaimSettings(),
                      flagged: dict[str, str] | None = None) -> tuple[list[Claim], pd.DataFrame]:
    flagged = flagged or {}
    plain = done[_plain(done)]
    candidates = [p for v in _learned(done) if v in RANDOM_CONTROL
                  for p in _same_setting_pairs(plain, v, RANDOM_CONTROL[v])]
    pairs = [p for p in candidates if not set(p) & set(flagged)]
    dropped = [a for p in candidates if set(p) & set(flagged) for a in p if a in flagged]
    ok = done[~done["arm"].isin(flagged)]
    variant = _primary_variant(done, settings, among=RANDOM_CONTROL)
    best = _best(ok, (ok["variant"] == variant) & _plain(ok) & ok["arm"].isin([a for a, _ in pairs]))
    primary, secondary = _split(pairs, best)
    eff = _family_effects(ok, primary, secondary, settings, "C2")
    statement = ("learned routing ({arm}) has lower test causal bpb than random routing with the same gate "
                 "and scope ({ref})")
    if not primary:
        if not candidates:
            return [], eff
        return [_no_primary("C2", statement.format(arm=variant, ref=RANDOM_CONTROL.get(variant, "random")), variant,
                            _flagged_of(done, variant, flagged) or sorted(set(dropped)))], eff
    parts = [f"{r.arm} − {r.reference}: {_fmt(r.estimate)} [{_fmt(r.ci_low)}, {_fmt(r.ci_high)}] "
             f"→ {_verdict(pd.Series(r._asdict()), 'learned better', 'random better')}"
             for r in eff.itertuples(index=False)]
    first = eff.iloc[0]
    return [Claim(
        "C2", statement.format(arm=first["arm"], ref=first["reference"]),
        _verdict(first, "supported: learned routing is better", "reversed: random routing is better"),
        detail="; ".join(parts) + f" ({_families_text(eff)}{_excluded_text(flagged, dropped)})",
        **_fields(first))], eff


def _t_interval(x: np.ndarray, confidence: float = 0.95) -> tuple[float, float | None, float | None]:
    x = x[np.isfinite(x)]
    if x.size < 2:
        return (float(x.mean()) if x.size else float("nan")), None, None
    if not x.std() > 0:
        return float(x.mean()), float(x.mean()), float(x.mean())
    low, high = stats.t.interval(confidence, x.size - 1, loc=x.mean(), scale=stats.sem(x))
    return float(x.mean()), float(low), float(high)


def _one_sample_tost(x: np.ndarray, margin: float | None) -> float | None:
    """TOST p of H0 |mean| >= margin for a within-run quantity (one-sample t)."""
    x = x[np.isfinite(x)]
    if margin is None or x.size < 2 or not x.std() > 0:
        return None
    from statsmodels.stats.weightstats import DescrStatsW  # here: the study runner imports this module's names on a
    # lent GPU machine, which has no statsmodels (modbench.study.slot)

    return _clean(DescrStatsW(x).ttost_mean(-margin, margin)[0])


def _one_sample_class(low: float | None, high: float | None, tost_p: float | None) -> str:
    """better (CI below 0), worse (above 0), equivalent (TOST), inconclusive: lower is better."""
    if low is not None and high is not None and (high < 0 or low > 0):
        return "better" if high < 0 else "worse"
    return verdict_class(None, None, tost_p, ALPHA)


def causal_rule(done: pd.DataFrame, settings: ClaimSettings = ClaimSettings(),
                flagged: dict[str, str] | None = None) -> tuple[list[Claim], pd.DataFrame]:
    flagged = flagged or {}
    rows = []
    routed = done[_plain(done) & (done["variant"] != DENSE) & ~done["arm"].isin(flagged)]
    need = ("val/causal_agreement", "val/causal_chance_agreement", "val/causal_bpb", "val/bpb")
    if routed.empty or any(c not in routed for c in need):
        return [], pd.DataFrame()
    for arm, g in routed.groupby("arm", sort=False):
        over = (g["val/causal_agreement"] - g["val/causal_chance_agreement"]).to_numpy(dtype=float)
        gap = (g["val/causal_bpb"] - g["val/bpb"]).to_numpy(dtype=float)
        o, o_lo, o_hi = _t_interval(over)
        d, d_lo, d_hi = _t_interval(gap)
        _, e_lo, e_hi = _t_interval(gap, 1 - 2 * ALPHA)
        rows.append({"arm": arm, "variant": g["variant"].iloc[0], "n": len(g),
                     "agreement": g["val/causal_agreement"].mean(), "chance": g["val/causal_chance_agreement"].mean(),
                     "agreement − chance": o, "ci_low": o_lo, "ci_high": o_hi,
                     "precision": g.get("val/causal_precision", pd.Series(dtype=float)).mean(),
                     "recall": g.get("val/causal_recall", pd.Series(dtype=float)).mean(),
                     "causal − top-k gap": d, "gap_ci_low": d_lo, "gap_ci_high": d_hi,
                     "gap_equiv_ci_low": e_lo, "gap_equiv_ci_high": e_hi,
                     "gap_tost_p": _one_sample_tost(gap, settings.margin),
                     "realised fraction": g["val/causal_fraction"].mean() if "val/causal_fraction" in g else float("nan")})
    table = pd.DataFrame(rows)
    variant = _primary_variant(done, settings)
    pick = table[table["variant"] == variant]
    gone = _flagged_of(done, variant, flagged)
    if pick.empty and gone:
        return [_no_primary(i, f"the causal rule of {variant}: {what}", variant, gone)
                for i, what in (("C3a", "agreement with top-k above chance"), ("C3b", "the causal − top-k gap"))], table
    if len(pick):  # the primary variant's best arm on validation
        pick = pick[pick["arm"] == _best(routed, routed["variant"] == variant)]
    first = (pick if len(pick) else table).iloc[0]
    above = first["ci_low"] is not None and first["ci_low"] > 0
    agreement_verdict = ("supported: the causal rule agrees with top-k above chance" if above else
                         "not supported: agreement not above chance" if first["ci_high"] is not None and first["ci_high"] <= 0
                         else "inconclusive: the CI includes chance")
    gap_class = _one_sample_class(first["gap_ci_low"], first["gap_ci_high"], first["gap_tost_p"])
    gap_verdict = {"worse": "the causal rule costs bpb (gap > 0)", "better": "the causal rule is better than top-k (gap < 0)",
                   "inconclusive": "no gap detected (the CI includes 0)"}.get(gap_class)
    if gap_class == "equivalent":  # only then is there a TOST p to print (one seed has none)
        gap_verdict = (f"no gap beyond ±{settings.margin:g} bpb: the {1 - 2 * ALPHA:.0%} CI "
                       f"[{_fmt(first['gap_equiv_ci_low'])}, {_fmt(first['gap_equiv_ci_high'])}] lies inside "
                       f"the margin (TOST p = {first['gap_tost_p']:.2g})")
    claims = [
        Claim("C3a", f"the causal rule of {first['arm']} predicts top-k membership better than chance "
                     f"(agreement {first['agreement']:.3f} vs chance {first['chance']:.3f}; precision {first['precision']:.3f}, "
                     f"recall {first['recall']:.3f})", agreement_verdict,
              _clean(first["agreement − chance"]), _clean(first["ci_low"]), _clean(first["ci_high"]), int(first["n"]),
              "agreement − chance on validation windows, one-sample t over seeds",
              verdict_class="better" if above else "worse" if agreement_verdict.startswith("not supported") else "inconclusive"),
        Claim("C3b", f"decoding {first['arm']} with its causal rule instead of top-k changes validation bpb by the gap",
              gap_verdict, _clean(first["causal − top-k gap"]), _clean(first["gap_ci_low"]), _clean(first["gap_ci_high"]),
              int(first["n"]), "val causal bpb − val top-k bpb within each run, one-sample t over seeds",
              margin=settings.margin, verdict_class=gap_class, tost_p=_clean(first["gap_tost_p"])),
    ]
    return claims, table


def methods_vs_sigmoid(done: pd.DataFrame, settings: ClaimSettings = ClaimSettings(),
                       flagged: dict[str, str] | None = None) -> tuple[list[Claim], pd.DataFrame]:
    flagged = flagged or {}
    plain = done[_plain(done)]
    candidates = [p for variant in _learned(done) if variant != METHODS_REFERENCE
                  for p in _same_setting_pairs(plain, variant, METHODS_REFERENCE)]
    if not candidates:
        return [], pd.DataFrame()
    pairs = [p for p in candidates if not set(p) & set(flagged)]
    ok = done[~done["arm"].isin(flagged)]
    variant = _primary_variant(done, settings, among=[v for v in _learned(done) if v != METHODS_REFERENCE])
    best = _best(ok, (ok["variant"] == variant) & _plain(ok) & ok["arm"].isin([a for a, _ in pairs]))
    primary, secondary = _split(pairs, best)
    eff = _family_effects(ok, primary, secondary, settings, "C4")
    ids = {pair: f"C4{_letters(i)}" for i, pair in enumerate(candidates)}  # sub-ids follow the study's variants
    if len(eff):
        eff["claim_id"] = [ids[(a, r)] for a, r in zip(eff["arm"], eff["reference"])]
    rows = {(r["arm"], r["reference"]): r for _, r in eff.iterrows()}
    found = []
    for i, (arm, ref) in enumerate(candidates):  # flagged ones keep their sub-id, untested
        statement = f"{arm} has lower test causal bpb than {ref} (causal − top-k gap: {_gap_text(done, arm, ref)})"
        if (arm, ref) not in rows:
            reasons = "; ".join(f"{a}: {flagged[a]}" for a in (arm, ref) if a in flagged)
            found.append(Claim(f"C4{_letters(i)}", statement, f"not tested: degenerate arm ({reasons})", None, None, None,
                               0, "excluded from the C4 families", verdict_class=FLAGGED, primary=False))
            continue
        row = rows[(arm, ref)]
        found.append(Claim(
            f"C4{_letters(i)}", statement,
            _verdict(row, "supported: the method is better", f"reversed: {METHODS_REFERENCE} is better"),
            detail=f"Δ = method − {METHODS_REFERENCE}, {row['method']}; "
                   + ("primary contrast, its own family (m = 1)" if row["family"] == "primary"
                      else f"secondary, Holm over {int((eff['family'] == 'secondary').sum())} comparisons"),
            primary=row["family"] == "primary", **_fields(row)))
    return found, eff


def _gap_text(done: pd.DataFrame, arm: str, reference: str) -> str:
    """Each side's causal − top-k validation gap, mean [95 % t CI] over the compared seeds: what
    decoding by the method's causal rule costs, beside the reference's (issue 26: each method's gap
    in the claims table)."""
    parts = []
    for label, name in (("method", arm), ("reference", reference)):
        g = done[done["arm"] == name]
        if not {"val/causal_bpb", "val/bpb"} <= set(g.columns) or g.empty:
            return "n/a"
        mean, low, high = _t_interval((g["val/causal_bpb"] - g["val/bpb"]).to_numpy(dtype=float))
        ci = "" if low is None else f" [{_fmt(low)}, {_fmt(high)}]"
        parts.append(f"{label} {_fmt(mean)}{ci}")
    return "; ".join(parts)


def _letters(i: int) -> str:
    """a, b, …, z, aa, ab, …: sub-ids of a claim family."""
    out = ""
    i += 1
    while i:
        i, r = divmod(i - 1, 26)
        out = chr(ord("a") + r) + out
    return out


CLAIM_FUNCTIONS = {"mod_vs_best_dense": mod_vs_best_dense, "learned_vs_random": learned_vs_random,
                   "causal_rule": causal_rule, "methods_vs_sigmoid": methods_vs_sigmoid}


def _fmt(x) -> str:
    return "n/a" if x is None or (isinstance(x, float) and not math.isfinite(x)) else f"{x:+.3f}"


def arm_summary(done: pd.DataFrame, study: StudySpec) -> pd.DataFrame:
    """One row per arm, causal first: test causal bpb (mean, t CI), top-k bpb, realised fraction,
    training FLOPs per token and forward FLOPs per token at the realised fraction."""
    rows = []
    for arm, g in done.groupby("arm", sort=False):
        x = g[HEADLINE].to_numpy(dtype=float) if HEADLINE in g else np.array([])
        mean, low, high = _t_interval(x)
        first = g.iloc[0]
        fraction = float(g["test/causal_fraction"].mean()) if "test/causal_fraction" in g and g["test/causal_fraction"].notna().any() else 1.0
        cfg = study.run_config(row_arm(first), int(first["seed"]))
        rows.append({"arm": arm, "variant": first["variant"], "causal_bpb": mean, "causal_ci_low": low, "causal_ci_high": high,
                     "topk_bpb": float(g["test/bpb"].mean()), "val_causal_bpb": float(g[SELECT].mean()),
                     "realised_fraction": fraction,
                     "flops_per_token": float(g["perf/flops_per_token"].mean()),
                     "decode_flops_per_token": decode_flops_per_token(cfg.model, cfg.routing, cfg.train.seq_len, fraction),
                     "n_seeds": int(np.isfinite(x).sum())})
    return pd.DataFrame(rows).sort_values("causal_bpb").reset_index(drop=True)


def _capacity_bounds(row: pd.Series, study: StudySpec) -> tuple[float, float] | None:
    """(lowest, highest) capacity of the trial's routed layers at the evaluation length, or None
    for an arm with no routing (dense, or C = 1 everywhere)."""
    if row["variant"] == DENSE:
        return None
    cfg = study.run_config(row_arm(row), int(row["seed"]))
    routing = cfg.routing
    ends = (routing.capacity, routing.capacity if routing.capacity_first is None else routing.capacity_first)
    if routing.capacities:  # per recursion step (mor): the loosest bounds over the steps
        ends = (min(routing.capacity_list), max(routing.capacity_list))
    caps = [CapacitySchedule(c, routing.schedule, cfg.model.max_seq_len).effective(cfg.train.seq_len) for c in ends]
    return None if min(caps) >= 1.0 else (min(caps), max(caps))


def _share_problem(share: float, low: float, high: float) -> str:
    """Why a realised share is degenerate for capacities in [low, high], or ''."""
    if share < low / DEGENERATE_FACTOR:
        return f"collapsed: processes {share:.2g} of tokens, below C/{DEGENERATE_FACTOR:g} = {low / DEGENERATE_FACTOR:.3g}"
    if 1 - share < (1 - high) / DEGENERATE_FACTOR:
        return (f"saturated: processes {share:.3g} of tokens, skipping fewer than (1 − C)/{DEGENERATE_FACTOR:g} = "
                f"{(1 - high) / DEGENERATE_FACTOR:.3g}")
    return ""


def degenerate_arms(done: pd.DataFrame, study: StudySpec) -> dict[str, str]:
    """Routed arms whose realised share in some completed trial is far from their capacity C:
    share < C/4 (collapsed) or skipped share < (1 − C)/4 (saturated), on any recorded share
    column (``val/`` and ``test/causal_fraction``, and ``…_L{i}`` per routed layer when logged).

    Returns {arm label: reason}, the reason naming the share range seen and the capacity. For a
    capacity that decays over depth (``capacity_first``) the bounds are the loosest over its
    layers (the lowest layer capacity for "collapsed", the highest for "saturated"), so a flag
    never depends on which layer has which capacity. ``study`` gives each arm's routing and
    evaluation length (a "log" capacity schedule is taken at the evaluation length).
    """
    columns = [c for c in done.columns if SHARE_COLUMN.match(str(c))]
    found: dict[str, str] = {}
    if not columns or done.empty:
        return found
    for arm, g in done.groupby("arm", sort=False):
        bounds = _capacity_bounds(g.iloc[0], study)
        if bounds is None:
            continue
        shares = g[columns].apply(pd.to_numeric, errors="coerce").to_numpy(dtype=float)
        shares = shares[np.isfinite(shares)]
        problems = sorted({_share_problem(float(x), *bounds) for x in shares} - {""})
        if problems:
            cap = f"C = {bounds[0]:g}" if bounds[0] == bounds[1] else f"C = {bounds[0]:g}–{bounds[1]:g}"
            seen = f"{shares.min():.2g}" if shares.min() == shares.max() else f"{shares.min():.2g}–{shares.max():.2g}"
            found[str(arm)] = (f"realised share {seen} vs {cap} "
                               f"({problems[0].split(':')[0]}, in {len(g)} trials)")
    return found


def confirmation_rows(done: pd.DataFrame, study: StudySpec, confirmed: Collection[str] | None = None) -> pd.DataFrame:
    """The trials a claim of a study with ``[tune]`` compares: the confirmed arms' (``confirmed``,
    arm labels; None: every arm) on every seed but the tuning seed, on which each best value was
    picked. A study without ``[tune]``: every trial."""
    if not study.tune.lr_mult:
        return done
    keep = done["seed"].astype(int) != int(study.tune.seed)
    if confirmed is not None:
        keep &= done["arm"].isin(list(confirmed))
    return done[keep]


def test_claims(done: pd.DataFrame, study: StudySpec,
                confirmed: Collection[str] | None = None) -> tuple[list[Claim], pd.DataFrame, list[pd.DataFrame]]:
    """Every declared claim: the claims, the effects table (C1, C1+, C2, C4 rows, column
    ``family``: primary / secondary) and the extra tables. Degenerate arms (:func:`degenerate_arms`)
    are left out of every family; call it to name them. For a study with ``[tune]``, ``confirmed``
    (the labels of the arms its confirmation seeds ran, ``modbench.study.tuning.best_arms``) and
    the confirmation seeds are what is compared (:func:`confirmation_rows`)."""
    done = confirmation_rows(done, study, confirmed)
    flagged = degenerate_arms(done, study)
    claims, effects, tables = [], [], []
    for name in study.settings.claims:
        found, table = CLAIM_FUNCTIONS[name](done, study.claim_settings.get(name, ClaimSettings()), flagged)
        claims += found
        if name == "causal_rule":
            tables.append(table)
        elif len(table):
            effects.append(table)
    effects = pd.concat(effects, ignore_index=True) if effects else pd.DataFrame()
    claims, effects = holm_across_primaries(claims, effects)
    return claims, effects, tables


def holm_across_primaries(claims: list[Claim], effects: pd.DataFrame, alpha: float = ALPHA) -> tuple[list[Claim], pd.DataFrame]:
    """Holm over the study's primary contrasts (C1, C2, C4, …; the positive control is a check of the
    design, not a claim): each primary is its own family (m = 1), and a study tests several, so the
    chance that one of them is a false positive grows with their number. Every primary row gets
    ``p_primaries`` and ``tost_p_primaries`` (Holm across them); a claim whose class changes under
    them takes the new class, and its verdict says why. One primary: nothing changes."""
    if effects.empty or "family" not in effects:
        return claims, effects
    rows = effects[(effects["family"] == "primary") & (effects["claim_id"] != POSITIVE_CONTROL_ID)
                   & effects["p"].notna()]
    effects = effects.assign(p_primaries=np.nan, tost_p_primaries=np.nan)
    if len(rows) < 2:
        return claims, effects
    effects.loc[rows.index, "p_primaries"] = holm(rows["p"].astype(float).tolist())
    tost = rows["tost_p"].dropna()
    if len(tost):
        effects.loc[tost.index, "tost_p_primaries"] = holm(tost.astype(float).tolist())
    out = []
    for claim in claims:
        match = effects.loc[rows.index][effects.loc[rows.index, "claim_id"] == claim.id]
        if match.empty:
            out.append(claim)
            continue
        row = effects.loc[match.index[0]]
        cls = verdict_class(_clean(row["estimate"]), _clean(row["p_primaries"]), _clean(row["tost_p_primaries"]), alpha)
        if cls == claim.verdict_class or claim.verdict_class == FLAGGED:
            out.append(claim)
            continue
        note = (f"{claim.verdict_class} on its own, {cls} after Holm across the study's {len(rows)} primary claims "
                f"(p = {row['p_primaries']:.3g}" + (f", TOST p = {row['tost_p_primaries']:.3g}" if
                                                     pd.notna(row["tost_p_primaries"]) else "") + ")")
        out.append(replace(claim, verdict_class=cls, verdict=note, tost_p=_clean(row["tost_p_primaries"])))
    return out, effects
