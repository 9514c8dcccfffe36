"""``modbench report``: a study's markdown report with statistics, tables and plots.

reports/<study>/report.md, its figures, summary.json and the data it was computed from. Four
steps, one module each, data flowing one way:

1. ``collect``: the study's trials (Optuna) and runs (MLflow) into pandas (``ReportData``);
2. ``measure``: what needs the trials' checkpoints (decode costs, routing masks);
3. ``sections``: every section's numbers (statistics from ``stats``, ``effects``, ``claims``);
4. ``render``: the markdown, and ``figures`` the figures, from those numbers.

``data_files`` saves steps 1–2's output beside the report, so ``rerender_report`` can run 3–4
again without the store: a committed report is re-rendered by ``modbench report STUDY --from-data
reports/STUDY``.
"""

from __future__ import annotations

import json
import platform
import shlex
import shutil
import sys
from pathlib import Path

import pandas as pd

from modbench.design.controls import study_arms
from modbench.design.study_file import StudySpec, find_study, load_study
from modbench.errors import redact
from modbench.report import data_files
from modbench.report.collect import ReportData, collect
from modbench.report.measure import Measurements, measure
from modbench.report.render import render
from modbench.report.sections import Sections, TuningTable, compared_rows, compute, summary_json, tuning_table

STUDY_COPY = "study.toml"  # the study file the trials ran, saved in the report's data folder


def build_report(study_path: str | Path, *, uri: str, storage: str | None = None, out_dir: str | Path = "runs/studies",
                 reports_dir: str | Path = "reports", command: str | None = None,
                 progress: bool = False, tuning: TuningTable | None = None) -> Path:
    """Write reports/<study>/report.md from the study's store. ``tuning``: the study runner's
    per-family tuning table (``modbench.study.tuning.family_table`` over the trials), rendered for
    a study with ``[tune]``."""
    study = load_study(study_path)
    data = collect(study, storage=storage, out_dir=out_dir, uri=uri, progress=progress)
    dest = Path(reports_dir) / study.name
    dest.mkdir(parents=True, exist_ok=True)
    table = tuning_table(data, tuning)
    measured = measure(data.done, compared_rows(data, table), uri, progress) if len(data.done) else Measurements()
    data_files.save(dest, data, measured, _portable(data.storage), command)
    shutil.copyfile(find_study(study_path), dest / data_files.DATA / STUDY_COPY)
    path = _write(study_path, compute(data, measured, table), dest, command)
    _log_on_parent_run(data, dest)
    return path


def rerender_report(study_path: str | Path, folder: str | Path, *, reports_dir: str | Path = "reports",
                    command: str | None = None, tuning: TuningTable | None = None) -> Path:
    """Compute and render a report again from the data a report saved in ``folder``, with no store:
    the study file the trials ran (saved beside it) when there is one, else ``study_path``."""
    folder = Path(folder)
    saved = folder / data_files.DATA / STUDY_COPY
    study = load_study(saved if saved.is_file() else study_path)
    data, measured = data_files.load(study, folder)
    dest = Path(reports_dir) / study.name
    dest.mkdir(parents=True, exist_ok=True)
    # the commands that made the numbers (a report that predates saving them: the plain ones), then
    # the one that rendered them again
    first = data_files.built_by(folder) or f"modbench study run {study_path}\nmodbench report {study_path}"
    command = f"{first}\n# rendered again from the saved data:\n{command or ''}".rstrip()
    data_files.save(dest, data, measured, data.storage, first)  # what was read, in this version's layout
    source, copy = find_study(saved if saved.is_file() else study_path), dest / data_files.DATA / STUDY_COPY
    if not copy.exists() or not copy.samefile(source):
        shutil.copyfile(source, copy)
    return _write(study_path, compute(data, measured, tuning_table(data, tuning)), dest, command)


def _write(study_path, s: Sections, dest: Path, command: str | None) -> Path:
    """report.md, its figures, CSVs and summary.json from the computed sections."""
    data = s.data
    lines = [f"# Study report: {data.study.name}", "", data.study.settings.description, ""] + _count_lines(data.study, data)
    if data.done.empty:
        lines += ["**No trial has finished yet**, so there is nothing to compare. Run `modbench study run` first.", ""]
        return _finish(lines, data, dest, study_path, command)
    lines += render(s, dest)
    _write_tables(s, dest)
    return _finish(lines, data, dest, study_path, command)


def _write_tables(s: Sections, dest: Path) -> None:
    """The computed sections' CSVs and summary.json."""
    d, c = s.diagnostics, s.claims
    d.arms.to_csv(dest / "arms.csv", index=False)
    if not d.comparisons.empty:
        d.comparisons.to_csv(dest / "comparisons.csv", index=False)
    if c is None:
        return
    c.arms.to_csv(dest / "arms_causal.csv", index=False)
    if len(c.effects):
        c.effects.to_csv(dest / "effects.csv", index=False)
    if c.isoflop is not None and len(c.isoflop.dense_fit):
        c.isoflop.fits.to_csv(dest / "isoflop_fits.csv", index=False)
    (dest / "summary.json").write_text(json.dumps(_plain(summary_json(c, s.data)), indent=2, allow_nan=False))


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


def _count_lines(study: StudySpec, data: ReportData) -> list[str]:
    """The trial count (what a staged study's stages queued so far, else what the grid plans), seeds,
    dataset and budget."""
    counts = data.trials.state.value_counts().to_dict() if len(data.trials) else {}
    if study.tune.lr_mult:  # a staged study plans as it goes (modbench.study.tuning): what its stages queued
        planned = f"{len(data.trials)} queued by its stages so far"
    else:
        planned = f"{(len(study_arms(study)) if study.settings.sampler == 'grid' else study.settings.n_trials) * len(study.settings.seeds)} planned"
    return [f"Trials: {counts.get('COMPLETE', 0)} complete of {planned}"
            + "".join(f", {n} {s.lower()}" for s, n in sorted(counts.items()) if s != "COMPLETE")
            + f"; {_seed_text(study)}; dataset `{study.base.train.dataset}`; "
            f"every arm trains for the same budget `{study.base.train.budget}`" + (" (per group)" if "budget" in study.space and len(study.space["budget"]) > 1 else "") + ".", ""]


def _seed_text(study: StudySpec) -> str:
    """Which seeds ran what: a tuned study tunes on one seed and confirms on the others."""
    seeds = study.settings.seeds
    if not study.tune.lr_mult:
        return f"seeds per arm: {len(seeds)}"
    confirm = [s for s in seeds if s != study.tune.seed]
    return (f"seed {study.tune.seed} tunes every family, {len(confirm)} confirmation seed{'s' * (len(confirm) != 1)} "
            f"({', '.join(map(str, confirm))}) run the compared arms")


def _finish(lines: list[str], data: ReportData, dest: Path, study_path, command: str | None) -> Path:
    lines += _environment_lines(data, study_path) + _reproduce_lines(study_path, command)
    path = dest / "report.md"
    path.write_text("\n".join(lines))
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
        "study file": _path_free(_portable(str(study_path))),  # no machine path, even for a file elsewhere
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
            "Data: `trials.csv` (every trial), `arms.csv`, `comparisons.csv`, `curves.csv` and `summary.json` beside this "
            "file; `data/` holds the rest of what the report was computed from (the runs' final metrics, the study "
            "file, the decode costs and routing measured on the checkpoints), so `modbench report STUDY --from-data "
            "<this folder>` computes and renders it again without the study's stores.", ""]


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
