"""Typed user code of the blocking facade: `mypy --strict` must accept it (tests/test_sync.py runs it).

Each `# type: ignore[...]` marks a call the facade's types must refuse: under
`--strict` (warn_unused_ignores) an ignore that is not needed is an error, so a
facade that took `**options: Any` again would fail this check.
"""

from __future__ import annotations

import threading
from typing import assert_type

from otel_lock import LockInfo, LockLost, LockManager, LockTimeout
from otel_lock.sync import RunningLoopError, SyncHeldLock, SyncLockContext, SyncLockManager


def from_a_url() -> None:
    with SyncLockManager.from_url("redis://127.0.0.1:6379/0", namespace="jobs", lease=30.0, wait=5.0,
                                  cancel_on_lost=True, socket_timeout=2.0,
                                  redis_options={"client_name": "cron"}) as locks:
        assert_type(locks.namespace, str)
        context = locks.lock("job:nightly", wait=1.0, lease=None, name="job", cancel_on_lost=False)
        assert_type(context, SyncLockContext)
        with context as held:
            assert_type(held, SyncHeldLock)
            assert_type(held.key, str)
            assert_type(held.owner, str)
            assert_type(held.token, int)
            assert_type(held.depth, int)
            assert_type(held.lost, threading.Event)
        maybe = locks.try_lock("job:nightly", lease=10.0)
        assert_type(maybe, SyncHeldLock | None)
        if maybe is not None:
            assert_type(maybe.release(), bool)
        assert_type(locks.acquire("job:x", wait=0.5).release(), bool)
        assert_type(locks.held_locks(), list[LockInfo])
        assert_type(locks.force_release("job:x"), bool)
        locks.lock("job:nightly", wiat=1.0)  # type: ignore[call-arg]
        locks.acquire("job:nightly", wait="5")  # type: ignore[arg-type]
        locks.try_lock("job:nightly", wait=1.0)  # type: ignore[call-arg]
        SyncLockManager.from_url("redis://127.0.0.1:6379/0", lease_seconds=3)  # type: ignore[call-arg]


def from_a_factory() -> None:
    locks = SyncLockManager(lambda: LockManager.from_url("redis://127.0.0.1:6379/0"), cancel_on_lost=True)
    try:
        with locks.lock("job:nightly") as held:
            assert_type(held.token, int)
    except (LockTimeout, LockLost) as error:
        assert_type(error.key, str | None)
    except RunningLoopError as error:
        refused: RuntimeError = error
        assert_type(refused, RuntimeError)
    finally:
        locks.close()
    SyncLockManager("redis://127.0.0.1:6379/0")  # type: ignore[arg-type]
