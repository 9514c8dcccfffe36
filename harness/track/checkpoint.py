"""Checkpoints that resume a run exactly: weights, optimizer, step, RNG states, run id.

Written atomically (temp file + rename) so a run killed mid-save never leaves a checkpoint
that loads but is half-written. Read with ``torch.load(weights_only=True)``: a checkpoint is
tensors, numbers, strings and containers, so a crafted file (a pickle that would run code,
from a shared disk or a tracking server anyone can tag) is refused instead of executed.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from modbench.errors import ModbenchError


def save_checkpoint(path: Path, state: dict[str, Any]) -> None:
    """Write atomically; a disk that refuses (full, read-only, over quota) is one line, the previous
    checkpoint at ``path`` is kept intact and no partial file is left behind."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        _write(state, tmp)
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        kept = " (its previous checkpoint is kept)" if path.exists() else ""
        raise ModbenchError(f"cannot write the checkpoint {path} ({e.strerror or e}){kept}: free space or pick "
                            "another --out-dir, then --resume") from None
    except BaseException:  # Ctrl-C, or anything else mid-write: no partial file either
        tmp.unlink(missing_ok=True)
        raise


def _write(state: dict[str, Any], tmp: Path) -> None:
    """``torch.save`` through a file we opened, then flushed to the disk. Why not ``torch.save(state,
    tmp)``: given a path, torch writes with its own C++ writer, which reports a full disk as a
    RuntimeError ("unexpected pos …"), not as the OSError(ENOSPC) Python's file raises; and the
    fsync makes the disk refuse now, before the rename replaces the previous checkpoint."""
    with open(tmp, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())


def load_checkpoint(path: Path, *, run_id: str | None = None) -> dict[str, Any]:
    """The checkpoint's contents; with ``run_id``, it must be that MLflow run's checkpoint."""
    if not path.is_file():
        raise ModbenchError(f"no checkpoint at {path}: run without --resume first, or check --out-dir/--run-name")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise ModbenchError(f"checkpoint {path} cannot be read as a modbench checkpoint ({type(e).__name__}); "
                            "only plain tensors and values are loaded, never code: use a checkpoint modbench wrote") from None
    if run_id is not None and isinstance(state, dict) and state.get("run_id") != run_id:
        raise ModbenchError(f"checkpoint {path} was written by MLflow run {state.get('run_id')}, not {run_id}: "
                            "the run's checkpoint tag points to another run's file")
    return state


def check_writable(folder: Path, what: str) -> None:
    """Fail at the start, in one line, when ``folder`` cannot take files (not after training)."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / f".modbench-write-probe-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise ModbenchError(f"{what} {folder} is not writable ({e.strerror}): pick another folder") from None
