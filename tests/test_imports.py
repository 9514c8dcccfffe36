"""The package's import graph: one package, no cycles, data flowing one way.

Every ``import`` in every module of ``modbench`` is read with ``ast`` — function-local and
``TYPE_CHECKING`` imports included, since a cycle hidden in a function is still a cycle — and
resolved to the module it names. The test fails on a cycle between modules, on an edge from a
sub-package to one it may not import (``ALLOWED``, which mirrors the docstrings of the
sub-packages), and on any import of the old top-level names ``harness`` or ``variants``.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SOURCE_DIRS = {"modbench": REPO / "harness", "modbench.variants": REPO / "variants"}

# Which sub-packages each may import (the root ``modbench`` holds only ``__version__``).
ALLOWED: dict[str, set[str]] = {
    "errors": set(),
    "progress": set(),
    "interrupts": set(),
    "results": {"errors"},
    "variants": {"errors"},
    "data": {"errors", "progress"},  # a download's progress bar
    "config": {"errors", "results", "variants", "data"},
    "model": {"errors", "config", "variants"},
    "track": {"errors", "results", "config"},
    "design": {"errors", "results", "config", "data", "variants", "model"},
    "run": {"errors", "results", "config", "data", "variants", "model", "track", "progress", "interrupts"},
    "bench": {"errors", "config", "variants", "model", "track"},  # track.provenance: the commit a table was measured at
    "report": {"errors", "results", "config", "data", "variants", "model", "track", "design"},
    "study": {"errors", "results", "config", "data", "model", "run", "track", "progress", "interrupts", "report", "design"},
    "cli": {"errors", "results", "config", "data", "variants", "model", "track", "run", "bench", "report", "study", "progress",
            "design",
            "interrupts"},
}


def module_files() -> dict[str, Path]:
    """modbench.* module name → file, from the package-dir mapping."""
    mods: dict[str, Path] = {}
    for package, root in SOURCE_DIRS.items():
        for path in root.rglob("*.py"):
            rel = path.relative_to(root).with_suffix("").parts
            if rel[-1] == "__init__":
                rel = rel[:-1]
            name = ".".join((package, *rel))
            if package == "modbench" and rel[:1] == ("variants",):
                continue
            mods[name] = path
    return mods


def imported_names(module: str, path: Path) -> list[str]:
    """Absolute names of everything a module imports (each a module or a name in one)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    is_pkg = path.name == "__init__.py"
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")
                base = base[: len(base) - node.level + (1 if is_pkg else 0)]
                prefix = ".".join(base + ([node.module] if node.module else []))
            else:
                prefix = node.module or ""
            names += [f"{prefix}.{a.name}" for a in node.names]
    return names


def import_graph() -> dict[str, set[str]]:
    mods = module_files()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for module, path in mods.items():
        for name in imported_names(module, path):
            # 'from a.b import c': the module a.b.c if it exists, else a.b (or its nearest parent).
            target = name
            while target and target not in mods:
                target = target.rpartition(".")[0]
            if target and target != module:
                graph[module].add(target)
    return graph


def component(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_every_module_is_mapped_to_a_known_subpackage():
    unknown = {m for m in module_files() if component(m) and component(m) not in ALLOWED}
    unknown -= {"modbench.studies"}
    assert not unknown, f"modules outside the layered sub-packages: {sorted(unknown)}"


def test_the_allowed_table_is_itself_one_way():
    assert find_cycle({k: set(v) for k, v in ALLOWED.items()}) is None


def test_no_import_cycle_between_modules():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_no_upward_or_sideways_edge_between_subpackages():
    bad = []
    for module, targets in import_graph().items():
        src = component(module)
        for target in targets:
            dst = component(target)
            if src and dst and src != dst and dst not in ALLOWED[src]:
                bad.append(f"{module} -> {target}")
    assert not bad, "imports against the data flow:\n" + "\n".join(sorted(bad))


def test_no_module_imports_the_old_top_level_names():
    offenders = [
        f"{m}: {name}"
        for m, path in module_files().items()
        for name in imported_names(m, path)
        if name.split(".")[0] in {"harness", "variants"}
    ]
    assert not offenders, offenders


def test_import_graph_sees_function_local_imports(tmp_path):
    """The reader must count an import inside a function (the old cycles hid there)."""
    src = tmp_path / "m.py"
    src.write_text("def f():\n    from modbench.run import train\n")
    assert "modbench.run.train" in imported_names("modbench.model.x", src)


@pytest.mark.parametrize("name", ["harness", "variants"])
def test_old_top_level_packages_are_not_installed(tmp_path, name):
    """Outside the checkout only ``modbench`` is importable."""
    code = f"import importlib.util, sys; sys.exit(importlib.util.find_spec({name!r}) is not None)"
    assert subprocess.run([sys.executable, "-c", code], cwd=tmp_path).returncode == 0
    ok = subprocess.run([sys.executable, "-c", "import modbench.variants, modbench.cli.main"], cwd=tmp_path)
    assert ok.returncode == 0
