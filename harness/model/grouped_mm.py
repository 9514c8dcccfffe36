"""The ragged expert batches of a top-1 mixture of MLPs as two grouped GEMMs, with no host read.

Why. ``modbench.model.gpt.TopOneMoE`` sorts its tokens by expert; each expert's MLP then runs on its
slice. Run as one matmul pair per slice, the slice sizes must be read on the host (one device sync per
routed layer and step, which no CUDA graph can hold, and unbacked sizes under ``torch.compile``). torch's
grouped GEMM (``torch.nn.functional.grouped_mm``, the kernel torchtitan's MoE layers use) takes the slice
boundaries as a device tensor of offsets instead: every expert's tokens in one launch, nothing read on the
host, the same shapes at every step.

Each group's rows are padded to a multiple of 8 (``ALIGN_ROWS``): in the weight gradient (a 2-D × 2-D
grouped GEMM) a group's rows are the contraction, which CUDA's kernel loads in 16-byte units; a group of
another size trips a device-side assert there (torchao's MoE training tests met it, and torchtitan pads its
token groups to 8 for bf16 for that reason). The padded layout has a size fixed by the token and expert
counts alone (``padded_rows``: the last group takes the slack), so padding reads nothing on the host either;
the padding rows are zeros, which add nothing to any output or gradient. CPU and CUDA run the same layout.

Where it applies (``grouped_dtype``): bfloat16 only. torch 2.11 and 2.13 document the kernel for bf16 on
CUDA (SM ≥ 80), and their shape checks under ``torch.compile`` (the meta function of ``aten._grouped_mm``)
refuse any other dtype. So a mixture uses it under bf16 autocast (CUDA training, ``modbench.run.train``)
or on bf16 inputs, and the per-slice loop with its host read in full precision (CPU training). The CPU has
a bf16 implementation too, which is what tests compare with the loop and compile.

FLOPs. ``FlopCounterMode`` has no formula for ``aten._grouped_mm`` (torch 2.11, 2.13): it would count the
experts as nothing. ``grouped_mm_flops`` is that formula, registered once on import with torch's
``register_flop_formula`` (unless a later torch brings its own): a grouped GEMM costs what one matmul per
group costs, 2·m·k·n summed over the groups. Its backward runs grouped GEMMs too (the input gradient 2-D ×
3-D, the weight gradient 2-D × 2-D with the contraction split by the offsets), so the same formula counts it.
What it counts beyond ``modbench.model.flops``' one MLP per token is the padding rows' work, fewer than
``ALIGN_ROWS`` × (experts + 1) rows a call: executed, and left out of the analytic count that budgets a
run, as other overheads are (under 4 % of a mixture's MLP at 1,024 routed tokens and 4 experts).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.flop_counter import flop_registry, register_flop_formula

GROUPED_DTYPE = torch.bfloat16  # the only dtype the kernel's shape checks accept (module doc)
ALIGN_ROWS = 8  # a group's rows come in multiples of this: 16 bytes of bf16 along the weight gradient's contraction


def grouped_dtype(x: Tensor) -> torch.dtype | None:
    """The dtype to run a mixture's experts in with the grouped kernel, or None: run the per-slice loop.
    bf16 when ``x`` is bf16 or its device's autocast casts matmuls to bf16 (what ``F.linear`` would run in)."""
    device = x.device.type
    autocast = torch.is_autocast_enabled(device) and torch.get_autocast_dtype(device) == GROUPED_DTYPE
    return GROUPED_DTYPE if autocast or x.dtype == GROUPED_DTYPE else None


def padded_rows(rows: int, groups: int) -> int:
    """Rows of the padded layout of ``rows`` rows in ``groups`` groups: room for each group rounded up to
    ``ALIGN_ROWS`` (an empty one to ``ALIGN_ROWS``), whatever the split; a multiple of ``ALIGN_ROWS``."""
    return -(-rows // ALIGN_ROWS) * ALIGN_ROWS + groups * ALIGN_ROWS


def padded_layout(counts: Tensor, rows: int) -> tuple[Tensor, Tensor]:
    """(each row's place in the padded layout (rows,), each group's end there (groups,) int32) for ``rows``
    rows sorted by group, ``counts`` per group: group g starts at a multiple of ``ALIGN_ROWS`` and spans its
    count rounded up to a multiple of it (at least one); the last group ends at ``padded_rows``, taking the
    slack. All on the device, of shapes fixed by ``rows`` and the number of groups."""
    spans = torch.clamp_min((counts + ALIGN_ROWS - 1) // ALIGN_ROWS, 1) * ALIGN_ROWS
    ends = torch.cat([spans[:-1].cumsum(0), spans.new_full((1,), padded_rows(rows, counts.shape[0]))])
    starts = torch.cat([ends.new_zeros(1), ends[:-1]])
    packed_ends = counts.cumsum(0)  # where each group ends among the sorted rows
    row = torch.arange(rows, device=counts.device)
    group = torch.searchsorted(packed_ends, row, right=True)  # each sorted row's group
    place = (starts - packed_ends + counts).index_select(0, group) + row
    return place, ends.to(torch.int32)


def grouped_mlp(x: Tensor, counts: Tensor, experts: Sequence[nn.Module], activation: Callable[[Tensor], Tensor],
                dtype: torch.dtype = GROUPED_DTYPE) -> Tensor:
    """Expert e's MLP, ``experts[e].proj(activation(experts[e].fc(·)))`` (modbench's ``MLP``: two bias-free
    linears), on its slice of ``x`` (N, d): rows sorted by expert, ``counts`` (E,) rows each (on the device).
    Returns (N, d) in ``dtype``.

    The rows run in the padded layout (``padded_layout``: zeros between the groups), gathered back after.
    The weights are stacked per call (E, out, in) in ``dtype``: the cast F.linear does under autocast,
    with one stack copy more; their gradients reach each expert's own parameters."""
    place, offs = padded_layout(counts, x.shape[0])
    padded = x.new_zeros(padded_rows(x.shape[0], counts.shape[0]), x.shape[1], dtype=dtype)
    padded = padded.index_copy(0, place, x.to(dtype))
    fc_w = torch.stack([e.fc.weight for e in experts]).to(dtype)  # (E, r·d, d)
    proj_w = torch.stack([e.proj.weight for e in experts]).to(dtype)  # (E, d, r·d)
    h = F.grouped_mm(padded, fc_w.transpose(-2, -1), offs=offs)
    y = F.grouped_mm(activation(h), proj_w.transpose(-2, -1), offs=offs)
    return y.index_select(0, place)


def grouped_mm_flops(a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
    """``FlopCounterMode``'s count of one ``aten._grouped_mm`` call: 2·m·k·n over its groups (module doc).
    2-D × 2-D (a weight gradient): a's columns, b's rows are the contraction, split by the offsets, each in
    one group, so 2 · a rows · a columns · b columns. Otherwise every output element contracts a's last
    dimension once: 2 · numel(out) · k."""
    if len(a_shape) == 2 and len(b_shape) == 2:
        return 2 * a_shape[0] * a_shape[1] * b_shape[1]
    return 2 * math.prod(out_shape) * a_shape[-1]


if torch.ops.aten._grouped_mm not in flop_registry:  # (a torch with its own formula keeps it)
    register_flop_formula(torch.ops.aten._grouped_mm)(grouped_mm_flops)
