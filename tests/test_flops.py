"""Analytic FLOPs against torch's FlopCounterMode.

FlopCounterMode counts the CPU flash-attention kernel as 0 FLOPs in torch 2.13 (upstream
issue 195460), so the cross-check runs attention on the *math* SDPA backend, which the
counter sees as plain matmuls over the full L × L score matrix. The matching analytic
convention is therefore ``causal=False``; the causal count is checked by hand below.
"""

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from modbench import variants
from modbench.config.model import ModelConfig, RoutingConfig
from modbench.model.flops import attention_flops
from modbench.model.gpt import GPT

CFG = ModelConfig(depth=2, n_embd=64, head_dim=16, max_seq_len=128)


def counted(model, T, backward=True):
    idx = torch.randint(0, 256, (2, T))
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as fc:
        out = model(idx, idx)
        if backward:
            loss = out.loss + (model.weighted_aux_loss(out.aux_losses, 10**6) or 0.0)
            loss.backward()
    return fc.get_total_flops() / 2  # per sequence


@pytest.mark.parametrize("name", variants.list_variants() + variants.decode_aliases())
@pytest.mark.parametrize("capacity,pattern", [(0.25, "alternate"), (0.5, "all")])
def test_analytic_flops_match_flop_counter(name, capacity, pattern):
    torch.manual_seed(0)
    m = GPT(CFG, RoutingConfig(name, capacity=capacity, pattern=pattern))
    T = 96
    report = m.flop_report(T, causal=False)
    fwd = counted(m, T, backward=False)
    assert report.forward == pytest.approx(fwd, rel=0.01)
    total = counted(m, T, backward=True)
    assert report.total == pytest.approx(total, rel=0.01)


def test_routed_layer_attention_is_counted_at_k_squared():
    m = GPT(CFG, RoutingConfig("norm", capacity=0.25, pattern="all"))
    r = m.flop_report(128, causal=True)
    assert r.tokens_processed == [32, 32]
    assert r.breakdown["attn_scores"] == 2 * attention_flops(64, 32, causal=True)
    # causal pairs by hand: k(k+1)/2 = 528, 4·d FLOPs each
    assert attention_flops(64, 32, causal=True) == 4 * 64 * 528


def test_routed_block_flop_ratio_matches_hand_count():
    """One layer, d=256, T=1024, C=0.125: the paper-style saving, counted by hand."""
    cfg = ModelConfig(depth=1, n_embd=256, head_dim=64, max_seq_len=1024)
    d, T, k = 256, 1024, 128
    dense = GPT(cfg).flop_report(T)
    routed = GPT(cfg, RoutingConfig("norm", capacity=0.125, pattern="all")).flop_report(T)
    head = 2 * d * 256 * T
    dense_block = 24 * d * d * T + 2 * d * T * (T + 1)
    routed_block = 24 * d * d * k + 2 * d * k * (k + 1)
    assert dense.forward == dense_block + head
    assert routed.forward == routed_block + head + 2 * d * T  # + the norm router
    ratio = (routed.total - 3 * head) / (dense.total - 3 * head)
    assert ratio == pytest.approx(0.0979, abs=5e-4)


def test_flop_budget_favours_mod_models():
    dense = GPT(CFG)
    mod = GPT(CFG, RoutingConfig("sigmoid", capacity=0.125, pattern="alternate"))
    assert mod.flops_per_token(128) < 0.8 * dense.flops_per_token(128)
    mlp = GPT(CFG, RoutingConfig("mlp_skip", capacity=0.125, pattern="alternate"))
    assert mod.flops_per_token(128) < mlp.flops_per_token(128) < dense.flops_per_token(128)


def test_model_flops_are_the_sum_of_its_layers_methods():
    """One counter: GPT.flop_report adds each layer's own ``flops`` and the head's."""
    from modbench.model.flops import head_flops

    cfg = ModelConfig(depth=4, max_seq_len=64)
    for routing in (None, RoutingConfig("sigmoid", capacity=0.25, pattern="alternate"),
                    RoutingConfig("mlp_skip", capacity=0.5, pattern="all")):
        m = GPT(cfg, routing)
        layers = [layer.flops(64) for layer in m.layers]
        head = head_flops(cfg.width, cfg.vocab_size, 64)
        report = m.flop_report(64)
        assert report.forward == sum(l.forward for l in layers) + head.forward
        assert report.backward == sum(l.backward for l in layers) + head.backward
        assert report.tokens_processed == [l.tokens_processed for l in layers]


@pytest.mark.parametrize("name", ["token_choice", "threshold"])
@pytest.mark.parametrize("share", [0.25, 0.5])
def test_decode_flops_of_a_variable_count_router_at_its_share_are_a_fixed_count_routers(name, share):
    """Decoding runs exactly the tokens the rule processes: no k_max slots. (Charging the slots made
    a share of 0.25 cost what a fixed-count router pays at 0.5, and a share of 0.5 more than dense.)"""
    from modbench.model.sizing import decode_flops_per_token

    T = 96
    variable = decode_flops_per_token(CFG, RoutingConfig(name, capacity=0.125, pattern="all"), T, share)
    fixed = decode_flops_per_token(CFG, RoutingConfig("sigmoid", capacity=0.125, pattern="all"), T, share)
    assert variable == fixed  # the same linear scorer (2d per token): everything else is the block at k
    assert variable < decode_flops_per_token(CFG, RoutingConfig(), T, 1.0)
    # training FLOPs still count the slots the batched forward runs (FlopCounterMode, above)
    m = GPT(CFG, RoutingConfig(name, capacity=share, pattern="all"))
    assert m.flop_report(T).tokens_processed == [min(T, 2 * int(share * T))] * CFG.layers
