"""Recursive models (Mixture-of-Recursions, arXiv:2507.10524 §2.1): one shared block applied N_R
times, Cycle and Middle-Cycle sharing; parameters counted once, FLOPs per application; the same
causal, KV-cache and determinism properties as every other model."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from modbench import variants
from modbench.config.io import read_toml
from modbench.config.model import ModelConfig, RoutingConfig
from modbench.config.run import RunConfig, TrainConfig
from modbench.errors import ModbenchError
from modbench.model.decode import Decoder, generate
from modbench.model.gpt import GPT, RoutedBlock
from modbench.model.recursion import recursion_step, sharing_map
from modbench.run.causal_eval import calibrate_causal_rules, leak_rate

T = 32
SHAPES = [("cycle", 2, 4), ("cycle", 3, 3), ("middle_cycle", 2, 4), ("middle_cycle", 3, 5), ("middle_cycle", 4, 10)]


def cfg(mode: str = "middle_cycle", n_r: int = 3, depth: int = 5, max_seq_len: int = T) -> ModelConfig:
    return ModelConfig(depth=depth, n_embd=32, head_dim=8, max_seq_len=max_seq_len, recursion=mode, recursions=n_r)


def block_params(m: GPT, i: int) -> int:
    return sum(p.numel() for p in m.layers[i].block.parameters())


# --- the sharing map and the config -------------------------------------------------------------
def test_sharing_maps_follow_the_released_code():
    # middle_cycle: [first] + N_R × block + [last]; cycle: the whole stack cycled
    # (raymin0223/mixture_of_recursions, model/sharing_strategy/llama.py: 1 + i + rec·base_depth)
    assert sharing_map(8, "middle_cycle", 3) == (0, 1, 2, 1, 2, 1, 2, 3)
    assert sharing_map(6, "cycle", 3) == (0, 1, 0, 1, 0, 1)
    assert sharing_map(3, "none", 1) == (0, 1, 2)
    assert recursion_step(8, "middle_cycle", 3) == (None, 0, 0, 1, 1, 2, 2, None)
    assert recursion_step(4, "cycle", 2) == (0, 0, 1, 1)


@pytest.mark.parametrize("mode, n_r, depth", SHAPES)
def test_physical_and_effective_depth(mode, n_r, depth):
    c = cfg(mode, n_r, depth)
    assert c.layers == depth  # effective: applications on the residual stream
    unshared = 2 if mode == "middle_cycle" else 0
    assert c.physical_layers == (depth - unshared) // n_r + unshared
    assert c.physical_layers == len(set(sharing_map(depth, mode, n_r)))
    assert c.width == ModelConfig(depth=depth, n_embd=32, head_dim=8).width
    assert c.to_dict()["resolved_physical_layers"] == c.physical_layers


@pytest.mark.parametrize("kw, expected", [
    (dict(recursion="loop", recursions=2), "model.recursion 'loop' is unknown: expected one of 'none', 'cycle', 'middle_cycle'"),
    (dict(recursions=3), "model.recursions = 3 needs a shared block"),
    (dict(recursion="cycle", recursions=1), "model.recursions = 1 is out of range for recursion 'cycle': expected one of 2, 3, 4"),
    (dict(recursion="cycle", recursions=5), "model.recursions = 5 is out of range: expected an integer in [1, 4]"),
    (dict(recursion="cycle", recursions=2, depth=5), "model depth 5 does not split into 2 applications"),
    (dict(recursion="middle_cycle", recursions=3, depth=6), "model depth 6 does not split into 3 applications"),
    (dict(recursion="middle_cycle", recursions=2, depth=3), "model depth 3 does not split into 2 applications"),
])
def test_bad_recursion_configs_are_one_line_errors(kw, expected):
    with pytest.raises(ModbenchError) as e:
        ModelConfig(**kw)
    assert str(e.value).startswith(expected) and "\n" not in str(e.value)


def test_recursion_round_trips_through_the_config_file(tmp_path):
    run = RunConfig(cfg("middle_cycle", 3, 5), RoutingConfig("sigmoid", 0.25, pattern="fixed:1,1"),
                    TrainConfig(dataset="arithmetic", seq_len=T))
    (tmp_path / "run.toml").write_text(run.to_toml())
    back = RunConfig.from_dict(read_toml(tmp_path / "run.toml"))
    assert back == run and back.model.recursion == "middle_cycle" and back.model.recursions == 3
    with pytest.raises(ModbenchError, match="model.recursion 'loop' is unknown"):
        RunConfig.from_dict({"model": {"recursion": "loop", "recursions": 2}})


def test_recursion_flags_round_trip_through_print_config(tmp_cwd, capsys):
    from modbench.cli.main import main

    argv = ["train", "--dataset", "arithmetic", "--depth", "5", "--recursion", "middle_cycle", "--recursions", "3",
            "--variant", "mor", "--capacity", "0.3333333333333333", "--capacities", "1,2/3,1/3", "--pattern", "fixed:1,1"]
    assert main([*argv, "--print-config"]) == 0
    text = capsys.readouterr().out
    (tmp_cwd / "run.toml").write_text(text)
    back = RunConfig.from_dict(read_toml(tmp_cwd / "run.toml"))
    assert (back.model.recursion, back.model.recursions, back.routing.capacities) == ("middle_cycle", 3, "1,2/3,1/3")
    assert main(["train", "--dataset", "arithmetic", "--depth", "6", "--recursion", "middle_cycle", "--recursions", "3"]) == 2
    err = capsys.readouterr().err.strip()
    assert "model depth 6 does not split into 3 applications" in err and "\n" not in err


# --- parameters once, FLOPs per application -----------------------------------------------------
@pytest.mark.parametrize("mode, n_r, depth", SHAPES)
def test_a_shared_block_is_one_module_and_its_parameters_count_once(mode, n_r, depth):
    torch.manual_seed(0)
    rec, vanilla = GPT(cfg(mode, n_r, depth)), GPT(dataclasses.replace(cfg(), depth=depth, recursion="none", recursions=1))
    share = sharing_map(depth, mode, n_r)
    for i, j in itertools.product(range(depth), repeat=2):
        assert (rec.layers[i].block is rec.layers[j].block) == (share[i] == share[j])
    assert len({id(layer.block) for layer in rec.layers}) == rec.cfg.physical_layers
    b = (depth - (2 if mode == "middle_cycle" else 0)) // n_r
    assert rec.num_params() == vanilla.num_params() - (n_r - 1) * b * block_params(vanilla, 0)
    assert rec.num_params() == len(torch.nn.utils.parameters_to_vector(rec.parameters()))
    # the same FLOPs as the vanilla twin: a block's work is counted at each application
    assert rec.flop_report(T) == vanilla.flop_report(T)


def counted(model: GPT, idx: torch.Tensor) -> tuple[float, float]:
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as fc:
        out = model(idx, idx)
    fwd = fc.get_total_flops()
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as fc:
        out = model(idx, idx)
        (out.loss + (model.weighted_aux_loss(out.aux_losses, 10**6) or 0.0)).backward()
    return fwd / idx.shape[0], fc.get_total_flops() / idx.shape[0]


@pytest.mark.parametrize("routing", [RoutingConfig(), RoutingConfig("sigmoid", 0.5, pattern="fixed:1,1"),
                                     RoutingConfig("nested", 0.25, pattern="all", capacity_first=0.75),
                                     RoutingConfig("mlp_skip", 0.5, pattern="alternate")])
@pytest.mark.parametrize("mode, n_r, depth", [("cycle", 2, 4), ("middle_cycle", 3, 5)])
def test_analytic_flops_match_flop_counter(routing, mode, n_r, depth):
    torch.manual_seed(0)
    m = GPT(cfg(mode, n_r, depth, max_seq_len=96), routing)
    idx = torch.randint(0, 256, (2, 96))
    fwd, total = counted(m, idx)
    report = m.flop_report(96, causal=False)
    assert report.forward == pytest.approx(fwd, rel=0.01)
    assert report.total == pytest.approx(total, rel=0.01)


@pytest.mark.parametrize("name", variants.list_variants())
def test_every_variant_on_a_recursive_model_counts_flops_as_flop_counter_mode(name):
    """Middle-Cycle, N_R = 2, pattern alternate: the shared block runs routed at one application and
    dense at the other (a MoDE block's gate is counted at both), the unshared last layer routed."""
    torch.manual_seed(0)
    m = GPT(cfg("middle_cycle", 2, 4, max_seq_len=96), RoutingConfig(name, capacity=0.5, pattern="alternate"))
    assert m.layers[1].block is m.layers[2].block
    fwd, total = counted(m, torch.randint(0, 256, (2, 96)))
    report = m.flop_report(96, causal=False)
    assert report.forward == pytest.approx(fwd, rel=0.01)
    assert report.total == pytest.approx(total, rel=0.01)


def test_the_shared_block_gets_the_gradient_of_every_application():
    """One parameter, N_R uses: its gradient is the sum over the applications (autograd's, checked
    against the per-application gradients of an untied copy with the same weights)."""
    torch.manual_seed(0)
    rec = GPT(cfg("cycle", 2, 2))
    untied = GPT(dataclasses.replace(rec.cfg, recursion="none", recursions=1))
    state = {k: v for k, v in rec.state_dict().items()}
    untied.load_state_dict(state)  # the recursive state dict names the shared block at both positions
    idx = torch.randint(0, 256, (2, T))
    rec(idx, idx).loss.backward()
    untied(idx, idx).loss.backward()
    w = rec.layers[0].block.mlp.fc.weight
    assert w is rec.layers[1].block.mlp.fc.weight
    expected = untied.layers[0].block.mlp.fc.weight.grad + untied.layers[1].block.mlp.fc.weight.grad
    torch.testing.assert_close(w.grad, expected, atol=1e-6, rtol=1e-5)


def test_init_scales_the_residual_projections_by_the_effective_depth():
    torch.manual_seed(0)
    m = GPT(ModelConfig(depth=10, n_embd=256, head_dim=32, max_seq_len=T, recursion="middle_cycle", recursions=4))
    assert m.cfg.physical_layers == 4
    std = m.layers[1].block.mlp.proj.weight.std().item()
    assert std == pytest.approx(0.02 / (2 * 10) ** 0.5, rel=0.05)  # not 0.02/√(2·4)


@pytest.mark.parametrize("mode, n_r, depth", SHAPES)
def test_param_matched_vanilla_has_the_recursive_models_parameters_and_fewer_flops(mode, n_r, depth):
    from modbench.model.sizing import non_embedding_params, param_matched_vanilla

    rec = ModelConfig(depth=depth, head_dim=16, max_seq_len=T, recursion=mode, recursions=n_r)
    twin = param_matched_vanilla(rec)
    assert twin.recursion == "none" and twin.layers == rec.physical_layers and twin.width == rec.width
    assert non_embedding_params(twin, RoutingConfig()) == non_embedding_params(rec, RoutingConfig())
    assert GPT(twin).flops_per_token(T) < GPT(rec).flops_per_token(T)


def test_matched_dense_control_of_a_recursive_arm_is_a_vanilla_model():
    from modbench.model.sizing import matched_dense_shape

    run = RunConfig(cfg("cycle", 2, 4), RoutingConfig("sigmoid", 0.5, pattern="all"), TrainConfig(seq_len=T))
    depth, width, ratio = matched_dense_shape(run, tolerance=1.0)
    assert 1 <= depth <= 4 and width <= 32 and ratio > 0


# --- determinism, causality and the KV cache ----------------------------------------------------
def test_same_seed_same_model_and_step_bit_for_bit(one_training_step):
    build = lambda: GPT(cfg("middle_cycle", 2, 4), RoutingConfig("sigmoid", 0.5, pattern="fixed:1,1"))  # noqa: E731
    (a, la), (b, lb) = one_training_step(build), one_training_step(build)
    assert la == lb and torch.equal(a, b)


def routed_model(name: str, mode: str, n_r: int, depth: int) -> GPT:
    torch.manual_seed(0)
    m = GPT(cfg(mode, n_r, depth), RoutingConfig(name, capacity=0.5, pattern="fixed:1,1" if mode == "middle_cycle" else "all"))
    for r in m.routers:
        for pname, p in r.named_parameters():
            if pname.endswith("bias"):
                torch.nn.init.zeros_(p)
            elif p.dim() > 0:
                torch.nn.init.normal_(p, std=0.5)
    calibrate_causal_rules(m, [torch.randint(0, 256, (4, T))])
    return m.eval()


@pytest.mark.parametrize("name", ["dense", "sigmoid", "nested", "mor", "mor_token_choice"])
@pytest.mark.parametrize("mode, n_r, depth", [("cycle", 2, 2), ("middle_cycle", 3, 5)])
@pytest.mark.parametrize("batch", [1, 3])
def test_cached_generation_equals_the_causal_forward(name, mode, n_r, depth, batch):
    """Each application of the shared block keeps its own KV cache, holding only the tokens that
    application processed (recursion-wise caching), so decoding is the causal pass."""
    m = routed_model(name, mode, n_r, depth)
    prompt = torch.randint(0, 256, (batch, 5), generator=torch.Generator().manual_seed(batch))
    out = generate(m, prompt, 12, temperature=0, return_logits=True)
    full = m(out.tokens[:, :-1], routing_mode="causal").logits
    torch.testing.assert_close(out.logits, full, atol=1e-5, rtol=1e-5)
    if name != "dense":
        assert sum(isinstance(layer, RoutedBlock) for layer in m.layers) == n_r * (depth - (2 if mode == "middle_cycle" else 0)) // n_r
        assert 0.0 < out.skipped_fraction < 1.0


@pytest.mark.parametrize("name", variants.list_variants())
def test_every_variant_on_a_recursive_model_decodes_as_its_causal_pass(name):
    m = routed_model(name, "middle_cycle", 2, 4)
    prompt = torch.randint(0, 256, (3, 4), generator=torch.Generator().manual_seed(0))
    out = generate(m, prompt, 10, temperature=0, return_logits=True)
    torch.testing.assert_close(out.logits, m(out.tokens[:, :-1], routing_mode="causal").logits, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["sigmoid", "nested", "mor", "mor_token_choice"])
def test_causal_mode_of_a_recursive_model_never_looks_ahead(name):
    m = routed_model(name, "middle_cycle", 3, 5)
    idx = torch.randint(0, 256, (2, T))
    with torch.no_grad():
        base = m(idx, routing_mode="causal").logits
        for t in (0, 9, T - 2):
            other = idx.clone()
            other[:, t + 1 :] = torch.randint(0, 256, (2, T - t - 1))
            assert torch.equal(m(other, routing_mode="causal").logits[:, : t + 1], base[:, : t + 1])
    assert leak_rate(m, idx, routing_mode="causal") == 0.0


# --- mor: expert choice per recursion step ------------------------------------------------------
def mor_model(**options) -> GPT:
    """Middle-Cycle, N_R = 3, a one-layer block; per-step capacities 1, 2/3, 1/3 (capacity_first = 1)."""
    torch.manual_seed(0)
    m = GPT(cfg("middle_cycle", 3, 5, max_seq_len=96),
            RoutingConfig("mor", capacity=1 / 3, capacity_first=1.0, pattern="fixed:1,1", options=options))
    for r in m.routers:
        torch.nn.init.normal_(r.scorer.proj.weight, std=0.5)
    return m


def test_mor_steps_nest_with_per_step_capacities_one_two_thirds_one_third():
    m = mor_model()
    m.set_collect_stats(True)
    idx = torch.randint(0, 256, (3, 96))
    stats = m(idx, idx).stats
    processed = [s["layer_processed"] for s in stats]
    assert [int(p[0].sum()) for p in processed] == [96, 64, 32]  # k_r = ⌊C_r·T⌋ of the whole sequence
    for before, after in zip(processed, processed[1:]):
        assert not (after & ~before).any()  # a token processed at step r was a candidate: processed at r − 1
    assert all(layer.block is m.layers[1].block for layer in m.layers[1:4])  # one shared block


@pytest.mark.parametrize("update", ["output", "delta"])
def test_mor_update_weights_the_blocks_output_or_its_delta(update):
    """Released code: scatter_add(x, g·block(x)), block(x) = x + Δ; option delta: x + g·Δ."""
    m = mor_model(update=update).eval()
    layer = m.layers[1]
    x = torch.randn(2, 96, 32)
    cos, sin = m.rope_cos, m.rope_sin
    with torch.no_grad():
        out = layer(x, cos, sin).x  # step 0 at capacity 1: every token
        delta = layer.block.delta(x, cos[:96], sin[:96])
        g = 0.1 * torch.sigmoid(layer.router.logit(x)).unsqueeze(-1)
    expected = x + g * (x + delta) if update == "output" else x + g * delta
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_mor_aux_losses_cover_the_steps_candidates_only():
    m = mor_model(z_weight=1e-3)
    router = m.layers[2].router  # step 1: candidates are what step 0 processed
    x = torch.randn(2, 96, 32)
    previous = torch.rand(2, 96) < 0.75
    r = router.route(x, 32, previous)
    raw = router.logit(x)
    target = torch.zeros_like(raw).scatter_(-1, r.index, 1.0)
    assert previous.gather(-1, r.index).all()  # selected among the candidates
    bce = torch.nn.functional.binary_cross_entropy_with_logits(raw[previous], target[previous])
    torch.testing.assert_close(r.aux_losses["router_bce"], bce)
    torch.testing.assert_close(r.aux_losses["router_z"], raw[previous].square().mean())
    assert router.aux_weights(0) == {"router_bce": 0.001, "router_z": 1e-3}


def test_mor_causal_rule_is_hierarchical():
    m = mor_model().eval()
    m.set_collect_stats(True)
    idx = torch.randint(0, 256, (2, 96))
    with torch.no_grad():
        decides = [s["decide"] for s in m(idx, routing_mode="causal").stats]
    for before, after in zip(decides, decides[1:]):
        assert not (after & ~before).any()


def test_a_step_at_capacity_one_processes_every_token_causally_too():
    """Top-k at capacity 1 takes every token, so the causal rule of that step (mor's first step with
    capacities 1, 2/3, 1/3) takes every token as well — an untrained router's r ≥ 0 takes about half."""
    torch.manual_seed(0)
    m = GPT(cfg("middle_cycle", 3, 5, max_seq_len=96),
            RoutingConfig("mor", capacity=1 / 3, capacities="1,2/3,1/3", pattern="fixed:1,1")).eval()
    m.set_collect_stats(True)
    idx = torch.randint(0, 256, (2, 96))
    seen, decide = [], m.layers[1].decide
    m.layers[1].decide = lambda x, previous: (seen.append(x), decide(x, previous))[1]  # the first step's input
    with torch.no_grad():
        decides = [s["decide"] for s in m(idx, routing_mode="causal").stats]
        assert 0 < (m.routers[0].logit(seen[0]) >= 0).float().mean() < 1  # its own rule would skip some
    assert decides[0].all() and not decides[1].all()


@pytest.mark.parametrize("options", [{"sampling": "aux_router"}, {"sampling": "aux_router", "z_weight": 1e-3},
                                     {"update": "delta", "temperature": 2.0}])
def test_mor_options_keep_flops_and_decoding_exact(options):
    torch.manual_seed(0)
    m = GPT(cfg("middle_cycle", 3, 5, max_seq_len=96),
            RoutingConfig("mor", capacity=1 / 3, capacity_first=1.0, pattern="fixed:1,1", options=options))
    fwd, total = counted(m, torch.randint(0, 256, (2, 96)))
    report = m.flop_report(96, causal=False)
    assert report.forward == pytest.approx(fwd, rel=0.01) and report.total == pytest.approx(total, rel=0.01)
    for r in m.routers:
        for p in r.parameters():
            if p.dim() == 2:
                torch.nn.init.normal_(p, std=0.5)
    m.eval()
    prompt = torch.randint(0, 256, (3, 4), generator=torch.Generator().manual_seed(0))
    out = generate(m, prompt, 10, temperature=0, return_logits=True)
    torch.testing.assert_close(out.logits, m(out.tokens[:, :-1], routing_mode="causal").logits, atol=1e-5, rtol=1e-5)


def test_mor_aux_router_decides_at_decode_time_and_learns_from_detached_states():
    """sampling = aux_router (released code): the BCE trains the second router only, on the detached
    state; the main router gets no BCE gradient; decode decides by the second router."""
    m = mor_model(sampling="aux_router")
    router = m.layers[1].router
    x = torch.randn(2, 96, 32, requires_grad=True)
    r = router.route(x, 48)
    r.aux_losses["router_bce"].backward()
    assert router.aux_scorer.proj.weight.grad.abs().sum() > 0
    assert router.scorer.proj.weight.grad is None and x.grad is None
    with torch.no_grad():
        torch.testing.assert_close(router.decide_causal(x), router.aux_scorer(x) >= 0)


@pytest.mark.parametrize("n_r, capacities, counts", [(2, "1,1/2", [96, 48]), (3, "1,2/3,1/3", [96, 64, 32]),
                                                     (4, "1,3/4,1/2,1/4", [96, 72, 48, 24])])
def test_mor_per_step_capacities_from_an_explicit_list(n_r, capacities, counts):
    torch.manual_seed(0)
    routing = RoutingConfig("mor", capacity=1 / n_r, capacities=capacities, pattern="fixed:1,1")
    m = GPT(cfg("middle_cycle", n_r, 2 + n_r, max_seq_len=96), routing)
    m.set_collect_stats(True)
    idx = torch.randint(0, 256, (2, 96))
    processed = [s["layer_processed"] for s in m(idx, idx).stats]
    assert [int(p[0].sum()) for p in processed] == counts
    assert all(not (b & ~a).any() for a, b in zip(processed, processed[1:]))
    # the FLOPs count each step at its own capacity
    assert m.flop_report(96).tokens_processed == [96, *counts, 96]


@pytest.mark.parametrize("kw, expected", [
    (dict(capacities="1,2/3,1/3", capacity=0.25), "routing.capacities '1,2/3,1/3' ends at 0.333333, not at routing.capacity 0.25"),
    (dict(capacities="1,x,1/3", capacity=1 / 3), "routing.capacities '1,x,1/3' has the entry 'x'"),
    (dict(capacities="1,0,1/3", capacity=1 / 3), "routing.capacities '1,0,1/3' has the entry '0'"),
    (dict(capacities="1,1/2", capacity=0.5, capacity_first=1.0), "routing.capacities and routing.capacity_first both"),
])
def test_bad_capacity_lists_are_one_line_errors(kw, expected):
    with pytest.raises(ModbenchError) as e:
        RoutingConfig("mor", pattern="fixed:1,1", **kw)
    assert str(e.value).startswith(expected) and "\n" not in str(e.value)


def test_a_capacity_list_needs_one_entry_per_routed_layer():
    with pytest.raises(ModbenchError, match="has 2 entries for 3 routed layers"):
        RunConfig(cfg("middle_cycle", 3, 5), RoutingConfig("mor", 0.5, pattern="fixed:1,1", capacities="1,1/2"))
    assert RoutingConfig("mor", 1.0, capacities="1,1").is_dense


@pytest.mark.parametrize("options, expected", [({"update": "sum"}, "update must be one of 'output', 'delta'"),
                                               ({"sampling": "router"}, "sampling must be one of 'aux_loss', 'aux_router'"),
                                               ({"alpha": 0.0}, "alpha must be in (0, 10]"),
                                               ({"z_weight": -1.0}, "z_weight must be >= 0")])
def test_mor_bad_options_are_one_line_errors(options, expected):
    from modbench import variants

    with pytest.raises(ModbenchError, match=expected.replace("(", r"\(").replace("]", r"\]")):
        variants.get_variant("mor").make_config(options)


# --- mor_token_choice: the depth chosen up front ------------------------------------------------
def tc_model(min_depth: int = 1, capacities: str = "1,1/2,1/2", capacity: float = 0.5, **options) -> GPT:
    """Middle-Cycle, N_R = 3, a one-layer block, its three applications routed. By default every step
    has T slots (k = 16, slack 3): no overflow."""
    torch.manual_seed(0)
    m = GPT(cfg("middle_cycle", 3, 5), RoutingConfig("mor_token_choice", capacity=capacity, capacities=capacities,
                                                       pattern="fixed:1,1", options={"min_depth": min_depth, **options}))
    torch.nn.init.normal_(m.routers[0].depth_router.weight, std=0.5)  # a spread of depths at initialisation
    return m


def first_routed_input(m: GPT, idx: torch.Tensor) -> torch.Tensor:
    return m.layers[0](m.embed(idx), m.rope_cos, m.rope_sin).x


@pytest.mark.parametrize("min_depth", [0, 1])
def test_mor_token_choice_steps_follow_the_depth_chosen_at_the_first_step(min_depth):
    """One router (N = 3 + 1 − min_depth outputs) at the first step; step s processes exactly the tokens
    whose depth d = min_depth + argmax r exceeds s, so a token processed at s was processed at s − 1."""
    m = tc_model(min_depth)
    first, *later = m.routers
    assert first.depth_router.out_features == 4 - min_depth and all(r.depth_router is None for r in later)
    assert [sum(p.numel() for p in r.parameters()) for r in later] == [0, 0]
    idx = torch.randint(0, 256, (3, T))
    m.set_collect_stats(True)
    with torch.no_grad():
        stats = m(idx, idx).stats
        depth = min_depth + (first_routed_input(m, idx) @ first.depth_router.weight.T).argmax(-1)
    processed = [s["layer_processed"] for s in stats]
    for step, p in enumerate(processed):
        assert torch.equal(p, depth > step)
        assert stats[step]["overflow"] == 0
    for before, after in zip(processed, processed[1:]):
        assert not (after & ~before).any()
    assert processed[0].all() == (min_depth == 1) and processed[2].any() and not processed[2].all()
    assert stats[0]["mean_depth"] == pytest.approx(depth.float().mean().item())


def released_token_choice(x_in, weight, block, cos, sin, steps):
    """The released code's arithmetic (raymin0223/mixture_of_recursions token_choice_router.py,
    MoRLlamaDecoderLayer.forward: softmax router, α = 1, gating "weighted", no KV sharing), per sequence:
    token i runs blocks 0 … e (e its top-1 expert); steps before e replace its state by the block's
    output, step e adds g·output to the layer's input (``final_x``)."""
    probs = torch.softmax(x_in @ weight.T, -1)
    expert = probs.argmax(-1)
    gate = probs.gather(-1, expert.unsqueeze(-1))
    final, x = x_in.clone(), x_in.clone()
    for step in range(steps):
        updates = x.clone()
        for b in range(x.shape[0]):
            sel = (expert[b] >= step).nonzero().squeeze(1)
            if not sel.numel():
                continue
            sub = x[b, sel].unsqueeze(0)
            out = (sub + block.delta(sub, cos[sel][None, None], sin[sel][None, None]))[0]
            done, going = expert[b, sel] == step, expert[b, sel] > step
            final[b, sel[done]] = x_in[b, sel[done]] + gate[b, sel[done]] * out[done]
            updates[b, sel[going]] = out[going]
        x = updates
    return final


@pytest.mark.parametrize("routing_mode", ["topk", "causal"])
def test_mor_token_choice_weights_the_output_as_the_released_code(routing_mode):
    m = tc_model(1).eval()
    idx = torch.randint(0, 256, (3, T))
    cos, sin = m.rope_cos[:T], m.rope_sin[:T]
    with torch.no_grad():
        x = x_in = first_routed_input(m, idx)
        expected = released_token_choice(x_in, m.routers[0].depth_router.weight, m.layers[1].block, cos, sin, 3)
        previous = None
        for layer in m.layers[1:4]:
            out = layer(x, cos, sin, previous) if routing_mode == "topk" else layer.forward_causal(x, cos, sin, previous)
            x, previous = out.x, out.handoff
    assert 0 < previous.depth.eq(1).sum() and 0 < previous.depth.eq(3).sum()  # exits at the first and the last step
    torch.testing.assert_close(x, expected, atol=1e-5, rtol=1e-5)


def test_mor_token_choice_balancing_and_z_losses_are_the_codes():
    """balancing == "loss": N·Σᵢ fᵢ·Pᵢ, fᵢ the share choosing i (bincount), Pᵢ the mean of α·softmax(r)ᵢ;
    z-loss mean(logsumexp(r)²); weights coeff 0.1 and z_coeff 1e-5 (the released token config)."""
    m = tc_model(1)
    router = m.routers[0]
    idx = torch.randint(0, 256, (4, T))
    out = m(idx, idx)
    with torch.no_grad():
        logits = first_routed_input(m, idx) @ router.depth_router.weight.T
    probs = torch.softmax(logits, -1)
    f = 3 * torch.bincount(logits.argmax(-1).flatten(), minlength=3) / logits[..., 0].numel()
    # (summed over the routed layers: equal to the first step's alone, as only it chooses)
    torch.testing.assert_close(out.aux_losses["balance"], (probs.mean((0, 1)) * f).sum())
    torch.testing.assert_close(out.aux_losses["router_z"], torch.logsumexp(logits, -1).square().mean())
    assert router.aux_weights(0) == {"balance": 0.1, "router_z": 1e-5}
    grads = torch.autograd.grad(out.aux_losses["balance"], router.depth_router.weight)
    assert grads[0].abs().sum() > 0


@pytest.mark.parametrize("min_depth", [0, 1])
def test_mor_token_choice_decides_causally_as_it_trains(min_depth):
    """The depth comes from the token's own state at the first step: the causal pass processes exactly
    the top-k forward's tokens and gives its logits (no train/decode gap), and decoding is that pass."""
    m = tc_model(min_depth).eval()
    idx = torch.randint(0, 256, (3, T))
    m.set_collect_stats(True)
    with torch.no_grad():
        top, causal = m(idx), m(idx, routing_mode="causal")
    assert [s["overflow"].item() for s in top.stats] == [0.0] * 3
    assert all(torch.equal(a["layer_processed"], b["decide"]) for a, b in zip(top.stats, causal.stats))
    torch.testing.assert_close(top.logits, causal.logits, atol=1e-6, rtol=1e-6)
    m.set_collect_stats(False)
    for batch in (1, 3):
        prompt = torch.randint(0, 256, (batch, 5), generator=torch.Generator().manual_seed(batch))
        out = generate(m, prompt, 12, temperature=0, return_logits=True)
        torch.testing.assert_close(out.logits, m(out.tokens[:, :-1], routing_mode="causal").logits, atol=1e-5, rtol=1e-5)
        assert out.processed_shares[0] == (1.0 if min_depth else out.processed_shares[0]) and out.skipped_fraction > 0


def test_mor_token_choice_overflow_drops_tokens_but_keeps_the_nesting():
    """Fewer slots than eligible tokens (slack 1, capacity 1/4): the top-k forward drops some (the
    ``overflow`` statistic), each step still nests in the previous one, and it processes a subset of
    what the causal rule (no slots) processes — the only train/decode difference."""
    m = tc_model(0, capacities="", capacity=0.25, slack=1.0)
    idx = torch.randint(0, 256, (3, T))
    m.set_collect_stats(True)
    with torch.no_grad():
        top, causal = m(idx).stats, m(idx, routing_mode="causal").stats
    assert sum(s["overflow"].item() for s in top) > 0
    assert all(int(s["layer_processed"].sum(-1).max()) <= 8 for s in top)  # k_max = ⌈1 · ⌊T/4⌋⌉
    for a, b in zip(top, top[1:]):
        assert not (b["layer_processed"] & ~a["layer_processed"]).any()
    for a, b in zip(top, causal):
        assert not (a["layer_processed"] & ~b["decide"]).any()
    assert any(not torch.equal(a["layer_processed"], b["decide"]) for a, b in zip(top, causal))


def test_mor_token_choice_trains_with_sane_per_step_shares(tmp_cwd):
    """A short run through the trainer (the released recipe: min_depth 1, capacities 1, 2/3, 1/3): the
    first step takes every token, the later ones a nested, non-trivial share, and the evaluation finds no
    gap between the top-k and the causal (decode-time) model."""
    from modbench.run.train import train

    routing = RoutingConfig("mor_token_choice", capacity=1 / 3, capacities="1,2/3,1/3", pattern="fixed:1,1",
                            options={"min_depth": 1})
    t = TrainConfig(dataset="arithmetic", seq_len=T, batch_size=8, budget="steps=30", eval_every=1000, log_every=5,
                    eval_windows=8, track=False, out_dir="runs", lr=3e-3)
    result = train(RunConfig(cfg("middle_cycle", 3, 5), routing, t), progress=False)
    shares = [[h[f"route/L{i}/fraction"] for i in (1, 2, 3)] for h in result.history if "route/L1/fraction" in h]
    assert len(shares) == 6
    for first, second, third in shares:
        assert first == 1.0 and 1.0 >= second >= third >= 0.0
    first, second, third = shares[-1]
    assert 0.0 < third <= second < 1.0
    assert result.val["causal_gap"] == pytest.approx(0.0, abs=1e-6) and result.val["bpb"] < 8.0
    assert 0.0 < result.val["causal_fraction"] < 1.0


@pytest.mark.parametrize("options, expected", [({"router_func": "tanh"}, "router_func must be one of 'softmax', 'sigmoid'"),
                                               ({"min_depth": 2}, "min_depth must be 0 or 1"),
                                               ({"slack": 0.5}, "slack must be in [1, 64]"),
                                               ({"balance_weight": -1.0}, "balance_weight must be >= 0")])
def test_mor_token_choice_bad_options_are_one_line_errors(options, expected):
    with pytest.raises(ModbenchError) as e:
        variants.get_variant("mor_token_choice").make_config(options)
    assert expected in str(e.value) and "\n" not in str(e.value)


def test_mor_token_choice_min_depth_one_needs_two_routed_layers():
    with pytest.raises(ModbenchError) as e:
        GPT(cfg("middle_cycle", 3, 5), RoutingConfig("mor_token_choice", 0.5, pattern="fixed:2,2", options={"min_depth": 1}))
    assert "needs at least 2 routed layers, got 1" in str(e.value) and "\n" not in str(e.value)


# --- KV bytes from the valid cache slots --------------------------------------------------------
@pytest.mark.parametrize("name", ["dense", "mor", "sigmoid", "mor_token_choice"])
def test_kv_bytes_count_the_valid_slots_not_the_allocation(name):
    """Dense: every layer caches every token, 2·d values each. Routed: each routed application caches
    only the tokens it processed (what the causal pass decides), so fewer bytes than dense."""
    m = routed_model(name, "middle_cycle", 3, 5)
    idx = torch.randint(0, 256, (2, 20))
    dec = Decoder(m, 2, 24)
    with torch.no_grad():
        dec(idx[:, :7])
        for t in range(7, 20):
            dec(idx[:, t : t + 1])
    per_slot = 2 * m.cfg.width * 4  # K and V, float32
    if name == "dense":
        assert dec.kv_bytes == 5 * 2 * 20 * per_slot
        return
    m.set_collect_stats(True)
    with torch.no_grad():
        decides = [s["decide"] for s in m(idx, routing_mode="causal").stats]
    routed = sum(isinstance(layer, RoutedBlock) for layer in m.layers)
    expected = ((5 - routed) * 2 * 20 + sum(int(d.sum()) for d in decides)) * per_slot
    assert dec.kv_bytes == expected < 5 * 2 * 20 * per_slot
    assert dec.kv_bytes_per_token == pytest.approx(expected / 40)
