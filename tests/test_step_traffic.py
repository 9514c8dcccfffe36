"""tools/step_traffic.py: its byte counter counts what an eager kernel reads and writes (views and
aliases nothing, an in-place op its tensor twice, a matmul's bytes left to its FLOPs), and a step
counted at two smaller batches and extrapolated is the step at the study's batch."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from modbench.design.study_file import load_study

REPO = Path(__file__).resolve().parents[1]
DRY = REPO / "tests" / "studies" / "slot_dry.toml"


def _tool():
    spec = importlib.util.spec_from_file_location("step_traffic", REPO / "tools" / "step_traffic.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass resolves its annotations through the module
    spec.loader.exec_module(module)
    return module


def test_the_byte_counter_counts_inputs_and_outputs_of_data_moving_ops_only():
    tool = _tool()
    x, w = torch.ones(1000), torch.ones(8, 16)

    def work():
        y = x * 2 + 1          # mul, add: 4,000 B read and 4,000 B written each
        y.view(10, 100)        # a view: nothing
        y.add_(1)              # in place: y read and written
        w @ torch.ones(16, 4)  # a matmul: its FLOPs, not its bytes (the ones() is a fill: 256 B written)

    c = tool.counted(work)
    assert c.bytes["mul"] == 8000 and c.bytes["add"] == 8000 and c.bytes["add_"] == 8000
    assert "view" not in c.bytes and "mm" not in c.bytes
    assert c.bytes["ones"] == 16 * 4 * 4
    assert c.flops == 2 * 8 * 16 * 4


def test_a_step_counted_at_two_smaller_batches_and_extrapolated_is_the_step_at_the_studys_batch():
    tool = _tool()
    study = load_study(DRY)
    full, batch = tool.arm_count(study, "dense", 4)  # counted at the study's own batch
    small, _ = tool.arm_count(study, "dense", 2)     # at 1 and 2, extrapolated to 4
    assert batch == 4 == study.base.train.batch_size
    assert small.flops == pytest.approx(full.flops, rel=1e-9)
    assert sum(small.bytes.values()) == pytest.approx(sum(full.bytes.values()), rel=0.002)
    assert full.flops > 0 and full.bytes["_to_copy"] > 0  # autocast's casts are traffic


def test_an_unknown_arm_is_one_line_and_exit_2():
    r = subprocess.run([sys.executable, str(REPO / "tools" / "step_traffic.py"), str(DRY), "--arms", "nope"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "'nope' is not an arm of slot_dry" in r.stderr and "Traceback" not in r.stderr
