"""``modbench variants``: the registered routing variants, their sources, provenance and config fields."""

from __future__ import annotations

import json
from dataclasses import MISSING, fields

from modbench import variants

from modbench.errors import ModbenchError, accepted


# The decode-rule aliases, in one line (they are not registered names: ``variants.decode_aliases``).
AUX_RULE = (f"any fixed-count routed variant + '{variants.AUX_SUFFIX}' (e.g. amod{variants.AUX_SUFFIX}): decode with "
            "Raposo et al. 2024 (arXiv:2404.02258) §3.5's auxiliary predictor (options aux_decode_hidden, "
            "aux_decode_weight; its FLOPs counted)")


def describe_variants(pattern: str = "*") -> list[dict]:
    """The registered variants matching ``pattern``; a pattern naming '+aux' also matches the aliases."""
    rows = []
    names = variants.list_variants(pattern) + (variants.decode_aliases(pattern) if variants.AUX_SUFFIX in pattern else [])
    for name in names:
        spec = variants.get_variant(name)
        cfg_fields = {
            f.name: (f.default if f.default is not MISSING else None) for f in fields(spec.config_cls)
        }
        scope = spec.build(8).scope
        rows.append({"name": name, "scope": scope, "summary": spec.summary, "source": spec.source,
                     "provenance": _provenance(spec.provenance), "config": cfg_fields})
    return rows


def _provenance(p: variants.Provenance | None) -> dict | None:
    """The registry's provenance as plain data (None: a plugin that did not state it)."""
    if p is None:
        return None
    return {"selection": p.selection, "weighting": p.weighting, "decode": p.decode,
            "citations": [{"citation": c, "checked": how} for c, how in p.citations], "text": p.cell()}


def run(args) -> int:
    rows = describe_variants(args.pattern)
    if not rows:
        raise ModbenchError(
            f"no variant matches {args.pattern!r}: registered variants are {accepted(variants.list_variants())}; "
            f"'{variants.AUX_SUFFIX}' variants are {accepted(variants.decode_aliases())}"
        )
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"modbench variants ({len(rows)})", show_lines=True)
    for col in ("variant", "skips", "what it does", "source", "provenance", "config (defaults)"):
        table.add_column(col, overflow="fold")
    for r in rows:
        cfg = "\n".join(f"{k}={v}" for k, v in r["config"].items()) or "-"
        provenance = r["provenance"]["text"] if r["provenance"] else "(not stated)"
        table.add_row(r["name"], r["scope"], r["summary"], r["source"], provenance, cfg)
    console = Console(width=max(Console().width, 140))
    console.print(table)
    console.print(AUX_RULE, markup=False, soft_wrap=True)
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("variants", help="list routing variants with their source and config fields")
    p.add_argument("pattern", nargs="?", default="*", help="shell wildcard, e.g. 'l*'")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=run)
