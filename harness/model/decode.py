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
    layer reads only ``max_b lengths[b]`` slots. A decode step routes first and then runs the
    block only on the sequences that process the token (all of them, none, or a gathered
    subset), so skipping saves the block's work; the subset gather copies those sequences'
    caches. Which sequences process the token and the cache's new ``max lengths`` are read
    in one host sync per routed layer and step (the subset's size fixes the shapes); dense
    layers and bookkeeping read nothing. While every sequence holds the same number of slots
    (dense layers; any layer at batch 1) appends are slice writes and a one-token query needs
    no mask.

The static step (``modbench.model.static_decode``): the same semantics with static shapes and no host
sync, for a CUDA graph or ``torch.compile``. ``generate(step=...)`` picks the decoder: "dynamic" (this
module's ``Decoder``), "static" (the static step, eager), "graph" (its one-token step replayed from a
CUDA graph), "compile" (under ``torch.compile(fullgraph=True)``, "reduce-overhead" on CUDA), each also
as "<step>-cond" (a routed layer that no sequence of the batch routes to runs its skip path alone,
``torch.cond``: the static step's way to keep MoD's decode saving; "graph-cond", and "compile-cond" on
CUDA, decide on the device through CUDA graph conditional nodes, "static-cond" on the host), as
"graph-split" and "compile-split" (the same branches, the step captured as CUDA graphs split at each
one and the host reading its predicate between them: for a torch without conditional nodes), or "auto":
"graph" on CUDA for every variant whose routers allow it (``Router.static_decode_refusal``), else
"dynamic" — on a CPU a host read is free and the dynamic decoder skips the work of skipped tokens.

Calibrating the causal rules and measuring the train/inference gap live in
``modbench.run.causal_eval``.
"""

from __future__ import annotations

import math
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from modbench.errors import ModbenchError, accepted
from modbench.model.gpt import GPT, Attention, AttentionSummary, RoutedBlock, attention_summary
from modbench.model.static_decode import MODES, STATIC_STEPS, RoutingTally, StaticDecoder, StepSpec, static_refusal

DECODE_MODES = MODES  # ("causal", "dense"): top-k cannot decode, it needs the future
# generate's decoders (module doc): step name → the ``StaticDecoder``'s options (None: the dynamic ``Decoder``)
STEPS: dict[str, StepSpec | None] = {"dynamic": None, **STATIC_STEPS}
CUDA_ONLY_STEPS = tuple(name for name, spec in STATIC_STEPS.items() if spec.captures)


# --- the KV cache -------------------------------------------------------------------------
class LayerCache:
    """Keys and values of one layer for a batch, compacted per sequence (see module doc)."""

    def __init__(self, batch: int, heads: int, max_len: int, head_dim: int, device, dtype) -> None:
        self.max_len = max_len
        self.k = torch.zeros(batch, heads, max_len + 1, head_dim, device=device, dtype=dtype)
        self.v = torch.zeros_like(self.k)
        self.lengths = torch.zeros(batch, dtype=torch.long, device=device)
        self.bound = 0  # host-side max(lengths): how many slots attention must read
        # True while every sequence holds the same number of slots (= bound): then appends are
        # slice writes and a one-token query needs no mask. Always true for one sequence.
        self.uniform = True
        # The last append's (b, n) counts of slots visible to each new token (None: the causal ones after
        # ``last_start`` slots): what a later recursion step reading this cache shares (``SharedLayerCache``).
        self.last_count: Tensor | None = None
        self.last_start = 0

    def attend(self, attn: Attention, h: Tensor, cos: Tensor, sin: Tensor,
               keep: Tensor | None, rows: Tensor | None = None, bound: int | None = None) -> Tensor:
        """Attention output for new tokens ``h`` (b, n, d) appended to the cache.

        keep: (b, n) bool, which new tokens write K/V (None: all of them).
        rows: which sequences of the batch ``h`` holds (None: all, in order).
        bound: max(lengths) after this append when the caller knows it (a decode step reads it
        with its routing decisions, in one host sync); None: computed here.
        A new query sees the processed tokens of its sequence up to and including itself.
        Queries of skipped tokens get a finite but meaningless output (the caller discards
        it): they see the processed tokens before them, or slot 0 when there are none.
        """
        q, k, v = attn.project(h, cos, sin)
        b, n = h.shape[:2]
        every_row = rows is None or rows.numel() == self.k.shape[0]
        start = self.bound
        if keep is None and every_row and self.uniform:
            count = self._append_all(k, v)
        elif keep is None and n == 1:
            count = self._append_step(k, v, rows, bound)
        else:
            count = self._append_kept(k, v, keep, rows)
        self.last_count, self.last_start = count, start
        L = max(self.bound, 1)
        keys, values = self.k[:, :, :L], self.v[:, :, :L]
        if not every_row:
            keys, values = keys.index_select(0, rows), values.index_select(0, rows)
        causal = count is None and n > 1 and start == 0  # a uniform prefill: the plain causal mask
        mask = None if count is None else _visible(count, L).unsqueeze(1)
        if count is None and n > 1 and not causal:  # a uniform chunk after earlier tokens
            mask = _visible(start + torch.arange(1, n + 1, device=h.device).unsqueeze(0), L).unsqueeze(1)
        y = F.scaled_dot_product_attention(q, keys.to(q.dtype), values.to(q.dtype), attn_mask=mask, is_causal=causal)
        if attn.expose:  # the next router reads this layer's attention (amod): each new token's self-weight
            if count is None:
                count = (start + torch.arange(1, n + 1, device=h.device)).expand(b, n)
            keep_ = torch.ones(b, n, dtype=torch.bool, device=h.device) if keep is None else keep
            own = attention_summary(q, keys, _visible(count, L).unsqueeze(1), own=(count - 1).clamp_min(0)).self_weight * keep_
            full = own if every_row else torch.zeros(self.k.shape[0], n, device=h.device).index_copy(0, rows, own)
            attn.exposed = AttentionSummary(full)
        return attn.output(y)

    def _append_all(self, k: Tensor, v: Tensor) -> None:
        """Every sequence appends every new token, at the same slots: slice writes, no index
        tensors, no sync. Returns None: the queries' visibility is causal (see ``attend``)."""
        n = k.shape[2]
        self.k[:, :, self.bound : self.bound + n] = k.to(self.k.dtype)
        self.v[:, :, self.bound : self.bound + n] = v.to(self.v.dtype)
        self.lengths += n
        self.bound += n
        return None

    def _append_step(self, k: Tensor, v: Tensor, rows: Tensor | None, bound: int | None) -> Tensor:
        """One token for each sequence in ``rows``, at its own next slot; (b, 1) counts."""
        lengths = self.lengths if rows is None else self.lengths.index_select(0, rows)
        seq = torch.arange(self.k.shape[0], device=k.device) if rows is None else rows
        self.k[seq, :, lengths] = k[:, :, 0].to(self.k.dtype)
        self.v[seq, :, lengths] = v[:, :, 0].to(self.v.dtype)
        count = lengths + 1
        self.lengths.index_copy_(0, seq, count)
        self.bound = int(self.lengths.max()) if bound is None else bound
        self.uniform = self.k.shape[0] == 1
        return count.unsqueeze(1)

    def _append_kept(self, k: Tensor, v: Tensor, keep: Tensor | None, rows: Tensor | None) -> Tensor:
        """The general append (a routed prefill): token j of sequence b writes where ``keep``,
        at slot lengths[b] + (kept tokens before it); skipped tokens write to the bin slot. (b, n)
        counts: the processed tokens up to and including each new one."""
        b, n = k.shape[0], k.shape[2]
        lengths = self.lengths if rows is None else self.lengths.index_select(0, rows)
        keep_ = torch.ones(b, n, dtype=torch.bool, device=k.device) if keep is None else keep
        count = lengths.unsqueeze(1) + keep_.long().cumsum(-1)  # processed up to and incl. j
        slot = torch.where(keep_, count - 1, self.max_len)  # skipped tokens → the bin slot
        seq = (torch.arange(b, device=k.device) if rows is None else rows).unsqueeze(1)
        self.k[seq, :, slot] = k.transpose(1, 2).to(self.k.dtype)
        self.v[seq, :, slot] = v.transpose(1, 2).to(self.v.dtype)
        if rows is None:
            self.lengths = count[:, -1].contiguous()
        else:
            self.lengths[rows] = count[:, -1]
        self.bound = int(self.lengths.max())  # one host sync per prefill and layer
        self.uniform = self.k.shape[0] == 1
        return count


class SharedLayerCache:
    """Recursive KV sharing (``ModelConfig.kv_sharing``, Mixture-of-Recursions arXiv:2507.10524 §2.3): a
    later recursion step's view of the step-0 cache of the same layer of the shared block. It stores
    nothing (``lengths`` stays 0: no K/V bytes) and computes no K/V: its queries attend to the slots
    step 0 holds up to their own position — on a decode step every slot (step 0 ran first in the same
    pass), in a prefill the counts step 0's append recorded — as ``GPT.forward``'s shared path does.
    A token with no such slot (before every token step 0 processed) gets a zero attention output."""

    def __init__(self, source: LayerCache) -> None:
        self.source = source
        self.lengths = torch.zeros_like(source.lengths)

    def attend(self, attn: Attention, h: Tensor, cos: Tensor, sin: Tensor,
               keep: Tensor | None, rows: Tensor | None = None, bound: int | None = None) -> Tensor:
        src = self.source
        q = attn.query(h, cos, sin)
        b, n = h.shape[:2]
        L = max(src.bound, 1)
        keys, values = src.k[:, :, :L], src.v[:, :, :L]
        if rows is not None and rows.numel() != src.k.shape[0]:
            keys, values = keys.index_select(0, rows), values.index_select(0, rows)
        if n == 1:
            count = (src.lengths if rows is None else src.lengths.index_select(0, rows)).unsqueeze(1)
        elif src.last_count is not None:  # a prefill (every row): step 0's counts for these tokens
            count = src.last_count
        else:
            count = (src.last_start + torch.arange(1, n + 1, device=h.device)).expand(b, n)
        y = F.scaled_dot_product_attention(q, keys.to(q.dtype), values.to(q.dtype), attn_mask=_visible(count, L).unsqueeze(1))
        return attn.output(y * (count > 0).view(b, 1, n, 1).to(y.dtype))


def _visible(count: Tensor, length: int) -> Tensor:
    """(b, n, length) bool: slot s visible to new token j iff s < count[b, j] (at least slot 0)."""
    return torch.arange(length, device=count.device) < count.clamp_min(1).unsqueeze(-1)


# --- the decoder --------------------------------------------------------------------------
class Decoder(RoutingTally):
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
        self.caches: list[LayerCache | SharedLayerCache] = []
        for src in model.kv_sources:  # a later step under recursive KV sharing reads step 0's cache
            self.caches.append(LayerCache(batch, cfg.heads, max_len, hd, p.device, p.dtype) if src is None
                               else SharedLayerCache(self.caches[src]))
        self.pos = 0
        # Routed-layer token computations, per routed layer: how many were done, out of how many each.
        n_routed = sum(isinstance(layer, RoutedBlock) for layer in model.layers)
        # Prefill counts stay on the device (no sync); decode steps count on the host, from the
        # decisions they read anyway.
        self.processed = torch.zeros(n_routed, dtype=torch.long, device=p.device)
        self.processed_steps = [0] * n_routed
        self.routed_total = 0  # per routed layer

    @property
    def kv_bytes(self) -> int:
        """Bytes of the K/V entries the caches hold: the *valid* slots (each sequence's ``lengths``
        at each layer), not the worst-case allocation. A routed layer holds only the tokens it
        processed; a recursive model's applications of one shared block keep separate caches, each
        holding the tokens that application processed (Mixture-of-Recursions' recursion-wise
        caching, arXiv:2507.10524 §2.2); under recursive KV sharing (§2.3) the later applications hold
        none (``SharedLayerCache``). One host sync."""
        slots = torch.stack([cache.lengths for cache in self.caches]).sum()
        c = next(cache for cache in self.caches if isinstance(cache, LayerCache))
        return int(slots) * 2 * c.k.shape[1] * c.k.shape[3] * c.k.element_size()

    @property
    def kv_bytes_per_token(self) -> float:
        """``kv_bytes`` per token fed so far, per sequence: the cache a context of this length costs."""
        return self.kv_bytes / max(self.pos * self.batch, 1)


    @property
    def processed_counts(self) -> list[int]:
        """Per routed layer: the token computations done so far."""
        return [int(c) + s for c, s in zip(self.processed.tolist(), self.processed_steps)]

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
        previous = None  # the last routed layer's decisions for these tokens (nested routing), or its handoff
        j = 0  # the routed layer's index
        for layer, cache in zip(m.layers, self.caches):
            attn = layer.block.attn
            if attn.expose:
                attn.exposed = None  # (a routed layer that no sequence processes leaves none)
            if isinstance(layer, RoutedBlock) and self.mode == "causal":
                x, decide, handoff = self._routed(layer, cache, x, cos, sin, previous, j)
                previous = decide if handoff is None else handoff  # (mor_token_choice: the depths chosen up front)
                j += 1
            else:
                x = self._dense(layer.block, cache, x, cos, sin)
            if attn.expose:  # the next router reads this layer's attention (amod): the tokens' self-weights
                exposed = attn.take_exposed()
                previous = exposed if exposed is not None else AttentionSummary(torch.zeros(B, n, device=x.device))
        self.pos += n
        if self.mode == "causal":
            self.routed_total += B * n
        return m.head(m.norm(x))

    @staticmethod
    def _dense(block, cache: LayerCache, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        return x + block.delta(x, cos, sin, cache=cache)

    def _routed(self, layer: RoutedBlock, cache: LayerCache, x: Tensor, cos: Tensor, sin: Tensor,
                previous: object | None, j: int) -> tuple[Tensor, Tensor, object | None]:
        # The model's own block path (pre_route, decide, routed_delta, mix_causal), with the cache passed in:
        # how the block's output meets the stream is the router's ``Mixing``, applied by ``RoutedBlock.mix``.
        x = layer.pre_route(x, cos, sin, cache=cache)
        decide, handoff = layer.decide(x, previous)
        B, n = x.shape[:2]
        if n > 1:
            # Prefill: every token computed in one masked pass, skipped ones discarded.
            self.processed[j] += decide.sum()
            delta = layer.routed_delta(x, cos, sin, cache=cache, keep=decide)
            return layer.mix_causal(x, decide, delta, handoff), decide, handoff
        # Decode step: run the block only for the sequences that process this token. One host sync
        # reads which they are and the cache's new bound (its max length) together.
        flags = decide[:, 0]
        *processing, bound = torch.cat((flags.long(), (cache.lengths + flags).max().view(1))).tolist()
        rows_list = [b for b, p in enumerate(processing) if p]
        self.processed_steps[j] += len(rows_list)
        if not rows_list:
            return layer.skipped(x), decide, handoff  # nobody processes it: no K/V written, no block run
        all_rows = len(rows_list) == B
        rows = None if all_rows else torch.tensor(rows_list, device=x.device)
        xs = x if all_rows else x.index_select(0, rows)
        delta = layer.routed_delta(xs, cos, sin, cache=cache, rows=rows, bound=bound)
        out = layer.mix_causal(xs, torch.ones(xs.shape[:2], dtype=torch.bool, device=x.device), delta, handoff, rows)
        if all_rows:
            return out, decide, handoff
        return layer.skipped(x).index_copy(0, rows, out), decide, handoff


# --- generation ---------------------------------------------------------------------------
@dataclass
class Generation:
    tokens: Tensor  # (B, P + N): prompt and new tokens
    prompt_len: int
    seconds: float  # wall time of prefill + decoding
    skipped_fraction: float  # of routed-layer token computations
    processed_shares: list[float]  # per routed layer: the share of token computations done
    logits: Tensor | None = None  # (B, P + N − 1, V) when asked for: every fed position
    prefill_seconds: float = 0.0  # of ``seconds``: the prompt's pass and the first new token's sampling
    kv_bytes_per_token: float = 0.0  # valid K/V bytes per fed token and sequence (``Decoder.kv_bytes``)
    step: str = "dynamic"  # the decoder that ran (``STEPS``)
    setup_seconds: float = 0.0  # before ``seconds``: the static step's CUDA graph capture or compile (``prepare``)

    @property
    def new_tokens(self) -> Tensor:
        return self.tokens[:, self.prompt_len :]

    @property
    def tokens_per_s(self) -> float:
        """New tokens per second over the batch (prefill time included)."""
        return self.new_tokens.numel() / max(self.seconds, 1e-9)

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens per second of the one-token decode steps alone (prefill excluded): the B·(N − 1)
        tokens sampled after a KV-cached step, over those steps' time. What MoD's decode saving is
        about; NaN when there was no decode step (N = 1)."""
        steps = self.new_tokens.shape[1] - 1
        if steps < 1:
            return math.nan
        return self.new_tokens.shape[0] * steps / max(self.seconds - self.prefill_seconds, 1e-9)


def sample(logits: Tensor, *, temperature: float = 1.0, top_k: int | None = None,
           generator: torch.Generator | None = None) -> Tensor:
    """(B, V) logits → (B, 1) tokens; temperature 0 is greedy.

    The draw is argmax(p / e) with e ~ Exp(1) per entry (the exponential race: token i wins with
    probability pᵢ), which is how ``torch.multinomial`` draws one sample, so the same generator gives the
    same tokens (tests/test_causal.py checks). Written out because ``multinomial`` first checks its input
    with host reads (``.item()``) in the torch releases of this project's range: a host sync per token,
    which would stall a decode loop that a CUDA graph lets run ahead of the GPU."""
    if temperature <= 0:
        return logits.argmax(-1, keepdim=True)
    logits = logits.float() / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, -math.inf)
    p = F.softmax(logits, dim=-1)
    return (p / torch.empty_like(p).exponential_(generator=generator)).argmax(-1, keepdim=True)


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
    step: str = "auto",
    decoder: StaticDecoder | None = None,
) -> Generation:
    """Sample ``max_new_tokens`` after each row of ``prompt`` (B, P) with a KV cache.

    ``step``: which decoder (module doc; "auto" by default). ``decoder``: a ``StaticDecoder`` built
    before (for this batch, at least P + max_new_tokens − 1 long) to reuse, reset first: its captured
    CUDA graph or compiled step serves this generation too (``step`` is then its ``step_name``). Any
    decoder with the same members (``model``, ``batch``, ``max_len``, ``mode``, ``reset``, ``prepare``,
    ``step_name``, the tallies) can be passed: ``modbench.bench.reference_decoder``'s is one."""
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
        if decoder is None:
            step = resolve_step(model, step, mode)
            spec = STEPS[step]
            decoder = Decoder(model, B, P + max_new_tokens - 1, mode=mode) if spec is None else \
                StaticDecoder(model, B, P + max_new_tokens - 1, mode=mode, **asdict(spec))
        else:
            _check_reused(decoder, model, B, P + max_new_tokens - 1, mode)
            decoder.reset()
            step = decoder.step_name
        setup = time.perf_counter()
        if hasattr(decoder, "prepare"):  # a static step (or the bench's reference decoder)
            with autocast or nullcontext():
                decoder.prepare()  # a capture or compile, outside the timed generation
        _sync(device)
        start = time.perf_counter()
        setup_seconds = start - setup
        tokens, all_logits = [prompt], []
        feed = prompt
        for i in range(max_new_tokens):
            with autocast or nullcontext():
                logits = decoder(feed)
            if return_logits:
                all_logits.append(logits.float())
            feed = sample(logits[:, -1], temperature=temperature, top_k=top_k, generator=generator)
            tokens.append(feed)
            if i == 0:
                _sync(device)
                prefill_seconds = time.perf_counter() - start
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
        processed_shares=decoder.processed_shares,
        logits=torch.cat(all_logits, dim=1) if return_logits else None,
        prefill_seconds=prefill_seconds,
        kv_bytes_per_token=decoder.kv_bytes_per_token,
        step=step,
        setup_seconds=setup_seconds,
    )


def resolve_step(model: GPT, step: str, mode: str = "causal") -> str:
    """The decoder ``generate`` runs for ``step`` (module doc): "auto" is "graph" on CUDA when the
    model's routers allow the static step, else "dynamic"; a static step asked for by name for a
    model whose routers refuse it is an error that says why."""
    if step != "auto" and step not in STEPS:
        raise ModbenchError(f"unknown decode step {step!r}: expected {accepted(('auto', *STEPS))}")
    why = static_refusal(model) if mode == "causal" else None
    cuda = model.head.weight.device.type == "cuda"
    if step == "auto":
        return "graph" if cuda and why is None else "dynamic"
    if STEPS[step] is not None and why is not None:
        raise ModbenchError(f"variant {model.routing.variant!r} cannot decode with step {step!r} ({why}); "
                            "expected step 'dynamic' or 'auto'")
    if step in CUDA_ONLY_STEPS and not cuda:
        others = [s for s in ("auto", *STEPS) if s not in CUDA_ONLY_STEPS]
        raise ModbenchError(f"decode step {step!r} replays a CUDA graph: the model is not on a CUDA device; "
                            f"expected {accepted(others)}")
    return step


def _check_reused(decoder: StaticDecoder, model: GPT, batch: int, length: int, mode: str) -> None:
    if decoder.model is not model or decoder.batch != batch or decoder.max_len < length or decoder.mode != mode:
        raise ModbenchError(f"the decoder passed to generate was built for batch {decoder.batch}, "
                            f"{decoder.max_len} tokens, mode {decoder.mode!r} (of another model?): expected "
                            f"batch {batch}, at least {length} tokens, mode {mode!r}, the same model")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
