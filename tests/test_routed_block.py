"""Correctness of routed layers, swept over every registered variant (like timm's tests)."""

from dataclasses import replace

import pytest
import torch

from modbench import variants
from modbench.config.capacity import CapacitySchedule
from modbench.config.model import ModelConfig, RoutingConfig
from modbench.errors import ModbenchError
from modbench.model.gpt import GPT, RoutedBlock

ALL = variants.list_variants() + variants.decode_aliases()  # and every "+aux" decode rule
ROUTED = [v for v in ALL if variants.get_variant(v).build(8).scope != "none"]
CFG = ModelConfig(depth=3, n_embd=64, head_dim=16, max_seq_len=64)
B, T = 3, 48


def routed_block(name: str, capacity: float = 0.25, seed: int = 0) -> RoutedBlock:
    torch.manual_seed(seed)
    router = variants.build_router(name, CFG.width)
    block = RoutedBlock(CFG, router, CapacitySchedule(capacity, max_seq_len=CFG.max_seq_len))
    # Give learned scorers a non-trivial spread so the selection is not decided by ties.
    for p in router.parameters():
        torch.nn.init.normal_(p, std=0.5) if p.dim() > 0 else None
    return block.train()


def rope():
    m = GPT(CFG)
    return m.rope_cos, m.rope_sin


def run(block, x, seed=1):
    cos, sin = rope()
    torch.manual_seed(seed)
    return block(x, cos, sin)


def reference_input(x, block):
    """What unselected tokens must equal: x itself, or x + attention for mlp_skip."""
    if block.router.scope == "mlp":
        cos, sin = rope()
        with torch.no_grad():
            return x + block.block.attn(block.block.norm1(x), cos[:T], sin[:T])
    return x


def test_sweep_covers_all_routed_variants():
    assert {"norm", "linear_softmax", "sigmoid", "learned_temperature", "mlp_skip", "random", "nested", "token_choice",
            "threshold", "pmod"} <= set(ROUTED)


@pytest.mark.parametrize("name", ROUTED)
def test_processed_count_is_k_and_unselected_tokens_are_bit_identical(name):
    block = routed_block(name)
    x = torch.randn(B, T, CFG.width)
    with torch.no_grad():
        out = run(block, x).x
        base = reference_input(x, block)  # (builds a GPT for RoPE: before seeding the route's RNG)
        torch.manual_seed(1)
        r = block.router.route(base, block.capacity.k(T))
    k = block.capacity.k(T)
    assert k == 12 and r.index.shape == (B, block.router.tokens_run(k, T))
    with torch.no_grad():  # skipped rows: x itself, bit for bit — or w·x for p-MoD's STRing, by design
        skipped = block.skipped(base)
    assert (skipped is base) == (block.router.skip_scale(base) is None)
    changed = (out != skipped).any(-1)
    selected = r.processed(T)
    assert torch.equal(out[~selected], skipped[~selected])  # bit-identical, not allclose
    assert torch.equal(changed, selected)  # exactly the processed tokens were written
    if block.router.soft_gate:  # a soft gate (tsa): training runs every token, each update scaled by its weight
        assert r.valid is None and changed.all()
    elif r.valid is None:
        assert changed.sum(-1).tolist() == [k] * B  # expert choice: exactly k per sequence
    else:  # a variable count (token choice, threshold): what the rule decided, within the k_max slots
        assert changed.sum(-1).tolist() == r.valid.sum(-1).tolist()
        # Some slot is unused, unless the rule wants at least k_max tokens of every sequence at this spread: dtrnet's
        # two-layer router wants attention for 2/3 of the tokens, null_experts a real expert for E/(E + 1) (its best
        # of E logits against one null logit), so they fill every slot; tests/test_dtrnet.py and
        # tests/test_null_experts.py check their unused slots on centred logits.
        with torch.no_grad():
            full = bool((block.router.decide_causal(base).sum(-1) >= r.index.shape[-1]).all())
        assert 0 < changed.sum() < B * r.index.shape[-1] or full


@pytest.mark.parametrize("name", ROUTED)
def test_indices_ascending_and_equal_to_topk_of_the_score(name):
    block = routed_block(name)
    x = torch.randn(B, T, CFG.width)
    k = block.capacity.k(T)
    with torch.no_grad():
        torch.manual_seed(3)
        r = block.router.route(x, k)
        torch.manual_seed(3)
        scores = block.router.score(x)
    assert (r.index[:, 1:] > r.index[:, :-1]).all()
    expected = torch.topk(scores, block.router.tokens_run(k, T), dim=-1).indices.sort(-1).values
    assert torch.equal(r.index, expected)


@pytest.mark.parametrize("name", ROUTED)
def test_routed_block_equals_dense_block_on_the_subset_at_original_positions(name):
    block = routed_block(name)
    x = torch.randn(B, T, CFG.width)
    cos, sin = rope()
    with torch.no_grad():
        out = run(block, x).x
        base = reference_input(x, block)
        torch.manual_seed(1)
        r = block.router.route(base, block.capacity.k(T))
        valid = torch.ones_like(r.index, dtype=torch.bool) if r.valid is None else r.valid
        for b in range(B):  # loop on purpose: independent of the batched gather and of the masks
            idx = r.index[b][valid[b]]  # the processed positions of this sequence, ascending
            sub = base[b, idx].unsqueeze(0)
            if block.router.scope == "mlp":
                delta = block.block.mlp(block.block.norm2(sub))
            elif block.router.scope == "attention":  # DTRNet: x + w·attn on the subset, then the MLP
                c, s = cos[idx].unsqueeze(0).unsqueeze(0), sin[idx].unsqueeze(0).unsqueeze(0)
                h = sub + block.block.attention(sub, c, s) * r.weight[b][valid[b]]
                torch.testing.assert_close(out[b, idx].unsqueeze(0), h + block.block.mlp_delta(h), rtol=1e-5, atol=1e-6)
                continue
            elif block.mixing.weight == "sublayers":  # x + w·attn + w·mlp(x + w·attn) (TSA), w > 0
                w = r.weight[b][valid[b]]
                a = block.block.attention(sub, cos[idx].unsqueeze(0).unsqueeze(0), sin[idx].unsqueeze(0).unsqueeze(0)) * w
                delta = a + block.block.mlp(block.block.norm2(sub + a)) * w
            elif block.mixing.weight == "mlp" and r.weight is not None:  # x + attn + w·mlp (p-MoD)
                a = block.block.attention(sub, cos[idx].unsqueeze(0).unsqueeze(0), sin[idx].unsqueeze(0).unsqueeze(0))
                delta = a + block.block.mlp(block.block.norm2(sub + a)) * r.weight[b][valid[b]]
            else:  # a dense block on the subset, original positions
                delta = block.block.delta(sub, cos[idx].unsqueeze(0).unsqueeze(0), sin[idx].unsqueeze(0).unsqueeze(0))
                if block.mixing.output:  # mor: the weight scales the block's output x + Δ (its released code)
                    delta = delta + sub
            if r.weight is not None and block.mixing.weight == "block":
                delta = delta * r.weight[b][valid[b]]
            torch.testing.assert_close(out[b, idx].unsqueeze(0), sub + delta, rtol=1e-5, atol=1e-6)


def test_routed_attention_uses_original_positions_not_subset_positions():
    block = routed_block("norm")
    x = torch.randn(B, T, CFG.width)
    cos, sin = rope()
    with torch.no_grad():
        out = run(block, x).x
        r = block.router.route(x, block.capacity.k(T))
        idx = r.index
        sub = torch.stack([x[b, idx[b]] for b in range(B)])
        k = idx.shape[1]
        wrong = sub + block.block.delta(sub, cos[:k], sin[:k])  # positions 0..k-1
        got = torch.stack([out[b, idx[b]] for b in range(B)])
    assert not torch.allclose(got, wrong, atol=1e-4)


@pytest.mark.parametrize("name", ALL)
def test_model_forward_backward_reaches_every_parameter(name):
    torch.manual_seed(0)
    m = GPT(CFG, RoutingConfig(name, capacity=0.25, pattern="alternate"))
    idx = torch.randint(0, 256, (B, T))
    out = m(idx, idx)
    assert out.logits.shape == (B, T, 256)
    assert torch.isfinite(out.logits).all() and torch.isfinite(out.loss)
    aux = m.weighted_aux_loss(out.aux_losses, step=10**6)
    total = out.loss + (aux if aux is not None else 0.0)
    total.backward()
    missing = [n for n, p in m.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert missing == []
    if name != "dense":
        assert m.routers, "a routed variant built no router"
    n_router_params = sum(p.numel() for r in m.routers for p in r.parameters())
    if name in ("norm", "random", "dense", "amod"):  # parameter-free routers
        assert n_router_params == 0
    else:
        assert n_router_params > 0


@pytest.mark.parametrize("name", ALL)
def test_capacity_one_is_exactly_the_dense_model(name):
    idx = torch.randint(0, 256, (2, 40))
    torch.manual_seed(7)
    dense = GPT(CFG, RoutingConfig("dense", capacity=1.0))
    torch.manual_seed(7)
    full = GPT(CFG, RoutingConfig(name, capacity=1.0, pattern="all"))
    assert full.routers == []
    assert torch.equal(dense(idx).logits, full(idx).logits)


@pytest.mark.parametrize("name", ALL)
def test_same_seed_same_output(name):
    idx = torch.randint(0, 256, (2, 40))
    outs = []
    for _ in range(2):
        torch.manual_seed(11)
        m = GPT(CFG, RoutingConfig(name, capacity=0.3))
        torch.manual_seed(12)
        outs.append(m(idx, idx))
    assert torch.equal(outs[0].logits, outs[1].logits)
    assert torch.equal(outs[0].loss, outs[1].loss)


@pytest.mark.parametrize("name", ROUTED)
def test_routing_stats_are_detached_and_sane(name):
    torch.manual_seed(0)
    m = GPT(CFG, RoutingConfig(name, capacity=0.25, pattern="all"))
    m.set_collect_stats(True)
    out = m(torch.randint(0, 256, (B, T)))
    assert len(out.stats) == CFG.layers
    for layer, s in zip(m.routers, out.stats):
        if layer.tokens_run(12, 48) == 12:
            assert s["fraction"].item() == pytest.approx(12 / 48)
        else:  # variable count: the realised share, within the k_max slots
            assert 0.0 <= s["fraction"].item() <= layer.tokens_run(12, 48) / 48
            assert s["fraction"].item() == pytest.approx(s["layer_processed"].float().mean().item())
        assert 0.0 <= s["mean_position"].item() <= 1.0
        assert 0.0 <= s["score_entropy"].item() <= 1.0 + 1e-6
        assert s["position_hist"].sum().item() == pytest.approx(1.0)
        buckets = torch.div(s["layer_index"] * 8, T, rounding_mode="floor").flatten()  # the slots' eighths of T
        assert torch.equal(s["position_hist"], torch.bincount(buckets, minlength=8).float() / buckets.numel())
        assert not any(v.requires_grad for v in s.values() if v.is_floating_point())


@pytest.mark.parametrize("name", ROUTED)
def test_decide_causal_is_per_token(name):
    """decide_causal must use only the token's own state: permuting tokens permutes decisions."""
    block = routed_block(name)
    x = torch.randn(B, T, CFG.width)
    with torch.no_grad():
        block.train()
        block.router.route(x, 12)  # lets calibrating routers observe one batch
        block.eval()
        perm = torch.randperm(T)
        torch.manual_seed(5)
        a = block.router.decide_causal(x)
        torch.manual_seed(5)
        b = block.router.decide_causal(x[:, perm])
    assert a.shape == (B, T) and a.dtype == torch.bool
    if name != "random":
        assert torch.equal(a[:, perm], b)


def test_sequence_longer_than_model_is_a_clear_error():
    m = GPT(CFG)
    with pytest.raises(ModbenchError, match="exceeds the model's max_seq_len 64"):
        m(torch.zeros(1, 65, dtype=torch.long))


def test_bad_routing_inputs_are_clear_errors():
    with pytest.raises(ModbenchError, match=r"\(0, 1\]"):
        GPT(CFG, RoutingConfig("norm", capacity=1.5))
    with pytest.raises(ModbenchError, match="unknown variant"):
        GPT(CFG, RoutingConfig("nrom", capacity=0.5))
    with pytest.raises(ModbenchError, match="layer pattern"):
        GPT(CFG, RoutingConfig("norm", capacity=0.5, pattern="alternating"))


def test_a_variable_count_router_that_weights_the_blocks_output_leaves_unused_slots_rows_unchanged():
    """x + w·(x + Δ) for a router with unused slots (``valid``) and no handoff base: an unused slot
    points at a row it does not process (often a processed one, or a skipped one), and must add
    nothing there — not w·x. token_choice made to weight its block's output, at C where its slots
    outnumber the tokens it picks."""
    block = routed_block("token_choice", capacity=0.25)
    block.set_mixing(replace(block.mixing, output=True))  # as a router declaring Mixing(output=True) would (mor's update)
    x = torch.randn(B, T, CFG.width)
    with torch.no_grad():
        layer = run(block, x)
        torch.manual_seed(1)
        r = block.router.route(x, block.capacity.k(T), None)
    assert r.valid is not None and not bool(r.valid.all()), "the sweep needs unused slots"
    processed = layer.processed
    assert torch.equal(layer.x[~processed], x[~processed])  # skipped rows bit for bit
    # a processed row got exactly one x + w·(x + Δ) (unused slots pointing at it added 0)
    w = torch.zeros(B, T).scatter(1, r.index, torch.where(r.valid, r.weight.squeeze(-1), torch.zeros(())))
    assert torch.all(w[processed] != 0)
