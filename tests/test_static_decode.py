"""The static, sync-free decode step (``modbench.model.static_decode``; issue 38, items 1 and 2).

Swept over every registered variant and every "+aux" decode rule (as tests/test_causal.py):

- exactness: KV-cached generation with the static step equals the causal full pass (float32, CPU,
  atol 1e-5), at batch 1 and at a batch whose sequences skip different tokens, and agrees with the
  dynamic decoder (same tokens, shares and KV bytes);
- the "-cond" steps (``StaticDecoder(cond=True)``: a routed layer no sequence routes to runs its skip
  path alone, ``torch.cond``) give the masked step's logits and cache bit for bit, eager and compiled
  (one fullgraph graph whose ``cond`` branches hold no host-syncing op), and such a layer runs none of
  its block's matmuls (counted by torch.profiler) while the masked step runs them all;
- the "-split" steps (``split=True``: the step in pieces between the branches, each piece a CUDA graph
  on CUDA, here rehearsed with ``eager_piece``) likewise, with one host read per branching layer and step;
- no host sync: a decode step calls none of the host-reading tensor methods, and it compiles with
  ``torch.compile(fullgraph=True)`` into one graph with no host-syncing op, reused at every step (a
  graph break, a host read or a data-dependent shape would fail it). Backend "eager": Dynamo's
  tracing alone, which is what finds graph breaks, without Inductor's C++ compile (minutes on 2
  cores for the sweep); the compiled step's logits must still equal the causal pass. A router that
  reads the device in its rule is shown to fail the same check.

The dense mode, chunked feeding, reuse of one decoder, the fallback of a router that refuses the static
step, and (on CUDA only) the CUDA-graph runner. What the step leaves in its caches (a skipped token's
slot, recursive KV sharing) is tests/test_static_cache.py's; the capture mechanics are
tests/test_cuda_graphs.py's; the routed training forward's fullgraph compile is tests/bench/test_compile.py's.
"""

from __future__ import annotations

from dataclasses import asdict

import pytest
import torch

from modbench import variants
from modbench.config.model import ModelConfig, RoutingConfig
from modbench.errors import ModbenchError
from modbench.model.decode import STEPS, Decoder, generate, resolve_step, sample
from modbench.model.gpt import GPT, RoutedBlock
from modbench.model.cuda_graphs import branch_capture_missing, eager_piece
from modbench.model.static_decode import StaticDecoder, static_refusal
from modbench.run.causal_eval import calibrate_causal_rules

ALL = variants.list_variants() + variants.decode_aliases()
ROUTED = [v for v in ALL if variants.get_variant(v).scope != "none"]
SYNC_FREE = [v for v in ALL if not variants.static_decode_refusal(v)]  # what claims the static step
CFG = ModelConfig(depth=3, n_embd=32, head_dim=8, max_seq_len=32)
T = 32
SYNCING = ("item", "tolist", "nonzero", "_local_scalar_dense", "masked_select", "unique", "cpu", "numpy")


def model(name: str, cfg: ModelConfig = CFG, pattern: str = "MDM", capacity: float = 0.25) -> GPT:
    """A tiny GPT whose routers have a real spread and calibrated causal rules (as tests/test_causal.py)."""
    torch.manual_seed(0)
    m = GPT(cfg, RoutingConfig(name, capacity=capacity, pattern=pattern))
    for r in m.routers:
        for pname, p in r.named_parameters():
            if pname.endswith("bias"):
                torch.nn.init.zeros_(p)  # zero-mean logits: both decisions occur
            elif p.dim() > 0:
                torch.nn.init.normal_(p, std=0.5)
    calibrate_causal_rules(m, [torch.randint(0, 256, (4, T), generator=torch.Generator().manual_seed(9))])
    return m.eval()


def decisions(m: GPT, idx: torch.Tensor) -> list[torch.Tensor]:
    """Per routed layer, (B, T) bool: what the causal full pass processes."""
    m.set_collect_stats(True)
    try:
        with torch.no_grad():
            return [s["decide"] for s in m(idx, routing_mode="causal").stats]
    finally:
        m.set_collect_stats(False)


def prompt(batch: int, length: int = 4) -> torch.Tensor:
    return torch.randint(0, 256, (batch, length), generator=torch.Generator().manual_seed(batch))


def test_every_builtin_variant_claims_the_static_step():
    """No built-in router refuses: the compute-then-mask step has no shape that depends on the count."""
    assert SYNC_FREE == ALL and len(ALL) > 20
    assert {"token_choice", "threshold", "expert_threshold", "mor_token_choice", "amod", "sigmoid+aux"} <= set(SYNC_FREE)


# --- exactness ------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", SYNC_FREE)
@pytest.mark.parametrize("batch", [1, 5])
def test_static_generation_equals_the_causal_forward_and_the_dynamic_decoder(name, batch):
    """Batch 5 has steps where all, some and none of the sequences process a token."""
    m = model(name)
    p = prompt(batch)
    out = generate(m, p, 12, temperature=0, return_logits=True, step="static")
    assert out.step == "static"
    full = m(out.tokens[:, :-1], routing_mode="causal").logits
    torch.testing.assert_close(out.logits, full, atol=1e-5, rtol=1e-5)
    dynamic = generate(m, p, 12, temperature=0, return_logits=True, step="dynamic")
    assert torch.equal(out.tokens, dynamic.tokens)
    assert out.kv_bytes_per_token == dynamic.kv_bytes_per_token  # the valid slots, not the allocation
    assert out.processed_shares == pytest.approx(dynamic.processed_shares)
    if name in ROUTED:
        expected = [d.float().mean().item() for d in decisions(m, out.tokens[:, :-1])]
        assert out.processed_shares == pytest.approx(expected)
        assert out.skipped_fraction == pytest.approx(1 - sum(expected) / len(expected))
        assert 0.0 < out.skipped_fraction < 1.0 or batch == 1  # (one greedy sequence may repeat a skipped byte)
    else:
        assert out.skipped_fraction == 0.0 and out.processed_shares == []


# --- the "-cond" steps: skip a layer no sequence routes to ---------------------------------------------
def _fed(dec: StaticDecoder, idx: torch.Tensor, prompt_len: int = 4) -> list[torch.Tensor]:
    """Feed a prompt, then one token at a time; every call's logits."""
    with torch.no_grad():
        return [dec(idx[:, :prompt_len])] + [dec(idx[:, t : t + 1]) for t in range(prompt_len, idx.shape[1])]


@pytest.mark.parametrize("name", [v for v in ROUTED if v in SYNC_FREE])
def test_the_cond_step_equals_the_masked_step_bit_for_bit(name):
    """At batch 1 most steps leave some routed layer with no processed token (the skip branch), at batch
    3 fewer: logits, counts and every cache tensor are the masked step's exactly, so ``cond`` changes
    speed and never numbers."""
    m = model(name)
    for batch in (1, 3):
        idx = torch.randint(0, 256, (batch, 16), generator=torch.Generator().manual_seed(4))
        masked, cond = StaticDecoder(m, batch, 16), StaticDecoder(m, batch, 16, cond=True)
        for a, b in zip(_fed(masked, idx), _fed(cond, idx)):
            assert torch.equal(a, b)
        assert all(torch.equal(a, b) for a, b in zip(masked.state(), cond.state()))
        assert cond.step_name == "static-cond" and masked.step_name == "static"


@pytest.mark.parametrize("name", ["sigmoid", "token_choice", "mor_token_choice", "dtrnet", "amod"])
def test_compiled_parts_and_the_traced_cond_equal_the_masked_step_bit_for_bit(name):
    """"compile-cond" runs Dynamo-compiled parts with the branch between them (here backend "eager":
    Dynamo's tracing, no code generation); a whole step traced with ``torch.cond`` runs the HOP. Both
    give the masked step's logits and cache bit for bit."""
    m = model(name)
    idx = torch.randint(0, 256, (3, 16), generator=torch.Generator().manual_seed(6))
    torch._dynamo.reset()
    masked = StaticDecoder(m, 3, 16)
    parts = StaticDecoder(m, 3, 16, runner="compile", cond=True, compile_backend="eager")
    for a, b in zip(_fed(masked, idx), _fed(parts, idx)):
        assert torch.equal(a, b)
    assert all(torch.equal(a, b) for a, b in zip(masked.state(), parts.state()))
    assert parts.step_name == "compile-cond" and parts._parts is not None
    traced = StaticDecoder(m, 3, 16, cond=True)
    step = torch.compile(traced.step, fullgraph=True, dynamic=False, backend="eager")
    with torch.no_grad():
        outs = [traced(idx[:, :4])] + [step(idx[:, t : t + 1]) for t in range(4, 16)]
    for a, b in zip(_fed(StaticDecoder(m, 3, 16), idx), outs):
        assert torch.equal(a, b)
    assert all(torch.equal(a, b) for a, b in zip(masked.state(), traced.state()))


@pytest.mark.parametrize("name", [v for v in ROUTED if v in SYNC_FREE])
def test_the_split_step_equals_the_masked_step_bit_for_bit(name):
    """"graph-split" rehearsed on the CPU (``eager_piece``: each piece runs where a CUDA graph would replay):
    the pieces, the branch buffers between them and the host's choice of side give the masked step's
    logits and cache bit for bit at batch 1 and 3, for every routed variant (amod's exposing layers, nested
    routing's and mor_token_choice's handoffs across a split included)."""
    m = model(name)
    for batch in (1, 3):
        idx = torch.randint(0, 256, (batch, 16), generator=torch.Generator().manual_seed(4))
        masked = StaticDecoder(m, batch, 16)
        split = StaticDecoder(m, batch, 16, runner="graph", cond=True, split=True, capture_piece=eager_piece)
        for a, b in zip(_fed(masked, idx), _fed(split, idx)):
            assert torch.equal(a, b)
        assert all(torch.equal(a, b) for a, b in zip(masked.state(), split.state()))
        assert split.step_name == "graph-split" and len(split._pieces) == 1 + len(split._branch_layers()) > 1


def test_compiled_split_parts_and_one_host_read_per_branch(monkeypatch):
    """"compile-split" (Dynamo-compiled parts in the pieces, backend "eager") equals the masked step bit for
    bit; a one-token step reads the host exactly once per branching routed layer (the predicate that picks
    the side: a sync each on CUDA) and nothing else; ``prepare`` captures the pieces ahead, mid-generation,
    leaving the cache as it was."""
    m = model("sigmoid", ModelConfig(depth=4, n_embd=32, head_dim=8, max_seq_len=T), pattern="MDMM")
    idx = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(8))
    torch._dynamo.reset()
    masked = StaticDecoder(m, 2, 16)
    split = StaticDecoder(m, 2, 16, runner="compile", cond=True, split=True, compile_backend="eager",
                          capture_piece=eager_piece)
    with torch.no_grad():
        masked(idx[:, :4]), split(idx[:, :4])
        before = [t.clone() for t in split.state()]
        split.prepare()
        assert all(torch.equal(x, y) for x, y in zip(before, split.state())) and len(split._pieces) == 4
        reads = []
        original = torch.Tensor.item

        def counted(self, *args, **kw):
            reads.append(self.shape)
            return original(self, *args, **kw)

        monkeypatch.setattr(torch.Tensor, "item", counted)
        for t in range(4, 16):
            assert torch.equal(masked(idx[:, t : t + 1]), split(idx[:, t : t + 1]))
        monkeypatch.undo()
    assert all(torch.equal(x, y) for x, y in zip(masked.state(), split.state()))
    assert split.step_name == "compile-split" and len(reads) == 12 * 3 and all(r == () for r in reads)


def test_one_split_decoder_serves_many_generations():
    """A split decoder captures its pieces once (``generate`` prepares it) and ``reset`` empties the caches in
    place under them: a reused one generates, greedily, the fresh masked step's tokens and logits again."""
    m = model("sigmoid")
    p = prompt(2)
    fresh = generate(m, p, 10, temperature=0, return_logits=True, step="static")
    dec = StaticDecoder(m, 2, 4 + 10 - 1, runner="graph", cond=True, split=True, capture_piece=eager_piece)
    captured = []
    for _ in range(2):
        again = generate(m, p, 10, temperature=0, return_logits=True, decoder=dec)
        assert torch.equal(again.tokens, fresh.tokens) and torch.equal(again.logits, fresh.logits)
        assert again.step == "graph-split" and again.processed_shares == fresh.processed_shares
        captured.append(dec._pieces)
    assert captured[0] is captured[1] and len(captured[0]) == 3  # captured once, replayed by both generations


def test_one_compiled_graph_per_part_serves_every_layer():
    """"compile-cond" compiles four parts (route, processed, skipped, dense), not one graph per layer:
    a model twice as deep compiles no more graphs (and stays far from Dynamo's recompile limit), and
    ``prepare`` compiles them all, so that no compile falls inside a timed generation."""
    counts = []
    for depth, pattern in ((4, "DMMD"), (8, "DMMMMMMD")):
        m = model("sigmoid", ModelConfig(depth=depth, n_embd=32, head_dim=8, max_seq_len=T), pattern=pattern)
        torch._dynamo.reset()
        graphs: list = []
        dec = StaticDecoder(m, 2, 16, runner="compile", cond=True, compile_backend=_recording(graphs))
        dec.prepare()  # compiles every part, both branches included, before any timed step
        prepared = len(graphs)
        _fed(dec, torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(7)))
        assert len(graphs) == prepared and dec.processed.sum() > 0  # (decoding compiled nothing more)
        counts.append(prepared)
    assert counts[0] == counts[1] and 4 <= counts[0] <= 8, counts


def _matmuls(call) -> int:
    """Matrix products the call ran (torch.profiler's aten events; a linear counts once)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        call()
    return sum(e.count for e in prof.key_averages() if e.key in ("aten::linear", "aten::matmul", "aten::bmm"))


@pytest.mark.parametrize("name", ["sigmoid", "mlp_skip", "token_choice", "dtrnet"])
@pytest.mark.parametrize("split", [False, True], ids=["static-cond", "graph-split"])
def test_a_layer_no_sequence_routes_to_runs_none_of_its_block_under_cond(name, split):
    """Batch 1: each step's matmul count is the masked step's less a fixed number per routed layer that
    skips the token, so a skipped layer reads none of its routed weights (the roofline's saving); the
    masked step runs every layer's block whatever the decisions. The same for a split step's replays."""
    m = model(name, ModelConfig(depth=4, n_embd=32, head_dim=8, max_seq_len=T), pattern="MDMM")
    idx = torch.randint(0, 256, (1, 20), generator=torch.Generator().manual_seed(5))
    masked = StaticDecoder(m, 1, 20)
    cond = StaticDecoder(m, 1, 20, cond=True, **({"runner": "graph", "split": True, "capture_piece": eager_piece}
                                                 if split else {}))
    with torch.no_grad():
        masked(idx[:, :4]), cond(idx[:, :4])
        cond(idx[:, 4:5]), masked(idx[:, 4:5])  # (the first torch.cond call traces its branches)
        counts = []
        for t in range(5, 20):
            before = cond.processed.clone()
            n_cond = _matmuls(lambda: cond(idx[:, t : t + 1]))
            n_masked = _matmuls(lambda: masked(idx[:, t : t + 1]))
            idle = int((cond.processed == before).sum())  # routed layers that processed nothing this step
            counts.append((idle, n_masked - n_cond))
    saved = {idle: diff for idle, diff in counts}
    assert len(saved) >= 2, f"the steps should differ in how many layers skip: {counts}"
    per_layer = saved[max(saved)] // max(saved)
    assert per_layer > 0 and all(diff == idle * per_layer for idle, diff in counts), counts


@pytest.mark.parametrize("name", ["sigmoid", "mlp_skip", "amod"])
def test_dense_mode_and_chunked_feeding(name):
    m = model(name)
    idx = torch.randint(0, 256, (3, 20), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        dense = StaticDecoder(m, 3, 20, mode="dense")
        got = torch.cat([dense(idx[:, :7]), dense(idx[:, 7:8]), dense(idx[:, 8:])], dim=1)
        torch.testing.assert_close(got, m(idx, routing_mode="dense").logits, atol=1e-5, rtol=1e-5)
        causal = StaticDecoder(m, 3, 20)
        got = torch.cat([causal(idx[:, :4]), causal(idx[:, 4:12]), *[causal(idx[:, i : i + 1]) for i in range(12, 20)]], 1)
        torch.testing.assert_close(got, m(idx, routing_mode="causal").logits, atol=1e-5, rtol=1e-5)
    assert dense.skipped_fraction == 0.0 and 0.0 < causal.skipped_fraction < 1.0


def test_one_decoder_serves_many_generations():
    """``reset`` empties the caches in place: a reused decoder generates what a fresh one does."""
    m = model("sigmoid")
    p = prompt(2)
    fresh = generate(m, p, 10, temperature=0, return_logits=True, step="static")
    dec = StaticDecoder(m, 2, 4 + 10 - 1)  # as long as generate's own (the attention length sets the rounding)
    for _ in range(2):
        again = generate(m, p, 10, temperature=0, return_logits=True, decoder=dec)
        assert torch.equal(again.tokens, fresh.tokens) and torch.equal(again.logits, fresh.logits)
        assert again.processed_shares == fresh.processed_shares and again.step == "static"
    with pytest.raises(ModbenchError, match="built for batch 2"):
        generate(m, prompt(3), 10, decoder=dec)
    with pytest.raises(ModbenchError, match="at least 14 tokens"):
        generate(m, p, 11, decoder=dec)
    with pytest.raises(ModbenchError, match="decoding past 13"):
        dec.reset()
        dec(torch.zeros(2, 14, dtype=torch.long))


# --- no host sync ----------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["sigmoid", "mlp_skip", "nested", "amod", "token_choice", "dense"])
def test_a_static_step_reads_nothing_on_the_host(name, monkeypatch):
    """The dynamic decoder reads the device once per routed layer and step; the static step never."""
    m = model(name)
    dec = StaticDecoder(m, 3, 20)
    with torch.no_grad():
        feed = dec(prompt(3))[:, -1:].argmax(-1)
    reads = []
    for method in ("item", "tolist", "__int__", "__bool__", "__float__", "__index__", "nonzero"):
        original = getattr(torch.Tensor, method)

        def counted(self, *a, _original=original, _name=method, **k):
            reads.append(_name)
            return _original(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, method, counted)
    with torch.no_grad():
        for _ in range(6):
            feed = dec(feed)[:, -1:].argmax(-1)
    assert reads == []


def _recording(graphs: list):
    def record(gm, example_inputs):
        graphs.append(gm)
        return gm.forward  # backend "eager": run the traced graph as it is

    return record


def _compiled_generation(m: GPT, batch: int, graphs: list, cond: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy generation of 12 tokens whose 11 one-token steps run the whole step under
    ``torch.compile(fullgraph=True)`` (the prompt eagerly): (tokens, logits)."""
    torch._dynamo.reset()
    dec = StaticDecoder(m, batch, 16, cond=cond)
    compiled = torch.compile(dec.step, fullgraph=True, dynamic=False, backend=_recording(graphs))
    tokens, logits = [prompt(batch)], []
    with torch.no_grad():
        for i in range(12):
            out = dec(tokens[-1]) if i == 0 else compiled(tokens[-1])
            if i > 0:
                dec.fed += 1
            logits.append(out)
            tokens.append(out[:, -1:].argmax(-1))
    return torch.cat(tokens[:-1], 1), torch.cat(logits, 1)


def assert_compiles_sync_free(m: GPT, batch: int = 3, cond: bool = False) -> None:
    """fullgraph=True raises on any graph break (a branch on a tensor, a data-dependent shape, a host
    read Dynamo will not trace); the one graph, and under ``cond`` each branch's subgraph, must hold no
    host-syncing op (a traced ``.item()``), and it must serve all 11 one-token steps (no recompile: what
    a CUDA graph replay needs); its logits are the causal pass's."""
    graphs: list = []
    tokens, logits = _compiled_generation(m, batch, graphs, cond)
    assert len(graphs) == 1
    subgraphs = [g.graph for g in graphs[0].modules() if isinstance(g, torch.fx.GraphModule)]
    calls = [n for g in subgraphs for n in g.nodes if n.op in ("call_function", "call_method")]
    names = [str(n.target) for n in calls]
    syncing = [n for n in names if any(n == s or n.endswith(f".{s}") or f" {s}" in n for s in SYNCING)]
    assert syncing == [], f"host-syncing ops in the compiled step: {syncing}"
    conds = sum(n.target is torch.ops.higher_order.cond for n in calls)
    routed = sum(isinstance(layer, RoutedBlock) and not layer.block.attn.expose for layer in m.layers)
    assert conds == (routed if cond else 0)  # one torch.cond per routed layer, traced (not a graph break)
    torch.testing.assert_close(logits, m(tokens, routing_mode="causal").logits, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", SYNC_FREE)
@pytest.mark.parametrize("cond", [False, True], ids=["masked", "cond"])
def test_the_decode_step_compiles_to_one_graph_without_host_syncs(name, cond):
    assert_compiles_sync_free(model(name), cond=cond)


@pytest.mark.parametrize("host_read", ["branch", "item"])
def test_a_rule_that_reads_the_device_fails_the_check(host_read, monkeypatch):
    """The check above can fail: a causal rule that branches on a tensor breaks the graph; one that
    reads a scalar (traced by Dynamo as ``item``) leaves a host-syncing op in it."""
    m = model("sigmoid")
    router = m.routers[0]
    rule = router.decide_causal

    def branching(x):
        return rule(x) if router.scorer(x).mean() < 1e9 else ~rule(x)

    def reading(x):
        return rule(x * (1.0 + 0.0 * router.scorer(x).abs().max().item()))

    monkeypatch.setattr(router, "decide_causal", branching if host_read == "branch" else reading)
    with pytest.raises(Exception, match="(?i)graph break|data.dependent|Unsupported|host-syncing ops"):
        assert_compiles_sync_free(m, 2)


def test_a_router_that_refuses_the_static_step_falls_back_to_the_dynamic_decoder(monkeypatch):
    m = model("sigmoid")
    refusal = "its rule sizes a tensor by the decision"
    monkeypatch.setattr(type(m.routers[0]), "static_decode_refusal", refusal)
    assert variants.static_decode_refusal("sigmoid") == refusal and refusal in static_refusal(m)
    assert resolve_step(m, "auto") == "dynamic"
    out = generate(m, prompt(2), 6, temperature=0, step="auto")
    assert out.step == "dynamic"
    with pytest.raises(ModbenchError, match=f"cannot decode with step 'static'.*{refusal}"):
        generate(m, prompt(2), 6, step="static")
    with pytest.raises(ModbenchError, match="cannot decode with the static step"):
        StaticDecoder(m, 2, 8)
    assert resolve_step(m, "static", mode="dense") == "static"  # routing off: no rule to refuse


def test_step_choice_on_cpu():
    """"auto" keeps the dynamic decoder on a CPU (a host read is free there, and it skips the work);
    "graph" needs CUDA; unknown names are one-line errors."""
    m = model("sigmoid")
    assert resolve_step(m, "auto") == "dynamic" and generate(m, prompt(1), 3).step == "dynamic"
    with pytest.raises(ModbenchError, match="needs|CUDA") as e:
        generate(m, prompt(1), 3, step="graph")
    assert "\n" not in str(e.value)
    with pytest.raises(ModbenchError, match="unknown decode step 'fast'"):
        generate(m, prompt(1), 3, step="fast")
    with pytest.raises(ModbenchError, match="captures a CUDA graph"):
        StaticDecoder(m, 1, 8, runner="graph")
    with pytest.raises(ModbenchError, match="'graph-cond' replays a CUDA graph.*expected 'auto', 'dynamic'") as e:
        generate(m, prompt(1), 3, step="graph-cond")
    assert "\n" not in str(e.value) and "'graph'" not in str(e.value).split("expected")[1]
    assert "'graph-split'" not in str(e.value).split("expected")[1]
    with pytest.raises(ModbenchError, match="'graph-split' replays a CUDA graph"):
        generate(m, prompt(1), 3, step="graph-split")
    with pytest.raises(ModbenchError, match="the split 'compile' runner captures a CUDA graph: the model is on cpu"):
        StaticDecoder(m, 1, 8, runner="compile", cond=True, split=True)
    with pytest.raises(ModbenchError, match="needs cond=True and runner 'graph' or 'compile'"):
        StaticDecoder(m, 1, 8, runner="graph", split=True, capture_piece=eager_piece)
    with pytest.raises(ModbenchError, match="needs cond=True"):
        StaticDecoder(m, 1, 8, runner="eager", cond=True, split=True)
    assert isinstance(Decoder(m, 1, 8), Decoder)  # (the dynamic decoder is unchanged)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA not available")
@pytest.mark.parametrize("name", ["dense", "sigmoid", "token_choice", "amod"])
def test_cuda_graph_replay_equals_the_eager_static_step(name):
    """On CUDA: the captured one-token step, replayed, gives the eager static step's logits; capturing
    mid-generation (after a prefill) leaves the cache as it was."""
    m = model(name).cuda()
    p = prompt(4).cuda()
    eager = generate(m, p, 12, temperature=0, return_logits=True, step="static")
    graph = generate(m, p, 12, temperature=0, return_logits=True, step="graph")
    assert graph.step == "graph" and torch.equal(graph.tokens, eager.tokens)
    torch.testing.assert_close(graph.logits, eager.logits, atol=1e-5, rtol=1e-5)
    assert graph.processed_shares == pytest.approx(eager.processed_shares)


# "compile-cond" once: each part is an Inductor compile on the GPU
CONDITIONAL_CASES = [(n, b, "graph-cond") for n in ("sigmoid", "mlp_skip", "token_choice", "mor_token_choice")
                     for b in (1, 4)] + [("sigmoid", 4, "compile-cond")]


@pytest.mark.skipif(bool(branch_capture_missing()), reason=branch_capture_missing())
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA not available")
@pytest.mark.parametrize("name,batch,step", CONDITIONAL_CASES)
def test_cuda_graph_conditional_nodes_equal_the_eager_static_step(name, batch, step):
    """On CUDA: "graph-cond" captures each routed layer's branch as CUDA graph conditional nodes, and
    "compile-cond" captures Inductor-compiled parts inside them; replayed, each generates the eager masked
    step's tokens and shares, its logits within rounding (Inductor's fused kernels round differently)."""
    _assert_generates_the_eager_static_step(name, batch, step)


def _assert_generates_the_eager_static_step(name: str, batch: int, step: str) -> None:
    """On CUDA: ``step`` generates the eager masked step's tokens and shares, its logits within rounding (1e-4
    for a compiled step: Inductor's fused kernels round differently)."""
    m = model(name).cuda()
    p = prompt(batch).cuda()
    eager = generate(m, p, 12, temperature=0, return_logits=True, step="static")
    graph = generate(m, p, 12, temperature=0, return_logits=True, step=step)
    assert graph.step == step and torch.equal(graph.tokens, eager.tokens)
    tol = 1e-4 if step.startswith("compile") else 1e-5
    torch.testing.assert_close(graph.logits, eager.logits, atol=tol, rtol=tol)
    assert graph.processed_shares == pytest.approx(eager.processed_shares)


SPLIT_CASES = [(n, b, "graph-split") for n in ("sigmoid", "mlp_skip", "token_choice", "mor_token_choice", "amod")
               for b in (1, 4)] + [("sigmoid", 4, "compile-split")]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA not available")
@pytest.mark.parametrize("name,batch,step", SPLIT_CASES)
def test_split_cuda_graphs_equal_the_eager_static_step(name, batch, step):
    """On CUDA, on any torch (no conditional nodes needed): the step captured as CUDA graphs split at each
    branch, the host picking each branch's side between replays, generates the eager masked step's tokens
    and shares, its logits within rounding ("compile-split": Inductor's fused kernels round differently);
    a layer's two sides and the pieces around it pass tensors through buffers that the captures fix."""
    _assert_generates_the_eager_static_step(name, batch, step)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA not available")
@pytest.mark.parametrize("step", ["graph", pytest.param("graph-cond", marks=pytest.mark.skipif(
    bool(branch_capture_missing()), reason=branch_capture_missing()))])
def test_a_captured_cuda_decode_step_and_its_sampling_never_sync(step):
    """On CUDA, once captured: a one-token call of the "graph" and "graph-cond" steps and the sampling of
    its next token run under ``set_sync_debug_mode("error")`` (any host sync raises), so a decode loop can
    run ahead of the GPU by many tokens."""
    m = model("sigmoid").cuda()
    spec = STEPS[step]
    dec = StaticDecoder(m, 4, 16, mode="causal", **asdict(spec))
    dec.prepare()
    feed = prompt(4).cuda()
    dec(feed)  # the prefill (a multi-token step, eager)
    feed = feed[:, -1:]
    g = torch.Generator(device="cuda").manual_seed(0)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(5):
            feed = sample(dec(feed)[:, -1], temperature=1.0, generator=g)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert feed.shape == (4, 1) and dec.fed == prompt(4).shape[1] + 5
