"""Recursive KV sharing (Mixture-of-Recursions, arXiv:2507.10524 §2.3; ``ModelConfig.kv_sharing``): every
later application of the shared block attends with its own queries to the keys and values the same
layer computed at the first application, and computes and caches none of its own. The training
forward, the causal mode and KV-cached decoding change together; FLOPs count the missing K/V
projections; KV bytes fall by the later steps' slots."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from modbench import variants
from modbench.config.io import read_toml
from modbench.config.model import ModelConfig, RoutingConfig
from modbench.config.run import RunConfig, TrainConfig
from modbench.errors import ModbenchError
from modbench.model.decode import Decoder, SharedLayerCache, generate
from modbench.model.gpt import GPT, apply_rope
from modbench.model.kv_sharing import KVAccess, KVShare
from modbench.run.causal_eval import calibrate_causal_rules, leak_rate

T = 32


def cfg(mode: str = "middle_cycle", n_r: int = 3, depth: int = 5, max_seq_len: int = T, share: bool = True) -> ModelConfig:
    return ModelConfig(depth=depth, n_embd=32, head_dim=8, max_seq_len=max_seq_len, recursion=mode, recursions=n_r,
                       kv_sharing=share)


def pattern(mode: str) -> str:
    return "fixed:1,1" if mode == "middle_cycle" else "all"  # every application of the shared block routed


def model(name: str, mode: str = "middle_cycle", n_r: int = 3, depth: int = 5, *, share: bool = True,
          capacity: float = 0.5, **routing) -> GPT:
    """A recursive model with routers that score sharply (std 0.5) and calibrated causal rules, in eval mode."""
    torch.manual_seed(0)
    m = GPT(cfg(mode, n_r, depth, share=share), RoutingConfig(name, capacity=capacity, pattern=pattern(mode), **routing))
    for r in m.routers:
        for pname, p in r.named_parameters():
            if pname.endswith("bias"):
                torch.nn.init.zeros_(p)
            elif p.dim() > 0:
                torch.nn.init.normal_(p, std=0.5)
    calibrate_causal_rules(m, [torch.randint(0, 256, (4, T))])
    return m.eval()


# --- the config ---------------------------------------------------------------------------------
def test_kv_sharing_needs_a_shared_block_in_one_line():
    with pytest.raises(ModbenchError) as e:
        ModelConfig(kv_sharing=True)
    assert str(e.value).startswith("model.kv_sharing needs a shared block") and "\n" not in str(e.value)
    assert not ModelConfig().kv_sharing  # recursion-wise caching stays the default
    with pytest.raises(ModbenchError, match="kv_sharing needs a shared block"):
        RunConfig.from_dict({"model": {"kv_sharing": True}})


def test_kv_sharing_round_trips_through_the_config_file(tmp_path):
    run = RunConfig(cfg(), RoutingConfig("mor", 1 / 3, pattern="fixed:1,1", capacities="1,2/3,1/3"),
                    TrainConfig(dataset="arithmetic", seq_len=T))
    (tmp_path / "run.toml").write_text(run.to_toml())
    back = RunConfig.from_dict(read_toml(tmp_path / "run.toml"))
    assert back == run and back.model.kv_sharing is True
    assert run.to_dict()["model.kv_sharing"] is True  # logged to MLflow with the model's params


def test_kv_sharing_flag_round_trips_through_print_config(tmp_cwd, capsys):
    from modbench.cli.main import main

    argv = ["train", "--dataset", "arithmetic", "--depth", "5", "--recursion", "middle_cycle", "--recursions", "3"]
    assert main([*argv, "--kv-sharing", "--print-config"]) == 0
    (tmp_cwd / "run.toml").write_text(capsys.readouterr().out)
    assert RunConfig.from_dict(read_toml(tmp_cwd / "run.toml")).model.kv_sharing is True
    assert main([*argv, "--no-kv-sharing", "--print-config"]) == 0
    assert "kv_sharing = false" in capsys.readouterr().out
    assert main(["train", "--dataset", "arithmetic", "--kv-sharing"]) == 2
    err = capsys.readouterr().err.strip()
    assert "model.kv_sharing needs a shared block" in err and "\n" not in err


def test_a_router_that_reads_the_previous_attention_is_refused():
    with pytest.raises(ModbenchError) as e:
        GPT(cfg("cycle", 2, 4), RoutingConfig("amod", 0.5, pattern="alternate"))
    assert "kv_sharing does not combine with variant 'amod'" in str(e.value) and "\n" not in str(e.value)


def test_which_positions_share_whose_keys():
    """Middle-Cycle N_R = 3 with a two-layer block: layer j of the block at steps 1, 2 reads layer j at step 0."""
    m = GPT(cfg("middle_cycle", 3, 8))
    assert [layer.kv_step for layer in m.layers] == [None, 0, 0, 1, 1, 2, 2, None]
    assert m.kv_sources == (None, None, None, 1, 2, 1, 2, None)
    assert GPT(cfg(share=False)).kv_sources == (None,) * 5


# --- the forward against a hand-computed reference ------------------------------------------------
def manual_attention(attn, h: torch.Tensor, qpos: torch.Tensor, k0: torch.Tensor, v0: torch.Tensor,
                     kpos: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """softmax(q·k0ᵀ/√hd) over step 0's keys at positions ≤ the query's, written out: q from the first d
    rows of qkv at the queries' own positions; a query with no such key gets 0."""
    B, n, d = h.shape
    H = attn.n_head
    q = (h @ attn.qkv.weight[:d].T).view(B, n, H, d // H).transpose(1, 2)
    q = apply_rope(q, cos[qpos].unsqueeze(1), sin[qpos].unsqueeze(1))
    scores = q @ k0.transpose(-2, -1) / math.sqrt(d // H)
    visible = (kpos.unsqueeze(1) <= qpos.unsqueeze(2)).unsqueeze(1)  # (B, 1, n, L)
    w = torch.softmax(scores.masked_fill(~visible, -math.inf), dim=-1).nan_to_num(0.0)
    return attn.proj((w @ v0).transpose(1, 2).reshape(B, n, d))


def step0_kv(attn, h: torch.Tensor, pos: torch.Tensor, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
    B, n, d = h.shape
    H = attn.n_head
    _, k, v = (h @ attn.qkv.weight.T).view(B, n, 3, H, d // H).permute(2, 0, 3, 1, 4)
    return apply_rope(k, cos[pos].unsqueeze(1), sin[pos].unsqueeze(1)), v


def test_dense_recursive_forward_equals_a_hand_computed_shared_kv_pass():
    """Cycle, N_R = 2, one-layer block, every token at both steps: step 1 attends to step 0's K/V."""
    torch.manual_seed(0)
    m = GPT(cfg("cycle", 2, 2)).eval()
    idx = torch.randint(0, 256, (2, T))
    block, cos, sin = m.layers[0].block, m.rope_cos[:T], m.rope_sin[:T]
    pos = torch.arange(T).expand(2, T)
    with torch.no_grad():
        x0 = m.embed(idx)
        x1 = block(x0, cos, sin)  # step 0: a plain block
        k0, v0 = step0_kv(block.attn, block.norm1(x0), pos, cos, sin)
        a = manual_attention(block.attn, block.norm1(x1), pos, k0, v0, pos, cos, sin)
        x2 = x1 + a + block.mlp(block.norm2(x1 + a))
        expected = m.head(m.norm(x2))
        torch.testing.assert_close(m(idx).logits, expected, atol=1e-5, rtol=1e-5)
        # and it is another model than recursion-wise caching (step 1's own K/V)
        unshared = GPT(dataclasses.replace(m.cfg, kv_sharing=False))
        unshared.load_state_dict(m.state_dict())
        assert not torch.allclose(unshared(idx).logits, expected, atol=1e-3)


@pytest.mark.parametrize("name, capacity, extra", [("mor", 1 / 3, dict(capacity_first=1.0)), ("sigmoid", 0.5, {})])
def test_routed_step_attends_to_the_tokens_step_0_processed(name, capacity, extra):
    """Top-k mode, Middle-Cycle N_R = 3: step 1's selected tokens attend, at their own positions, to the
    K/V of the tokens step 0 selected (mor: every token, capacity 1 at step 0; sigmoid: step 0 routed at
    C = 0.5, so the tokens it skipped are no keys, and a token before all of its keys gets attention 0)."""
    torch.manual_seed(0)
    m = GPT(cfg(max_seq_len=T), RoutingConfig(name, capacity, pattern="fixed:1,1", **extra))
    for r in m.routers:
        torch.nn.init.normal_(r.scorer.proj.weight, std=0.5)
    m.set_collect_stats(True)
    seen = {}
    hooks = [m.layers[i].register_forward_hook(lambda mod, args, out, i=i: seen.__setitem__(i, (args[0], out)))
             for i in (1, 2)]
    idx = torch.randint(0, 256, (2, T))
    with torch.no_grad():
        stats = m(idx).stats
    for h in hooks:
        h.remove()
    sel0, sel1 = stats[0]["layer_index"], stats[1]["layer_index"]
    assert sel0.shape[1] == (T if name == "mor" else T // 2)
    (x_in0, _), (x_in1, out1) = seen[1], seen[2]
    layer = m.layers[2]
    block, cos, sin = layer.block, m.rope_cos[:T], m.rope_sin[:T]
    with torch.no_grad():
        xs0 = x_in0.gather(1, sel0.unsqueeze(-1).expand(-1, -1, 32))
        k0, v0 = step0_kv(block.attn, block.norm1(xs0), sel0, cos, sin)
        xs = x_in1.gather(1, sel1.unsqueeze(-1).expand(-1, -1, 32))
        a = manual_attention(block.attn, block.norm1(xs), sel1, k0, v0, sel0, cos, sin)
        delta = a + block.mlp(block.norm2(xs + a))
        r = layer.router.route(x_in1, sel1.shape[1], stats[0]["layer_processed"])
        assert torch.equal(r.index, sel1)
        new = xs + r.weight * ((xs + delta) if layer.mixing.output else delta)
        expected = x_in1.scatter(1, sel1.unsqueeze(-1).expand(-1, -1, 32), new)
    torch.testing.assert_close(out1.x, expected, atol=1e-5, rtol=1e-5)
    if name == "sigmoid":  # some selected token at step 1 precedes every key of step 0 or is not one
        assert not torch.isin(sel1, sel0).all()


def test_a_query_with_no_step_0_key_gets_zero_attention():
    """Step 0 ran positions 2, 3, 5 and kept 2 and 5 (3 an unused slot): queries at 0 and 1 see no key
    (output 0, not NaN); 3 and 4 see exactly the key at 2, so they match a one-key attention."""
    torch.manual_seed(0)
    m = GPT(cfg("cycle", 2, 2))
    attn, cos, sin = m.layers[0].block.attn, m.rope_cos, m.rope_sin
    share, h = KVShare(), torch.randn(1, 6, 32)
    at = [2, 3, 5]
    KVAccess(share, True, torch.tensor([at]), torch.tensor([[True, False, True]])).attend(
        attn, h[:, at], cos[at].view(1, 1, 3, -1), sin[at].view(1, 1, 3, -1), None)
    out = KVAccess(share, False, torch.arange(6).unsqueeze(0)).attend(attn, h, cos[:6], sin[:6], None)
    assert torch.equal(out[0, :2], torch.zeros(2, 32))
    only_key = attn.proj(share.v[:, :, 0].reshape(1, 32))[0]  # softmax over one key: its value
    torch.testing.assert_close(out[0, 3], only_key)
    torch.testing.assert_close(out[0, 4], only_key)
    assert out.isfinite().all()


# --- causality, the KV cache, FLOPs, KV bytes, determinism ------------------------------------------
@pytest.mark.parametrize("name", ["dense", "sigmoid", "mor", "token_choice"])
def test_causal_mode_never_looks_ahead(name):
    m = model(name)
    idx = torch.randint(0, 256, (2, T))
    modes = ["causal", "topk"] if name == "dense" else ["causal"]  # top-k is causal only for a dense model
    with torch.no_grad():
        for mode in modes:
            base = m(idx, routing_mode=mode).logits
            for t in (0, 9, T - 2):
                other = idx.clone()
                other[:, t + 1 :] = torch.randint(0, 256, (2, T - t - 1))
                assert torch.equal(m(other, routing_mode=mode).logits[:, : t + 1], base[:, : t + 1])
    assert leak_rate(m, idx, routing_mode="causal") == 0.0


@pytest.mark.parametrize("name", ["dense", "sigmoid", "nested", "mor", "mlp_skip", "token_choice", "mor_token_choice"])
@pytest.mark.parametrize("mode, n_r, depth", [("cycle", 2, 2), ("middle_cycle", 3, 5)])
@pytest.mark.parametrize("batch", [1, 3])
def test_cached_generation_equals_the_causal_forward(name, mode, n_r, depth, batch):
    """The later steps read step 0's cache (``SharedLayerCache``): decoding is the causal pass."""
    m = model(name, mode, n_r, depth)
    prompt = torch.randint(0, 256, (batch, 5), generator=torch.Generator().manual_seed(batch))
    out = generate(m, prompt, 12, temperature=0, return_logits=True)
    full = m(out.tokens[:, :-1], routing_mode="causal").logits
    torch.testing.assert_close(out.logits, full, atol=1e-5, rtol=1e-5)
    if name != "dense":
        assert 0.0 < out.skipped_fraction < 1.0


def test_chunked_prefill_reads_step_0s_counts():
    """A prompt fed in two chunks, then tokens one at a time: the same logits as the causal pass."""
    m = model("sigmoid")
    idx = torch.randint(0, 256, (3, 20), generator=torch.Generator().manual_seed(1))
    dec = Decoder(m, 3, 20)
    with torch.no_grad():
        logits = [dec(idx[:, :6]), dec(idx[:, 6:11]), *(dec(idx[:, t : t + 1]) for t in range(11, 20))]
        full = m(idx, routing_mode="causal").logits
    torch.testing.assert_close(torch.cat(logits, 1), full, atol=1e-5, rtol=1e-5)


def counted(m: GPT, idx: torch.Tensor) -> tuple[float, float]:
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as fc:
        m(idx, idx)
    fwd = fc.get_total_flops()
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as fc:
        out = m(idx, idx)
        (out.loss + (m.weighted_aux_loss(out.aux_losses, 10**6) or 0.0)).backward()
    return fwd / idx.shape[0], fc.get_total_flops() / idx.shape[0]


@pytest.mark.parametrize("name", [v for v in variants.list_variants() if v != "amod"])
@pytest.mark.parametrize("pattern_", ["alternate", "fixed:1,1"])
def test_analytic_flops_match_flop_counter(name, pattern_):
    """Middle-Cycle N_R = 2 (alternate: step 0 routed, step 1 dense; fixed:1,1: both routed)."""
    torch.manual_seed(0)
    m = GPT(cfg("middle_cycle", 2, 4, max_seq_len=96), RoutingConfig(name, capacity=0.5, pattern=pattern_))
    fwd, total = counted(m, torch.randint(0, 256, (2, 96)))
    report = m.flop_report(96, causal=False)
    assert report.forward == pytest.approx(fwd, rel=0.01)
    assert report.total == pytest.approx(total, rel=0.01)


def test_shared_steps_save_exactly_their_kv_projections():
    """Dense, Cycle N_R = 3, one-layer block: the two later steps skip 2 · (2·2d²) FLOPs per token of
    K/V projection (and their backward, 2×); the causal attention pairs are the same T(T+1)/2."""
    d = 32
    shared, own = GPT(cfg("cycle", 3, 3, max_seq_len=96)), GPT(cfg("cycle", 3, 3, max_seq_len=96, share=False))
    for causal in (True, False):
        a, b = shared.flop_report(96, causal=causal), own.flop_report(96, causal=causal)
        assert b.forward - a.forward == 2 * 2 * 2 * d * d * 96
        assert b.total - a.total == 3 * 2 * 2 * 2 * d * d * 96
        assert a.breakdown["attn_scores"] == b.breakdown["attn_scores"]


@pytest.mark.parametrize("name", ["dense", "mor", "sigmoid"])
def test_kv_bytes_count_step_0s_slots_only(name):
    """The later steps cache nothing: the bytes are the unshared layers' and step 0's valid slots, fewer
    than recursion-wise caching's for the same weights and tokens."""
    shared, own = model(name), model(name, share=False)
    idx = torch.randint(0, 256, (2, 20))
    bytes_ = {}
    for key, m in (("shared", shared), ("own", own)):
        dec = Decoder(m, 2, 24)
        with torch.no_grad():
            dec(idx[:, :7])
            for t in range(7, 20):
                dec(idx[:, t : t + 1])
        bytes_[key] = dec
    dec = bytes_["shared"]
    assert all(isinstance(c, SharedLayerCache) for c in dec.caches[2:4])
    per_slot = 2 * 32 * 4  # K and V, float32
    shared.set_collect_stats(True)
    with torch.no_grad():
        decides = [s["decide"] for s in shared(idx, routing_mode="causal").stats]
    step0 = 2 * 20 if name == "dense" else int(decides[0].sum())
    assert dec.kv_bytes == (2 * 2 * 20 + step0) * per_slot  # first and last layer, every token; step 0
    assert dec.kv_bytes_per_token == pytest.approx(dec.kv_bytes / 40)
    assert dec.kv_bytes_per_token < bytes_["own"].kv_bytes_per_token


def test_same_seed_same_model_and_step_bit_for_bit(one_training_step):
    build = lambda: GPT(cfg(), RoutingConfig("mor", 1 / 3, pattern="fixed:1,1", capacities="1,2/3,1/3"))  # noqa: E731
    (a, la), (b, lb) = one_training_step(build), one_training_step(build)
    assert la == lb and torch.equal(a, b)


@pytest.mark.parametrize("name", ["dense", "mor"])
def test_the_shared_kv_forward_compiles_fullgraph_without_a_host_sync(name):
    """The model's promise (``modbench.model.gpt``): one graph, no host sync, the eager values."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    eager = GPT(cfg(), RoutingConfig(name, 1 / 3, pattern="fixed:1,1", capacities="1,2/3,1/3" if name == "mor" else ""))
    graphs = []
    inner = torch._dynamo.lookup_backend("aot_eager")
    compiled = torch.compile(eager, fullgraph=True, backend=lambda gm, ex: graphs.append(gm) or inner(gm, ex))
    idx = torch.randint(0, 256, (2, T))
    assert torch.equal(compiled(idx, idx).loss, eager(idx, idx).loss)
    assert len(graphs) == 1
    names = [str(n.target) for gm in graphs for n in gm.graph.nodes if n.op in ("call_function", "call_method")]
    syncing = ("item", "tolist", "nonzero", "_local_scalar_dense", "masked_select", "unique", "cpu", "numpy")
    assert not [n for n in names if any(n == s or n.endswith(f".{s}") or f" {s}" in n for s in syncing)]
