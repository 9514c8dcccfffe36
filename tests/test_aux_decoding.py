"""The "<name>+aux" decode rule: Raposo et al. 2024 (arXiv:2404.02258) §3.5's auxiliary predictor on
any fixed-count routed variant. The registry sweeps (test_causal, test_routed_block, test_flops,
test_registry) also run every alias; this file checks what the alias itself promises."""

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from modbench import variants
from modbench.cli.main import main
from modbench.config.model import ModelConfig, RoutingConfig
from modbench.errors import ModbenchError
from modbench.model.gpt import GPT
from modbench.variants.linear_router import AuxPredictor

CFG = ModelConfig(depth=3, n_embd=32, head_dim=8, max_seq_len=32)
T = 32


def gpt(name: str, seed: int = 0, **options) -> GPT:
    torch.manual_seed(seed)
    return GPT(CFG, RoutingConfig(name, capacity=0.25, pattern="MDM", options=options))


def test_every_fixed_count_routed_variant_has_an_alias_and_no_other():
    aliases = variants.decode_aliases()
    assert {"amod+aux", "sigmoid+aux", "norm+aux", "nested+aux", "mor+aux", "mlp_skip+aux"} <= set(aliases)
    for refused in ("dense+aux", "token_choice+aux", "threshold+aux", "expert_threshold+aux", "linear_softmax+aux"):
        assert refused not in aliases
    assert not set(aliases) & set(variants.list_variants())  # list_variants stays the registered names
    assert variants.decode_aliases("amod*") == ["amod+aux"]
    spec = variants.get_variant("amod+aux")
    assert spec is variants.get_variant("amod+aux") and spec.name == "amod+aux"
    assert variants.get_variant("mlp_skip+aux").scope == "mlp"
    assert spec.provenance.decode == "paper's recipe"
    assert ("Raposo et al. 2024 (arXiv:2404.02258) §3.5", "secondary") in spec.provenance.citations


@pytest.mark.parametrize("name,message", [
    ("dense+aux", "variant 'dense+aux' is refused: 'dense' routes nothing"),
    ("token_choice+aux", "'token_choice' routes a variable count"),
    ("linear_softmax+aux", "'linear_softmax' already decodes with that auxiliary predictor"),
    ("amodd+aux", "unknown variant 'amodd+aux': 'amodd' is not a registered variant"),
])
def test_refused_aliases_are_one_line_errors_naming_the_accepted_ones(name, message):
    with pytest.raises(ModbenchError) as e:
        variants.get_variant(name)
    text = str(e.value)
    assert message in text and "\n" not in text
    assert "'+aux' variants are 'amod+aux'" in text and "'sigmoid+aux'" in text


def test_the_aliases_options_are_the_base_config_plus_the_predictors_validated():
    spec = variants.get_variant("sigmoid+aux")
    cfg = spec.make_config({"aux_weight": 0.1, "aux_decode_hidden": 5, "aux_decode_weight": 2.0})
    assert isinstance(cfg, variants.get_variant("sigmoid").config_cls)
    assert (cfg.aux_weight, cfg.aux_decode_hidden, cfg.aux_decode_weight) == (0.1, 5, 2.0)
    with pytest.raises(Exception):
        cfg.aux_decode_hidden = 3  # frozen
    for bad, match in [({"aux_decode_hidden": -1}, "aux_decode_hidden must be >= 0"),
                       ({"aux_decode_weight": -0.5}, "aux_decode_weight must be >= 0"),
                       ({"aux_decode_weight": "x"}, "wrong type"), ({"nope": 1}, "has no option 'nope'"),
                       ({"aux_weight": -1}, "aux_weight must be >= 0")]:  # the base's own checks still run
        with pytest.raises(ModbenchError, match=match):
            spec.make_config(bad)
    with pytest.raises(ModbenchError, match="sampling='aux_router' is refused with '\\+aux'"):
        variants.get_variant("mor+aux").make_config({"sampling": "aux_router"})
    router = spec.build(32, {"aux_decode_hidden": 0})
    assert isinstance(router.aux_decoder, AuxPredictor) and router.aux_decoder.hidden == 16  # 0: d_model // 2


@pytest.mark.parametrize("base", ["amod", "sigmoid", "nested", "mlp_skip"])
def test_topk_training_forward_and_base_parameters_are_the_base_variants(base):
    """Same seed: every parameter of the base model is bit-identical, and so are the top-k logits, the
    LM loss and the base's own aux losses; the alias only adds its BCE."""
    a, b = gpt(base), gpt(f"{base}+aux")
    sa, sb = a.state_dict(), b.state_dict()
    assert set(sb) - set(sa) and all(".aux_decoder." in k or ".aux_threshold." in k for k in set(sb) - set(sa))
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    idx = torch.randint(0, 256, (3, T))
    torch.manual_seed(1)
    oa = a(idx, idx)
    torch.manual_seed(1)
    ob = b(idx, idx)
    assert torch.equal(oa.logits, ob.logits) and torch.equal(oa.loss, ob.loss)
    assert set(ob.aux_losses) == set(oa.aux_losses) | {"aux_decode_bce"}
    assert all(torch.equal(oa.aux_losses[k], ob.aux_losses[k]) for k in oa.aux_losses)
    weights = b.routers[0].loss_weights(0)
    assert weights["aux_decode_bce"] == 1.0 and {k: weights[k] for k in a.routers[0].aux_weights(0)} == a.routers[0].aux_weights(0)


def test_the_predictors_bce_trains_only_the_predictor():
    m = gpt("amod+aux", aux_decode_weight=3.0)
    idx = torch.randint(0, 256, (3, T))
    out = m(idx, idx)
    total = m.weighted_aux_loss(out.aux_losses, 0)
    assert torch.equal(total, 3.0 * out.aux_losses["aux_decode_bce"])  # weighted through the one path
    total.backward()
    decoder = {id(p) for r in m.routers for p in r.aux_decoder.parameters()}
    for name, p in m.named_parameters():
        if id(p) in decoder:
            assert p.grad is not None and p.grad.abs().sum() > 0, name
        else:
            assert p.grad is None or not p.grad.any(), name


@pytest.mark.parametrize("base", ["amod", "sigmoid", "nested"])
def test_decide_causal_is_the_predictors_logit_at_its_calibrated_threshold_and_nesting_is_kept(base):
    m = gpt(f"{base}+aux").eval()
    for r in m.routers:
        torch.nn.init.normal_(r.aux_decoder.net[0].weight, std=0.5)
        torch.nn.init.zeros_(r.aux_decoder.net[2].bias)
        r.aux_threshold.value.fill_(0.05)
    x = torch.randn(2, T, CFG.width)
    r = m.routers[0]
    own = r.aux_decoder(x) >= 0.05
    assert 0 < own.float().mean() < 1
    assert torch.equal(r.decide_causal(x), own)
    previous = torch.rand(2, T) < 0.5
    expected = own & previous if base == "nested" else own  # nested ANDs with what the previous layer processed
    assert torch.equal(r.decide_causal_given(x, previous), expected)
    # the base variant's own rule is untouched on its own routers
    plain = gpt(base).routers[0]
    assert type(plain).decide_causal is type(r).decide_causal and "decide_causal" not in vars(plain)
    # and in the model's causal pass, the routed layer decides by the predictor
    m.set_collect_stats(True)
    with torch.no_grad():
        stats = m(torch.randint(0, 256, (2, T)), routing_mode="causal").stats
    assert all(s["decide"].dtype == torch.bool for s in stats)


@pytest.mark.parametrize("base", ["amod", "sigmoid"])
def test_the_predictors_flops_are_counted_and_match_the_flop_counter(base):
    d = CFG.width
    plain, aux = gpt(base), gpt(f"{base}+aux")
    predictor = aux.routers[0].aux_decoder
    fwd, bwd = predictor.flops(d)
    assert fwd == 2 * d * predictor.hidden + 2 * predictor.hidden
    n_routed = len(aux.routers)
    assert aux.flop_report(T).forward - plain.flop_report(T).forward == pytest.approx(n_routed * T * fwd)
    assert aux.flop_report(T).total - plain.flop_report(T).total == pytest.approx(n_routed * T * (fwd + bwd))
    idx = torch.randint(0, 256, (2, T))
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as fc:
        out = aux(idx, idx)
        (out.loss + aux.weighted_aux_loss(out.aux_losses, 10**6)).backward()
    assert aux.flop_report(T, causal=False).total == pytest.approx(fc.get_total_flops() / 2, rel=0.01)


def test_a_study_space_accepts_an_alias_beside_its_base(tmp_path):
    from modbench.design.study_file import load_study

    study = tmp_path / "aux.toml"
    study.write_text("""
[study]
name = "aux"
seeds = [0]
[model]
depth = 2
n_embd = 32
head_dim = 16
max_seq_len = 64
[train]
dataset = "arithmetic"
seq_len = 32
budget = "steps=2"
[options."amod+aux"]
aux_decode_hidden = 8
[space]
variant = ["amod", "amod+aux"]
capacity = [0.25]
pattern = ["alternate"]
""")
    s = load_study(study)
    assert s.space["variant"] == ["amod", "amod+aux"]
    assert s.options["amod+aux"]["aux_decode_hidden"] == 8
    study.write_text(study.read_text().replace('"amod+aux"]', '"dense+aux"]'))
    with pytest.raises(ModbenchError, match="dense\\+aux"):
        load_study(study)


def test_cli_variants_states_the_alias_rule_and_describes_an_alias(capsys):
    assert main(["variants", "amod"]) == 0
    out = capsys.readouterr().out
    assert "+ '+aux'" in out and "arXiv:2404.02258" in out
    assert main(["variants", "amod+aux", "--json"]) == 0
    import json

    (row,) = json.loads(capsys.readouterr().out)
    assert row["name"] == "amod+aux" and row["config"]["aux_decode_hidden"] == 0


@pytest.mark.parametrize("base", ["amod", "sigmoid"])
def test_the_threshold_is_the_running_kth_largest_predictor_logit_so_the_share_is_about_c(base):
    """Training forwards move the threshold to the per-sequence k-th largest predictor logit (the
    paper's 0.5 probability would process no token while the predictor is unsure, C of the targets
    being positive), and the causal rule then processes about C of the tokens."""
    m = gpt(f"{base}+aux").train()
    g = torch.Generator().manual_seed(3)
    idx = torch.randint(0, 256, (8, T), generator=g)
    with torch.no_grad():
        for _ in range(200):  # at the EMA's floor rate the running mean has forgotten its start
            m(idx)
    m.set_collect_stats(True)
    with torch.no_grad():
        stats = m.eval()(idx, routing_mode="causal").stats
    shares = [s["decide"].float().mean().item() for s in stats]
    assert all(abs(sh - 0.25) < 0.25 / 2 for sh in shares), shares  # C = 0.25 (``gpt``)


@pytest.mark.parametrize("alias", variants.decode_aliases())
def test_decode_flops_at_the_realised_share_count_the_predictor(alias):
    """The report's decode FLOPs/token build the model on the meta device (``decode_flops_per_token``):
    an alias must build there too, and costs its base variant's forward plus the predictor's forward
    at every routed layer."""
    from modbench.model.sizing import decode_flops_per_token

    base = alias[: -len(variants.AUX_SUFFIX)]
    model = ModelConfig(depth=3, n_embd=32, head_dim=8, max_seq_len=32)
    routed = GPT(model, RoutingConfig(base, capacity=0.25, pattern="MDM")).routers
    hidden = max(1, model.width // 2)
    predictor = 2.0 * model.width * hidden + 2.0 * hidden
    with_aux = decode_flops_per_token(model, RoutingConfig(alias, capacity=0.25, pattern="MDM"), T, 0.2)
    plain = decode_flops_per_token(model, RoutingConfig(base, capacity=0.25, pattern="MDM"), T, 0.2)
    assert with_aux == pytest.approx(plain + len(routed) * predictor, rel=1e-12)
