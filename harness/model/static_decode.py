"""KV-cached decoding with static shapes and no host sync: a step that a CUDA graph can replay.

Why. ``modbench.model.decode.Decoder`` runs a routed layer's block on exactly the sequences that
process the token: it reads on the host which they are (one sync per routed layer and step), and
its cache grows step by step, so every step has new shapes. On a CPU that is the fast way (a host
read costs nothing, skipped work is saved). On a GPU the step is then bound by the host: issue 38
measured modbench's dense decode step at 6.0 ms on an H100 where its memory roofline is 0.10 ms,
8-13x below a static-cache decoder of the same model captured in a CUDA graph. This module is that
decoder for every variant: one step whose shapes depend only on (batch, max_len), with the position
on the device, so that ``torch.compile(fullgraph=True)`` traces it as one graph and a CUDA graph
replays it.

The design: compute every row, then mask (the causal rule of Raposo et al. 2024, arXiv:2404.02258
§3.5, decided on the device). A routed layer runs its block on every sequence of the batch and keeps
the result only where the rule processes the token: ``torch.where(decide, x + w·Δ, skipped(x))``,
through the model's own path (``RoutedBlock.pre_route`` / ``decide`` / ``routed_delta`` /
``mix_causal``), exactly what ``GPT.forward(routing_mode="causal")`` does for a whole sequence and
what the dynamic decoder does for a prompt. For a one-token step the "fixed-bound slot grid" is the
B rows of the batch: it never overflows, so every count the rule can pick (0 … B) is exact, a
variable-count router's (``token_choice``, ``threshold``, ``expert_threshold``, ``mor_token_choice``)
included: at decode its count is whatever its rule picks, with no k_max slots and nothing dropped.
Why not a gathered grid of fewer than B rows (vLLM's MoE sizing): it must drop or defer the
sequences beyond its bound when more of them process the token, which changes the model; a grid
sized by the count, or bucketed graphs, need the count on the host.

What masking costs: the step does a dense step's block work at every routed layer (plus the
router's), so by itself it saves nothing per decode step: it removes the host overhead that issue 38
measured dominating both. The saving comes back with ``cond=True`` (steps "static-cond",
"graph-cond", "compile-cond" of ``modbench.model.decode.generate``): each routed layer branches on
``decide.any()`` between ``processed`` and ``skipped``, so a layer that no sequence of the batch routes
to runs its skip path alone — no block weights read, no K/V written — and one that some sequence
routes to runs the masked block above. The two branches give the same result whenever the
predicate picks either (a layer with no processed token: ``mix_causal`` is ``skipped(x)`` and the
masked write keeps the old slot), so the choice changes speed, never numbers (tests check the two
bit for bit). That is the saving the roofline of ``modbench.bench.decode_roofline`` charges (a
routed layer reads its weights only on steps where b > 0): everything at batch 1, little at batch
64 where some sequence nearly always processes. The step is the parts below (``route_part``,
``processed_part``, ``skipped_part``, ``dense_part``) applied layer by layer, and the branch between
them is taken
- on the device in a CUDA graph ("graph-cond"; "compile-cond" on CUDA): the capture records each
  branch with torch's ``if_else_node`` (``torch._higher_order_ops.cudagraph_conditional_nodes``, what
  Inductor's CUDA-graph trees run a ``torch.cond`` with) as CUDA graph conditional nodes (CUDA ≥
  12.4) whose body the GPU runs or skips by reading the predicate itself: a replay reads nothing on
  the host. The warm-up before it runs both branches (their lazy set-up and compiles);
- on the host otherwise ("static-cond"; "compile-cond" on a CPU): one read per routed layer and step,
  free on a CPU (a sync each on CUDA). That is what an eager ``torch.cond`` does after its Dynamo
  trace and guard check (about 0.5 ms a call on a CPU), so the step branches in Python;
- on the host between CUDA graphs ("graph-split", "compile-split": ``StepSpec.split``), for a torch
  without conditional nodes (2.11, the lent GPU's: ``cuda_graphs.branch_capture_missing``): the step
  captured in pieces split at each branching layer, piece k from the layer after branch k − 1 to branch
  k's decision, and each branch's two sides captured apart, both writing the layer's output into one
  buffer that piece k + 1 reads (``_capture_pieces``). A replay runs a piece, reads the predicate (a
  sync per routed layer), and replays the side it picks, so a skipped layer launches none of its
  block's kernels; the pieces are the same functions whatever runs them, and ``cuda_graphs.eager_piece``
  runs them without CUDA (the CPU tests, the decode bench's dry run). vLLM's piecewise CUDA graphs split
  a model at its attention the same way, leaving that part to the host.
"compile-cond" compiles each part once (``compiled_parts``: Inductor's kernels, one graph per part
serving every layer; Inductor's default mode, whose code a capture can hold). Why not compile the
whole step with a ``torch.cond``: Inductor lowers it to a host ``if pred.item()`` and will not
CUDA-graph a graph that holds one (torch 2.13, ``_inductor/lowering.py``). The whole step still
traces with ``torch.cond`` under ``torch.compile(fullgraph=True)`` (tests: one graph, no host sync),
which is what shows that nothing in it needs the host. A layer whose attention exposes a summary to
the next router (``amod``: a module attribute set, which a branch or a compiled part may not hold)
runs its parts eagerly, and masked if it is routed.

The cache, slot t for position t with a ``valid`` mask that a skipped token leaves unset:
``modbench.model.static_cache``. The capture mechanics (side-stream warm-up, captures, conditional nodes):
``modbench.model.cuda_graphs``.

Runners (``StaticDecoder(runner=...)``; prompt chunks of more than one token always run eagerly):
"eager" calls the step; "graph" captures the one-token step once in a ``torch.cuda.CUDAGraph`` (a
warm-up on a side stream, then capture, the cache restored after) and replays it, the new tokens
copied into a static input first; "compile" runs it under ``torch.compile(fullgraph=True)``, mode
"reduce-overhead" on CUDA (Inductor's CUDA graphs; the cache tensors are marked static addresses so
that their in-place updates stay inside the graph); under ``cond`` it compiles the parts instead and,
on CUDA, captures the step as "graph" does (above). ``prepare`` captures or compiles ahead of a
generation, leaving the cache as it was; ``reset`` empties it in place, so one decoder (one capture,
one compile) serves many generations of one batch size.

A router that cannot use this step says why in ``Router.static_decode_refusal`` (registry:
``modbench.variants.static_decode_refusal``); ``static_refusal`` reads it for a built model, and
``modbench.model.decode.generate(step="auto")`` then decodes with the dynamic decoder. No built-in
variant refuses.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from modbench.errors import ModbenchError, accepted
from modbench.model.cuda_graphs import (COMPILE_WARMUP, capture_cuda_graph, cuda_graph_piece,
                                        require_if_else_node, uncached_autocast, warm_up)
from modbench.model.gpt import GPT, RoutedBlock
from modbench.model.static_cache import StaticLayerCache, StaticSharedCache, slots_of

RUNNERS = ("eager", "graph", "compile")


@dataclass(frozen=True)
class StepSpec:
    """How a static step runs: ``StaticDecoder``'s options for one of ``generate``'s step names."""

    runner: str
    """How a one-token call runs the step (``RUNNERS``, module doc)."""
    cond: bool = False
    """A routed layer that no sequence of the batch routes to runs its skip path alone (``torch.cond``)."""
    split: bool = False
    """(with ``cond``, a "graph" or "compile" runner) The step captured as CUDA graphs split at each branch, the
    host reading the branch's predicate between them, instead of one graph with conditional nodes."""

    @property
    def captures(self) -> bool:
        """Whether the step replays CUDA graphs of its own (so needs CUDA); "compile" without ``cond`` leaves
        its CUDA graphs to Inductor ("reduce-overhead"), "compile-cond" captures them on CUDA only."""
        return self.runner == "graph" or self.split


# generate's names for the static steps (``modbench.model.decode.STEPS`` adds "dynamic", the old decoder)
STATIC_STEPS = {"static": StepSpec("eager"), "graph": StepSpec("graph"), "compile": StepSpec("compile"),
                "static-cond": StepSpec("eager", cond=True), "graph-cond": StepSpec("graph", cond=True),
                "compile-cond": StepSpec("compile", cond=True),
                "graph-split": StepSpec("graph", cond=True, split=True),
                "compile-split": StepSpec("compile", cond=True, split=True)}
# The steps that capture each routed layer's branch as CUDA graph conditional nodes on CUDA
# (``cuda_graphs.branch_capture_missing``): every "-cond" step but the one that branches on the host
BRANCH_CAPTURE_STEPS = tuple(name for name, spec in STATIC_STEPS.items()
                             if spec.cond and spec.runner != "eager" and not spec.split)
MODES = ("causal", "dense")  # as ``modbench.model.decode.DECODE_MODES`` (top-k needs the future)


# --- which models can use it ------------------------------------------------------------------
def static_refusal(model: GPT) -> str | None:
    """Why ``model`` cannot decode causally with the static step (its first router that says so,
    ``Router.static_decode_refusal``), or None when it can."""
    for router in model.routers:
        if router.static_decode_refusal:
            return f"{type(router).__name__}: {router.static_decode_refusal}"
    return None


# --- the step's parts ---------------------------------------------------------------------------
# A step applies these layer by layer; between them sits the only branch (``StaticDecoder._routed``).
# "compile-cond" compiles each part once (Inductor fuses its kernels, and one compiled graph serves every
# layer of its kind) and keeps the branch outside compiled code: on the host on a CPU, as a CUDA graph's
# conditional node on CUDA.
def route_part(layer: RoutedBlock, cache, x: Tensor, cos: Tensor, sin: Tensor, previous: object | None):
    """What runs on every row before the decision, and the decision: (x, decide (B, n) bool, handoff)."""
    x = layer.pre_route(x, cos, sin, cache=cache)
    decide, handoff = layer.decide(x, previous)
    return x, decide, handoff


def processed_part(layer: RoutedBlock, cache, handoff: object | None, x: Tensor, decide: Tensor,
                   cos: Tensor, sin: Tensor) -> Tensor:
    """The routed layer on every row, kept where ``decide``: skipped rows write no K/V (``keep``) and
    leave the skip rule's output (``mix_causal``'s torch.where)."""
    delta = layer.routed_delta(x, cos, sin, cache=cache, keep=decide)
    return layer.mix_causal(x, decide, delta, handoff)


def skipped_part(layer: RoutedBlock, x: Tensor) -> Tensor:
    """The layer's output when no row processes the token (``processed_part``'s value then, bit for bit)."""
    return layer.skipped(x).clone()  # (a branch may not return its input itself)


def dense_part(layer, cache, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """A plain layer (or a routed one under mode "dense") on every row."""
    return x + layer.block.delta(x, cos, sin, cache=cache)


@dataclass(frozen=True)
class StepParts:
    """The four parts a step calls: the functions above, or compiled forms of them."""

    route: Callable
    processed: Callable
    skipped: Callable
    dense: Callable


EAGER_PARTS = StepParts(route_part, processed_part, skipped_part, dense_part)


class _Carry(NamedTuple):
    """What one layer of a step hands the next: the residual stream ``x``, the new tokens' rotations, their
    number, and what the next router reads of the last routed layer (``previous``: its decisions, for
    nested routing; its handoff, for mor_token_choice's depths chosen up front; or an attention's summary,
    for amod).

    Immutable, each layer making a new one: under torch 2.13 Dynamo loses an attribute written to a Python
    object after a traced ``torch.cond`` (a later read returns the value from before the write, silently;
    torch 2.11 keeps it), which made the whole step traced with ``torch.cond`` compute wrong logits."""

    x: Tensor
    cos: Tensor
    sin: Tensor
    n: int
    previous: object | None = None

    def with_x(self, x: Tensor) -> _Carry:
        return _Carry(x, self.cos, self.sin, self.n, self.previous)

    def with_previous(self, previous: object | None) -> _Carry:
        return _Carry(self.x, self.cos, self.sin, self.n, previous)

    def routed(self, x: Tensor, decide: Tensor, handoff: object | None) -> _Carry:
        """After a routed layer: its output, and what the next router reads of it."""
        return _Carry(x, self.cos, self.sin, self.n, decide if handoff is None else handoff)


@dataclass
class _Piece:
    """One CUDA graph of a split step (``StaticDecoder._capture_pieces``) and, unless it is the last, the
    branch that follows it: its index, and the graphs of its two sides."""

    replay: Callable[[], None]
    branch: int | None = None  # the branch's index (its predicate: the box's ("pred", branch), 0-dim bool)
    processed: Callable[[], None] | None = None
    skipped: Callable[[], None] | None = None


def compiled_parts(backend: str | Callable = "inductor") -> StepParts:
    """Each part under ``torch.compile(fullgraph=True, dynamic=False)`` (Inductor's default mode: no CUDA
    graphs of its own, so that a capture of the whole step can hold them)."""
    return StepParts(*(torch.compile(f, fullgraph=True, dynamic=False, backend=backend)
                       for f in (route_part, processed_part, skipped_part, dense_part)))


# --- the decoder --------------------------------------------------------------------------------
class RoutingTally:
    """The shares a decoder reports from its ``processed_counts``, ``routed_total`` and ``processed``
    (one entry per routed layer): written once for the dynamic ``Decoder`` and the ``StaticDecoder``."""

    @property
    def processed_shares(self) -> list[float]:
        """Per routed layer, in order: the share of its token computations done so far."""
        return [c / max(self.routed_total, 1) for c in self.processed_counts]

    @property
    def skipped_fraction(self) -> float:
        """Fraction of routed-layer token computations skipped so far (mlp_skip: MLPs)."""
        if not self.routed_total or not self.processed.numel():
            return 0.0
        return 1.0 - sum(self.processed_counts) / (self.routed_total * self.processed.numel())


class StaticDecoder(RoutingTally):
    """Feeds tokens through ``model`` with static KV caches: ``decoder(idx)`` takes the next (B, n)
    tokens of every sequence and returns their logits (B, n, V), as ``modbench.model.decode.Decoder``
    (mode "causal" routes by the causal rule; "dense" runs every routed layer as a plain block).

    ``step`` is the static, sync-free computation; ``runner`` says how a one-token call runs it
    (``RUNNERS``, module doc); ``cond``: a routed layer no sequence routes to runs its skip path alone
    (``torch.cond``, module doc); ``split`` (with ``cond``): the step captured in pieces between the branches,
    the host choosing each branch's graph (``StepSpec``, module doc). ``compile_backend`` overrides
    torch.compile's backend for the "compile" runner (tests use "eager": Dynamo's tracing, no code
    generation); ``capture_piece`` overrides how a ``split`` step captures a piece (default
    ``cuda_graphs.cuda_graph_piece``; ``cuda_graphs.eager_piece`` rehearses it on a CPU). ``reset`` empties
    the caches so that one decoder (and its captured graphs or compiled step) serves many generations.
    """

    def __init__(self, model: GPT, batch: int, max_len: int, *, mode: str = "causal", runner: str = "eager",
                 cond: bool = False, split: bool = False, compile_backend: str | Callable | None = None,
                 capture_piece: Callable[[Callable[[], None]], Callable[[], None]] | None = None) -> None:
        if mode not in MODES:
            raise ModbenchError(f"cannot decode with routing mode {mode!r}: expected {accepted(MODES)} "
                                "(top-k needs the scores of future tokens)")
        if runner not in RUNNERS:
            raise ModbenchError(f"unknown static decode runner {runner!r}: expected {accepted(RUNNERS)}")
        cfg = model.cfg
        if max_len > cfg.max_seq_len:
            raise ModbenchError(f"prompt + new tokens = {max_len} exceeds the model's max_seq_len {cfg.max_seq_len}")
        why = static_refusal(model) if mode == "causal" else None
        if why is not None:
            raise ModbenchError(f"variant {model.routing.variant!r} cannot decode with the static step ({why}); "
                                "use the dynamic decoder (generate(step='dynamic'))")
        if split and (not cond or runner == "eager"):
            raise ModbenchError("a split step captures the pieces between routed layers' branches: it needs cond=True "
                                "and runner 'graph' or 'compile' (expected steps 'graph-split' or 'compile-split')")
        p = model.head.weight
        if (runner == "graph" or split) and p.device.type != "cuda" and capture_piece is None:
            what = f"the split {runner!r} runner" if split else f"the {runner!r} runner"
            raise ModbenchError(f"{what} captures a CUDA graph: the model is on {p.device.type}, expected cuda "
                                "(use runner 'eager' or 'compile')")
        self.model, self.mode, self.batch, self.max_len, self.runner = model, mode, batch, max_len, runner
        self.routed = mode == "causal"
        self.cond, self.split = cond, split
        if cond and not split and (runner == "graph" or (runner == "compile" and p.device.type == "cuda")):
            require_if_else_node()  # (fails now, with the reason, where this torch cannot capture a branch)
        self.compile_backend = compile_backend
        self.capture_piece = capture_piece or cuda_graph_piece
        self.pos = torch.zeros((), dtype=torch.long, device=p.device)  # the next token's position
        hd = cfg.width // cfg.heads
        self.caches: list[StaticLayerCache | StaticSharedCache] = []
        for src in model.kv_sources:  # a later step under recursive KV sharing reads step 0's cache
            self.caches.append(StaticLayerCache(batch, cfg.heads, max_len, hd, p.device, p.dtype, self.pos)
                               if src is None else StaticSharedCache(self.caches[src]))
        # per layer: its index among the routed layers when it routes (mode "causal"), for ``processed``
        routed = [i for i, layer in enumerate(model.layers) if isinstance(layer, RoutedBlock)]
        self._routed_index = {i: j for j, i in enumerate(routed)} if self.routed else {}
        self.processed = torch.zeros(len(routed), dtype=torch.long, device=p.device)  # per routed layer, on the device
        self.fed = 0  # tokens fed per sequence, counted on the host (bounds and shares: no sync)
        # one CUDA graph: "graph", "graph-cond" (eager parts) and, on CUDA, "compile-cond" (compiled parts)
        self.graphed = not split and (runner == "graph" or (runner == "compile" and cond and p.device.type == "cuda"))
        self._pieces: list[_Piece] | None = None  # a split step's captured pieces (``_capture_pieces``)
        self._box: dict = {}  # the tensors its pieces pass each other
        self._parts: StepParts | None = None  # the one-token step's parts (compiled ones built on first use)
        self._branching = "host"  # how ``_routed`` branches: "host", "warm-up" or "capture" (``_capture``)
        self._graph: torch.cuda.CUDAGraph | None = None
        self._graph_idx: Tensor | None = None
        self._graph_out: Tensor | None = None
        self._compiled = None

    @property
    def step_name(self) -> str:
        """``generate``'s name for this decoder (``STATIC_STEPS``)."""
        return next(name for name, spec in STATIC_STEPS.items() if spec == StepSpec(self.runner, self.cond, self.split))

    # --- state ---------------------------------------------------------------------------------
    def state(self) -> list[Tensor]:
        """Every tensor a step mutates in place: the position, the counts and the caches."""
        return [self.pos, self.processed, *(t for c in self.caches for t in c.tensors())]

    def reset(self) -> None:
        """Empty the caches (in place: a captured graph keeps its addresses) for a new generation."""
        for t in self.state():
            t.zero_()
        self.fed = 0

    @property
    def routed_total(self) -> int:
        """Per routed layer: the token computations the causal rule decided on so far."""
        return self.fed * self.batch if self.routed else 0

    @property
    def processed_counts(self) -> list[int]:
        return [int(c) for c in self.processed.tolist()] if self.routed else [0] * self.processed.numel()


    @property
    def kv_bytes(self) -> int:
        """Bytes of the K/V entries of the valid slots (as ``Decoder.kv_bytes``). One host sync."""
        caches = [c for c in self.caches if isinstance(c, StaticLayerCache)]
        slots = torch.stack([c.valid.sum() for c in caches]).sum()
        k = caches[0].k
        return int(slots) * 2 * k.shape[1] * k.shape[3] * k.element_size()

    @property
    def kv_bytes_per_token(self) -> float:
        return self.kv_bytes / max(self.fed * self.batch, 1)

    # --- feeding -------------------------------------------------------------------------------
    @torch.no_grad()
    def __call__(self, idx: Tensor) -> Tensor:
        B, n = idx.shape
        if B != self.batch:
            raise ValueError(f"decoder was built for batch {self.batch}, got {B}")
        if self.fed + n > self.max_len:
            raise ModbenchError(f"decoding past {self.max_len} tokens: raise the decoder's max_len")
        if n == 1 and self.split:
            logits = self._replay_pieces(idx)
        elif n == 1 and self.graphed:
            logits = self._replay(idx)
        elif n == 1 and self.runner == "compile" and not self.cond:
            logits = self._compiled_step(idx)
        elif n == 1:
            logits = self.step(idx, self._one_token_parts())
        else:
            logits = self.step(idx)  # a prompt chunk: eager
        self.fed += n
        return logits

    def step(self, idx: Tensor, parts: StepParts = EAGER_PARTS) -> Tensor:
        """The static step: (B, n) tokens at positions ``pos`` … ``pos`` + n − 1 → logits (B, n, V).
        Shapes depend on (B, n, max_len) alone, state changes in place, and nothing is read on the host
        except, for a "-cond" step outside a CUDA graph, one flag per routed layer (``_routed``)."""
        carry = self._begin(idx)
        for i in range(len(self.model.layers)):
            carry = self._layer(carry, i, parts)
        return self._end(carry)

    def _begin(self, idx: Tensor) -> _Carry:
        """The embedded tokens and their rotations (from the device position)."""
        m = self.model
        slots = slots_of(self.pos, idx.shape[1])
        return _Carry(m.embed(idx), m.rope_cos.index_select(0, slots), m.rope_sin.index_select(0, slots), idx.shape[1])

    def _layer(self, carry: _Carry, i: int, parts: StepParts) -> _Carry:
        """Layer ``i`` of the step after ``carry``, a routed layer's branch included (``_routed``)."""
        layer, cache = self.model.layers[i], self.caches[i]
        attn = layer.block.attn
        # (an attention that exposes its summary to the next router sets a module attribute: kept eager)
        own = EAGER_PARTS if attn.expose else parts
        if i in self._routed_index:
            carry, decide, handoff = self._route(carry, i, own)
            x = self._routed(own, layer, cache, carry.x, decide, handoff, carry.cos, carry.sin)
            carry = carry.routed(x, decide, handoff)
        else:
            carry = carry.with_x(own.dense(layer, cache, carry.x, carry.cos, carry.sin))
        if attn.expose:  # the next router reads this layer's attention (amod)
            carry = carry.with_previous(attn.take_exposed())
        return carry

    def _route(self, carry: _Carry, i: int, parts: StepParts) -> tuple[_Carry, Tensor, object | None]:
        """Routed layer ``i`` up to its decision (``route_part``), counted: (carry, decide (B, n) bool, handoff)."""
        x, decide, handoff = parts.route(self.model.layers[i], self.caches[i], carry.x, carry.cos, carry.sin,
                                         carry.previous)
        self.processed[self._routed_index[i]] += decide.sum()
        return carry.with_x(x), decide, handoff

    def _end(self, carry: _Carry) -> Tensor:
        """The logits, and the position moved past the fed tokens."""
        self.pos.add_(carry.n)
        return self.model.head(self.model.norm(carry.x))

    def _routed(self, parts: StepParts, layer: RoutedBlock, cache, x: Tensor, decide: Tensor,
                handoff: object | None, cos: Tensor, sin: Tensor) -> Tensor:
        """A routed layer's output: ``processed_part``; under ``cond``, ``skipped_part`` instead when no
        row processes the token (the same value, without the block's work: module doc)."""
        if not self.cond or layer.block.attn.expose:
            return parts.processed(layer, cache, handoff, x, decide, cos, sin)

        def processed(x: Tensor, decide: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
            return parts.processed(layer, cache, handoff, x, decide, cos, sin)

        def skipped(x: Tensor, decide: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
            return parts.skipped(layer, x)

        operands = (x, decide, cos, sin)
        pred = decide.any()
        if torch.compiler.is_compiling():  # the whole step traced: Dynamo keeps both branches
            return torch.cond(pred, processed, skipped, operands)
        if self._branching == "capture":  # a CUDA graph: the GPU reads ``pred`` and runs one branch
            return require_if_else_node()(pred, processed, skipped, operands)
        if self._branching == "warm-up":  # both branches before a capture (lazy set-up, compiles), no host read;
            skipped(*operands)  # the masked branch alone is always right (an idle layer writes nothing)
            return processed(*operands)
        # On the host: what an eager torch.cond does after its Dynamo trace and guard check (about 0.5 ms a
        # call on a CPU: torch/_higher_order_ops/cond.py, cond_op_dense), without them.
        return processed(*operands) if pred else skipped(*operands)

    def _one_token_parts(self) -> StepParts:
        """The parts of a one-token step: compiled for "compile-cond" (built once), else the eager ones."""
        if self._parts is None:
            compiled = self.runner == "compile" and self.cond
            self._parts = compiled_parts(self.compile_backend or "inductor") if compiled else EAGER_PARTS
        return self._parts

    # --- runners -------------------------------------------------------------------------------
    def prepare(self) -> None:
        """Capture ("graph") or compile and warm up ("compile") the one-token step now, leaving the
        caches as they were, so that a generation's timing starts at steady state (``generate`` calls
        it before its clock and reports its time as ``Generation.setup_seconds``). Idempotent; nothing
        to do for "eager". Call it under the autocast the steps will run under."""
        if self.split:
            if self._pieces is None:
                self._capture_pieces()
        elif self.graphed:
            if self._graph is None:
                self._capture()
        elif self.runner == "compile" and not self.cond and self._compiled is None:
            idx = torch.zeros(self.batch, 1, dtype=torch.long, device=self.pos.device)
            with torch.no_grad(), self._scratch():
                for _ in range(COMPILE_WARMUP):
                    self._compiled_step(idx)
        elif self.runner == "compile" and self._parts is None:  # compiled parts, both branches of each
            idx = torch.zeros(self.batch, 1, dtype=torch.long, device=self.pos.device)
            with torch.no_grad(), self._scratch(), self._branching_as("warm-up"):
                for _ in range(COMPILE_WARMUP):
                    self.step(idx, self._one_token_parts())

    @contextmanager
    def _branching_as(self, how: str):
        """``_routed`` branches ``how`` ("warm-up", "capture") inside, on the host again after."""
        self._branching = how
        try:
            yield
        finally:
            self._branching = "host"

    @contextmanager
    def _scratch(self):
        """Steps run inside change nothing: every mutated tensor is saved before and restored after,
        and they run from position 0 (whatever was fed already, they stay inside the cache)."""
        saved = [t.clone() for t in self.state()]
        self.pos.zero_()
        try:
            yield
        finally:
            for t, s in zip(self.state(), saved):
                t.copy_(s)

    def _replay(self, idx: Tensor) -> Tensor:
        if self._graph is None:
            self._capture()
        self._graph_idx.copy_(idx)
        self._graph.replay()
        return self._graph_out.clone()  # the next replay overwrites the graph's output

    @torch.no_grad()
    def _capture(self) -> None:
        """Capture the one-token step in a CUDA graph: warm-up steps run eagerly on a side stream (as
        ``torch.cuda.graphs`` asks: lazy cuBLAS and SDPA set-up happen outside the capture), all of it
        inside ``_scratch``, so capturing mid-generation changes nothing."""
        device = self.pos.device
        self._graph_idx = torch.zeros(self.batch, 1, dtype=torch.long, device=device)
        parts = self._one_token_parts()
        with self._scratch(), uncached_autocast(device):
            self._graph, self._graph_out = capture_cuda_graph(
                lambda idx: self.step(idx, parts), self._graph_idx,
                warming=lambda: self._branching_as("warm-up"), capturing=lambda: self._branching_as("capture"))

    # --- the split steps ------------------------------------------------------------------------
    def _branch_layers(self) -> list[int]:
        """The layers whose branch splits the step: the routed ones that branch (``_routed``)."""
        return [i for i in self._routed_index if not self.model.layers[i].block.attn.expose]

    def _replay_pieces(self, idx: Tensor) -> Tensor:
        """A one-token step of a split decoder: each piece's graph, and after it the graph of the side its
        branch takes, read on the host (one read, and so one sync on CUDA, per branching layer)."""
        if self._pieces is None:
            self._capture_pieces()
        self._graph_idx.copy_(idx)
        for piece in self._pieces:
            piece.replay()
            if piece.branch is not None:
                (piece.processed if self._box["pred", piece.branch].item() else piece.skipped)()
        return self._box["logits"].clone()  # the next replay overwrites it

    @torch.no_grad()
    def _capture_pieces(self) -> None:
        """Capture the one-token step as pieces (``capture_piece`` each): piece k runs from the layer after
        branch k − 1 to branch k's decision (the last one to the logits); branch k's two sides, captured
        apart, each write the layer's output into one buffer, where piece k + 1 reads it. Tensors pass
        between pieces through one box whose entries the captures fix (a replay rewrites them in place).
        Warm-up first, each piece and both sides of each branch eagerly on a side stream (lazy set-up and
        compiles outside the captures), all of it inside ``_scratch``: capturing changes nothing."""
        device = self.pos.device
        self._graph_idx = torch.zeros(self.batch, 1, dtype=torch.long, device=device)
        self._box.clear()
        pieces, sides = self._piece_functions(self._graph_idx, self._one_token_parts())
        def every_piece_and_side() -> None:
            for k, piece in enumerate(pieces):
                piece()
                if k < len(sides):
                    sides[k][0](), sides[k][1]()

        with self._scratch(), uncached_autocast(device):
            warm_up(every_piece_and_side, device)
            self._pieces = []
            for k, piece in enumerate(pieces):
                replay = self.capture_piece(piece)
                if k == len(sides):
                    self._pieces.append(_Piece(replay))
                else:
                    processed, skipped = (self.capture_piece(f) for f in sides[k])
                    self._pieces.append(_Piece(replay, k, processed, skipped))

    def _piece_functions(self, idx: Tensor, parts: StepParts) -> tuple[list[Callable], list[tuple[Callable, Callable]]]:
        """(pieces, per branch its (processed, skipped) sides) of the one-token step on ``idx``, as functions
        of no argument that pass tensors through ``self._box`` (``_capture_pieces``)."""
        box, layers = self._box, self.model.layers
        branches = self._branch_layers()
        starts = [0] + [i + 1 for i in branches]
        stops = branches + [len(layers)]

        def piece(k: int) -> Callable[[], None]:
            def run() -> None:
                if k == 0:
                    carry = self._begin(idx)
                else:  # branch k − 1's output, from its buffer
                    carry = box["carry"].routed(box["out", k - 1], *box["branch", k - 1])
                for i in range(starts[k], stops[k]):
                    carry = self._layer(carry, i, parts)
                if k == len(branches):
                    box["logits"] = self._end(carry)
                    return
                carry, decide, handoff = self._route(carry, branches[k], parts)
                box["carry"], box["branch", k] = carry, (decide, handoff)
                box["pred", k] = decide.any()
                if ("out", k) not in box:  # (the warm-up allocates it: outside any capture, one address for good)
                    box["out", k] = torch.empty_like(carry.x)
            return run

        def side(k: int, processed: bool) -> Callable[[], None]:
            def run() -> None:
                layer, cache, carry = layers[branches[k]], self.caches[branches[k]], box["carry"]
                decide, handoff = box["branch", k]
                y = (parts.processed(layer, cache, handoff, carry.x, decide, carry.cos, carry.sin) if processed
                     else parts.skipped(layer, carry.x))
                box["out", k].copy_(y)
            return run

        return ([piece(k) for k in range(len(branches) + 1)],
                [(side(k, True), side(k, False)) for k in range(len(branches))])

    def _compiled_step(self, idx: Tensor) -> Tensor:
        cuda = self.pos.device.type == "cuda"
        if self._compiled is None:
            if self.compile_backend is not None:
                self._compiled = torch.compile(self.step, fullgraph=True, dynamic=False, backend=self.compile_backend)
            else:
                if cuda:  # in-place updates of these stay inside Inductor's CUDA graph
                    for t in self.state():
                        torch._dynamo.mark_static_address(t)
                self._compiled = torch.compile(self.step, fullgraph=True, dynamic=False,
                                               mode="reduce-overhead" if cuda else None)
        if cuda:
            torch.compiler.cudagraph_mark_step_begin()
        return self._compiled(idx).clone()  # (a CUDA graph's output is overwritten by its next replay)
