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
    assert penalty.item() == pytest.approx(abs(wanting - 0.25), abs=1e-6)  # two-sided, the default


@pytest.mark.parametrize("budget", ["two_sided", "one_sided"])
def test_threshold_budget_penalty_pulls_a_share_below_c_back_up_only_when_two_sided(budget):
    """relu(share − C) has no gradient below C, so nothing stops the share collapsing to ~0 (issue 26);
    |share − C| pulls it back. The share here is far below C at the start (a negative bias)."""
    torch.manual_seed(12)
    m = spread(GPT(CFG, RoutingConfig("threshold", capacity=0.25, pattern="all", options={"budget": budget})), std=0.3)
    for r in m.routers:
        torch.nn.init.constant_(r.scorer.proj.bias, -5.0)
    idx = torch.randint(0, 256, (4, T))
    before = torch.cat([p.float().flatten() for p in processed(m, idx)]).mean().item()
    opt = torch.optim.Adam([p for r in m.routers for p in r.parameters()], lr=0.1)
    for _ in range(80):
        loss = sum(m(idx, idx).aux_losses.values())
        opt.zero_grad()
        loss.backward()
        opt.step()
    after = torch.cat([p.float().flatten() for p in processed(m, idx)]).mean().item()
    assert before < 0.01
    if budget == "two_sided":
        assert abs(after - 0.25) < 0.1
    else:
        assert after == before  # no gradient below C: the share stays where it fell


def test_expert_threshold_decides_by_one_rule_in_training_and_decoding():
    """r >= θ, θ an EMA of the steps' capacity quantile: after a few steps the share is about C, the top-k
    forward (the batched training path) and the causal forward are the same computation, nothing leaks,
    and there is no auxiliary loss."""
    torch.manual_seed(6)
    m = spread(GPT(CFG, RoutingConfig("expert_threshold", capacity=0.25, pattern="all", options={"slack": 4.0})), std=0.3)
    g = torch.Generator().manual_seed(6)
    for step in range(8):
        m.set_step(step)
        with torch.no_grad():
            out = m(torch.randint(0, 256, (4, T), generator=g))
        assert out.aux_losses == {}
    m.set_step(8)
    assert all(r.theta.value.item() != 0.0 for r in m.routers)
    idx = torch.randint(0, 256, (4, T), generator=g)
    m.train()
    topk_sets = processed(m, idx, "topk")  # training mode: the rule the training forward applies
    m.eval()
    causal_sets = processed(m, idx, "causal")
    assert all(abs(s.float().mean().item() - 0.25) < 0.1 for s in topk_sets)
    assert all(torch.equal(a, b) for a, b in zip(topk_sets, causal_sets))
    with torch.no_grad():
        torch.testing.assert_close(m(idx).logits, m(idx, routing_mode="causal").logits, atol=1e-5, rtol=1e-5)
    assert leak_rate(m, idx) == 0.0


def test_expert_threshold_weights_the_delta_by_sigmoid_of_the_margin_so_the_router_learns():
    torch.manual_seed(7)
    m = spread(GPT(CFG, RoutingConfig("expert_threshold", capacity=0.25, pattern="all")))
    block: RoutedBlock = m.layers[0]
    router = block.router
    with torch.no_grad():
        router.theta.value.fill_(0.3)
    x = torch.randn(2, T, CFG.width)
    r = router.route(x, block.capacity.k(T))
    selected = router.score(x).gather(-1, r.index)
    torch.testing.assert_close(r.weight.squeeze(-1), torch.sigmoid(selected - 0.3))
    assert bool((selected[r.valid] >= 0.3).all()) and bool((selected[~r.valid] < 0.3).all())
    with torch.no_grad():
        router.theta.value.zero_()  # (0.3 is above every score of the model's own small hidden states)
    idx = torch.randint(0, 256, (2, T))
    m(idx, idx).loss.backward()
    assert all(l.router.scorer.proj.weight.grad.abs().sum() > 0 for l in m.layers)  # the LM loss reaches the router


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


# --- A-MoD: attention received in the previous layer ----------------------------------------------
def _attention_by_hand(m: GPT, layer: int, x: torch.Tensor) -> torch.Tensor:
    """softmax(QKᵀ/√hd) of ``m.layers[layer]`` on the residual stream ``x``, causal, averaged over heads."""
    block = m.layers[layer].block
    T_ = x.shape[1]
    q, k, _ = block.attn.project(block.norm1(x), m.rope_cos[:T_], m.rope_sin[:T_])
    logits = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    causal = torch.ones(T_, T_, dtype=torch.bool).tril()
    return torch.softmax(logits.masked_fill(~causal, -math.inf), -1).mean(1)  # (B, T, T)


def test_amod_scores_the_attention_received_in_the_previous_layer():
    torch.manual_seed(8)
    m = GPT(CFG, RoutingConfig("amod", capacity=0.25, pattern="alternate")).eval()  # D M D M
    idx = torch.randint(0, 256, (2, T))
    with torch.no_grad():
        x = m.embed(idx)
        a = _attention_by_hand(m, 0, x)
        n = torch.arange(1, T + 1, dtype=a.dtype)  # keys each query sees
        received = (a * n.unsqueeze(-1)).sum(-2) / (T - torch.arange(T, dtype=a.dtype))  # mean over the queries i >= j
        out = m.layers[0](x, m.rope_cos, m.rope_sin)
        torch.testing.assert_close(out.attention.received, received, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(out.attention.self_weight, a.diagonal(dim1=-2, dim2=-1) * n, rtol=1e-5, atol=1e-5)
        # uniform attention scores every token 1: early tokens are not favoured by the causal mask
        uniform = torch.ones(T, T).tril() / n.unsqueeze(-1)
        assert torch.allclose((uniform * n.unsqueeze(-1)).sum(-2) / (T - torch.arange(T)), torch.ones(T))
        # the next routed layer processes the top-k of that score
        routed = m.layers[1](out.x, m.rope_cos, m.rope_sin, out.attention)
        k = m.layers[1].capacity.k(T)
        expected = torch.zeros(2, T, dtype=torch.bool).scatter_(1, torch.topk(received, k, -1).indices, True)
        assert torch.equal(routed.processed, expected)
    assert sum(p.numel() for r in m.routers for p in r.parameters()) == 0  # parameter-free


def test_amod_causal_rule_uses_the_tokens_own_attention_row():
    from modbench.run.causal_eval import calibrate_causal_rules

    torch.manual_seed(9)
    m = GPT(CFG, RoutingConfig("amod", capacity=0.25, pattern="alternate"))
    calibrate_causal_rules(m, [torch.randint(0, 256, (4, T))])
    m.eval()
    idx = torch.randint(0, 256, (3, T))
    decide = processed(m, idx, "causal")
    with torch.no_grad():
        a = _attention_by_hand(m, 0, m.embed(idx))
    own = a.diagonal(dim1=-2, dim2=-1) * torch.arange(1, T + 1)  # (t+1)·a_{t,t}: row t, key t only
    assert torch.equal(decide[0], own >= m.routers[0].threshold.value)
    share = decide[0].float().mean().item()
    assert 0.05 < share < 0.6  # calibrated on the k-th largest own weight: about C
    assert leak_rate(m, idx, routing_mode="causal") == 0.0
    assert leak_rate(m, idx) > 0.0  # top-k of the received attention sees later queries


@pytest.mark.parametrize("mode", ["topk", "causal"])
def test_amod_after_a_routed_layer_selects_within_its_selection(mode):
    """Tokens a routed layer skipped received no attention there: the next layer's choice nests."""
    from modbench.run.causal_eval import calibrate_causal_rules

    torch.manual_seed(10)
    m = GPT(CFG, RoutingConfig("amod", capacity=0.125, capacity_first=0.5, pattern="all"))
    calibrate_causal_rules(m, [torch.randint(0, 256, (4, T))])
    idx = torch.randint(0, 256, (3, T))
    sets = processed(m.eval(), idx, mode)
    for before, after in zip(sets, sets[1:]):
        assert not (after & ~before).any()
    assert sets[-1].sum() < sets[0].sum()
    if mode == "topk":  # layer 0 has no previous layer: the norm fallback, exactly `norm`'s choice
        with torch.no_grad():
            top = torch.topk(torch.linalg.vector_norm(m.embed(idx), dim=-1), m.layers[0].capacity.k(T), -1).indices
        assert torch.equal(sets[0], torch.zeros(3, T, dtype=torch.bool).scatter_(1, top, True))


def test_amod_counts_the_extra_attention_scores_in_the_previous_layer():
    m = GPT(CFG, RoutingConfig("amod", capacity=0.25, pattern="alternate"))
    plain = GPT(CFG, RoutingConfig("norm", capacity=0.25, pattern="alternate"))
    d = CFG.width
    for i, (a, b) in enumerate(zip(m.layers, plain.layers)):
        extra = a.flops(T).parts["router"] - b.flops(T).parts["router"]
        if i % 2 == 0:  # dense layers before a routed one: their T × T scores again
            assert extra == 2 * d * T * T
        else:  # the routed layers' own score is free (norm's is 2·d per token)
            assert extra == -2 * d * T
        assert a.flops(T).backward == b.flops(T).backward


# --- MoDE (integrated): one softmax over the expert MLPs and a no-op expert -------------------------
def integrated(experts: int = 3, capacity: float = 0.25, **options) -> GPT:
    torch.manual_seed(8)
    m = GPT(CFG, RoutingConfig("mode_integrated", capacity=capacity, pattern="all",
                               options={"experts": experts, **options}))
    for r in m.routers:
        torch.nn.init.normal_(r.gate.weight, std=0.5)  # a real spread of gate logits
    return m


def test_mode_integrated_router_and_mixture_read_one_gate_with_a_noop_expert():
    from modbench.model.gpt import TopOneMoE

    m = integrated(experts=3)
    block: RoutedBlock = m.layers[0]
    router, moe = block.router, block.block.mlp
    assert router.scope == "mlp" and isinstance(moe, TopOneMoE) and len(moe.experts) == 3
    assert moe.gate is router.gate and block.block.norm2 is router.norm  # shared, not copies
    assert router.gate.out_features == 4  # 3 experts + the no-op
    # counted once in the model, and trained with the blocks' own parameters
    assert sum(p.numel() for p in m.parameters()) == sum(p.numel() for _, p in m.named_parameters())


def test_mode_integrated_runs_only_the_topk_tokens_through_one_expert_each():
    """The no-op really saves the MLP: k of T tokens reach the experts, each exactly one expert, output
    x + p_e·expert_e(norm(x)) with p_e from the softmax over experts + no-op; the rest keep x bit for bit."""
    m = integrated(experts=3)
    block: RoutedBlock = m.layers[0]
    router, moe = block.router, block.block.mlp
    rows_run: list[int] = []
    hooks = [e.register_forward_hook(lambda mod, args, out: rows_run.append(args[0].shape[0])) for e in moe.experts]
    x = torch.randn(2, T, CFG.width)
    cos, sin = m.rope_cos, m.rope_sin
    out = block(x, cos, sin)
    for h in hooks:
        h.remove()
    k = block.capacity.k(T)
    assert k == 16 and sum(rows_run) == 2 * k  # one expert per processed token, none for the others
    with torch.no_grad():
        h = x + block.block.attention(x, cos[:T], sin[:T])  # scope "mlp": attention on every token
        logits = router.logits(h)
        margin = logits[..., :-1].amax(-1) - logits[..., -1]
        expected = torch.zeros(2, T, dtype=torch.bool).scatter_(1, margin.topk(k, -1).indices, True)
        assert torch.equal(out.processed, expected)  # top-k of the experts' margin over the no-op
        assert torch.equal(out.x[~expected], h[~expected])
        p = torch.softmax(logits, -1)
        for b, t in expected.nonzero().tolist():
            e = int(p[b, t, :-1].argmax())
            want = h[b, t] + p[b, t, e] * moe.experts[e](router.norm(h[b, t]))
            torch.testing.assert_close(out.x[b, t], want, rtol=1e-5, atol=1e-6)
    assert set(out.aux_losses) == {"router_bce", "expert_balance"}


def test_mode_integrated_causal_rule_is_argmax_not_the_noop_and_the_balance_is_over_real_experts():
    m = integrated(experts=4)
    router = m.routers[0]
    x = torch.randn(3, T, CFG.width)
    with torch.no_grad():
        p = torch.softmax(router.logits(x), -1)
        assert torch.equal(router.decide_causal(x), p.argmax(-1) != 4)
        assert 0 < router.decide_causal(x).float().mean() < 1
        assert router.causal_weight(x, router.decide_causal(x)) is None  # the mixture weights by p_e itself
    moe = m.layers[0].block.mlp.train()
    h = torch.randn(40, CFG.width)
    moe(h)
    with torch.no_grad():
        q = torch.softmax(moe.gate(h), -1)[:, :4]
        real = q / q.sum(-1, keepdim=True)  # the no-op's share renormalised away
        f = torch.bincount(q.argmax(-1), minlength=4).float() / 40
        torch.testing.assert_close(moe.balance, 4 * (f * real.mean(0)).sum())


def test_mode_integrated_aux_loss_teaches_the_causal_rule():
    torch.manual_seed(9)
    from modbench import variants

    router = variants.build_router("mode_integrated", 32, {"aux_weight": 1.0}).train()
    x = torch.randn(16, T, 32)
    k = 16

    def agreement() -> float:
        with torch.no_grad():
            member = torch.zeros(16, T, dtype=torch.bool).scatter_(1, router.route(x, k).index, True)
            return (router.decide_causal(x) == member).float().mean().item()

    before = agreement()
    opt = torch.optim.Adam(router.parameters(), lr=0.05)
    for _ in range(60):
        loss = router.route(x, k).aux_losses["router_bce"]
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert agreement() > max(0.9, before)


@pytest.mark.parametrize("experts", [2, 5])
def test_mode_integrated_flops_count_the_gate_everywhere_and_one_expert_per_processed_token(experts):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    m = integrated(experts=experts)
    plain = GPT(CFG, RoutingConfig("mlp_skip", capacity=0.25, pattern="all"))  # the MLP at k, no experts
    d, k, out = CFG.width, m.layers[0].capacity.k(T), experts + 1
    mine, ref = m.flop_report(T, causal=False), plain.flop_report(T, causal=False)
    # the router: the gate over E + 1 outputs on all T tokens (mlp_skip's scorer: one output)
    assert mine.breakdown["router"] - ref.breakdown["router"] == pytest.approx(CFG.layers * T * 2 * d * (out - 1))
    # the MLP part: one expert's MLP per processed token, plus the mixture's gate on those k tokens
    assert mine.breakdown["mlp"] - ref.breakdown["mlp"] == pytest.approx(CFG.layers * k * 2 * d * out)
    idx = torch.randint(0, 256, (2, T))
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as fc:
        o = m(idx, idx)
    assert mine.forward == pytest.approx(fc.get_total_flops() / 2, rel=1e-9)
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as fc:
        o = m(idx, idx)
        (o.loss + m.weighted_aux_loss(o.aux_losses, 10**6)).backward()
    assert mine.total == pytest.approx(fc.get_total_flops() / 2, rel=1e-9)
    # without the BCE nothing backpropagates through the router's gate call, and the count says so
    m0 = GPT(CFG, RoutingConfig("mode_integrated", capacity=0.25, pattern="all",
                                options={"experts": experts, "aux_weight": 0.0}))
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as fc:
        o = m0(idx, idx)
        (o.loss + m0.weighted_aux_loss(o.aux_losses, 10**6)).backward()
    assert m0.flop_report(T, causal=False).total == pytest.approx(fc.get_total_flops() / 2, rel=1e-9)


@pytest.mark.parametrize("name", ["mode_staged", "mode_integrated"])
def test_mixture_of_experts_at_inference_keeps_each_row_independent_of_the_others(name):
    """In eval mode the mixture runs fixed shapes: changing later rows leaves earlier rows bit-identical
    (ragged expert slices would change the earlier rows' rounding), and it equals the training path."""
    torch.manual_seed(10)
    m = GPT(CFG, RoutingConfig(name, capacity=0.25, pattern="all", options={"experts": 4}))
    moe = m.layers[0].block.mlp
    torch.nn.init.normal_(moe.gate.weight, std=0.5)
    h = torch.randn(3 * T, CFG.width)
    with torch.no_grad():
        trained = moe.train()(h)
        base = moe.eval()(h)
        torch.testing.assert_close(base, trained, rtol=1e-5, atol=1e-6)
        for cut in (5, 40, 100):
            other = h.clone()
            other[cut:] = torch.randn(3 * T - cut, CFG.width)
            assert torch.equal(moe(other)[:cut], base[:cut])


# --- issue 26, item 5: plumbing ----------------------------------------------------------------------
def test_k_max_is_slack_times_the_fixed_count_k_in_code_and_docs():
    """k_max = min(T, ⌈slack·k⌉), k = max(1, ⌊C·T⌋): the code, the variant's docs and docs/variants.md say one thing."""
    from pathlib import Path

    import modbench.variants.token_choice as token_choice

    for name in ("token_choice", "threshold"):
        for C, seq_len, slack, expected in [(0.125, 100, 2.0, 24), (0.125, 64, 1.0, 8), (0.01, 50, 3.0, 3),
                                            (0.5, 64, 2.0, 64), (0.3, 10, 1.5, 5)]:
            m = GPT(ModelConfig(depth=1, n_embd=32, head_dim=8, max_seq_len=128),
                    RoutingConfig(name, capacity=C, pattern="all", options={"slack": slack}))
            block: RoutedBlock = m.layers[0]
            k = block.capacity.k(seq_len)
            assert k == max(1, math.floor(C * seq_len + 1e-9))
            assert block.router.tokens_run(k, seq_len) == expected == min(seq_len, math.ceil(slack * k))
    root = Path(__file__).resolve().parents[1]
    variants_doc = (root / "docs" / "variants.md").read_text()
    for text in (variants_doc, token_choice.__doc__):
        assert "⌈slack·C·T⌉" not in text.replace(" ", "")
        assert "⌈slack·k⌉" in text.replace(" ", "")
    assert "⌈slack·C·T⌉" not in (root / "README.md").read_text().replace(" ", "")


def test_learned_temperature_stays_in_its_bounds_and_keeps_a_gradient_there():
    """The clamped τ of old froze once it left [0.1, 5] (zero gradient); the sigmoid bound does not:
    τ follows a target to either end of its range and back, strictly inside the bounds."""
    torch.manual_seed(8)
    router = GPT(CFG, RoutingConfig("learned_temperature", capacity=0.25, pattern="all")).routers[0]
    lo, hi = router.config.temperature_min, router.config.temperature_max
    assert router.tau().item() == pytest.approx(router.config.temperature_init, rel=1e-5)
    for target in (hi - 0.1, lo + 0.1, 2.0):
        opt = torch.optim.Adam([router.temperature_logit], lr=0.2)
        for _ in range(400):
            opt.zero_grad()
            ((router.tau() - target) ** 2).backward()
            opt.step()
            assert lo < router.tau().item() < hi
        assert router.tau().item() == pytest.approx(target, abs=0.05)
    with torch.no_grad():
        router.temperature_logit.fill_(12.0)  # τ a hair below the top bound: still a gradient
    router.temperature_logit.grad = None
    r = torch.randn(4, 8)
    router.mix_weight(r, r).sum().backward()
    assert router.temperature_logit.grad.abs().item() > 0


@pytest.mark.parametrize("old_tau, expected", [(0.7, 0.7), (3.0, 3.0), (9.0, 5.0), (0.01, 0.1)])
def test_learned_temperature_converts_a_checkpoint_of_the_clamped_form(old_tau, expected):
    """A state dict with the old ``temperature`` parameter loads into the new form with the τ the old
    forward used (its clamp applied); strict loading sees no missing or unexpected key."""
    m = GPT(CFG, RoutingConfig("learned_temperature", capacity=0.25, pattern="all"))
    state = m.state_dict()
    for key in [k for k in state if k.endswith("router.temperature_logit")]:
        del state[key]
        state[key.replace("temperature_logit", "temperature")] = torch.tensor(old_tau)
    m.load_state_dict(state)
    for r in m.routers:
        assert r.tau().item() == pytest.approx(expected, abs=1e-4)


@pytest.mark.parametrize("init, bounds", [(0.1, (0.1, 5.0)), (5.0, (0.1, 5.0)), (2.0, (3.0, 5.0))])
def test_learned_temperature_init_must_be_strictly_inside_its_bounds(init, bounds):
    with pytest.raises(ModbenchError, match="temperature_min < temperature_init < temperature_max"):
        GPT(CFG, RoutingConfig("learned_temperature", capacity=0.25, pattern="all", options={
            "temperature_init": init, "temperature_min": bounds[0], "temperature_max": bounds[1]}))
    fixed = GPT(CFG, RoutingConfig("learned_temperature", capacity=0.25, pattern="all", options={
        "temperature_init": 1.0, "temperature_min": 1.0, "temperature_max": 1.0})).routers[0]
    assert fixed.tau().item() == 1.0


def _calibrated(name: str, options: dict, pattern: str = "all") -> GPT:
    from modbench.run.causal_eval import calibrate_causal_rules

    torch.manual_seed(9)
    m = spread(GPT(CFG, RoutingConfig(name, capacity=0.25, pattern=pattern, options=options)))
    calibrate_causal_rules(m, [torch.randint(0, 256, (4, T))])
    return m.eval()


def _causal_and_cached_decoding_agree(m: GPT) -> None:
    """No look-ahead in causal mode, and KV-cached generation equal to the causal forward."""
    from modbench.model.decode import generate

    idx = torch.randint(0, 256, (2, 32))
    assert leak_rate(m, idx, routing_mode="causal") == 0.0
    out = generate(m, idx[:, :3], 12, temperature=0, return_logits=True)
    with torch.no_grad():
        full = m(out.tokens[:, :-1], routing_mode="causal").logits
    torch.testing.assert_close(out.logits, full, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("weight_scope", ["mlp", "block"])
def test_pmod_weight_scope_mlp_weights_the_mlp_output_only(weight_scope):
    """"mlp" (default, p-MoD's released code): a processed token becomes x + attn + w·mlp; "block":
    x + w·(attn + mlp). Skipped tokens are w·x either way (STRing)."""
    torch.manual_seed(10)
    options = {} if weight_scope == "mlp" else {"weight_scope": "block"}
    m = spread(GPT(CFG, RoutingConfig("pmod", capacity=0.25, pattern="all", options=options)))
    assert m.routers[0].mixing.weight == weight_scope
    block: RoutedBlock = m.layers[0]
    x = torch.randn(2, T, CFG.width)
    with torch.no_grad():
        out = block(x, m.rope_cos, m.rope_sin)
        w = 0.2 * torch.tanh(block.router.scorer(x)) + 1
        for b in range(2):
            idx = out.processed[b].nonzero().squeeze(1)
            sub = x[b, idx].unsqueeze(0)
            cos, sin = m.rope_cos[idx].view(1, 1, len(idx), -1), m.rope_sin[idx].view(1, 1, len(idx), -1)
            a = block.block.attention(sub, cos, sin)
            mlp = block.block.mlp(block.block.norm2(sub + a))
            wb = w[b, idx].view(1, -1, 1)
            expected = sub + a + wb * mlp if weight_scope == "mlp" else sub + wb * (a + mlp)
            torch.testing.assert_close(out.x[b, idx].unsqueeze(0), expected, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(out.x[~out.processed], (x * w.unsqueeze(-1))[~out.processed])
    _causal_and_cached_decoding_agree(_calibrated("pmod", options))


def test_pmod_weight_scope_is_validated():
    with pytest.raises(ModbenchError, match="weight_scope"):
        GPT(CFG, RoutingConfig("pmod", capacity=0.25, pattern="all", options={"weight_scope": "attn"}))


def test_sigmoid_raw_weighting_multiplies_the_block_output_by_r_itself():
    """Raposo et al. §3.4: x + r·f(x) for the top-k tokens, r the raw router output ("raw");
    "sigmoid" (the default, from the blog) gives x + sigmoid(r)·f(x)."""
    torch.manual_seed(11)
    x = torch.randn(2, T, CFG.width)
    outs = {}
    for weighting in ("raw", "sigmoid"):
        torch.manual_seed(11)
        m = spread(GPT(CFG, RoutingConfig("sigmoid", capacity=0.25, pattern="all", options={"weighting": weighting})))
        block: RoutedBlock = m.layers[0]
        with torch.no_grad():
            out = block(x, m.rope_cos, m.rope_sin)
            r = block.router.scorer(x)
        outs[weighting] = (out, r)
    (raw, r), (sig, _) = outs["raw"], outs["sigmoid"]
    assert torch.equal(raw.processed, sig.processed)  # the same selection: only the weight differs
    p = raw.processed
    delta_sig = (sig.x - x)[p] / torch.sigmoid(r)[p].unsqueeze(-1)  # f(x) of the processed tokens
    torch.testing.assert_close((raw.x - x)[p], r[p].unsqueeze(-1) * delta_sig, rtol=1e-4, atol=1e-5)
    assert torch.equal(raw.x[~p], x[~p])
    _causal_and_cached_decoding_agree(_calibrated("sigmoid", {"weighting": "raw"}))
    with pytest.raises(ModbenchError, match="weighting"):
        GPT(CFG, RoutingConfig("sigmoid", capacity=0.25, pattern="all", options={"weighting": "softmax"}))
