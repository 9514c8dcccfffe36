import sys
import textwrap

import pytest

from modbench import variants
from modbench.errors import ModbenchError
from modbench.variants import registry

BUILT_IN = {"dense", "learned_temperature", "linear_softmax", "mlp_skip", "norm", "random", "sigmoid"}


def test_the_seven_variants_are_registered():
    assert BUILT_IN <= set(variants.list_variants())


def test_wildcards_filter_names():
    assert variants.list_variants("l*") == ["learned_temperature", "linear_softmax"]
    assert variants.list_variants("random*") == ["random", "random_gated", "random_mlp"]
    assert variants.list_variants("nothing*") == []


def test_unknown_variant_lists_names_and_suggests_closest():
    with pytest.raises(ModbenchError) as e:
        variants.get_variant("sigmod")
    msg = str(e.value)
    assert "did you mean 'sigmoid'" in msg
    for name in BUILT_IN:
        assert repr(name) in msg
    assert "\n" not in msg


def test_unknown_option_names_the_accepted_fields():
    with pytest.raises(ModbenchError, match="aux_weight"):
        variants.get_variant("sigmoid").make_config({"aux_wieght": 0.1})


def test_invalid_option_value_is_a_user_error():
    with pytest.raises(ModbenchError, match="temperature"):
        variants.get_variant("learned_temperature").make_config({"temperature_init": 9.0})


def test_every_variant_has_a_source_summary_and_a_frozen_config():
    for name in variants.list_variants():
        spec = variants.get_variant(name)
        assert spec.source and spec.summary
        cfg = spec.make_config()
        with pytest.raises(Exception):
            cfg.some_field = 1  # frozen dataclass
        assert isinstance(cfg.to_dict(), dict)


def test_third_party_variant_loads_through_entry_points(tmp_path, monkeypatch):
    pkg = tmp_path / "my_mod_variant.py"
    pkg.write_text(textwrap.dedent('''
        from dataclasses import dataclass
        import torch
        from modbench.variants import Router, VariantConfig, register_variant

        @dataclass(frozen=True)
        class FirstTokensConfig(VariantConfig):
            pass

        class FirstTokens(Router):
            scope = "block"
            def score(self, x):
                T = x.shape[1]
                return -torch.arange(T, dtype=x.dtype).expand(x.shape[:-1])
            def decide_causal(self, x):
                return torch.ones(x.shape[:-1], dtype=torch.bool)

        @register_variant("mod_first_tokens", config=FirstTokensConfig, source="test plugin")
        def build(d_model, config):
            """Processes the first k tokens."""
            return FirstTokens(config)
    '''))
    dist = tmp_path / "my_mod_variant-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: my-mod-variant\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[modbench.variants]\nfirst_tokens = my_mod_variant\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(registry, "_plugins_loaded", False)
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    assert variants.list_variants("mod_*") == ["mod_first_tokens"]
    import torch
    from modbench.config.model import ModelConfig, RoutingConfig
    from modbench.model.gpt import GPT

    m = GPT(ModelConfig(depth=2, n_embd=32, head_dim=16, max_seq_len=16), RoutingConfig("mod_first_tokens", 0.5, pattern="all"))
    r = m.routers[0].route(torch.randn(2, 8, 32), 4)
    assert r.index.tolist() == [[0, 1, 2, 3]] * 2
    sys.modules.pop("my_mod_variant", None)


def test_product_text_cites_public_sources_never_the_internal_seed_documents():
    """Users cannot look up "seed 000"-style design documents, and "seed" clashes with random
    seeds: the README, the code's docstrings, the study files and every variant's source cite the
    public work (Raposo et al. 2024 with its section, the "Mixture of Depth is Vibe" blog, nanochat)."""
    import re
    from pathlib import Path

    internal = re.compile(r"\bseeds?[ /_-]*0\d\d\b|shared/seeds", re.IGNORECASE)
    root = Path(__file__).resolve().parents[1]
    files = [root / "README.md", *root.glob("harness/**/*.py"), *root.glob("variants/**/*.py"), *root.glob("studies/*.toml")]
    hits = [f"{f.relative_to(root)}: {m.group(0)}" for f in files for m in internal.finditer(f.read_text())]
    hits += [f"variant {name}: {variants.get_variant(name).source}" for name in variants.list_variants()
             if internal.search(variants.get_variant(name).source)]
    assert not hits, hits
    assert "arXiv:2404.02258" in (root / "README.md").read_text()
