"""``tsa``: Token-Selective Attention (arXiv:2605.05222), a per-token MLP halting gate.

What the registry sweeps do not check: the router against the released ``TokenRouter`` (sizes, initial
bias, the paper's parameter count), a training layer against the paper's eqs. 3–4 written out per token
(every token runs the block, both residual updates scaled by 1 − p in turn), the gate's gradient from the
language-model loss alone reaching every token (λ = 0), the causal rule p > 0.5 halts with the paper's
binary weight (and modbench's "soft" option), halted tokens writing no K/V in decoding, the depth loss and
its weight, and the FLOPs: dense plus the router in training, the block at the realised share in decoding.
"""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from modbench.config.capacity import CapacitySchedule
from modbench.config.model import ModelConfig, RoutingConfig
from modbench.errors import ModbenchError
from modbench.model.decode import Decoder
from modbench.model.gpt import GPT, RoutedBlock
from modbench.model.sizing import decode_flops_per_token
from modbench.variants import build_router, decode_aliases, get_variant
from modbench.variants.tsa import TSARouter

CFG = ModelConfig(depth=3, n_embd=32, head_dim=8, max_seq_len=48)
B, T, D = 3, 48, 32


def spread(router: TSARouter, std: float = 0.3) -> TSARouter:
    """Weights with a real spread and zero biases, so that tokens fall on both sides of p = 0.5."""
    for name, p in router.named_parameters():
        torch.nn.init.zeros_(p) if name.endswith("bias") else torch.nn.init.normal_(p, std=std)
    return router


def layer(seed: int = 0, **options) -> RoutedBlock:
    torch.manual_seed(seed)
    router = spread(build_router("tsa", D, options))
    return RoutedBlock(CFG, router, CapacitySchedule(0.25, max_seq_len=CFG.max_seq_len)).train()


def rope(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    m = GPT(CFG)
    return m.rope_cos[:n], m.rope_sin[:n]


def released_router(router: TSARouter) -> torch.nn.Sequential:
    """The released ``TokenRouter.mlp`` (Linear → ReLU → Linear; halt_prob = sigmoid of it) with this router's weights."""
    s = router.scorer
    mlp = torch.nn.Sequential(torch.nn.Linear(D, s.hidden.out_features), torch.nn.ReLU(), torch.nn.Linear(s.hidden.out_features, 1))
    mlp.load_state_dict({"0.weight": s.hidden.weight, "0.bias": s.hidden.bias, "2.weight": s.head.weight, "2.bias": s.head.bias})
    return mlp


def test_the_router_is_the_released_token_router():
    """d → max(d/4, 16) → ReLU → 1, sigmoid: the halting probability p; final bias −1 (p ≈ 0.27 at the start);
    the score is the logit of 1 − p. At the paper's d = 256, L = 6 the five routers hold ≈ 83K parameters
    (d²/4 + d/2 + 1 each, §2.2)."""
    torch.manual_seed(0)
    router = build_router("tsa", D)
    assert isinstance(router, TSARouter) and router.scope == "block" and router.variable_count and router.soft_gate
    assert (router.scorer.hidden.out_features, build_router("tsa", 256).scorer.hidden.out_features) == (16, 64)
    assert router.scorer.head.bias.item() == -1.0
    bound = 1 / D**0.5  # PyTorch's default nn.Linear initialisation, as the released router keeps it
    assert router.scorer.hidden.weight.abs().max() <= bound and router.scorer.hidden.weight.std() > bound / 4
    x = torch.randn(2, T, D)
    with torch.no_grad():
        p = torch.sigmoid(released_router(router)(x).squeeze(-1))
        torch.testing.assert_close(router.halting_probability(x), p)
        torch.testing.assert_close(router.probability(x), 1 - p)  # the active weight
        torch.testing.assert_close(torch.sigmoid(router.score(x)), 1 - p)
    m = GPT(ModelConfig(depth=6, n_embd=256, head_dim=32, max_seq_len=128), RoutingConfig("tsa", 0.5, pattern="fixed:1,0"))
    assert m.routed_flags == (False, True, True, True, True, True)  # the stem, then L − 1 routed blocks
    n = sum(p.numel() for r in m.routers for p in r.parameters())
    assert n == 5 * (256**2 // 4 + 256 // 2 + 1) == 82565
    assert get_variant("tsa").make_config().depth_weight == 0.001  # λ of the language experiments


def reference(block: RoutedBlock, x: torch.Tensor, processed: torch.Tensor | None, weight: torch.Tensor | None):
    """The paper's gated block update written out one sequence at a time: the tokens in ``processed`` (all when
    None) attend causally among themselves at their own positions, h = x + w·attn(norm1(x)), then
    h + w·mlp(norm2(h)) (eqs. 3–4; w = 1 where ``weight`` is None); the other tokens keep x."""
    blk = block.block
    cos, sin = rope(x.shape[1])
    out = x.clone()
    for b in range(x.shape[0]):
        idx = torch.arange(x.shape[1]) if processed is None else processed[b].nonzero().squeeze(-1)
        if not idx.numel():
            continue
        sub = x[b, idx].unsqueeze(0)
        w = torch.ones(1, idx.numel(), 1) if weight is None else weight[b, idx].view(1, -1, 1)
        h = sub + w * blk.attn(blk.norm1(sub), cos[idx].unsqueeze(0).unsqueeze(0), sin[idx].unsqueeze(0).unsqueeze(0))
        out[b, idx] = (h + w * blk.mlp(blk.norm2(h)))[0]
    return out


def test_training_runs_every_token_each_update_gated_by_one_minus_p_in_turn():
    block = layer()
    x = torch.randn(B, T, D)
    cos, sin = rope(T)
    with torch.no_grad():
        p = block.router.halting_probability(x)
        out = block(x, cos, sin)
        expected = reference(block, x, None, 1 - p)
    assert 0.05 < float((p > 0.5).float().mean()) < 0.95  # tokens on both sides of the threshold
    assert out.processed.all()  # nothing skipped in training, halting ones included
    torch.testing.assert_close(out.x, expected, rtol=1e-5, atol=1e-5)
    # the MLP reads the gated state x + w·attn, not x + attn: the whole-block weighting x + w·(attn + mlp(x + attn))
    # is another model
    with torch.no_grad():
        blk, w = block.block, (1 - p).unsqueeze(-1)
        a = blk.attn(blk.norm1(x), cos, sin)
        whole = x + w * (a + blk.mlp(blk.norm2(x + a)))
    assert not torch.allclose(out.x, whole, atol=1e-3)


def test_the_language_model_loss_alone_reaches_every_tokens_gate():
    """The paper's central mechanism (§3.4, λ = 0): the gate multiplies every token's update, so the task loss's
    gradient reaches the halting logit of every token, halting ones included (a hard router's skipped tokens get none)."""
    torch.manual_seed(1)
    m = GPT(CFG, RoutingConfig("tsa", 0.25, pattern="fixed:1,0", options={"depth_weight": 0.0})).train()
    for r in m.routers:
        spread(r)
    scores = []

    def keep(module, args, out):  # the scores r = −z, kept with their gradient
        out.retain_grad()
        scores.append(out)

    hooks = [r.scorer.register_forward_hook(keep) for r in m.routers]
    idx = torch.randint(0, 256, (B, T))
    out = m(idx, idx)
    for h in hooks:
        h.remove()
    assert m.weighted_aux_loss(out.aux_losses, 0) == 0.0
    out.loss.backward()
    halting = torch.cat([(s < 0).flatten() for s in scores])  # score = −z: p > 0.5
    assert 0 < int(halting.sum()) < halting.numel()
    assert all(bool((s.grad != 0).all()) for s in scores)
    assert all(r.scorer.hidden.weight.grad.abs().sum() > 0 for r in m.routers)


@pytest.mark.parametrize("decode_weight", ["hard", "soft"])
def test_the_causal_rule_halts_tokens_with_p_above_one_half(decode_weight):
    """Causal mode: p ≤ 0.5 runs the block among the running tokens, with the paper's binary weight ("hard": the
    plain update) or the trained 1 − p on each sublayer ("soft"); p > 0.5 keeps x bit for bit."""
    block = layer(decode_weight=decode_weight)
    x = torch.randn(B, T, D)
    cos, sin = rope(T)
    with torch.no_grad():
        p = block.router.halting_probability(x)
        causal = block.forward_causal(x, cos, sin)
        expected = reference(block, x, p <= 0.5, None if decode_weight == "hard" else 1 - p)
    assert torch.equal(causal.processed, p <= 0.5)
    assert torch.equal(causal.x[p > 0.5], x[p > 0.5])
    torch.testing.assert_close(causal.x, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("decode_weight", ["hard", "soft"])
def test_halted_tokens_write_no_kv_and_decoding_equals_the_causal_pass(decode_weight):
    torch.manual_seed(2)
    m = GPT(CFG, RoutingConfig("tsa", 0.25, pattern="fixed:1,0", options={"decode_weight": decode_weight}))
    for r in m.routers:
        spread(r)
    m.eval()
    idx = torch.randint(0, 256, (B, 20))
    m.set_collect_stats(True)
    with torch.no_grad():
        full = m(idx, routing_mode="causal")
    m.set_collect_stats(False)
    dec = Decoder(m, B, 20)
    with torch.no_grad():
        got = torch.cat([dec(idx[:, :6]), *[dec(idx[:, t : t + 1]) for t in range(6, 20)]], dim=1)
    torch.testing.assert_close(got, full.logits, atol=1e-5, rtol=1e-5)
    assert dec.caches[0].lengths.tolist() == [20] * B  # the stem: every token
    for cache, s in zip(dec.caches[1:], full.stats):
        assert 0 < int(s["decide"].sum()) < s["decide"].numel()
        assert cache.lengths.tolist() == s["decide"].sum(-1).tolist()  # the running tokens only


def test_the_depth_loss_is_the_mean_active_fraction_over_the_routed_layers():
    """Eq. 5: λ·(1/(L − 1))·Σ_l mean(1 − p_l), λ = ``depth_weight`` (0.001 by default); its gradient reaches the routers."""
    torch.manual_seed(3)
    m = GPT(CFG, RoutingConfig("tsa", 0.25, pattern="fixed:1,0")).train()
    for r in m.routers:
        spread(r)
    inputs = []
    hooks = [layer.register_forward_pre_hook(lambda mod, args: inputs.append(args[0])) for layer in m.layers[1:]]
    m.set_collect_stats(True)
    idx = torch.randint(0, 256, (B, T))
    out = m(idx, idx)
    m.set_collect_stats(False)
    for h in hooks:
        h.remove()
    active = [1 - r.halting_probability(x) for r, x in zip(m.routers, inputs)]
    expected = sum(a.mean() for a in active) / len(m.routers)
    torch.testing.assert_close(out.aux_losses["depth"], expected)
    torch.testing.assert_close(m.weighted_aux_loss(out.aux_losses, 0), 0.001 * expected)
    for s, a in zip(out.stats, active):  # logged: the decode rule's share, and the paper's α = mean(1 − p)
        torch.testing.assert_close(s["fraction"], (a >= 0.5).float().mean())
        torch.testing.assert_close(s["active_fraction"], a.detach().mean())
    out.aux_losses["depth"].backward()
    assert all(r.scorer.head.weight.grad.abs().sum() > 0 for r in m.routers)


def test_training_flops_are_the_dense_blocks_plus_the_router_and_decoding_pays_the_realised_share():
    """Training: every token runs the block (so attention over all T), plus the router (2·d·h + 2·h forward,
    twice that backward) at every token; FlopCounterMode agrees (math SDPA: the full T × T scores, as
    tests/test_flops.py counts). Decoding at share f: the block at k = f·T tokens, the router at all T."""
    d, h = D, 16
    assert CFG.mlp_ratio == 4  # a block at n tokens: 8d² (q, k, v, o) + 16d² (MLP) per token, and the scores
    torch.manual_seed(0)
    m = GPT(CFG, RoutingConfig("tsa", 0.25, pattern="fixed:1,0"))
    dense = GPT(CFG)
    router = 2 * d * h + 2 * h
    got, base = m.flop_report(T, causal=True), dense.flop_report(T, causal=True)
    assert got.tokens_processed == [T] * CFG.layers
    assert got.forward == base.forward + 2 * router * T
    assert got.total == base.total + 2 * 3 * router * T
    idx = torch.randint(0, 256, (2, T))
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as fc:
        out = m(idx, idx)
        (out.loss + m.weighted_aux_loss(out.aux_losses, 0)).backward()
    assert m.flop_report(T, causal=False).total == pytest.approx(fc.get_total_flops() / 2, rel=0.01)
    share, k = 0.25, int(0.25 * T)
    head = 2 * d * CFG.vocab_size * T
    block = lambda n: 24 * d * d * n + 2 * d * n * (n + 1)  # noqa: E731 (projections, MLP and causal scores at n tokens)
    decode = decode_flops_per_token(CFG, RoutingConfig("tsa", 0.25, pattern="fixed:1,0"), T, share) * T
    assert decode == block(T) + 2 * (block(k) + router * T) + head


def test_options_are_checked_and_there_is_no_aux_decode_alias():
    with pytest.raises(ModbenchError, match="decode_weight must be one of 'hard', 'soft'"):
        get_variant("tsa").make_config({"decode_weight": "binary"})
    with pytest.raises(ModbenchError, match="depth_weight must be >= 0"):
        get_variant("tsa").make_config({"depth_weight": -0.1})
    assert "tsa+aux" not in decode_aliases()
    with pytest.raises(ModbenchError, match="is a soft gate"):
        get_variant("tsa+aux")
