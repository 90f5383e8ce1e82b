"""`LockMiddleware(app, manager=...)` is typed with the `Locks` protocol: clean under `mypy --strict` in user code.

Regression test for issue 15 (`LockMiddleware(manager=RedLockManager(...))`
worked but failed `mypy --strict` for the user), and of the lazy forms
(a factory, nothing) that issue added.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
USAGE = "tests/typecheck/middleware_usage.py"


def _mypy(*files: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "mypy", "--strict", "--no-incremental", *files],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_every_documented_way_to_give_the_manager_passes_mypy_strict():
    # RedLockManager satisfies `Locks` once the one-core refactor gives it held_locks and
    # force_release (issue 15); until then this names exactly those two members.
    result = _mypy(USAGE)
    assert result.returncode == 0 and "Success: no issues found" in result.stdout, result.stdout + result.stderr


def test_a_manager_of_the_wrong_type_is_a_type_error(tmp_path):
    wrong = tmp_path / "wrong_manager.py"
    wrong.write_text("from starlette.applications import Starlette\n"
                     "from otel_lock import LockMiddleware\n"
                     "LockMiddleware(Starlette(), manager='redis://127.0.0.1:6379/0')\n"
                     "LockMiddleware(Starlette(), manager=lambda: 42)\n")
    result = _mypy(str(wrong))
    assert result.returncode == 1, result.stdout
    assert "wrong_manager.py:3: error" in result.stdout and "wrong_manager.py:4: error" in result.stdout, result.stdout
    assert 'Argument "manager" to "LockMiddleware"' in result.stdout
