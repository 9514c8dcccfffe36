"""``modbench train``: one tracked training run from flags and/or a TOML config.

Under ``torchrun`` every process runs this command; only rank 0 prints (``modbench.run.distributed``).
"""

from __future__ import annotations

import json
import time
from contextlib import nullcontext

from modbench import interrupts
from modbench.run import distributed
from modbench.errors import ModbenchError
from modbench.cli.common import add_tracking_flag, tracking_uri_of
from modbench.config.run import add_config_flags, config_from_args

# How long a rank other than 0 holds back its error (below); torchrun stops it sooner.
RANK_ERROR_GRACE_S = 10.0


def run(args) -> int:
    from modbench.config.model import describe
    from modbench.run.train import train

    main = distributed.is_main()
    try:
        cfg = config_from_args(args)
        if args.print_config:
            if main:
                print(cfg.to_annotated_toml(), end="")
            return 0
        uri = tracking_uri_of(args) if cfg.train.track else None
        if main and not (args.quiet or args.json):  # --json: stdout is the one JSON document
            print(f"modbench train: {describe(cfg.model, cfg.routing)}")
            print(cfg.to_json())
            print(cfg.effective_note().removeprefix("# ").rstrip())  # train.lr is not what it trains at
        # One process: Ctrl-C/SIGTERM stop between two steps (modbench.interrupts). Under
        # torchrun every rank must stop at the same step, which a per-process flag cannot
        # promise, so there the signal interrupts where it lands and torchrun ends the group.
        with nullcontext() if distributed.launched_world_size() > 1 else interrupts.deferred():
            result = train(cfg, tracking_uri=uri, resume=args.resume, progress=not args.quiet)
    except ModbenchError as e:
        if main:
            raise
        # Every rank runs the same flags on the same files (and logs the same all-reduced
        # loss), so nearly always every rank raises the same error: rank 0 prints its one line
        # and ends its MLflow run, and when it exits torchrun stops this rank. Exiting first
        # would make torchrun stop rank 0 before it has done so. Still running after the
        # grace period, the error is this rank's alone: it is printed then, with the rank.
        time.sleep(RANK_ERROR_GRACE_S)
        raise ModbenchError(f"rank {distributed.rank()}: {e}") from None
    if not main:
        return 0
    summary = {
        "run_id": result.run_id,
        "steps": result.steps,
        "tokens": result.tokens,
        **result.record.metrics,  # the record's declared names: val/bpb, val/causal_bpb, test/bpb, perf/...
        "perf/logging_overhead": result.logging_overhead,
        "checkpoint": result.record.checkpoint,
    }
    if args.json or args.quiet:
        print(json.dumps(summary))
    else:
        print(
            f"done: {result.steps} steps, {result.tokens:,} tokens, {result.flops:.3g} FLOPs; "
            f"val {result.val['bpb']:.4f} bpb, test {result.test['bpb']:.4f} bpb; "
            f"{result.tokens_per_s:,.0f} tokens/s; logging overhead {100 * result.logging_overhead:.2f}%"
        )
        if result.run_id:
            print(f"MLflow run {result.run_id} (see it with: modbench ui)")
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("train", help="train one model (FLOP/token/step/time budget), tracked in MLflow")
    add_config_flags(p)
    add_tracking_flag(p)
    p.add_argument("--print-config", action="store_true",
                   help="print the resolved config as TOML (what --config reads back), led by a comment with the "
                        "learning rate and weight decay it trains at, and exit without training")
    p.add_argument("--resume", action="store_true", help="continue from the run's last checkpoint")
    p.add_argument("--quiet", action="store_true", help="no progress bar; print one JSON summary line")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.set_defaults(func=run)
