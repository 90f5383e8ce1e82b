"""After a fork, in the child: what the lock managers and the telemetry of the process redo.

Its own module, below both packages, so that `lock` and `telemetry` share it
without importing each other (`telemetry` never imports `lock`).
"""

from __future__ import annotations

import os
import weakref
from typing import Callable

# What every manager and exporter of the process wants done after a fork (weakly: their life is their user's).
_ALL: list[weakref.WeakMethod[Callable[[], None]]] = []


def watch_fork(forked: Callable[[], None]) -> None:
    """Call the bound method `forked()` in the child after every fork, as long as its object lives."""
    _ALL[:] = [ref for ref in _ALL if ref() is not None]
    _ALL.append(weakref.WeakMethod(forked))


def _after_fork_in_child() -> None:
    for ref in list(_ALL):
        forked = ref()
        if forked is not None:
            forked()


os.register_at_fork(after_in_child=_after_fork_in_child)
