"""The routed block's mixing policy (``variants.base.Mixing``): declared by every router, applied by
``RoutedBlock.mix`` on the one top-k path and the causal path, refused when it cannot be applied."""

from dataclasses import dataclass, replace

import pytest
import torch
from torch import Tensor

from modbench import variants
from modbench.config.capacity import CapacitySchedule
from modbench.config.model import ModelConfig
from modbench.model.gpt import GPT, Block, RoutedBlock
from modbench.variants import Mixing, Router, Routing, VariantConfig

ALL = variants.list_variants() + variants.decode_aliases()  # and every "+aux" decode rule
# Options that change a variant's policy: each must still declare what its routing does.
POLICY_OPTIONS = [("sigmoid", {"gate": False}), ("mode_staged", {"gate": False}), ("pmod", {"string": False}),
                  ("pmod", {"weight_scope": "block"}), ("pmod", {"string": False, "weight_scope": "block"}),
                  ("mor", {"update": "delta"})]
CFG = ModelConfig(depth=2, n_embd=32, head_dim=8, max_seq_len=64)


# --- every registered variant declares a valid policy, and its routing carries what the policy reads --------
@pytest.mark.parametrize("name,options", [(n, {}) for n in ALL] + POLICY_OPTIONS)
def test_every_registered_variant_declares_a_valid_policy(name, options):
    spec = variants.get_variant(name)
    router = spec.builder(CFG.width, spec.make_config(options))
    mixing = router.mixing
    assert isinstance(mixing, Mixing)
    assert mixing.check(router.scope, router.variable_count) is mixing  # raises on a combination the block refuses
    if router.scope == "none":
        return  # dense: the model never routes
    torch.manual_seed(0)
    block = RoutedBlock(CFG, router, CapacitySchedule(0.25, max_seq_len=CFG.max_seq_len)).train()
    assert block.mixing is mixing
    for p in router.parameters():
        torch.nn.init.normal_(p, std=0.5) if p.dim() > 0 else None
    x = torch.randn(2, 48, CFG.width)
    with torch.no_grad():
        r = router.route(x, block.capacity.k(48))
    # The routing gives exactly what the policy declares it reads.
    assert (r.weight is None) == (mixing.weight == "none"), "a weight exactly when the policy weights"
    assert (r.skip_scale is not None) == (mixing.skip != "keep")  # s of s·x ("scale") or of x + s·local(x) ("local")
    assert (r.base is not None) == mixing.handoff and (r.handoff is not None) == mixing.handoff
    # a variable count's used slots; a soft gate (tsa) routes every token in training, so none are unused
    assert (r.valid is not None) == (router.variable_count and not router.soft_gate)
    with torch.no_grad():
        skipped = block.skipped(x)
    assert (skipped is x) == (mixing.skip == "keep")


def test_the_flags_the_policy_replaced_are_gone():
    for flag in ("weights_block_output", "weight_scope"):
        assert not hasattr(Router, flag)


# --- the one forward path gives each policy's documented formula on a hand-checkable block ----------------
class HandBlock(Block):
    """The real ``Block.delta`` (attn + mlp, or attn + w·mlp) over a hand-checkable attention and MLP:
    attn(x) = x and mlp(h) = 2h, so Δ = x + 2·(x + x) = 5x, and attn + w·mlp = x + w·4x."""

    def attention(self, x: Tensor, cos: Tensor, sin: Tensor, **attention: object) -> Tensor:
        return x

    def mlp_delta(self, x: Tensor) -> Tensor:
        return 2 * x


@dataclass
class Handoff:
    weight: Tensor  # (B, T)
    base: Tensor  # (B, T, d)


W, S, BASE = 0.5, 0.25, 8.0  # the router's weight, skip scale and handed-over base


class HandRouter(Router):
    """score = x[..., 0] (top-k and the causal rule x[..., 0] > 0 pick the same tokens); w = 0.5; s = 0.25;
    a handoff's base 8."""

    def __init__(self, mixing: Mixing, valid: Tensor | None = None) -> None:
        super().__init__(VariantConfig())
        self.mixing = mixing
        self.valid = valid  # a variable count's used slots, when given

    def score(self, x: Tensor) -> Tensor:
        return x[..., 0]

    def mix_weight(self, selected_scores: Tensor, scores: Tensor) -> Tensor | None:
        return None if self.mixing.weight == "none" else torch.full_like(selected_scores, W)

    def causal_weight(self, x: Tensor, decide: Tensor | None) -> Tensor:
        return torch.full(x.shape[:2], W)

    def skip_scale_of(self, scores: Tensor) -> Tensor:
        return torch.full_like(scores, S)

    def decide_causal(self, x: Tensor) -> Tensor:
        return x[..., 0] > 0

    def assign_causal(self, x: Tensor, previous: object) -> tuple[Tensor, Handoff]:
        return self.decide_causal(x), Handoff(torch.full(x.shape[:2], W), torch.full_like(x, BASE))

    def route(self, x: Tensor, k: int, previous: object = None) -> Routing:
        r = super().route(x, k, previous)
        if self.mixing.handoff:
            r = Routing(r.index, r.weight, {}, {}, base=torch.full((*r.index.shape, x.shape[-1]), BASE),
                        handoff=self.assign_causal(x, previous)[1])
        if self.valid is not None:
            r = Routing(r.index, r.weight, {}, {}, valid=self.valid, base=r.base, handoff=r.handoff)
        return r


T, D = 4, 8
# x[..., 0] = 1, −1, 2, −2: top-2 and the causal rule both process positions 0 and 2. No zeros anywhere,
# small integers: every formula below is exact in float32.
X = torch.tensor([[1.0, -1.0, 2.0, -2.0]]).unsqueeze(-1) * torch.arange(1, D + 1, dtype=torch.float32)
PROCESSED = torch.tensor([[True, False, True, False]])

# (policy, a processed token's value, a skipped token's value), by the policy's own formula
CASES = {
    "plain": (Mixing(weight="none"), X + 5 * X, X),  # x + Δ
    "weighted": (Mixing(), X + W * 5 * X, X),  # x + w·Δ
    "mlp": (Mixing(weight="mlp"), X + X + W * 4 * X, X),  # x + attn + w·mlp
    "sublayers": (Mixing(weight="sublayers"), X + W * X + W * 2 * (X + W * X), X),  # x + w·attn + w·mlp(x + w·attn)
    "output": (Mixing(output=True), X + W * (X + 5 * X), X),  # x + w·(x + Δ)
    "handoff": (Mixing(output=True, handoff=True), BASE + W * (X + 5 * X), X),  # b + w·(x + Δ)
    "skip_scale": (Mixing(skip="scale"), X + W * 5 * X, S * X),  # skipped: s·x
}


def hand_block(mixing: Mixing, valid: Tensor | None = None) -> tuple[RoutedBlock, Tensor, Tensor]:
    cfg = ModelConfig(depth=1, n_embd=D, head_dim=D, max_seq_len=16)
    block = RoutedBlock(cfg, HandRouter(mixing, valid), CapacitySchedule(0.5, max_seq_len=16), HandBlock(cfg))
    m = GPT(cfg)
    return block, m.rope_cos, m.rope_sin


@pytest.mark.parametrize("kind", CASES)
@pytest.mark.parametrize("mode", ["topk", "causal"])
def test_the_one_path_gives_each_policys_formula(kind, mode):
    mixing, processed, skipped = CASES[kind]
    block, cos, sin = hand_block(mixing)
    with torch.no_grad():
        layer = block(X, cos, sin) if mode == "topk" else block.forward_causal(X, cos, sin)
    assert torch.equal(layer.processed, PROCESSED)
    expected = torch.where(PROCESSED.unsqueeze(-1), processed, skipped)
    assert torch.equal(layer.x, expected), (mixing.formula, layer.x, expected)
    if mixing.skip == "keep":  # skipped rows bit for bit
        assert torch.equal(layer.x[~PROCESSED], X[~PROCESSED])


def test_the_policys_formula_is_the_documented_one():
    assert {k: m.formula for k, (m, _, _) in CASES.items()} == {
        "plain": ("x + Δ", "x"), "weighted": ("x + w·Δ", "x"), "mlp": ("x + attn + w·mlp", "x"),
        "sublayers": ("x + w·attn + w·mlp(x + w·attn)", "x"),
        "output": ("x + w·(x + Δ)", "x"), "handoff": ("b + w·(x + Δ)", "x"), "skip_scale": ("x + w·Δ", "s·x")}


class LocalBlock(HandBlock):
    """HandBlock with a hand-checkable token-local update: local(x) = 3x."""

    def local_update(self, x: Tensor) -> Tensor:
        return 3 * x


class AttentionScope(HandRouter):
    scope = "attention"


@pytest.mark.parametrize("mode", ["topk", "causal"])
def test_a_scope_attention_router_with_the_local_skip_gives_dtrnets_formula(mode):
    """Scope "attention" (DTRNet): Δ is attention alone, then the MLP on every token; ``Mixing(skip="local")``:
    a skipped token gets x + s·local(x). attn(x) = x, mlp(h) = 2h, local(x) = 3x: processed x + w·x, then
    ·3; skipped x + s·3x, then ·3."""
    mixing = Mixing(skip="local")
    assert mixing.formula == ("x + w·Δ", "x + s·local(x)")
    cfg = ModelConfig(depth=1, n_embd=D, head_dim=D, max_seq_len=16)
    block = RoutedBlock(cfg, AttentionScope(mixing), CapacitySchedule(0.5, max_seq_len=16), LocalBlock(cfg))
    m = GPT(cfg)
    with torch.no_grad():
        layer = block(X, m.rope_cos, m.rope_sin) if mode == "topk" else block.forward_causal(X, m.rope_cos, m.rope_sin)
        skipped = block.skipped(X)
    assert torch.equal(layer.processed, PROCESSED)
    expected = torch.where(PROCESSED.unsqueeze(-1), 3 * (X + W * X), 3 * (X + S * 3 * X))
    assert torch.equal(layer.x, expected), (layer.x, expected)
    assert torch.equal(skipped[~PROCESSED], expected[~PROCESSED])  # what the decoders write for a skipped token
    with pytest.raises(ValueError, match="skip='local' gives a skipped token attention with only itself"):
        RoutedBlock(cfg, HandRouter(mixing), CapacitySchedule(0.5, max_seq_len=16), LocalBlock(cfg))


@pytest.mark.parametrize("kind", ["plain", "weighted", "sublayers", "output", "handoff"])
def test_an_unused_slot_adds_nothing_under_every_policy(kind):
    """A variable count: slot 1 (position 2) is unused, so its row is x bit for bit — not x + w·x under a
    weighted output, not the base under a handoff."""
    mixing, processed, _ = CASES[kind]
    block, cos, sin = hand_block(mixing, valid=torch.tensor([[True, False]]))
    with torch.no_grad():
        out = block(X, cos, sin).x
    assert torch.equal(out[0, 0], processed[0, 0])
    assert torch.equal(out[0, 1:], X[0, 1:])


# --- a combination the block cannot apply is refused, with a clear error -----------------------------------
@pytest.mark.parametrize("fields,message", [
    ({"weight": "attn"}, "mixing weight must be one of 'block', 'mlp', 'none', 'sublayers', got 'attn'"),
    ({"skip": "drop"}, "mixing skip must be one of 'keep', 'scale', 'local', got 'drop'"),
    ({"output": 1}, "mixing output must be True or False"),
    ({"weight": "mlp", "output": True}, "output=True weights the block's output x \\+ Δ: it needs weight='block'"),
    ({"weight": "none", "output": True}, "it needs weight='block', got weight='none'"),
    ({"handoff": True}, "handoff=True makes a processed token base \\+ w·\\(x \\+ Δ\\): it needs output=True"),
    ({"output": True, "handoff": True, "skip": "scale"}, "skip must be 'keep', got 'scale'"),
])
def test_an_unknown_combination_is_refused(fields, message):
    with pytest.raises(ValueError, match=message):
        Mixing(**fields)


def test_a_policy_the_router_cannot_apply_is_refused_when_its_layer_is_built():
    class MlpScope(HandRouter):
        scope = "mlp"

    class Variable(HandRouter):
        variable_count = True

    with pytest.raises(ValueError, match="a scope 'mlp' router routes the MLP alone"):
        RoutedBlock(CFG, MlpScope(Mixing(weight="mlp")), CapacitySchedule(0.5))
    with pytest.raises(ValueError, match="weight='sublayers' weights each sublayer's output inside the block"):
        RoutedBlock(CFG, MlpScope(Mixing(weight="sublayers")), CapacitySchedule(0.5))
    with pytest.raises(ValueError, match="a variable-count router's skip must be 'keep'"):
        RoutedBlock(CFG, Variable(Mixing(skip="scale")), CapacitySchedule(0.5))
    block = RoutedBlock(CFG, MlpScope(Mixing(weight="none")), CapacitySchedule(0.5))
    with pytest.raises(ValueError, match="needs weight='block'"):
        block.set_mixing(replace(block.mixing, output=True))  # switching a block's policy by hand is checked too
