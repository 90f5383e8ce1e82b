"""Wake-on-release: one subscriber connection per manager, one waiter woken per release.

A release hands the lock to the first live waiter in the lock's Redis queue
and publishes `<waiter id> <token> <redis time>` on that waiter's manager
channel, so only the new holder wakes. Locally, waiters of one lock are kept in arrival order
and only the first of them polls Redis as a fallback (bounded by the holder's
remaining TTL), so a lost message never strands anybody and the poll rate
does not grow with the number of waiters. After the subscriber reconnects
(messages may have been lost meanwhile) every waiter polls once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import OrderedDict
from typing import NamedTuple

from redis.exceptions import RedisError

log = logging.getLogger("otel_lock")

class Grant(NamedTuple):
    """The lock was handed to this waiter: its token, and Redis' time of the hand-over (us)."""

    token: int
    at_us: int


POLL = "poll"          # look at Redis now
PROMOTED = "promoted"  # became the first local waiter: start the fallback poll
RECONNECT_DELAY = 0.2
HEALTH_INTERVAL = 2.0  # seconds between PINGs on an idle subscriber connection
EARLY_LIMIT = 1024     # grants for waiters not (or no longer) registered, kept briefly


class Waiter:
    """One caller waiting for one lock; resolved with a Grant, POLL, PROMOTED, or None (timer)."""

    __slots__ = ("id", "key", "_future", "_loop")

    def __init__(self, waiter_id: str, key: str) -> None:
        self.id = waiter_id
        self.key = key
        self._loop = asyncio.get_running_loop()
        self._future: asyncio.Future = self._loop.create_future()

    def wake(self, value: object) -> None:
        future = self._future
        if future.done():
            # A grant beats a pending POLL/PROMOTED/timer: never lose one.
            if future.cancelled() or (isinstance(value, Grant) and not isinstance(future.result(), Grant)):
                future = self._future = self._loop.create_future()
            else:
                return
        future.set_result(value)

    async def next(self, timeout: float | None) -> object | None:
        """The next wake-up, or None after `timeout` seconds (one timer, no extra task)."""
        future = self._future
        handle = None if timeout is None else self._loop.call_later(timeout, _expire, future)
        try:
            value = await future
        finally:
            if handle is not None:
                handle.cancel()
        if self._future is future and not isinstance(value, Grant):
            self._future = self._loop.create_future()
        return value

    def grant(self) -> Grant | None:
        """The grant if the lock was handed to this waiter already."""
        future = self._future
        if future.done() and not future.cancelled() and isinstance(future.result(), Grant):
            return future.result()
        return None


def _expire(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)


class Waiting:
    """The manager's subscriber and its registry of local waiters."""

    def __init__(self, redis, channel: str, subscriber=None) -> None:
        self._redis = redis
        self._subscriber = subscriber  # makes a lean Connection, when the client allows one
        self.channel = channel
        self._waiters: dict[str, Waiter] = {}
        self._by_key: dict[str, OrderedDict[str, Waiter]] = {}
        # Grants that arrived before their waiter registered: the enqueue
        # reply and the grant travel on different connections, in any order.
        self._early: OrderedDict[str, Grant] = OrderedDict()
        self._task: asyncio.Task | None = None
        self._subscribed: asyncio.Future | None = None

    @property
    def ready(self) -> bool:
        return self._subscribed is not None and self._subscribed.done() and not self._subscribed.exception()

    async def start(self) -> None:
        """Subscribe once; later calls return at once."""
        if self._task is None or self._task.done():
            self._subscribed = asyncio.get_running_loop().create_future()
            self._task = asyncio.create_task(self._listen(), name="otel-lock subscriber")
        await asyncio.shield(self._subscribed)

    def add(self, waiter_id: str, key: str) -> Waiter:
        """Register a waiter, behind the other local waiters of its key."""
        waiter = Waiter(waiter_id, key)
        self._waiters[waiter_id] = waiter
        early = self._early.pop(waiter_id, None)
        if early is not None:
            waiter.wake(early)
        queue = self._by_key.setdefault(key, OrderedDict())
        queue[waiter_id] = waiter
        return waiter

    def is_first(self, waiter: Waiter) -> bool:
        queue = self._by_key.get(waiter.key)
        return bool(queue) and next(iter(queue)) == waiter.id

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

    async def _listen(self) -> None:
        if self._subscriber is not None:
            await self._listen_direct()
        else:
            await self._listen_redis_py()

    async def _listen_direct(self) -> None:
        """Subscriber on the lean connection: a reply per message, no timers."""
        lost = asyncio.Event()
        first = True
        while True:
            connection = self._subscriber(on_push=self._on_push, on_lost=lost.set)
            try:
                await connection.execute("SUBSCRIBE", self.channel)
            except (RedisError, OSError) as exc:
                await connection.aclose()
                if first:
                    self._subscribed.set_exception(exc)
                    return
                await asyncio.sleep(RECONNECT_DELAY)
                continue
            if first:
                first = False
                self._subscribed.set_result(None)
            else:
                self._poll_all()  # re-subscribed: grants may have been missed meanwhile
            try:
                await self._watch(connection, lost)
            finally:
                await connection.aclose()
            lost.clear()
            log.warning("otel-lock subscriber lost its connection; waiters poll until it is back")
            self._poll_all()
            await asyncio.sleep(RECONNECT_DELAY)

    @staticmethod
    async def _watch(connection, lost: asyncio.Event) -> None:
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

    def _on_push(self, reply) -> None:
        if reply[0] == b"message":
            self._deliver(reply[2])

    async def _listen_redis_py(self) -> None:
        """Subscriber for clients the lean connection does not cover (TLS, RESP3, ...)."""
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
                        self._subscribed.set_exception(exc)
                        return
                    log.warning("otel-lock subscriber lost its connection (%s); waiters poll", exc)
                    self._poll_all()
                    await asyncio.sleep(RECONNECT_DELAY)
                    with contextlib.suppress(Exception):
                        await pubsub.reset()
                    pubsub = self._redis.pubsub()
                    continue
                if message is None:
                    continue
                kind = message["type"]
                if kind in ("subscribe", b"subscribe"):
                    if first:
                        first = False
                        self._subscribed.set_result(None)
                    else:
                        self._poll_all()
                elif kind in ("message", b"message"):
                    self._deliver(message["data"])
        finally:
            with contextlib.suppress(Exception):
                await asyncio.shield(pubsub.aclose())

    def _deliver(self, data: bytes | str) -> None:
        if isinstance(data, bytes):
            data = data.decode()
        waiter_id, token, at_us = data.rsplit(" ", 2)
        grant = Grant(int(token), int(at_us))
        waiter = self._waiters.get(waiter_id)
        if waiter is not None:
            waiter.wake(grant)
        else:
            self._early[waiter_id] = grant
            if len(self._early) > EARLY_LIMIT:
                self._early.popitem(last=False)

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
            self._task = None
