"""``expert_threshold_released``: Expert-Threshold routing as its released code trains it (issue 40).

What the registry sweeps do not check: the shipped defaults, the bias-corrected cutoff EMA and the
router's own step count (once per optimizer step, whatever calls ``GPT.set_step``), the expert-choice
warm-up and the step at which the training rule becomes the decode rule, measured as the causal gap
(causal bpb − top-k bpb, ``modbench.run.evaluate``) on both sides of it, the training clamps, and
the count surviving a checkpoint.
"""

from __future__ import annotations

import math

import pytest
import torch

from modbench.config.model import ModelConfig, RoutingConfig
from modbench.errors import ModbenchError
from modbench.model.gpt import GPT
from modbench.run.causal_eval import calibrate_causal_rules
from modbench.run.evaluate import evaluate, evaluate_causal
from modbench.variants import get_variant
from modbench.variants.expert_threshold_released import ReleasedExpertThresholdRouter

NAME = "expert_threshold_released"
CFG = ModelConfig(depth=2, n_embd=32, head_dim=8, max_seq_len=32)
T = 32
C = 0.25
K = int(C * T)  # the per-sequence k: 8


def model(seed: int = 0, **options) -> GPT:
    """Both layers routed; routers spread (zero-mean logits, as after some training) so both decisions occur."""
    torch.manual_seed(seed)
    m = GPT(CFG, RoutingConfig(NAME, C, pattern="all", options=options))
    for r in m.routers:
        torch.nn.init.normal_(r.scorer.proj.weight, std=0.5)
        torch.nn.init.zeros_(r.scorer.proj.bias)
    return m.train()


def batch(g: torch.Generator, n: int = 4) -> torch.Tensor:
    return torch.randint(0, 256, (n, T), generator=g)


def training_decisions(m: GPT, idx: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per routed layer, on the training forward's own hidden states: (what it processed, what the
    decode rule r ≥ θ decides). An eval-mode pass: it adds nothing to the step's statistics."""
    was_training = m.training
    m.eval().set_collect_stats(True)
    for r in m.routers:
        r.collect_causal = True
    try:
        with torch.no_grad():
            stats = m(idx).stats
    finally:
        m.set_collect_stats(False)
        for r in m.routers:
            r.collect_causal = False
        m.train(was_training)
    return [(s["layer_processed"], s["causal_decide"]) for s in stats]


def causal_gap(m: GPT, x: torch.Tensor) -> float:
    """causal bpb − top-k bpb on ``x``'s next-byte targets, as the trainer's evaluation computes it."""
    y = torch.roll(x, -1, 1)
    cpu = torch.device("cpu")
    topk = evaluate(m, x, y, batch_size=4, device=cpu)["bpb"]
    return evaluate_causal(m, x, y, batch_size=4, device=cpu, topk_bpb=topk)["causal_gap"]


# --- what the code ships -------------------------------------------------------------------------------
def test_the_defaults_are_the_released_codes_and_bad_values_are_refused():
    """cutoff_ema_alpha 0.99 (src/models/model_base.py), threshold_warmup_steps 4000 (configs/mlp/et.yaml),
    expert_capacity_factor −1 (no clamps); the warm-up decides the rule until step 4000."""
    spec = get_variant(NAME)
    cfg = spec.make_config()
    assert (cfg.ema_alpha, cfg.threshold_warmup_steps, cfg.capacity_factor) == (0.99, 4000, -1.0)
    router = spec.build(CFG.width)
    assert isinstance(router, ReleasedExpertThresholdRouter) and router.variable_count
    assert router.training_rule() == "topk" and router.causal_training_from == 4000 and int(router.steps) == 0
    for options, word in [({"ema_alpha": 1.0}, "ema_alpha"), ({"threshold_warmup_steps": -2}, "threshold_warmup_steps"),
                          ({"capacity_factor": 1.5}, "capacity_factor"), ({"capacity_factor": -0.5}, "capacity_factor"),
                          ({"threshold_warmup_steps": 1.5}, "threshold_warmup_steps")]:
        with pytest.raises(ModbenchError, match=word):
            spec.make_config(options)


# --- the cutoff and the step count ---------------------------------------------------------------------
def test_the_cutoff_is_the_bias_corrected_ema_of_the_steps_kth_largest_score_once_per_step():
    """Two micro-batches a step: q is the mean of their k-th largest of B·T scores (k = ⌊C·B·T⌋);
    c ← α·c + (1 − α)·q once per step and θ = c / (1 − αⁿ) (the first θ is the first q exactly). Calls
    of ``GPT.set_step`` with no training forward between (FLOP accounting, the final ``2**62``), eval
    forwards and the final calibration move neither θ nor the count."""
    alpha = 0.9
    m = model(ema_alpha=alpha, threshold_warmup_steps=2)
    router = m.routers[0]
    g = torch.Generator().manual_seed(1)
    raw, thetas = 0.0, []
    for step in range(4):
        m.set_step(step)
        assert int(router.steps) == step  # during step s the count is s
        qs = []
        for _ in range(2):
            x = batch(g)
            with torch.no_grad():
                seen = []
                hook = m.layers[0].register_forward_pre_hook(lambda mod, args: seen.append(args[0]))
                m(x)
                hook.remove()
            scores = router.score(seen[0]).detach().flatten()
            qs.append(torch.topk(scores, int(C * scores.numel())).values.min().item())
        raw = alpha * raw + (1 - alpha) * sum(qs) / 2
        thetas.append(raw / (1 - alpha ** (step + 1)))
        if step == 0:
            first = sum(qs) / 2
    m.set_step(4)
    assert int(router.steps) == 4
    assert router.cutoff.value().item() == pytest.approx(thetas[-1], rel=1e-5)
    assert thetas[0] == pytest.approx(first, rel=1e-6)  # the first θ is the first step's cutoff, not (1 − α) of it
    state = {k: v.clone() for k, v in m.named_buffers() if ".cutoff." in k}
    m.training_flops_per_token(T, 10)  # set_step(0 … 9) and set_step(2**62): nothing pending
    m.set_step(2**62)
    with torch.no_grad():
        m.eval()(batch(g))
    calibrate_causal_rules(m, [batch(g)])
    m.set_step(5)
    for k, v in state.items():
        assert torch.equal(m.get_buffer(k), v), k


# --- the warm-up and the switch ------------------------------------------------------------------------
def test_the_training_rule_is_topk_until_the_declared_step_then_the_decode_rule_and_the_causal_gap_closes():
    """W = 3: steps 0-2 process exactly the k highest of every sequence (expert choice), which the
    decode rule r ≥ θ does not reproduce, so the causal gap (causal bpb − top-k bpb) is a real gap;
    from step 3 the training forward processes exactly what r ≥ θ decides (slack 4: T slots, no
    overflow) and the gap is 0 up to float rounding. The test asserts where the rule changes, not a bpb."""
    warmup = 3
    m = model(threshold_warmup_steps=warmup, slack=4.0)
    assert all(r.causal_training_from == warmup for r in m.routers)
    opt = torch.optim.Adam(m.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(2)
    probe = batch(g, 8)
    rules, gaps = [], []
    for step in range(6):
        m.set_step(step)
        rules.append({r.training_rule() for r in m.routers})
        gaps.append(causal_gap(m, probe))
        for processed, decide in training_decisions(m, probe):
            if step < warmup:
                assert processed.sum(-1).tolist() == [K] * probe.shape[0]  # exactly k per sequence
            else:
                assert torch.equal(processed, decide)  # the decode rule, token for token
        x = batch(g)
        out = m(x, torch.roll(x, -1, 1))
        assert out.aux_losses == {}
        opt.zero_grad()
        out.loss.backward()
        opt.step()
    assert rules == [{"topk"}] * warmup + [{"threshold"}] * 3
    print(f"causal gap (bpb) by step, switch at {warmup}: {[round(x, 5) for x in gaps]}")
    assert all(abs(gap) > 1e-4 for gap in gaps[:warmup]), gaps  # top-k and r ≥ θ are different models
    assert all(abs(gap) < 1e-5 for gap in gaps[warmup:]), gaps  # one rule: the same model
    assert all(math.isfinite(gap) for gap in gaps)


def test_the_phase_is_the_routers_step_count_not_the_argument_of_set_step():
    """The trainer's last ``set_step(2**62)`` (evaluate past any capacity warm-up) must not switch a model
    that never left its warm-up; the count is in the state dict, so a resumed run keeps its phase."""
    m = model(threshold_warmup_steps=2)
    g = torch.Generator().manual_seed(3)
    m.set_step(2**62)
    assert {r.training_rule() for r in m.routers} == {"topk"}
    for step in range(2):
        m.set_step(step)
        with torch.no_grad():
            m(batch(g))
    m.set_step(2)
    assert {r.training_rule() for r in m.routers} == {"threshold"}
    resumed = model(seed=1, threshold_warmup_steps=2)
    resumed.load_state_dict(m.state_dict())
    assert [int(r.steps) for r in resumed.routers] == [2, 2]
    assert {r.training_rule() for r in resumed.routers} == {"threshold"}
    idx = batch(g)
    with torch.no_grad():
        torch.testing.assert_close(resumed.eval()(idx).logits, m.eval()(idx).logits)


def test_without_a_warmup_step_zero_already_routes_by_threshold_and_never_switching_is_expert_choice():
    """W = 0: thresholds from the first step (θ = 0 until the first update, as the released c is);
    W = −1: top-k for good (the paper's EC arms, decoded by the cutoff EMA), so no step's rule is causal."""
    assert model(threshold_warmup_steps=0).routers[0].training_rule() == "threshold"
    m = model(threshold_warmup_steps=-1)
    g = torch.Generator().manual_seed(4)
    for step in range(3):
        m.set_step(step)
        with torch.no_grad():
            m(batch(g))
    m.set_step(3)
    r = m.routers[0]
    assert r.training_rule() == "topk" and r.causal_training_from is None and r.cutoff.value().item() != 0.0


# --- the clamps ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("where", ["high", "low"])
def test_clamps_bound_each_sequences_count_in_training_and_decoding_ignores_them(where):
    """f = 0.25 after the warm-up: a threshold above every score still processes ⌊k(1 − f)⌋ per sequence
    (the highest), one below every score at most ⌊k(1 + f)⌋ (the slots); the decode rule r ≥ θ has no
    clamp (0 tokens, all tokens). So no training step's rule is the decode rule."""
    m = model(threshold_warmup_steps=0, capacity_factor=0.25)
    g = torch.Generator().manual_seed(5)
    for r in m.routers:
        r.cutoff.raw.fill_(1e3 if where == "high" else -1e3)
        r.cutoff.updates.fill_(1)
        r.cutoff.alpha = 0.0  # θ = c: a threshold set by hand
        assert r.training_rule() == "clamped_threshold" and r.causal_training_from is None
        assert r.tokens_run(K, T) == math.floor(K * 1.25)
    idx = batch(g)
    for processed, decide in training_decisions(m, idx):
        count = math.floor(K * 0.75) if where == "high" else math.floor(K * 1.25)
        assert processed.sum(-1).tolist() == [count] * idx.shape[0]
        assert bool((~decide).all()) if where == "high" else bool(decide.all())
