"""Roofline limit of a KV-cached decode step: what speed-up routing can buy at batch B.

The FLOP ratio alone over-promises at batch B > 1: a routed layer skips a token of one sequence,
but it still reads all its weights whenever *any* sequence of the batch processes its token, and a
small batch is limited by those weight reads, not by arithmetic. The model here (a roofline,
Williams, Waterman & Patterson 2009, CACM 52(4)) charges each layer, per decode step,

    time = max(FLOPs / peak, bytes / bandwidth)

and sums the layers and the head. A routed layer whose B sequences each process the step's token
with probability s (its realised share) processes b ~ Binomial(B, s) of them
(``scipy.stats.binom``): its FLOPs are those of b tokens, and its weights are read only when b > 0
(expected fraction of steps 1 − (1 − s)^B); the router and, for MLP-scope routing, the attention
run on all B every step; for attention-scope routing (``dtrnet``) the MLP and the value and output
projections run on all B (the unrouted tokens' token-local update), and the query and key projections
and the scores over the cache on the routed ones. A top-1 mixture of E experts reads
E·(1 − (1 − 1/E)^b) expert MLPs in expectation (uniform assignment). KV-cache reads count per processed token (its keys and values
over the mean context of the decode steps; a routed layer's cache holds the share s of them).
Elementwise work (norms, RoPE, softmax, GELU, gathers) and Python overhead count as zero: that is
the gap this limit exposes. ``peak`` and ``bandwidth`` are measured on the machine
(``measure_machine``: a large matmul and a large copy, in the dtype of the weights, on the CPU or the GPU).

``speedup_limit`` = dense step time / routed step time under this model, the attainable speed-up;
a measured speed-up ÷ it is the share of the attainable speed-up realised.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from scipy.stats import binom
from torch import nn

from modbench.model.gpt import GPT, RoutedBlock, TopOneMoE


@dataclass(frozen=True)
class Machine:
    peak_flops: float  # FLOP/s of a large fp32 matmul at the benchmark's thread count
    bandwidth: float  # bytes/s of a large copy (read + write counted)


@dataclass(frozen=True)
class LayerCost:
    """One layer's per-step costs. ``always_*``: every step, per token of the batch (and the
    weights read every step); ``routed_*``: per processed token, and the weights read when at
    least one token is processed; ``expert_bytes``: per distinct expert used (``experts`` > 0)."""

    share: float = 1.0  # probability a sequence processes the step's token (1: a dense layer)
    always_flops: float = 0.0
    always_bytes: float = 0.0  # weights
    always_token_bytes: float = 0.0  # per token: KV-cache reads
    routed_flops: float = 0.0
    routed_bytes: float = 0.0  # weights
    routed_token_bytes: float = 0.0
    experts: int = 0
    expert_bytes: float = 0.0


def layer_time(cost: LayerCost, batch: int, machine: Machine) -> float:
    """Expected roofline time of one decode step of ``cost`` at ``batch`` sequences."""
    total = 0.0
    for b in range(batch + 1):
        p = float(binom.pmf(b, batch, cost.share))
        if p == 0.0:
            continue
        flops = batch * cost.always_flops + b * cost.routed_flops
        data = cost.always_bytes + batch * cost.always_token_bytes + b * cost.routed_token_bytes
        if b > 0:
            data += cost.routed_bytes
            if cost.experts:
                data += cost.experts * (1.0 - (1.0 - 1.0 / cost.experts) ** b) * cost.expert_bytes
        total += p * max(flops / machine.peak_flops, data / machine.bandwidth)
    return total


def step_time(costs: list[LayerCost], batch: int, machine: Machine) -> float:
    return sum(layer_time(c, batch, machine) for c in costs)


def speedup_limit(dense: list[LayerCost], routed: list[LayerCost], batch: int, machine: Machine) -> float:
    """Attainable decode speed-up (dense step time / routed step time) under the roofline."""
    return step_time(dense, batch, machine) / step_time(routed, batch, machine)


# --- costs of a GPT's layers, read off its modules --------------------------------------------
def _numel(*modules: nn.Module) -> int:
    return sum(p.numel() for m in modules for p in m.parameters())


def model_costs(model: GPT, context: float, shares: list[float] | None = None, bytes_per_value: int = 4) -> list[LayerCost]:
    """Per-layer ``LayerCost`` of ``model`` at a decode step over ``context`` cached tokens, with
    the routed layers' realised ``shares`` (in order; a routed layer without one processes all).

    FLOPs: 2 per weight of the linears a token runs (``modbench.model.flops``), plus attention
    4·d per cached key (scores and weighted sum). Bytes: every weight once, and K and V
    (2·d values) per cached key. The head is a last "layer" that every token runs."""
    d = model.cfg.width
    shares = list(shares or [])
    costs = []
    for layer in model.layers:
        block = layer.block
        attn_w = _numel(block.attn)
        kv = 2 * d * bytes_per_value
        if isinstance(block.mlp, TopOneMoE):
            gate_w, expert_w, experts = block.mlp.gate.weight.numel(), _numel(block.mlp.experts[0]), len(block.mlp.experts)
        else:
            gate_w, expert_w, experts = 0, _numel(block.mlp), 0
        mlp_flops = 2.0 * (gate_w + expert_w)
        attn_flops = 2.0 * attn_w + 4.0 * d * context
        if not isinstance(layer, RoutedBlock):
            costs.append(_dense_layer(attn_w, gate_w, expert_w, experts, attn_flops, mlp_flops, kv * context, bytes_per_value))
            continue
        share = shares.pop(0) if shares else 1.0
        router = layer.router
        block_params = {id(p) for p in block.parameters()}
        router_w = sum(p.numel() for p in router.parameters() if id(p) not in block_params)
        router_flops = router.scoring_flops(d)[0]
        mlp_w = 0 if experts else expert_w  # a mixture's experts are charged per expert used (``expert_bytes``)
        if router.scope == "mlp":  # attention (and the router) on every token, the MLP on the processed ones
            always_flops, always_w, always_kv = router_flops + attn_flops, router_w + attn_w, kv * context
            routed_flops, routed_w, routed_kv = mlp_flops, gate_w + mlp_w, 0.0
        elif router.scope == "attention":  # W_V, W_O and the MLP on every token; W_Q, W_K and the scores on the routed
            vo_w = attn_w // 2  # (qkv is 3d², the output projection d²: v and o are half of the attention's weights)
            always_flops = router_flops + 2.0 * vo_w + mlp_flops
            always_w, always_kv = router_w + vo_w + gate_w + mlp_w, 0.0
            routed_flops = 2.0 * (attn_w - vo_w) + 4.0 * d * context * share
            routed_w, routed_kv = attn_w - vo_w, kv * context * share
        else:  # the whole block on the processed tokens, over a cache that holds the share s of the context
            always_flops, always_w, always_kv = router_flops, router_w, 0.0
            routed_flops = 2.0 * attn_w + 4.0 * d * context * share + mlp_flops
            routed_w, routed_kv = attn_w + gate_w + mlp_w, kv * context * share
        costs.append(LayerCost(
            share=share, always_flops=always_flops, always_bytes=always_w * bytes_per_value,
            always_token_bytes=always_kv, routed_flops=routed_flops, routed_bytes=routed_w * bytes_per_value,
            routed_token_bytes=routed_kv, experts=experts, expert_bytes=expert_w * bytes_per_value,
        ))
    head_w = model.head.weight.numel()
    costs.append(LayerCost(always_flops=2.0 * head_w, always_bytes=head_w * bytes_per_value))
    return costs


def _dense_layer(attn_w: int, gate_w: int, expert_w: int, experts: int, attn_flops: float, mlp_flops: float,
                 kv_bytes: float, bytes_per_value: int) -> LayerCost:
    """A plain block on every token: all of it is 'routed' with share 1 (every step reads it)."""
    weights = attn_w + gate_w + (0 if experts else expert_w)
    return LayerCost(share=1.0, routed_flops=attn_flops + mlp_flops, routed_bytes=weights * bytes_per_value,
                     routed_token_bytes=kv_bytes, experts=experts, expert_bytes=expert_w * bytes_per_value)


def dense_and_routed_costs(model: GPT, context: float, shares: list[float],
                           bytes_per_value: int = 4) -> tuple[list[LayerCost], list[LayerCost]]:
    """(the dense GPT of ``model``'s shape, ``model`` at its routed layers' realised ``shares``): the two
    cost lists ``speedup_limit`` and ``step_time`` compare. The dense twin is built on the meta device."""
    with torch.device("meta"):
        dense = GPT(model.cfg)
    return (model_costs(dense, context, bytes_per_value=bytes_per_value),
            model_costs(model, context, shares, bytes_per_value=bytes_per_value))


# --- the machine ------------------------------------------------------------------------------
def _best_seconds(fn, repeats: int, device: str = "cpu") -> float:
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    fn()  # warm-up
    sync()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t0)
    return best


def measure_machine(*, matmul_size: int = 1024, copy_mib: int = 256, repeats: int = 5, device: str = "cpu",
                    dtype: torch.dtype = torch.float32) -> Machine:
    """Peak FLOP/s of a ``dtype`` (n × n)·(n × n) matmul and the bandwidth of copying ``copy_mib``
    MiB (bytes read + written) on ``device`` (a CPU: at the current ``torch.get_num_threads()``); best
    of ``repeats`` (the machine's capability, not its load). A GPU's decode runs bf16 weights: measure
    it with ``dtype=torch.bfloat16`` and a matmul large enough to fill it (``gpu_decode`` uses 8192)."""
    a = torch.randn(matmul_size, matmul_size, device=device, dtype=dtype)
    b = torch.randn(matmul_size, matmul_size, device=device, dtype=dtype)
    peak = 2.0 * matmul_size**3 / _best_seconds(lambda: torch.mm(a, b), repeats, device)
    n = copy_mib * 2**20 // a.element_size()
    src, dst = torch.randn(n, device=device, dtype=dtype), torch.empty(n, device=device, dtype=dtype)
    bandwidth = 2.0 * n * a.element_size() / _best_seconds(lambda: dst.copy_(src), repeats, device)
    return Machine(peak_flops=peak, bandwidth=bandwidth)
