"""One trial data-parallel under torchrun: the same losses as one process on the same global batch.

Each DDP run is the real command (``torchrun --standalone --nproc_per_node=2 --no-python modbench
train ...``, gloo on CPU: torchrun launching the installed console script). Its per-step training metrics
come from where train records them — the MLflow metric history in a temporary store for the
tracked run, the checkpoint's ``history`` (the same rows) for the untracked ones, which skip
MLflow's start-up — and are compared with the history of an in-process single-process run
of the same config. The two differ only in float rounding: half-batch matmuls, the gradient
all-reduce and the mean of two slice means.

Variants left out, and why they cannot match: ``random`` draws its scores from each rank's
global RNG, so rank 1 repeats rank 0's draws instead of continuing the single-process
stream; ``learned_temperature``'s balance loss (mean p − C)² is not linear in the batch, so
the mean of the per-slice losses is not the global-batch loss.
"""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from mlflow.tracking import MlflowClient

from modbench.cli.main import main
from modbench.config.model import ModelConfig, RoutingConfig
from modbench.data import make_arithmetic
from modbench.config.run import RunConfig, TrainConfig
from modbench.run.train import train

REPO = Path(__file__).resolve().parents[1]
RTOL = 1e-4  # measured: at most ~2e-7 relative on this machine (rounding only)

MODEL = dict(depth=2, n_embd=64, head_dim=16, max_seq_len=64)
# tokens=8192 is a global-token budget: 16 steps of 8 × 64 tokens at any world size.
TRAIN = dict(seq_len=64, batch_size=8, budget="tokens=8192", eval_every=8, log_every=2,
             eval_windows=8, lr=3e-3, seed=0)


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    """Temp dir of the module: one MLflow store (its schema is created once) and the corpus."""
    root = tmp_path_factory.mktemp("ddp")
    # 100 kB of arithmetic lines as a file corpus: memory-mapped at once by every process,
    # where the 2 MB `arithmetic` dataset would be generated anew by each.
    (root / "arith.txt").write_bytes(make_arithmetic(0, 100_000)[0].tobytes())
    return root


def flags(store: Path, variant: str, capacity: float) -> list[str]:
    items = {**MODEL, **TRAIN, "dataset": store / "arith.txt", "variant": variant, "capacity": capacity}
    return [arg for k, v in items.items() for arg in (f"--{k.replace('_', '-')}", str(v))]


def config(store: Path, variant: str, capacity: float) -> RunConfig:
    train_cfg = TrainConfig(**TRAIN, dataset=str(store / "arith.txt"), track=False, out_dir=str(store / f"single-{variant}"))
    return RunConfig(ModelConfig(**MODEL), RoutingConfig(variant, capacity), train_cfg)


def torchrun(store: Path, argv: list[str]) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(MLFLOW_TRACKING_URI=f"sqlite:///{store}/mlflow.db", OMP_NUM_THREADS="1")
    # The command a user types: torchrun launching the installed console script (--no-python).
    script = Path(sys.executable).with_name("modbench")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "--no-python",
           str(script), "train", *argv]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


@pytest.fixture
def one_thread():
    # The reference runs beside nothing else; one thread, like each torchrun worker, is faster
    # on a busy 2-core machine and changes nothing but rounding.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def logged_rows(store: Path, summary: dict, keys: list[str], tracked: bool) -> dict[str, list[tuple[int, float]]]:
    """(step, value) of each metric, as the DDP run recorded it."""
    if tracked:
        client = MlflowClient(f"sqlite:///{store}/mlflow.db")
        return {k: [(m.step, m.value) for m in client.get_metric_history(summary["run_id"], k)] for k in keys}
    history = torch.load(summary["checkpoint"], weights_only=False)["history"]
    return {k: [(h["step"], h[k]) for h in history if k in h] for k in keys}


@pytest.mark.parametrize("variant,capacity,tracked", [("dense", 1.0, True), ("norm", 0.5, False), ("sigmoid", 0.5, False)])
def test_two_processes_follow_the_single_process_loss_trajectory(store, one_thread, variant, capacity, tracked):
    experiment = f"ddp-{variant}"
    proc = torchrun(store, [*flags(store, variant, capacity), "--quiet", "--experiment", experiment,
                            "--out-dir", str(store / experiment), "--track" if tracked else "--no-track"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    summaries = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(summaries) == 1, proc.stdout  # rank 0 alone prints
    ddp = summaries[0]

    single = train(config(store, variant, capacity), progress=False)
    assert ddp["steps"] == single.steps == 16 and ddp["tokens"] == single.tokens

    if tracked:
        client = MlflowClient(f"sqlite:///{store}/mlflow.db")
        exp = client.get_experiment_by_name(experiment)
        assert len(client.search_runs([exp.experiment_id])) == 1  # rank 0 alone tracks
    ref_rows = [h for h in single.history if "train/loss" in h]
    keys = ["train/loss", "train/grad_norm"] + [k for k in ref_rows[0] if k.startswith(("train/aux/", "route/"))]
    if variant == "sigmoid":
        assert "train/aux/router_bce" in keys
    logged = logged_rows(store, ddp, [*keys, "val/bpb"], tracked)
    worst = {}
    for key in keys:
        assert [step for step, _ in logged[key]] == [h["step"] for h in ref_rows] == list(range(2, 17, 2))
        ref = [h[key] for h in ref_rows]
        got = [value for _, value in logged[key]]
        assert got == pytest.approx(ref, rel=RTOL, abs=1e-6), key
        worst[key] = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(got, ref))
    print(f"{variant}: max relative difference {worst}")  # shown with pytest -s
    # Evaluation: mid-run (rank 0) and final, on the whole eval set as one process does it.
    ref_val = [(h["step"], h["val/bpb"]) for h in single.history if "val/bpb" in h]
    assert [s for s, _ in logged["val/bpb"]][:1] == [s for s, _ in ref_val] == [8]
    assert logged["val/bpb"][0][1] == pytest.approx(ref_val[0][1], rel=RTOL)
    assert ddp["val/bpb"] == pytest.approx(single.val["bpb"], rel=RTOL)
    assert ddp["test/bpb"] == pytest.approx(single.test["bpb"], rel=RTOL)
    # The record's checkpoint: the MLflow artifact of a tracked run, the local file of an untracked one.
    assert (ddp["checkpoint"] == "checkpoint/checkpoint.pt" if ddp["run_id"] else Path(ddp["checkpoint"]).is_file())
    assert math.isfinite(ddp["val/bpb"])


def test_batch_not_divisible_by_the_processes_is_one_line_exit_2(store, tmp_cwd, capsys, monkeypatch):
    # What each torchrun worker sees; the check runs before any process waits for another.
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    rc = main(["train", *flags(store, "dense", 1.0), "--batch-size", "7", "--quiet"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1
    assert "train.batch_size 7 is the global batch and must be divisible by the 2 torchrun processes" in err
    assert "6 or 8" in err
    assert not (tmp_cwd / "mlflow.db").exists() and not (tmp_cwd / "runs").exists()


def test_under_torchrun_the_error_is_printed_once(store):
    proc = torchrun(store, [*flags(store, "dense", 1.0), "--batch-size", "7", "--quiet", "--out-dir", str(store / "bad")])
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.splitlines() if line.startswith("modbench: error:")]
    assert len(lines) == 1 and "must be divisible by the 2 torchrun processes" in lines[0]
    assert not (store / "bad").exists()
