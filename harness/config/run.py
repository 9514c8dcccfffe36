"""The full configuration of one training run: model, routing and training sections.

Defaults < a TOML file (``--config run.toml`` with [model], [routing], [routing.options],
[train]) < command-line flags. Every field of every section is a flag: ``--depth``,
``--variant``, ``--budget`` …, plus ``--option key=value`` for the variant's own fields.
``to_dict`` gives the flat ``section.field`` params logged to MLflow.
"""

from __future__ import annotations

import argparse
import json
import typing
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from modbench import variants

from modbench.config.budget import Budget
from modbench.config.capacity import check_capacity
from modbench.config.model import ModelConfig, RoutingConfig
from modbench.config.io import from_mapping, parse_literal, read_toml
from modbench.data import check_dataset
from modbench.errors import ModbenchError, accepted

DEVICES = ("auto", "cpu", "cuda")


@dataclass(frozen=True)
class TrainConfig:
    dataset: str = "stdlib"
    seq_len: int = 256
    batch_size: int = 16
    grad_accum: int = 1
    budget: str = "flops=1e13"
    lr: float = 1e-3  # at n_embd = 768; scaled by (n_embd/768)^-0.5 when scale_hparams
    weight_decay: float = 0.1  # at depth 12; scaled by (12/depth)^2 when scale_hparams
    scale_hparams: bool = True  # seed 004's depth-based LR / WD scaling
    min_lr_ratio: float = 0.1
    warmup_frac: float = 0.05
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    eval_every: int = 50
    eval_windows: int = 32
    log_every: int = 10
    checkpoint_every: int = 0  # 0: only at the end
    seed: int = 0
    device: str = "auto"
    compile: bool = False
    out_dir: str = "runs"
    experiment: str = "modbench"
    run_name: str = ""
    track: bool = True

    def __post_init__(self) -> None:
        check_dataset(self.dataset)
        Budget.parse(self.budget)
        for name in ("seq_len", "batch_size", "grad_accum", "eval_windows", "log_every", "eval_every"):
            if getattr(self, name) < 1:
                raise ModbenchError(f"train.{name} must be >= 1, got {getattr(self, name)}")
        if self.checkpoint_every < 0:
            raise ModbenchError(f"train.checkpoint_every must be >= 0, got {self.checkpoint_every}")
        if not self.lr > 0:
            raise ModbenchError(f"train.lr must be > 0, got {self.lr}")
        if self.device not in DEVICES:
            raise ModbenchError(f"train.device {self.device!r} is unknown: expected {accepted(DEVICES)}")
        if not 0 <= self.warmup_frac < 1 or not 0 <= self.min_lr_ratio <= 1:
            raise ModbenchError("train.warmup_frac must be in [0, 1) and train.min_lr_ratio in [0, 1]")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    train: TrainConfig = field(default_factory=TrainConfig)

    def __post_init__(self) -> None:
        spec = variants.get_variant(self.routing.variant)
        spec.make_config(self.routing.options)
        check_capacity(self.routing.capacity)
        self.routing.capacity_schedule(self.model.max_seq_len)
        self.routing.routed_layers(self.model.layers)
        if self.train.seq_len > self.model.max_seq_len:
            raise ModbenchError(
                f"train.seq_len {self.train.seq_len} exceeds model.max_seq_len {self.model.max_seq_len}"
            )

    def to_dict(self) -> dict[str, Any]:
        return {f"{s}.{k}": v for s in SECTIONS for k, v in getattr(self, s).to_dict().items()}

    def to_toml_dict(self) -> dict[str, Any]:
        return {"model": asdict(self.model), "routing": asdict(self.routing), "train": asdict(self.train)}

    def to_json(self) -> str:
        return json.dumps(self.to_toml_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str = "config") -> "RunConfig":
        sections = ("model", "routing", "train")
        for key in data:
            if key not in sections:
                raise ModbenchError(f"{where}: unknown section {key!r}; accepted sections are {accepted(sections)}")
        model = from_mapping(ModelConfig, data.get("model", {}), f"{where}: model")
        routing = from_mapping(RoutingConfig, data.get("routing", {}), f"{where}: routing")
        train = from_mapping(TrainConfig, data.get("train", {}), f"{where}: train")
        return cls(model, routing, train)


# --- command-line flags ---------------------------------------------------------------------
SECTIONS = {"model": ModelConfig, "routing": RoutingConfig, "train": TrainConfig}


def add_config_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per config field, all defaulting to None (= not given on the command line)."""
    parser.add_argument("--config", help="TOML file with [model], [routing], [train] sections")
    for section, cls in SECTIONS.items():
        group = parser.add_argument_group(f"{section} (config section [{section}])")
        hints = typing.get_type_hints(cls)
        for f in fields(cls):
            if f.name == "options":
                continue
            flag = "--" + f.name.replace("_", "-")
            tp = hints[f.name]
            if tp is bool:
                group.add_argument(flag, dest=f"{section}.{f.name}", action=argparse.BooleanOptionalAction, default=None)
            else:
                default = f.default if f.default is not MISSING else None
                group.add_argument(flag, dest=f"{section}.{f.name}", default=None, metavar=f.name.upper(),
                                   help=f"default: {default}")
    parser.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                        help="a field of the variant's own config, e.g. --option aux_weight=0.1 (repeatable)")


def config_from_args(args: argparse.Namespace) -> RunConfig:
    base = RunConfig.from_dict(read_toml(args.config), where=args.config) if args.config else None
    data: dict[str, dict[str, Any]] = {s: {} for s in SECTIONS}
    for section, cls in SECTIONS.items():
        hints = typing.get_type_hints(cls)
        for f in fields(cls):
            value = getattr(args, f"{section}.{f.name}", None)
            if value is None:
                continue
            tp = hints[f.name]
            data[section][f.name] = value if tp is str or isinstance(value, bool) else parse_literal(value)
    options = dict(base.routing.options) if base else {}
    for item in args.option:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ModbenchError(f"--option {item!r} is not KEY=VALUE")
        options[key.strip()] = parse_literal(value.strip())
    if options:
        data["routing"]["options"] = options
    sections = {
        s: from_mapping(cls, data[s], f"[{s}] flags", base=getattr(base, s) if base else cls(),
                        label=lambda key: "--" + key.replace("_", "-"))
        for s, cls in SECTIONS.items()
    }
    return RunConfig(**sections)


def save_config(cfg: RunConfig, path: Path) -> None:
    path.write_text(cfg.to_json())
