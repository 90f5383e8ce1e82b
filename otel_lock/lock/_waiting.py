"""Wake-on-release: one subscriber connection per manager, one waiter woken per release.

A release hands the lock to the first live waiter in the lock's Redis queue
and publishes `<waiter id> <token> <lock key>` on that waiter's manager
channel, so only that waiter wakes, and it needs no round trip to start. A
grant for a waiter this manager no longer has is passed on at once
(`on_orphan`). Waiters are registered before their first queued request, so
a grant can never arrive "too early".

Locally, waiters of one lock are kept in arrival order and only the first of
them polls Redis as a fallback (bounded by the holder's remaining TTL), so a
lost message never strands anybody and the poll rate does not grow with the
number of waiters. After the subscriber reconnects every waiter polls once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, Awaitable, Callable, NamedTuple

from redis.exceptions import RedisError

if TYPE_CHECKING:
    from ._connection import Connection

log = logging.getLogger("otel_lock")

class Grant(NamedTuple):
    """The lock was handed to this waiter, with this fencing token."""

    token: int


POLL = "poll"          # look at Redis now (the subscriber may have missed notices)
PROMOTED = "promoted"  # became the first local waiter: start the fallback poll
RECONNECT_DELAY = 0.2
HEALTH_INTERVAL = 2.0  # seconds between PINGs on an idle subscriber connection
_RANK = {None: 0, PROMOTED: 1, POLL: 2}


def _rank(value: object) -> int:
    return 3 if isinstance(value, Grant) else _RANK[value]  # type: ignore[index]


class Waiter:
    """One caller waiting for one lock; `next()` gives a Grant, POLL, PROMOTED, or None (timer)."""

    __slots__ = ("id", "key", "_value", "_event")

    def __init__(self, waiter_id: str, key: str) -> None:
        self.id = waiter_id
        self.key = key
        self._value: Grant | str | None = None
        self._event = asyncio.Event()

    def wake(self, value: Grant | str) -> None:
        # Wake-ups are not queued: the strongest unread one wins (a grant beats a poll).
        if not self._event.is_set() or _rank(value) > _rank(self._value):
            self._value = value
            self._event.set()

    @property
    def granted(self) -> bool:
        """An unread grant: the lock was handed to this waiter."""
        return self._event.is_set() and isinstance(self._value, Grant)

    async def next(self, timeout: float | None) -> Grant | str | None:
        """The next wake-up, consumed, or None after `timeout` seconds."""
        if not self._event.is_set():
            if timeout is None:
                await self._event.wait()
            else:
                # a timer that sets the event without a value: cheaper than a timeout scope per wait
                timer = asyncio.get_running_loop().call_later(timeout, self._event.set)
                try:
                    await self._event.wait()
                finally:
                    timer.cancel()
        value, self._value = self._value, None
        self._event.clear()
        return value


class Waiting:
    """The manager's subscriber and its registry of local waiters."""

    sharded = False  # True: wake channels are per slot, published with SPUBLISH (Redis Cluster)

    def __init__(self, redis: Any, channel: str, subscriber: Callable[..., Connection | None] | None = None,
                 on_orphan: Callable[[str, str], None] | None = None,
                 on_idle: Callable[[], Awaitable[None]] | None = None) -> None:
        self._redis = redis
        self._subscriber = subscriber  # makes a lean Connection, when the client allows one
        self._on_orphan = on_orphan
        self._on_idle = on_idle  # called when idle (Sentinel: is the master still it?)
        self.channel = channel
        self._waiters: dict[str, Waiter] = {}
        self._by_key: dict[str, OrderedDict[str, Waiter]] = {}
        self._task: asyncio.Task[None] | None = None
        self._subscribed: asyncio.Future[None] | None = None

    @property
    def ready(self) -> bool:
        return self._subscribed is not None and self._subscribed.done() and not self._subscribed.exception()

    def channel_for(self, key: str) -> str:
        """The channel a release of `key` publishes this manager's grants on."""
        return self.channel

    def ready_for(self, key: str) -> bool:
        return self.ready

    async def start(self, key: str | None = None) -> None:
        """Subscribe once; later calls return at once."""
        if self._task is None or self._task.done():
            self._subscribed = asyncio.get_running_loop().create_future()
            self._task = asyncio.create_task(self._listen(), name="otel-lock subscriber")
        assert self._subscribed is not None
        await asyncio.shield(self._subscribed)

    def add(self, waiter_id: str, key: str) -> Waiter:
        """Register a waiter, behind the other local waiters of its key."""
        waiter = Waiter(waiter_id, key)
        self._waiters[waiter_id] = waiter
        self._by_key.setdefault(key, OrderedDict())[waiter_id] = waiter
        return waiter

    def is_first(self, waiter: Waiter) -> bool:
        queue = self._by_key.get(waiter.key)
        if not queue:
            return False
        return next(iter(queue)) == waiter.id

    def remove(self, waiter: Waiter) -> None:
        self._waiters.pop(waiter.id, None)
        queue = self._by_key.get(waiter.key)
        if queue is None:
            return
        was_first = next(iter(queue), None) == waiter.id
        queue.pop(waiter.id, None)
        if not queue:
            del self._by_key[waiter.key]
        elif was_first:
            next(iter(queue.values())).wake(PROMOTED)

    def _poll_all(self) -> None:
        for waiter in list(self._waiters.values()):
            waiter.wake(POLL)

    def _deliver(self, data: bytes | str) -> None:
        if isinstance(data, bytes):
            data = data.decode()
        waiter_id, token, lock_key = data.split(" ", 2)
        waiter = self._waiters.get(waiter_id)
        if waiter is not None:
            waiter.wake(Grant(int(token)))
        elif self._on_orphan is not None and lock_key:
            self._on_orphan(waiter_id, lock_key)

    async def _listen(self) -> None:
        if self._subscriber is not None:
            await self._listen_direct()
        else:
            await self._listen_redis_py()

    def _set_subscribed(self, error: BaseException | None = None) -> None:
        if self._subscribed is not None and not self._subscribed.done():
            if error is None:
                self._subscribed.set_result(None)
            else:
                self._subscribed.set_exception(error)

    async def _listen_direct(self) -> None:
        """Subscriber on the lean connection: a reply per message, no timers."""
        assert self._subscriber is not None
        lost = asyncio.Event()
        first = True
        while True:
            connection = self._subscriber(on_push=self._on_push, on_lost=lost.set)
            assert connection is not None  # given only for a client that has a lean connection
            try:
                await connection.execute("SUBSCRIBE", self.channel)
            except (RedisError, OSError) as exc:
                await connection.aclose()
                if first:
                    self._set_subscribed(exc)
                    return
                await asyncio.sleep(RECONNECT_DELAY)
                continue
            if first:
                first = False
                self._set_subscribed()
            else:
                self._poll_all()  # re-subscribed: notices may have been missed meanwhile
            try:
                await self._watch(connection, lost)
            finally:
                await connection.aclose()
            lost.clear()
            log.warning("otel-lock subscriber lost its connection; waiters poll until it is back")
            self._poll_all()
            await asyncio.sleep(RECONNECT_DELAY)

    async def _watch(self, connection: Connection, lost: asyncio.Event) -> None:
        """Until the connection drops; a PING now and then finds one that went silent (half-open)."""
        while not lost.is_set():
            try:
                async with asyncio.timeout(HEALTH_INTERVAL):
                    await lost.wait()
            except TimeoutError:
                try:
                    await connection.execute("PING")  # no answer within the socket timeout: aborted
                except (RedisError, OSError):
                    return
                if self._on_idle is not None:
                    await self._on_idle()  # Sentinel: still the master? (else the watch closes this)

    def _on_push(self, reply: Any) -> None:
        if reply[0] == b"message":
            self._deliver(reply[2])

    async def _listen_redis_py(self) -> None:
        """Subscriber for clients the lean connection does not cover (RESP3, a connection class of their own)."""
        pubsub = self._redis.pubsub()
        first = True
        try:
            while True:
                try:
                    if not pubsub.subscribed:
                        await pubsub.subscribe(self.channel)
                    message = await pubsub.get_message(timeout=1.0)
                except (RedisError, OSError) as exc:
                    if first:
                        self._set_subscribed(exc)
                        return
                    log.warning("otel-lock subscriber lost its connection (%s); waiters poll", exc)
                    self._poll_all()
                    await asyncio.sleep(RECONNECT_DELAY)
                    with contextlib.suppress(Exception):
                        await pubsub.aclose()  # reset() is deprecated (and, under -W error, never ran)
                    pubsub = self._redis.pubsub()
                    continue
                if message is None:
                    if self._on_idle is not None:
                        await self._on_idle()
                    continue
                kind = message["type"]
                if kind in ("subscribe", b"subscribe"):
                    if first:
                        first = False
                        self._set_subscribed()
                    else:
                        self._poll_all()
                elif kind in ("message", b"message"):
                    self._deliver(message["data"])
        finally:
            with contextlib.suppress(Exception):
                await asyncio.shield(pubsub.aclose())

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
            self._task = None
