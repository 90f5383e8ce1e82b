"""`Locks`: what the middleware and the blocking facade need of a lock manager.

`LockManager` (one Redis, Sentinel, Cluster) and `RedLockManager` (a quorum
of masters) both satisfy it, so code typed against `Locks` takes either,
clean under `mypy --strict`.
"""

from __future__ import annotations

from typing import Iterable, Protocol, runtime_checkable

from ._held import HeldLock, LockContext, LockInfo
from ._multi import HeldLocks, MultiLockContext


@runtime_checkable
class Locks(Protocol):
    """A lock manager: `lock()`, `try_lock()`, `acquire()`, `lock_all()`, the operator calls, `aclose()`."""

    @property
    def namespace(self) -> str:
        """The prefix of every Redis key of this manager."""
        ...

    def lock(self, key: str, *, wait: float | None = None, lease: float | None = None, name: str | None = None,
             cancel_on_lost: bool | None = None, share_with_children: bool = False,
             shared: bool = False) -> LockContext:
        """`async with locks.lock("stock:1") as held:`; LockTimeout after `wait` seconds."""
        ...

    async def try_lock(self, key: str, *, lease: float | None = None, name: str | None = None,
                       cancel_on_lost: bool | None = None, share_with_children: bool = False,
                       shared: bool = False) -> HeldLock | None:
        """The hold if the lock is free right now, else None."""
        ...

    async def acquire(self, key: str, *, wait: float | None = None, lease: float | None = None,
                      name: str | None = None, cancel_on_lost: bool | None = None,
                      share_with_children: bool = False, shared: bool = False) -> HeldLock:
        """Acquire and return the hold; release it with `await held.release()`."""
        ...

    def semaphore(self, key: str, *, permits: int, wait: float | None = None, lease: float | None = None,
                  name: str | None = None, cancel_on_lost: bool | None = None) -> LockContext:
        """`async with locks.semaphore("export:t3", permits=2) as held:` at most `permits` holders at once."""
        ...

    async def acquire_permit(self, key: str, *, permits: int, wait: float | None = None, lease: float | None = None,
                             name: str | None = None, cancel_on_lost: bool | None = None) -> HeldLock:
        """A permit of `key`; release it with `await held.release()`."""
        ...

    def lock_all(self, keys: Iterable[str], *, wait: float | None = None, lease: float | None = None,
                 name: str | None = None, cancel_on_lost: bool | None = None) -> MultiLockContext:
        """`async with locks.lock_all(["a", "b"]) as held:`: every key in the canonical order, or LockTimeout."""
        ...

    async def acquire_all(self, keys: Iterable[str], *, wait: float | None = None, lease: float | None = None,
                          name: str | None = None, cancel_on_lost: bool | None = None) -> HeldLocks:
        """Acquire every key (all or nothing); release them with `await held.release()`."""
        ...

    async def held_locks(self) -> list[LockInfo]:
        """Every lock held in this namespace."""
        ...

    async def force_release(self, key: str) -> bool:
        """Release whoever holds `key` (an operator's last resort)."""
        ...

    async def aclose(self) -> None:
        """Stop background work; locks still held expire after their lease."""
        ...
