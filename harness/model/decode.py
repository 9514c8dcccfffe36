"""Causal routing at inference: KV-cached generation and the train/inference gap metrics.

Top-k over the whole sequence is not causal: whether token t is processed depends on the
scores of later tokens, so a model trained with top-k is a different model when it decodes
one token at a time. This module measures that and decodes the causal model.

Generation (``Decoder``, ``generate``)
    The prompt is prefilled in one pass, then tokens are fed one at a time. Each layer keeps
    a KV cache. At a routed layer a token routed away by ``decide_causal`` writes *no* K/V
    entry, so later tokens never attend to it — the same computation as
    ``GPT.forward(..., routing_mode="causal")``, which tests check to ``allclose``.

    Cache layout: per layer, ``k``/``v`` of shape (B, H, max_len + 1, hd), *compacted per
    sequence* — slot s of sequence b holds the s-th token that layer processed for b, and
    ``lengths[b]`` slots are valid — so sequences of one batch can skip different tokens.
    Keys are stored already rotated by their absolute positions (RoPE), so a slot's position
    is never needed again. The extra last slot is a bin for the writes of skipped tokens
    (one batched scatter, no per-sequence branches); it is never read. Cost: the buffers are
    allocated for the worst case (every token processed: the dense cache size); a routed
    layer reads only ``max_b lengths[b]`` slots, which takes one host sync per routed layer
    and step. A decode step routes first and then runs the block only on the sequences that
    process the token (all of them, none, or a gathered subset), so skipping saves the
    block's work; the subset gather copies those sequences' caches.

Calibrating the causal rules and measuring the train/inference gap live in
``modbench.run.causal_eval``.
"""

from __future__ import annotations

import math
import time
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from modbench.errors import ModbenchError, accepted
from modbench.model.gpt import GPT, Attention, AttentionSummary, RoutedBlock, attention_summary

DECODE_MODES = ("causal", "dense")  # top-k cannot decode: it needs the future


# --- the KV cache -------------------------------------------------------------------------
class LayerCache:
    """Keys and values of one layer for a batch, compacted per sequence (see module doc)."""

    def __init__(self, batch: int, heads: int, max_len: int, head_dim: int, device, dtype) -> None:
        self.max_len = max_len
        self.k = torch.zeros(batch, heads, max_len + 1, head_dim, device=device, dtype=dtype)
        self.v = torch.zeros_like(self.k)
        self.lengths = torch.zeros(batch, dtype=torch.long, device=device)
        self.bound = 0  # host-side max(lengths): how many slots attention must read

    def attend(self, attn: Attention, h: Tensor, cos: Tensor, sin: Tensor,
               keep: Tensor | None, rows: Tensor | None = None) -> Tensor:
        """Attention output for new tokens ``h`` (b, n, d) appended to the cache.

        keep: (b, n) bool, which new tokens write K/V (None: all of them, a dense layer).
        rows: which sequences of the batch ``h`` holds (None: all, in order).
        A new query sees the processed tokens of its sequence up to and including itself.
        Queries of skipped tokens get a finite but meaningless output (the caller discards
        it): they see the processed tokens before them, or slot 0 when there are none.
        """
        q, k, v = attn.project(h, cos, sin)
        b, n = h.shape[:2]
        lengths = self.lengths if rows is None else self.lengths.index_select(0, rows)
        keep_ = torch.ones(b, n, dtype=torch.bool, device=h.device) if keep is None else keep
        count = lengths.unsqueeze(1) + keep_.long().cumsum(-1)  # processed up to and incl. j
        slot = torch.where(keep_, count - 1, self.max_len)  # skipped tokens → the bin slot
        seq = (torch.arange(b, device=h.device) if rows is None else rows).unsqueeze(1)
        self.k[seq, :, slot] = k.transpose(1, 2).to(self.k.dtype)
        self.v[seq, :, slot] = v.transpose(1, 2).to(self.v.dtype)
        new_lengths = count[:, -1]
        if rows is None:
            self.lengths = new_lengths
        else:
            self.lengths[rows] = new_lengths
        if keep is None and rows is None:
            self.bound += n  # every sequence holds every token: known without a sync
        else:
            self.bound = int(self.lengths.max())
        L = max(self.bound, 1)
        keys, values = self.k[:, :, :L], self.v[:, :, :L]
        if rows is not None:
            keys, values = keys.index_select(0, rows), values.index_select(0, rows)
        if keep is None and n == 1:
            mask = None  # one new token that sees every slot: no mask needed
        else:
            visible = torch.arange(L, device=h.device) < count.clamp_min(1).unsqueeze(-1)  # (b, n, L)
            mask = visible.unsqueeze(1)
        y = F.scaled_dot_product_attention(q, keys.to(q.dtype), values.to(q.dtype), attn_mask=mask)
        if attn.expose:  # the next router reads this layer's attention (amod): each new token's self-weight
            visible = torch.arange(L, device=h.device) < count.clamp_min(1).unsqueeze(-1)
            own = attention_summary(q, keys, visible.unsqueeze(1), own=(count - 1).clamp_min(0)).self_weight * keep_
            full = own if rows is None else torch.zeros(self.k.shape[0], n, device=h.device).index_copy(0, rows, own)
            attn.exposed = AttentionSummary(full)
        return attn.output(y)


# --- the decoder --------------------------------------------------------------------------
class Decoder:
    """Feeds tokens through ``model`` with per-layer KV caches, routing causally.

    ``decoder(idx)`` takes the next (B, n) tokens of every sequence (the prompt first, then
    one at a time, or any chunking) and returns their logits (B, n, V). mode "causal" routes
    by ``decide_causal``; "dense" runs every routed layer as a plain block (MoD off).
    """

    def __init__(self, model: GPT, batch: int, max_len: int, *, mode: str = "causal") -> None:
        if mode not in DECODE_MODES:
            raise ModbenchError(
                f"cannot decode with routing mode {mode!r}: expected {accepted(DECODE_MODES)} "
                "(top-k needs the scores of future tokens)"
            )
        cfg = model.cfg
        if max_len > cfg.max_seq_len:
            raise ModbenchError(
                f"prompt + new tokens = {max_len} exceeds the model's max_seq_len {cfg.max_seq_len}"
            )
        self.model, self.mode, self.batch, self.max_len = model, mode, batch, max_len
        p = model.head.weight
        hd = cfg.width // cfg.heads
        self.caches = [LayerCache(batch, cfg.heads, max_len, hd, p.device, p.dtype) for _ in model.layers]
        self.pos = 0
        # Routed-layer token computations: how many were done, out of how many.
        self.processed = torch.zeros((), dtype=torch.long, device=p.device)
        self.routed_total = 0

    @property
    def skipped_fraction(self) -> float:
        """Fraction of routed-layer token computations skipped so far (mlp_skip: MLPs)."""
        return 1.0 - self.processed.item() / self.routed_total if self.routed_total else 0.0

    @torch.no_grad()
    def __call__(self, idx: Tensor) -> Tensor:
        B, n = idx.shape
        if B != self.batch:
            raise ValueError(f"decoder was built for batch {self.batch}, got {B}")
        if self.pos + n > self.max_len:
            raise ModbenchError(f"decoding past {self.max_len} tokens: raise the decoder's max_len")
        m = self.model
        cos = m.rope_cos[self.pos : self.pos + n]
        sin = m.rope_sin[self.pos : self.pos + n]
        x = m.embed(idx)
        previous = None  # the last routed layer's decisions for these tokens (nested routing)
        for layer, cache in zip(m.layers, self.caches):
            attn = layer.block.attn
            if attn.expose:
                attn.exposed = None  # (a routed layer that no sequence processes leaves none)
            if isinstance(layer, RoutedBlock) and self.mode == "causal":
                x, decide = self._routed(layer, cache, x, cos, sin, previous)
                previous = decide
                self.processed += decide.sum()
                self.routed_total += decide.numel()
            else:
                x = self._dense(layer.block, cache, x, cos, sin)
            if attn.expose:  # the next router reads this layer's attention (amod): the tokens' self-weights
                exposed = attn.take_exposed()
                previous = exposed if exposed is not None else AttentionSummary(torch.zeros(B, n, device=x.device))
        self.pos += n
        return m.head(m.norm(x))

    @staticmethod
    def _dense(block, cache: LayerCache, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        return x + block.delta(x, cos, sin, cache=cache)

    def _routed(self, layer: RoutedBlock, cache: LayerCache, x: Tensor, cos: Tensor, sin: Tensor,
                previous: Tensor | None) -> tuple[Tensor, Tensor]:
        # The model's own block path (pre_route, routed_delta, mix_causal), with the cache passed in.
        x = layer.pre_route(x, cos, sin, cache=cache)
        decide = layer.router.decide_causal_given(x, previous)
        n = x.shape[1]
        if n > 1:
            # Prefill: every token computed in one masked pass, skipped ones discarded.
            return layer.mix_causal(x, decide, layer.routed_delta(x, cos, sin, cache=cache, keep=decide)), decide
        # Decode step: run the block only for the sequences that process this token.
        rows = decide[:, 0].nonzero().squeeze(1)
        if rows.numel() == 0:
            return layer.skipped(x), decide  # nobody processes it: no K/V written, no block run
        all_rows = rows.numel() == x.shape[0]
        xs = x if all_rows else x.index_select(0, rows)
        ones = torch.ones(xs.shape[:2], dtype=torch.bool, device=x.device)
        delta = layer.routed_delta(xs, cos, sin, cache=cache, keep=ones, rows=None if all_rows else rows)
        out = layer.mix_causal(xs, ones, delta)
        if all_rows:
            return out, decide
        return layer.skipped(x).index_copy(0, rows, out), decide


# --- generation ---------------------------------------------------------------------------
@dataclass
class Generation:
    tokens: Tensor  # (B, P + N): prompt and new tokens
    prompt_len: int
    seconds: float  # wall time of prefill + decoding
    skipped_fraction: float  # of routed-layer token computations
    logits: Tensor | None = None  # (B, P + N − 1, V) when asked for: every fed position

    @property
    def new_tokens(self) -> Tensor:
        return self.tokens[:, self.prompt_len :]

    @property
    def tokens_per_s(self) -> float:
        """New tokens per second over the batch (prefill time included)."""
        return self.new_tokens.numel() / max(self.seconds, 1e-9)


def sample(logits: Tensor, *, temperature: float = 1.0, top_k: int | None = None,
           generator: torch.Generator | None = None) -> Tensor:
    """(B, V) logits → (B, 1) tokens; temperature 0 is greedy."""
    if temperature <= 0:
        return logits.argmax(-1, keepdim=True)
    logits = logits.float() / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, -math.inf)
    return torch.multinomial(F.softmax(logits, dim=-1), 1, generator=generator)


@torch.no_grad()
def generate(
    model: GPT,
    prompt: Tensor,
    max_new_tokens: int,
    *,
    mode: str = "causal",
    temperature: float = 1.0,
    top_k: int | None = None,
    seed: int = 0,
    return_logits: bool = False,
    autocast: torch.autocast | None = None,
) -> Generation:
    """Sample ``max_new_tokens`` after each row of ``prompt`` (B, P) with a KV cache."""
    if prompt.dim() != 2 or prompt.shape[1] < 1:
        raise ModbenchError("the prompt must hold at least one token per sequence")
    if max_new_tokens < 1:
        raise ModbenchError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    was_training = model.training
    model.eval()
    device = model.head.weight.device
    prompt = prompt.to(device)
    B, P = prompt.shape
    generator = torch.Generator(device=device).manual_seed(seed)
    try:
        decoder = Decoder(model, B, P + max_new_tokens - 1, mode=mode)
        _sync(device)
        start = time.perf_counter()
        tokens, all_logits = [prompt], []
        feed = prompt
        for i in range(max_new_tokens):
            with autocast or nullcontext():
                logits = decoder(feed)
            if return_logits:
                all_logits.append(logits.float())
            feed = sample(logits[:, -1], temperature=temperature, top_k=top_k, generator=generator)
            tokens.append(feed)
            if i + 1 == max_new_tokens:
                break  # the last token is sampled, never fed
        _sync(device)
        seconds = time.perf_counter() - start
    finally:
        model.train(was_training)
    return Generation(
        tokens=torch.cat(tokens, dim=1),
        prompt_len=P,
        seconds=seconds,
        skipped_fraction=decoder.skipped_fraction,
        logits=torch.cat(all_logits, dim=1) if return_logits else None,
    )


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
