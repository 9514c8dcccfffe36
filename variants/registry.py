"""Variant registry, after timm's model registry.

``@register_variant("name", config=Cfg, source="…", provenance=Provenance(…))`` on a builder ``(d_model, config) ->
Router`` makes a variant known; ``list_variants("mod_*")`` filters with shell wildcards;
``get_variant`` fails with the registered names and the closest match. Third-party packages
add variants without forking by exposing a module under the entry-point group
``modbench.variants`` (importing it runs their ``@register_variant``).
"""

from __future__ import annotations

import difflib
import math
import fnmatch
import importlib.metadata
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any

from modbench.errors import ModbenchError, accepted

from .base import Provenance, Router, VariantConfig

ENTRY_POINT_GROUP = "modbench.variants"


@dataclass(frozen=True)
class VariantSpec:
    name: str
    builder: Callable[[int, VariantConfig], Router]
    config_cls: type[VariantConfig]
    source: str
    summary: str
    provenance: Provenance | None = None  # None: a plugin that did not state it

    @property
    def scope(self) -> str:
        """The routers' scope ("block", "mlp" or "none"), from the builder's return annotation
        (every built-in builder has one) or, for an unannotated plugin, from one probe router
        built once under a forked RNG (it must not shift the initialisation)."""
        if self.name not in _SCOPES:
            hints = typing.get_type_hints(self.builder)
            ret = hints.get("return")
            if isinstance(ret, type) and issubclass(ret, Router):
                _SCOPES[self.name] = ret.scope
            else:
                import torch

                with torch.random.fork_rng(devices=[]):
                    _SCOPES[self.name] = self.build(8).scope
        return _SCOPES[self.name]

    def make_config(self, options: Mapping[str, Any] | None = None) -> VariantConfig:
        options = dict(options or {})
        known = {f.name for f in fields(self.config_cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ModbenchError(
                f"variant {self.name!r} has no option {unknown[0]!r}: its options are "
                f"{accepted(sorted(known)) or '(none)'}"
            )
        types = {f.name: f.type for f in fields(self.config_cls)}
        for key, value in options.items():
            _check_option(self.name, key, value, types[key])
        try:
            return self.config_cls(**options)
        except (TypeError, ValueError) as e:
            raise ModbenchError(f"variant {self.name!r}: {e}") from None

    def build(self, d_model: int, options: Mapping[str, Any] | None = None) -> Router:
        return self.builder(d_model, self.make_config(options))


_KINDS = {"bool": (bool,), "int": (int,), "float": (int, float), "str": (str,)}


def _check_option(variant: str, key: str, value: Any, annotation: Any) -> None:
    """A variant option has its field's type (a bool is not a number, a number is finite): the
    frozen configs' own checks compare numbers, and a NaN or a string passes a comparison test."""
    kind = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", "")
    allowed = _KINDS.get(kind)
    if allowed is None:
        return
    if isinstance(value, bool) and kind != "bool" or not isinstance(value, allowed):
        raise ModbenchError(f"variant {variant!r} option {key} = {value!r} has the wrong type: expected {_NAMES[kind]}")
    if kind == "float" and not math.isfinite(value):
        raise ModbenchError(f"variant {variant!r} option {key} = {value!r} is not finite: expected a finite number")


_NAMES = {"bool": "true or false", "int": "an integer", "float": "a number", "str": "a string"}

_REGISTRY: dict[str, VariantSpec] = {}
_SCOPES: dict[str, str] = {}
_plugins_loaded = False


def register_variant(name: str, *, config: type[VariantConfig], source: str, provenance: Provenance | None = None):
    """Decorator registering ``builder(d_model, config) -> Router`` under ``name``; ``provenance``
    says which parts follow the cited source and how the citation was checked (every built-in
    variant states it)."""

    def wrap(builder: Callable[[int, VariantConfig], Router]):
        if name in _REGISTRY and _REGISTRY[name].builder is not builder:
            raise ValueError(f"variant {name!r} is already registered")
        summary = (builder.__doc__ or "").strip().splitlines()[0] if builder.__doc__ else ""
        _REGISTRY[name] = VariantSpec(name, builder, config, source, summary, provenance)
        return builder

    return wrap


def _load_plugins() -> None:
    global _plugins_loaded
    if _plugins_loaded:
        return
    _plugins_loaded = True
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        try:
            ep.load()
        except Exception as e:  # a broken plugin must not hide the built-in variants
            raise ModbenchError(
                f"variant plugin {ep.name!r} ({ep.value}) failed to load: {type(e).__name__}: {e}"
            ) from e


def list_variants(pattern: str = "*") -> list[str]:
    """Registered variant names matching a shell-style wildcard, sorted."""
    _load_plugins()
    return sorted(n for n in _REGISTRY if fnmatch.fnmatchcase(n, pattern))


def get_variant(name: str) -> VariantSpec:
    _load_plugins()
    if name not in _REGISTRY:
        hint = difflib.get_close_matches(name, list(_REGISTRY), n=1)
        suggestion = f" (did you mean {hint[0]!r}?)" if hint else ""
        raise ModbenchError(
            f"unknown variant {name!r}{suggestion}: registered variants are "
            f"{accepted(sorted(_REGISTRY))}"
        )
    return _REGISTRY[name]


def build_router(name: str, d_model: int, options: Mapping[str, Any] | None = None) -> Router:
    return get_variant(name).build(d_model, options)
