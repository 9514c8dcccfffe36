"""Causal routing: the three routing modes, KV-cached generation, leak and agreement metrics.

Swept over every registered variant (like tests/test_routed_block.py). The ``random``
control's causal rule is a fixed random hyperplane on the token's own state (see
variants/controls.py), so it is deterministic and needs no RNG fixing here.
"""

import json
import math

import pytest
import torch

from modbench import variants
from modbench.cli.main import main
from modbench.config.model import ModelConfig, RoutingConfig
from modbench.run.evaluate import evaluate
from modbench.run.causal_eval import calibrate_causal_rules, causal_agreement, leak_rate
from modbench.model.decode import Decoder, generate, sample
from modbench.model.gpt import GPT, RoutedBlock
from modbench.config.run import RunConfig, TrainConfig
from modbench.run.train import train

ALL = variants.list_variants() + variants.decode_aliases()  # and every "+aux" decode rule
ROUTED = [v for v in ALL if variants.get_variant(v).build(8).scope != "none"]
CFG = ModelConfig(depth=3, n_embd=32, head_dim=8, max_seq_len=32)
T = 32


def model(name: str, capacity: float = 0.25, pattern: str = "MDM", seed: int = 0) -> GPT:
    """A tiny GPT whose routers have a real spread and calibrated causal rules."""
    torch.manual_seed(seed)
    m = GPT(CFG, RoutingConfig(name, capacity=capacity, pattern=pattern))
    for r in m.routers:
        for pname, p in r.named_parameters():
            if pname.endswith("bias"):
                torch.nn.init.zeros_(p)  # zero-mean logits: both decisions occur
            elif p.dim() > 0:
                torch.nn.init.normal_(p, std=0.5)
    calibrate_causal_rules(m, [torch.randint(0, 256, (4, T))])
    return m.eval()


def causal_fraction(m: GPT, idx: torch.Tensor) -> float:
    m.set_collect_stats(True)
    try:
        stats = m(idx, routing_mode="causal").stats
    finally:
        m.set_collect_stats(False)
    return torch.cat([s["decide"].flatten() for s in stats]).float().mean().item()


def test_sweep_covers_all_routed_variants():
    assert {"norm", "linear_softmax", "sigmoid", "learned_temperature", "mlp_skip", "random"} <= set(ROUTED)


@pytest.mark.parametrize("name", ROUTED)
def test_causal_mode_never_looks_ahead(name):
    m = model(name)
    idx = torch.randint(0, 256, (2, T))
    frac = causal_fraction(m, idx)
    assert 0.0 < frac < 1.0, "the causal rule should skip some tokens and keep others"
    with torch.no_grad():
        base = m(idx, routing_mode="causal").logits
        for t in (0, 5, 17, T - 2):
            other = idx.clone()
            other[:, t + 1 :] = torch.randint(0, 256, (2, T - t - 1))
            got = m(other, routing_mode="causal").logits
            assert torch.equal(got[:, : t + 1], base[:, : t + 1])  # bit-identical
    assert leak_rate(m, idx, routing_mode="causal") == 0.0


@pytest.mark.parametrize("name", ["norm", "learned_temperature", "mlp_skip", "random"])
def test_calibrated_threshold_rules_process_about_the_capacity(name):
    """Threshold rules, calibrated on the final weights, keep about C of the tokens."""
    torch.manual_seed(0)
    m = GPT(CFG, RoutingConfig(name, capacity=0.25, pattern="all"))
    data = torch.randint(0, 256, (8, T))
    with torch.no_grad():
        m.train()
        for _ in range(3):
            m(torch.randint(0, 256, (8, T)))  # a stale, different EMA history
    before = [r.threshold.value.clone() for r in m.routers]
    calibrate_causal_rules(m.eval(), [data])
    assert all(r.calibrating is False for r in m.routers) and not m.training  # mode restored
    m.set_collect_stats(True)
    for r in m.routers:
        r.collect_causal = True
    with torch.no_grad():
        stats = m(data).stats  # top-k states: what each threshold was calibrated on
    for s in stats:
        assert abs(s["causal_decide"].float().mean().item() - 0.25) < 0.1
    if name != "random":  # (random's threshold was never set before)
        assert any(not torch.equal(b, r.threshold.value) for b, r in zip(before, m.routers))


def test_topk_leaks_and_the_leak_rate_is_reproducible():
    m = model("sigmoid", pattern="all")
    idx = torch.randint(0, 256, (4, T))
    rate = leak_rate(m, idx, seed=3)
    assert 0.0 < rate <= 1.0
    assert leak_rate(m, idx, seed=3) == rate
    # the random control's top-k ignores content: with the same draws nothing leaks
    assert leak_rate(model("random", pattern="all"), idx, seed=3) == 0.0


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("prompt_len", [1, 3, 17])
def test_cached_generation_equals_the_causal_forward(name, prompt_len):
    m = model(name)
    prompt = torch.randint(0, 256, (2, prompt_len))  # two different prompts
    out = generate(m, prompt, 10, temperature=0, return_logits=True)
    assert out.tokens.shape == (2, prompt_len + 10)
    assert torch.equal(out.tokens[:, :prompt_len], prompt)
    full = m(out.tokens[:, :-1], routing_mode="causal").logits
    torch.testing.assert_close(out.logits, full, atol=1e-5, rtol=1e-5)
    if name in ROUTED:
        assert 0.0 <= out.skipped_fraction <= 1.0
    else:
        assert out.skipped_fraction == 0.0


@pytest.mark.parametrize("name", ["sigmoid", "mlp_skip"])
def test_decoder_in_dense_mode_and_chunked_feeding(name):
    m = model(name)
    idx = torch.randint(0, 256, (3, 20))
    with torch.no_grad():
        dense = Decoder(m, 3, 20, mode="dense")
        got = torch.cat([dense(idx[:, :7]), dense(idx[:, 7:8]), dense(idx[:, 8:])], dim=1)
        torch.testing.assert_close(got, m(idx, routing_mode="dense").logits, atol=1e-5, rtol=1e-5)
        causal = Decoder(m, 3, 20)
        got = torch.cat([causal(idx[:, :4]), causal(idx[:, 4:12]), *[causal(idx[:, i : i + 1]) for i in range(12, 20)]], 1)
        torch.testing.assert_close(got, m(idx, routing_mode="causal").logits, atol=1e-5, rtol=1e-5)
    assert dense.skipped_fraction == 0.0


def test_sampling_is_seeded_and_respects_top_k():
    m = model("sigmoid")
    prompt = torch.randint(0, 256, (2, 3))
    a = generate(m, prompt, 12, temperature=1.0, top_k=5, seed=1, return_logits=True)
    b = generate(m, prompt, 12, temperature=1.0, top_k=5, seed=1)
    assert torch.equal(a.tokens, b.tokens)
    top5 = torch.topk(a.logits, 5, dim=-1).indices[:, 2:]  # logits at the positions that sampled
    assert (top5 == a.new_tokens.unsqueeze(-1)).any(-1).all()
    assert a.tokens_per_s > 0


@pytest.mark.parametrize("name", ROUTED)
def test_dense_mode_is_the_model_with_plain_blocks(name):
    m = model(name)
    idx = torch.randint(0, 256, (2, T))
    if variants.get_variant(name).build(8).mlp_experts:
        # MoDE: its blocks hold a mixture-of-experts MLP, so "plain" means each block on every token
        with torch.no_grad():
            x = m.embed(idx)
            for layer in m.layers:
                x = layer.block(x, m.rope_cos[:T], m.rope_sin[:T])
            assert torch.equal(m(idx, routing_mode="dense").logits, m.head(m.norm(x)))
        return
    torch.manual_seed(1)
    dense = GPT(CFG)  # same shapes, every layer a plain block
    state = {k: v for k, v in m.state_dict().items() if ".router." not in k}
    dense.load_state_dict(state)
    with torch.no_grad():
        assert torch.equal(m(idx, routing_mode="dense").logits, dense(idx).logits)


def test_unknown_routing_mode_is_a_clear_error():
    from modbench.errors import ModbenchError

    m = model("sigmoid")
    with pytest.raises(ModbenchError, match="routing mode 'causl'"):
        m(torch.zeros(1, 4, dtype=torch.long), routing_mode="causl")
    with pytest.raises(ModbenchError, match="cannot decode"):
        Decoder(m, 1, 8, mode="topk")
    with pytest.raises(ModbenchError, match="exceeds the model's max_seq_len"):
        generate(m, torch.zeros(1, 30, dtype=torch.long), 5)


@pytest.mark.parametrize("name", ALL)
def test_mode_metrics_are_in_range(name):
    m = model(name)
    x = torch.randint(0, 256, (6, T))
    y = torch.roll(x, -1, 1)
    r = evaluate(m, x, y, batch_size=4, device=torch.device("cpu"), modes=True)
    for key in ("causal_agreement", "causal_fraction", "topk_leak_rate"):
        assert 0.0 <= r[key] <= 1.0, key
    for key in ("causal_precision", "causal_recall", "causal_chance_agreement"):
        assert (key in r) == (name != "dense") and 0.0 <= r.get(key, 0.0) <= 1.0, key
    assert r["causal_gap"] == pytest.approx(r["causal_bpb"] - r["bpb"])
    assert r["dense_gap"] == pytest.approx(r["dense_bpb"] - r["bpb"])
    assert all(math.isfinite(v) for v in r.values())
    if name == "dense":
        assert r["causal_gap"] == r["dense_gap"] == 0.0 and r["causal_fraction"] == 1.0
    else:
        n_routed = sum(isinstance(layer, RoutedBlock) for layer in m.layers)
        assert len([k for k in r if k.startswith("causal_agreement_L")]) == n_routed
        if not name.startswith("random"):  # (the random controls draw their top-k from the RNG)
            per_layer = causal_agreement(m, x[:16])  # evaluate probes the first 16 windows
            assert r["causal_agreement"] == pytest.approx(sum(per_layer) / len(per_layer))
    assert m.training is False  # evaluate restores the mode it found


def test_causal_confusion_counts_against_topk_and_its_chance_level(monkeypatch):
    """Hand-made decisions: 8 tokens, top-k picks 2, the rule processes 4 of which 1 is right."""
    from modbench.run import causal_eval

    decide = torch.tensor([[1, 1, 1, 1, 0, 0, 0, 0]], dtype=torch.bool)
    member = torch.tensor([[1, 0, 0, 0, 1, 0, 0, 0]], dtype=torch.bool)
    monkeypatch.setattr(causal_eval, "causal_decisions", lambda model, x: [(decide, member)])
    r = causal_eval.causal_confusion(None, None)
    assert r["causal_precision"] == 0.25 and r["causal_recall"] == 0.5
    assert r["causal_chance_agreement"] == 0.5 * 0.25 + 0.5 * 0.75  # q = 4/8, c = 2/8
    assert causal_eval.causal_agreement(None, None) == [0.5]  # 4 of 8 agree: exactly chance


def test_sigmoid_aux_loss_teaches_the_causal_rule():
    """A few steps of the aux BCE on fixed hidden states: r > 0 agrees with top-k membership."""
    torch.manual_seed(0)
    router = variants.build_router("sigmoid", 32, {"aux_weight": 1.0}).train()
    x = torch.randn(16, T, 32)
    k = 8  # C = 0.25

    def agreement() -> float:
        with torch.no_grad():
            member = torch.zeros(16, T, dtype=torch.bool).scatter_(1, router.route(x, k).index, True)
            return (router.decide_causal(x) == member).float().mean().item()

    before = agreement()
    opt = torch.optim.Adam(router.parameters(), lr=0.05)
    for _ in range(50):
        loss = router.route(x, k).aux_losses["router_bce"]
        opt.zero_grad()
        loss.backward()
        opt.step()
    chance = 0.25**2 + 0.75**2  # a rule independent of membership that processes 25 %
    assert agreement() > max(0.9, before, chance + 0.2)


# --- training logs the gaps; the CLI generates from a checkpoint or an MLflow run --------------
def tiny_run(**train_kw) -> RunConfig:
    t = dict(dataset="arithmetic", seq_len=32, batch_size=4, budget="steps=3", eval_every=100,
             log_every=1, eval_windows=4, track=False, out_dir="runs", lr=3e-3)
    t.update(train_kw)
    return RunConfig(CFG, RoutingConfig("sigmoid", 0.25), TrainConfig(**t))


def test_cli_generate_missing_checkpoint_is_one_line_exit_2(tmp_cwd, capsys):
    for run in ("missing.pt", "0123456789abcdef0123456789abcdef"):
        rc = main(["generate", "--run", run, "--prompt", "1+1="])
        err = capsys.readouterr().err.strip()
        assert rc == 2 and len(err.splitlines()) == 1 and err.startswith("modbench: error:")
    assert not (tmp_cwd / "mlflow.db").exists()


def test_training_logs_the_gaps_and_cli_generates_from_the_run(tmp_cwd, capsys, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_cwd}/mlflow.db")
    result = train(tiny_run(track=True, experiment="causal-test"), progress=False)
    for key in ("causal_bpb", "dense_bpb", "causal_gap", "dense_gap", "causal_agreement", "causal_fraction", "topk_leak_rate"):
        assert math.isfinite(result.val[key]), key
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_cwd}/mlflow.db")
    run = client.get_run(result.run_id)
    assert run.data.metrics["val/causal_gap"] == pytest.approx(result.val["causal_gap"])
    assert run.data.tags["modbench.checkpoint"] == result.record.checkpoint == "checkpoint/checkpoint.pt"

    for ref in (str(result.checkpoint), result.run_id):
        if ref == result.run_id:  # from the run id alone: the artifact is fetched, no local file needed
            saved = result.checkpoint.read_bytes()
            result.checkpoint.unlink()
        rc = main(["generate", "--run", ref, "--prompt", "12+", "--max-new-tokens", "6", "--batch", "2", "--json"])
        assert rc == 0
        out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert len(out["texts"]) == 2 and [len(b) for b in out["new_bytes"]] == [6, 6]
        assert out["tokens_per_s"] > 0 and out["dense_tokens_per_s"] > 0
        assert 0.0 <= out["skipped_fraction"] <= 1.0
    result.checkpoint.write_bytes(saved)

    rc = main(["generate", "--run", str(result.checkpoint), "--prompt", "7*", "--max-new-tokens", "5", "--greedy"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert rc == 0 and lines[0].startswith("7*") and "tokens/s" in lines[-1] and "skipped" in lines[-1]
    rc = main(["generate", "--run", str(result.checkpoint), "--prompt", "x", "--max-new-tokens", "40"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "exceeds the model's max_seq_len 32" in err and len(err.splitlines()) == 1


@pytest.mark.parametrize("name", ["sigmoid", "mlp_skip"])
def test_every_routing_path_runs_the_one_block_implementation(name, monkeypatch):
    """Training top-k, the causal mode, dense mode and KV-cached decoding all compute the block
    through Block.attention and Block.mlp_delta: a change there changes every path."""
    from modbench.model.gpt import Block

    calls: dict[str, int] = {}
    for method in ("attention", "mlp_delta"):
        original = getattr(Block, method)

        def counted(self, *a, _original=original, _name=method, **k):
            calls[_name] = calls.get(_name, 0) + 1
            return _original(self, *a, **k)

        monkeypatch.setattr(Block, method, counted)
    m = model(name).eval()
    x = torch.randint(0, 256, (2, 8))
    for run in (lambda: m(x), lambda: m(x, routing_mode="causal"), lambda: m(x, routing_mode="dense"),
                lambda: Decoder(m, 2, 8)(x), lambda: Decoder(m, 2, 8, mode="dense")(x)):
        calls.clear()
        with torch.no_grad():
            run()
        assert calls.get("attention", 0) >= 3 and calls.get("mlp_delta", 0) >= 2, calls


# --- KV-cached decoding at batch 1 and at a batch whose sequences skip different tokens ---------
@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("batch", [1, 5])
def test_cached_generation_equals_the_causal_forward_at_batch_1_and_5(name, batch):
    """Batch 1 takes the cache's uniform path (slice writes, no mask) at every layer; batch 5 has
    decode steps where all, some and none of the sequences process a token."""
    m = model(name)
    prompt = torch.randint(0, 256, (batch, 4), generator=torch.Generator().manual_seed(batch))
    out = generate(m, prompt, 12, temperature=0, return_logits=True)
    full = m(out.tokens[:, :-1], routing_mode="causal").logits
    torch.testing.assert_close(out.logits, full, atol=1e-5, rtol=1e-5)
    if name in ROUTED:
        m.set_collect_stats(True)
        try:
            stats = m(out.tokens[:, :-1], routing_mode="causal").stats
        finally:
            m.set_collect_stats(False)
        expected = [s["decide"].float().mean().item() for s in stats]  # what each routed layer processed
        assert out.processed_shares == pytest.approx(expected)
        assert out.skipped_fraction == pytest.approx(1 - sum(expected) / len(expected))


@pytest.mark.parametrize("name", ["sigmoid", "mlp_skip", "nested", "dense"])
def test_a_decode_step_reads_the_device_at_most_once_per_routed_layer(name, monkeypatch):
    """Host syncs per decode step: one per routed layer (which sequences process the token, and the
    cache's new bound, read together), none at a dense layer or for the bookkeeping."""
    m = model(name)
    n_routed = len(m.routers)
    decoder = Decoder(m, 3, 20)
    with torch.no_grad():
        feed = decoder(torch.randint(0, 256, (3, 4)))[:, -1:].argmax(-1)  # prefill (its syncs are per prompt)
    reads = []
    for method in ("item", "tolist", "__int__", "__bool__", "__float__", "nonzero"):
        original = getattr(torch.Tensor, method)

        def counted(self, *a, _original=original, _name=method, **k):
            reads.append(_name)
            return _original(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, method, counted)
    steps = 6
    with torch.no_grad():
        for _ in range(steps):
            feed = decoder(feed)[:, -1:].argmax(-1)
    assert len(reads) == steps * n_routed, reads


@pytest.mark.parametrize("top_k", [None, 5])
def test_sampling_draws_what_torch_multinomial_draws(top_k):
    """``sample`` writes out multinomial's one-sample draw (the exponential race) to avoid its host reads:
    the same generator gives the same tokens as ``torch.multinomial`` and leaves it in the same state, so
    seeded generations are what they were."""
    logits = torch.randn(6, 97, generator=torch.Generator().manual_seed(0)) * 3
    for seed in range(50):
        ours, theirs = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed)
        drawn = sample(logits, temperature=0.8, top_k=top_k, generator=ours)
        scaled = logits / 0.8
        if top_k is not None:
            scaled = scaled.masked_fill(scaled < scaled.topk(top_k, dim=-1).values[:, -1:], -math.inf)
        expected = torch.multinomial(torch.softmax(scaled, dim=-1), 1, generator=theirs)
        assert torch.equal(drawn, expected)
        assert torch.equal(torch.rand(4, generator=ours), torch.rand(4, generator=theirs))
    counts = torch.bincount(torch.cat([sample(logits[:1], generator=torch.Generator().manual_seed(s))[0]
                                       for s in range(4000)]), minlength=97).float() / 4000
    assert (counts - torch.softmax(logits[0], -1)).abs().max() < 0.03  # token i drawn with probability p_i
