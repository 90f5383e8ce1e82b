"""Several keys at once (`lock_all`): one canonical order, all or nothing within one wait, released together.

Two callers that name the same keys in different orders (a transfer from 7
to 3 and one from 3 to 7) take them in the same order here, sorted by Redis
key with duplicates folded, so they cannot wait on each other in a circle.
Each key is one ordinary hold (`Core.acquire`): its own lease, watchdog
renewal, fencing token, wake-on-release queue, re-entry and telemetry; the
keys share one `wait` budget. Whatever was taken is released (in reverse
order) when a later key times out, fails, or the caller is cancelled, so a
failed `lock_all` leaves nothing held.

The order is the same on every topology (Cluster keys in different slots,
RedLock), which is what keeps `lock_all` users deadlock-free there;
`LockDeadlock` (`_deadlock.py`) catches the callers that stack `lock()`
calls by hand.
"""

from __future__ import annotations

import asyncio
import logging
import math
from types import TracebackType
from typing import Any, Awaitable, Callable, Iterable

from ._errors import LockBusy, LockError, LockTimeout
from ._held import HeldLock, Lease, PerTaskHolds

log = logging.getLogger("otel_lock")


def canonical(keys: Iterable[str]) -> list[str]:
    """The keys in the order every caller takes them: by Redis key (`ns:{key}`), duplicates folded.

    TypeError for a lone string or a non-str key, ValueError for an empty list;
    each key is checked as `lock()` checks it by the caller.
    """
    if isinstance(keys, (str, bytes)) or not isinstance(keys, Iterable):
        raise TypeError(f"lock_all takes a list of keys, not {keys!r}")
    listed = list(keys)
    if not listed:
        raise ValueError("lock_all needs at least one key, got an empty list")
    for key in listed:
        if not isinstance(key, str):
            raise TypeError(f"lock_all keys must be strings, not {key!r} ({type(key).__name__})")
    # `ns:{key}` compares as `key + "}"` within one namespace: the Redis key's order, not the bare key's
    return sorted(set(listed), key=lambda key: key + "}")


class AnyLost(asyncio.Event):
    """`held.lost` of several holds: set as soon as any one of their leases is known lost."""

    def __init__(self, leases: list[Lease]) -> None:
        super().__init__()
        self._leases = leases
        for lease in leases:
            lease.on_lost.append(self.set)
            if lease.lost_reason:
                self.set()

    def detach(self) -> None:
        """The holds ended: stop listening (a long-held lease re-entered by many lock_all calls keeps no list)."""
        for lease in self._leases:
            if self.set in lease.on_lost:
                lease.on_lost.remove(self.set)

    def is_set(self) -> bool:
        if not super().is_set() and any(lease.lost.is_set() for lease in self._leases):
            self.set()  # a look past a lease's local validity counts (`_held.LostEvent`)
        return super().is_set()


class HeldLocks:
    """What `lock_all()` yields: one hold per key, in the canonical order."""

    __slots__ = ("keys", "holds", "tokens", "lost")

    keys: tuple[str, ...]
    """The keys as the caller named them (duplicates folded), in the order they were taken."""
    holds: tuple[HeldLock, ...]
    """One `HeldLock` per key, same order (`.key` is the full Redis key)."""
    tokens: dict[str, int]
    """Fencing token per key (the caller's key, as in `keys`)."""
    lost: asyncio.Event
    """Set as soon as the lease of any one key is known lost."""

    def __init__(self, keys: list[str], holds: list[HeldLock]) -> None:
        self.keys = tuple(keys)
        self.holds = tuple(holds)
        self.tokens = {key: held.token for key, held in zip(keys, holds)}
        self.lost = AnyLost([held._lease for held in holds])

    async def release(self) -> bool:
        """Release every hold, in reverse order; False if any lock was no longer ours. Idempotent, safe to cancel."""
        try:
            return await release_all(self.holds)
        finally:
            if isinstance(self.lost, AnyLost):
                self.lost.detach()

    def __repr__(self) -> str:
        return f"<HeldLocks {', '.join(f'{k}={t}' for k, t in self.tokens.items())}>"


async def release_all(holds: Iterable[HeldLock]) -> bool:
    """Release the holds together, the last taken first on the wire; the first error after all were answered.

    Every release is under way before the first is awaited, and each runs to
    its end by itself, so a cancelled caller leaves none of them held.
    """
    last_first = list(holds)[::-1]
    for held in last_first:
        held.begin_release()
    ok, error = True, None
    for held in last_first:
        try:
            ok = await held.release() and ok
        except LockError as exc:
            error = error or exc
    if error is not None:
        raise error
    return ok


async def acquire_all(acquire: Callable[..., Awaitable[HeldLock]], keys: list[str], wait: float,
                      redis_key: Callable[[str], str], **options: Any) -> HeldLocks:
    """Take `keys` (already canonical) one after the other within one `wait`; all of them, or none."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    deadline = start + wait
    taken: list[HeldLock] = []
    try:
        while True:
            for key in keys:
                remaining = math.inf if math.isinf(wait) else max(0.0, deadline - loop.time())
                try:
                    taken.append(await acquire(key, wait=remaining, **options))
                except LockTimeout as exc:
                    waited = loop.time() - start
                    kind = LockBusy if wait == 0 else LockTimeout
                    raise kind(f"locks {', '.join(keys)} were not all acquired within {wait} s: {redis_key(key)} "
                               f"was held by another owner", key=redis_key(key), waited=waited) from exc
            # A key taken first may have run out while a later one was waited for (the process
            # stalled past its lease: nothing renewed it, another caller may have had it since).
            # All or nothing: never hand out a set with a lost key; let go and take them again.
            gone = [held for held in taken[:-1] if held.lost.is_set()]
            if not gone:
                return HeldLocks(keys, taken)
            log.warning("otel-lock: lock_all lost %s while it waited for a later key; taking the keys again",
                        ", ".join(held.key for held in gone))
            letting_go, taken = taken, []
            await _let_go(letting_go)
            if not math.isinf(wait) and loop.time() >= deadline:
                raise LockTimeout(f"locks {', '.join(keys)} were not all held at once within {wait} s: "
                                  f"{gone[0].key} ran out while a later key was waited for",
                                  key=gone[0].key, waited=loop.time() - start)
    except BaseException:
        if taken:
            await _let_go(taken)
        raise


async def _let_go(taken: list[HeldLock]) -> None:
    """Release a partly taken set; run to its end even if the caller is cancelled again meanwhile."""
    letting_go = asyncio.ensure_future(release_all(taken))
    letting_go.add_done_callback(_log_failure)
    await asyncio.wait({letting_go})


def _log_failure(task: asyncio.Future[bool]) -> None:
    if not task.cancelled() and isinstance(task.exception(), LockError):
        log.warning("otel-lock: could not release a partly taken lock_all, it will expire by itself: %s",
                    task.exception())


class MultiLockContext(PerTaskHolds["HeldLocks"]):
    """`async with manager.lock_all([...])`: acquire on enter, release on exit, LockLost on loss.

    Shared by tasks and nested as `LockContext` is: each exit releases what its own task entered last.
    """

    __slots__ = ("_acquire",)

    def __init__(self, acquire: Callable[[], Awaitable[HeldLocks]]) -> None:
        super().__init__()
        self._acquire = acquire

    async def __aenter__(self) -> HeldLocks:
        held: HeldLocks = await self._acquire()
        self.keep(held)
        return held

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        held = self.take_back("MultiLockContext")
        try:
            await held.release()
        except LockError as error:
            log.warning("otel-lock: could not release every lock of %s, they will expire by themselves: %s",
                        ", ".join(held.keys), error)
        except asyncio.CancelledError as cancelled:
            _raise_lost(held, cancelled)
            raise
        if exc_type is not None and issubclass(exc_type, asyncio.CancelledError):
            _raise_lost(held, exc)


def _raise_lost(held: HeldLocks, cancelled: BaseException | None) -> None:
    """The holder was cancelled by lost leases (`cancel_on_lost`), nothing else: LockLost instead."""
    ours = [h._lease for h in held.holds if h._lease.cancelled_by_us]
    task = asyncio.current_task()
    if not ours or task is None:
        return
    left = task.cancelling()
    for _ in ours:
        left = task.uncancel()
    if left == 0:
        raise ours[0].lost_error(cancelled)
