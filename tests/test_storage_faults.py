"""Storage that refuses to be written: one line, exit 2, and nothing finished is lost or corrupted."""

import errno
from pathlib import Path

import torch

from modbench.cli.main import main
from modbench.track import checkpoint as checkpoint_mod

ARGS = ["train", "--dataset", "arithmetic", "--depth", "2", "--n-embd", "32", "--head-dim", "16", "--max-seq-len", "32",
        "--seq-len", "32", "--batch-size", "4", "--eval-every", "100", "--eval-windows", "2"]


def one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("modbench: error: "), err
    return lines[0]


def test_a_read_only_mlflow_store_is_refused_before_training(tmp_cwd, capsys):
    assert main([*ARGS, "--budget", "steps=2", "--run-name", "first"]) == 0  # creates ./mlflow.db
    capsys.readouterr()
    uri = f"sqlite:///file:{tmp_cwd}/mlflow.db?mode=ro&uri=true"  # the same store, opened read-only
    assert main([*ARGS, "--budget", "steps=2", "--run-name", "second", "--tracking-uri", uri]) == 2
    line = one_line(capsys.readouterr().err)
    assert "readonly database" in line and "--tracking-uri" in line
    assert not list(Path("runs").glob("second*/checkpoint.pt"))  # nothing trained


def test_a_full_disk_at_a_checkpoint_keeps_the_previous_one_and_leaves_no_partial_file(tmp_cwd, capsys, monkeypatch):
    real_save = torch.save
    saves = []

    def save_until_full(obj, path, *a, **kw):
        saves.append(path)
        if len(saves) >= 2:  # the second checkpoint finds the disk full, part-way through
            Path(path).write_bytes(b"partial")
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(obj, path, *a, **kw)

    monkeypatch.setattr(checkpoint_mod.torch, "save", save_until_full)
    code = main([*ARGS, "--budget", "steps=4", "--checkpoint-every", "2", "--run-name", "full", "--no-track", "--quiet"])
    assert code == 2
    line = one_line(capsys.readouterr().err)
    assert "No space left on device" in line and "previous checkpoint is kept" in line
    (run_dir,) = Path("runs").glob("full*")
    assert not list(run_dir.glob("*.tmp"))  # no partial file left
    state = checkpoint_mod.load_checkpoint(run_dir / "checkpoint.pt")  # the first checkpoint, intact
    assert state["step"] == 2
