"""``modbench generate``: sample from a trained model with a routed KV cache.

``--run`` is a checkpoint file (``runs/<run name>/checkpoint.pt``, written by ``modbench
train``) or an MLflow run id: its checkpoint artifact is fetched from ``--tracking-uri``. The prompt is prefilled and new bytes are sampled one at a time with
causal routing (``modbench.model.decode``); the same weights are then timed with routing off
(every token through every layer) for the tokens/s comparison.
"""

from __future__ import annotations

import json
import re
import sys
from contextlib import contextmanager
from pathlib import Path

from modbench.cli.common import add_tracking_flag, tracking_uri_of
from modbench.config.help import DEVICES
from modbench.errors import ModbenchError

RUN_ID = re.compile(r"[0-9a-f]{32}")


def _temperature(text: str) -> float:
    import argparse
    import math

    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a temperature: expected a finite number >= 0")
    return value


def resolve_checkpoint(run: str, tracking_uri: str) -> Path:
    """A checkpoint path from ``--run``: a file path, or an MLflow run id in ``tracking_uri``."""
    path = Path(run)
    if path.is_dir() and (path / "checkpoint.pt").is_file():  # a run directory
        path = path / "checkpoint.pt"
    if path.is_file():
        return path
    if not RUN_ID.fullmatch(run):
        raise ModbenchError(f"--run {run!r}: no checkpoint file there, and it is not an MLflow run id (32 hex digits)")
    from modbench.track.records import fetch_checkpoint, read_record
    from modbench.track.store import sqlite_db_path

    db = sqlite_db_path(tracking_uri)
    if db is not None and not db.is_file():  # do not create an empty store just to look
        raise ModbenchError(f"--run {run}: no MLflow store at {db} (run from the directory that has mlflow.db, or pass --tracking-uri)")
    return fetch_checkpoint(tracking_uri, read_record(tracking_uri, run))


def load_model(path: Path, device, run_id: str | None = None):
    """The GPT stored in a training checkpoint, in eval mode on ``device``."""
    from modbench.model.restore import model_from_state
    from modbench.track.checkpoint import load_checkpoint

    model, cfg = model_from_state(load_checkpoint(path, run_id=run_id), str(path))
    return model.to(device).eval(), cfg


@contextmanager
def _memory_is_one_line(batch: int, device):
    """The machine's memory running out (a --batch too large for it) as one line, not a traceback."""
    import torch

    try:
        yield
    except (MemoryError, torch.OutOfMemoryError) as e:
        raise ModbenchError(f"--batch {batch} needs more memory than {device} has ({_first_line(e)}); "
                            "pass a smaller --batch or --max-new-tokens") from None
    except RuntimeError as e:  # the CPU allocator says so in a RuntimeError
        if "can't allocate memory" not in str(e) and "not enough memory" not in str(e):
            raise
        raise ModbenchError(f"--batch {batch} needs more memory than {device} has ({_first_line(e)}); "
                            "pass a smaller --batch or --max-new-tokens") from None


def _first_line(e: BaseException) -> str:
    asked = re.search(r"tried to allocate [0-9.]+ ?[KMGT]?i?B(ytes)?", str(e))  # torch names the size it wanted
    if asked:
        return asked.group(0)
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    return (lines[0] if lines else type(e).__name__)[:160]


def run(args) -> int:
    import torch

    from modbench.model.decode import generate
    from modbench.run.train import resolve_device

    if args.max_new_tokens < 1:
        raise ModbenchError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.batch < 1:
        raise ModbenchError(f"--batch must be >= 1, got {args.batch}")
    if args.top_k is not None and args.top_k < 1:
        raise ModbenchError(f"--top-k must be >= 1, got {args.top_k}")
    prompt_bytes = args.prompt.encode("utf-8")
    if not prompt_bytes:
        raise ModbenchError("--prompt is empty: give at least one character")
    device = resolve_device(args.device)
    run_id = args.run if RUN_ID.fullmatch(args.run) and not Path(args.run).exists() else None
    model, cfg = load_model(resolve_checkpoint(args.run, tracking_uri_of(args)), device, run_id)
    if max(prompt_bytes) >= cfg.model.vocab_size:
        raise ModbenchError(f"the prompt has bytes outside the model's vocabulary of {cfg.model.vocab_size}")
    total = len(prompt_bytes) + args.max_new_tokens
    if total > cfg.model.max_seq_len:
        raise ModbenchError(
            f"prompt ({len(prompt_bytes)} bytes) + --max-new-tokens {args.max_new_tokens} = {total} exceeds the "
            f"model's max_seq_len {cfg.model.max_seq_len}"
        )
    temperature = 0.0 if args.greedy else args.temperature
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else None
    kw = dict(temperature=temperature, top_k=args.top_k, seed=args.seed, autocast=autocast)
    with _memory_is_one_line(args.batch, device):
        prompt = torch.tensor(list(prompt_bytes), dtype=torch.long).unsqueeze(0).repeat(args.batch, 1)
        out = generate(model, prompt, args.max_new_tokens, mode="causal", **kw)
        dense = None if args.no_dense else generate(model, prompt, args.max_new_tokens, mode="dense", **kw)
    texts = [bytes(row.tolist()).decode("utf-8", errors="replace") for row in out.new_tokens.cpu()]
    summary = {
        "variant": cfg.routing.variant,
        "new_tokens": args.max_new_tokens,
        "batch": args.batch,
        "tokens_per_s": out.tokens_per_s,
        "dense_tokens_per_s": dense.tokens_per_s if dense else None,
        "skipped_fraction": out.skipped_fraction,
    }
    if args.json:
        print(json.dumps({"prompt": args.prompt, "texts": texts, "new_bytes": out.new_tokens.tolist(), **summary}))
        return 0
    for text in texts:
        sys.stdout.write(args.prompt + text + "\n")
    line = f"{cfg.routing.variant}: {out.new_tokens.numel()} new bytes at {out.tokens_per_s:,.1f} tokens/s"
    if dense:
        line += f" (routing off: {dense.tokens_per_s:,.1f} tokens/s, ×{out.tokens_per_s / max(dense.tokens_per_s, 1e-9):.2f})"
    line += f"; routed-layer token computations skipped: {100 * out.skipped_fraction:.1f}%"
    print(line)
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("generate", help="sample bytes from a trained model with causal routing and a KV cache")
    p.add_argument("--run", required=True, help="checkpoint file (runs/<name>/checkpoint.pt) or MLflow run id")
    p.add_argument("--prompt", required=True, help="text to continue (UTF-8 bytes)")
    p.add_argument("--max-new-tokens", type=int, default=100, help="bytes to generate (default: 100)")
    p.add_argument("--temperature", type=_temperature, default=1.0, help="sampling temperature, a finite number >= 0; 0 is greedy (default: 1)")
    p.add_argument("--top-k", type=int, default=None, help="sample among the k most likely bytes")
    p.add_argument("--greedy", action="store_true", help="always take the most likely byte")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default: 0)")
    p.add_argument("--batch", type=int, default=1, help="sequences sampled in parallel from the prompt (default: 1)")
    p.add_argument("--device", default="auto", choices=DEVICES,
                   help="auto (cuda when available), cpu or cuda; bf16 autocast on cuda, float32 on cpu")
    p.add_argument("--no-dense", action="store_true", help="skip the routing-off timing run")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    add_tracking_flag(p)
    p.set_defaults(func=run)
