"""The random controls and the ungated option: they differ from their learned arm only where stated."""

from __future__ import annotations

import torch

from modbench import variants
from modbench.variants.controls import RandomGatedRouter, RandomRouter

D, B, T, K = 32, 3, 16, 4


def test_random_gated_selects_like_random_and_weights_by_its_gate():
    x = torch.randn(B, T, D)
    plain = variants.build_router("random", D, {})
    gated = variants.build_router("random_gated", D, {})
    assert isinstance(gated, RandomGatedRouter) and gated.scope == "block"
    torch.manual_seed(0)
    a = plain.route(x, K)
    torch.manual_seed(0)
    b = gated.route(x, K)
    assert torch.equal(a.index, b.index)  # the same random selection for the same RNG state
    assert a.weight is None
    expected = torch.sigmoid(gated.gate(x)).gather(-1, b.index).unsqueeze(-1)
    torch.testing.assert_close(b.weight, expected)
    b.weight.sum().backward()
    assert gated.gate.proj.weight.grad.abs().sum() > 0  # the gate learns from the LM loss


def test_random_gated_causal_weight_is_the_tokens_own_gate():
    gated = variants.build_router("random_gated", D, {})
    x = torch.randn(B, T, D)
    decide = gated.decide_causal(x)
    w = gated.causal_weight(x, decide)
    torch.testing.assert_close(w[:, :5], gated.causal_weight(x[:, :5], decide[:, :5]))  # no look-ahead


def test_random_mlp_is_the_mlp_scope_control():
    r = variants.build_router("random_mlp", D, {})
    assert r.scope == "mlp" and isinstance(r, RandomRouter)
    assert variants.get_variant("mlp_skip").make_config({}) is not None


def test_sigmoid_without_gate_adds_the_delta_unweighted():
    x = torch.randn(B, T, D)
    gated = variants.build_router("sigmoid", D, {})
    ungated = variants.build_router("sigmoid", D, {"gate": False})
    ungated.load_state_dict(gated.state_dict())
    a, b = gated.route(x, K), ungated.route(x, K)
    assert torch.equal(a.index, b.index) and b.weight is None and a.weight is not None
    assert ungated.causal_weight(x, ungated.decide_causal(x)) is None
