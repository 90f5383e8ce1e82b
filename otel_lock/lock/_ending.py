"""How holds end: released, lost, expired; the counts, spans and events that go with it.

A mixin of LockManager, kept apart so the manager reads as "take a lock"
and this file as "let it go".
"""

from __future__ import annotations

import asyncio
import logging
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Coroutine

from . import _scripts
from ._attempt import _cancelling
from ._errors import LockError, RedisUnavailable, error_type
from ._held import HELD, HeldLock, Lease
from ._watchdog import Watchdog
from ..telemetry._instruments import LockCounts, Telemetry

log = logging.getLogger("otel_lock")


class HoldEnds:
    """What every manager does when a hold ends or is lost: counts, span, the holder told."""

    id: str
    telemetry: Telemetry
    _counts: LockCounts

    def _forget(self, held: HeldLock) -> None:
        """Drop the key from this context's held map when its outer hold ends."""
        lease = held._lease
        if not held._outer:
            return
        current = HELD.get()
        ident = (self.id, lease.lock_key)
        if current.get(ident) is lease:
            HELD.set(MappingProxyType({k: v for k, v in current.items() if k != ident}))

    def _stop_renewing(self, lease: Lease) -> None:
        """No renewal may follow a loss (each manager renews its own way)."""

    def _finish(self, lease: Lease, outcome: str) -> None:
        """The hold is over: its duration, the active count, the age gauge and its span."""
        loop = asyncio.get_running_loop()
        self.telemetry.hold_duration.record(loop.time() - lease.acquired_at,
                                            {"lock.name": lease.name, "lock.release.outcome": outcome})
        self._uncount(lease)
        self._counts.hold_ended(lease)  # a lost hold stays in the age gauge until its holder lets go
        self.telemetry.end_hold_span(lease.span, outcome)

    def _uncount(self, lease: Lease) -> None:
        """`otel_lock.active` counts what is held: a lost or expired lease leaves it at once."""
        if lease.counted:
            lease.counted = False
            self._counts.active[lease.name] -= 1

    def _lose(self, lease: Lease, reason: str, count: bool = True) -> None:
        """The lease is gone: tell the holder, and cancel it if it asked for that."""
        if lease.lost_reason:
            return
        lease.lost_reason = reason
        lease.lost.set()
        self._stop_renewing(lease)
        self._uncount(lease)  # no longer held, whatever the holder still believes
        if count and lease.renew:
            self.telemetry.renewals.add(1, {"lock.name": lease.name, "lock.renewal.outcome": "lost"})
        if lease.span.is_recording():
            lease.span.add_event("lock lost", {"lock.name": lease.name, "lock.token": lease.token,
                                               "lock.lost.reason": reason})
        log.warning("otel-lock: lease of %s lost: %s", lease.key, reason)
        for callback in lease.on_lost:
            callback()
        task = lease.task
        if lease.cancel_on_lost and task is not None and not task.done() and not lease.ended:
            lease.cancelled_by_us = True
            task.cancel(f"otel-lock: lease of {lease.key} lost")


class Ending(HoldEnds):
    """Release, loss and their telemetry, for LockManager."""

    fence_ttl_ms: int
    _watchdog: Watchdog

    if TYPE_CHECKING:
        def _keys(self, key: str) -> tuple[str, str, str, str]: ...

        async def _call(self, script: _scripts.Script, keys: tuple[str, ...], args: list[Any], operation: str,
                        name: str) -> Any: ...

        def _background_task(self, coro: Coroutine[Any, Any, Any]) -> None: ...

    async def _release(self, held: HeldLock) -> bool:
        lease = held._lease
        if held._child:
            lease.unnest(child=True)
        elif held._outer and lease.child_holds > 0:
            lease.closing = True  # no new child may enter; those inside finish first
            await lease.children_done.wait()
        if lease.ended:
            return False
        if not held._child:
            lease.depth -= 1
        final = lease.depth <= 0
        if final:
            lease.closing = True
            self._watchdog.discard(lease)  # never renew what is being released
        keys = self._keys(lease.lock_key)
        release_all = "1" if final and not lease.explicit_owner else "0"
        try:
            res = await self._call(_scripts.release, keys, [lease.owner, self.fence_ttl_ms, release_all],
                                   "release", lease.name)
        except LockError as error:
            if final:
                self._end(lease, "error")
                if isinstance(error, RedisUnavailable) and not lease.explicit_owner:
                    # Let the next caller in as soon as Redis is back, not after the lease.
                    self._background_task(self._release_when_back(keys, lease))
            raise
        if res == -1:
            outcome = "lost" if lease.renew else "expired"
            if not lease.lost.is_set():
                self._lose(lease, "the lock was no longer ours at release", count=False)
            self._end(lease, outcome)
            return False
        if final:
            self._end(lease, "released")
        return True

    async def _release_when_back(self, keys: tuple[str, ...], lease: Lease) -> None:
        loop = asyncio.get_running_loop()
        give_up = loop.time() + lease.lease_seconds
        while loop.time() < give_up:
            await asyncio.sleep(0.25)
            try:
                await self._call(_scripts.release, keys, [lease.owner, self.fence_ttl_ms, "1"], "release", lease.name)
                return
            except RedisUnavailable:
                if _cancelling():  # aclose() stopped it, whatever redis-py made of the CancelledError
                    return
                continue

    def _end(self, lease: Lease, outcome: str) -> None:
        if lease.ended:
            return
        lease.ended = True
        self._watchdog.discard(lease)
        self._finish(lease, outcome)

    def _stop_renewing(self, lease: Lease) -> None:
        self._watchdog.discard(lease)

    def _count_renewal(self, lease: Lease, outcome: str, error: BaseException | None = None) -> None:
        self.telemetry.renewals.add(1, {"lock.name": lease.name, "lock.renewal.outcome": outcome})
        if error is not None:
            self.telemetry.errors.add(1, {"lock.name": lease.name, "lock.operation": "renew",
                                          "error.type": _error_type(error)})
            if lease.span.is_recording():
                lease.span.add_event("lock renewal failed", {"lock.name": lease.name, "error.type": _error_type(error)})


def _error_type(error: BaseException) -> str:
    return error_type(error)
