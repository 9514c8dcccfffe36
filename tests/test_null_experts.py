"""``null_experts``: null experts in a token-choice mixture (Kilian et al. 2026, arXiv:2601.15370).

What the registry sweeps do not check: a layer's output against a per-token reference written from the
method's definition (the E real logits and M explicit copies of the null logit, the top-1 slot, the
chosen expert weighted by its probability in the softmax over the E + M slots), in training and in causal
mode; the null copies' multiplicity following the layer's capacity; the balancing loss against Switch's
loss over explicit slots, and that it alone moves the real share to C; the FLOPs in training and at the
realised share in decoding; and the minimal form (one real expert) through the causal checks.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from modbench.config.capacity import CapacitySchedule
from modbench.config.model import ModelConfig, RoutingConfig
from modbench.errors import ModbenchError
from modbench.model.decode import Decoder
from modbench.model.gpt import GPT, RoutedBlock, TopOneMoE
from modbench.model.sizing import decode_flops_per_token
from modbench.run.causal_eval import calibrate_causal_rules, leak_rate
from modbench.variants import build_router, get_variant
from modbench.variants.null_experts import NullExpertsRouter

CFG = ModelConfig(depth=2, n_embd=32, head_dim=8, max_seq_len=48)
B, T, D = 3, 48, 32


def spread(router: NullExpertsRouter, std: float = 0.3, null_bias: float = 0.5) -> NullExpertsRouter:
    """Gate weights with a real spread, the null's bias raised so that both decisions are common."""
    with torch.no_grad():
        torch.nn.init.normal_(router.gate.weight, std=std)
        router.gate.bias.zero_()
        router.gate.bias[-1] = null_bias
    return router


def layer(capacity: float = 0.25, seed: int = 0, **options) -> RoutedBlock:
    """One null-experts layer; slack 4 at C = 0.25 gives k_max = T slots: no sequence overflows."""
    torch.manual_seed(seed)
    router = spread(build_router("null_experts", D, {"slack": 4.0, **options}))
    return RoutedBlock(CFG, router, CapacitySchedule(capacity, max_seq_len=CFG.max_seq_len)).train()


def rope(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    m = GPT(CFG)
    return m.rope_cos[:n], m.rope_sin[:n]


def slot_logits(router: NullExpertsRouter, h: torch.Tensor) -> torch.Tensor:
    """(…, E + M): the E real logits, then M explicit copies of the null logit (M an integer here)."""
    E = router.config.experts
    M = round(float(router.gate.log_copies.exp()))
    l = F.linear(router.norm(h), router.gate.weight, router.gate.bias).float()
    return torch.cat([l[..., :E], l[..., E:].expand(*l.shape[:-1], M)], dim=-1)


def reference(block: RoutedBlock, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The method per token: h = x + attn(norm1(x)) for every token; the top-1 of the E + M slots; a real
    top-1 e adds p_e·MLP_e(norm(h)), p the softmax over the E + M slots; a null leaves h. Returns
    (output, routed to a real expert, h)."""
    router, blk = block.router, block.block
    E = router.config.experts
    cos, sin = rope(x.shape[1])
    h = block.pre_route(x, cos, sin)
    slots = slot_logits(router, h)
    p = F.softmax(slots, dim=-1)
    top = slots.argmax(-1)  # the first of equal maxima: a real expert before the null copies
    out = h.clone()
    for b in range(h.shape[0]):
        for t in range(h.shape[1]):
            e = int(top[b, t])
            if e < E:
                out[b, t] = h[b, t] + p[b, t, e] * blk.mlp.experts[e](router.norm(h[b, t]))
    return out, top < E, h


def test_a_layer_is_the_per_token_reference_in_training_and_in_causal_mode():
    block = layer()
    x = torch.randn(B, T, D)
    cos, sin = rope(T)
    with torch.no_grad():
        topk = block(x, cos, sin)  # (sets M from the layer's capacity: 4·(48 − 12)/12 = 12)
        assert block.router.gate.log_copies.exp().item() == pytest.approx(12.0)
        expected, real, h = reference(block, x)
        causal = block.eval().forward_causal(x, cos, sin)
    assert 0.2 < real.float().mean() < 0.8  # both decisions are common
    assert torch.equal(topk.processed, real) and torch.equal(causal.processed, real)  # the rule, no slot cap hit
    torch.testing.assert_close(topk.x, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(causal.x, expected, rtol=1e-5, atol=1e-5)
    # a token routed to a null expert keeps x + attn bit for bit, in both modes
    assert torch.equal(topk.x[~real], h[~real]) and torch.equal(causal.x[~real], h[~real])
    assert (topk.x[real] != h[real]).any(-1).all()


def test_the_router_and_the_mixture_read_one_gate_whose_null_counts_m_times():
    block = layer()
    router, mlp = block.router, block.block.mlp
    assert isinstance(router, NullExpertsRouter) and router.scope == "mlp" and router.variable_count
    assert isinstance(mlp, TopOneMoE) and mlp.gate is router.gate and block.block.norm2 is router.norm
    assert router.gate.out_features == 4 + 1 and len(mlp.experts) == 4
    x = torch.randn(B, T, D)
    with torch.no_grad():
        block(x, *rope(T))
        h = router.norm(x)
        explicit = F.softmax(slot_logits(router, x), dim=-1)  # (norm applied inside)
        folded = F.softmax(router.gate(h).float(), dim=-1)  # what the mixture's softmax sees
    torch.testing.assert_close(folded[..., :4], explicit[..., :4])  # each real expert's probability over E + M
    torch.testing.assert_close(folded[..., 4], explicit[..., 4:].sum(-1))  # the null: all M copies' mass
    # the rule: the top-1 slot is real iff the best real logit reaches the null logit
    assert torch.equal(router.decide_causal(x), slot_logits(router, x).argmax(-1) < 4)


@pytest.mark.parametrize("capacity,copies", [(0.125, 4 * 42 / 6), (0.25, 12.0), (0.5, 4.0), (0.75, 4 * 12 / 36)])
def test_the_null_copies_follow_the_layers_capacity_and_only_training_forwards_set_them(capacity, copies):
    """M = E·(T − k)/k, so that the balanced real share E/(E + M) is k/T; a calibration pass and an eval
    forward leave it (decoding reads what training set)."""
    block = layer(capacity)
    x = torch.randn(B, T, D)
    gate = block.router.gate
    assert gate.log_copies.exp().item() == pytest.approx(4.0)  # before any training forward: E
    with torch.no_grad():
        block(x, *rope(T))
    k = block.capacity.k(T)
    assert gate.log_copies.exp().item() == pytest.approx(copies) and 4 / (4 + copies) == pytest.approx(k / T)
    with torch.no_grad():
        gate.log_copies.fill_(0.0)
        block.router.calibrating = True
        block(x, *rope(T))
        block.router.calibrating = False
        block.eval()(x, *rope(T))
    assert gate.log_copies.item() == 0.0


def test_a_layer_at_k_equal_t_has_no_null_expert():
    """A capacity warm-up's first steps give k = T: M = 0, every token runs its top-1 real expert."""
    block = layer()
    block.capacity = CapacitySchedule(1.0, max_seq_len=CFG.max_seq_len)
    x = torch.randn(B, T, D)
    with torch.no_grad():
        out = block(x, *rope(T))
        assert torch.isneginf(block.router.gate.log_copies)
        assert out.processed.all() and block.router.decide_causal(x).all()
        assert (F.softmax(block.router.gate(block.router.norm(x)).float(), -1)[..., -1] == 0).all()
    assert torch.isfinite(out.aux_losses["null_balance"])


def test_the_balancing_loss_is_switchs_over_the_real_and_null_slots():
    """(E + M)·Σᵢ fᵢ·Pᵢ over explicit E + M slots (M = 12 copies), fᵢ the fraction of tokens whose top-1 slot
    is i, Pᵢ its mean softmax probability; weighted by ``balance_weight``; the mixture's own loss unweighted."""
    block = layer()
    x = torch.randn(B, T, D)
    out = block(x, *rope(T))
    slots = slot_logits(block.router, block.pre_route(x, *rope(T)))
    n = slots.shape[-1]
    f = F.one_hot(slots.argmax(-1), n).float().mean((0, 1))
    expected = n * (f * F.softmax(slots, -1).mean((0, 1))).sum()
    torch.testing.assert_close(out.aux_losses["null_balance"], expected)
    assert block.router.aux_weights(0) == {"null_balance": 0.01, "expert_balance": 0.0}
    out.aux_losses["null_balance"].backward()
    assert block.router.gate.weight.grad.abs().sum() > 0 and block.router.gate.bias.grad[-1] != 0
    off = build_router("null_experts", D, {"balance_weight": 0.0}).train()
    assert off.route(x, 12).aux_losses == {} and off.flops_per_token(D)[1] == 0.0


@pytest.mark.parametrize("experts,capacity", [(4, 0.25), (1, 0.5)])
def test_the_balancing_loss_alone_brings_the_real_share_to_the_capacity(experts, capacity):
    """From the fresh gate's E/(E + 1) (its best of E logits against one null logit), gradient steps on the
    balancing loss alone, with fixed inputs, bring the share of tokens routed to a real expert near C."""
    torch.manual_seed(0)
    router = build_router("null_experts", D, {"experts": experts}).train()
    x = torch.randn(8, T, D)
    k = CapacitySchedule(capacity).k(T)
    opt = torch.optim.Adam(router.parameters(), lr=0.02)
    start = router.decide_causal(x).float().mean().item()
    for _ in range(300):
        opt.zero_grad()
        router.route(x, k).aux_losses["null_balance"].backward()
        opt.step()
    share = router.decide_causal(x).float().mean().item()
    assert start > experts / (experts + 1) - 0.15 and abs(share - capacity) < 0.05, (start, share)


def test_flops_count_the_gate_everywhere_and_one_expert_per_slot_and_at_the_realised_share_in_decoding():
    d, r, E = D, CFG.mlp_ratio, 4
    m = GPT(CFG, RoutingConfig("null_experts", 0.25, pattern="DM"))
    slots = m.routers[0].tokens_run(int(0.25 * T), T)
    assert slots == 24  # ⌈2·k⌉
    routed = m.layers[1].flops(T, causal=True)
    assert routed.parts == {
        "attn_proj": 8 * d * d * T,  # attention on every token
        "attn_scores": 2 * d * T * (T + 1),
        "mlp": 4 * r * d * d * slots + 2 * d * (E + 1) * slots,  # one expert and the mixture's gate per slot
        "router": 2 * d * (E + 1) * T,
    }
    # backward: the router's gate through the balancing loss, the mixture's gate and the MLP at the slots
    assert routed.backward == 2 * (routed.forward - routed.parts["router"] - 2 * d * (E + 1) * slots) \
        + 4 * d * (E + 1) * (T + slots)
    # decoding at a realised share f: one expert and the gate at the f·T processed tokens, as mode_integrated
    for share in (0.125, 0.3):
        got = decode_flops_per_token(CFG, RoutingConfig("null_experts", 0.25, pattern="DM"), T, share)
        same = decode_flops_per_token(CFG, RoutingConfig("mode_integrated", 0.25, pattern="DM"), T, share)
        assert got == same < decode_flops_per_token(CFG, RoutingConfig(), T, 1.0)


@pytest.mark.parametrize("options", [{"experts": 1}, {"balance_weight": 0.0}, {"experts": 3, "slack": 1.5}])
def test_flops_equal_flop_counter_mode_with_other_options(options):
    torch.manual_seed(0)
    m = GPT(CFG, RoutingConfig("null_experts", 0.25, pattern="all", options=options))
    idx = torch.randint(0, 256, (2, T))
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as fc:
        out = m(idx, idx)
        (out.loss + (m.weighted_aux_loss(out.aux_losses, 0) or 0.0)).backward()
    assert m.flop_report(T, causal=False).total == pytest.approx(fc.get_total_flops() / 2, rel=0.01)


def test_the_minimal_form_never_looks_ahead_and_decodes_as_its_causal_pass():
    """One real expert (the MLP itself) against the null copies: no leak in causal mode, and the KV-cached
    decoder's logits are the causal pass's, at a prefill and one token a step."""
    torch.manual_seed(1)
    m = GPT(CFG, RoutingConfig("null_experts", 0.25, pattern="MD", options={"experts": 1}))
    spread(m.routers[0], std=0.5, null_bias=0.0)
    calibrate_causal_rules(m, [torch.randint(0, 256, (4, T))])
    m.eval()
    idx = torch.randint(0, 256, (B, 24))
    m.set_collect_stats(True)
    with torch.no_grad():
        full = m(idx, routing_mode="causal")
    m.set_collect_stats(False)
    decide = full.stats[0]["decide"]
    assert 0 < int(decide.sum()) < decide.numel()
    assert leak_rate(m, idx, routing_mode="causal") == 0.0
    dec = Decoder(m, B, 24)
    with torch.no_grad():
        got = torch.cat([dec(idx[:, :5]), *[dec(idx[:, t : t + 1]) for t in range(5, 24)]], dim=1)
    torch.testing.assert_close(got, full.logits, atol=1e-5, rtol=1e-5)


def test_an_overflowing_sequence_drops_its_lowest_margin_tokens_in_training_only():
    """At the default slack (k_max = 2k = 12 of 48 at C = 0.125) a fresh-ish gate wants more: the training
    forward runs the 12 highest margins among those at m ≥ 0, the causal rule all of them."""
    torch.manual_seed(0)
    router = spread(build_router("null_experts", D), null_bias=0.0)
    block = RoutedBlock(CFG, router, CapacitySchedule(0.125, max_seq_len=CFG.max_seq_len)).train()
    x = torch.randn(B, T, D)
    with torch.no_grad():
        out = block(x, *rope(T))
        h = block.pre_route(x, *rope(T))
        wanting = router.decide_causal(h)
        margin = router.score(h)
    assert bool((wanting.sum(-1) > 12).all())
    assert out.processed.sum(-1).tolist() == [12] * B and bool((out.processed <= wanting).all())
    for b in range(B):  # the kept ones are the 12 largest margins
        assert margin[b][out.processed[b]].min() >= margin[b][wanting[b] & ~out.processed[b]].max()
    assert torch.equal(out.x[~out.processed], h[~out.processed])


@pytest.mark.parametrize("options,message", [({"experts": 0}, "experts must be in \\[1, 64\\]"),
                                             ({"balance_weight": -1.0}, "balance_weight must be >= 0"),
                                             ({"slack": 0.5}, "slack must be in \\[1, 64\\]")])
def test_bad_options_are_one_line_errors(options, message):
    with pytest.raises(ModbenchError, match=message):
        get_variant("null_experts").make_config(options)
    assert math.isclose(get_variant("null_experts").make_config().balance_weight, 0.01)
