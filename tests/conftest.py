import os
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
