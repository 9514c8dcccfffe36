"""Variant registry, after timm's model registry.

``@register_variant("name", config=Cfg, source="…", provenance=Provenance(…))`` on a builder ``(d_model, config) ->
Router`` makes a variant known, and so does ``register_variant("name", MyRouter, config=Cfg, …)`` for a router
class constructed as ``MyRouter(d_model, config)``: the class is the builder, with no function to write;
``list_variants("mod_*")`` filters with shell wildcards;
``get_variant`` fails with the registered names and the closest match. Each variant has a role
(timm's metadata on the entry): ``baseline`` (``dense``: no routing), ``learned`` (a router) or
``control`` (a random router, ``control_of`` the learned variant with its gate and scope), so no
caller names names: ``is_baseline``, ``baseline_variant``, ``random_controls``. Third-party packages
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
from dataclasses import dataclass, field, fields, make_dataclass
from typing import Any

from modbench.errors import ModbenchError, accepted

from .base import Provenance, Router, VariantConfig, check_nonnegative

ENTRY_POINT_GROUP = "modbench.variants"
ROLES = ("baseline", "learned", "control")


@dataclass(frozen=True)
class VariantSpec:
    name: str
    builder: Callable[[int, VariantConfig], Router]
    config_cls: type[VariantConfig]
    source: str
    summary: str
    provenance: Provenance | None = None  # None: a plugin that did not state it
    role: str = "learned"  # one of ROLES
    control_of: str = ""  # a control: the learned variant whose selection it randomises (same gate, same scope)

    @property
    def scope(self) -> str:
        """The routers' scope ("block", "mlp" or "none"), from the router class (``_router_class``:
        every built-in variant names it) or, for an unannotated plugin, from one probe router
        built once under a forked RNG (it must not shift the initialisation)."""
        if self.name not in _SCOPES:
            ret = _router_class(self.builder)
            if ret is not None:
                _SCOPES[self.name] = ret.scope
            else:
                _SCOPES[self.name] = _probe_router(self).scope
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


def _router_class(builder: Callable[[int, VariantConfig], Router]) -> type[Router] | None:
    """The class of the routers ``builder`` builds where it says so: the builder itself (a ``Router``
    subclass) or its return annotation; None otherwise."""
    ret = builder if isinstance(builder, type) else typing.get_type_hints(builder).get("return")
    return ret if isinstance(ret, type) and issubclass(ret, Router) else None


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


def register_variant(name: str, builder: Callable[[int, VariantConfig], Router] | None = None, *,
                     config: type[VariantConfig], source: str, provenance: Provenance | None = None,
                     role: str = "learned", control_of: str = ""):
    """Register ``builder(d_model, config) -> Router`` under ``name``: a function, or a ``Router``
    subclass whose constructor takes ``(d_model, config)``; the first line of its docstring is the
    variant's summary. Without ``builder``, a decorator that registers what it decorates.
    ``provenance`` says which parts follow the cited source and how the citation was checked
    (every built-in variant states it). ``role``: "learned" (a router), "baseline" (no routing) or
    "control" (``control_of``: the learned variant it controls)."""
    if role not in ROLES:
        raise ValueError(f"variant {name!r}: role must be one of {ROLES}, got {role!r}")
    if bool(control_of) != (role == "control"):
        raise ValueError(f"variant {name!r}: a control names the variant it controls (control_of), nothing else does")

    def wrap(builder: Callable[[int, VariantConfig], Router]):
        if name in _REGISTRY and _REGISTRY[name].builder is not builder:
            raise ValueError(f"variant {name!r} is already registered")
        summary = (builder.__doc__ or "").strip().splitlines()[0] if builder.__doc__ else ""
        _REGISTRY[name] = VariantSpec(name, builder, config, source, summary, provenance, role, control_of)
        return builder

    return wrap if builder is None else wrap(builder)


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


def baseline_variant() -> str:
    """The registered baseline (role "baseline"): the model every routed arm is compared with."""
    _load_plugins()
    found = [s.name for s in _REGISTRY.values() if s.role == "baseline"]
    if len(found) != 1:
        raise ModbenchError(f"expected one baseline variant, found {accepted(found) or 'none'}")
    return found[0]


def is_baseline(name: str) -> bool:
    """Whether ``name`` is the baseline (no routing); an unknown name is not."""
    _load_plugins()
    spec = _REGISTRY.get(name)
    return spec is not None and spec.role == "baseline"


def random_controls() -> dict[str, str]:
    """{learned variant: its random control} (role "control", ``control_of``)."""
    _load_plugins()
    return {s.control_of: s.name for s in _REGISTRY.values() if s.role == "control"}


def get_variant(name: str) -> VariantSpec:
    """A registered variant's spec, or the derived spec of a "<name>+aux" alias (``decode_aliases``)."""
    _load_plugins()
    if isinstance(name, str) and name.endswith(AUX_SUFFIX) and name not in _REGISTRY:
        return _aux_alias(name)
    if name not in _REGISTRY:
        hint = difflib.get_close_matches(name, list(_REGISTRY), n=1)
        suggestion = f" (did you mean {hint[0]!r}?)" if hint else ""
        raise ModbenchError(
            f"unknown variant {name!r}{suggestion}: registered variants are "
            f"{accepted(sorted(_REGISTRY))}"
        )
    return _REGISTRY[name]


# --- decode-rule aliases: "<name>+aux" ---------------------------------------------------
AUX_SUFFIX = "+aux"
AUX_CITATION = "Raposo et al. 2024 (arXiv:2404.02258) §3.5"
# Variants whose own causal rule already is an auxiliary predictor on the detached state: "+aux" would
# only swap one predictor for another of the same method.
_OWN_AUX_PREDICTOR = {"linear_softmax": "already decodes with that auxiliary predictor"}
# Options that contradict "+aux" (variant: {option: (refused value, why)}): mor's sampling="aux_router"
# trains a second detached predictor that decoding would then never read.
_AUX_REFUSED_OPTIONS = {"mor": {"sampling": ("aux_router", "'+aux' replaces that detached router; keep sampling='aux_loss'")}}
_ALIASES: dict[str, VariantSpec] = {}
_ROUTER_KINDS: dict[str, tuple[str, bool, bool]] = {}


def _router_kind(spec: VariantSpec) -> tuple[str, bool, bool]:
    """(scope, variable_count, soft_gate) of a registered variant's routers, as ``VariantSpec.scope`` finds them."""
    if spec.name not in _ROUTER_KINDS:
        ret = _router_class(spec.builder)
        if ret is None:
            ret = type(_probe_router(spec))
        _ROUTER_KINDS[spec.name] = (spec.scope, bool(ret.variable_count), bool(ret.soft_gate))
    return _ROUTER_KINDS[spec.name]


def _refusal(name: str) -> str | None:
    """Why the registered variant ``name`` has no "+aux" alias, or None when it has one."""
    if name in _OWN_AUX_PREDICTOR:
        return _OWN_AUX_PREDICTOR[name]
    scope, variable, soft = _router_kind(_REGISTRY[name])
    if scope == "none":
        return "routes nothing"
    if soft:
        return "is a soft gate (it trains on every token, so top-k membership, what the predictor learns, is every token)"
    if variable:
        return "routes a variable count (each token decides for itself: its causal rule is its training rule)"
    return None


def decode_aliases(pattern: str = "*") -> list[str]:
    """The "<name>+aux" names (decoding by Raposo et al. 2024 §3.5's auxiliary predictor) of every
    registered fixed-count routed variant, matching a shell-style wildcard, sorted. ``list_variants``
    stays the registered names."""
    return sorted(a for a in (f"{n}{AUX_SUFFIX}" for n in list_variants() if _refusal(n) is None)
                  if fnmatch.fnmatchcase(a, pattern))


def _aux_alias(name: str) -> VariantSpec:
    """The derived spec of "<base>+aux" (built once, then cached)."""
    base_name = name[: -len(AUX_SUFFIX)]
    if name in _ALIASES:
        return _ALIASES[name]
    if base_name not in _REGISTRY or _refusal(base_name) is not None:
        what = f"unknown variant {name!r}: {base_name!r} is not a registered variant" if base_name not in _REGISTRY \
            else f"variant {name!r} is refused: {base_name!r} {_refusal(base_name)}"
        raise ModbenchError(f"{what}; '{AUX_SUFFIX}' variants are {accepted(decode_aliases())}")
    base = _REGISTRY[base_name]
    config_cls = _aux_config(base)

    def build(d_model: int, config: VariantConfig) -> Router:
        router = base.builder(d_model, config)  # first: the base router's initialisation is the base variant's
        router.enable_aux_decoding(d_model, config.aux_decode_hidden, config.aux_decode_weight)
        return router

    p = base.provenance
    provenance = None if p is None else Provenance(p.selection, p.weighting, "paper's recipe",
                                                   p.citations + ((AUX_CITATION, "secondary"),))
    spec = VariantSpec(name, build, config_cls, f"{base.source}; decoded by {AUX_CITATION}'s auxiliary predictor",
                       f"{base.summary.rstrip('.')}; decode: auxiliary MLP predictor (logit at its calibrated C-quantile)", provenance)
    _SCOPES[name] = base.scope
    _ALIASES[name] = spec
    return spec


def _aux_config(base: VariantSpec) -> type[VariantConfig]:
    """The base variant's config plus the predictor's two options, frozen and validated."""
    refused = _AUX_REFUSED_OPTIONS.get(base.name, {})

    def __post_init__(self) -> None:
        if hasattr(base.config_cls, "__post_init__"):
            base.config_cls.__post_init__(self)
        if self.aux_decode_hidden < 0:
            raise ValueError(f"aux_decode_hidden must be >= 0 (0: d_model // 2), got {self.aux_decode_hidden}")
        check_nonnegative(self, "aux_decode_weight")
        for option, (value, why) in refused.items():
            if getattr(self, option) == value:
                raise ValueError(f"{option}={value!r} is refused with '{AUX_SUFFIX}': {why}")

    return make_dataclass(
        f"{base.config_cls.__name__}AuxDecoding",
        [("aux_decode_hidden", int, field(default=0)),  # hidden width of the predictor; 0 means d_model // 2
         ("aux_decode_weight", float, field(default=1.0))],  # its BCE trains only the predictor (input detached)
        bases=(base.config_cls,), frozen=True, namespace={"__post_init__": __post_init__, "__module__": __name__})


def static_decode_refusal(name: str) -> str:
    """Why variant ``name`` (a "+aux" alias included) cannot decode with the static, sync-free step
    (``modbench.model.static_decode``), or "" when it can: its routers' ``Router.static_decode_refusal``
    (the router class's, or for an unannotated builder one probe router's, built under a forked RNG)."""
    spec = get_variant(name)
    ret = _router_class(spec.builder)
    if ret is None:
        return _probe_router(spec).static_decode_refusal
    return ret.static_decode_refusal


def training_host_read(name: str) -> str:
    """Why variant ``name``'s training forward reads the device on the host (``Router.training_host_read``:
    not sync-free, though it compiles to one graph), or "" when it does not; read from one probe router with
    the variant's default options (``_probe_router``)."""
    return _probe_router(get_variant(name)).training_host_read


def _probe_router(spec: VariantSpec) -> Router:
    """One router of ``spec`` with its default options, to read what only an instance says: built under a forked
    RNG, so that probing never shifts a model's initialisation."""
    import torch

    with torch.random.fork_rng(devices=[]):
        return spec.build(8)


def build_router(name: str, d_model: int, options: Mapping[str, Any] | None = None) -> Router:
    return get_variant(name).build(d_model, options)
