"""The GPU decode bench (``modbench.bench.gpu_decode``, issue 38 item 4) runs end to end on the CPU.

Its ``--dry-run`` is the very command a lent GPU runs, on a tiny fp32 model: every decoder of
``generate`` (the old dynamic decoder, the static step eager and compiled, masked and under
``torch.cond`` or split at its branches; the CUDA graphs recorded as not available here, the split steps'
pieces run eagerly) at two batch sizes, for dense and sigmoid, written as markdown and JSON with the
environment. So the prepared command cannot rot between GPU sessions.
"""

from __future__ import annotations

import json

import torch

from modbench.bench import gpu_decode
from modbench.track.provenance import git_sha


def test_dry_run_writes_every_cell(tmp_path, capsys):
    assert gpu_decode.main(["--dry-run", "--out", str(tmp_path), "--rounds", "1"]) == 0
    record = json.loads((tmp_path / "decode-static-dry.json").read_text())
    md = (tmp_path / "decode-static-dry.md").read_text()
    assert record["dry_run"] and record["environment"]["torch"] == torch.__version__
    assert record["environment"]["device"].startswith("cpu") and record["environment"]["python"]
    assert f"commit {git_sha()}" in md and record["environment"]["commit"] == git_sha()  # the code it timed
    cells = {(c["variant"], c["batch"], c["step"]): c for c in record["cells"]}
    assert set(cells) == {(v, b, s) for v in ("dense", "sigmoid") for b in (1, 2) for s in gpu_decode.DEFAULT_STEPS
                          if v == "dense" or s not in gpu_decode.REFERENCE_STEPS}  # the yardstick: dense only
    # every decoder of generate is timed, and the reference decoder beside them
    assert set(gpu_decode.DEFAULT_STEPS) == set(gpu_decode.STEPS) | set(gpu_decode.REFERENCE_STEPS)
    for (variant, batch, step), c in cells.items():
        if step.endswith("graph") or step == "graph-cond":
            assert c["error"].startswith("n/a") and c["decode_tokens_per_s"] is None
            continue
        assert c["error"] is None, c
        assert c["decode_tokens_per_s"] > 0 and len(c["rounds"]) == 1
        assert (c["processed_share"] is None) == (variant == "dense")
        if variant == "sigmoid":
            assert 0.0 < c["processed_share"] < 0.5  # routed layers moved to C = 0.125 (a tiny sample)
    assert "| 1 | static |" in md and "sigmoid ÷ dense" in md and "Speed-up of each static step" in md
    assert record["machine"]["peak_flops"] > 0 and record["machine"]["bandwidth"] > 0
    for (variant, batch, step), c in cells.items():  # the roofline of the routed cells: > 1 (routing can save)
        assert (c["roofline"] is None) == (variant == "dense" or c["error"] is not None)
        assert c["roofline"] is None or 1.0 < c["roofline"] < 8.0
    assert "Bars of issue 38" in md and "(H100: ≥ 1,400; not an H100)" in md and "the compiled reference (" in md
    assert md.count("| sigmoid | static-cond |") == 2  # one bar row per batch
    assert "| 2 | graph-cond |" in md and "Set-up (capture or compile" in md and "B2 compile-cond" in md
    # the split steps' pieces run eagerly in the dry run (``eager_piece``), so their code path is timed here too
    assert all(cells[v, b, s]["error"] is None for v in ("dense", "sigmoid") for b in (1, 2)
               for s in ("graph-split", "compile-split"))
    assert "B2 graph-split" in md and "pieces run eagerly" in md
    assert md.count("\n| ") >= 2 * 9 + 4 and "decode-static-dry.md" in capsys.readouterr().out


def test_a_failing_cell_is_recorded_and_the_rest_run(tmp_path, monkeypatch):
    """One cell's error (a compile failure, memory) is one line in its cell; the others are measured."""
    real = gpu_decode.measure

    def failing(model, size, cell, rounds, dry_run):
        if cell.step == "static":
            raise RuntimeError("out of memory\nsecond line")
        return real(model, size, cell, rounds, dry_run)

    monkeypatch.setattr(gpu_decode, "measure", failing)
    cells = gpu_decode.run(tmp_path, "t", variants=["dense"], steps=["dynamic", "static"], batches=(1,), rounds=1,
                           dry_run=True, log=lambda line: None)
    assert [c.error for c in cells] == [None, "RuntimeError: out of memory"]
    assert cells[0].decode_tokens_per_s > 0
    assert "error: RuntimeError: out of memory" in (tmp_path / "t.md").read_text()


def test_more_compiled_cells_than_dynamos_recompile_limit(tmp_path):
    """Each cell compiles its own decoder's step: twelve of them (the GPU run's count) pass Dynamo's limit of
    eight recompiles per code object unless each cell starts afresh; no cell may fail for it."""
    cells = gpu_decode.run(tmp_path, "t", variants=["dense", "sigmoid"], steps=["compile", "compile-cond"],
                           batches=(1, 2, 3), rounds=1, dry_run=True, log=lambda line: None)
    assert len(cells) == 12 and [c.error for c in cells] == [None] * 12
