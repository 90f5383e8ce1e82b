"""The packages import one way: `lock` may record through `telemetry`, `telemetry` never imports `lock`.

Both use `otel_lock._fork` (what to redo after a fork), which imports neither.
A circle between the two made each package's import order matter, and the
type checkers saw the lock's spine through it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import otel_lock

ROOT = Path(otel_lock.__file__).parent


def _imported(path: Path) -> set[str]:
    """Every otel_lock module a file imports (relative or absolute, at any depth, TYPE_CHECKING included)."""
    package = ["otel_lock", *path.relative_to(ROOT).parent.parts]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - node.level + 1]
                found.add(".".join([*base, *(node.module.split(".") if node.module else [])]))
            elif node.module:
                found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {name for name in found if name.startswith("otel_lock")}


def test_telemetry_never_imports_the_lock_package():
    offenders = {str(path.relative_to(ROOT)): sorted(n for n in _imported(path) if n.startswith("otel_lock.lock"))
                 for path in sorted((ROOT / "telemetry").rglob("*.py"))}
    assert not {path: names for path, names in offenders.items() if names}


def test_the_fork_hook_imports_neither_package():
    assert _imported(ROOT / "_fork.py") == set()


def test_the_check_sees_a_relative_import_of_the_lock_package(tmp_path):
    # The walk itself: a telemetry-like module importing ..lock would be found.
    sample = ROOT / "telemetry" / "_instruments.py"
    assert any(name.startswith("otel_lock.") for name in _imported(sample))
    assert "otel_lock._fork" in _imported(ROOT / "telemetry" / "_prom.py")
