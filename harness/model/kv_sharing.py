"""Recursive KV sharing (Mixture-of-Recursions, arXiv:2507.10524 §2.3; ``ModelConfig.kv_sharing``).

A later application of a recursive model's shared block computes no keys and values: its queries attend
to what the same layer computed at the block's first application (recursion step 0), at the keys'
original positions. ``KVShare`` holds step 0's K/V for one forward, ``KVAccess`` is how one layer
position uses it (step 0 writes, later steps read), and ``kv_access`` builds the attention keyword
``modbench.model.gpt.Block.attention`` takes. The attention module is passed in (``Attention.project``,
``query``, ``output``), so this module imports nothing of the model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

class KVShare:
    """Recursive KV sharing (Mixture-of-Recursions, arXiv:2507.10524 §2.3; ``ModelConfig.kv_sharing``):
    the keys and values one layer of the shared block computed at its first application (recursion
    step 0), which the same layer attends to at every later step instead of computing its own.

    Filled by step 0 in the same forward (``KVAccess`` with ``write``), read by steps ≥ 1.
    k, v:  (B, H, L, hd), the keys rotated by their own positions.
    pos:   (B, L) the keys' positions (step 0 ran a gathered subset: top-k mode), or None: 0 … L−1.
    valid: (B, L) bool, which of the L are keys (the tokens step 0 processed, when it computed more:
           a causal pass, a variable-count router's unused slots), or None: all.
    Tokens step 0 skipped have no K/V there, so they are keys at no later step either.
    """

    def __init__(self) -> None:
        self.k: Tensor | None = None
        self.v: Tensor | None = None
        self.pos: Tensor | None = None
        self.valid: Tensor | None = None

    def visible(self, positions: Tensor | None, n: int) -> Tensor | None:
        """(B or 1, n, L) bool: key j visible to query i iff pos_j <= pos_i and j is valid; None when
        that is the plain causal mask (step 0 and these queries cover positions 0 … n−1 alike)."""
        L = self.k.shape[-2]
        if self.pos is None and self.valid is None and positions is None and n == L:
            return None
        device = self.k.device
        kpos = self.pos if self.pos is not None else torch.arange(L, device=device).unsqueeze(0)
        qpos = positions if positions is not None else torch.arange(n, device=device).unsqueeze(0)
        vis = kpos.unsqueeze(-2) <= qpos.unsqueeze(-1)
        return vis if self.valid is None else vis & self.valid.unsqueeze(-2)


@dataclass
class KVAccess:
    """How one application of a shared layer uses its ``KVShare`` (the layer's ``kv_step``): step 0
    (``write``) attends as usual and records its K/V; a later step attends with its own queries to
    the recorded K/V. positions: (B, n) positions of the tokens attending (a gathered subset), None:
    0 … n−1. valid: (B, n) bool, step 0's tokens that are keys (None: all)."""

    share: KVShare
    write: bool
    positions: Tensor | None = None
    valid: Tensor | None = None

    def attend(self, attn: nn.Module, h: Tensor, cos: Tensor, sin: Tensor, mask: Tensor | None) -> Tensor:
        s = self.share
        if self.write:  # step 0: the layer's own attention (``mask`` as without sharing), K/V recorded
            q, k, v = attn.project(h, cos, sin)
            s.k, s.v, s.pos, s.valid = k, v, self.positions, self.valid
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None)
            return attn.output(y)
        q = attn.query(h, cos, sin)  # a later step: queries only (``mask``, for its own keys, does not apply)
        vis = s.visible(self.positions, q.shape[-2])
        if vis is None:
            return attn.output(F.scaled_dot_product_attention(q, s.k.to(q.dtype), s.v.to(q.dtype), is_causal=True))
        # A query with no key (a token before every token step 0 processed) gets a zero attention output:
        # it sees every key (a finite row) and is zeroed after, rather than a NaN softmax over nothing.
        has = vis.any(-1, keepdim=True)
        y = F.scaled_dot_product_attention(q, s.k.to(q.dtype), s.v.to(q.dtype), attn_mask=(vis | ~has).unsqueeze(-3))
        return attn.output(y * has.unsqueeze(-3).to(y.dtype))


def kv_access(step: int | None, share: KVShare | None, positions: Tensor | None = None,
              valid: Tensor | None = None) -> dict[str, KVAccess]:
    """The attention keyword of a layer position under recursive KV sharing (its ``kv_step``: 0 writes,
    later steps read), or nothing without a ``share``."""
    return {} if share is None else {"kv": KVAccess(share, step == 0, positions, valid)}
