"""The blocking facade over a RedLock quorum, as user code: `mypy --strict` must accept it."""

from __future__ import annotations

from typing import assert_type

from otel_lock import RedLockManager
from otel_lock.sync import SyncHeldLock, SyncLockManager


def over_a_quorum(urls: list[str]) -> None:
    with SyncLockManager(lambda: RedLockManager.from_urls(urls, namespace="jobs")) as locks:
        with locks.lock("job:nightly", wait=5.0) as held:
            assert_type(held, SyncHeldLock)
