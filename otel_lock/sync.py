"""A blocking facade over LockManager for scripts and cron jobs.

The async core runs on a private event-loop thread; every call is submitted
to it and waited for. Reentrancy is per thread: a thread that already holds
a key re-enters it (same owner, depth + 1). A blocked thread cannot be
cancelled, so a lost lease shows as `held.lost.is_set()` (check it between
steps of long work) and as a False return from `release()`.
"""

from __future__ import annotations

import asyncio
import threading
from contextlib import contextmanager
from typing import Any, Coroutine, Iterator, TypeVar

from .lock import HeldLock, LockInfo, LockManager

T = TypeVar("T")


class SyncHeldLock:
    """A hold seen from a thread: key, owner, token, depth, lost (threading.Event)."""

    def __init__(self, manager: "SyncLockManager", held: HeldLock, lost: threading.Event) -> None:
        self._manager, self._held = manager, held
        self.lost: threading.Event = lost
        self.key: str = held.key
        self.name: str = held.name
        self.owner: str = held.owner
        self.token: int = held.token
        self.depth: int = held.depth

    def release(self) -> bool:
        """Release this hold; False if the lock was no longer ours."""
        return self._manager._release(self)

    def __repr__(self) -> str:
        return f"<SyncHeldLock {self.key} owner={self.owner} token={self.token} depth={self.depth}>"


class SyncLockManager:
    """`with locks.lock("job:cleanup"):` from plain threads."""

    def __init__(self, url: str, **options: Any) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="otel-lock loop", daemon=True)
        self._thread.start()
        self._held = threading.local()
        try:
            self._manager: LockManager = self._run(self._make(url, options))
        except BaseException:
            self._stop_loop()
            raise

    @classmethod
    def from_url(cls, url: str, **options: Any) -> "SyncLockManager":
        """The same as `SyncLockManager(url, **options)`; options as for `LockManager.from_url`."""
        return cls(url, **options)

    @staticmethod
    async def _make(url: str, options: dict[str, Any]) -> LockManager:
        return LockManager.from_url(url, **options)

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    @contextmanager
    def lock(self, key: str, **options: Any) -> Iterator[SyncHeldLock]:
        """`with locks.lock("k", wait=5.0) as held:`; options as for `LockManager.lock`."""
        held = self.acquire(key, **options)
        try:
            yield held
        finally:
            held.release()

    def try_lock(self, key: str, **options: Any) -> SyncHeldLock | None:
        """The hold if the lock is free right now (or this thread holds it), else None."""
        if key in self._held_map() and "owner" not in options:
            return self.acquire(key, **options)
        found = self._run(self._manager.try_lock(key, **options))
        return None if found is None else self._wrap(key, found)

    def acquire(self, key: str, **options: Any) -> SyncHeldLock:
        """Block until held (LockTimeout after `wait`); re-enters a key this thread holds.

        A nested acquire of a lease that was lost raises LockLost, as in the
        async API: it never takes the lock afresh under the outer hold's feet.
        """
        outer = self._held_map().get(key)
        if outer is not None and "owner" not in options:
            held = self._run(self._manager._reenter(outer._held._lease, child=False))
        else:
            held = self._run(self._manager.acquire(key, **options))
        return self._wrap(key, held)

    def _wrap(self, key: str, held: HeldLock) -> SyncHeldLock:
        held_map = self._held_map()
        outer = held_map.get(key)
        if outer is not None and outer._held._lease is held._lease:
            return SyncHeldLock(self, held, outer.lost)
        lost = threading.Event()
        # Told by the manager's loop thread the moment the lease is known lost: no task per hold.
        held._lease.on_lost.append(lost.set)
        if held.lost.is_set():
            lost.set()
        wrapped = SyncHeldLock(self, held, lost)
        if outer is None:
            held_map[key] = wrapped
        return wrapped

    def _release(self, wrapped: SyncHeldLock) -> bool:
        held_map = self._held_map()
        for key, value in list(held_map.items()):
            if value is wrapped:
                del held_map[key]
        return self._run(wrapped._held.release())

    def _held_map(self) -> dict[str, SyncHeldLock]:
        if not hasattr(self._held, "map"):
            self._held.map = {}
        held_map: dict[str, SyncHeldLock] = self._held.map
        return held_map

    def held_locks(self) -> list[LockInfo]:
        """Every lock held in the namespace (see `LockManager.held_locks`)."""
        return self._run(self._manager.held_locks())

    def force_release(self, key: str) -> bool:
        """Release whoever holds `key` (an operator's last resort)."""
        return self._run(self._manager.force_release(key))

    def close(self) -> None:
        """Stop the manager and its loop thread; locks still held expire after their lease."""
        if self._thread.is_alive():
            self._run(self._manager.aclose())
            self._stop_loop()

    def _stop_loop(self) -> None:
        async def cancel_rest() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(cancel_rest(), self._loop).result()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    def __enter__(self) -> "SyncLockManager":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
