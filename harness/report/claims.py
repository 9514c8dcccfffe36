"""Claims a study declares (``study.claims``), each tested with its controls, one verdict each.

The headline metric is the deployable one, **causal bpb on the test split** (the decode-time
routing rule, Raposo et al. 2024 §3.5); top-k bpb, which sees the future, is secondary.
Every choice of "best" (model size, learning rate) is made on the validation split and
reported on test, so no number is chosen and reported on the same data.

Claim kinds (ids C1, C2, C3a/C3b in the order the study lists them):

- ``mod_vs_best_dense`` (paper §4.1, Figure 3): each learned MoD variant, at its best
  learning rate, against the isoFLOP-optimal dense model (the best dense size and learning
  rate at the same FLOP budget). Its family also holds the derived controls: the FLOP-matched
  dense model and the iso-token dense model (``study.controls``).
- ``learned_vs_random``: each learned variant against the random control with the same gate
  and scope (``RANDOM_CONTROL``), at the same capacity, pattern and learning rate.
- ``causal_rule``: the causal rule as a predictor of top-k membership, agreement minus its
  chance level (an independent rule with the same marginals), with precision and recall
  (C3a); and the causal − top-k gap (C3b).
- ``methods_vs_sigmoid``: every other learned variant against the ``sigmoid`` recipe at the
  same capacity, pattern and learning rate (C4a, C4b, … in the order the study lists them),
  one family: does a method of the later literature route better than the seed recipe?

Differences are arm − reference over seeds (``modbench.report.effects``): paired by seed when
both arms ran the same seeds (a seed fixes the data order), Holm-corrected within each
claim's family, with the minimum detectable effect. C3's quantities are within-run
differences, so their CIs are one-sample t intervals over seeds.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np
import pandas as pd
from scipy import stats

from modbench.config.study import Study
from modbench.report.collect import row_arm
from modbench.model.sizing import decode_flops_per_token
from modbench.report.effects import compare_effects

HEADLINE = "test/causal_bpb"  # what claims are reported on
SELECT = "val/causal_bpb"  # what "best" is chosen on
ALPHA = 0.05
RANDOM_CONTROL = {"sigmoid": "random_gated", "norm": "random", "mlp_skip": "random_mlp"}
CONTROL_VARIANTS = ("random", "random_gated", "random_mlp")
METHODS_REFERENCE = "sigmoid"  # the seed recipe the later methods are measured against (C4)


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

    def to_dict(self) -> dict:
        return asdict(self)


def _clean(x) -> float | None:
    return None if x is None or (isinstance(x, float) and not math.isfinite(x)) else float(x)


def _mean_by_arm(df: pd.DataFrame, metric: str) -> pd.Series:
    return df.groupby("arm")[metric].mean().dropna()


def _learned(done: pd.DataFrame) -> list[str]:
    """Learned routed variants in the order they appear."""
    seen = [v for v in done["variant"] if v != "dense" and v not in CONTROL_VARIANTS]
    return list(dict.fromkeys(seen))


def _plain(done: pd.DataFrame) -> pd.Series:
    """Rows of declared (not derived-control) arms."""
    control = done["control"].fillna("") if "control" in done else pd.Series("", index=done.index)
    return control.astype(str) == ""


def _best(done: pd.DataFrame, mask: pd.Series) -> str | None:
    means = _mean_by_arm(done[mask], SELECT)
    return None if means.empty else str(means.idxmin())


def _verdict(row: pd.Series, better: str, worse: str) -> str:
    if row["estimate"] is None or pd.isna(row["p_adj"]):
        return "not testable (" + str(row["method"]).removeprefix("none: ") + ")"
    if row["p_adj"] < ALPHA:
        return better if row["estimate"] < 0 else worse
    if row["ci_low"] is not None and (row["ci_low"] > 0 or row["ci_high"] < 0):
        return (f"not significant after Holm correction (p = {row['p_adj']:.2g}), though the unadjusted 95 % CI "
                f"excludes 0: {better.split(':')[-1].strip() if row['estimate'] < 0 else worse.split(':')[-1].strip()} "
                "at most weakly")
    mde = f"; with these seeds only |Δ| ≥ {row['mde']:.3g} bpb is detectable" if row["mde"] else ""
    return f"not supported: no difference detected (Holm p = {row['p_adj']:.2g}){mde}"


def _same_setting_pairs(plain: pd.DataFrame, variant: str, reference: str) -> list[tuple[str, str]]:
    """(arm, reference arm) for each arm of ``variant`` and the ``reference`` variant's arm at the
    same capacity, pattern and learning rate."""
    pairs = []
    for _, arm in plain[plain["variant"] == variant].drop_duplicates("arm").iterrows():
        match = plain[(plain["variant"] == reference) & (plain["capacity"] == arm["capacity"])
                      & (plain["pattern"] == arm["pattern"]) & (plain["lr_mult"] == arm["lr_mult"])]
        if len(match):
            pairs.append((arm["arm"], match["arm"].iloc[0]))
    return pairs


def mod_vs_best_dense(done: pd.DataFrame) -> tuple[list[Claim], pd.DataFrame]:
    dense_best = _best(done, (done["variant"] == "dense") & _plain(done))
    pairs, primary = [], []
    for variant in _learned(done):
        best = _best(done, (done["variant"] == variant) & _plain(done))
        if best and dense_best:
            pairs.append((best, dense_best))
            primary.append(best)
    controls = done[~_plain(done)]["arm"].unique().tolist()
    if primary:
        pairs += [(primary[0], c) for c in controls]
    if not pairs:
        return [], pd.DataFrame()
    eff = compare_effects(done, HEADLINE, pairs).assign(claim="C1")
    claims = []
    first = eff.iloc[0]
    n = int(min(first["n_arm"], first["n_ref"]))
    claims.append(Claim(
        "C1", f"MoD ({first['arm']}, best LR on val) has lower test causal bpb than the isoFLOP-optimal dense "
              f"model ({first['reference']}, best size and LR on val) at the same training FLOPs",
        _verdict(first, "supported: MoD is better", "reversed: the dense optimum is better"),
        _clean(first["estimate"]), _clean(first["ci_low"]), _clean(first["ci_high"]), n,
        f"Δ = MoD − dense, {first['method']}, Holm over {len(eff)} comparisons"))
    return claims, eff


def learned_vs_random(done: pd.DataFrame) -> tuple[list[Claim], pd.DataFrame]:
    pairs = []
    plain = done[_plain(done)]
    for variant in _learned(done):
        control = RANDOM_CONTROL.get(variant)
        if control is None:
            continue
        pairs += _same_setting_pairs(plain, variant, control)
    if not pairs:
        return [], pd.DataFrame()
    eff = compare_effects(done, HEADLINE, pairs).assign(claim="C2")
    parts = [f"{r.arm} − {r.reference}: {_fmt(r.estimate)} [{_fmt(r.ci_low)}, {_fmt(r.ci_high)}] → {_verdict(r, 'learned better', 'random better')}"
             for _, r in eff.iterrows()]
    first = eff.iloc[0]
    claims = [Claim(
        "C2", f"learned routing ({first['arm']}) has lower test causal bpb than random routing with the same gate "
              f"and scope ({first['reference']})",
        _verdict(first, "supported: learned routing is better", "reversed: random routing is better"),
        _clean(first["estimate"]), _clean(first["ci_low"]), _clean(first["ci_high"]),
        int(min(first["n_arm"], first["n_ref"])), "; ".join(parts))]
    return claims, eff


def _t_interval(x: np.ndarray) -> tuple[float, float | None, float | None]:
    x = x[np.isfinite(x)]
    if x.size < 2:
        return (float(x.mean()) if x.size else float("nan")), None, None
    low, high = stats.t.interval(0.95, x.size - 1, loc=x.mean(), scale=stats.sem(x)) if x.std() > 0 else (x.mean(), x.mean())
    return float(x.mean()), float(low), float(high)


def causal_rule(done: pd.DataFrame) -> tuple[list[Claim], pd.DataFrame]:
    rows = []
    routed = done[_plain(done) & (done["variant"] != "dense")]
    need = ("val/causal_agreement", "val/causal_chance_agreement", "val/causal_bpb", "val/bpb")
    if routed.empty or any(c not in routed for c in need):
        return [], pd.DataFrame()
    for arm, g in routed.groupby("arm", sort=False):
        over = (g["val/causal_agreement"] - g["val/causal_chance_agreement"]).to_numpy(dtype=float)
        gap = (g["val/causal_bpb"] - g["val/bpb"]).to_numpy(dtype=float)
        o, o_lo, o_hi = _t_interval(over)
        d, d_lo, d_hi = _t_interval(gap)
        rows.append({"arm": arm, "variant": g["variant"].iloc[0], "n": len(g),
                     "agreement": g["val/causal_agreement"].mean(), "chance": g["val/causal_chance_agreement"].mean(),
                     "agreement − chance": o, "ci_low": o_lo, "ci_high": o_hi,
                     "precision": g.get("val/causal_precision", pd.Series(dtype=float)).mean(),
                     "recall": g.get("val/causal_recall", pd.Series(dtype=float)).mean(),
                     "causal − top-k gap": d, "gap_ci_low": d_lo, "gap_ci_high": d_hi,
                     "realised fraction": g["val/causal_fraction"].mean() if "val/causal_fraction" in g else float("nan")})
    table = pd.DataFrame(rows)
    learned = [v for v in _learned(done)]
    pick = table[table["variant"] == learned[0]] if learned else table
    first = (pick if len(pick) else table).iloc[0]
    above = first["ci_low"] is not None and first["ci_low"] > 0
    agreement_verdict = ("supported: the causal rule agrees with top-k above chance" if above else
                         "not supported: agreement not above chance" if first["ci_high"] is not None and first["ci_high"] <= 0
                         else "inconclusive: the CI includes chance")
    gap_verdict = ("the causal rule costs bpb (gap > 0)" if first["gap_ci_low"] is not None and first["gap_ci_low"] > 0 else
                   "the causal rule is better than top-k (gap < 0)" if first["gap_ci_high"] is not None and first["gap_ci_high"] < 0
                   else "no gap detected (the CI includes 0)")
    claims = [
        Claim("C3a", f"the causal rule of {first['arm']} predicts top-k membership better than chance "
                     f"(agreement {first['agreement']:.3f} vs chance {first['chance']:.3f}; precision {first['precision']:.3f}, "
                     f"recall {first['recall']:.3f})", agreement_verdict,
              _clean(first["agreement − chance"]), _clean(first["ci_low"]), _clean(first["ci_high"]), int(first["n"]),
              "agreement − chance on validation windows, one-sample t over seeds"),
        Claim("C3b", f"decoding {first['arm']} with its causal rule instead of top-k changes validation bpb by the gap",
              gap_verdict, _clean(first["causal − top-k gap"]), _clean(first["gap_ci_low"]), _clean(first["gap_ci_high"]),
              int(first["n"]), "val causal bpb − val top-k bpb within each run, one-sample t over seeds"),
    ]
    return claims, table


def methods_vs_sigmoid(done: pd.DataFrame) -> tuple[list[Claim], pd.DataFrame]:
    plain = done[_plain(done)]
    pairs = [p for variant in _learned(done) if variant != METHODS_REFERENCE
             for p in _same_setting_pairs(plain, variant, METHODS_REFERENCE)]
    if not pairs:
        return [], pd.DataFrame()
    eff = compare_effects(done, HEADLINE, pairs).assign(claim="C4")
    found = []
    for i, (_, row) in enumerate(eff.iterrows()):
        found.append(Claim(
            f"C4{_letters(i)}", f"{row['arm']} has lower test causal bpb than {row['reference']}",
            _verdict(row, "supported: the method is better", f"reversed: {METHODS_REFERENCE} is better"),
            _clean(row["estimate"]), _clean(row["ci_low"]), _clean(row["ci_high"]), int(min(row["n_arm"], row["n_ref"])),
            f"Δ = method − {METHODS_REFERENCE}, {row['method']}, Holm over {len(eff)} comparisons"))
    return found, eff


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


def arm_summary(done: pd.DataFrame, study: Study) -> pd.DataFrame:
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


def test_claims(done: pd.DataFrame, study: Study) -> tuple[list[Claim], pd.DataFrame, list[pd.DataFrame]]:
    """Every declared claim: the claims, the effects table (C1, C2 rows) and the extra tables."""
    claims, effects, tables = [], [], []
    for name in study.settings.claims:
        found, table = CLAIM_FUNCTIONS[name](done)
        claims += found
        if name == "causal_rule":
            tables.append(table)
        elif len(table):
            effects.append(table)
    return claims, pd.concat(effects, ignore_index=True) if effects else pd.DataFrame(), tables
