"""What a caller holds: the lease in Redis, the (possibly nested) holds on it, `async with`.

A Lease is one lock held in Redis by one owner. Holds on it nest: the task
that acquired it may re-enter it (depth + 1), and with
`share_with_children=True` so may the tasks it spawns while holding it; the
outer hold's release then waits until those children have released theirs.

Which leases the current task holds is kept in a context variable, so a
task spawned while a lock is held sees that hold (and waits its turn, unless
the hold is shared), and a task spawned before sees nothing. Each task
records its holds in a dict of its own, so holding N locks costs O(1) per
acquire and release, not a copy of everything held.
"""

from __future__ import annotations

import asyncio
import logging
import math
import weakref
from contextvars import ContextVar
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Generic, NamedTuple, TypeVar

from opentelemetry import trace

from ._errors import LockError, LockLost, RedisUnavailable
from ._shapes import EXCLUSIVE, PERMIT, Shape

if TYPE_CHECKING:
    from ._ending import HoldEnds
    from ._runtime import Runtime

log = logging.getLogger("otel_lock")

NEVER = math.inf


@dataclass(frozen=True)
class LockInfo:
    """A lock as Redis sees it, for `otel-lock locks`."""

    key: str
    owner: str
    depth: int
    ttl: float
    token: int


class _Holds:
    """The leases one task acquired, by (manager id, key); `parent`: what the spawning task held then."""

    __slots__ = ("_task", "by_key", "parent", "seq")

    def __init__(self, task: asyncio.Task[object] | None, parent: _View | None) -> None:
        # Weak: the task's context holds this (`_HELD`), so a strong reference back would make every
        # task that took a lock a reference cycle, its leases with it, left to the cyclic collector.
        self._task = weakref.ref(task) if task is not None else None
        self.by_key: dict[tuple[str, str], Lease] = {}
        self.parent: _View | None = parent
        self.seq: int = 0

    @property
    def task(self) -> asyncio.Task[object] | None:
        return self._task() if self._task is not None else None


class _View(NamedTuple):
    """A task's holds as of `seq`: what a task spawned at that moment inherits (a tuple: made per acquisition)."""

    holds: _Holds
    seq: int


_HELD: ContextVar[_View | None] = ContextVar("otel_lock_held", default=None)


def held_here(ident: tuple[str, str]) -> Lease | None:
    """The lease of `ident` this context holds (its own task's, or its spawner's at the spawn), if any."""
    view = _HELD.get()
    while view is not None:
        lease = view.holds.by_key.get(ident)
        if lease is not None and lease.seq <= view.seq:
            return lease
        view = view.holds.parent
    return None


def remember(ident: tuple[str, str], lease: Lease) -> None:
    """Record a new outer hold in the current task (O(1))."""
    task = asyncio.current_task()
    view = _HELD.get()
    holds = view.holds if view is not None and view.holds.task is task else _Holds(task, view)
    holds.seq += 1
    lease.seq, lease.holds = holds.seq, holds
    holds.by_key[ident] = lease
    _HELD.set(_View(holds, holds.seq))


def forget(ident: tuple[str, str], lease: Lease) -> None:
    """The outer hold ended: drop it from the task that recorded it (O(1), from any task)."""
    holds = lease.holds
    if holds is not None and holds.by_key.get(ident) is lease:
        del holds.by_key[ident]


class LostEvent(asyncio.Event):
    """`held.lost`: set by the watchdog, and also by any look at it once the local validity has passed.

    A holder resumed after a pause (SIGSTOP, a blocked loop) may reach its
    next check before the watchdog's timer runs; it must not read "not lost"
    for a lease that already ran out on its own clock.
    """

    def __init__(self, lease: Lease) -> None:
        super().__init__()
        # Weak: the lease holds this event, and a cycle would leave every hold to the cyclic garbage
        # collector. A lease not ended yet is alive (its watchdog holds it); an ended one has nothing to check.
        self._lease = weakref.ref(lease)

    def is_set(self) -> bool:
        if not super().is_set():
            lease = self._lease()
            if lease is not None:
                lease.check_validity()
        return super().is_set()


class Lease:
    """One lock held in Redis by one owner; reentrant holds share it.

    Validity is counted from `valid_from`, the loop time at which the
    acquiring request was *sent*: Redis set the expiry after that moment, so
    the lease cannot run out earlier than this side believes, however late
    the reply was read. `planned`: a fixed lease meant to run out (a
    once-per-period job's tick), whose expiry is no loss.
    """

    # Slots: one Lease is made per acquisition (on every hand-over's path), and a fixed layout is cheaper to fill.
    __slots__ = ("ends", "shape", "lock_base", "permits", "name", "owner", "token", "lock_key", "key",
                 "lease_seconds", "renew_ms", "renew", "renew_every", "drift", "cancel_on_lost", "planned", "task",
                 "span", "acquired_at", "expires_at", "renew_at", "depth", "child_holds", "_children_done",
                 "closing", "loop", "lost", "lost_reason", "on_lost", "explicit_owner", "share_with_children",
                 "cancelled_by_us", "finished", "ended", "renewing", "seq", "holds", "runtime", "__weakref__")

    runtime: Runtime  # the manager's runtime on the loop it was acquired on (set by the core, once taken)

    def __init__(self, ends: HoldEnds, key: str, redis_key: str, name: str, owner: str, token: int, lease: float,
                 renew_every: float, cancel_on_lost: bool, valid_from: float, acquired_at: float, *,
                 explicit_owner: bool = False, share_with_children: bool = False, planned: bool = False,
                 shape: Shape = EXCLUSIVE, lock_base: str | None = None, permits: int | None = None) -> None:
        self.ends: HoldEnds = ends
        self.shape: Shape = shape            # exclusive, shared or permit (`_shapes.py`)
        self.lock_base: str = lock_base or redis_key  # `S:{N}`: what the shape's keys are made from
        self.permits: int | None = permits   # a permit's limit
        self.name: str = name
        self.owner: str = owner
        self.token: int = token
        self.lock_key: str = key
        self.key: str = redis_key
        self.lease_seconds: float = lease
        self.renew_ms: int = int(lease * 1000)
        self.renew: bool = renew_every != NEVER
        self.renew_every: float = renew_every
        self.drift: float = lease * 0.01 + 0.002
        self.cancel_on_lost: bool = cancel_on_lost
        self.planned: bool = planned
        self.task: asyncio.Task[object] | None = asyncio.current_task()
        self.span: trace.Span = trace.INVALID_SPAN  # the `lock hold` span, set by the core
        self.acquired_at: float = acquired_at
        self.expires_at: float = valid_from + lease - self.drift
        self.renew_at: float = valid_from + renew_every
        self.depth: int = 1
        self.child_holds: int = 0        # holds of spawned tasks (share_with_children)
        self._children_done: asyncio.Event | None = None  # made when a child enters
        self.closing: bool = False       # the final release has begun: no more re-entry
        self.loop: asyncio.AbstractEventLoop = asyncio.get_running_loop()
        self.lost: asyncio.Event = LostEvent(self)
        self.lost_reason: str = ""
        self.on_lost: list[Callable[[], None]] = []
        self.explicit_owner: bool = explicit_owner  # other holders may count on the Redis depth
        self.share_with_children: bool = share_with_children
        self.cancelled_by_us: bool = False
        self.finished: bool = False      # its duration, span and counts are recorded
        self.ended: bool = False         # released (or given up): no renewal, no re-entry
        self.renewing: asyncio.Future[Any] | None = None  # a renewal in flight (a release waits for it)
        self.seq: int = 0
        self.holds: _Holds | None = None

    @property
    def held_as(self) -> str:
        """What the hold is known by among its task's holds: its key, or a permit's own name (never re-entered,
        listed only so that a wait of its task can be followed through it to a deadlock)."""
        return self.lock_key if self.shape is not PERMIT else f"{self.lock_key} {self.owner}"

    def check_validity(self) -> None:
        if not self.ended and not self.lost_reason and self.loop.time() >= self.expires_at:
            self.ends.lose(self, "no renewal confirmed the lease in time" if self.renew else "the fixed lease ran out")

    def nest(self, *, child: bool) -> None:
        """One more hold inside this one (the acquiring task's, or a child's it shares with)."""
        if self.lost.is_set():
            raise LockLost(f"lease of {self.key} was lost: {self.lost_reason}", key=self.key, reason=self.lost_reason)
        if self.closing:
            raise LockError(f"lock {self.key} is being released: a spawned task cannot re-enter it now",
                            key=self.key)
        self.depth += 1
        if child:
            self.child_holds += 1
            self.children_done.clear()

    @property
    def children_done(self) -> asyncio.Event:
        """Set while no spawned task holds it (the outer release waits for it)."""
        if self._children_done is None:
            self._children_done = asyncio.Event()
            if not self.child_holds:
                self._children_done.set()
        return self._children_done

    def unnest(self, *, child: bool) -> None:
        """A nested hold ended (or never got its Redis confirmation)."""
        self.depth -= 1
        if child:
            self.child_holds -= 1
            if self.child_holds == 0:
                self.children_done.set()

    def confirmed(self, sent_at: float) -> None:
        """A renewal sent at `sent_at` (loop time) succeeded: valid for a full lease from then."""
        self.expires_at = sent_at + self.renew_ms / 1000 - self.drift
        self.renew_at = sent_at + self.renew_every

    def lost_error(self, cause: BaseException | None = None) -> LockLost:
        error = LockLost(f"lease of {self.key} was lost: {self.lost_reason}", key=self.key, reason=self.lost_reason)
        error.__cause__ = cause
        return error


class HeldLock:
    """What `lock()` yields and `try_lock()` returns: one (possibly nested) hold."""

    __slots__ = ("_lease", "depth", "_release", "_outer", "_child")

    depth: int
    """Reentrancy depth: 1 for the outermost hold."""

    def __init__(self, lease: Lease, depth: int, *, outer: bool = False, child: bool = False) -> None:
        self._lease = lease
        self.depth = depth
        self._release: Any = None  # the release under way: a task, or the core's Releasing
        self._outer = outer
        self._child = child

    @property
    def key(self) -> str:
        """The full Redis key."""
        return self._lease.key

    @property
    def name(self) -> str:
        """The `lock.name` of metrics and spans."""
        return self._lease.name

    @property
    def owner(self) -> str:
        """The owner id in Redis."""
        return self._lease.owner

    @property
    def token(self) -> int:
        """Fencing token: strictly increasing per key."""
        return self._lease.token

    @property
    def lost(self) -> asyncio.Event:
        """Set once the lease is known lost."""
        return self._lease.lost

    @property
    def mode(self) -> str:
        """`exclusive`, `shared` (`lock(key, shared=True)`) or `permit` (`semaphore()`): `lock.mode` in telemetry."""
        return self._lease.shape.mode

    @property
    def permits(self) -> int | None:
        """The key's limit, for a `semaphore()` hold; None for a lock."""
        return self._lease.permits

    def begin_release(self) -> None:
        """Put the release under way now (on the wire, on the fast path); `release()` gives its outcome."""
        if self._release is None:
            self._release = self._lease.ends.release(self._lease, outer=self._outer, child=self._child)

    async def release(self) -> bool:
        """Release this hold; False if the lock was no longer ours. Idempotent, safe to cancel."""
        self.begin_release()
        release = self._release
        if isinstance(release, asyncio.Future):
            return await asyncio.shield(release)
        answer: bool = await release.wait()
        return answer

    def __repr__(self) -> str:
        return f"<HeldLock {self.key} owner={self.owner} token={self.token} depth={self.depth}>"


H = TypeVar("H")  # a context's hold: a HeldLock, or lock_all's HeldLocks


class PerTaskHolds(Generic[H]):
    """The holds of one context object, each with the task that entered it: tasks may share the object and
    nest it (`ctx = locks.lock(k)` made once), and each exit takes back the hold its own task entered last.

    The hold of a context nobody else is inside sits in a slot: the usual `async with locks.lock(k):`
    allocates nothing more. Holds entered while it is taken go on a stack of their task's.
    """

    __slots__ = ("_held", "_task", "_more")

    def __init__(self) -> None:
        self._held: H | None = None
        self._task: asyncio.Task[Any] | None = None
        self._more: dict[asyncio.Task[Any] | None, list[H]] | None = None

    def keep(self, held: H) -> None:
        task = asyncio.current_task()
        if self._held is None and not self._more:
            self._held, self._task = held, task
        else:  # entered already: a stack per task, newer than the slot, so exits go innermost first
            if self._more is None:
                self._more = {}
            self._more.setdefault(task, []).append(held)

    def take_back(self, what: str) -> H:
        """The hold this task entered last, out of the context; RuntimeError if it entered none."""
        task = asyncio.current_task()
        more = self._more
        if more:
            stack = more.get(task)
            if stack:
                held = stack.pop()
                if not stack:
                    del more[task]
                return held
        outer = self._held
        if outer is None or self._task is not task:
            raise RuntimeError(f"{what} exited in a task that is not inside it: each `async with` releases "
                               "the hold its own task took (to let go of a hold from another task, hand that "
                               "task the hold and await held.release())")
        self._held = self._task = None
        return outer


class LockContext(PerTaskHolds[HeldLock]):
    """`async with manager.lock(...)`: acquire on enter, release on exit, LockLost on loss.

    Tasks may share one context object and nest it: each exit releases the
    hold its own task entered last (`PerTaskHolds`).
    """

    __slots__ = ("_acquire",)

    def __init__(self, acquire: Callable[[], Awaitable[HeldLock]]) -> None:
        super().__init__()
        self._acquire = acquire

    async def __aenter__(self) -> HeldLock:
        held: HeldLock = await self._acquire()
        self.keep(held)
        return held

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        held = self.take_back("LockContext")
        lease = held._lease
        try:
            await held.release()
        except RedisUnavailable as error:
            log.warning("otel-lock: could not release %s, it will expire by itself: %s", lease.key, error)
        except asyncio.CancelledError as cancelled:
            # The loss's cancellation reached us here, after the body finished.
            _raise_lost(lease, cancelled)
            raise
        if exc_type is not None and issubclass(exc_type, asyncio.CancelledError):
            _raise_lost(lease, exc)


def _raise_lost(lease: Lease, cancelled: BaseException | None) -> None:
    task = asyncio.current_task()
    if lease.cancelled_by_us and task is not None and task.uncancel() == 0:
        raise lease.lost_error(cancelled)
