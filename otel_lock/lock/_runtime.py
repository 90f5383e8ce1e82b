"""A manager per process and event loop: what it opens on each, and how it lets go.

A manager is made once (often at import time) and used from wherever the
app runs: the serving loop, `asyncio.run` per job, a test client's loop per
request, a thread with its own loop, a forked worker. Sockets, tasks and
futures belong to one loop of one process, so each manager keeps a
`Runtime` per loop: its transport (connections, subscriber), its watchdog
and its background tasks, made at the first call on that loop.

- When the loop shuts down (`asyncio.run`, `asyncio.Runner`, anyio,
  pytest-asyncio, uvloop: they all finalize async generators after
  cancelling the tasks), the runtime closes its connections. It watches for
  that with an async generator of its own, which the loop finalizes last.
- After `fork()` the child forgets every runtime it inherited without
  touching them (their sockets are the parent's) and the manager takes a new
  identity: new owner ids and wake channel, new connections on first use.
"""

from __future__ import annotations

import asyncio
import logging
import os
import weakref
from typing import Any, AsyncIterator, Awaitable, Callable, Coroutine

from ._background import Background
from ._transport import Transport
from ._watchdog import Watchdog

log = logging.getLogger("otel_lock")

# Runtimes a forked child inherited: kept referenced, never used, never closed
# (closing them would tear down state the parent still uses).
_INHERITED: list[Runtime] = []


class Runtime:
    """A manager's transport, watchdog and background tasks on one event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop, transport: Transport, watchdog: Watchdog, background: Background,
                 client: Any, owns_client: bool) -> None:
        self.loop: asyncio.AbstractEventLoop = loop
        self.transport: Transport = transport
        self.watchdog: Watchdog = watchdog
        self.background: Background = background
        self.client: Any = client  # a redis-py client, or a RedLock quorum's list of them
        self.owns_client: bool = owns_client
        self.closed: bool = False
        self.checked: bool = False  # the first-use checks (data model, server) passed on this loop
        self._checking: asyncio.Future[None] | None = None
        self.guard: asyncio.Future[Any] | None = None  # the guard that stays awake (`_server_watch.py`)
        self.pid: int = os.getpid()
        self._closer = _on_shutdown(weakref.ref(self))
        _start(self._closer)

    async def first_use(self, check: Callable[[Transport], Awaitable[None]]) -> None:
        """Run `check(transport)` once for every caller that arrives before it passed; a failure is not kept."""
        if self._checking is None or (self._checking.done() and self._checking.exception() is not None):
            self._checking = asyncio.ensure_future(check(self.transport))
        await asyncio.shield(self._checking)
        self.checked = True

    def keep_awake(self, guard: Callable[[], Coroutine[Any, Any, None]]) -> None:
        """Run the guard (`_server_watch.py`) until the runtime closes; started once, again if it ended."""
        if self.guard is None or self.guard.done():
            self.guard = asyncio.ensure_future(guard())
            self.guard.add_done_callback(_guard_ended)

    def recheck(self) -> None:
        """The next acquisition runs the first-use checks again (the guard saw the server or the model change)."""
        self.checked = False
        if self._checking is not None and self._checking.done():
            self._checking = None

    async def aclose(self) -> None:
        """Stop the watchdog and the subscriber, finish clean-ups, close connections (never a child's copy)."""
        if self.closed or self.pid != os.getpid():
            return
        self.closed = True
        if self.guard is not None:
            self.guard.cancel()
            await asyncio.gather(self.guard, return_exceptions=True)
        await self.watchdog.aclose()
        # Before the connections close: a task cancelled mid-connect would otherwise
        # hand a fresh socket back to an already closed pool.
        await self.background.aclose()
        await self.transport.aclose()
        if self.owns_client:
            await _close_client(self.client)


def _guard_ended(guard: asyncio.Future[Any]) -> None:
    if not guard.cancelled() and guard.exception() is not None:
        log.warning("otel-lock: the server watch stopped: %r", guard.exception())


async def _close_client(client: Any) -> None:
    if isinstance(client, (list, tuple)):
        for one in client:
            await one.aclose()
    else:
        await client.aclose()


async def _on_shutdown(runtime: weakref.ref[Runtime]) -> AsyncIterator[None]:
    """Suspended for the loop's life; the loop finalizes it at shutdown, after the tasks."""
    try:
        yield
    finally:
        alive = runtime()
        if alive is not None:
            await alive.aclose()


async def _closing(close: Callable[[], Awaitable[Any]]) -> AsyncIterator[None]:
    try:
        yield
    finally:
        await close()


def at_loop_shutdown(close: Callable[[], Awaitable[Any]]) -> AsyncIterator[None]:
    """Call `close()` when the running event loop shuts down (after its tasks); keep the result referenced."""
    generator = _closing(close)
    _start(generator)
    return generator


def _start(generator: AsyncIterator[None]) -> None:
    """Run the generator to its first `yield` now: that registers it with the running loop's hooks."""
    step = generator.__anext__()
    try:
        step.send(None)  # type: ignore[attr-defined]  # the awaitable of __anext__ is a coroutine-like
    except StopIteration:
        pass


class Runtimes:
    """A manager's runtimes, by loop, in this process; `here()` is the current loop's."""

    def __init__(self, make: Callable[[asyncio.AbstractEventLoop, int], Runtime]) -> None:
        self._make = make
        self._by_loop: dict[asyncio.AbstractEventLoop, Runtime] = {}
        self._made = 0

    def here(self) -> Runtime:
        loop = asyncio.get_running_loop()
        runtime = self._by_loop.get(loop)
        if runtime is None or runtime.closed:
            self._forget_closed_loops()
            runtime = self._by_loop[loop] = self._make(loop, self._made)
            self._made += 1
        return runtime

    def current(self) -> Runtime | None:
        """The current loop's runtime, if there is a running loop and it has one."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return None
        return self._by_loop.get(loop)

    def all(self) -> list[Runtime]:
        return list(self._by_loop.values())

    def _forget_closed_loops(self) -> None:
        for loop in [loop for loop in self._by_loop if loop.is_closed()]:
            del self._by_loop[loop]

    def forked(self) -> None:
        """In a forked child: forget every runtime (the parent's), touching none of them."""
        _INHERITED.extend(self._by_loop.values())
        self._by_loop = {}
        self._made = 0

    async def aclose(self) -> None:
        """Close this loop's runtime now; ask the other live loops to close theirs."""
        here = self.current()
        for runtime in self.all():
            if runtime is here:
                continue
            if not runtime.loop.is_closed() and runtime.loop.is_running():
                asyncio.run_coroutine_threadsafe(runtime.aclose(), runtime.loop)
        self._by_loop = {}
        if here is not None:
            await here.aclose()
