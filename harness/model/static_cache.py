"""The static KV caches of ``modbench.model.static_decode``: a layer's keys and values at shapes fixed by
(batch, max_len), and recursive KV sharing over them.

The cache (``StaticLayerCache``): per layer ``k``/``v`` of shape (B, H, max_len, hd), slot t holding
the token at position t (keys rotated by RoPE at their position), and ``valid`` (B, max_len) bool.
A token the layer processes writes its K/V at its slot and marks it valid; a skipped token writes
*no* K/V: its slot keeps what it held (zeros in a fresh cache; ``torch.where`` on the decision picks
the old contents) and stays invalid, so no later query ever sees it as a key — the same semantics as
the dynamic decoder's compacted cache (which skips the write) and the causal pass's mask
(``causal_routing_mask``). A new query sees the valid slots up to its own position, and its own slot
always: for a processed token that is its key; a skipped token's query then sees finite numbers
whose output the mix discards. Attention reads all max_len slots every step (a static shape), where
the dynamic cache reads only the slots written so far.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from modbench.model.gpt import Attention, AttentionSummary, attention_summary


def slots_of(pos: Tensor, n: int) -> Tensor:
    """(n,) the positions (= cache slots) of the n new tokens, from the device position."""
    return pos + torch.arange(n, device=pos.device)


def _visible(valid: Tensor, slots: Tensor) -> Tensor:
    """(B, n, L) bool: slot s visible to new token j iff it is valid and s <= slot_j, or s is j's own slot."""
    s = torch.arange(valid.shape[-1], device=valid.device)
    before = s <= slots.unsqueeze(-1)  # (n, L)
    own = s == slots.unsqueeze(-1)
    return (valid.unsqueeze(1) & before) | own


class StaticLayerCache:
    """One layer's keys and values for a batch, slot t = position t, with a ``valid`` mask (module doc).

    ``pos`` is the decoder's position tensor (shared by every layer): the slot of the first new token.
    """

    def __init__(self, batch: int, heads: int, max_len: int, head_dim: int, device, dtype, pos: Tensor) -> None:
        self.k = torch.zeros(batch, heads, max_len, head_dim, device=device, dtype=dtype)
        self.v = torch.zeros_like(self.k)
        self.valid = torch.zeros(batch, max_len, dtype=torch.bool, device=device)
        self.pos = pos

    @property
    def lengths(self) -> Tensor:
        """(B,) slots holding a processed token: what ``kv_bytes`` counts (as ``LayerCache.lengths``)."""
        return self.valid.sum(-1)

    def tensors(self) -> tuple[Tensor, ...]:
        """The state a step mutates in place."""
        return self.k, self.v, self.valid

    def attend(self, attn: Attention, h: Tensor, cos: Tensor, sin: Tensor, keep: Tensor | None,
               rows: Tensor | None = None, bound: int | None = None) -> Tensor:
        """Attention output for new tokens ``h`` (B, n, d) at slots pos … pos + n − 1, their K/V
        written where ``keep`` ((B, n) bool; None: every token). ``rows`` and ``bound`` belong to the
        dynamic cache's subsets; a static step always holds every row."""
        if rows is not None:
            raise ValueError("a static cache step holds every sequence of the batch (rows=None)")
        q, k, v = attn.project(h, cos, sin)
        slots = slots_of(self.pos, h.shape[1])
        k, v = k.to(self.k.dtype), v.to(self.v.dtype)
        if keep is None:
            self.k.index_copy_(2, slots, k)
            self.v.index_copy_(2, slots, v)
            self.valid.index_fill_(1, slots, True)
        else:  # a skipped token writes nothing: its slot keeps its old contents and stays invalid
            write = keep[:, None, :, None]
            self.k.index_copy_(2, slots, torch.where(write, k, self.k.index_select(2, slots)))
            self.v.index_copy_(2, slots, torch.where(write, v, self.v.index_select(2, slots)))
            self.valid.index_copy_(1, slots, keep)
        mask = _visible(self.valid, slots).unsqueeze(1)  # (B, 1, n, L)
        y = F.scaled_dot_product_attention(q, self.k.to(q.dtype), self.v.to(q.dtype), attn_mask=mask)
        if attn.expose:  # the next router reads this layer's attention (amod): each new token's self-weight
            own = slots.expand(h.shape[0], -1)
            weight = attention_summary(q, self.k, mask, own=own).self_weight
            attn.exposed = AttentionSummary(weight if keep is None else weight * keep)
        return attn.output(y)


class StaticSharedCache:
    """Recursive KV sharing (``ModelConfig.kv_sharing``, Mixture-of-Recursions arXiv:2507.10524 §2.3) on
    the static cache: a later recursion step's queries attend to the valid slots of the step-0 cache of
    the same layer up to their own position (step 0 ran first in the same pass), computing no K/V; a
    query with no such slot gets a zero attention output — as ``modbench.model.decode.SharedLayerCache``."""

    def __init__(self, source: StaticLayerCache) -> None:
        self.source = source

    @property
    def lengths(self) -> Tensor:
        return torch.zeros_like(self.source.valid[:, 0], dtype=torch.long)  # stores nothing

    def tensors(self) -> tuple[Tensor, ...]:
        return ()

    def attend(self, attn: Attention, h: Tensor, cos: Tensor, sin: Tensor, keep: Tensor | None,
               rows: Tensor | None = None, bound: int | None = None) -> Tensor:
        src = self.source
        q = attn.query(h, cos, sin)
        slots = slots_of(src.pos, h.shape[1])
        s = torch.arange(src.valid.shape[-1], device=h.device)
        vis = src.valid.unsqueeze(1) & (s <= slots.unsqueeze(-1))  # (B, n, L)
        has = vis.any(-1, keepdim=True)  # a key to attend to (a device flag, no branch)
        y = F.scaled_dot_product_attention(q, src.k.to(q.dtype), src.v.to(q.dtype), attn_mask=(vis | ~has).unsqueeze(1))
        return attn.output(y * has.unsqueeze(1).to(y.dtype))
