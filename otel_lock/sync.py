"""A blocking facade over any `Locks` manager, for scripts, cron jobs and WSGI workers.

Each process gets its own event-loop thread (a daemon: it never keeps the
process alive) and its own manager, built by the factory. After `fork()` the
child builds both afresh at its first call, from the same factory: it never
touches the parent's loop or sockets, and the holds it inherited stay the
parent's.

Every blocking call runs one coroutine on that loop and waits for it. When
the waiting thread is interrupted (a signal handler raising, Ctrl-C, a soft
time limit) the call is abandoned on the loop thread, where it cannot race
the answer: a pending acquire is cancelled, and a lock it was granted
meanwhile is released. No lock is left held and renewed that no code can
release.

Re-entry is per thread: a thread that holds a key re-enters it (depth + 1,
same token); another thread is another caller. The re-entry itself is the
async manager's own (`Core._reenter`): one round trip that checks the lease
is still this owner's in Redis, so a lease gone there raises LockLost, as in
async code, and each nested hold is released as the manager releases it
(any order). A `Locks` of another kind is re-entered by a local count.

A thread cannot be cancelled, so `cancel_on_lost=True` means: a `with` block
whose lease was lost raises LockLost as it ends. `held.lost` (a
threading.Event) tells at any time.

A call that would wait from inside a running event loop is refused at once
with RunningLoopError (a RuntimeError): it would stop every task of that
loop for the whole wait.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import os
import signal
import threading
import time
from functools import partial
from types import TracebackType
from typing import Any, Awaitable, Callable, Coroutine, Generic, Iterable, Mapping, TypeVar, cast

from opentelemetry.metrics import MeterProvider
from opentelemetry.trace import TracerProvider

from .lock import HeldLock, LockBusy, LockError, LockInfo, LockLost, LockManager, Locks, LockTimeout, RedisUnavailable
from .lock._deadlock import THREAD_HOLDS
from .lock._multi import canonical
from .lock._options import check_flag, check_key, check_seconds
from .lock._server_checks import ServerHealth, ServerReport

__all__ = ["RunningLoopError", "SyncHeldLock", "SyncHeldLocks", "SyncLockContext", "SyncLockManager",
           "SyncMultiLockContext"]

log: logging.Logger = logging.getLogger("otel_lock")
T = TypeVar("T")
_CLOSE_BOUND = 5.0  # seconds close() gives calls in flight to finish
_NEEDED = ("namespace", "acquire", "try_lock", "aclose")  # what taking a lock needs of a `Locks`

# Guards building a process's runtime. Replaced in every child: a lock some
# parent thread held at fork time would stay held there for ever.
_process_lock = threading.Lock()


def _fresh_process_lock() -> None:
    global _process_lock
    _process_lock = threading.Lock()


os.register_at_fork(after_in_child=_fresh_process_lock)


class RunningLoopError(RuntimeError):
    """A blocking call was made from a thread that runs an event loop; use the async API there."""


# What each refused call is in async code: a context for `async with`, the rest awaited.
_ASYNC_API = {
    "lock": "async with locks.lock(...)",
    "semaphore": "async with locks.semaphore(...)",
    "lock_all": "async with locks.lock_all(...)",
    "acquire": "await locks.acquire(...)",
    "try_lock": "await locks.try_lock(...)",
    "acquire_permit": "await locks.acquire_permit(...)",
    "acquire_all": "await locks.acquire_all(...)",
    "held_locks": "await locks.held_locks()",
    "force_release": "await locks.force_release(...)",
    "check_servers": "await locks.check_servers()",
}


def _refuse_in_loop(call: str) -> None:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return
    raise RunningLoopError(
        f"SyncLockManager.{call}() blocks its thread, and this thread runs an event loop: every task on it "
        f"would stop for the whole wait. In async code use the async API instead: `{_ASYNC_API[call]}` "
        f"on an otel_lock.LockManager (LockManager.from_url) or RedLockManager")


class _Call(Generic[T]):
    """One coroutine run on the loop for a waiting thread.

    `abandon()` runs on the loop thread when that thread stops waiting
    (interrupted): whatever the coroutine produced, before or after, is
    handed to `undo`, so a grant can never reach a thread that is gone.
    """

    def __init__(self, make: Callable[[], Awaitable[T]], undo: Callable[[T], None] | None,
                 cancel_on_abandon: bool) -> None:
        self.future: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._make, self._undo, self._cancel_on_abandon = make, undo, cancel_on_abandon
        self._task: asyncio.Future[T] | None = None
        self._abandoned = False
        self._reported = False

    def start(self, in_flight: dict[asyncio.Future[Any], bool]) -> None:
        if not self._abandoned:
            self._task = task = asyncio.ensure_future(self._make())
            in_flight[task] = self._cancel_on_abandon
            task.add_done_callback(self._done)
            task.add_done_callback(lambda _: in_flight.pop(task, None))

    def _done(self, task: asyncio.Future[T]) -> None:
        self._reported = True
        if self._abandoned:
            self._undo_result(task)
        elif task.cancelled():  # by close(), while a thread waited
            self.future.set_exception(RuntimeError("the SyncLockManager was closed while this call waited"))
        elif (error := task.exception()) is not None:
            self.future.set_exception(error)
        else:
            self.future.set_result(task.result())

    def abandon(self) -> None:
        self._abandoned = True
        task = self._task
        if task is None:
            return  # never started
        if self._reported:
            self._undo_result(task)
        elif self._cancel_on_abandon:
            task.cancel()  # `_done` undoes a result that beats the cancellation

    def _undo_result(self, task: asyncio.Future[T]) -> None:
        if self._undo is not None and not task.cancelled() and task.exception() is None:
            self._undo(task.result())


class _Runtime:
    """What belongs to one process: the loop thread, the manager, each thread's holds."""

    def __init__(self, factory: Callable[[], Locks]) -> None:
        self.pid: int = os.getpid()
        self.loop: asyncio.AbstractEventLoop = asyncio.new_event_loop()
        self.thread: threading.Thread = threading.Thread(target=self._serve, name="otel-lock sync loop",
                                                         daemon=True)
        self.local: threading.local = threading.local()
        self.mutex: threading.Lock = threading.Lock()  # the holds' bookkeeping, shared by every thread
        self.closing: bool = False
        self.background: set[asyncio.Future[Any]] = set()
        self.in_flight: dict[asyncio.Future[Any], bool] = {}  # calls threads wait for: cancellable?
        self.thread.start()
        try:
            self.manager: Locks = self.run(partial(self._build, factory))
        except BaseException:
            self._stop()
            raise

    def _serve(self) -> None:
        # A process-wide signal (Ctrl-C, alarm(), a soft time limit) must reach the
        # application's threads, which can be interrupted, never this one.
        if hasattr(signal, "pthread_sigmask"):
            signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())
        self.loop.run_forever()

    @staticmethod
    async def _build(factory: Callable[[], Locks]) -> Locks:
        manager = factory()  # on the loop thread: a manager may look for its loop when made
        missing = [name for name in _NEEDED if not hasattr(manager, name)]
        if missing:
            raise TypeError(f"the SyncLockManager factory must return a lock manager (otel_lock.Locks: "
                            f"LockManager, RedLockManager), not {manager!r}: it has no {', '.join(missing)}")
        return manager

    def run(self, make: Callable[[], Awaitable[T]], undo: Callable[[T], None] | None = None,
            cancel_on_abandon: bool = True) -> T:
        """Run `make()` on the loop and wait; if this thread is interrupted, abandon it there."""
        if threading.current_thread() is self.thread:
            raise RunningLoopError("a blocking SyncLockManager call cannot run on the facade's own loop thread")
        call = _Call(make, undo, cancel_on_abandon)
        with self.mutex:
            if self.closing:
                raise RuntimeError("this SyncLockManager is closed")
            self.loop.call_soon_threadsafe(call.start, self.in_flight)
        try:
            return call.future.result()
        except BaseException:
            if not call.future.done() or call.future.exception() is None:
                self.abandon_soon(call.abandon)
            raise

    def abandon_soon(self, abandon: Callable[[], None]) -> None:
        """From the thread: run `abandon` on the loop, without waiting."""
        try:
            self.loop.call_soon_threadsafe(abandon)
        except RuntimeError:
            pass  # the loop is closed: nothing on it runs any more

    def holds(self) -> dict[str, _Hold]:
        """This thread's outer holds, by key."""
        try:
            holds: dict[str, _Hold] = self.local.holds
        except AttributeError:
            holds = self.local.holds = {}
        return holds

    def in_background(self, coro: Awaitable[Any]) -> None:
        """On the loop: run `coro` to its end, keeping a reference; its failure is logged."""
        task = asyncio.ensure_future(coro)
        self.background.add(task)
        task.add_done_callback(self._background_done)

    def _background_done(self, task: asyncio.Future[Any]) -> None:
        self.background.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("otel-lock: could not release an abandoned lock, it will expire by itself: %s",
                        task.exception())

    def close(self) -> None:
        with self.mutex:
            if self.closing:
                return
            self.closing = True
        if threading.current_thread() is self.thread:
            raise RuntimeError("SyncLockManager.close() cannot run on its own loop thread")
        try:
            call = _Call(self._aclose, None, cancel_on_abandon=False)
            self.loop.call_soon_threadsafe(call.start, {})
            call.future.result()
        finally:
            self._stop()

    async def _aclose(self) -> None:
        # Waiting acquires are cancelled (their threads are told "closed"), releases finish,
        # and so do the releases of abandoned grants; then the manager closes its connections.
        for task, cancellable in list(self.in_flight.items()):
            if cancellable:
                task.cancel()
        pending = [*self.in_flight, *self.background]
        if pending:
            await asyncio.wait(pending, timeout=_CLOSE_BOUND)
        await self.manager.aclose()

    def _stop(self) -> None:
        async def cancel_the_rest() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(cancel_the_rest(), self.loop).result()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join()
        self.loop.close()


class _LostEvent(threading.Event):
    """`held.lost`: set from the loop thread, and also by a look at it once the lease ran out.

    After a pause of the whole process (SIGSTOP) the thread may look before
    the loop thread's timer has run; `is_set()` asks the loop, whose own
    `held.lost` checks the lease's validity on the spot.
    """

    def __init__(self, runtime: _Runtime, held: HeldLock) -> None:
        super().__init__()
        self._runtime, self._held = runtime, held

    def is_set(self) -> bool:
        if super().is_set():
            return True
        runtime = self._runtime
        if runtime.pid != os.getpid() or threading.current_thread() is runtime.thread:
            return False
        try:
            if runtime.run(self._ask):
                self.set()
        except RuntimeError:  # closed: what the loop thread last told is all there is
            pass
        return super().is_set()

    async def _ask(self) -> bool:
        return self._held.lost.is_set()


class _Hold:
    """One thread's hold of one key: the lease in Redis and how many times the thread entered it.

    Made and entered in the thread's map on the loop thread, in the same step
    that receives the grant, so an abandoned grant is taken out of the map
    and released in one place.
    """

    def __init__(self, runtime: _Runtime, holds: dict[str, _Hold], key: str, held: HeldLock,
                 cancel_on_lost: bool) -> None:
        self.runtime: _Runtime = runtime
        self.holds: dict[str, _Hold] = holds
        self.key: str = key
        self.held: HeldLock = held
        self.cancel_on_lost: bool = cancel_on_lost
        # otel-lock's own managers re-enter (and count nested holds) themselves; anything else: counted here
        self.reenter: Callable[..., Awaitable[HeldLock]] | None = getattr(runtime.manager, "_reenter", None)
        self.depth: int = 0
        self.lost: threading.Event = _LostEvent(runtime, held)
        self.also_lost: list[threading.Event] = []  # a lock_all's `lost`, told of this hold's loss too
        self._watch = asyncio.ensure_future(self._tell_lost())
        with runtime.mutex:
            self.depth = 1
            holds[key] = self

    async def _tell_lost(self) -> None:
        await self.held.lost.wait()
        threading.Event.set(self.lost)
        for event in self.also_lost:
            event.set()

    def forget(self) -> bool:
        """One release by the thread: True if it was the last, which takes the key out of its map."""
        with self.runtime.mutex:
            self.depth -= 1
            if self.depth > 0:
                return False
            if self.holds.get(self.key) is self:
                del self.holds[self.key]
            return True

    async def end(self, own: HeldLock, last: bool) -> bool:
        """On the loop: the release of one of the thread's holds (`own`), the last one of the key or not."""
        if last:
            self._watch.cancel()
        return await own.release()

    async def nest(self) -> HeldLock:
        """On the loop: one more hold of this lease, as the async manager re-enters it (LockLost if gone)."""
        assert self.reenter is not None
        return await self.reenter(self.held._lease, child=False)

    def abandon(self) -> None:
        """On the loop: a grant no thread will ever see is taken out of its map and released."""
        with self.runtime.mutex:
            self.depth = 0
            if self.holds.get(self.key) is self:
                del self.holds[self.key]
        self.runtime.in_background(self.end(self.held, True))


class SyncHeldLock:
    """A hold seen from a thread: key, name, owner, token, depth, and `lost` (a threading.Event)."""

    __slots__ = ("_manager", "_hold", "_own", "depth", "_last", "_released")

    def __init__(self, manager: SyncLockManager, hold: _Hold, depth: int, own: HeldLock | None) -> None:
        self._manager, self._hold = manager, hold
        self._own = own  # the manager's hold this one releases (None: a nested hold counted here)
        self.depth: int = depth
        """Reentrancy depth in this thread: 1 for the outermost hold."""
        self._last: bool | None = None      # counted out of the thread's depth: was it the last hold?
        self._released: bool | None = None

    @property
    def key(self) -> str:
        """The full Redis key."""
        return self._hold.held.key

    @property
    def name(self) -> str:
        """The `lock.name` of metrics and spans."""
        return self._hold.held.name

    @property
    def owner(self) -> str:
        """The owner id in Redis."""
        return self._hold.held.owner

    @property
    def token(self) -> int:
        """Fencing token: strictly increasing per key."""
        return self._hold.held.token

    @property
    def lost(self) -> threading.Event:
        """Set once the lease is known lost; check it between steps of long work."""
        return self._hold.lost

    @property
    def mode(self) -> str:
        """`exclusive`, `shared` or `permit`."""
        return self._hold.held.mode

    @property
    def permits(self) -> int | None:
        """The key's limit, for a `semaphore()` hold; None for a lock."""
        return self._hold.held.permits

    def release(self) -> bool:
        """Release this hold; False if the lease was lost (or is another process's). Idempotent."""
        if self._released is None:
            if self._last is None:  # counted out once, even if the wait below is interrupted
                self._last = self._manager._count_out(self._hold)
            self._released = self._manager._release(self._hold, self._last, self._own)
        return self._released

    def __repr__(self) -> str:
        return f"<SyncHeldLock {self.key} owner={self.owner} token={self.token} depth={self.depth}>"


def _check_cancel(cancel_on_lost: object) -> None:
    """Before a nested hold is handed out or a first key taken: a flag that is not a bool is refused."""
    if cancel_on_lost is not None:
        check_flag("cancel_on_lost", cancel_on_lost)


class _PerThread(Generic[T]):
    """A `with` context that threads may share and nest, as one does a `threading.RLock`.

    Each thread's holds are kept apart, innermost last: an exit releases the
    hold its own thread entered last, never another thread's (which would
    leave its own held and renewed for ever).
    """

    __slots__ = ("_acquire", "_entered")

    def __init__(self, acquire: Callable[[], T]) -> None:
        self._acquire = acquire
        # A thread only ever adds or removes its own entry: no lock needed.
        self._entered: dict[int, list[T]] = {}

    def _enter(self) -> T:
        held = self._acquire()
        self._entered.setdefault(threading.get_ident(), []).append(held)
        return held

    def _exit(self) -> T:
        me = threading.get_ident()
        stack = self._entered.get(me)
        if not stack:
            raise RuntimeError(f"{type(self).__name__} exited in a thread that is not inside it: each `with` "
                               "releases the hold its own thread took (to let go of a hold from another thread, "
                               "hand that thread the hold and call held.release())")
        held = stack.pop()
        if not stack:
            del self._entered[me]
        return held


class SyncLockContext(_PerThread[SyncHeldLock]):
    """`with locks.lock(...) as held:`: acquire on enter, release on exit (LockLost on loss, if asked)."""

    __slots__ = ()

    def __enter__(self) -> SyncHeldLock:
        return self._enter()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        held = self._exit()
        try:
            held.release()
        except RedisUnavailable as error:
            log.warning("otel-lock: could not release %s, it will expire by itself: %s", held.key, error)
        if exc_type is None and held._hold.cancel_on_lost and held.lost.is_set():
            raise LockLost(f"lease of {held.key} was lost while the block ran", key=held.key,
                           reason="lost while held")


class _AnyLost(threading.Event):
    """`held.lost` of a lock_all: set once the lease of any of its keys is known lost."""

    def __init__(self, holds: list[SyncHeldLock]) -> None:
        super().__init__()
        self._holds = holds
        for held in holds:
            held._hold.also_lost.append(self)
        if any(threading.Event.is_set(held._hold.lost) for held in holds):
            self.set()

    def detach(self) -> None:
        """The holds ended: stop listening (a long-held hold re-entered by many lock_all calls keeps no list)."""
        for held in self._holds:
            if self in held._hold.also_lost:
                held._hold.also_lost.remove(self)

    def is_set(self) -> bool:
        if not super().is_set() and any(held.lost.is_set() for held in self._holds):
            self.set()
        return super().is_set()


class SyncHeldLocks:
    """What `lock_all()` gives a thread: one `SyncHeldLock` per key, in the canonical order."""

    __slots__ = ("keys", "holds", "tokens", "lost", "_released")

    def __init__(self, keys: list[str], holds: list[SyncHeldLock]) -> None:
        self.keys: tuple[str, ...] = tuple(keys)
        """The keys as the caller named them (duplicates folded), in the order they were taken."""
        self.holds: tuple[SyncHeldLock, ...] = tuple(holds)
        """One hold per key, same order (`.key` is the full Redis key)."""
        self.tokens: dict[str, int] = {key: held.token for key, held in zip(keys, holds)}
        """Fencing token per key."""
        self.lost: threading.Event = _AnyLost(holds)
        """Set once the lease of any one key is known lost."""
        self._released: bool | None = None

    def release(self) -> bool:
        """Release every hold, the last taken first; False if any was lost. Idempotent."""
        if self._released is None:
            try:
                self._released = _release_each(self.holds)
            finally:
                if isinstance(self.lost, _AnyLost):
                    self.lost.detach()
        return self._released

    def __repr__(self) -> str:
        return f"<SyncHeldLocks {', '.join(f'{k}={t}' for k, t in self.tokens.items())}>"


def _release_each(holds: Iterable[SyncHeldLock]) -> bool:
    """Release in reverse order, every one even if one fails; the first error after that."""
    ok, error = True, None
    for held in reversed(list(holds)):
        try:
            ok = held.release() and ok
        except LockError as exc:
            error = error or exc
    if error is not None:
        raise error
    return ok


class SyncMultiLockContext(_PerThread[SyncHeldLocks]):
    """`with locks.lock_all([...]) as held:`: every key on enter, all released on exit."""

    __slots__ = ()

    def __enter__(self) -> SyncHeldLocks:
        return self._enter()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        held = self._exit()
        try:
            held.release()
        except RedisUnavailable as error:
            log.warning("otel-lock: could not release every lock of %s, they will expire by themselves: %s",
                        ", ".join(held.keys), error)
        lost = [h for h in held.holds if h._hold.cancel_on_lost and h.lost.is_set()]
        if exc_type is None and lost:
            raise LockLost(f"lease of {lost[0].key} was lost while the block ran", key=lost[0].key,
                           reason="lost while held")


class SyncLockManager:
    """`with locks.lock("job:cleanup"):` from plain threads, over any `Locks` manager.

    `SyncLockManager(factory)` calls `factory()` (on its loop thread) once per
    process for a new manager: `lambda: RedLockManager.from_urls([...])`.
    `SyncLockManager.from_url(url, ...)` builds a `LockManager.from_url`.
    `cancel_on_lost` is the default of `lock()`: see the module docstring.
    """

    def __init__(self, factory: Callable[[], Locks], *, cancel_on_lost: bool = False) -> None:
        if isinstance(factory, str) or not callable(factory):
            raise TypeError(f"SyncLockManager takes a factory that returns a lock manager, not {factory!r}; "
                            f"for a URL use SyncLockManager.from_url(url)")
        self._factory = factory
        self._cancel_on_lost = check_flag("cancel_on_lost", cancel_on_lost)
        self._permit_ids = itertools.count(1)
        self._closed = False
        self._runtime: _Runtime | None = None
        self._current()  # built now: a bad URL or option fails here, not at first use

    @classmethod
    def from_url(cls, url: str, *, namespace: str | None = None, lease: float | None = None,
                 wait: float | None = None, cancel_on_lost: bool = False, fence_ttl: float | None = None,
                 poll_cap: float | None = None, renew_interval: float | None = None,
                 wait_replicas: int | None = None, wait_replicas_timeout: float | None = None,
                 breaker_failures: int | None = None, breaker_cooldown: float | None = None,
                 tracer_provider: TracerProvider | None = None, meter_provider: MeterProvider | None = None,
                 socket_timeout: float | None = None, socket_connect_timeout: float | None = None,
                 max_connections: int | None = None, pool_timeout: float | None = None,
                 redis_options: Mapping[str, Any] | None = None) -> SyncLockManager:
        """A facade over `LockManager.from_url(url, ...)`; None leaves that option at its default.

        `redis_options`: any other redis-py client option (`password`,
        `ssl_ca_certs`, ...). `cancel_on_lost` is this facade's default.
        """
        named: dict[str, Any] = {
            "namespace": namespace, "lease": lease, "wait": wait, "fence_ttl": fence_ttl, "poll_cap": poll_cap,
            "renew_interval": renew_interval, "wait_replicas": wait_replicas,
            "wait_replicas_timeout": wait_replicas_timeout, "breaker_failures": breaker_failures,
            "breaker_cooldown": breaker_cooldown, "tracer_provider": tracer_provider,
            "meter_provider": meter_provider, "socket_timeout": socket_timeout,
            "socket_connect_timeout": socket_connect_timeout, "max_connections": max_connections,
            "pool_timeout": pool_timeout}
        options = {name: value for name, value in named.items() if value is not None}
        extra = dict(redis_options or {})
        if twice := sorted(set(extra) & set(named)):
            raise TypeError(f"redis_options must not repeat a named option: {', '.join(twice)}")
        return cls(partial(LockManager.from_url, url, **options, **extra), cancel_on_lost=cancel_on_lost)

    # -- the process's runtime -------------------------------------------------

    def _current(self) -> _Runtime:
        """This process's runtime; a forked child builds its own at its first call."""
        runtime = self._runtime
        if runtime is not None and runtime.pid == os.getpid() and not self._closed:
            return runtime
        with _process_lock:
            if self._closed:
                raise RuntimeError("this SyncLockManager is closed")
            runtime = self._runtime
            if runtime is None or runtime.pid != os.getpid():
                # The parent's runtime is left as it is: its thread does not exist here, and
                # closing its loop or sockets would reach into the parent's (shared after fork).
                runtime = self._runtime = _Runtime(self._factory)
            return runtime

    @property
    def namespace(self) -> str:
        """The prefix of every Redis key of the manager."""
        return self._current().manager.namespace

    def unsupported_reason(self, mode: str) -> str | None:
        """Why this manager cannot take holds of `mode` (exclusive, shared or permit), or None: no round trip.

        As `LockManager.unsupported_reason`, for a start-up check; None from a `Locks` that does not say."""
        ask: Callable[[str], str | None] | None = getattr(self._current().manager, "unsupported_reason", None)
        return ask(mode) if ask is not None else None

    # -- locks -----------------------------------------------------------------

    def lock(self, key: str, *, wait: float | None = None, lease: float | None = None, name: str | None = None,
             cancel_on_lost: bool | None = None, shared: bool = False) -> SyncLockContext:
        """`with locks.lock("k", wait=5.0) as held:`; LockTimeout after `wait` seconds.

        Options as for `LockManager.lock`; `cancel_on_lost=True` raises
        LockLost as the block ends if the lease was lost meanwhile.
        """
        _refuse_in_loop("lock")
        check_key(key)
        return SyncLockContext(partial(self.acquire, key, wait=wait, lease=lease, name=name,
                                       cancel_on_lost=cancel_on_lost, shared=shared))

    def acquire(self, key: str, *, wait: float | None = None, lease: float | None = None, name: str | None = None,
                cancel_on_lost: bool | None = None, shared: bool = False) -> SyncHeldLock:
        """Block until held (LockTimeout after `wait`); re-enters a key this thread holds.

        A nested acquire takes the outer hold as it is (its own `wait`,
        `lease` and `name` are not used) and raises LockLost if that lease
        was lost: it never takes the lock afresh under the outer hold's feet.
        `shared=True`: a shared hold (`LockManager.lock`); an exclusive
        acquire inside this thread's shared hold of the key is refused.
        """
        _refuse_in_loop("acquire")
        check_key(key)  # before the thread's holds are looked up by it
        _check_cancel(cancel_on_lost)
        check_flag("shared", shared)
        nested = self._reenter(key, shared)
        if nested is not None:
            return nested
        held = self._take(key, lambda manager: manager.acquire(key, wait=wait, lease=lease, name=name,
                                                               cancel_on_lost=False, shared=shared), cancel_on_lost)
        assert held is not None, "acquire() returns a hold or raises"
        return held

    def try_lock(self, key: str, *, lease: float | None = None, name: str | None = None,
                 cancel_on_lost: bool | None = None, shared: bool = False) -> SyncHeldLock | None:
        """The hold if the lock is free right now (or this thread holds it), else None."""
        _refuse_in_loop("try_lock")
        check_key(key)  # before the thread's holds are looked up by it
        _check_cancel(cancel_on_lost)
        check_flag("shared", shared)
        nested = self._reenter(key, shared)
        if nested is not None:
            return nested
        return self._take(key, lambda manager: manager.try_lock(key, lease=lease, name=name, cancel_on_lost=False,
                                                                shared=shared), cancel_on_lost)

    def semaphore(self, key: str, *, permits: int, wait: float | None = None, lease: float | None = None,
                  name: str | None = None, cancel_on_lost: bool | None = None) -> SyncLockContext:
        """`with locks.semaphore("export:t3", permits=2) as held:` at most `permits` holders at once.

        As `LockManager.semaphore`: every call takes a permit of its own, in
        any thread (no re-entry); `held.permits` is the limit.
        """
        _refuse_in_loop("semaphore")
        check_key(key)
        return SyncLockContext(partial(self.acquire_permit, key, permits=permits, wait=wait, lease=lease, name=name,
                                       cancel_on_lost=cancel_on_lost))

    def acquire_permit(self, key: str, *, permits: int, wait: float | None = None, lease: float | None = None,
                       name: str | None = None, cancel_on_lost: bool | None = None) -> SyncHeldLock:
        """Block until a permit of `key` is held (LockTimeout after `wait`); release it with `held.release()`."""
        _refuse_in_loop("acquire_permit")
        check_key(key)
        _check_cancel(cancel_on_lost)
        slot = f"\x00permit\x00{key}\x00{next(self._permit_ids)}"  # a slot of its own in the thread's holds
        held = self._take(slot, lambda manager: manager.acquire_permit(key, permits=permits, wait=wait, lease=lease,
                                                                       name=name, cancel_on_lost=False),
                          cancel_on_lost)
        assert held is not None, "acquire_permit() returns a hold or raises"
        return held

    def lock_all(self, keys: Iterable[str], *, wait: float | None = None, lease: float | None = None,
                 name: str | None = None, cancel_on_lost: bool | None = None) -> SyncMultiLockContext:
        """`with locks.lock_all(["account:7", "account:3"], wait=5.0) as held:`; every key, or LockTimeout.

        As `LockManager.lock_all`: one canonical order, one `wait` for all,
        nothing left held on failure or interruption; keys this thread holds
        are re-entered.
        """
        _refuse_in_loop("lock_all")
        return SyncMultiLockContext(partial(self.acquire_all, keys, wait=wait, lease=lease, name=name,
                                            cancel_on_lost=cancel_on_lost))

    def acquire_all(self, keys: Iterable[str], *, wait: float | None = None, lease: float | None = None,
                    name: str | None = None, cancel_on_lost: bool | None = None) -> SyncHeldLocks:
        """Block until every key is held (all or nothing); release them with `held.release()`."""
        _refuse_in_loop("acquire_all")
        ordered = canonical(keys)
        for key in ordered:
            check_key(key)
        _check_cancel(cancel_on_lost)
        if wait is None:
            wait_s = float(getattr(self._current().manager, "wait", 5.0))
        else:
            wait_s = check_seconds("wait", wait, allow_zero=True, allow_inf=True)
        start = time.monotonic()
        taken: list[SyncHeldLock] = []
        try:
            while True:
                for key in ordered:
                    remaining = wait_s if wait_s == float("inf") else max(0.0, start + wait_s - time.monotonic())
                    try:
                        taken.append(self.acquire(key, wait=remaining, lease=lease, name=name,
                                                  cancel_on_lost=cancel_on_lost))
                    except LockTimeout as exc:
                        kind = LockBusy if wait_s == 0 else LockTimeout
                        raise kind(f"locks {', '.join(ordered)} were not all acquired within {wait_s} s: "
                                   f"{exc.key} was held by another owner", key=exc.key,
                                   waited=time.monotonic() - start) from exc
                # As LockManager.acquire_all: a key that ran out while a later one was waited for is
                # never handed out as held; let go and take them again within the same wait.
                gone = [held for held in taken[:-1] if held.lost.is_set()]
                if not gone:
                    return SyncHeldLocks(ordered, taken)
                letting_go, taken = taken, []
                _release_each(letting_go)
                if wait_s != float("inf") and time.monotonic() >= start + wait_s:
                    raise LockTimeout(f"locks {', '.join(ordered)} were not all held at once within {wait_s} s: "
                                      f"{gone[0].key} ran out while a later key was waited for", key=gone[0].key,
                                      waited=time.monotonic() - start)
        except BaseException:
            _release_each(taken)
            raise

    def held_locks(self) -> list[LockInfo]:
        """Every lock held in the namespace (see `LockManager.held_locks`)."""
        _refuse_in_loop("held_locks")
        runtime = self._current()
        return runtime.run(runtime.manager.held_locks)

    def force_release(self, key: str) -> bool:
        """Release whoever holds `key` (an operator's last resort)."""
        _refuse_in_loop("force_release")
        check_key(key)
        runtime = self._current()
        return runtime.run(partial(runtime.manager.force_release, key))

    def health(self) -> ServerHealth:
        """The manager's current verdict on its servers and data model (see `LockManager.health`).

        No round trip: what the manager's server watch last saw, for a
        worker's health endpoint or a script's pre-flight check.
        """
        runtime = self._current()
        read = self._checks_of(runtime.manager, "health")

        async def on_the_loop() -> ServerHealth:  # the manager's state belongs to its loop thread
            return cast(ServerHealth, read())
        return runtime.run(on_the_loop)

    def check_servers(self) -> tuple[ServerReport, ...]:
        """Run the server checks now and return their reports (what `otel-lock doctor` prints)."""
        _refuse_in_loop("check_servers")
        runtime = self._current()
        return runtime.run(self._checks_of(runtime.manager, "check_servers"))

    @staticmethod
    def _checks_of(manager: Locks, method: str) -> Callable[[], Any]:
        found = getattr(manager, method, None)
        if found is None:
            raise TypeError(f"{type(manager).__name__} has no {method}(): a manager of otel-lock's "
                            "(LockManager, RedLockManager) has")
        return cast("Callable[[], Any]", found)

    def close(self) -> None:
        """Stop the manager and its loop thread; locks still held expire after their lease.

        Idempotent. In a forked child it only forgets the parent's runtime.
        """
        with _process_lock:
            if self._closed:
                return
            self._closed = True
            runtime, self._runtime = self._runtime, None
        if runtime is not None and runtime.pid == os.getpid():
            runtime.close()

    def __enter__(self) -> SyncLockManager:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    # -- inside ------------------------------------------------------------------

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run one coroutine on this process's loop and wait (tests look at the loop this way)."""
        try:
            runtime = self._current()
        except BaseException:
            coro.close()
            raise
        return runtime.run(lambda: coro)

    def _reenter(self, key: str, shared: bool = False) -> SyncHeldLock | None:
        """A nested hold of a key this thread holds; None if it holds none.

        Counted in the thread first, so that a release racing it cannot miss
        it; then the manager re-enters the lease as the async API does.
        """
        runtime = self._current()
        hold = runtime.holds().get(key)
        if hold is None:
            return None
        if not shared and getattr(hold.held, "mode", "exclusive") == "shared":
            raise LockError(f"lock {hold.held.key} is held shared by this thread: an exclusive hold of it would "
                            "wait for itself (release the shared hold first)", key=hold.held.key)
        if hold.lost.is_set():
            raise LockLost(f"lease of {hold.held.key} was lost: a nested acquire cannot re-enter it",
                           key=hold.held.key, reason="lost before re-entry")
        with runtime.mutex:
            if runtime.holds().get(key) is not hold:
                return None  # released meanwhile (by another thread): take it afresh
            hold.depth += 1
            depth = hold.depth
        if hold.reenter is None:
            return SyncHeldLock(self, hold, depth, None)
        try:
            nested = runtime.run(hold.nest, undo=lambda inner: runtime.in_background(inner.release()))
            return SyncHeldLock(self, hold, depth, nested)
        except BaseException:
            hold.forget()  # never entered (lost, Redis down, interrupted): out of the thread's count again
            raise

    def _take(self, key: str, take: Callable[[Locks], Awaitable[HeldLock | None]],
              cancel_on_lost: bool | None) -> SyncHeldLock | None:
        runtime = self._current()
        holds = runtime.holds()
        cancel = self._cancel_on_lost if cancel_on_lost is None else cancel_on_lost  # checked by the callers

        caller = threading.current_thread()
        who = f"{caller.name}#{caller.ident}"

        async def held() -> _Hold | None:
            if holds:  # the thread holds locks: its wait may close a cycle (`_deadlock.py`)
                THREAD_HOLDS.set((partial(_owners, holds), who))
            got = await take(runtime.manager)
            return None if got is None else _Hold(runtime, holds, key, got, cancel)

        hold = runtime.run(held, undo=_abandon_hold)
        if hold is None:
            return None
        try:
            return SyncHeldLock(self, hold, 1, hold.held)
        except BaseException:  # interrupted before the caller could see the hold: let it go
            runtime.abandon_soon(hold.abandon)
            raise

    @staticmethod
    def _count_out(hold: _Hold) -> bool:
        """One release of the thread's hold: True if it was the last (a hold inherited across fork: never)."""
        return hold.runtime.pid == os.getpid() and hold.forget()

    def _release(self, hold: _Hold, last: bool, own: HeldLock | None) -> bool:
        runtime = hold.runtime
        if runtime.pid != os.getpid():
            return False  # inherited across fork: the parent's lock, not this process's
        if hold.reenter is None:  # counted here: only the thread's last release reaches Redis
            if not last:
                return not hold.lost.is_set()
            own = hold.held
        if runtime.closing:
            return False  # closed meanwhile: the lease expires by itself
        assert own is not None
        return runtime.run(partial(hold.end, own, last), cancel_on_abandon=False)


def _owners(holds: dict[str, _Hold]) -> list[str]:
    """The owner ids of a thread's holds (read on the loop thread when its wait may close a cycle)."""
    return [hold.held.owner for hold in list(holds.values()) if not hold.held._lease.ended]


def _abandon_hold(hold: _Hold | None) -> None:
    if hold is not None:
        hold.abandon()
