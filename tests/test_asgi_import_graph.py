"""asgi/ has no import circles: every module imports on its own, and the graph of its relative imports is acyclic.

Imports inside functions count (they are how circles hid before); imports
under `if TYPE_CHECKING:` do not (they never run).
"""

from __future__ import annotations

import ast
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import otel_lock.asgi

from _docs_runner import Forks

ROOT = Path(otel_lock.asgi.__file__).parent
PACKAGE = "otel_lock.asgi"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join([PACKAGE, *parts])


MODULES = {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _runtime_imports(tree: ast.AST) -> list[ast.ImportFrom]:
    """Relative imports that run (module level and inside functions), not those under TYPE_CHECKING."""
    found: list[ast.ImportFrom] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.ImportFrom) and node.level:
            found.append(node)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def _edges(name: str, path: Path) -> set[str]:
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in _runtime_imports(ast.parse(path.read_text(encoding="utf-8"))):
        base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
        target = f"{base}.{node.module}" if node.module else base
        # `from . import _x` names a submodule; `from ._x import y` the module itself.
        candidates = [f"{target}.{a.name}" for a in node.names] if not node.module else [target]
        out.update(c for c in candidates if c in MODULES and c != name)
    return out


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def walk(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt):], nxt]
            if nxt not in state and (found := walk(nxt)) is not None:
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := walk(node)) is not None:
            return found
    return None


def test_the_relative_import_graph_of_asgi_has_no_cycle() -> None:
    graph = {name: _edges(name, path) for name, path in MODULES.items()}
    assert sum(len(v) for v in graph.values()) > 20   # the parser sees the imports at all
    assert _cycle(graph) is None, " -> ".join(_cycle(graph) or [])


def test_the_cycle_finder_finds_one() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


@pytest.fixture(scope="module")
def import_alone() -> Iterator[Callable[[str], tuple[int | None, str]]]:
    """`import_alone(module)`: (exit status, output) of importing it in a fork of the docs runner, which
    has the third-party packages loaded and no otel_lock module, as a fresh interpreter has none."""
    forks = Forks()

    def run(module: str) -> tuple[int | None, str]:
        return forks.run({"path": "<import>", "line": 0, "source": f"import {module}\n", "port": 0}, 60)

    try:
        yield run
    finally:
        forks.close()


@pytest.mark.parametrize("module", sorted(MODULES))
def test_each_asgi_module_imports_with_no_other_otel_lock_module_loaded(module: str, import_alone) -> None:
    assert import_alone(module) == (0, "")


def test_the_importer_reports_a_failed_import(import_alone) -> None:
    status, output = import_alone("otel_lock.asgi._no_such_module")
    assert status == 1 and "ModuleNotFoundError" in output, output
    assert import_alone("otel_lock.asgi") == (0, "")  # the failed fork left the importer clean
