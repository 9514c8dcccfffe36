"""``modbench report``: a study's markdown report with statistics, tables and plots.

reports/<study>/report.md, its PNGs and the data as CSV. Statistics (modbench.report.stats): per-arm
mean and 95% t-interval over seeds; every routed arm against the dense arm of its group
(same depth, budget and LR multiplier, so iso-FLOP) with Welch's t-test, Mann–Whitney U and
Hedges' g, p-values Holm-corrected over every comparison in the report. Every sentence in the
summary is generated from those numbers.
"""

from __future__ import annotations

import math
import platform
import shlex
import tempfile
import sys
from pathlib import Path

import numpy as np
import pandas as pd

from modbench.errors import redact
from modbench.report import figures
from modbench.design.vocabulary import CONTROL_VARIANTS, DENSE
from modbench.report.claims_report import TuningTable, claims_sections
from modbench.report.collect import ReportData, collect
from modbench.report.routing_analysis import MASKS_TAG, analyse_masks, load_masks, selection_masks
from modbench.report.stats import compare_to_baseline, holm, pareto_front, summarize
from modbench.report.stats_text import describe_comparison
from modbench.design.study_file import load_study
from modbench.design.controls import study_arms

ALPHA = 0.05
SPEED_SPREAD_TOLERANCE = 1.25  # fastest / slowest seed of one arm above this: the machine was busy


def fmt(x, digits: int = 4) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "n/a"
    if isinstance(x, float):
        return f"{x:.{digits}g}" if abs(x) < 1e4 else f"{x:.3g}"
    return str(x)


def md_table(df: pd.DataFrame) -> str:
    return df.map(lambda v: fmt(v) if not isinstance(v, str) else v).to_markdown(index=False)


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


def comparisons(data: ReportData, arms: pd.DataFrame) -> tuple[pd.DataFrame, list[str]]:
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


def build_report(study_path: str | Path, *, uri: str, storage: str | None = None, out_dir: str | Path = "runs/studies",
                 reports_dir: str | Path = "reports", command: str | None = None,
                 progress: bool = False, tuning: TuningTable | None = None) -> Path:
    """Write reports/<study>/report.md. ``tuning``: the study runner's per-family tuning table
    (``modbench.study.tuning.family_table`` over the trials), rendered for a study with ``[tune]``."""
    study = load_study(study_path)
    data = collect(study, storage=storage, out_dir=out_dir, uri=uri, progress=progress)
    dest = Path(reports_dir) / study.name
    dest.mkdir(parents=True, exist_ok=True)
    data.trials.to_csv(dest / "trials.csv", index=False)
    data.curves.to_csv(dest / "curves.csv", index=False)
    lines = [f"# Study report: {study.name}", "", study.settings.description, ""] + _count_lines(study, data)
    if data.done.empty:
        lines += ["**No trial has finished yet**, so there is nothing to compare. Run `modbench study run` first.", ""]
        return _finish(lines, data, dest, study_path, command)

    lines += failed_arm_lines(data.trials)
    lines += claims_sections(data, dest, tuning)
    arms = arm_table(data)
    arms.to_csv(dest / "arms.csv", index=False)
    comp, notes = comparisons(data, arms)
    if not comp.empty:
        comp.to_csv(dest / "comparisons.csv", index=False)
    lines += _topk_lines(study, arms, comp, notes)
    curves_png = figures.validation_curves(data.curves, dest / "curves.png") if len(data.curves) else None
    if curves_png:
        lines += ["## Validation curves", "", "![validation curves](curves.png)", ""]
    lines += _pareto_lines(arms, dest) + _throughput_lines(arms, dest)
    lines += _causal_section(data)
    lines += _routing_section(data, dest, uri, progress)
    return _finish(lines, data, dest, study_path, command)


def _count_lines(study, data) -> list[str]:
    """The trial count (what a staged study's stages queued so far, else what the grid plans), seeds,
    dataset and budget."""
    counts = data.trials.state.value_counts().to_dict() if len(data.trials) else {}
    if study.tune.lr_mult:  # a staged study plans as it goes (modbench.study.tuning): what its stages queued
        planned = f"{len(data.trials)} queued by its stages so far"
    else:
        planned = f"{(len(study_arms(study)) if study.settings.sampler == 'grid' else study.settings.n_trials) * len(study.settings.seeds)} planned"
    return [f"Trials: {counts.get('COMPLETE', 0)} complete of {planned}"
            + "".join(f", {n} {s.lower()}" for s, n in sorted(counts.items()) if s != "COMPLETE")
            + f"; seeds per arm: {len(study.settings.seeds)}; dataset `{study.base.train.dataset}`; "
            f"every arm trains for the same budget `{study.base.train.budget}`" + (" (per group)" if "budget" in study.space and len(study.space["budget"]) > 1 else "") + ".", ""]


def _topk_lines(study, arms: pd.DataFrame, comp: pd.DataFrame, notes: list[str]) -> list[str]:
    """The per-group diagnostics on validation top-k bpb: the summary, the arm table and the
    comparisons against each group's dense arm."""
    table, sentences = summary_rows(arms, comp)
    lines = []
    if study.settings.claims:
        lines += ["# Details", "", "The sections below are per-group diagnostics on validation top-k bpb (the training-time "
                  "rule); the claims above are the study's answers.", ""]
    lines += ["## Top-k validation summary by group", "", md_table(table), ""]
    if not study.settings.claims:  # a claims study says it once, in its claims table
        lines += [f"- {s}" for s in sentences]
    lines += [f"- {n}" for n in notes]
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


def _pareto_lines(arms: pd.DataFrame, dest: Path) -> list[str]:
    """The Pareto fronts (bpb against FLOPs per token and against measured tokens/s), with their figures."""
    front_flops = pareto_front(arms.assign(m=arms["mean"].astype(float)), minimize=["m", "flops_per_token"])
    front_speed = pareto_front(arms.assign(m=arms["mean"].astype(float)), minimize=["m"], maximize=["tokens_per_s"])
    figures.pareto_scatter(arms, "flops_per_token", "training FLOPs per token", front_flops, dest / "pareto_flops.png")
    figures.pareto_scatter(arms, "tokens_per_s", "training tokens / s", front_speed, dest / "pareto_speed.png")
    return ["## Pareto fronts", "",
            "Arms not dominated in (validation bpb ↓, FLOPs per token ↓): " + ", ".join(arms[front_flops.values]["arm"]) + ".", "",
            "![bpb vs FLOPs](pareto_flops.png)", "",
            "Arms not dominated in (validation bpb ↓, tokens/s ↑) — wall-clock on this machine: " + ", ".join(arms[front_speed.values]["arm"]) + ".", "",
            "![bpb vs tokens/s](pareto_speed.png)", ""]


def _throughput_lines(arms: pd.DataFrame, dest: Path) -> list[str]:
    """The capacity figure (several capacities only) and the measured throughput bars."""
    lines = []
    if arms[arms.variant != DENSE]["capacity"].nunique() > 1:
        figures.capacity_vs_bpb(arms, dest / "capacity.png")
        lines += ["## Capacity", "", "![capacity vs bpb](capacity.png)", ""]
    figures.throughput_bars(arms, dest / "throughput.png")
    return lines + ["## Throughput", "", "Measured training throughput: tokens/s of each arm's fastest seed (other processes "
                    "can only slow a run down); FLOPs are analytic (see modbench.model.flops).", "",
                    "![throughput](throughput.png)", ""] + _throughput_caveat(arms)


def _throughput_caveat(arms: pd.DataFrame, tolerance: float = SPEED_SPREAD_TOLERANCE) -> list[str]:
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


def _causal_section(data: ReportData) -> list[str]:
    cols = ["val/causal_gap", "val/dense_gap", "val/causal_agreement", "val/causal_fraction", "val/topk_leak_rate"]
    present = [c for c in cols if c in data.done]
    routed = data.done[data.done.variant != DENSE]
    if not present or routed.empty:
        return []
    t = routed.groupby("arm")[present].mean().reset_index()
    return ["## Train/inference gap", "",
            "bpb under the causal decode-time rule and with MoD switched off, minus the training-time top-k bpb "
            "(means over seeds); agreement of the causal rule with top-k membership; realised causal fraction; "
            "top-k leak rate (how often future tokens change a past routing decision).", "", md_table(t), ""]


def _routing_section(data: ReportData, dest: Path, uri: str, progress: bool = False) -> list[str]:
    """Routing measured on each arm's first-seed checkpoint, fetched from the trial's MLflow run."""
    from tqdm.auto import tqdm

    from modbench.track.records import read_record

    routed = data.done[data.done.variant != DENSE].sort_values("seed")
    if routed.empty:
        return []
    positions, classes, overlaps = [], [], []
    heatmap, heatmap_arm, heatmap_learned = None, None, False
    arms = routed.groupby("arm")
    for arm, g in tqdm(arms, total=arms.ngroups, desc="routing analysis", unit="arm", disable=not progress):
        run_id = g.iloc[0].get("mlflow_run_id")
        record = read_record(uri, run_id) if isinstance(run_id, str) else None
        got = _masks_of(uri, record) if record is not None else None
        if got is None:
            continue
        x, masks = got
        res = analyse_masks(x, masks)
        learned = g.iloc[0]["variant"] not in CONTROL_VARIANTS  # a learned router's picture, a random one's only if none
        if masks and (heatmap is None or (learned and not heatmap_learned)):  # redrawn from the checkpoint
            heatmap_learned = learned
            heatmap = figures.routing_heatmap([m[0] for m in masks], dest / "routing_heatmap.png",
                                              title=f"{arm}, seed {int(g.iloc[0]['seed'])}: positions processed under the top-k rule, one validation window")
            heatmap_arm = arm
        positions.append(res["positions"].assign(arm=arm))
        classes.append(res["classes"].assign(arm=arm))
        if len(res["overlap"]):
            overlaps.append({"arm": arm, "mean Jaccard between routed layers": res["overlap"]["jaccard"].mean()})
    if not positions:
        return ["## Routing", "", "No trial checkpoints were found, so routing could not be analysed.", ""]
    pos = pd.concat(positions)
    figures.routing_by_position(pos, dest / "routing_positions.png")
    cls = pd.concat(classes).groupby(["arm", "byte_class"])["rate"].mean().unstack()
    out = ["## Routing", "", "Measured on 16 fixed validation windows with each arm's first seed.", "",
           "![routing by position](routing_positions.png)", "",
           "Fraction of tokens processed, by byte class of the token (mean over routed layers):", "",
           cls.reset_index().pipe(md_table), ""]
    if overlaps:
        out += ["Overlap of the selected sets between routed layers (1 = the same tokens every layer):", "",
                md_table(pd.DataFrame(overlaps)), ""]
    if "val/hard_precision" in data.done:
        hard = data.done[data.done.variant != DENSE].groupby("arm")[["val/hard_precision", "val/hard_recall", "val/hard_base_rate"]].mean().reset_index()
        out += ["Routing against ground truth (arithmetic task: hard = answer digits of multiplications):", "", md_table(hard), ""]
    if heatmap is not None:
        out += [f"Processed positions on one validation window ({heatmap_arm}, first seed; drawn from its checkpoint):", "",
                "![routing heatmap](routing_heatmap.png)", ""]
    return out


def _masks_of(uri: str, record) -> tuple[np.ndarray, list[np.ndarray]] | None:
    """A run's input bytes and routing masks: from its checkpoint, else from the masks a GPU slot
    computed for a checkpoint its archive could not hold (``MASKS_TAG``), else None."""
    from modbench.track.records import fetch_artifact, fetch_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        if record.checkpoint:
            x, masks, _ = selection_masks(fetch_checkpoint(uri, record, Path(tmp)))
            return x, masks
        if record.tags.get(MASKS_TAG):
            return load_masks(fetch_artifact(uri, record.run_id, record.tags[MASKS_TAG], Path(tmp)))
    return None


def _finish(lines: list[str], data: ReportData, dest: Path, study_path, command: str | None) -> Path:
    lines += _environment_lines(data, study_path) + _reproduce_lines(study_path, command)
    path = dest / "report.md"
    text = "\n".join(lines)
    path.write_text(text)
    _log_on_parent_run(data, dest)
    return path


REPORTED_PACKAGES = ("numpy", "scipy", "pandas", "statsmodels", "matplotlib", "mlflow", "optuna", "modbench")


def _package_versions() -> dict[str, str]:
    """Versions of the packages that computed and drew this report (importlib.metadata)."""
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for name in REPORTED_PACKAGES:
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = "not installed"
    return out


def git_sha_line(shas: list[str]) -> str:
    """The commit the trials ran from; a ``-dirty`` sha (uncommitted changes) or several commits
    are said plainly, since then no single commit reproduces the numbers."""
    shas = sorted({s for s in shas if isinstance(s, str) and s}) or ["n/a"]
    dirty = [s for s in shas if s.endswith("-dirty")]
    text = ", ".join(shas)
    if len(shas) > 1:
        text += f" (**the trials ran from {len(shas)} different commits**)"
    if dirty:
        text += " (**uncommitted changes**: no commit reproduces these numbers exactly; rerun from a clean tree)"
    return text


def _environment_lines(data: ReportData, study_path) -> list[str]:
    import torch

    tags = data.tags
    shas = data.done["git_sha"].tolist() if "git_sha" in data.done else [tags.get("git_sha", "n/a")]
    env = {
        "device": tags.get("device", "n/a"),
        "git sha (trials)": git_sha_line(shas),
        "torch (trials)": tags.get("torch_version", torch.__version__),
        "python (trials)": tags.get("python_version", platform.python_version()),
        **{f"{name} (report)": v for name, v in _package_versions().items()},
        "dataset": data.study.base.train.dataset,
        "dataset sha256": tags.get("dataset_sha256", "n/a"),
        "study file": _portable(str(study_path)),
        "study file sha256": data.study.file_sha256,
        "Optuna storage": redact(_portable(data.storage)),
    }
    return ["## Environment", "", pd.DataFrame({"": list(env), "value": list(env.values())}).to_markdown(index=False), ""]


def _reproduce_lines(study_path, command: str | None) -> list[str]:
    """The *Reproduce* block: the commands that rebuild this report. ``command`` is those lines as
    ``modbench report`` writes them (modbench.cli.common.study_command: the store flags it used, a
    password as a reference to an environment variable, no machine path); else the plain commands."""
    commands = command or f"modbench study run {study_path}\nmodbench report {study_path}"
    return ["## Reproduce", "", "```bash", *(_portable(line) for line in commands.splitlines()), "```", "",
            "Data: `trials.csv` (every trial), `arms.csv`, `comparisons.csv`, `curves.csv` beside this file.", ""]


def _log_on_parent_run(data: ReportData, dest: Path) -> None:
    """The report (markdown, figures, CSVs, summary.json) as artifacts of the study's MLflow parent
    run, under report/: whoever opens the study in the MLflow UI finds its report there."""
    from mlflow.tracking import MlflowClient

    from modbench.track.optuna_store import parent_run_id

    run_id = parent_run_id(data.study.name, data.storage)
    if run_id is not None and data.uri is not None:
        MlflowClient(data.uri).log_artifacts(run_id, str(dest), artifact_path="report")


def _portable(text: str) -> str:
    """Paths under the working directory written relative to it: reports travel between machines."""
    cwd = str(Path.cwd().resolve())
    return text.replace(cwd + "/", "")


def command_line() -> str:
    """This command as typed, with no machine path in it: an absolute path is written relative to
    the working directory when it lies under it, else by its last component alone."""
    return "modbench " + " ".join(shlex.quote(_path_free(a)) for a in sys.argv[1:])


def _path_free(arg: str) -> str:
    scheme = "sqlite:///" if arg.startswith("sqlite:////") else ""  # an SQLite URL's absolute path
    rest = arg[len(scheme):]
    if not rest.startswith("/"):
        return arg
    path, cwd = Path(rest).resolve(), Path.cwd().resolve()
    return scheme + (str(path.relative_to(cwd)) if path.is_relative_to(cwd) else path.name)
