"""Plain-language sentences from the statistics of ``modbench.report.stats``.

The summary of a report is generated, never hand-written: :func:`describe_comparison` turns one
arm-vs-baseline row into a sentence that states the difference, the effect size, both tests
with their corrected p-values, and — when the seeds given cannot reach significance — says so.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, is_dataclass
from typing import Any

import pandas as pd

from modbench.report.stats import CORRECTION_NAMES, _num


def _ptext(label: str, p: float) -> str:
    return f"{label} p < 0.001" if p < 0.001 else f"{label} p = {_num(p)}"


def _get(row: Any, key: str, default: Any = None) -> Any:
    if is_dataclass(row) and not isinstance(row, type):
        row = asdict(row)
    value = row.get(key, default) if isinstance(row, (Mapping, pd.Series)) else getattr(row, key, default)
    if isinstance(value, float) and math.isnan(value):
        return None
    return value


def describe_comparison(row, unit: str | None = None, lower_is_better: bool | None = True) -> str:
    """One plain-language sentence from a :func:`compare_to_baseline` row (Series, dict or
    :class:`Comparison`). ``unit`` defaults to the metric name; with ``lower_is_better=None``
    the direction is stated as lower/higher instead of better/worse. Never contains 'nan'.
    """
    arm, base = _get(row, "arm"), _get(row, "baseline")
    n1, n2 = int(_get(row, "n_arm", 0)), int(_get(row, "n_base", 0))
    unit = _get(row, "metric", "") if unit is None else unit
    diff = _get(row, "mean_diff")
    alpha = _get(row, "alpha", 0.05)
    corr = CORRECTION_NAMES.get(_get(row, "correction", "holm"), "adjusted")
    sizes = f"n = {n1} vs {n2}"
    note = _get(row, "note") or ""

    if diff is None:
        return f"{arm} vs {base}: {note or 'no comparison possible'} ({sizes})."
    if diff == 0:
        head = f"{arm} has the same mean {unit} as {base}".replace("  ", " ")
    else:
        if lower_is_better is None:
            word = "lower" if diff < 0 else "higher"
        else:
            word = "better" if (diff < 0) == lower_is_better else "worse"
        head = f"{arm} is {_num(abs(diff), 3)}{' ' + unit if unit else ''} {word} than {base}"

    welch_p, mwu_p = _get(row, "welch_p"), _get(row, "mwu_p")
    if welch_p is None and mwu_p is None:
        return f"{head} ({sizes}); {note or 'no test possible'}."
    parts = []
    g = _get(row, "hedges_g")
    if g is not None:
        parts.append(f"Hedges' g = {_num(g)}")
    for label, p, p_adj in (
        ("Welch", welch_p, _get(row, "welch_p_adj")),
        ("Mann\u2013Whitney", mwu_p, _get(row, "mwu_p_adj")),
    ):
        if p is None:
            continue
        text = _ptext(label, p)
        if p_adj is not None:
            text += f", {corr}-adjusted " + ("< 0.001" if p_adj < 0.001 else _num(p_adj))
        parts.append(text)
    parts.append(sizes)
    sentence = f"{head} ({'; '.join(parts)})"

    if not _get(row, "can_reach_significance", False):
        best, raw = _get(row, "mwu_min_p_adj"), _get(row, "mwu_min_p")
        sentence += (
            f"; cannot reach significance with {sizes} "
            f"(minimum Mann\u2013Whitney p = {_num(raw)}"
            + (f", {corr}-adjusted {_num(best)}" if best is not None and best != raw else "")
            + ")"
        )
        welch_adj = _get(row, "welch_p_adj")
        if welch_adj is not None and welch_adj <= alpha:
            sentence += ", so the Welch result rests on the normality assumption alone"
    else:
        sig = [
            name for name, key in (("Welch", "welch_p_adj"), ("Mann\u2013Whitney", "mwu_p_adj"))
            if _get(row, key) is not None and _get(row, key) <= alpha
        ]
        if sig:
            sentence += f"; significant at \u03b1 = {_num(alpha)} after {corr} correction ({' and '.join(sig)})"
        else:
            sentence += f"; not significant at \u03b1 = {_num(alpha)} after {corr} correction"
    if welch_p is None and "zero variance" in note:
        sentence += "; zero variance in both groups"
    return sentence + "."
