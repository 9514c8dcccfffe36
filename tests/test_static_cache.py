"""The static KV caches (``modbench.model.static_cache``), as the static decode step leaves them:

- a skipped token writes no K/V: its cache slot stays untouched (zero) and invalid, and the valid
  slots are exactly the tokens the causal pass processed (``StaticLayerCache``), for every routed variant;
- recursive KV sharing (``StaticSharedCache``): a later recursion step reads step 0's cache, and the
  model decodes as the causal pass with and without it.

The tiny models, prompts and decisions are tests/test_static_decode.py's.
"""

from __future__ import annotations

import pytest
import torch

from modbench.config.model import ModelConfig
from modbench.model.decode import generate
from modbench.model.gpt import RoutedBlock
from modbench.model.static_cache import StaticLayerCache, StaticSharedCache
from modbench.model.static_decode import StaticDecoder

from test_static_decode import ROUTED, SYNC_FREE, T, decisions, model, prompt


@pytest.mark.parametrize("name", [v for v in ROUTED if v in SYNC_FREE])
def test_skipped_tokens_write_no_kv(name):
    """At a routed layer of scope "block" or "attention" the valid slots are exactly the tokens the causal
    pass processed, and every other slot is untouched (still the fresh cache's zeros); scope "mlp" routes
    the MLP alone, so its attention caches every token."""
    m = model(name)
    idx = torch.randint(0, 256, (3, 20), generator=torch.Generator().manual_seed(2))
    dec = StaticDecoder(m, 3, 24)
    with torch.no_grad():
        dec(idx[:, :6])
        for t in range(6, 20):
            dec(idx[:, t : t + 1])
    routed = [c for layer, c in zip(m.layers, dec.caches) if isinstance(layer, RoutedBlock)]
    assert routed and all(isinstance(c, StaticLayerCache) for c in routed)
    for cache, decide in zip(routed, decisions(m, idx)):
        expected = torch.ones_like(decide) if m.routers[0].scope == "mlp" else decide
        assert torch.equal(cache.valid[:, :20], expected)
        assert not cache.valid[:, 20:].any()
        invalid = ~cache.valid
        assert (cache.k.transpose(1, 2)[invalid] == 0).all() and (cache.v.transpose(1, 2)[invalid] == 0).all()
        assert (cache.k.transpose(1, 2)[cache.valid] != 0).any(-1).all()  # every processed token wrote a key
    if m.routers[0].scope != "mlp":
        assert 0 < sum(int(c.valid.sum()) for c in routed) < 3 * 20 * len(routed)  # some skipped, some not


@pytest.mark.parametrize("name", ["dense", "sigmoid", "mor", "mor_token_choice"])
@pytest.mark.parametrize("share", [True, False])
def test_recursive_models_with_and_without_kv_sharing(name, share):
    """Middle-Cycle N_R = 3: later applications read step 0's static cache (``StaticSharedCache``)
    with sharing, keep their own without; both decode as the causal pass."""
    cfg = ModelConfig(depth=5, n_embd=32, head_dim=8, max_seq_len=T, recursion="middle_cycle", recursions=3,
                      kv_sharing=share)
    m = model(name, cfg, pattern="fixed:1,1", capacity=0.5)
    out = generate(m, prompt(3, 5), 12, temperature=0, return_logits=True, step="static")
    torch.testing.assert_close(out.logits, m(out.tokens[:, :-1], routing_mode="causal").logits, atol=1e-5, rtol=1e-5)
    dynamic = generate(m, prompt(3, 5), 12, temperature=0, step="dynamic")
    assert out.kv_bytes_per_token == dynamic.kv_bytes_per_token
    dec = StaticDecoder(m, 1, 4)
    assert any(isinstance(c, StaticSharedCache) for c in dec.caches) == share
