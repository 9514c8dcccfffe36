"""The full configuration of one training run: model, routing and training sections.

Defaults < a TOML file (``--config run.toml`` with [model], [routing], [routing.options],
[train]) < command-line flags. Every field of every section is a flag: ``--depth``,
``--variant``, ``--budget`` …, plus ``--option key=value`` for the variant's own fields.
``to_dict`` gives the flat ``section.field`` params logged to MLflow.
"""

from __future__ import annotations

import argparse
import json
import re
import typing
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from modbench import variants

from modbench.config.budget import Budget
from modbench.config.model import ModelConfig, RoutingConfig, lr_scale, wd_scale
from modbench.config.help import DEVICES
from modbench.config.help import SECTIONS as FLAG_HELP
from modbench.config.io import bounded, check_bounds, from_mapping, parse_literal, read_toml
from modbench.data import check_dataset
from modbench.errors import ModbenchError, accepted

MAX_NAME = 100
NAME_CHARS = re.compile(r"[A-Za-z0-9 _.=+,:-]*")


@dataclass(frozen=True)
class TrainConfig:
    dataset: str = "stdlib"
    seq_len: int = bounded(256, 1, 1 << 17)
    batch_size: int = bounded(16, 1, 1 << 16)
    grad_accum: int = bounded(1, 1, 4096)
    budget: str = "flops=1e13"
    lr: float = bounded(1e-3, 0.0, 10.0, low_open=True)  # at n_embd = 768; scaled by (n_embd/768)^-0.5 when scale_hparams
    weight_decay: float = bounded(0.1, 0.0, 100.0)  # at depth 12; scaled by (12/depth)^2 when scale_hparams
    scale_hparams: bool = True  # nanochat's depth-based LR / WD scaling (karpathy/nanochat)
    min_lr_ratio: float = bounded(0.1, 0.0, 1.0)
    warmup_frac: float = bounded(0.05, 0.0, 1.0, high_open=True)
    beta1: float = bounded(0.9, 0.0, 1.0, high_open=True)
    beta2: float = bounded(0.95, 0.0, 1.0, high_open=True)
    grad_clip: float = bounded(1.0, 0.0, 1e9, low_open=True)
    eval_every: int = bounded(50, 1, 1 << 40)
    eval_windows: int = bounded(32, 1, 1 << 20)
    system_metrics_s: float = bounded(10.0, 0.0, 3600.0)  # MLflow system-metrics sampling interval (0: off)
    log_every: int = bounded(10, 1, 1 << 40)
    checkpoint_every: int = bounded(0, 0, 1 << 40)  # 0: only at the end
    seed: int = bounded(0, 0, 2**32 - 1)
    device: str = "auto"
    compile: bool = False
    out_dir: str = "runs"
    experiment: str = "modbench"
    run_name: str = ""
    track: bool = True

    def __post_init__(self) -> None:
        # Checks of the values alone: nothing here reads a file or loads a plugin (see load_run).
        check_bounds(self, "train")
        Budget.parse(self.budget)
        if self.device not in DEVICES:
            raise ModbenchError(f"train.device {self.device!r} is unknown: expected {accepted(DEVICES)}")
        for name in ("experiment", "run_name"):
            value = getattr(self, name)
            if len(value) > MAX_NAME or (name == "experiment" and not value.strip()) or not NAME_CHARS.fullmatch(value):
                raise ModbenchError(f"train.{name} = {value[:40]!r} is not accepted: expected "
                                    f"{'a non-empty' if name == 'experiment' else 'a'} name of at most {MAX_NAME} "
                                    "letters, digits, spaces and '-', '_', '.', '=' (no path separators)")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    train: TrainConfig = field(default_factory=TrainConfig)

    def __post_init__(self) -> None:
        self.routing.capacity_schedule(self.model.max_seq_len)  # validates capacity and schedule
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

    def effective_lr(self) -> float:
        """The peak learning rate the optimizer gets: ``train.lr`` is the value at n_embd = 768,
        scaled to this width when ``train.scale_hparams`` (nanochat's rule, ``lr_scale``)."""
        t = self.train
        return t.lr * (lr_scale(self.model.width) if t.scale_hparams else 1.0)

    def effective_weight_decay(self) -> float:
        """The weight decay the optimizer gets: ``train.weight_decay`` is the value at depth 12,
        scaled to this depth when ``train.scale_hparams`` (nanochat's rule, ``wd_scale``)."""
        t = self.train
        return t.weight_decay * (wd_scale(self.model.layers) if t.scale_hparams else 1.0)

    def effective_note(self) -> str:
        """TOML comment lines naming the learning rate and weight decay the run trains with. Why
        comments: ``train.lr`` and ``train.weight_decay`` are the unscaled values (what ``--config``
        reads back); a reader of the file must still see that the run does not train at them."""
        t = self.train
        if not t.scale_hparams:
            return (f"# trains at lr {t.lr:.4g} and weight_decay {t.weight_decay:.4g} as written "
                    "(train.scale_hparams = false)\n")
        return (f"# trains at lr {self.effective_lr():.4g} and weight_decay {self.effective_weight_decay():.4g}: "
                f"train.scale_hparams = true scales train.lr by (768 / n_embd)^0.5 with n_embd {self.model.width} "
                f"and train.weight_decay by (12 / L)^2 with L = {self.model.layers} layers\n")

    def to_toml(self) -> str:
        """The config as a TOML file that ``--config`` reads back to an equal config (``None``
        overrides, which TOML cannot spell, are left out: absent means the same)."""
        import tomli_w

        def drop_none(d: dict) -> dict:
            return {k: drop_none(v) if isinstance(v, dict) else v for k, v in d.items() if v is not None}

        return tomli_w.dumps(drop_none(self.to_toml_dict()))

    def to_annotated_toml(self) -> str:
        """``to_toml`` led by ``effective_note``: what ``--print-config`` shows (comments, so it
        still reads back to an equal config)."""
        return self.effective_note() + self.to_toml()

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
            default = f.default if f.default is not MISSING else None
            text = f"{FLAG_HELP[section][f.name]} (default: {default})"
            if tp is bool:
                group.add_argument(flag, dest=f"{section}.{f.name}", action=argparse.BooleanOptionalAction, default=None,
                                   help=text)
            else:
                group.add_argument(flag, dest=f"{section}.{f.name}", default=None, metavar=f.name.upper(), help=text)
    parser.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                        help="a field of the variant's own config, e.g. --option aux_weight=0.1 (repeatable)")


def load_run(cfg: RunConfig) -> RunConfig:
    """The one loader's last step, for a config that is about to train: the checks that look
    outside the values (the dataset exists, the variant is registered and takes these
    options). Flags, ``--config`` files and study trials all pass through here, once."""
    check_dataset(cfg.train.dataset)
    variants.get_variant(cfg.routing.variant).make_config(cfg.routing.options)
    t = cfg.train
    budget, per_step = Budget.parse(t.budget), t.batch_size * t.seq_len * t.grad_accum
    if budget.kind == "tokens" and budget.amount < per_step:
        raise ModbenchError(f"budget {t.budget!r} is smaller than one training step ({per_step} tokens = batch_size × "
                            "seq_len × grad_accum): raise the budget or shrink the batch")
    return cfg


def config_from_args(args: argparse.Namespace) -> RunConfig:
    """Defaults < ``--config`` file < flags, validated once (``load_run``)."""
    if args.config is not None and not str(args.config).strip():
        raise ModbenchError("--config is empty: give the path of a TOML run config, or leave the flag out")
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
    return load_run(RunConfig(**sections))


def save_config(cfg: RunConfig, path: Path) -> None:
    path.write_text(cfg.to_json())
