"""What a caller holds: the lease in Redis, the (possibly nested) holds on it, `async with`."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from opentelemetry import trace

from ._errors import LockLost, RedisUnavailable
from ._watchdog import NEVER

if TYPE_CHECKING:
    from ._manager import LockManager

log = logging.getLogger("otel_lock")


@dataclass(frozen=True)
class LockInfo:
    """A lock as Redis sees it, for `otel-lock locks`."""

    key: str
    owner: str
    depth: int
    ttl: float
    token: int


class Lease:
    """One lock held in Redis by one owner; reentrant holds share it."""

    def __init__(self, manager: LockManager, key: str, name: str, owner: str, token: int,
                 lease: float, renew: bool, cancel_on_lost: bool, now: float, granted_for: float) -> None:
        self.manager, self.name, self.owner, self.token = manager, name, owner, token
        self.lock_key = key
        self.key = manager._keys(key)[0]
        self.renew_ms = int(lease * 1000)
        self.renew = renew
        self.renew_every = manager.renew_interval if renew else NEVER
        self.drift = lease * 0.01 + 0.002
        self.cancel_on_lost = cancel_on_lost
        self.task = asyncio.current_task()
        self.span = trace.get_current_span()
        self.acquired_at = now
        self.depth = 1
        self.lost = asyncio.Event()
        self.lost_reason = ""
        self.shared = False  # owner= given explicitly: other holders may count on the Redis depth
        self.cancelled_by_us = False
        self.ended = False
        if granted_for < lease:
            # handed over with the short grace lease: top it up soon, trust it for half
            self.expires_at = now + granted_for / 2
            self.renew_at = now + granted_for / 4
        else:
            self.expires_at = now + lease - self.drift
            self.renew_at = now + self.renew_every

    def confirmed(self, sent_at: float) -> None:
        self.expires_at = sent_at + self.renew_ms / 1000 - self.drift
        self.renew_at = sent_at + self.renew_every


class HeldLock:
    """What `lock()` yields and `try_lock()` returns: one (possibly nested) hold."""

    __slots__ = ("_lease", "depth", "_release")

    def __init__(self, lease: Lease, depth: int) -> None:
        self._lease = lease
        self.depth = depth
        self._release: asyncio.Future | None = None

    key = property(lambda self: self._lease.key, doc="The full Redis key.")
    name = property(lambda self: self._lease.name, doc="The `lock.name` of metrics and spans.")
    owner = property(lambda self: self._lease.owner, doc="The owner id in Redis.")
    token = property(lambda self: self._lease.token, doc="Fencing token: strictly increasing per key.")
    lost = property(lambda self: self._lease.lost, doc="asyncio.Event set once the lease is known lost.")

    async def release(self) -> bool:
        """Release this hold; False if the lock was no longer ours. Idempotent, safe to cancel."""
        if self._release is None:
            self._lease.manager._forget(self)
            self._release = asyncio.ensure_future(self._lease.manager._release(self))
        return await asyncio.shield(self._release)

    def __repr__(self) -> str:
        return f"<HeldLock {self.key} owner={self.owner} token={self.token} depth={self.depth}>"


class _LockContext:
    """`async with manager.lock(...)`: acquire on enter, release on exit, LockLost on loss."""

    __slots__ = ("_manager", "_args", "_held")

    def __init__(self, manager: LockManager, args: dict) -> None:
        self._manager, self._args, self._held = manager, args, None

    async def __aenter__(self) -> HeldLock:
        self._held = await self._manager.acquire(**self._args)
        return self._held

    async def __aexit__(self, exc_type, exc, tb) -> None:
        held, self._held = self._held, None
        lease = held._lease
        try:
            await held.release()
        except RedisUnavailable as error:
            log.warning("otel-lock: could not release %s, it will expire by itself: %s", lease.key, error)
        except asyncio.CancelledError as cancelled:
            # The loss's cancellation reached us here, after the body finished.
            self._raise_lost(lease, cancelled)
            raise
        if exc_type is not None and issubclass(exc_type, asyncio.CancelledError):
            self._raise_lost(lease, exc)

    @staticmethod
    def _raise_lost(lease: Lease, cancelled: BaseException | None) -> None:
        task = asyncio.current_task()
        if lease.cancelled_by_us and task is not None and task.uncancel() == 0:
            raise LockLost(f"lease of {lease.key} was lost: {lease.lost_reason}", key=lease.key) from cancelled
