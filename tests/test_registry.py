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
    seeds: the README and docs/, the code's docstrings, the study files and every variant's source cite the
    public work (Raposo et al. 2024 with its section, the "Mixture of Depth is Vibe" blog, nanochat)."""
    import re
    from pathlib import Path

    internal = re.compile(r"\bseeds?[ /_-]*0\d\d\b|shared/seeds", re.IGNORECASE)
    root = Path(__file__).resolve().parents[1]
    files = [root / "README.md", *root.glob("docs/*.md"), *root.glob("harness/**/*.py"), *root.glob("variants/**/*.py"),
             *root.glob("studies/*.toml")]
    hits = [f"{f.relative_to(root)}: {m.group(0)}" for f in files for m in internal.finditer(f.read_text())]
    hits += [f"variant {name}: {variants.get_variant(name).source}" for name in variants.list_variants()
             if internal.search(variants.get_variant(name).source)]
    assert not hits, hits
    assert "arXiv:2404.02258" in (root / "README.md").read_text()


@pytest.mark.parametrize("name", variants.list_variants() + variants.decode_aliases())
def test_every_router_parameter_is_undecayed_and_initialised_by_its_router(name):
    """The optimizer's router group (no weight decay) and ``GPT._init_weights`` pick router parameters
    by identity. mode_integrated's gate is registered under ``block.mlp.gate`` first, which a test on
    the name (".router.") missed: it got weight decay and was re-initialised by the model."""
    import torch

    from modbench.config.model import ModelConfig, RoutingConfig
    from modbench.config.run import RunConfig, TrainConfig
    from modbench.model.gpt import GPT
    from modbench.run.train import build_optimizer

    cfg = RunConfig(ModelConfig(depth=2, n_embd=32, head_dim=8, max_seq_len=32), RoutingConfig(name, 0.5, pattern="all"),
                    TrainConfig(seq_len=32))
    torch.manual_seed(0)
    model = GPT(cfg.model, cfg.routing)
    group_of = {id(p): g for g in build_optimizer(model, cfg).param_groups for p in g["params"]}
    assert len(group_of) == len(list(model.parameters()))  # every parameter in exactly one group
    owned = [p for r in model.routers for p in r.parameters()]
    assert {id(p) for p in owned} == {id(p) for p in model.router_parameters()}
    for p in owned:
        assert group_of[id(p)]["name"] == "router" and group_of[id(p)]["weight_decay"] == 0.0
    others = [g for g in group_of.values() if g["name"] == "router"]
    assert len(others) == len({id(p) for p in owned})  # and nothing else is in the router group
    # the model's GPT-2 init leaves every router parameter as its router set it
    with torch.no_grad():
        for p in owned:
            p.fill_(0.123)
    model._init_weights()
    assert all(bool((p == 0.123).all()) for p in owned)


def _variant_table_rows() -> dict[str, list[str]]:
    """{variant: cells} of every row of the variant tables in docs/variants.md."""
    import re
    from pathlib import Path

    rows: dict[str, list[str]] = {}
    doc = (Path(__file__).resolve().parents[1] / "docs" / "variants.md").read_text()
    for line in doc.splitlines():
        if m := re.match(r"^\| `(\w+)` \|(.*)\|\s*$", line):
            assert m[1] not in rows, f"variant {m[1]} has two rows in docs/variants.md"
            rows[m[1]] = [c.strip() for c in m[2].split(" | ")]
    return rows


def test_docs_variant_tables_show_the_registrys_provenance():
    """Both variant tables of docs/variants.md carry a provenance column equal to each variant's registry
    fields, every built-in variant has a row, and every routed one states its provenance."""
    from modbench.variants.base import CHECKS, ORIGINS

    rows = _variant_table_rows()
    assert set(rows) == set(variants.list_variants())
    for name in variants.list_variants():
        spec = variants.get_variant(name)
        if name != "dense":
            assert spec.provenance is not None, f"{name} states no provenance"
            p = spec.provenance
            assert {p.selection, p.weighting, p.decode} <= set(ORIGINS)
            assert all(check in CHECKS for _, check in p.citations)
            assert p.citations or name.startswith("random"), f"{name} cites nothing"
        expected = spec.provenance.cell() if spec.provenance else "—"
        assert rows[name][-1] == expected, f"docs/variants.md provenance of {name}: {rows[name][-1]!r} != {expected!r}"


def test_provenance_refuses_values_outside_its_vocabulary():
    from modbench.variants import Provenance

    with pytest.raises(ValueError, match="selection"):
        Provenance("the paper", "paper", "paper")
    with pytest.raises(ValueError, match="check"):
        Provenance("paper", "paper", "paper", (("X 2024", "read it"),))
    assert Provenance("paper", "paper's recipe", "modbench's own", (("X 2024", "secondary"),)).cell() == (
        "selection: paper; weighting: paper's recipe; decode: modbench's own; cited: X 2024 (secondary)")


def test_cli_variants_lists_the_provenance(capsys):
    import json

    from modbench.cli.main import main

    assert main(["variants", "pmod", "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    p = variants.get_variant("pmod").provenance
    assert row["provenance"]["text"] == p.cell()
    assert (row["provenance"]["selection"], row["provenance"]["weighting"], row["provenance"]["decode"]) == (
        p.selection, p.weighting, p.decode)
    assert [(c["citation"], c["checked"]) for c in row["provenance"]["citations"]] == list(p.citations)
    assert ("MCG-NJU/p-MoD pmod_llava_llama.py (ModLayer)", "released code") in p.citations
