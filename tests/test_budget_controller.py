"""The budget controller of the variable-count routers (issue 26, item 3) and the per-step state it
shares with ``expert_threshold``'s threshold: read by the training forward, moved once per step by
``GPT.set_step``, equal on every data-parallel rank, untouched by the final calibration, logged per
routed layer, compiled without a host sync."""

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from modbench.config.model import ModelConfig, RoutingConfig
from modbench.config.run import RunConfig, TrainConfig
from modbench.model.gpt import GPT
from modbench.run import distributed
from modbench.run.causal_eval import calibrate_causal_rules
from modbench.run.train import train

VARIABLE = ["token_choice", "threshold", "expert_threshold"]
CFG = ModelConfig(depth=2, n_embd=32, head_dim=8, max_seq_len=64)
T = 64
C = 0.125
# Steps the controller (default gain 4) may take to bring the rule's share within C/4 of C, from a
# share near 0 or near 0.9: measured at most 7 on these models, for each variable-count variant.
REACH_STEPS = 16


def model(name: str, capacity: float = C, **options) -> GPT:
    torch.manual_seed(0)
    return GPT(CFG, RoutingConfig(name, capacity, pattern="DM", options={"controller": True, **options})).train()


def routed_input(m: GPT, idx: torch.Tensor) -> torch.Tensor:
    """The hidden state the routed layer (layer 1 of D M) sees, from an eval-mode forward (which adds
    nothing to the step's statistics)."""
    seen = []
    handle = m.layers[1].register_forward_pre_hook(lambda mod, args: seen.append(args[0]))
    was_training = m.training
    try:
        with torch.no_grad():
            m.eval()(idx)
    finally:
        handle.remove()
        m.train(was_training)
    return seen[0]


def rule_share(m: GPT, idx: torch.Tensor) -> float:
    router = m.routers[0]
    return router.decide_causal(routed_input(m, idx)).float().mean().item()


def start_at(m: GPT, idx: torch.Tensor, share: float) -> None:
    """Put the routed layer's rule at about ``share`` of the tokens: the controller's bias (logit
    variants) or the threshold (expert_threshold, as if after many steps: its EMA at its floor rate)."""
    router = m.routers[0]
    with torch.no_grad():
        scores = router.score(routed_input(m, idx)).flatten()
        cut = torch.quantile(scores, 1.0 - share) if share > 0 else scores.max() + scores.std()
        if hasattr(router, "theta"):
            router.theta.value.fill_(cut)
            router.theta.steps.fill_(1000)
        else:
            router.controller.bias.fill_(-cut - 1e-4 * scores.std())  # sigmoid(r + b) >= 0.5 iff r >= cut
            router.controller.updates.fill_(10)  # a controller that has run (past its warm start)


@pytest.mark.parametrize("start", [0.0, 0.9])
@pytest.mark.parametrize("name", VARIABLE)
def test_the_controller_brings_the_share_to_c_from_near_0_and_near_0_9(name, start):
    m = model(name)
    g = torch.Generator().manual_seed(1)
    batch = lambda: torch.randint(0, 256, (8, T), generator=g)  # noqa: E731
    probe = batch()
    start_at(m, probe, start)
    first = rule_share(m, probe)
    assert abs(first - start) < 0.05, first
    shares = []
    for step in range(REACH_STEPS + 40):
        m.set_step(step)
        x = batch()
        with torch.no_grad():
            m(x)  # a training forward (train mode): reads the state, adds its share to the step's gap
        shares.append(rule_share(m, x))  # the share that forward's rule realised (the state is unchanged)
    reached = next(i for i, s in enumerate(shares) if abs(s - C) < C / 4)
    assert reached <= REACH_STEPS, shares
    assert all(C / 2 <= s <= 2 * C for s in shares[reached:]), shares[reached:]  # and it stays near C
    assert abs(sum(shares[-20:]) / 20 - C) < C / 4


@pytest.mark.parametrize("name", ["token_choice", "threshold"])
def test_the_first_update_is_a_warm_start_to_a_share_of_c(name):
    """A fresh router's logits are centred (share ≈ 0.5); the first update sets the bias that would have
    given the first step's batch a share of exactly C, then the integral law takes over."""
    m = model(name)
    x = torch.randint(0, 256, (8, T), generator=torch.Generator().manual_seed(7))
    m.set_step(0)
    with torch.no_grad():
        m(x)
    before = rule_share(m, x)
    m.set_step(1)
    assert abs(before - 0.5) < 0.2 and rule_share(m, x) == pytest.approx(C, abs=1.5 / x.numel())
    assert m.routers[0].controller.updates.item() == 1


@pytest.mark.parametrize("name", VARIABLE)
def test_the_state_moves_once_per_step_by_the_mean_gap_of_its_forwards(name):
    """Micro-batches of one step read the same state; ``set_step`` moves it by μ·(mean gap), and the
    further ``set_step`` calls the trainer makes to count FLOPs find nothing pending."""
    m = model(name)
    router = m.routers[0]
    router.controller.updates.fill_(1)  # past the warm start
    gain = router.config.controller_gain
    g = torch.Generator().manual_seed(2)
    xs = [torch.randint(0, 256, (4, T), generator=g) for _ in range(2)]
    bias0 = router.controller.bias.clone()
    gaps = []
    for x in xs:
        h = routed_input(m, x)
        wanting = router.decide_causal(h).float().mean()
        scale = router.score(h).float().std().clamp_min(1e-3)  # σ of the logits (a shift leaves it unchanged)
        gaps.append((C - wanting) * scale)
    for x in xs:
        with torch.no_grad():
            m(x)  # two micro-batches of one step
        assert torch.equal(router.controller.bias, bias0)  # the forward reads the bias, never moves it
    m.set_step(1)
    torch.testing.assert_close(router.controller.bias, bias0 + gain * torch.stack(gaps).mean(), rtol=1e-5, atol=1e-7)
    after = router.controller.bias.clone()
    m.training_flops_per_token(T, 10)  # set_step(0 … 9) and set_step(2**62): nothing pending
    m.set_step(2)
    assert torch.equal(router.controller.bias, after)
    assert not torch.equal(after, bias0)


def test_expert_threshold_is_the_ema_of_the_steps_capacity_quantile():
    """θ after the first step: the mean over the step's forwards of the k-th largest of the B·T scores
    (k = ⌊C·B·T⌋, rate 1 at the first step); then θ ← θ + momentum·(q − θ)."""
    torch.manual_seed(0)
    m = GPT(CFG, RoutingConfig("expert_threshold", C, pattern="DM")).train()
    router = m.routers[0]
    g = torch.Generator().manual_seed(3)
    quantiles = []
    for step in range(4):
        m.set_step(step)
        q = []
        for _ in range(2):
            x = torch.randint(0, 256, (4, T), generator=g)
            scores = router.score(routed_input(m, x)).flatten()
            q.append(torch.topk(scores, int(C * scores.numel())).values.min())
            with torch.no_grad():
                m(x)  # the training forward, reading θ as it stood at the step's start
        quantiles.append(torch.stack(q).mean())
    m.set_step(4)
    theta = quantiles[0]  # rate 1 at the first update
    for n, q in enumerate(quantiles[1:], start=2):
        theta = theta + max(1.0 / n, router.config.momentum) * (q - theta)
    torch.testing.assert_close(router.theta.value, theta, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("name", VARIABLE)
def test_calibration_leaves_the_state_the_training_forward_reads_alone(name):
    m = model(name)
    g = torch.Generator().manual_seed(4)
    for step in range(3):
        m.set_step(step)
        with torch.no_grad():
            m(torch.randint(0, 256, (4, T), generator=g))
    m.set_step(3)
    with torch.no_grad():
        m(torch.randint(0, 256, (4, T), generator=g))  # a pending step's statistics, too
    state = {k: v.clone() for k, v in m.named_buffers() if ".controller." in k or ".theta." in k}
    assert state and any(k.endswith("gap.count") and v.item() == 1 for k, v in state.items())
    calibrate_causal_rules(m, [torch.randint(0, 256, (4, T), generator=g) for _ in range(3)])
    for k, v in state.items():
        assert torch.equal(m.get_buffer(k), v), k


def test_a_checkpoint_from_before_the_controller_loads_as_bias_zero():
    old = GPT(CFG, RoutingConfig("threshold", C, pattern="DM", options={"controller": False}))
    state = old.state_dict()
    assert not any("controller" in k for k in state)
    new = GPT(CFG, RoutingConfig("threshold", C, pattern="DM"))  # the default: controller on
    new.load_state_dict(state)
    assert new.routers[0].controller.bias.item() == 0.0
    idx = torch.randint(0, 256, (2, T))
    with torch.no_grad():
        assert torch.equal(new.eval()(idx).logits, old.eval()(idx).logits)


@pytest.mark.parametrize("name", ["token_choice", "expert_threshold"])
def test_the_controlled_forward_compiles_fullgraph_without_a_host_sync(name):
    """threshold's default (controller on) is in tests/bench/test_compile.py's sweep; these two have it
    off by default, so their controlled forward is compiled here the same way."""
    import copy

    torch._dynamo.reset()
    eager = model(name)
    for p in eager.routers[0].parameters():
        if p.dim() > 0:
            torch.nn.init.normal_(p, std=0.5)
    compiled_base = copy.deepcopy(eager)
    graphs = []
    inner = torch._dynamo.lookup_backend("aot_eager")
    compiled = torch.compile(compiled_base, fullgraph=True,
                             backend=lambda gm, ex: graphs.append(gm) or inner(gm, ex))
    idx = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(5))
    for net in (eager, compiled):
        out = net(idx, idx)
        aux = eager.weighted_aux_loss(out.aux_losses, 10)
        (out.loss if aux is None else out.loss + aux).backward()
    assert len(graphs) == 1
    names = [str(n.target) for gm in graphs for n in gm.graph.nodes if n.op in ("call_function", "call_method")]
    syncing = ("item", "tolist", "nonzero", "_local_scalar_dense", "masked_select", "unique", "cpu", "numpy")
    assert not [n for n in names if any(n == s or n.endswith(f".{s}") or f" {s}" in n for s in syncing)]
    for (name_, a), b in zip(eager.named_buffers(), compiled_base.buffers()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=lambda msg: f"{name_}: {msg}")
    eager.set_step(1)
    compiled_base.set_step(1)
    torch.testing.assert_close(compiled_base.routers[0].controller.bias, eager.routers[0].controller.bias)


def test_the_controller_bias_and_the_threshold_are_logged_per_routed_layer(tmp_cwd):
    cfg = RunConfig(ModelConfig(depth=2, n_embd=32, head_dim=16, max_seq_len=32),
                    RoutingConfig("expert_threshold", 0.25, pattern="all", options={"controller": True}),
                    TrainConfig(dataset="arithmetic", seq_len=32, batch_size=4, budget="steps=4", eval_every=100,
                                log_every=2, eval_windows=4, track=False, out_dir="runs"))
    result = train(cfg, progress=False)
    rows = [h for h in result.history if "train/loss" in h]
    assert [h["step"] for h in rows] == [2, 4]
    for layer in (0, 1):
        biases = [h[f"route/L{layer}/controller_bias"] for h in rows]
        thresholds = [h[f"route/L{layer}/threshold"] for h in rows]
        assert biases[0] != 0.0 and thresholds[0] != thresholds[1]  # moved by the steps before each log


# --- data parallel: the state stays equal on every rank --------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_states(rank: int, world: int, port: int, name: str, results: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        m = model(name)
        step_model = distributed.wrap_model(m, torch.device("cpu"))
        g = torch.Generator().manual_seed(6)
        pending = []
        for step in range(3):
            m.set_step(step)
            for micro in range(2):
                x = distributed.local_slice(torch.randint(0, 256, (4, T), generator=g))  # each rank its own half
                with distributed.grad_sync(step_model, micro == 1):
                    step_model(x, x).loss.backward()
                if micro == 0:
                    pending.append(m.routers[0].controller.gap.total.clone())  # this rank's own, before the sync
        m.set_step(3)
        results[rank] = ({k: v.clone() for k, v in m.named_buffers() if ".controller." in k or ".theta." in k}, pending)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("name", ["threshold", "expert_threshold"])
def test_ranks_read_equal_state_at_every_step(name):
    """Two gloo processes, each on its half of every batch: their own shares differ, yet after the
    per-step sync the controller's bias (and expert_threshold's threshold) are bit-identical."""
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_rank_states, args=(2, _free_port(), name, out), nprocs=2, join=True)
        (state0, pending0), (state1, pending1) = out[0], out[1]
    assert any(not torch.equal(a, b) for a, b in zip(pending0, pending1))  # the slices' shares differ
    assert state0.keys() == state1.keys() and any(k.endswith("controller.bias") for k in state0)
    for k in state0:
        assert torch.equal(state0[k], state1[k]), k
    assert state0[next(k for k in state0 if k.endswith("controller.bias"))].item() != 0.0


class _Stop(Exception):
    pass


def test_resume_continues_the_controller_exactly(tmp_cwd):
    """The controller's bias and the step's pending statistics are in the checkpoint: a resumed run
    gives the same losses and shares as an uninterrupted one."""
    def cfg(out_dir: str) -> RunConfig:
        return RunConfig(ModelConfig(depth=2, n_embd=32, head_dim=16, max_seq_len=32),
                         RoutingConfig("threshold", 0.25, pattern="all"),
                         TrainConfig(dataset="arithmetic", seq_len=32, batch_size=4, budget="steps=12", eval_every=6,
                                     log_every=3, eval_windows=4, checkpoint_every=6, track=False, out_dir=out_dir))

    def rows(result) -> list:
        return [{k: v for k, v in h.items() if k.startswith(("train/loss", "route/"))} for h in result.history
                if "train/loss" in h]

    full = train(cfg("full"), progress=False)

    def interrupt(step, val):
        if step == 6:
            raise _Stop

    with pytest.raises(_Stop):
        train(cfg("parts"), progress=False, on_eval=interrupt)
    resumed = train(cfg("parts"), progress=False, resume=True)
    assert rows(resumed) == rows(full) and any("route/L0/controller_bias" in r for r in rows(full))
