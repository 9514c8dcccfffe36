"""What a report measures on the trained models themselves: decode costs and routing masks.

These are the only numbers of a report that need the trials' checkpoints (fetched from their
MLflow runs), so they are measured once, when the report is first built from the study's store,
and saved beside it (``modbench.report.data_files``); a re-render reads them back instead of the
checkpoints. Everything else a report says is computed from the trials (``modbench.report.sections``).

- ``decode_costs``: per compared arm, ``modbench.report.decode_costs.measure_checkpoint`` on its
  first compared seed's checkpoint;
- ``routing``: per routed arm (its first seed), the processing rate by position and by byte class
  and the overlap between routed layers (``modbench.report.routing_analysis``) on 16 fixed
  validation windows, and one window's per-layer masks for the heatmap.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from modbench.design.vocabulary import CONTROL_VARIANTS, DENSE
from modbench.report.decode_costs import measure_arms
from modbench.report.routing_analysis import MASKS_TAG, analyse_masks, load_masks, selection_masks


@dataclass
class RoutingData:
    """The routing analysis of a study's routed arms (each on its first seed)."""
    positions: pd.DataFrame  # arm, layer, bucket, rate
    classes: pd.DataFrame  # arm, layer, byte_class, rate, share_of_tokens
    overlaps: pd.DataFrame  # arm, mean Jaccard between routed layers
    heatmap: list[np.ndarray] = field(default_factory=list)  # one validation window's mask per routed layer
    heatmap_arm: str | None = None
    heatmap_title: str = ""


@dataclass
class Measurements:
    """What a report measured on the trials' checkpoints (empty where none was found)."""
    decode_costs: pd.DataFrame = field(default_factory=pd.DataFrame)
    routing: RoutingData | None = None
    routing_missing: str = "No trial checkpoints were found, so routing could not be analysed."  # why routing is None


def measure(done: pd.DataFrame, compared: pd.DataFrame, uri: str | None, progress: bool = False) -> Measurements:
    """Decode costs of the ``compared`` trials' arms and the routing analysis of ``done``'s routed arms."""
    return Measurements(measure_arms(uri, compared), routing_data(done, uri, progress) if uri else None)


def routing_data(done: pd.DataFrame, uri: str, progress: bool = False) -> RoutingData | None:
    """Routing measured on each routed arm's first-seed checkpoint, fetched from the trial's MLflow run;
    None when no routed arm has a checkpoint (or its masks)."""
    from tqdm.auto import tqdm

    from modbench.track.records import read_record

    routed = done[done.variant != DENSE].sort_values("seed")
    positions, classes, overlaps = [], [], []
    heatmap, heatmap_arm, heatmap_title, heatmap_learned = [], None, "", False
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
        if masks and (heatmap_arm is None or (learned and not heatmap_learned)):
            heatmap_learned, heatmap_arm = learned, arm
            heatmap = [np.asarray(m[0]) for m in masks]
            heatmap_title = (f"{arm}, seed {int(g.iloc[0]['seed'])}: positions processed under the top-k rule, "
                             "one validation window")
        positions.append(res["positions"].assign(arm=arm))
        classes.append(res["classes"].assign(arm=arm))
        if len(res["overlap"]):
            overlaps.append({"arm": arm, "mean Jaccard between routed layers": res["overlap"]["jaccard"].mean()})
    if not positions:
        return None
    return RoutingData(pd.concat(positions, ignore_index=True), pd.concat(classes, ignore_index=True),
                       pd.DataFrame(overlaps, columns=["arm", "mean Jaccard between routed layers"]),
                       heatmap, heatmap_arm, heatmap_title)


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
