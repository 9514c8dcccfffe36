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
