"""``dtrnet``: DTRNet (arXiv:2509.00925), attention's token mixing routed (issue 40).

What the registry sweeps do not check: a layer's output against a per-token reference written from the
released code's algorithm (routed tokens x + p·attn among the routed, the others x + (1 − p)·W_O·W_V·norm(x),
then the MLP on every token), the same in causal mode, the unrouted tokens writing no K/V in the dynamic
decoder's cache, the L1 loss and its weight, and the FLOPs of the token-local update in training and
at the realised share in decoding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from modbench.config.capacity import CapacitySchedule
from modbench.config.model import ModelConfig, RoutingConfig
from modbench.model.decode import Decoder
from modbench.model.gpt import GPT, RoutedBlock
from modbench.model.sizing import decode_flops_per_token
from modbench.variants import build_router, get_variant
from modbench.variants.dtrnet import DTRNetRouter

CFG = ModelConfig(depth=2, n_embd=32, head_dim=8, max_seq_len=48)
B, T, D = 3, 48, 32


def spread(router: DTRNetRouter, std: float = 0.3) -> DTRNetRouter:
    """Weights with a real spread and zero biases, so that both decisions occur."""
    for name, p in router.named_parameters():
        torch.nn.init.zeros_(p) if name.endswith("bias") else torch.nn.init.normal_(p, std=std)
    return router


def layer(capacity: float = 0.5, seed: int = 0) -> RoutedBlock:
    """One DTRNet layer; at C = 0.5 the slots (⌈2·k⌉ = T) hold every token the rule routes: no overflow."""
    torch.manual_seed(seed)
    router = spread(build_router("dtrnet", D))
    return RoutedBlock(CFG, router, CapacitySchedule(capacity, max_seq_len=CFG.max_seq_len)).train()


def rope(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    m = GPT(CFG)
    return m.rope_cos[:n], m.rope_sin[:n]


def reference(block: RoutedBlock, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The released ``LlamaDecoderLayer.forward`` (sparse layer), one sequence at a time, with the weights
    sliced by hand: p = softmax(router)[attention]; the routed tokens (p > 0.5) attend causally among
    themselves at their own positions, x + p·attn; the others x + (1 − p)·o_proj(v_proj(norm(x)));
    then x + mlp(norm(x)) on every token. Returns (output, routed mask)."""
    router, blk = block.router, block.block
    cos, sin = rope(x.shape[1])
    p = torch.sigmoid(router.score(x))  # softmax over (attention, bypass): sigmoid of the logits' difference
    routed = p > 0.5
    w_v = blk.attn.qkv.weight[2 * D:]  # v_proj: the last d rows of the fused qkv
    out = torch.empty_like(x)
    for b in range(x.shape[0]):
        h = x[b].clone()
        idx = routed[b].nonzero().squeeze(-1)
        if idx.numel():
            sub = x[b, idx].unsqueeze(0)
            attn = blk.attn(blk.norm1(sub), cos[idx].unsqueeze(0).unsqueeze(0), sin[idx].unsqueeze(0).unsqueeze(0))[0]
            h[idx] = x[b, idx] + p[b, idx].unsqueeze(-1) * attn
        skip = (~routed[b]).nonzero().squeeze(-1)
        bypass = F.linear(F.linear(blk.norm1(x[b, skip]), w_v), blk.attn.proj.weight)
        h[skip] = x[b, skip] + (1 - p[b, skip]).unsqueeze(-1) * bypass
        out[b] = h + blk.mlp(blk.norm2(h))
    return out, routed


def test_a_layer_is_the_released_algorithm_in_training_and_in_causal_mode():
    block = layer()
    x = torch.randn(B, T, D)
    cos, sin = rope(T)
    with torch.no_grad():
        expected, routed = reference(block, x)
        topk = block(x, cos, sin)
        causal = block.forward_causal(x, cos, sin)
    assert 0 < int(routed.sum()) < routed.numel()  # both paths occur, and the T slots are never all used
    assert torch.equal(topk.processed, routed) and torch.equal(causal.processed, routed)  # p > 0.5, no cap hit
    torch.testing.assert_close(topk.x, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(causal.x, expected, rtol=1e-5, atol=1e-5)
    assert (topk.x != x).any(-1).all()  # every token is updated: the bypass and the MLP
    # the bypass is the block's own: its attention with the token itself as the only key
    h = block.block.norm1(x[:1, :1])
    with torch.no_grad():
        alone = block.block.attn(h, cos[:1], sin[:1])  # one token, causal: it sees itself only
        torch.testing.assert_close(block.block.local_update(x[:1, :1]), alone, rtol=1e-5, atol=1e-6)


def test_the_router_is_the_released_token_router_and_starts_undecided():
    """d → d/2 → SiLU → 2, N(0, 0.02) weights, zero biases: at initialisation p ≈ 0.5 for every token."""
    torch.manual_seed(0)
    router = build_router("dtrnet", D)
    assert isinstance(router, DTRNetRouter) and router.scope == "attention" and router.variable_count
    hidden, head = router.scorer.hidden, router.scorer.head
    assert (hidden.in_features, hidden.out_features, head.out_features) == (D, D // 2, 2)
    assert hidden.weight.std().item() < 0.03 and not hidden.bias.any() and not head.bias.any()
    p = router.probability(torch.randn(2, T, D))
    assert ((p - 0.5).abs() < 0.01).all()
    assert get_variant("dtrnet").make_config().aux_weight == 0.0008  # aux_loss_coeff of the shipped experiment


def test_unrouted_tokens_write_no_kv_and_decoding_equals_the_causal_pass():
    """The dynamic decoder's cache of a DTRNet layer holds exactly the routed tokens of each sequence
    (the bypass computes no key), and its logits are the causal pass's, at a prefill and one token a step."""
    torch.manual_seed(1)
    m = GPT(CFG, RoutingConfig("dtrnet", 0.5, pattern="DM"))
    spread(m.routers[0])
    m.eval()
    idx = torch.randint(0, 256, (B, 20))
    m.set_collect_stats(True)
    with torch.no_grad():
        full = m(idx, routing_mode="causal")
    m.set_collect_stats(False)
    decide = full.stats[0]["decide"]
    assert 0 < int(decide.sum()) < decide.numel()
    dec = Decoder(m, B, 20)
    with torch.no_grad():
        got = torch.cat([dec(idx[:, :6]), *[dec(idx[:, t : t + 1]) for t in range(6, 20)]], dim=1)
    torch.testing.assert_close(got, full.logits, atol=1e-5, rtol=1e-5)
    assert dec.caches[1].lengths.tolist() == decide.sum(-1).tolist()  # the routed layer: its routed tokens only
    assert dec.caches[0].lengths.tolist() == [20] * B  # the dense layer: every token


def test_the_l1_loss_is_the_mean_attention_probability_averaged_over_the_routed_layers():
    torch.manual_seed(2)
    m = GPT(CFG, RoutingConfig("dtrnet", 0.25, pattern="all")).train()
    for r in m.routers:
        spread(r)
    inputs = []
    hooks = [layer.register_forward_pre_hook(lambda mod, args: inputs.append(args[0])) for layer in m.layers]
    idx = torch.randint(0, 256, (B, T))
    out = m(idx, idx)
    for h in hooks:
        h.remove()
    expected = sum(r.probability(x).mean() for r, x in zip(m.routers, inputs)) / len(m.routers)
    torch.testing.assert_close(out.aux_losses["attention_l1"], expected)
    torch.testing.assert_close(m.weighted_aux_loss(out.aux_losses, 0), 0.0008 * expected)
    out.aux_losses["attention_l1"].backward()
    assert all(r.scorer.hidden.weight.grad.abs().sum() > 0 for r in m.routers)


def test_the_token_local_update_is_counted_in_training_and_at_the_realised_share_in_decoding():
    """Per sequence at a routed layer: attention (4·2d² projections and its scores) at the k_max slots, the
    MLP at every token, the bypass (2·2d²) at every token in the batched forward and at the T − k unrouted
    ones in decoding, the router (d → d/2 → 2) at every token."""
    d, r = D, CFG.mlp_ratio
    m = GPT(CFG, RoutingConfig("dtrnet", 0.25, pattern="DM"))
    slots = m.routers[0].tokens_run(int(0.25 * T), T)
    dense, routed = (layer.flops(T, causal=True) for layer in m.layers)
    router = 2 * d * (d // 2) + 2 * (d // 2) * 2
    assert routed.parts == {
        "attn_proj": 8 * d * d * slots + 4 * d * d * T,  # q, k, v, o at the slots; v, o (the bypass) at every token
        "attn_scores": 2 * d * slots * (slots + 1),
        "mlp": 4 * r * d * d * T,
        "router": router * T,
    }
    assert routed.tokens_processed == slots and dense.tokens_processed == T
    # decoding at a realised share f: attention at f·T tokens, the bypass at the other (1 − f)·T
    share = 0.125
    k = int(share * T)
    got = decode_flops_per_token(CFG, RoutingConfig("dtrnet", 0.25, pattern="DM"), T, share) * T
    head = 2 * d * CFG.vocab_size * T
    dense_block = 24 * d * d * T + 2 * d * T * (T + 1)
    routed_block = 8 * d * d * k + 2 * d * k * (k + 1) + 4 * d * d * (T - k) + 4 * r * d * d * T + router * T
    assert got == dense_block + routed_block + head
    mod = decode_flops_per_token(CFG, RoutingConfig("sigmoid", 0.25, pattern="DM"), T, share) * T
    assert mod < got < decode_flops_per_token(CFG, RoutingConfig(), T, 1.0) * T  # MoD skips the MLP too; dense does all


def test_an_overflowing_sequence_sends_its_lowest_p_tokens_down_the_bypass():
    """The k_max slots bound the routed count per sequence (the released code has no cap): at C = 0.125
    (k_max = 12 of 48) the training forward routes the 12 highest p among those above 0.5, the causal
    rule all of them. (A sequence under the cap leaves unused slots, whose rows keep their bypass value:
    the first test, at C = 0.5, where the T slots always outnumber the routed tokens.)"""
    block = layer(capacity=0.125)
    x = torch.randn(B, T, D)
    cos, sin = rope(T)
    with torch.no_grad():
        out = block(x, cos, sin)
        wanting = block.router.decide_causal(x)
        r = block.router.route(x, block.capacity.k(T))
    slots = r.index.shape[-1]
    assert slots == 12 and bool((wanting.sum(-1) > slots).any())  # some sequence overflows
    assert out.processed.sum(-1).tolist() == torch.clamp(wanting.sum(-1), max=slots).tolist()
    assert bool((out.processed <= wanting).all())
    skipped = block.skipped(x)
    assert torch.equal(out.x[~out.processed], skipped[~out.processed])  # the bypass and the MLP, bit for bit
