"""``modbench demo``: a one-minute look at every variant on a tiny model.

For each variant: analytic training FLOPs per token relative to dense, the measured time of
a forward+backward pass relative to dense, and where the first routed layer sends tokens.
"""

from __future__ import annotations

import time

import torch

from modbench import variants

from modbench.config.model import ModelConfig, RoutingConfig
from modbench.config.patterns import FORMS as PATTERN_FORMS
from modbench.model.gpt import GPT


def _step_time(model: GPT, idx: torch.Tensor) -> float:
    t0 = time.perf_counter()
    model(idx, idx).loss.backward()
    return time.perf_counter() - t0


def _time_ratio(model: GPT, dense: GPT, idx: torch.Tensor, repeats: int) -> float:
    """min-of-rounds time of ``model`` over ``dense``, interleaved so load drifts cancel."""
    _step_time(model, idx), _step_time(dense, idx)  # warm-up
    t_model = min(_step_time(model, idx) for _ in range(repeats))
    t_dense = min(_step_time(dense, idx) for _ in range(repeats))
    return t_model / t_dense


def run(args) -> int:
    from rich.console import Console
    from rich.table import Table

    torch.manual_seed(args.seed)
    cfg = ModelConfig(depth=args.depth, max_seq_len=args.seq_len)
    idx = torch.randint(0, 256, (args.batch_size, args.seq_len))
    base = GPT(cfg)
    dense_flops = base.flops_per_token(args.seq_len)
    table = Table(title=f"depth {cfg.layers}, d={cfg.width}, T={args.seq_len}, B={args.batch_size}, "
                        f"C={args.capacity}, pattern={args.pattern}")
    for col in ("variant", "FLOPs/token", "FLOP ratio", "time ratio", "tokens processed in layer 2 (first 64 positions)"):
        table.add_column(col)
    for name in variants.list_variants():
        torch.manual_seed(args.seed)
        m = GPT(cfg, RoutingConfig(name, capacity=args.capacity, pattern=args.pattern))
        f = m.flops_per_token(args.seq_len)
        t = 1.0 if variants.is_baseline(name) else _time_ratio(m, base, idx, args.repeats)
        m.set_collect_stats(True)
        with torch.no_grad():
            out = m(idx[:1])
        picture = "-" * 64
        if out.stats:
            chosen = set(out.stats[0]["layer_processed"][0].nonzero().squeeze(1).tolist())
            picture = "".join("█" if i in chosen else "·" for i in range(64))
        table.add_row(name, f"{f / 1e6:.2f} M", f"{f / dense_flops:.3f}", f"{t:.3f}", picture)
    Console(width=max(Console().width, 140)).print(table)
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("demo", help="compare every variant's FLOPs, speed and routing on a tiny model")
    p.add_argument("--depth", type=int, default=4, help="layers of the tiny model (default: 4)")
    p.add_argument("--seq-len", type=int, default=512, help="tokens per sequence (default: 512)")
    p.add_argument("--batch-size", type=int, default=4, help="sequences per batch (default: 4)")
    p.add_argument("--capacity", type=float, default=0.125, help="share of tokens a routed layer processes, in (0, 1] (default: 0.125)")
    p.add_argument("--pattern", default="alternate", help=f"which layers are routed: {PATTERN_FORMS} (default: alternate)")
    p.add_argument("--repeats", type=int, default=3, help="timed forward passes per variant; the fastest counts (default: 3)")
    p.add_argument("--seed", type=int, default=0, help="initialisation and input seed (default: 0)")
    p.set_defaults(func=run)
