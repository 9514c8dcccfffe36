"""Which layers are routed, as a short validated string (after nanochat's "SSSL").

    alternate     D M D M …  (Raposo et al. 2024 §3.4: routing every other block)
    fixed:S,E     first S and last E layers dense, all others routed (the nanochat fork's MoD: fixed:5,1)
    every:K       every K-th layer routed: every:3 → D D M D D M …
    all           every layer routed
    DDM           an explicit string of D (dense) and M (MoD), tiled to the depth
"""

from __future__ import annotations

import re

from modbench.errors import ModbenchError

FORMS = "'alternate', 'all', 'fixed:S,E', 'every:K' or a string of D/M such as 'DDM'"


def _bad(spec: str, why: str) -> ModbenchError:
    return ModbenchError(f"layer pattern {spec!r} {why}: expected {FORMS}")


def parse_pattern(spec: str, n_layer: int) -> tuple[bool, ...]:
    """Per-layer flags, True where the layer is routed."""
    if not isinstance(spec, str) or not spec.strip():
        raise _bad(str(spec), "is empty")
    s = spec.strip()
    if s == "alternate":
        flags = [i % 2 == 1 for i in range(n_layer)]
    elif s == "all":
        flags = [True] * n_layer
    elif m := re.fullmatch(r"fixed:(\d+),(\d+)", s):
        start, end = int(m[1]), int(m[2])
        flags = [start <= i < n_layer - end for i in range(n_layer)]
        if not any(flags):
            raise _bad(spec, f"leaves no routed layer in a {n_layer}-layer model (needs S+E < {n_layer})")
    elif m := re.fullmatch(r"every:(\d+)", s):
        k = int(m[1])
        if k < 1:
            raise _bad(spec, "needs K >= 1")
        flags = [(i + 1) % k == 0 for i in range(n_layer)]
    elif re.fullmatch(r"[DM]+", s):
        flags = [s[i % len(s)] == "M" for i in range(n_layer)]
    else:
        raise _bad(spec, "is not understood")
    return tuple(flags)


def pattern_string(flags: tuple[bool, ...]) -> str:
    """The resolved pattern as D/M characters, for logs."""
    return "".join("M" if f else "D" for f in flags)
