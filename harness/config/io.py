"""Validated construction of the frozen config dataclasses from TOML tables and CLI flags.

One path for every config: ``from_mapping(cls, table, where)`` checks keys against the
dataclass fields and values against their annotated types, and raises a one-line
``ModbenchError`` naming where the value came from (file and key), what was wrong and what is
accepted.

Why not pydantic (installed with MLflow): its ``ValidationError`` lists every failing field over
several lines in its own vocabulary ("Input should be a valid integer"), while a modbench refusal
is one line that names the flag or the file and key the value came from and the accepted values
(the CLI's exit-2 contract, tested in tests/test_cli_errors.py and tests/test_fuzz_cli.py); and the
configs stay plain frozen dataclasses from which the CLI flags, ``--print-config`` TOML and the
study files' tables are derived. Translating pydantic's errors into those lines would keep most of
this module and add a dependency on the validation library MLflow happens to pin. What is hand-
written here is the small part no library gives in that form: the type check against annotations
(``coerce``) and the bounds (``bounded``).
"""

from __future__ import annotations

import math
import tomllib
import typing
from collections.abc import Callable, Mapping
from dataclasses import field, fields
from pathlib import Path
from typing import Any

from modbench.errors import ModbenchError, accepted


def _type_name(tp: Any) -> str:
    names = {int: "an integer", float: "a number", str: "a string", bool: "true or false", dict: "a table"}
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if args:
        return " or ".join(names.get(a, getattr(a, "__name__", str(a))) for a in args)
    return names.get(tp, getattr(tp, "__name__", str(tp)))


def coerce(value: Any, tp: Any, where: str) -> Any:
    """Check ``value`` against annotation ``tp`` (int, float, str, bool, dict, X | None)."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        options = typing.get_args(tp)
        if value is None and type(None) in options:
            return None
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return coerce(value, option, where)
            except ModbenchError as e:
                errors.append(e)
        raise ModbenchError(f"{where} = {value!r} has the wrong type: expected {_type_name(tp)}")
    if origin is dict or tp is dict:
        if not isinstance(value, Mapping):
            raise ModbenchError(f"{where} = {value!r} has the wrong type: expected a table")
        return dict(value)
    ok = {
        bool: isinstance(value, bool),
        int: isinstance(value, int) and not isinstance(value, bool),
        float: isinstance(value, (int, float)) and not isinstance(value, bool),
        str: isinstance(value, str),
    }.get(tp)
    if ok is None:
        return value
    if not ok:
        raise ModbenchError(f"{where} = {value!r} has the wrong type: expected {_type_name(tp)}")
    if tp is float:
        value = float(value)
        if math.isnan(value):
            raise ModbenchError(f"{where} is NaN: expected a number")
    return value


def from_mapping(cls: type, table: Mapping[str, Any], where: str, base: Any = None,
                 label: Callable[[str], str] | None = None) -> Any:
    """Build ``cls`` from ``table`` over ``base`` (an instance whose values are the defaults).

    ``label`` names a key in messages (``train.lr`` for a file, ``--lr`` for a flag).
    """
    label = label or (lambda key: f"{where}.{key}")
    hints = typing.get_type_hints(cls)
    known = [f.name for f in fields(cls) if f.init]
    if not isinstance(table, Mapping):
        raise ModbenchError(f"{where} must be a table, got {type(table).__name__}")
    for key in table:
        if key not in known:
            raise ModbenchError(f"{where}: unknown key {key!r}; accepted keys are {accepted(known)}")
    values = {f: getattr(base, f) for f in known} if base is not None else {}
    for key, value in table.items():
        values[key] = coerce(value, hints[key], label(key))
    try:
        return cls(**values)
    except ModbenchError as e:
        raise ModbenchError(f"{where}: {e}") from None
    except (TypeError, ValueError) as e:
        raise ModbenchError(f"{where}: {e}") from None


def bounded(default: Any, low: float, high: float, *, low_open: bool = False, high_open: bool = False):
    """A dataclass field with its accepted range: the one place a bound is written.

    ``check_bounds`` enforces it on every instance; the message names the field and the range.
    """
    return field(default=default, metadata={"range": (low, high, low_open, high_open)})


def _range_text(tp: Any, low: float, high: float, low_open: bool, high_open: bool) -> str:
    integer = tp is int or int in typing.get_args(tp)
    show = (lambda v: str(int(v))) if integer else (lambda v: f"{v:g}")
    kind = "an integer" if integer else "a number"
    return f"{kind} in {'(' if low_open else '['}{show(low)}, {show(high)}{')' if high_open else ']'}"


def check_bounds(instance: Any, section: str) -> None:
    """Every field with a ``bounded`` range lies in it (None passes for optional overrides)."""
    hints = typing.get_type_hints(type(instance))
    for f in fields(instance):
        if "range" not in f.metadata:
            continue
        value = getattr(instance, f.name)
        if value is None:
            continue
        low, high, low_open, high_open = f.metadata["range"]
        below = value <= low if low_open else value < low
        above = value >= high if high_open else value > high
        if below or above or (isinstance(value, float) and math.isnan(value)):
            raise ModbenchError(f"{section}.{f.name} = {value!r} is out of range: expected "
                                f"{_range_text(hints[f.name], low, high, low_open, high_open)}")


def read_toml(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise ModbenchError(f"config file {str(p)!r} does not exist")
    try:
        return tomllib.loads(p.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as e:
        raise ModbenchError(f"{p}: not valid TOML ({e})") from None
    except UnicodeDecodeError:
        raise ModbenchError(f"{p}: not a UTF-8 text file") from None
    except OSError as e:  # a file the user may not read, a folder, a disk error: the environment, one line
        raise ModbenchError(f"cannot read {p}: {e.strerror or e}") from None


def parse_literal(text: str) -> Any:
    """A CLI value as TOML would read it (numbers, booleans, strings without quotes)."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text
