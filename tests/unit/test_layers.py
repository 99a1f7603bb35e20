"""The import graph: no cycle anywhere in ``src/``, and models never talk to other processes.

The layer contracts themselves are import-linter's (``lint-imports``, pyproject.toml); these are the
rules it cannot state: an acyclic graph of modules, no ``torch.distributed`` in models/, one class per
name in src/, and the axis table (``shardwise.dims``) one class that loads without torch, even
through the config.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import grimp

SRC = Path(__file__).resolve().parents[2] / "src" / "shardwise"


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), i.e. import cycles."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in edges.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def _edges(graph: grimp.ImportGraph) -> dict[str, set[str]]:
    return {m: set(graph.find_modules_directly_imported_by(m)) for m in graph.modules}


def test_no_import_cycle_in_src() -> None:
    # imports under `if TYPE_CHECKING:` never run, so they cannot form a cycle at import time
    graph = grimp.build_graph("shardwise", exclude_type_checking_imports=True, cache_dir=None)
    assert _cycles(_edges(graph)) == []


def test_the_cycle_finder_finds_cycles() -> None:
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e2"}, "e2": set()}
    assert _cycles(edges) == [["a", "b", "c"]]


def _imported(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def test_models_never_import_torch_distributed() -> None:
    offenders = {
        str(path.relative_to(SRC)): sorted(n for n in _imported(path) if n.startswith("torch.distributed"))
        for path in (SRC / "models").rglob("*.py")
    }
    assert {k: v for k, v in offenders.items() if v} == {}


def test_the_axis_table_imports_no_torch() -> None:
    """``shardwise.dims`` (``ParallelDims``) is read by the config, the planner and the mesh: pure."""
    code = "import sys, shardwise.dims, shardwise.config; print([m for m in sys.modules if m == 'torch'])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_one_parallel_dims_class() -> None:
    found = [p for p in SRC.rglob("*.py") if "class ParallelDims" in p.read_text()]
    assert [str(p.relative_to(SRC)) for p in found] == ["dims.py"]


def test_one_name_one_class() -> None:
    """No two classes in src/ share a name (two ``Piece``s once meant a checkpoint's and ZeRO's)."""
    where: dict[str, list[str]] = {}
    for path in SRC.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                where.setdefault(node.name, []).append(str(path.relative_to(SRC)))
    assert {name: files for name, files in where.items() if len(files) > 1} == {}
