"""The routed model compiles as one graph, matches eager, and never syncs host and device.

- Every routed variant: a small routed GPT (D M, C = 0.25) under
  ``torch.compile(fullgraph=True, backend="aot_eager")`` — Dynamo tracing plus AOT autograd
  (forward and backward graphs), no code generation, so the sweep stays cheap — must give
  the eager logits, loss, aux losses, gradients and buffers (allclose).
- One real Inductor compile (``sigmoid``, a tiny model): the generated kernels must agree
  with eager too.
- No host-device sync in the forward: ``fullgraph=True`` fails on any graph break, and
  ``.item()``, ``.tolist()``, ``nonzero`` or data-dependent shapes all break the graph; the
  captured graph is also checked for such ops by name. On CUDA, forward + backward run under
  ``torch.cuda.set_sync_debug_mode("error")``.
- The mixtures of experts read their slice sizes on the host in full precision by design
  (``Router.training_host_read`` says so in the registry): under ``modbench.model.gpt.compile_settings``
  that read is inside the one graph, which then serves every new split without a recompile; the read is
  checked to be there. In bf16 (as CUDA trains) they run grouped GEMMs, and their graph holds no read.
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch

from modbench import variants
from modbench.config.model import ModelConfig, RoutingConfig
from modbench.model.gpt import GPT, compile_settings

ROUTED = [v for v in variants.list_variants() if variants.build_router(v, 8).scope != "none"]
TINY = ModelConfig(depth=2, n_embd=32, head_dim=16, max_seq_len=64)  # D M with "alternate"
B, T = 2, 32
SYNCING = ("item", "tolist", "nonzero", "_local_scalar_dense", "masked_select", "unique", "cpu", "numpy")


def _model(variant: str, capacity: float = 0.25, cfg: ModelConfig = TINY, pattern: str = "alternate") -> GPT:
    torch.manual_seed(0)
    m = GPT(cfg, RoutingConfig(variant, capacity=capacity, pattern=pattern)).train()
    # Spread the learned scorers so top-k has no near-ties that rounding could flip.
    for r in m.routers:
        for p in r.parameters():
            if p.dim() > 0:
                torch.nn.init.normal_(p, std=0.5)
    assert any(m.routed_flags), "the test model must contain a routed layer"
    return m


def _train_forward_backward(model, idx, targets, seed: int = 5):
    torch.manual_seed(seed)  # `random` draws its scores from the global generator
    out = model(idx, targets)
    loss = out.loss
    aux = _aux_total(model, out)
    if aux is not None:
        loss = loss + aux
    loss.backward()
    return out


def _aux_total(model, out):
    base = getattr(model, "_orig_mod", model)
    return base.weighted_aux_loss(out.aux_losses, 10**6)


def _recording(backend: str, graphs: list):
    inner = torch._dynamo.lookup_backend(backend)

    def record(gm, example_inputs):
        graphs.append(gm)
        return inner(gm, example_inputs)

    return record


def _assert_same(eager_model, eager_out, compiled_model, compiled_out, rtol, atol):
    torch.testing.assert_close(compiled_out.logits, eager_out.logits, rtol=rtol, atol=atol)
    torch.testing.assert_close(compiled_out.loss, eager_out.loss, rtol=rtol, atol=atol)
    assert compiled_out.aux_losses.keys() == eager_out.aux_losses.keys()
    for name in eager_out.aux_losses:
        torch.testing.assert_close(compiled_out.aux_losses[name], eager_out.aux_losses[name], rtol=rtol, atol=atol)
    compiled_params = dict(compiled_model.named_parameters())
    for name, p in eager_model.named_parameters():
        q = compiled_params[name]
        assert (p.grad is None) == (q.grad is None), name
        if p.grad is not None:
            torch.testing.assert_close(q.grad, p.grad, rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")
    compiled_buffers = dict(compiled_model.named_buffers())
    for name, b in eager_model.named_buffers():
        torch.testing.assert_close(compiled_buffers[name], b, rtol=rtol, atol=atol)


def _host_reads(variant: str, bf16: bool = False) -> tuple[str, ...]:
    """The host-reading ops a variant's compiled graph may hold: the ones its registry entry declares (a
    mixture's slice sizes, read in full precision only: in bf16 it runs grouped GEMMs)."""
    return ("tolist", "item", "_local_scalar_dense") if variants.training_host_read(variant) and not bf16 else ()


def _syncing_ops(graphs: list, allowed: tuple[str, ...] = (), extra: tuple[str, ...] = ()) -> tuple[list, list]:
    """(the host-syncing ops in ``graphs`` not in ``allowed``, the allowed ones found)."""
    names = [str(n.target) for gm in graphs for n in gm.graph.nodes if n.op in ("call_function", "call_method")]

    def syncs(name: str, ops) -> bool:
        return any(name == s or name.endswith(f".{s}") or f" {s}" in name or name.endswith(f"{s}.default")
                   for s in ops)

    return ([n for n in names if syncs(n, SYNCING + extra) and not syncs(n, allowed)],
            [n for n in names if syncs(n, allowed)])


def _compile_and_compare(variant: str, backend: str, rtol: float, atol: float, bf16: bool = False, **model_kw):
    """``bf16``: both sides train under CPU bf16 autocast (the CUDA trainer's precision)."""
    torch._dynamo.reset()
    eager = _model(variant, **model_kw)
    compiled_base = copy.deepcopy(eager)
    graphs: list = []
    compiled = torch.compile(compiled_base, fullgraph=True, backend=_recording(backend, graphs))
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, TINY.vocab_size, (B, T), generator=g)
    targets = torch.randint(0, TINY.vocab_size, (B, T), generator=g)
    precision = lambda: torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16)  # noqa: E731

    with precision():
        eager_out = _train_forward_backward(eager, idx, targets)
    with compile_settings(), precision():
        compiled_out = _train_forward_backward(compiled, idx, targets)
    _assert_same(eager, eager_out, compiled_base, compiled_out, rtol, atol)

    # One graph for the whole forward (fullgraph would have raised on a break), and no op in it that
    # would make the host wait for the device but the read its registry entry declares, which must be there.
    assert len(graphs) == 1
    reads = _host_reads(variant, bf16)
    syncing, declared = _syncing_ops(graphs, reads)
    assert syncing == [], f"host-syncing ops in the compiled forward: {syncing}"
    assert bool(declared) == bool(reads), f"declared host read {reads}, found {declared}"
    return graphs


# MoDE's top-1 mixture runs each expert on its own slice of tokens: the slice sizes are one host read per
# layer (modbench.model.gpt.TopOneMoE), declared in the registry (Router.training_host_read).
SYNCS_BY_DESIGN = {v for v in ROUTED if variants.training_host_read(v)}


def test_the_registry_declares_a_host_read_for_exactly_the_variants_whose_model_reads_one():
    """The declaration follows the model: a variant says it reads the host iff its GPT builds a mixture."""
    from modbench.model.gpt import TopOneMoE

    builds_mixture = {v for v in ROUTED if any(isinstance(m, TopOneMoE) for m in _model(v).modules())}
    assert builds_mixture and SYNCS_BY_DESIGN == builds_mixture


@pytest.mark.parametrize("variant", sorted(ROUTED))
def test_routed_gpt_compiles_fullgraph_and_matches_eager(variant):
    _compile_and_compare(variant, "aot_eager", rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("variant", sorted(SYNCS_BY_DESIGN))
def test_a_mixture_in_bf16_compiles_fullgraph_with_no_host_read(variant):
    """As CUDA trains (bf16 autocast), a mixture runs grouped GEMMs (``modbench.model.grouped_mm``): one graph
    with no host-syncing op at all, the slice sizes' read gone, and eager's numbers."""
    _compile_and_compare(variant, "aot_eager", rtol=1e-2, atol=1e-3, bf16=True)


@pytest.mark.parametrize("variant", sorted(SYNCS_BY_DESIGN))
def test_the_trainers_compile_of_a_mixture_is_one_graph_only_under_the_compile_settings(variant):
    """What ``compile_settings`` is for. The trainer compiles without ``fullgraph`` (which would turn the
    capture on by itself): without the settings Dynamo breaks the graph at the host read and recompiles the
    pieces for each new split; under them one graph serves batches that split differently."""
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, TINY.vocab_size, (B, T), generator=g) for _ in range(3)]
    assert len({tuple(_expert_counts(_model(variant), idx)) for idx in batches}) > 1
    for settings, expect_one in ((contextlib.nullcontext, False), (compile_settings, True)):
        torch._dynamo.reset()
        graphs: list = []
        compiled = torch.compile(_model(variant), backend=_recording("eager", graphs))
        with settings():
            for idx in batches:
                _train_forward_backward(compiled, idx, idx)
        assert (len(graphs) == 1) == expect_one, f"{settings.__name__}: {len(graphs)} graphs"


def _expert_counts(model: GPT, idx) -> list[tuple[int, ...]]:
    """Each mixture's tokens per expert in a training forward of ``idx`` (eager, the gate's top-1)."""
    from modbench.model.gpt import TopOneMoE

    counts: list[tuple[int, ...]] = []

    def count(n: int):
        def hook(module, args, out):  # the gate's logits: the first n are the real experts'
            counts.append(tuple(torch.bincount(out[..., :n].argmax(-1).flatten(), minlength=n).tolist()))
        return hook

    hooks = [m.gate.register_forward_hook(count(len(m.experts))) for m in model.modules() if isinstance(m, TopOneMoE)]
    with torch.no_grad():
        model(idx, idx)
    for h in hooks:
        h.remove()
    return counts


@pytest.mark.parametrize("variant", sorted(ROUTED))
def test_a_logging_step_compiles_fullgraph_and_the_next_steps_reuse_the_graphs(variant):
    """The trainer's compiled step as it runs: a logging step collects routing statistics (one graph, no
    break: a data-dependent shape there sent every logging step back to eager and synced), the steps between
    run without them (a second graph), and later steps of either kind compile nothing more (a forward that
    first creates a module attribute recompiled the whole model on its second call), on new batches each
    step: a mixture of experts splits each batch differently, and its graph serves every split."""
    torch._dynamo.reset()
    model = _model(variant)
    graphs: list = []
    compiled = torch.compile(model, fullgraph=True, backend=_recording("eager", graphs))
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, TINY.vocab_size, (B, T), generator=g) for _ in range(4)]
    if variant in SYNCS_BY_DESIGN:  # the batches must split differently for the test to mean anything
        assert len({tuple(_expert_counts(model, idx)) for idx in batches}) > 1
    with compile_settings():
        for collect, idx in zip((True, False, True, False), batches):
            model.set_collect_stats(collect)
            out = _train_forward_backward(compiled, idx, idx)
            assert bool(out.stats) == collect
    model.set_collect_stats(False)
    assert len(graphs) == 2
    syncing, _ = _syncing_ops(graphs, _host_reads(variant), extra=("bincount",))
    assert syncing == [], f"host-syncing ops in the compiled step: {syncing}"


@pytest.mark.slow
def test_inductor_compile_matches_eager_sigmoid():
    """The one real code-generating compile (C++ kernels on CPU), kept cheap for CI.

    A one-layer routed model (the routed layer is what matters; the sweep above covers the
    D M stack), C++ compiled in-process (no worker pool to spawn on a 2-core runner) and
    without SIMD intrinsics: the vectorised headers double the C++ compile time of every
    kernel, and the lowering under test (top-k, sort, gather, index_add, SDPA, their
    backward) is the same. Cold, this is still the slowest test of tests/bench (~20-30 s on
    2 cores; a warm inductor cache makes it a few seconds).
    """
    import torch._inductor.config as inductor_config

    one_layer = ModelConfig(depth=1, n_embd=32, head_dim=16, max_seq_len=64)
    with inductor_config.patch({"compile_threads": 1, "cpp.vec_isa_ok": False}):
        _compile_and_compare("sigmoid", "inductor", rtol=1e-4, atol=1e-5, cfg=one_layer, pattern="all")


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["mode_staged", "random"])
def test_inductor_compile_matches_eager_under_deterministic_algorithms(variant):
    """As a compiled CPU run trains: Inductor, deterministic algorithms and ``compile_settings``.

    - ``mode_staged``: a mixture of experts compiles with unbacked slice sizes, and Inductor (torch 2.13)
      under deterministic algorithms got its scatter back into token order wrong (``index_copy_`` into an
      ``empty_like``: the routed tokens' logits off by up to 0.4, and a compiled run's loss NaN by step 10),
      where eager and either setting alone were right. The mixture now gathers by the inverse permutation.
    - ``random``: with Inductor's own random generator a random control drew other numbers than eager from
      the same seed; ``compile_settings`` makes it draw torch's (``fallback_random``).
    A real code-generating compile each, as the sigmoid test above."""
    import torch._inductor.config as inductor_config

    one_layer = ModelConfig(depth=1, n_embd=32, head_dim=16, max_seq_len=64)
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        with inductor_config.patch({"compile_threads": 1, "cpp.vec_isa_ok": False}):
            _compile_and_compare(variant, "inductor", rtol=1e-4, atol=1e-5, cfg=one_layer, pattern="all")
    finally:
        torch.use_deterministic_algorithms(before)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA not available")
@pytest.mark.parametrize("variant", sorted(set(ROUTED) - SYNCS_BY_DESIGN))
def test_forward_backward_do_not_sync_on_cuda(variant):
    model = _model(variant).cuda()
    idx = torch.randint(0, TINY.vocab_size, (B, T), device="cuda")
    _train_forward_backward(model, idx, idx)  # warm-up: lazy CUDA/cuBLAS initialisation
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        _train_forward_backward(model, idx, idx)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA not available")
@pytest.mark.parametrize("variant", sorted(SYNCS_BY_DESIGN))
def test_mixture_of_experts_variants_sync_once_per_layer_by_design(variant):
    """MoDE's expert slices are sized on the host in full precision (``TopOneMoE``: counts, ``tolist``, then
    ``split``), so its fp32 training forward syncs; said in SYNCS_BY_DESIGN, and checked here so that the
    exemption above cannot hide a variant that stopped syncing (measured on an H200, torch 2.11). In bf16 it
    does not: tests/test_grouped_mm.py."""
    model = _model(variant).cuda()
    idx = torch.randint(0, TINY.vocab_size, (B, T), device="cuda")
    _train_forward_backward(model, idx, idx)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with pytest.raises(RuntimeError, match="synchronizing"):
            _train_forward_backward(model, idx, idx)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
