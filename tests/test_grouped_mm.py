"""A mixture of experts in bf16 runs grouped GEMMs (``modbench.model.grouped_mm``): the same numbers as the
per-slice loop, no host read, and a FLOP count that sees the experts.

On a CPU the bf16 grouped kernel is torch's CPU one; what CUDA training runs is the same call under CUDA's
autocast, checked by the CUDA cases here when a GPU is present (``make gpu-decode-bench`` runs them first).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

import modbench.model.gpt as gpt
from modbench import variants
from modbench.config.model import ModelConfig, RoutingConfig
from modbench.model.gpt import GPT, TopOneMoE
from modbench.model.grouped_mm import ALIGN_ROWS, grouped_dtype, grouped_mlp, grouped_mm_flops, padded_layout, padded_rows

CFG = ModelConfig(depth=2, n_embd=64, head_dim=16, max_seq_len=64)
B, T = 2, 64
MIXTURES = sorted(v for v in variants.list_variants() if variants.build_router(v, 8).mlp_experts)


def _model(variant: str, device: str = "cpu") -> GPT:
    torch.manual_seed(0)
    m = GPT(CFG, RoutingConfig(variant, capacity=0.25, pattern="all")).train().to(device)
    for moe in _mixtures(m):  # a gate that spreads the tokens over every expert
        torch.nn.init.normal_(moe.gate.weight, std=0.5)
    return m


def _mixtures(m: GPT) -> list[TopOneMoE]:
    return [x for x in m.modules() if isinstance(x, TopOneMoE)]


def _step(m: GPT, idx: torch.Tensor):
    """A bf16-autocast training forward and backward: (logits, loss, each parameter's gradient)."""
    m.zero_grad(set_to_none=True)
    torch.manual_seed(5)
    with torch.autocast(idx.device.type, dtype=torch.bfloat16):
        out = m(idx, idx)
        loss = out.loss + m.weighted_aux_loss(out.aux_losses, 10**6)
    loss.backward()
    return out.logits.float(), loss.detach(), {n: p.grad for n, p in m.named_parameters() if p.grad is not None}


def _per_slice_only(monkeypatch) -> None:
    """Every mixture runs the full-precision path, the per-slice loop (what bf16 ran before the grouped kernel)."""
    monkeypatch.setattr(gpt, "grouped_dtype", lambda x: None)


def _no_per_slice(monkeypatch) -> None:
    def refuse(self, ranked, counts):
        raise AssertionError("the per-slice loop (a host read) ran under bf16")
    monkeypatch.setattr(TopOneMoE, "_per_slice", refuse)


def _assert_same_step(got, want, rtol: float, atol: float) -> None:
    torch.testing.assert_close(got[0], want[0], rtol=rtol, atol=atol)
    torch.testing.assert_close(got[1], want[1], rtol=rtol, atol=atol)
    assert got[2].keys() == want[2].keys()
    for name in want[2]:
        torch.testing.assert_close(got[2][name], want[2][name], rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")


def test_the_grouped_kernel_runs_exactly_in_bf16():
    x = torch.zeros(4, 8)
    assert grouped_dtype(x) is None
    assert grouped_dtype(x.bfloat16()) is torch.bfloat16
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert grouped_dtype(x) is torch.bfloat16
    with torch.autocast("cpu", dtype=torch.float16):
        assert grouped_dtype(x) is None  # the kernel's checks refuse fp16


@pytest.mark.parametrize("variant", MIXTURES)
def test_a_bf16_mixture_gives_the_per_slice_loops_numbers_without_a_host_read(variant, monkeypatch):
    """Logits, loss and every gradient of a bf16-autocast training step: grouped GEMMs against the loop of one
    matmul pair per expert slice, on a batch that uses every expert; the grouped run never enters the loop."""
    idx = torch.randint(0, CFG.vocab_size, (B, T), generator=torch.Generator().manual_seed(1))
    m = _model(variant)
    used: list[set[int]] = []

    def record(n: int):  # the gate's logits: the first n are the real experts'
        return lambda module, args, out: used.append(set(out[..., :n].argmax(-1).flatten().tolist()))

    hooks = [moe.gate.register_forward_hook(record(len(moe.experts))) for moe in _mixtures(m)]
    with monkeypatch.context() as patch:
        _per_slice_only(patch)
        loop = _step(m, idx)
    for hook in hooks:
        hook.remove()
    assert used and all(u == set(range(len(moe.experts))) for u, moe in zip(used, _mixtures(m)))
    with monkeypatch.context() as patch:
        _no_per_slice(patch)
        grouped = _step(m, idx)
    # bf16 matmuls accumulate in fp32 either way; CPU kernels agree to their last bits here (measured:
    # bit for bit), the bound leaves room for another BLAS's blocking
    _assert_same_step(grouped, loop, rtol=2e-2, atol=1e-3)


@pytest.mark.parametrize("variant", MIXTURES)
def test_flop_counter_counts_a_bf16_mixture_as_the_analytic_count_plus_its_padding(variant, monkeypatch):
    """Without ``grouped_mm_flops`` registered, FlopCounterMode counted the grouped GEMMs as nothing: a bf16
    step would spend its FLOP budget on attention and the gate alone. What it counts beyond the analytic
    count (which the full-precision step matches) is exactly the padding rows' work: each call's
    ``padded_rows`` − N rows through both matrices, forward and backward (3 × 2 × 2·d·r·d a row)."""
    m = _model(variant)
    idx = torch.randint(0, CFG.vocab_size, (B, T), generator=torch.Generator().manual_seed(2))
    calls: list[tuple[int, int]] = []

    def recording(x, counts, *args, **kwargs):
        calls.append((x.shape[0], counts.shape[0]))
        return grouped_mlp(x, counts, *args, **kwargs)

    monkeypatch.setattr(gpt, "grouped_mlp", recording)
    counted = {}
    for bf16 in (False, True):
        with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as fc, \
                torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            out = m(idx, idx)
            (out.loss + m.weighted_aux_loss(out.aux_losses, 10**6)).backward()
        counted[bf16] = fc.get_total_flops()
    assert len(calls) == len(_mixtures(m))  # (bf16 only: full precision runs the per-slice loop)
    analytic = B * m.flop_report(T, causal=False).total
    assert counted[False] == pytest.approx(analytic, rel=1e-9)
    d, hidden = CFG.width, CFG.mlp_ratio * CFG.width
    padding = sum(3 * 2 * 2 * d * hidden * (padded_rows(n, groups) - n) for n, groups in calls)
    assert padding > 0 and counted[True] == pytest.approx(analytic + padding, rel=1e-9)


def test_the_padded_layout_aligns_every_group_and_keeps_each_rows_order():
    """For splits with empty, aligned and ragged groups: each group starts at a multiple of ``ALIGN_ROWS`` and
    spans a multiple of it (at least one) that holds its rows, in order and contiguous from its start; the
    last group ends at ``padded_rows``, and no two rows share a place."""
    g = torch.Generator().manual_seed(4)
    splits = [[3, 0, 9, 8, 1], [0, 0, 5], [16], [0, 7], [1, 1, 1, 1]]
    splits += [torch.randint(0, 30, (int(torch.randint(1, 6, (1,), generator=g)),), generator=g).tolist()
               for _ in range(20)]
    for split in splits:
        counts = torch.tensor(split)
        rows = int(counts.sum())
        place, ends = padded_layout(counts, rows)
        starts = [0] + ends[:-1].tolist()
        assert ends[-1] == padded_rows(rows, len(split)) and ends.dtype == torch.int32
        assert len(set(place.tolist())) == rows
        first = 0
        for start, end, n in zip(starts, ends.tolist(), split):
            assert start % ALIGN_ROWS == 0 and end % ALIGN_ROWS == 0 and end - start >= max(n, 1)
            assert place[first:first + n].tolist() == list(range(start, start + n)), split
            first += n


@pytest.mark.parametrize("layout", ["2d x 3d", "3d x 3d", "2d x 2d"])
def test_grouped_mm_flops_is_one_matmul_per_group(layout):
    """The registered formula against FlopCounterMode's count of the same products done one group at a time,
    for each operand layout the kernel takes (the forward's 2-D × 3-D, its weight gradient's 2-D × 2-D)."""
    g = torch.Generator().manual_seed(3)
    sizes = [3, 0, 9, 4]
    ends = torch.tensor(sizes).cumsum(0)
    offs = ends.to(torch.int32)
    starts = [int(e) - s for e, s in zip(ends, sizes)]
    bf = dict(dtype=torch.bfloat16)
    if layout == "2d x 3d":
        a, b = torch.randn(16, 24, generator=g).to(**bf), torch.randn(4, 24, 8, generator=g).to(**bf)
        pieces = [(a[s:s + n], b[e]) for e, (s, n) in enumerate(zip(starts, sizes))]
    elif layout == "3d x 3d":
        a, b, offs = torch.randn(4, 5, 24, generator=g).to(**bf), torch.randn(4, 24, 8, generator=g).to(**bf), None
        pieces = [(a[e], b[e]) for e in range(4)]
    else:
        a, b = torch.randn(24, 16, generator=g).to(**bf), torch.randn(16, 8, generator=g).to(**bf)
        pieces = [(a[:, s:s + n], b[s:s + n]) for s, n in zip(starts, sizes)]
    with FlopCounterMode(display=False) as grouped:
        out = F.grouped_mm(a, b, offs=offs)
    with FlopCounterMode(display=False) as looped:
        want = [x @ y for x, y in pieces]
    assert grouped.get_total_flops() == looped.get_total_flops() > 0
    assert grouped.get_total_flops() == grouped_mm_flops(a.shape, b.shape, out_shape=out.shape)
    if layout != "2d x 3d":  # the 2-D × 3-D output is the groups' rows stacked, checked by the model tests
        torch.testing.assert_close(out.float(), torch.stack(want).float(), rtol=2e-2, atol=1e-2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA not available")
@pytest.mark.parametrize("variant", MIXTURES)
def test_a_bf16_mixture_on_cuda_matches_the_loop_and_does_not_sync(variant, monkeypatch):
    """What CUDA training runs (bf16 autocast): the grouped kernel's numbers against the per-slice loop, and a
    second step under ``set_sync_debug_mode("error")`` (the loop's host read would raise there)."""
    m = _model(variant, "cuda")
    idx = torch.randint(0, CFG.vocab_size, (B, T), device="cuda")
    with monkeypatch.context() as patch:
        _per_slice_only(patch)
        loop = _step(m, idx)
    grouped = _step(m, idx)  # the warm-up of the sync check too (lazy cuBLAS set-up)
    _assert_same_step(grouped, loop, rtol=2e-2, atol=2e-3)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        _step(m, idx)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
