"""The yardstick of issue 38's dense decode bar (``modbench.bench.reference_decoder``) decodes modbench's
dense GPT: the same logits as the model's full forward and the same greedy tokens as modbench's own
decoders, eager and compiled (Dynamo's "eager" backend), reused across generations; a routed model is
refused in one line."""

from __future__ import annotations

import pytest
import torch

from modbench.bench.reference_decoder import ReferenceDecoder
from modbench.config.model import ModelConfig, RoutingConfig
from modbench.errors import ModbenchError
from modbench.model.decode import generate
from modbench.model.gpt import GPT

CFG = ModelConfig(depth=3, n_embd=32, head_dim=8, max_seq_len=32)


def dense_model() -> GPT:
    torch.manual_seed(0)
    return GPT(CFG).eval()


def prompt(batch: int) -> torch.Tensor:
    return torch.randint(0, 256, (batch, 5), generator=torch.Generator().manual_seed(batch))


@pytest.mark.parametrize("runner", ["eager", "compile"])
@pytest.mark.parametrize("batch", [1, 3])
def test_the_reference_decodes_modbenchs_dense_model(runner, batch):
    m = dense_model()
    torch._dynamo.reset()
    ref = ReferenceDecoder(m, batch, 16, runner=runner, compile_backend="eager")
    out = generate(m, prompt(batch), 12, temperature=0, return_logits=True, decoder=ref, mode="dense")
    assert out.step == f"reference-{runner}"
    torch.testing.assert_close(out.logits, m(out.tokens[:, :-1]).logits, atol=1e-5, rtol=1e-5)
    static = generate(m, prompt(batch), 12, temperature=0, step="static", mode="dense")
    assert torch.equal(out.tokens, static.tokens)
    assert out.kv_bytes_per_token == static.kv_bytes_per_token  # every token's K/V at every layer
    again = generate(m, prompt(batch), 12, temperature=0, return_logits=True, decoder=ref, mode="dense")
    assert torch.equal(again.tokens, out.tokens) and torch.equal(again.logits, out.logits)  # reset in place


@pytest.mark.parametrize("runner", ["eager", "compile"])
def test_a_decode_step_copies_no_cache(runner):
    """The yardstick's step writes its token's K/V in place and nothing else: no copy of a cache tensor
    (its ``prepare``, which saves and restores the cache around a compile or capture, runs once)."""
    m = dense_model()
    torch._dynamo.reset()
    ref = ReferenceDecoder(m, 2, 16, runner=runner, compile_backend="eager")
    generate(m, prompt(2), 4, temperature=0, decoder=ref, mode="dense")  # compiles
    cache_shape = list(ref.k[0].shape)
    with torch.profiler.profile(record_shapes=True) as prof:
        generate(m, prompt(2), 8, temperature=0, decoder=ref, mode="dense")
    copies = [e.key for e in prof.events() if e.name in ("aten::clone", "aten::copy_", "aten::_to_copy")
              and cache_shape in [list(s) for s in e.input_shapes]]
    writes = [e for e in prof.events() if e.name == "aten::index_copy_"]
    assert copies == [], f"{len(copies)} cache-sized copies in 8 decode steps"
    assert writes, "the profile saw no cache write: it recorded nothing of the steps"


def test_a_routed_model_or_an_unknown_runner_is_refused_in_one_line():
    routed = GPT(CFG, RoutingConfig("sigmoid", capacity=0.5, pattern="MDM"))
    with pytest.raises(ModbenchError, match="plain dense GPT") as e:
        ReferenceDecoder(routed, 1, 8)
    assert "\n" not in str(e.value)
    with pytest.raises(ModbenchError, match="unknown reference decoder runner 'fast'"):
        ReferenceDecoder(dense_model(), 1, 8, runner="fast")
    with pytest.raises(ModbenchError, match="exceeds the model's max_seq_len"):
        ReferenceDecoder(dense_model(), 1, 64)
