"""What the methods beyond the seed recipes promise, beyond the registry sweeps.

The sweeps (test_routed_block, test_causal, test_flops, test_train) already run every
registered variant through exact counts, untouched rows, causal leak-freedom, KV-cached
decoding and FLOP counting; these tests check each method's own rule.
"""

import math

import pytest
import torch

from modbench.config.model import ModelConfig, RoutingConfig
from modbench.errors import ModbenchError
from modbench.model.gpt import GPT, RoutedBlock
from modbench.run.causal_eval import leak_rate

CFG = ModelConfig(depth=4, n_embd=32, head_dim=8, max_seq_len=64)
T = 64


def spread(m: GPT, std: float = 0.5) -> GPT:
    """Routers with a real spread of scores (zero-mean logits), as after some training."""
    for r in m.routers:
        for name, p in r.named_parameters():
            if name.endswith("bias"):
                torch.nn.init.zeros_(p)
            elif p.dim() > 1:
                torch.nn.init.normal_(p, std=std)
    return m


def processed(m: GPT, idx: torch.Tensor, mode: str = "topk") -> list[torch.Tensor]:
    m.set_collect_stats(True)
    try:
        with torch.no_grad():
            out = m(idx, routing_mode=mode)
    finally:
        m.set_collect_stats(False)
    return [s["layer_processed"] if mode == "topk" else s["decide"] for s in out.stats]


# --- per-layer capacity (p-MoD's progressive decay) ---------------------------------------------
def test_capacity_decays_over_depth_along_a_cosine():
    r = RoutingConfig("sigmoid", capacity=0.125, capacity_first=0.5)
    caps = [r.capacity_at(i, 4) for i in range(4)]
    assert caps[0] == 0.5 and caps[-1] == 0.125 and caps == sorted(caps, reverse=True)
    assert caps[1] == pytest.approx(0.125 + 0.375 * (1 + math.cos(math.pi / 3)) / 2)
    m = GPT(CFG, RoutingConfig("sigmoid", capacity=0.125, capacity_first=0.5, pattern="all"))
    ks = [layer.capacity.k(T) for layer in m.layers]
    assert ks == [math.floor(c * T) for c in caps]
    # FLOPs follow each layer's own k
    assert [f.tokens_processed for f in [layer.flops(T) for layer in m.layers]] == ks
    with pytest.raises(ModbenchError, match=r"\(0, 1\]"):
        RoutingConfig("sigmoid", capacity=0.125, capacity_first=1.5)


# --- nested (Mixture-of-Recursions) -------------------------------------------------------------
@pytest.mark.parametrize("mode", ["topk", "causal"])
def test_nested_layers_select_within_the_previous_layers_selection(mode):
    torch.manual_seed(0)
    m = spread(GPT(CFG, RoutingConfig("nested", capacity=0.125, capacity_first=0.5, pattern="all"))).eval()
    sets = processed(m, torch.randint(0, 256, (3, T)), mode)
    for before, after in zip(sets, sets[1:]):
        assert not (after & ~before).any(), "a layer processed a token the previous routed layer skipped"
    if mode == "topk":
        assert [s.sum(-1).tolist() for s in sets] == [[layer.capacity.k(T)] * 3 for layer in m.layers]
    else:
        assert sets[-1].sum() < sets[0].sum()


def test_nested_without_decay_selects_the_same_set_again():
    torch.manual_seed(1)
    m = spread(GPT(CFG, RoutingConfig("nested", capacity=0.25, pattern="all")))
    sets = processed(m, torch.randint(0, 256, (2, T)))
    assert all(torch.equal(s, sets[0]) for s in sets)


# --- token choice and threshold routing -----------------------------------------------------------
@pytest.mark.parametrize("name", ["token_choice", "threshold"])
def test_training_rule_is_the_decoding_rule_when_nothing_overflows(name):
    """Without overflow the top-k forward and the causal forward are the same computation."""
    torch.manual_seed(2)
    m = spread(GPT(CFG, RoutingConfig(name, capacity=0.25, pattern="all", options={"slack": 4.0})), std=0.3).eval()
    idx = torch.randint(0, 256, (2, T))
    topk_sets, causal_sets = processed(m, idx, "topk"), processed(m, idx, "causal")
    assert all(0 < s.float().mean() < 1 for s in topk_sets)
    assert all(torch.equal(a, b) for a, b in zip(topk_sets, causal_sets))
    with torch.no_grad():
        torch.testing.assert_close(m(idx).logits, m(idx, routing_mode="causal").logits, atol=1e-5, rtol=1e-5)
    assert leak_rate(m, idx) == 0.0  # the decision at t never depends on later tokens


def test_overflow_beyond_k_max_drops_the_lowest_scores_and_is_counted():
    torch.manual_seed(3)
    m = GPT(CFG, RoutingConfig("token_choice", capacity=0.125, pattern="all", options={"slack": 1.0}))
    for r in m.routers:
        torch.nn.init.constant_(r.scorer.proj.bias, 5.0)  # every token wants to be processed
    m.set_collect_stats(True)
    with torch.no_grad():
        out = m(torch.randint(0, 256, (2, T)))
    for s in out.stats:
        assert s["layer_processed"].sum(-1).tolist() == [8, 8]  # k_max = ⌈1.0 · 0.125 · 64⌉
        assert s["overflow"].item() == 1.0


def test_threshold_is_straight_through_processed_tokens_get_exactly_the_delta():
    torch.manual_seed(4)
    m = spread(GPT(CFG, RoutingConfig("threshold", capacity=0.25, pattern="all")))
    block: RoutedBlock = m.layers[0]
    x = torch.randn(2, T, CFG.width, requires_grad=True)
    r = block.router.route(x, block.capacity.k(T))
    valid_weights = r.weight.squeeze(-1)[r.valid]
    assert torch.equal(valid_weights.detach(), torch.ones_like(valid_weights))  # forward: exactly 1
    valid_weights.sum().backward()
    assert block.router.scorer.proj.weight.grad.abs().sum() > 0  # backward: the sigmoid's gradient
    penalty = r.aux_losses["capacity_penalty"]
    wanting = block.router.decide_causal(x).float().mean().item()  # the rule's share, before the k_max cap
    assert penalty.item() == pytest.approx(max(0.0, wanting - 0.25), abs=1e-6)


def test_token_choice_balance_loss_pulls_the_rate_to_the_capacity():
    torch.manual_seed(5)
    m = GPT(CFG, RoutingConfig("token_choice", capacity=0.25, pattern="all"))
    opt = torch.optim.Adam([p for r in m.routers for p in r.parameters()], lr=0.05)
    idx = torch.randint(0, 256, (4, T))
    for _ in range(60):
        out = m(idx, idx)
        loss = sum(out.aux_losses.values())
        opt.zero_grad()
        loss.backward()
        opt.step()
    rate = torch.cat([p.float().flatten() for p in processed(m, idx)]).mean().item()
    assert abs(rate - 0.25) < 0.1


# --- p-MoD: TanhNorm and STRing ------------------------------------------------------------------
@pytest.mark.parametrize("string", [True, False])
def test_pmod_scales_skipped_tokens_by_their_tanhnorm_weight(string):
    torch.manual_seed(6)
    m = spread(GPT(CFG, RoutingConfig("pmod", capacity=0.25, pattern="all", options={"string": string})))
    block: RoutedBlock = m.layers[0]
    x = torch.randn(2, T, CFG.width)
    out = block(x, m.rope_cos, m.rope_sin)
    skipped = ~out.processed
    w = 0.2 * torch.tanh(block.router.scorer(x)) + 1
    assert ((w > 0.8) & (w < 1.2)).all()
    expected = x * w.unsqueeze(-1) if string else x
    torch.testing.assert_close(out.x[skipped], expected[skipped])
    # STRing gives the router a gradient from the tokens it skips; without it, none
    out.x[skipped].sum().backward()
    grad = block.router.scorer.proj.weight.grad
    assert (grad is not None and grad.abs().sum() > 0) == string


# --- capacity warm-up ------------------------------------------------------------------------------
def test_capacity_warmup_falls_from_one_to_c_and_flop_budgets_count_each_step(tmp_cwd):
    from modbench.config.run import RunConfig, TrainConfig
    from modbench.run.train import train

    routing = RoutingConfig("sigmoid", capacity=0.25, pattern="all", capacity_warmup_steps=10)
    m = GPT(CFG, routing)
    ks = []
    for step in range(12):
        m.set_step(step)
        ks.append(m.layers[0].capacity.k(T))
    assert ks[0] == T and ks[10:] == [16, 16] and ks == sorted(ks, reverse=True)
    m.set_step(10**9)
    steady = m.flops_per_token(T)
    assert m.training_flops_per_token(T, 30) > 30 * steady  # the warm-up steps cost more
    assert m.training_flops_per_token(T, 30) - m.training_flops_per_token(T, 29) == pytest.approx(steady)
    # a FLOP budget buys fewer steps with the warm-up than without, and is never exceeded
    model_cfg = ModelConfig(depth=4, n_embd=32, head_dim=8, max_seq_len=32)
    budget = "flops=5e8"
    results = []
    for warm in (0, 10):
        cfg = RunConfig(model_cfg, RoutingConfig("sigmoid", 0.25, pattern="all", capacity_warmup_steps=warm),
                        TrainConfig(dataset="arithmetic", seq_len=32, batch_size=4, budget=budget, eval_every=1000,
                                    eval_windows=4, track=False))
        results.append(train(cfg))
    assert results[1].steps < results[0].steps
    assert all(r.flops <= 5e8 for r in results)
    assert results[1].flops > 5e8 * 0.9  # and nearly spent


# --- MoDE (staged): MoD routing, then a top-1 mixture of expert MLPs -------------------------------
def test_mode_staged_runs_each_processed_token_through_its_top_expert():
    from modbench.model.gpt import TopOneMoE

    torch.manual_seed(7)
    m = GPT(CFG, RoutingConfig("mode_staged", capacity=0.25, pattern="all", options={"experts": 3}))
    moe = m.layers[0].block.mlp
    assert isinstance(moe, TopOneMoE) and len(moe.experts) == 3
    h = torch.randn(2, 10, CFG.width)
    with torch.no_grad():
        got = moe(h)
        p = torch.softmax(moe.gate(h), -1)
        for b in range(2):
            for t in range(10):
                e = int(p[b, t].argmax())
                torch.testing.assert_close(got[b, t], p[b, t, e] * moe.experts[e](h[b, t]), rtol=1e-5, atol=1e-6)
    out = m(torch.randint(0, 256, (2, T)), torch.randint(0, 256, (2, T)))
    assert out.aux_losses["expert_balance"].item() >= 1.0 - 1e-6  # n·Σ f·P ≥ 1, equality when balanced
    # FLOPs: one expert per token plus the gate: the MLP part grows by the gate only
    plain = GPT(CFG, RoutingConfig("sigmoid", capacity=0.25, pattern="all"))
    grow = m.flop_report(T).breakdown["mlp"] - plain.flop_report(T).breakdown["mlp"]
    k = m.layers[0].capacity.k(T)
    assert grow == pytest.approx(CFG.layers * k * 2 * CFG.width * 3)
