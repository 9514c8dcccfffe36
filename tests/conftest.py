import os
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"
TINY_SHAKESPEARE = SHARED / "data" / "tinyshakespeare.txt"

torch.set_num_threads(min(2, os.cpu_count() or 1))


@pytest.fixture
def tmp_cwd(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.fixture(autouse=True)
def _isolated_mlflow(monkeypatch):
    """Keep MLflow's process-global tracking URI from leaking between tests.

    ``mlflow.set_tracking_uri`` sets a module global that beats the environment variable in
    the fluent API, and exports MLFLOW_TRACKING_URI so that subprocesses inherit it: a test
    that calls it would send later tests' runs (and their workers') to its own store.
    """
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    yield
    if "mlflow" in sys.modules:
        sys.modules["mlflow"].set_tracking_uri(None)  # also unsets the exported variable


@pytest.fixture
def one_training_step():
    """``step(build)``: seed 3, ``build()`` a GPT, one AdamW step on a random batch (LM + weighted aux
    losses); returns (the parameters after the step, the loss). Two calls compare bit for bit."""

    def step(build) -> tuple[torch.Tensor, float]:
        torch.manual_seed(3)
        m = build()
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
        idx = torch.randint(0, 256, (2, m.cfg.max_seq_len))
        out = m(idx, idx)
        (out.loss + m.weighted_aux_loss(out.aux_losses, 0)).backward()
        opt.step()
        return torch.nn.utils.parameters_to_vector(m.parameters()).detach(), out.loss.item()

    return step
