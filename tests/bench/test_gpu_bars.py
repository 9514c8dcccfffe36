"""The GPU bars command (``modbench.bench.gpu_bars``, issue 38 items 3 and 4) runs end to end on the CPU.

Its ``--dry-run`` is the command a lent GPU runs, on tiny fp32 shapes: the routed block (sigmoid and
norm) and the model training step against their dense references, eager and compiled (Dynamo's
"eager" backend), the CUDA-graph cells recorded as not available here; written as markdown and JSON.
"""

from __future__ import annotations

import json

import pytest
import torch

from modbench.bench import gpu_bars
from modbench.track.provenance import git_sha


def test_dry_run_writes_every_cell(tmp_path, capsys):
    assert gpu_bars.main(["--dry-run", "--out", str(tmp_path)]) == 0
    record = json.loads((tmp_path / "bars-dry.json").read_text())
    md = (tmp_path / "bars-dry.md").read_text()
    assert record["dry_run"] and record["environment"]["torch"] == torch.__version__
    assert f"commit {git_sha()}" in md  # the code it timed
    assert record["bars"] == {"block_max_flop_multiple": 1.5, "model_min_efficiency": 0.9}
    cells = {(c["bar"], c["variant"], c["mode"]): c for c in record["cells"]}
    assert set(cells) == {(b, v, m) for m in gpu_bars.MODES
                          for b, vs in (("block", gpu_bars.BLOCK_VARIANTS), ("model", (gpu_bars.MODEL_VARIANT,)))
                          for v in vs}
    for (bar, variant, mode), c in cells.items():
        if mode == "cudagraphs":
            assert c["error"].startswith("n/a") and c["time_ratio"] is None
            continue
        assert c["error"] is None, c
        assert len(c["ratios"]) == gpu_bars.DRY.rounds and c["time_ratio"] == pytest.approx(sorted(c["ratios"])[1])
        assert c["time_ms"] > 0 and c["dense_ms"] > 0 and c["setup_s"] >= 0
        # a C = 0.125 block does about 12 % of the dense block's FLOPs; the alternate model about 60 %
        assert 0.05 < c["flop_ratio"] < (0.2 if bar == "block" else 0.8)
    assert "| block | sigmoid | compile |" in md and "FLOP ratio: " in md and "of the speed-up: " in md
    assert "bars-dry.md" in capsys.readouterr().out


def test_the_verdicts_apply_the_issue_bars():
    block = gpu_bars.Cell("block", "sigmoid", "cudagraphs", time_ratio=0.15, flop_ratio=0.109)
    assert block.verdict.startswith("1.38× FLOP ratio: met")
    assert gpu_bars.Cell("block", "sigmoid", "compile", time_ratio=0.335, flop_ratio=0.109).verdict.startswith("3.07×")
    assert "MISSED" in gpu_bars.Cell("block", "sigmoid", "compile", time_ratio=0.335, flop_ratio=0.109).verdict
    model = gpu_bars.Cell("model", "sigmoid", "compile", time_ratio=0.8, flop_ratio=0.616)
    assert model.verdict.startswith("77% of the speed-up: MISSED")
    assert "met" in gpu_bars.Cell("model", "sigmoid", "x", time_ratio=0.65, flop_ratio=0.616).verdict
    assert gpu_bars.Cell("model", "sigmoid", "x").verdict == "—"


def test_a_failing_cell_is_recorded_and_the_rest_run(tmp_path, monkeypatch):
    real = gpu_bars.measure

    def failing(cell, shape, device, dry_run):
        if cell.variant == "norm":
            raise RuntimeError("CUDA out of memory\nsecond line")
        return real(cell, shape, device, dry_run)

    monkeypatch.setattr(gpu_bars, "measure", failing)
    cells = gpu_bars.run(tmp_path, "t", bars=["block"], modes=["eager"], dry_run=True, log=lambda line: None)
    assert [(c.variant, c.error) for c in cells] == [("sigmoid", None), ("norm", "RuntimeError: CUDA out of memory")]
    assert cells[0].time_ratio > 0
    assert "error: RuntimeError: CUDA out of memory" in (tmp_path / "t.md").read_text()


@pytest.mark.parametrize("args", [["--bars", "block,speed"], ["--modes", "turbo"], ["--bars", ""]])
def test_bad_arguments_are_one_line_and_exit_2(args, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        gpu_bars.main(["--dry-run", "--out", str(tmp_path / "out"), *args])
    assert e.value.code == 2 and "expected a comma-separated list" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
