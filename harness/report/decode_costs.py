"""What each arm costs at decode time, measured on its trained checkpoint: KV bytes and KV-cached tokens/s.

The analytic side (decode FLOPs per token at the realised causal share) is ``modbench.model.sizing``;
this module runs the trained model. For one checkpoint per arm it feeds ``BATCH`` fixed test windows'
first halves as prompts and greedily generates the second halves with the KV cache
(``modbench.model.decode.generate``, the causal rule), and records:

- ``kv_bytes_per_token``: valid K/V bytes per fed token and sequence (``Decoder.kv_bytes``: the cache
  slots that hold a processed token, not the allocation) — what recursion-wise caching and recursive KV
  sharing (Bae et al. 2025, arXiv:2507.10524 §2.3) save, and what a skipped MoD token saves;
- ``decode_tokens_per_s``: the one-token steps alone (prefill excluded), median of ``ROUNDS`` generations
  after one warm-up, on one thread. At the widths a CPU study trains this is per-op dispatch more than
  FLOPs, so it orders the arms on this machine and nothing more;
- ``decode_share``: the share of routed-layer token computations the causal rule ran while decoding;
- ``params``: non-embedding parameters (a shared block counted once).
"""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path

import pandas as pd
import torch

from modbench.data import eval_windows, load_corpus
from modbench.model.decode import generate
from modbench.model.restore import model_from_state
from modbench.model.sizing import non_embedding_params
from modbench.track.checkpoint import load_checkpoint

BATCH = 8  # test windows decoded at once
ROUNDS = 3  # timed generations (after one warm-up); the median is reported
THREADS = 1  # torch threads while timing (restored after)

COLUMNS = ("params", "kv_bytes_per_token", "decode_tokens_per_s", "decode_share")


@torch.no_grad()
def measure_checkpoint(checkpoint: Path, *, batch: int = BATCH, rounds: int = ROUNDS) -> dict[str, float]:
    """The decode costs of one trained checkpoint (see the module docstring)."""
    model, cfg = model_from_state(load_checkpoint(checkpoint), str(checkpoint))
    corpus = load_corpus(cfg.train.dataset, seed=cfg.train.seed)
    x, _ = eval_windows(corpus.split("test"), cfg.train.seq_len, batch)
    prompt_len = cfg.train.seq_len // 2
    prompt, new = x[:, :prompt_len], cfg.train.seq_len - prompt_len
    threads = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    try:
        runs = [generate(model, prompt, new, mode="causal", temperature=0.0) for _ in range(rounds + 1)]
    finally:
        torch.set_num_threads(threads)
    last = runs[-1]
    return {"params": float(non_embedding_params(cfg.model, cfg.routing)),
            "kv_bytes_per_token": float(last.kv_bytes_per_token),
            "decode_tokens_per_s": float(statistics.median(g.decode_tokens_per_s for g in runs[1:])),
            "decode_share": 1.0 - float(last.skipped_fraction)}


def measure_arms(uri: str | None, compared: pd.DataFrame) -> pd.DataFrame:
    """One row per compared arm: ``measure_checkpoint`` on its first compared seed's checkpoint,
    fetched from the trial's MLflow run in ``uri`` (``compared``: the trials a report compares, with
    ``arm``, ``seed`` and ``mlflow_run_id``). Arms whose trial has no checkpoint are left out."""
    from modbench.track.records import fetch_checkpoint, read_record

    rows = []
    if not uri or compared.empty or "mlflow_run_id" not in compared:
        return pd.DataFrame(rows)
    for arm, g in compared.sort_values("seed").groupby("arm", sort=False):
        run_id = g.iloc[0]["mlflow_run_id"]
        record = read_record(uri, run_id) if isinstance(run_id, str) else None
        if record is None or not record.checkpoint:
            continue
        with tempfile.TemporaryDirectory() as tmp:
            costs = measure_checkpoint(fetch_checkpoint(uri, record, Path(tmp)))
        rows.append({"arm": arm, "seed": int(g.iloc[0]["seed"]), **costs})
    return pd.DataFrame(rows)
