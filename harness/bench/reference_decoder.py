"""A plain static-cache decoder of modbench's dense GPT: the yardstick of issue 38's dense decode bar.

Issue 38 measured modbench's dense decoding against "an independent, minimal static-cache dense
decoder of exactly modbench's dense shape", its one-token step captured in a CUDA graph and, faster,
under ``torch.compile(mode="reduce-overhead")``, and set the bar at 0.7× the compiled one. This is that
decoder, written out once, so that ``modbench.bench.gpu_decode`` times the yardstick in the same
process, on the same device, as the decoders it judges ("reference-graph", "reference-compile").

What it is: the weights of a dense ``GPT`` read straight from its modules, and one function that runs
them: embedding; per layer RMSNorm, the fused qkv projection, RoPE on the two halves of each head, the
new K/V written at its slot of a preallocated cache (per layer B, H, max_len, hd), SDPA over every slot
with one (n, max_len) visibility mask (slot ≤ position), the output projection, RMSNorm and the
tanh-GELU MLP; the final RMSNorm and the head. No routing, no cache objects, no per-layer Python
beyond the loop. The position is a device tensor, so the one-token step has static shapes and no host
read. Hand-written because it is the measuring stick: a library decoder would be a different model.
Tests (tests/bench/test_reference_decoder.py) check that it gives modbench's dense logits, so both
decode the same model.

Measured on this project's CPU (torch 2.13, d 512, depth 8, fp32, one thread): compiled alone, this
step and modbench's compiled dense step run equally fast (1,190 and 1,185 tokens/s at batch 64), both
writing the cache in place inside Inductor's fused kernel. A first version was 0.80–0.86× modbench's in
the decode table: its ``prepare`` saved and restored the whole cache on every step instead of once
(tests/bench/test_reference_decoder.py now checks that a step copies no cache tensor).

It speaks the decoder protocol ``modbench.model.decode.generate`` drives (``prepare``, ``reset``,
``__call__``, ``step_name`` and the routing tallies, which are those of a dense model).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from modbench.errors import ModbenchError, accepted
from modbench.model.gpt import GPT, MLP, DenseLayer, apply_rope
from modbench.model.cuda_graphs import COMPILE_WARMUP, capture_cuda_graph

RUNNERS = ("eager", "graph", "compile")


class ReferenceDecoder:
    """``decoder(idx)``: the next (B, n) tokens of every sequence → their logits (B, n, V) (module doc)."""

    mode = "dense"
    skipped_fraction = 0.0
    processed_shares: list[float] = []

    def __init__(self, model: GPT, batch: int, max_len: int, *, runner: str = "eager",
                 compile_backend: str | None = None) -> None:
        if runner not in RUNNERS:
            raise ModbenchError(f"unknown reference decoder runner {runner!r}: expected {accepted(RUNNERS)}")
        plain = all(isinstance(layer, DenseLayer) and isinstance(layer.block.mlp, MLP) for layer in model.layers)
        if not plain or model.cfg.kv_sharing or model.cfg.recursion != "none":
            raise ModbenchError("the reference decoder runs a plain dense GPT: expected variant 'dense' without "
                                "recursion or KV sharing")
        if max_len > model.cfg.max_seq_len:
            raise ModbenchError(f"prompt + new tokens = {max_len} exceeds the model's max_seq_len {model.cfg.max_seq_len}")
        self.model, self.batch, self.max_len, self.runner = model, batch, max_len, runner
        self.compile_backend = compile_backend  # (tests and the dry run: "eager", Dynamo's tracing alone)
        cfg, w = model.cfg, model.head.weight
        self.heads, self.head_dim = cfg.heads, cfg.width // cfg.heads
        # One tensor per layer (a compiled step that wrote into a view of one stacked tensor would copy all
        # of it back, every layer of every step).
        shape = (batch, self.heads, max_len, self.head_dim)
        self.k = [torch.zeros(shape, device=w.device, dtype=w.dtype) for _ in model.layers]
        self.v = [torch.zeros_like(k) for k in self.k]
        self.pos = torch.zeros((), dtype=torch.long, device=w.device)
        self.fed = 0
        self._graph = self._graph_idx = self._graph_out = self._compiled = None

    @property
    def step_name(self) -> str:
        return f"reference-{self.runner}"

    @property
    def kv_bytes_per_token(self) -> float:
        """Every token's K and V at every layer (a dense model caches all of them)."""
        _, heads, _, hd = self.k[0].shape
        return 2.0 * len(self.k) * heads * hd * self.k[0].element_size()

    def state(self) -> list[Tensor]:
        """Every tensor a step mutates in place."""
        return [*self.k, *self.v, self.pos]

    def reset(self) -> None:
        for t in self.state():
            t.zero_()
        self.fed = 0

    def step(self, idx: Tensor) -> Tensor:
        m = self.model
        B, n = idx.shape
        slots = self.pos + torch.arange(n, device=idx.device)
        cos, sin = m.rope_cos.index_select(0, slots), m.rope_sin.index_select(0, slots)
        visible = torch.arange(self.max_len, device=idx.device) <= slots.unsqueeze(-1)  # (n, L)
        mask = visible.expand(B, 1, n, self.max_len)
        x = m.embed(idx)
        for i, layer in enumerate(m.layers):
            b = layer.block
            h = F.rms_norm(x, (x.shape[-1],), b.norm1.weight, b.norm1.eps)
            q, k, v = F.linear(h, b.attn.qkv.weight).view(B, n, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
            self.k[i].index_copy_(2, slots, apply_rope(k, cos, sin))
            self.v[i].index_copy_(2, slots, v)
            y = F.scaled_dot_product_attention(apply_rope(q, cos, sin), self.k[i], self.v[i], attn_mask=mask)
            x = x + F.linear(y.transpose(1, 2).reshape(B, n, -1), b.attn.proj.weight)
            h = F.rms_norm(x, (x.shape[-1],), b.norm2.weight, b.norm2.eps)
            x = x + F.linear(F.gelu(F.linear(h, b.mlp.fc.weight), approximate="tanh"), b.mlp.proj.weight)
        self.pos.add_(n)
        x = F.rms_norm(x, (x.shape[-1],), m.norm.weight, m.norm.eps)
        return F.linear(x, m.head.weight)

    @torch.no_grad()
    def prepare(self) -> None:
        """Capture ("graph") or compile ("compile") the one-token step once, leaving the cache as it was.
        Called before every one-token step: after the first it returns at once (saving and restoring the
        cache on every call copied all of it twice per token)."""
        if self.runner == "eager" or self._graph is not None or self._compiled is not None:
            return
        idx = torch.zeros(self.batch, 1, dtype=torch.long, device=self.pos.device)
        saved = [t.clone() for t in self.state()]
        if self.runner == "graph":
            self._graph_idx = idx
            self._graph, self._graph_out = capture_cuda_graph(self.step, idx)
        else:
            if self.compile_backend is not None:
                self._compiled = torch.compile(self.step, fullgraph=True, dynamic=False, backend=self.compile_backend)
            else:
                if idx.is_cuda:  # in-place updates of these stay inside Inductor's CUDA graph
                    for t in self.state():
                        torch._dynamo.mark_static_address(t)
                self._compiled = torch.compile(self.step, fullgraph=True, dynamic=False,
                                               mode="reduce-overhead" if idx.is_cuda else None)
            for _ in range(COMPILE_WARMUP):
                self._compiled_step(idx)
        for t, s in zip(self.state(), saved):
            t.copy_(s)

    def _compiled_step(self, idx: Tensor) -> Tensor:
        if idx.is_cuda:
            torch.compiler.cudagraph_mark_step_begin()
        return self._compiled(idx).clone()

    @torch.no_grad()
    def __call__(self, idx: Tensor) -> Tensor:
        if idx.shape[0] != self.batch or self.fed + idx.shape[1] > self.max_len:
            raise ModbenchError(f"the reference decoder holds batch {self.batch} and {self.max_len} tokens")
        if idx.shape[1] == 1 and self.runner != "eager":
            self.prepare()
            if self.runner == "graph":
                self._graph_idx.copy_(idx)
                self._graph.replay()
                logits = self._graph_out.clone()
            else:
                logits = self._compiled_step(idx)
        else:
            logits = self.step(idx)
        self.fed += idx.shape[1]
        return logits
