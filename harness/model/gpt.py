"""A byte-level GPT with Mixture-of-Depths routing.

Read top to bottom. Notable features:

- Decoder-only transformer over bytes (vocab 256 by default): token embedding, rotary
  position embeddings (Su et al. 2021), pre-norm RMSNorm, causal
  ``scaled_dot_product_attention``, a 4× GELU MLP and an untied output head.
- Depth parameterisation of nanochat (karpathy/nanochat; ``ModelConfig``).
- Routed layers (Raposo et al. 2024, arXiv:2404.02258): a variant's router picks the top-k
  tokens (k from the capacity schedule); the block gathers them in ascending position
  order together with the RoPE angles of their *original* positions, runs attention among
  the selected tokens only (a causal mask on the sorted subset is exact), runs the MLP, and
  adds ``weight · delta`` back with one batched ``index_add``. Unselected tokens are never
  written, so they come out bit-identical. ``mlp_skip`` routes the MLP alone; ``dtrnet`` routes
  attention's token mixing alone (scope "attention": the MLP runs on every token after the mix, and
  the skipped tokens get a token-local update, their attention with themselves alone). How a variant's
  block output meets the residual stream otherwise (its weight on the MLP alone, on each sublayer in
  turn or on the block's output, a handed-over base, scaled or locally updated skipped tokens) is the
  router's declared ``Mixing`` policy. A soft gate (``tsa``) routes every token in training, each update
  scaled by its own weight, and skips tokens only by its causal rule.
- Capacity 1.0 (and the ``dense`` variant) builds plain blocks: no router, no overhead.
- Three routing modes (``GPT.forward(..., routing_mode=...)``): ``"topk"`` is the training
  rule above (non-causal: whether token t is selected depends on the scores of later
  tokens); ``"causal"`` routes each token by the variant's ``decide_causal`` (its own hidden
  state only) in one parallel pass with a boolean attention mask — a skipped token is
  neither a query nor a key/value at that layer — which is exactly what KV-cached decoding
  (``modbench.model.decode``) computes; ``"dense"`` runs every routed layer as a plain block on
  every token (MoD switched off: the inference mode of the nanochat fork's MoD docs). The default path is unchanged.
- One block path: ``Block.attention`` / ``Block.mlp_delta`` / ``Block.delta`` are the block's
  arithmetic for every routing mode and for KV-cached decoding (the cache is an argument, as
  in nanochat); ``RoutedBlock.pre_route`` / ``routed_delta`` / ``post_route`` are the only places that
  read the router's scope, and ``RoutedBlock.mix`` the one place the block's output meets the residual
  stream (as the router's ``Mixing`` says), for the top-k forward, causal mode and decoding.
- No host-device synchronisation in the forward pass: k is a Python int from static
  shapes, and nothing calls ``.item()`` but a mixture of experts sizing its slices in full precision
  (``TopOneMoE``, declared by its routers: ``Router.training_host_read``; in bf16 it runs grouped GEMMs and
  reads nothing); the model compiles with ``fullgraph=True``.
- Analytic FLOPs as model methods (``flops_per_token``), documented in ``modbench.model.flops``.
- Recursive models (``ModelConfig.recursion``, Mixture-of-Recursions arXiv:2507.10524 §2.1): the
  layer positions of the unrolled stack that share a block hold the same ``Block`` module
  (``modbench.model.recursion.sharing_map``); every position keeps its own router, KV cache and
  FLOP count, so routing, decoding and FLOPs need no special case. The recursive dense baseline is
  a recursive config with the ``dense`` variant: the shared block on every token at every step.
  With ``ModelConfig.kv_sharing`` (MoR §2.3, recursive KV sharing) a later application of the shared
  block computes no K/V: its queries attend to what the same layer computed at step 0 (``KVShare``).
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from modbench.variants import Mixing, Router, get_variant

from modbench.model import flops as flop_math
from modbench.model.grouped_mm import grouped_dtype, grouped_mlp
from modbench.model.kv_sharing import KVAccess, KVShare, kv_access
from modbench.model.recursion import recursion_step, sharing_map
from modbench.config.capacity import CapacitySchedule
from modbench.config.model import ModelConfig, RoutingConfig
from modbench.errors import ModbenchError, accepted

ROUTING_MODES = ("topk", "causal", "dense")


# --- rotary position embeddings -----------------------------------------------------------
def rope_tables(max_seq_len: int, head_dim: int, base: float) -> tuple[Tensor, Tensor]:
    """cos, sin of shape (max_seq_len, head_dim / 2) (Su et al. 2021, RoFormer eq. 34)."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float64), inv_freq)
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate (x1, x2) halves of each head by the angles of the tokens' positions.

    x: (B, H, T, hd); cos, sin: broadcastable to (B, 1, T, hd / 2). The rotation runs in x's dtype
    (as nanochat's ``apply_rotary_emb`` does): fp32 tables would promote bf16 q and k to fp32 under
    autocast, and the attention would then cast them back, paying two fp32 copies of q and k forward
    and backward (issue 38: the dense layer's eager time). In fp32 the ``to`` is a no-op: CPU runs are
    bit for bit what they were.
    """
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


# --- the transformer block ----------------------------------------------------------------
@dataclass
class AttentionSummary:
    """What a layer's attention exposes to the next layer's router (``amod``), detached, (B, T) each.

    self_weight: nᵢ·a_{i,i}, the weight query i puts on its own key relative to uniform over its
                 nᵢ visible keys (the causal score: only query i has seen token i when it arrives).
    received:    the attention token j receives, Σ_{i sees j} nᵢ·a_{i,j} / #{i sees j} (uniform
                 attention gives 1 to every token); None where it was not computed (causal
                 mode, decoding). Both are averaged over heads and 0 for tokens the layer skipped.
    """

    self_weight: Tensor
    received: Tensor | None = None


def attention_summary(q: Tensor, k: Tensor, mask: Tensor | None, own: Tensor | None = None) -> AttentionSummary:
    """``AttentionSummary`` of softmax(qkᵀ/√hd) under ``mask`` (B, 1, n, L) bool, or causal when None
    (n = L). ``own``: (B, n) slot of each query's own key (decoding), else the diagonal. The full
    n × L score matrix is materialised (2·n·L·d FLOPs, no gradient)."""
    q, k = q.detach().float(), k.detach().float()
    n, L = q.shape[-2], k.shape[-2]
    causal = mask is None
    visible = torch.ones(n, L, dtype=torch.bool, device=q.device).tril(L - n) if causal else mask[:, 0]
    logits = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
    a = F.softmax(logits.masked_fill(~visible.unsqueeze(-3), -math.inf), dim=-1).mean(1)  # (B, n, L), heads averaged
    count = visible.sum(-1).to(a.dtype)  # nᵢ: the keys query i sees
    if own is not None:
        return AttentionSummary(a.gather(-1, own.unsqueeze(-1)).squeeze(-1) * count)
    self_weight = a.diagonal(dim1=-2, dim2=-1) * count
    if not causal:
        return AttentionSummary(self_weight)
    received = (a * count.unsqueeze(-1)).sum(-2) / visible.sum(-2).to(a.dtype)  # every key is seen by itself
    return AttentionSummary(self_weight, received)


class Attention(nn.Module):
    # True on a layer whose next layer's router reads its attention (``amod``, set by ``GPT``): every
    # attention call then leaves its ``AttentionSummary`` in ``exposed`` for the layer to pass on.
    expose: bool = False
    exposed: AttentionSummary | None = None

    def __init__(self, d: int, n_head: int) -> None:
        super().__init__()
        self.n_head = n_head
        # An instance attribute from the start: one that a forward first creates changes the module's
        # __dict__, and a compiled model's guard on it recompiles the whole forward once more.
        self.exposed = None
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.proj = nn.Linear(d, d, bias=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        if self.expose:
            q, k, v = self.project(x, cos, sin)
            self.exposed = attention_summary(q, k, None)
            return self.output(F.scaled_dot_product_attention(q, k, v, is_causal=True))
        return self.output(F.scaled_dot_product_attention(*self.project(x, cos, sin), is_causal=True))

    def take_exposed(self) -> AttentionSummary | None:
        """The summary the last attention call left (None when not exposing), and forget it."""
        s, self.exposed = self.exposed, None
        return s

    # The causal-mode and KV-cache paths use the two halves of ``forward`` with their own masks.
    def project(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """q, k, v of shape (B, H, T, hd), q and k rotated by the tokens' positions."""
        B, T, d = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.n_head, d // self.n_head).permute(2, 0, 3, 1, 4)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def query(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """q alone, (B, H, T, hd), rotated: a layer that reads shared keys and values (``KVShare``)
        computes no K/V of its own (q is the first d rows of ``qkv``)."""
        B, T, d = x.shape
        q = F.linear(x, self.qkv.weight[:d]).view(B, T, self.n_head, d // self.n_head).transpose(1, 2)
        return apply_rope(q, cos, sin)

    def output(self, y: Tensor) -> Tensor:
        B, _, T, hd = y.shape
        return self.proj(y.transpose(1, 2).reshape(B, T, self.n_head * hd))

    def alone(self, h: Tensor) -> Tensor:
        """Each token's attention with itself as its only key: a softmax over one key is 1, so every head
        returns the token's own value, and the output is W_O·W_V·h (DTRNet's bypass path, arXiv:2509.00925
        Fig. 1). No q, k or score: 2·2d² FLOPs per token (v is the last d rows of ``qkv``)."""
        return self.proj(F.linear(h, self.qkv.weight[2 * h.shape[-1]:]))

    def forward_masked(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor) -> Tensor:
        """Attention with an explicit boolean mask (B, 1, T, T): True = key visible."""
        q, k, v = self.project(x, cos, sin)
        if self.expose:
            self.exposed = attention_summary(q, k, mask)
        return self.output(F.scaled_dot_product_attention(q, k, v, attn_mask=mask))


class MLP(nn.Module):
    def __init__(self, d: int, ratio: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d, ratio * d, bias=False)
        self.proj = nn.Linear(ratio * d, d, bias=False)

    @staticmethod
    def activation(h: Tensor) -> Tensor:
        return F.gelu(h, approximate="tanh")

    def forward(self, x: Tensor) -> Tensor:
        return self.proj(self.activation(self.fc(x)))


class TopOneMoE(nn.Module):
    """``n`` MLP experts; each token goes to its top-1 expert, output × that expert's gate
    probability (Switch Transformer, Fedus et al. 2021, arXiv:2101.03961 §2.1), with Switch's
    load-balancing loss n · Σᵢ fᵢ·Pᵢ (§2.2). Every token runs exactly one expert, so its FLOPs
    per token are one MLP's plus the gate's, whatever the assignment. The MLP of MoDE (staged).

    ``noop=True`` (integrated MoDE, ``mode_integrated``): the gate has one more output, a no-op
    expert (output zero: the token keeps its residual). A token here still runs its top-1 *real*
    expert, output × that expert's probability in the softmax over all n + 1 (the router, which
    reads the same gate, already sent the no-op's tokens around the MLP); the balance loss uses the
    real experts' probabilities renormalised over the real experts.

    Execution in training: tokens sorted by expert, then in bf16 (CUDA training's autocast) two grouped
    GEMMs whose slice boundaries stay on the device (``modbench.model.grouped_mm``: no host read, static
    shapes); in full precision, where torch's grouped kernel refuses to run, one matmul pair per expert
    on its slice, the slice sizes read on the host once per layer (``Router.training_host_read`` says
    so). Under ``torch.compile`` that read is captured as unbacked sizes (``compile_settings``), so the
    forward stays one graph that serves every split; without it Dynamo broke the graph there and
    recompiled for each new split until its limit. In eval mode every expert runs on every token (fixed
    shapes; see ``forward``).
    """

    def __init__(self, d: int, ratio: int, n: int, noop: bool = False) -> None:
        super().__init__()
        self.gate = nn.Linear(d, n + int(noop), bias=False)
        self.experts = nn.ModuleList(MLP(d, ratio) for _ in range(n))
        self.balance: Tensor | None = None  # the last training forward's load-balancing loss

    def forward(self, x: Tensor) -> Tensor:
        flat = x.reshape(-1, x.shape[-1])
        p = F.softmax(self.gate(flat).float(), dim=-1)
        n = len(self.experts)
        real = p[:, :n]  # all of p without a no-op expert
        weight, expert = real.max(-1)
        if not self.training:
            # Inference (evaluation, causal mode, decoding): every expert on every token, fixed shapes,
            # each token keeping its own expert's output. A ragged slice's size depends on the other
            # tokens, later ones included, and BLAS rounds a row differently at different row counts:
            # the future would move the past's last bits, and the causal leak check is exact. E× the
            # MLP's work, at inference only; training (what the FLOP count covers) runs one expert per token.
            y = torch.zeros_like(flat)
            for e, mlp in enumerate(self.experts):
                y = torch.where((expert == e).unsqueeze(-1), mlp(flat).to(flat.dtype), y)
            return (y * weight.unsqueeze(-1).to(y.dtype)).view(x.shape)
        order = torch.argsort(expert, stable=True)
        # Counted by comparison, a fixed-size op (bincount's output size depends on the data).
        counts = (expert.unsqueeze(-1) == torch.arange(n, device=expert.device)).sum(0)
        ranked = flat.index_select(0, order)
        dtype = grouped_dtype(flat)
        if dtype is not None:  # bf16: one grouped GEMM per matrix, bounded by offsets on the device
            y = grouped_mlp(ranked, counts, self.experts, MLP.activation, dtype)
        else:
            y = self._per_slice(ranked, counts)
        y = y * weight.index_select(0, order).unsqueeze(-1).to(y.dtype)
        # Back in token order by a gather with the inverse permutation (compiled under deterministic algorithms,
        # Inductor got a scatter here, index_copy_ into an empty_like, wrong: tests/bench/test_compile.py).
        out = y.to(flat.dtype).index_select(0, torch.argsort(order))
        if p.shape[-1] > n:
            real = real / real.sum(-1, keepdim=True)
        self.balance = n * (counts.float() / flat.shape[0] * real.mean(0)).sum()
        return out.view(x.shape)

    def _per_slice(self, ranked: Tensor, counts: Tensor) -> Tensor:
        """Each expert's MLP on its slice of ``ranked`` (rows sorted by expert), the slices sized on the host."""
        sizes = counts.tolist()  # the host read
        for size in sizes:  # what a compiled graph needs to know of these unbacked sizes
            torch._check(size >= 0)
        torch._check(sum(sizes) == ranked.shape[0])
        return torch.cat([mlp(part) for mlp, part in zip(self.experts, ranked.split(sizes))])

    def gate_flops(self, d: int) -> tuple[float, float]:
        """(forward, backward) FLOPs per token of the gate (the experts count as one MLP)."""
        return 2.0 * d * self.gate.out_features, 4.0 * d * self.gate.out_features


@contextmanager
def compile_settings():
    """The context a compiled model trains under (``modbench.run.train``), so that compiling changes its speed
    and nothing else:

    - Dynamo's ``capture_scalar_outputs``: ``TopOneMoE``'s host read of its slice sizes becomes unbacked
      sizes inside the graph instead of a break there (and a recompile for every new split); no other
      variant reads the host, so no other graph changes;
    - Inductor's ``fallback_random``: random ops draw from torch's generator as in eager, so a random
      control (``random``, ``random_gated``, ``random_mlp``) routes the same tokens compiled or not (with
      Inductor's own generator it drew other numbers from the same seed).
    """
    import torch._inductor.config as inductor_config

    with torch._dynamo.config.patch(capture_scalar_outputs=True), inductor_config.patch(fallback_random=True):
        yield


class Block(nn.Module):
    """Pre-norm block; ``delta`` is what it adds to the residual stream.

    The one implementation of the block's arithmetic, for every path: training (``is_causal``
    attention, on the gathered subset for a routed layer), the causal routing mode (an explicit
    boolean ``mask``) and KV-cached decoding (``cache``: the layer's ``modbench.model.decode.
    LayerCache``, passed in as in nanochat, with ``keep``/``rows`` for a routed layer).
    """

    def __init__(self, cfg: ModelConfig, experts: int = 0, noop_expert: bool = False) -> None:
        super().__init__()
        self.cfg = cfg
        self.norm1 = nn.RMSNorm(cfg.width)
        self.attn = Attention(cfg.width, cfg.heads)
        self.norm2 = nn.RMSNorm(cfg.width)
        # A mixture of experts when the variant asks for one (MoDE), else the MLP.
        self.mlp = TopOneMoE(cfg.width, cfg.mlp_ratio, experts, noop_expert) if experts else MLP(cfg.width, cfg.mlp_ratio)

    def attention(self, x: Tensor, cos: Tensor, sin: Tensor, *, mask: Tensor | None = None, cache=None,
                  keep: Tensor | None = None, rows: Tensor | None = None, bound: int | None = None,
                  kv: KVAccess | None = None) -> Tensor:
        """attn(norm1(x)): causal, under an explicit boolean mask, or through a KV cache (``keep``,
        ``rows``, ``bound``: see ``LayerCache.attend``); ``kv``: recursive KV sharing (``KVAccess``)."""
        h = self.norm1(x)
        if cache is not None:
            return cache.attend(self.attn, h, cos, sin, keep=keep, rows=rows, bound=bound)
        if kv is not None:
            return kv.attend(self.attn, h, cos, sin, mask)
        if mask is not None:
            return self.attn.forward_masked(h, cos, sin, mask)
        return self.attn(h, cos, sin)

    def mlp_delta(self, x: Tensor) -> Tensor:
        return self.mlp(self.norm2(x))

    def local_update(self, x: Tensor) -> Tensor:
        """attn(norm1(x)) with each token attending to itself alone (``Attention.alone``): a token-local update."""
        return self.attn.alone(self.norm1(x))

    def delta(self, x: Tensor, cos: Tensor, sin: Tensor, mlp_weight: Tensor | None = None,
              sublayer_weight: Tensor | None = None, **attention: object) -> Tensor:
        """attn + mlp; attn + w·mlp with ``mlp_weight`` w of shape (B, T) (p-MoD's weighting); or, with
        ``sublayer_weight`` w (B, T), w·attn + w·mlp(x + w·attn): each sublayer's update gated in turn (TSA's)."""
        a = self.attention(x, cos, sin, **attention)
        if sublayer_weight is not None:
            a = a * sublayer_weight.unsqueeze(-1).to(a.dtype)
        m = self.mlp_delta(x + a)
        if sublayer_weight is not None:
            m = m * sublayer_weight.unsqueeze(-1).to(m.dtype)
        return a + (m if mlp_weight is None else m * mlp_weight.unsqueeze(-1).to(m.dtype))

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        return x + self.delta(x, cos, sin)


def causal_routing_mask(decide: Tensor) -> Tensor:
    """(B, 1, T, T) bool: key j visible to query i iff j <= i and token j is processed.

    An unprocessed query may have no visible key at all (a fully masked row gives NaN in
    SDPA), so every query also sees itself; the outputs of unprocessed queries are
    discarded by the caller, so this changes nothing that is kept.
    """
    T = decide.shape[-1]
    causal = torch.ones(T, T, dtype=torch.bool, device=decide.device).tril()
    eye = torch.eye(T, dtype=torch.bool, device=decide.device)
    return ((causal & decide.unsqueeze(1)) | eye).unsqueeze(1)


def subset_mask(valid: Tensor | None) -> Tensor | None:
    """(B, 1, k, k) bool for attention among a gathered subset whose slots are not all used:
    key j visible to query i iff j <= i and slot j is valid (every query also sees itself, so
    an unused slot's row is finite; its output is discarded). None (plain causal) when ``valid``
    is None: every slot is used."""
    if valid is None:
        return None
    k = valid.shape[-1]
    causal = torch.ones(k, k, dtype=torch.bool, device=valid.device).tril()
    eye = torch.eye(k, dtype=torch.bool, device=valid.device)
    return ((causal & valid.unsqueeze(1)) | eye).unsqueeze(1)


@dataclass
class LayerOutput:
    x: Tensor
    aux_losses: dict[str, Tensor] = field(default_factory=dict)
    stats: dict[str, Tensor] = field(default_factory=dict)
    processed: Tensor | None = None  # (B, T) bool at a routed layer: what the next routed layer may nest in
    attention: AttentionSummary | None = None  # when the next layer's router reads this layer's attention (amod)
    # What the next routed layer receives instead of ``processed`` from a router that chooses each token's depth
    # at the first routed layer (``mor_token_choice``'s ``DepthAssignment``): that choice, and this step's mix.
    handoff: object | None = None


class RoutedBlock(nn.Module):
    """A block whose router picks the k tokens it processes (scope 'block', 'mlp' or 'attention')."""

    # Recursive KV sharing (``GPT``): the recursion step of this position of the shared block (0: it
    # records its K/V; ≥ 1: it reads step 0's), None without sharing.
    kv_step: int | None = None

    def __init__(self, cfg: ModelConfig, router: Router, capacity: CapacitySchedule, block: Block | None = None) -> None:
        super().__init__()
        # ``block``: a recursive model's shared block (built once, applied at several positions)
        self.block = block if block is not None else Block(cfg, experts=router.mlp_experts, noop_expert=router.mlp_noop_expert)
        router.attach(self.block)  # a router that shares the block's modules binds them (mode_integrated)
        self.router = router
        self.base_capacity = capacity  # after any warm-up
        # How the block's output meets the residual stream (``Mixing``), as the router declares it: read
        # once here (an attribute read per layer on the hot path), applied by ``mix`` on every path.
        self.mixing = router.mixing.check(router.scope, router.variable_count)
        self.capacity = capacity  # at the current training step (GPT.set_step)

    def set_mixing(self, mixing: Mixing) -> None:
        """Use another policy (a test's, or a router's changed by hand), checked as at construction."""
        self.mixing = mixing.check(self.router.scope, self.router.variable_count)

    # The router's scope is read here, and only here: what runs on every token before routing,
    # which part of the block the router gates, and what runs on every token after mixing.
    def pre_route(self, x: Tensor, cos: Tensor, sin: Tensor, **attention: object) -> Tensor:
        """Nothing for scopes "block" and "attention"; attention on every token for scope "mlp" (``mlp_skip``)."""
        if self.router.scope == "mlp":
            return x + self.block.attention(x, cos, sin, **attention)
        return x

    def post_route(self, h: Tensor) -> Tensor:
        """Nothing for scopes "block" and "mlp"; the MLP on every token for scope "attention" (DTRNet,
        arXiv:2509.00925 Fig. 1: the routed tokens' attended stream and the others' locally updated one
        alike). The MLP is token-wise, so this commutes with choosing rows: every path applies it once,
        to what ``mix`` left (``forward``, ``mix_causal``, ``skipped``)."""
        if self.router.scope == "attention":
            return h + self.block.mlp_delta(h)
        return h

    def routed_delta(self, x: Tensor, cos: Tensor, sin: Tensor, weight: Tensor | None = None,
                     **attention: object) -> Tensor:
        """The routed tokens' delta: the whole block, the MLP alone for scope "mlp", attention alone for
        scope "attention" (its MLP is ``post_route``'s). Under a ``Mixing(weight="mlp")`` (p-MoD) the router's
        weight multiplies the MLP output here, under ``Mixing(weight="sublayers")`` (TSA) each sublayer's output
        in turn: ``weight`` (B, n, 1) from the top-k routing, else (causal mode, decoding) the token's own
        ``causal_weight`` (None: unweighted)."""
        if self.router.scope == "mlp":
            return self.block.mlp_delta(x)
        if self.router.scope == "attention":
            return self.block.attention(x, cos, sin, **attention)
        if self.mixing.weight not in ("mlp", "sublayers"):
            return self.block.delta(x, cos, sin, **attention)
        w = self.router.causal_weight(x, None) if weight is None else weight.squeeze(-1)
        if self.mixing.weight == "mlp":
            return self.block.delta(x, cos, sin, mlp_weight=w, **attention)
        return self.block.delta(x, cos, sin, sublayer_weight=w, **attention)

    def mix(self, x: Tensor, xs: Tensor, delta: Tensor, weight: Tensor | None, base: Tensor | None = None, *,
            decide: Tensor | None = None, flat: Tensor | None = None, rows: Tensor | None = None,
            valid: Tensor | None = None, scale: Tensor | None = None) -> Tensor:
        """What the layer leaves in the residual stream, as the router's ``Mixing`` says: the one place a
        routed block's output meets it, for the top-k forward, causal mode and KV-cached decoding.

        A processed token becomes x + w·Δ, x + Δ (weight "none"), x + attn + w·mlp (weight "mlp": ``w``
        was applied inside ``delta``), x + w·attn + w·mlp(x + w·attn) (weight "sublayers": likewise),
        x + w·(x + Δ) (output) or base + w·(x + Δ) (handoff); a skipped one ``skip_value(x)``: x, s·x (skip
        "scale") or x + s·local(x) (skip "local"). ``x``: (B, T, d) the layer's input; ``xs``: (B, n, d) the
        input of the n slots ``delta`` was computed for; ``weight``: (B, n, 1) or None (unweighted);
        ``base``: (B, n, d), with a handoff. Where the slots go: ``decide``
        ((B, T) bool; causal mode and decoding, every token a slot, ``xs`` is ``x``), or the top-k slots'
        ``rows`` of ``flat``, x's (B·T, d) view, with a variable count's ``valid`` slots (unused ones add
        nothing) and a skip rule's ``scale`` (B, T)."""
        m = self.mixing
        if valid is not None:  # a variable count: unused slots' delta is zeroed (rows unchanged)
            delta = delta * valid.unsqueeze(-1).to(xs.dtype)
        if m.output:  # x + w·(x + Δ): the block's output is weighted (mor, released code)
            delta = delta + xs
            if valid is not None:  # unused slots again add nothing (not w·x) to the rows they point at
                delta = delta * valid.unsqueeze(-1).to(delta.dtype)
        if weight is not None and m.weight == "block":
            delta = delta * weight.to(delta.dtype)
        if decide is not None:
            processed = (xs if base is None else base.to(xs.dtype)) + delta
            return torch.where(decide.unsqueeze(-1), processed, self.skip_value(x))
        B, T, d = x.shape
        # Under autocast the delta leaves the linears in bf16 while the residual stream stays fp32.
        delta = delta.reshape(-1, d).to(flat.dtype)
        if m.handoff:  # mor_token_choice: processed slots become base + w·(x + Δ); unused slots stay x
            new = base.reshape(-1, d).to(flat.dtype) + delta
            if valid is not None:
                new = torch.where(valid.reshape(-1, 1), new, xs.reshape(-1, d))
            return flat.index_copy(0, rows, new).view(B, T, d)
        if m.skip != "keep":  # every row starts as a skipped token's value (s·x, x + s·local(x)), then the slots
            every = self.skip_value(x, scale).reshape(B * T, d)
            new = xs.reshape(-1, d) + delta
            if valid is not None:  # a variable count's unused slot leaves its row's skipped value
                new = torch.where(valid.reshape(-1, 1), new, every.index_select(0, rows))
            return every.index_copy(0, rows, new).view(B, T, d)
        return flat.index_add(0, rows, delta).view(B, T, d)

    @staticmethod
    def _scaled(x: Tensor, scale: Tensor) -> Tensor:
        return x * scale.unsqueeze(-1).to(x.dtype)

    def skip_value(self, x: Tensor, scale: Tensor | None = None) -> Tensor:
        """What ``mix`` leaves for a skipped token: x itself (bit for bit) under ``Mixing(skip="keep")``;
        s·x under "scale" (p-MoD's STRing); x + s·local(x) under "local" (DTRNet's bypass: the token's
        attention with itself alone, ``Block.local_update``, weighted by the router's 1 − p). ``scale``: the
        routing's s (B, T), or None: the router's ``skip_scale_of`` its scores of ``x``."""
        if self.mixing.skip == "keep":
            return x
        if scale is None:
            scale = self.router.skip_scale_of(self.router.score(x))
        if self.mixing.skip == "scale":
            return self._scaled(x, scale)
        return x + self._scaled(self.block.local_update(x), scale)

    def skipped(self, x: Tensor) -> Tensor:
        """A skipped token's output of this layer: ``skip_value`` then ``post_route`` (x itself, bit for
        bit, under skip "keep" outside scope "attention"). The decoders write it for the sequences whose
        token the layer skips."""
        return self.post_route(self.skip_value(x))

    def mix_causal(self, x: Tensor, decide: Tensor, delta: Tensor, handoff: object | None = None,
                   rows: Tensor | None = None) -> Tensor:
        """``mix`` where ``decide``, ``skipped(x)`` elsewhere: causal mode and decoding, the weight being the
        router's ``causal_weight``; under a handoff (see ``decide``) its ``weight`` (B, T) and ``base``
        (B, T, d) instead (``rows``: the sequences of the batch that ``x`` holds, when a decode step runs a
        subset)."""
        base = None
        if self.mixing.handoff:
            weight, base = handoff.weight, handoff.base
            if rows is not None:
                weight, base = weight.index_select(0, rows), base.index_select(0, rows)
        else:
            weight = self.router.causal_weight(x, decide) if self.mixing.weight == "block" else None
        weight = None if weight is None else weight.unsqueeze(-1)
        return self.post_route(self.mix(x, x, delta, weight, base, decide=decide))

    def decide(self, x: Tensor, previous: object | None) -> tuple[Tensor, object | None]:
        """The causal decision (B, T) and what the next routed layer receives instead of it (None: the
        decision itself). Under ``Mixing(handoff=True)`` the router's ``assign_causal`` returns both
        (``mor_token_choice``: each token's depth, assigned at the first routed layer, handed on as ``previous``)."""
        if self.mixing.handoff:
            return self.router.assign_causal(x, previous)
        if self.capacity.is_dense and not self.router.variable_count:
            # Top-k at capacity 1 processes every token (mor's first recursion step at capacity 1, as in
            # ``capacities = "1,2/3,1/3"``), so the causal rule does too, whatever the router's predictor says.
            return torch.ones(x.shape[:2], dtype=torch.bool, device=x.device), None
        return self.router.decide_causal_given(x, previous), None

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, previous: Tensor | None = None,
                share: KVShare | None = None) -> LayerOutput:
        B, T, d = x.shape
        x = self.pre_route(x, cos[:T], sin[:T], **kv_access(self.kv_step, share))
        r = self.router.route(x, self.capacity.k(T), previous)
        k = r.index.shape[-1]
        # Flat row ids into the (B·T, d) view: batched gather/scatter, no loop over the batch.
        rows = (r.index + torch.arange(B, device=x.device).unsqueeze(1) * T).reshape(-1)
        flat = x.reshape(B * T, d)
        xs = flat.index_select(0, rows).view(B, k, d)
        pos = r.index.reshape(-1)  # the selected tokens keep the RoPE angles of their own positions
        cs = cos.index_select(0, pos).view(B, 1, k, -1)
        sn = sin.index_select(0, pos).view(B, 1, k, -1)
        kv = kv_access(self.kv_step, share, r.index, r.valid)  # (scope "mlp": its attention was pre_route's)
        # A variable count's unused slots (``r.valid``) are no keys; ``mix`` zeroes their delta.
        delta = self.routed_delta(xs, cs, sn, r.weight, mask=subset_mask(r.valid), **kv)
        out = self.mix(x, xs, delta, r.weight, r.base, flat=flat, rows=rows, valid=r.valid, scale=r.skip_scale)
        out = self.post_route(out)  # (scope "attention": the MLP on every token)
        processed = r.processed(T)
        stats = dict(r.stats, layer_index=r.index, layer_processed=processed) if self.router.collect_stats else r.stats
        aux = r.aux_losses
        if isinstance(self.block.mlp, TopOneMoE) and self.training:
            aux = {**aux, "expert_balance": self.block.mlp.balance}
        return LayerOutput(out, aux, stats, processed, self._exposed(r.index, T), r.handoff)

    def _exposed(self, index: Tensor, seq_len: int) -> AttentionSummary | None:
        """The attention summary of the selected subset, scattered to all positions (0 where skipped)."""
        s = self.block.attn.take_exposed()
        if s is None:
            return None
        zeros = torch.zeros(index.shape[0], seq_len, device=index.device)
        return AttentionSummary(zeros.scatter(1, index, s.self_weight), zeros.scatter(1, index, s.received))

    def attention_tokens(self, seq_len: int) -> int:
        """The tokens this layer's attention runs on (queries, and keys it computes): k, or every token
        for scope "mlp"."""
        k = self.router.tokens_run(self.capacity.k(seq_len), seq_len)
        return seq_len if self.router.scope == "mlp" else k

    def flops(self, seq_len: int, *, causal: bool = True, shared_keys: int | None = None) -> flop_math.LayerFlops:
        """Analytic FLOPs over one sequence: the block at k tokens (the MLP alone at k for scope "mlp";
        attention alone at k and the MLP at every token for scope "attention"), a skip "local" update on
        the tokens it runs on (every token in the batched forward, whose static shapes compute it for all
        and keep it for the skipped; the skipped ones alone when counting as decoding runs,
        ``Router.count_batched_slots`` off), plus the router on all ``seq_len`` tokens. ``shared_keys``: a
        later step under recursive KV sharing, attending to that many keys of step 0 and projecting no K/V."""
        k = self.router.tokens_run(self.capacity.k(seq_len), seq_len)
        attn_tokens = self.attention_tokens(seq_len)
        mlp_tokens = seq_len if self.router.scope == "attention" else k
        local_tokens = 0
        if self.mixing.skip == "local":
            local_tokens = seq_len if self.router.count_batched_slots else seq_len - k
        cfg = self.block.cfg
        mlp = self.block.mlp
        gate = mlp.gate_flops(cfg.width) if isinstance(mlp, TopOneMoE) else (0.0, 0.0)
        return flop_math.block_flops(cfg.width, cfg.mlp_ratio, attn_tokens=attn_tokens, mlp_tokens=mlp_tokens,
                                     causal=causal, router=self.router.scoring_flops(cfg.width), seq_len=seq_len,
                                     mlp_gate=gate, attention_summary=self.block.attn.expose, shared_keys=shared_keys,
                                     local_tokens=local_tokens)

    def forward_causal(self, x: Tensor, cos: Tensor, sin: Tensor, previous: Tensor | None = None,
                       share: KVShare | None = None) -> LayerOutput:
        """Route each token by ``decide_causal`` (its own state), in one masked pass.

        Processed tokens get ``x + causal_weight · delta``; skipped tokens come out
        bit-identical. Every token is computed and the skipped ones discarded: this mode
        measures quality, not speed (decoding with ``modbench.model.decode`` saves the work).
        Under recursive KV sharing step 0's keys are the tokens it processed (``decide``).
        """
        T = x.shape[1]
        cos, sin = cos[:T], sin[:T]
        x = self.pre_route(x, cos, sin, **kv_access(self.kv_step, share))
        decide, handoff = self.decide(x, previous)
        delta = self.routed_delta(x, cos, sin, mask=causal_routing_mask(decide),
                                  **kv_access(self.kv_step, share, valid=decide))
        out = self.mix_causal(x, decide, delta, handoff)
        s = self.block.attn.take_exposed()
        s = None if s is None else AttentionSummary(s.self_weight * decide)  # skipped tokens received nothing
        return LayerOutput(out, {}, {"decide": decide} if self.router.collect_stats else {}, decide, s, handoff)

    def forward_dense(self, x: Tensor, cos: Tensor, sin: Tensor, share: KVShare | None = None) -> LayerOutput:
        """MoD off: a plain block on every token, router and weights ignored."""
        T = x.shape[1]
        return LayerOutput(x + self.block.delta(x, cos[:T], sin[:T], **kv_access(self.kv_step, share)))


class DenseLayer(nn.Module):
    kv_step: int | None = None  # recursive KV sharing: as ``RoutedBlock.kv_step``

    def __init__(self, cfg: ModelConfig, block: Block | None = None) -> None:
        super().__init__()
        self.block = block if block is not None else Block(cfg)  # ``block``: a recursive model's shared block

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, share: KVShare | None = None) -> LayerOutput:
        T = x.shape[1]
        out = x + self.block.delta(x, cos[:T], sin[:T], **kv_access(self.kv_step, share))
        return LayerOutput(out, attention=self.block.attn.take_exposed())

    def attention_tokens(self, seq_len: int) -> int:
        return seq_len

    def flops(self, seq_len: int, *, causal: bool = True, shared_keys: int | None = None) -> flop_math.LayerFlops:
        cfg = self.block.cfg
        mlp = self.block.mlp  # a shared block that a routed position made a mixture of experts (MoDE)
        gate = mlp.gate_flops(cfg.width) if isinstance(mlp, TopOneMoE) else (0.0, 0.0)
        return flop_math.block_flops(cfg.width, cfg.mlp_ratio, attn_tokens=seq_len, mlp_tokens=seq_len, causal=causal,
                                     mlp_gate=gate, attention_summary=self.block.attn.expose, shared_keys=shared_keys)


@dataclass
class ModelOutput:
    logits: Tensor
    loss: Tensor | None  # mean next-byte cross-entropy in nats
    aux_losses: dict[str, Tensor]  # unweighted, summed over routed layers
    stats: list[dict[str, Tensor]]  # per routed layer, when collect_stats is on


# --- the model ----------------------------------------------------------------------------
class GPT(nn.Module):
    def __init__(self, cfg: ModelConfig, routing: RoutingConfig | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.routing = routing or RoutingConfig(variant="dense", capacity=1.0)
        spec = get_variant(self.routing.variant)  # one registry lookup and one config per model
        variant_config = spec.make_config(self.routing.options)
        self.routed_flags = self.routing.routed_layers(cfg.layers)
        if spec.scope == "none" or self.routing.is_dense:
            self.routed_flags = tuple(False for _ in self.routed_flags)
        n_routed = sum(self.routed_flags)

        self.embed = nn.Embedding(cfg.vocab_size, cfg.width)
        # A recursive model (``modbench.model.recursion``): position i of the unrolled stack runs physical
        # block ``sharing[i]``; positions that share it hold the same ``Block`` module, so its parameters
        # are registered (and counted, initialised, optimised) once and its FLOPs counted per application.
        self.sharing = sharing_map(cfg.layers, cfg.recursion, cfg.recursions)
        routers = [spec.builder(cfg.width, variant_config) if routed else None for routed in self.routed_flags] \
            if cfg.recursion != "none" else None
        blocks = self._shared_blocks(cfg, routers) if routers is not None else {}
        layers = []
        for i, routed in enumerate(self.routed_flags):
            block = blocks.get(self.sharing[i])
            if routed:
                router = routers[i] if routers is not None else spec.builder(cfg.width, variant_config)
                # Per-layer capacity (RoutingConfig.capacity_first): the j-th routed layer's own schedule.
                schedule = self.routing.capacity_schedule(cfg.max_seq_len, sum(isinstance(l, RoutedBlock) for l in layers), n_routed)
                layers.append(RoutedBlock(cfg, router, schedule, block))
            else:
                layers.append(DenseLayer(cfg, block))
        self.layers = nn.ModuleList(layers)
        for before, layer in zip(layers, layers[1:]):  # a router that scores by the previous layer's attention (amod)
            if isinstance(layer, RoutedBlock) and layer.router.reads_attention:
                before.block.attn.expose = True
                layer.router.attention_source = True
        self.kv_sources = self._share_kv(cfg, layers)
        routed = [layer.router for layer in layers if isinstance(layer, RoutedBlock)]
        for j, router in enumerate(routed):  # each router learns its place (mor_token_choice, dtrnet, tsa use it)
            router.place(j, len(routed))
        self.norm = nn.RMSNorm(cfg.width)
        self.head = nn.Linear(cfg.width, cfg.vocab_size, bias=False)
        cos, sin = rope_tables(cfg.max_seq_len, cfg.width // cfg.heads, cfg.rope_base)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self._init_weights()

    def _share_kv(self, cfg: ModelConfig, layers: list[nn.Module]) -> tuple[int | None, ...]:
        """Recursive KV sharing (``ModelConfig.kv_sharing``, MoR §2.3): each position of the shared block
        learns its recursion step (``kv_step``); returns, per position, the position whose K/V it reads
        (the same physical layer at step 0), None where it computes its own."""
        if not cfg.kv_sharing:
            return (None,) * len(layers)
        steps = recursion_step(cfg.layers, cfg.recursion, cfg.recursions)
        first = {}  # physical block → its position at step 0
        sources = []
        for i, (layer, step) in enumerate(zip(layers, steps)):
            layer.kv_step = step
            if step == 0:
                first[self.sharing[i]] = i
            if step is not None and layer.block.attn.expose:
                raise ModbenchError(f"model.kv_sharing does not combine with variant {self.routing.variant!r}: its router "
                                    "reads the previous layer's own-key attention, which a shared-KV step does not have; "
                                    "expected kv_sharing = false or another variant")
            sources.append(first[self.sharing[i]] if step else None)
        return tuple(sources)

    def _shared_blocks(self, cfg: ModelConfig, routers: list[Router | None]) -> dict[int, Block]:
        """One ``Block`` per physical block of a recursive model, a mixture of experts when a routed
        position that runs it asks for one (MoDE); built after the routers, in physical order."""
        blocks = {}
        for b in sorted(set(self.sharing)):
            users = [r for r, s in zip(routers, self.sharing) if s == b and r is not None]
            experts = max((r.mlp_experts for r in users), default=0)
            blocks[b] = Block(cfg, experts=experts, noop_expert=any(r.mlp_noop_expert for r in users))
        return blocks

    def router_parameters(self) -> list[nn.Parameter]:
        """Every parameter a router owns, chosen by identity: a router that binds block modules
        (``mode_integrated``'s gate and norm, registered under ``block.`` first) owns them too,
        which a test on the parameter's name would miss."""
        return list({id(p): p for r in self.routers for p in r.parameters()}.values())

    def predictor_parameters(self) -> list[nn.Parameter]:
        """The parameters of the "+aux" routers' decode-time predictors (``Router.enable_aux_decoding``):
        their input is detached, so nothing of the language model depends on them, and the trainer
        clips their gradient on its own (a joint norm would let them rescale the LM's update)."""
        return [p for r in self.routers if r.aux_decoder is not None for p in r.aux_decoder.parameters()]

    def _init_weights(self) -> None:
        # GPT-2 init: N(0, 0.02), residual projections scaled by 1/√(2·n_layer), n_layer the *effective*
        # depth: the scaling counts the residual additions a token's stream receives, one per application
        # of a block, shared or not (``ModelConfig``). A shared block's parameters appear once here.
        owned_by_routers = {id(p) for p in self.router_parameters()}
        for name, p in self.named_parameters():
            if id(p) in owned_by_routers:
                continue  # routers initialise themselves
            if p.dim() == 2:
                std = 0.02 / math.sqrt(2 * self.cfg.layers) if name.endswith("proj.weight") else 0.02
                nn.init.normal_(p, mean=0.0, std=std)

    def set_step(self, step: int) -> None:
        """Training step, for the capacity warm-up (``RoutingConfig.capacity_warmup_steps``) and the
        routers' per-step hook (``Router.set_step``: budget controllers, expert_threshold's threshold)."""
        for layer in self.layers:
            if isinstance(layer, RoutedBlock):
                layer.capacity = layer.base_capacity.warmed(step, self.routing.capacity_warmup_steps)
                layer.router.set_step(step)

    @property
    def routers(self) -> list[Router]:
        return [layer.router for layer in self.layers if isinstance(layer, RoutedBlock)]

    def set_collect_stats(self, on: bool) -> None:
        for r in self.routers:
            r.collect_stats = on

    def forward(self, idx: Tensor, targets: Tensor | None = None, *, routing_mode: str = "topk") -> ModelOutput:
        """Logits (and loss); ``routing_mode`` is "topk" (training), "causal" or "dense"."""
        B, T = idx.shape
        if T > self.cfg.max_seq_len:
            raise ModbenchError(
                f"sequence length {T} exceeds the model's max_seq_len {self.cfg.max_seq_len}: "
                f"use T <= {self.cfg.max_seq_len} or raise model.max_seq_len"
            )
        if routing_mode not in ROUTING_MODES:
            raise ModbenchError(f"routing mode {routing_mode!r} is unknown: expected {accepted(ROUTING_MODES)}")
        x = self.embed(idx)
        aux: dict[str, Tensor] = {}
        stats: list[dict[str, Tensor]] = []
        previous = None  # what the last routed layer processed (nested routing selects within it)
        shares: dict[int, KVShare] = {}  # recursive KV sharing: step 0's K/V, by the position that computed them
        for i, layer in enumerate(self.layers):
            share = self._kv_share(i, shares)
            if not isinstance(layer, RoutedBlock):
                out = layer(x, self.rope_cos, self.rope_sin, share)
            elif routing_mode == "topk":
                out = layer(x, self.rope_cos, self.rope_sin, previous, share)
            elif routing_mode == "causal":
                out = layer.forward_causal(x, self.rope_cos, self.rope_sin, previous, share)
            else:
                out = layer.forward_dense(x, self.rope_cos, self.rope_sin, share)
            x = out.x
            if out.processed is not None:
                previous = out.processed
            if out.attention is not None:  # the next router reads this layer's attention (amod)
                previous = out.attention
            if out.handoff is not None:  # the depths the first routed layer chose (mor_token_choice)
                previous = out.handoff
            for name, value in out.aux_losses.items():
                aux[name] = aux[name] + value if name in aux else value
            if out.stats:
                stats.append(out.stats)
        logits = self.head(self.norm(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(B * T, -1).float(), targets.reshape(-1))
        return ModelOutput(logits, loss, aux, stats)

    def _kv_share(self, i: int, shares: dict[int, KVShare]) -> KVShare | None:
        """Position i's ``KVShare``: a new one at step 0 of the shared block, step 0's at a later step."""
        if self.layers[i].kv_step == 0:
            shares[i] = KVShare()
            return shares[i]
        return None if self.kv_sources[i] is None else shares[self.kv_sources[i]]

    def weighted_aux_loss(self, aux: dict[str, Tensor], step: int) -> Tensor | None:
        """Σ_name weight(name, step) · aux[name]: the one path by which aux losses enter."""
        if not aux:
            return None
        weights = self.routers[0].loss_weights(step)  # incl. an auxiliary decoder's BCE ("+aux")
        total = None
        for name, value in aux.items():
            term = weights.get(name, 0.0) * value
            total = term if total is None else total + term
        return total

    # --- FLOPs ---------------------------------------------------------------------------
    def flop_report(self, seq_len: int, *, causal: bool = True, backward: bool = True) -> flop_math.FlopReport:
        """Analytic FLOPs of one sequence: the sum of every layer's ``flops`` and the head's."""
        layers = (layer.flops(seq_len, causal=causal, shared_keys=None if src is None else
                              self.layers[src].attention_tokens(seq_len))  # recursive KV sharing: step 0's keys
                  for layer, src in zip(self.layers, self.kv_sources))
        head = flop_math.head_flops(self.cfg.width, self.cfg.vocab_size, seq_len)
        return flop_math.FlopReport.from_layers(seq_len, layers, head, backward=backward)

    def flops_per_token(self, seq_len: int, *, causal: bool = True, backward: bool = True) -> float:
        """Analytic training (or forward-only) FLOPs per token at the layers' current capacity;
        see ``modbench.model.flops``."""
        return self.flop_report(seq_len, causal=causal, backward=backward).per_token

    def training_flops_per_token(self, seq_len: int, steps: int) -> float:
        """Σ over training steps 0 … steps−1 of the FLOPs per token at each step's capacity: with a
        capacity warm-up the early steps cost more; without one, steps × ``flops_per_token``."""
        warm = min(steps, self.routing.capacity_warmup_steps)
        final = [layer.capacity for layer in self.layers if isinstance(layer, RoutedBlock)]
        try:
            total = 0.0
            for s in range(warm):
                self.set_step(s)
                total += self.flops_per_token(seq_len)
            self.set_step(1 << 62)
            return total + (steps - warm) * self.flops_per_token(seq_len)
        finally:
            for layer, cap in zip((l for l in self.layers if isinstance(l, RoutedBlock)), final):
                layer.capacity = cap

    def num_params(self) -> int:
        """Parameters, a recursive model's shared block counted once (``parameters()`` deduplicates)."""
        return sum(p.numel() for p in self.parameters())
