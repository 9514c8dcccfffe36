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
    import psutil

    leftover = [p for p in psutil.Process().children(recursive=True) if "modbench.track.background" in p.cmdline()]
    assert not leftover  # the tracker process that found the store read-only has exited


def test_a_full_disk_at_a_checkpoint_keeps_the_previous_one_and_leaves_no_partial_file(tmp_cwd, capsys, monkeypatch):
    real_save = torch.save
    saves = []

    def save_until_full(obj, path, *a, **kw):
        saves.append(path)
        if len(saves) >= 2:  # the second checkpoint finds the disk full, part-way through
            (path.write if hasattr(path, "write") else Path(path).write_bytes)(b"partial")
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


def test_a_study_whose_mlflow_store_refuses_is_not_left_half_created(tmp_cwd, capsys):
    import optuna

    smoke = (Path(__file__).resolve().parents[1] / "studies" / "smoke.toml").read_text()
    path = tmp_cwd / "allornone.toml"
    path.write_text(smoke.replace('name = "smoke"', 'name = "allornone"').replace("seeds = [0, 1]", "seeds = [0]"))
    assert main(["train", "--dataset", "arithmetic", "--budget", "steps=1", "--depth", "1", "--n-embd", "16",
                 "--head-dim", "8", "--max-seq-len", "16", "--seq-len", "16", "--batch-size", "2", "--quiet"]) == 0
    capsys.readouterr()
    read_only = f"sqlite:///file:{tmp_cwd}/mlflow.db?mode=ro&uri=true"
    assert main(["study", "run", str(path), "--quiet", "--tracking-uri", read_only]) == 2
    assert "refused to start a run" in one_line(capsys.readouterr().err)
    storage = f"sqlite:///{tmp_cwd}/runs/studies/allornone/optuna.db"
    assert "allornone" not in [s.study_name for s in optuna.get_all_study_summaries(storage)]  # nothing half-made
    assert main(["study", "run", str(path), "--quiet"]) == 0  # the re-run creates it afresh, at once
    (summary,) = optuna.get_all_study_summaries(storage)
    assert summary.n_trials == 2
