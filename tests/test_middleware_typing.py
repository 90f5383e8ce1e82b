"""`LockMiddleware(app, manager=...)` is typed with the `Locks` protocol: clean under `mypy --strict` in user code.

Regression test: `LockMiddleware(manager=RedLockManager(...))` worked but
failed `mypy --strict` for the user. Also checks the lazy forms added with the
fix (a factory, nothing). Both files are checked in the suite's one mypy run
(the `type_checks` fixture, tests/_typecheck.py).
"""

from __future__ import annotations

import pytest

from _typecheck import MIDDLEWARE_USAGE

pytestmark = pytest.mark.timeout(660)  # the one mypy run, if this module asks first


def test_every_documented_way_to_give_the_manager_passes_mypy_strict(type_checks):
    # RedLockManager included: as a Core it has every member of `Locks` (held_locks, force_release).
    mypy = type_checks.mypy
    assert mypy.errors_in(MIDDLEWARE_USAGE) == [], mypy.output()


def test_a_manager_of_the_wrong_type_is_a_type_error(type_checks):
    mypy = type_checks.mypy
    errors = mypy.errors_in(str(mypy.wrong_manager))
    lines = {line.split(":")[1] for line in errors}
    assert lines == {"3", "4"}, mypy.output()
    assert any('Argument "manager" to "LockMiddleware"' in line for line in errors), mypy.output()
