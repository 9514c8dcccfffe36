"""The report's first sections: regime check, claims with verdicts, causal-first arm table.

Written for every study (the sanity baselines and the causal-first arm table) and, when the
study declares ``claims``, the claims, their effects with a forest plot, the causal-rule
table, the dense isoFLOP profile and ``summary.json``:

    claims:    [{id, statement, verdict, estimate, ci_low, ci_high, n_seeds, detail}]
    arms:      [{arm, causal_bpb, causal_ci_low, causal_ci_high, topk_bpb, realised_fraction,
                 flops_per_token, decode_flops_per_token, n_seeds, …}]
    baselines: {unigram, bigram, trigram, zstd, gzip, xz, split, n_bytes}   (bits per byte, test split)

Every number here is computed from the study's trials by this command.
"""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

from modbench.data import load_corpus
from modbench.model.sizing import non_embedding_params
from modbench.report import figures
from modbench.report.baselines import Baselines, sanity_baselines
from modbench.report.claims import HEADLINE, arm_summary, test_claims
from modbench.report.collect import ReportData, row_arm
from modbench.report.isoflop import profiles

SUMMARY_VERSION = 1


def _fmt(x, digits: int = 4) -> str:
    if x is None or (isinstance(x, float) and x != x):
        return "n/a"
    return f"{x:.{digits}g}" if isinstance(x, float) else str(x)


def _ci(low, high) -> str:
    return "n/a (n<2)" if low is None or high is None or low != low else f"[{low:+.3f}, {high:+.3f}]"


def baselines_for(data: ReportData) -> dict[str, Baselines]:
    corpus = load_corpus(data.study.base.train.dataset)
    train = corpus.split("train")
    return {split: sanity_baselines(train, corpus.split(split), split) for split in ("val", "test")}


def regime_lines(arms: pd.DataFrame, base: dict[str, Baselines]) -> list[str]:
    """The first lines of the report: do the models beat counting? If not, say so plainly."""
    trigram = base["test"].trigram
    worse = arms[~(arms["causal_bpb"] < trigram)]
    listed = ", ".join(f"{r.arm} ({_fmt(r.causal_bpb)})" for r in worse.itertuples())
    routed = arms[arms["variant"] != "dense"]
    if len(worse) and (worse["variant"] == "dense").all() and len(routed) and (routed["causal_bpb"] < trigram).all():
        margin = trigram - routed["causal_bpb"].max()
        return [f"> **Under-trained: {len(worse)} of {len(arms)} arms do not beat a count trigram model** on the test split "
                f"({trigram:.3f} bpb): {listed}. All of them are dense models (the large end of a size sweep trains too few "
                f"tokens at this budget, which an isoFLOP sweep must show); conclusions about those arms are unreliable. "
                f"Every routed arm beats the trigram (the worst by {margin:.3f} bpb).", ""]
    if len(worse):
        return [f"> **Under-trained regime: routing conclusions are unreliable.** {len(worse)} of {len(arms)} arms do "
                f"not beat a count trigram model on the test split ({trigram:.3f} bpb): {listed}.", ""]
    return [f"Every arm beats the count trigram baseline on the test split ({trigram:.3f} bpb; best arm "
            f"{arms['causal_bpb'].min():.3f}), so the models have learned more than byte statistics.", ""]


def baseline_lines(base: dict[str, Baselines]) -> list[str]:
    table = pd.DataFrame([{"split": b.split, "bytes": b.n_bytes, "unigram": b.unigram, "bigram": b.bigram,
                           "trigram (KN)": b.trigram, "gzip": b.gzip, "xz": b.xz, "zstd": b.zstd} for b in base.values()])
    return ["## Sanity baselines", "",
            "Bits per byte of count n-gram models (interpolated Kneser–Ney, fit on train) and of general-purpose "
            "compressors applied to the whole split. The compressors exploit repeats anywhere in the ~0.6 MB split; "
            "a model with a 128-byte context cannot, so they are a reference, not a bar.", "",
            table.map(lambda v: _fmt(v) if isinstance(v, float) else v).to_markdown(index=False), ""]


def arm_lines(arms: pd.DataFrame) -> list[str]:
    show = arms.assign(**{"95% CI": ["n/a (n<2)" if lo is None or lo != lo else f"[{lo:.3f}, {hi:.3f}]"
                                       for lo, hi in zip(arms.causal_ci_low, arms.causal_ci_high)]})
    show = show[["arm", "causal_bpb", "95% CI", "topk_bpb", "val_causal_bpb", "realised_fraction", "decode_flops_per_token",
                 "flops_per_token", "n_seeds"]].rename(columns={
        "causal_bpb": "test causal bpb", "topk_bpb": "test top-k bpb",
        "val_causal_bpb": "val causal bpb", "realised_fraction": "realised fraction",
        "decode_flops_per_token": "decode FLOPs/token", "flops_per_token": "train FLOPs/token", "n_seeds": "seeds"})
    return ["## Arms (deployable metric first)", "",
            "Test causal bpb: the decode-time causal routing rule on 64 KiB of fixed test windows (mean over seeds, "
            "Student-t 95 % CI). Top-k bpb sees the future and is shown second. Realised fraction: share of routed-layer "
            "token computations the causal rule performs; decode FLOPs/token: the forward cost at that fraction.", "",
            show.map(lambda v: _fmt(v) if isinstance(v, float) else v).to_markdown(index=False), ""]


def _claim_table(claims) -> str:
    return pd.DataFrame([{"id": c.id, "claim": c.statement, "verdict": c.verdict,
                          "estimate": _fmt(c.estimate), "95% CI": _ci(c.ci_low, c.ci_high), "seeds": c.n_seeds}
                         for c in claims]).to_markdown(index=False)


def effect_lines(effects: pd.DataFrame, dest: Path) -> list[str]:
    if effects.empty:
        return []
    figures.forest_plot(effects, dest / "effects.png", metric_label="Δ test causal bpb (arm − reference)")
    show = effects[["claim", "arm", "reference", "estimate", "ci_low", "ci_high", "method", "p_adj", "mde", "seeds_needed",
                    "verdict"]].rename(columns={"p_adj": "Holm p", "mde": "MDE", "seeds_needed": "seeds for 80% power"})
    return ["## Effects", "",
            "Differences arm − reference in test causal bpb (negative: the arm is better). Paired by seed where both "
            "arms ran the same seeds (a seed fixes the data order), else a BCa bootstrap over seeds; p-values "
            "Holm-corrected within each claim's family; MDE: the smallest |Δ| this design detects with 80 % power.", "",
            show.map(lambda v: _fmt(v) if isinstance(v, float) else v).to_markdown(index=False), "",
            "![effects](effects.png)", ""]


def causal_lines(tables: list[pd.DataFrame]) -> list[str]:
    if not tables or tables[0].empty:
        return []
    t = tables[0].drop(columns=["variant"])
    return ["## The causal rule against top-k (validation)", "",
            "Agreement of each layer's causal decision with top-k membership on the same hidden states, beside the "
            "agreement of an independent rule with the same marginals (chance: at C = 0.125 always-skip already "
            "agrees on 87.5 %); the causal − top-k bpb gap within each run. CIs: one-sample t over seeds.", "",
            t.map(lambda v: _fmt(v) if isinstance(v, float) else v).to_markdown(index=False), ""]


def isoflop_lines(data: ReportData, dest: Path) -> list[str]:
    """isoFLOP profiles (paper §4.1): per family (dense, each routed variant at one capacity) and FLOP
    budget with at least 3 model sizes, loss against log parameters, the optimum with a bootstrap CI
    over seeds, and each MoD optimum minus the dense optimum at the same budget."""
    done = data.done
    plain = done[(done["control"].fillna("").astype(str) == "") & (done["lr_mult"] == 1.0)
                 & done["budget"].astype(str).str.startswith("flops=")]
    rows = []
    for _, r in plain.iterrows():
        cfg = data.study.run_config(row_arm(r), int(r["seed"]))
        family = "dense" if r["variant"] == "dense" else f"{r['variant']} C={r['capacity']:g}"
        rows.append({"family": family, "budget": float(str(r["budget"]).split("=")[1]),
                     "params": non_embedding_params(cfg.model, cfg.routing), "loss": r["val/causal_bpb"]})
    points = pd.DataFrame(rows, columns=["family", "budget", "params", "loss"])
    sizes = points.groupby(["family", "budget"])["params"].nunique() if len(points) else pd.Series(dtype=int)
    keep = sizes[sizes >= 3].index
    if not len(keep):
        return []
    points = points.set_index(["family", "budget"]).loc[keep].reset_index()
    fits, versus = profiles(points)
    figures.isoflop_profile(points, fits, dest / "isoflop.png")
    fits.to_csv(dest / "isoflop_fits.csv", index=False)
    table = fits[["family", "budget", "sizes", "opt_params", "opt_low", "opt_high", "opt_loss", "loss_low", "loss_high", "inside"]]
    out = ["## isoFLOP profiles", "",
           "Validation causal bpb against non-embedding parameters per family and FLOP budget: a parabola in log size "
           "(Hoffmann et al. 2022, approach 2) and a bootstrap over seeds for the optimum. An optimum at the edge of "
           "the sizes trained is not an optimum: widen the sweep before concluding.", "",
           table.map(lambda v: _fmt(v) if isinstance(v, float) else v).to_markdown(index=False), ""]
    if len(versus):
        out += ["Optimum vs optimum (MoD family − dense at the same budget; bootstrap over seeds):", "",
                versus.map(lambda v: _fmt(v) if isinstance(v, float) else v).to_markdown(index=False), ""]
    return out + ["![isoFLOP profiles](isoflop.png)", ""]


def curve_lines(data: ReportData, dest: Path) -> list[str]:
    curves = data.curves
    if curves.empty:
        return []
    c = curves.rename(columns={"val/bpb": "val_bpb"})
    figures.small_multiples(c, dest / "curves_flops.png")
    figures.small_multiples(c, dest / "curves_tokens.png", x="tokens", xlabel="training tokens")
    return ["## Learning curves", "",
            "Validation top-k bpb (the training-time rule; the causal number is measured at the end) per variant, mean "
            "over seeds, against training FLOPs and against training tokens; dashed: dense.", "",
            "![curves vs FLOPs](curves_flops.png)", "", "![curves vs tokens](curves_tokens.png)", ""]


def claims_sections(data: ReportData, dest: Path) -> list[str]:
    """The report's opening: regime, claims, arms, baselines, effects, causal rule, profile, curves."""
    done = data.done
    if "control" not in done:
        done["control"] = ""
    if HEADLINE not in done:
        return []
    arms = arm_summary(done, data.study)
    base = baselines_for(data)
    lines = regime_lines(arms, base)
    claims, effects, tables = test_claims(done, data.study)
    if claims:
        lines += ["## Claims", "", _claim_table(claims), ""]
    lines += arm_lines(arms) + baseline_lines(base) + effect_lines(effects, dest) + causal_lines(tables)
    lines += isoflop_lines(data, dest) + curve_lines(data, dest)
    arms.to_csv(dest / "arms_causal.csv", index=False)
    if len(effects):
        effects.to_csv(dest / "effects.csv", index=False)
    summary = {"version": SUMMARY_VERSION, "study": data.study.name, "headline_metric": HEADLINE,
               "claims": [c.to_dict() for c in claims],
               "arms": arms.drop(columns=["variant"]).to_dict(orient="records"),
               "baselines": {k: v for k, v in base["test"].to_dict().items()}}
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
