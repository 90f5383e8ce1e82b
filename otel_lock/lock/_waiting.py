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

There is one subscriber loop, whatever carries it: the lean connection
(`_connection.py`, TLS included), or redis-py's PubSub behind the same face
(`PubSubConnection`) for a client whose connections are a class of the
caller's own. Either way an idle subscriber is PINGed every HEALTH_INTERVAL,
and one whose PING is not answered in time (a flow a load balancer, NAT or
firewall dropped without a word) is closed and subscribed again.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
from typing import Any, Awaitable, Callable, NamedTuple, Protocol

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

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


class Subscriber(Protocol):
    """A subscriber connection as `Waiting` drives it: the lean `Connection`, or a `PubSubConnection`."""

    async def execute(self, *args: Any) -> Any: ...  # SUBSCRIBE, PING: raises when not answered in time

    async def aclose(self) -> None: ...


class PubSubConnection:
    """redis-py's PubSub with the lean connection's face, for a client with a connection class of its own.

    `execute("SUBSCRIBE", channel)` and `execute("PING")` wait for their
    confirmation at most `timeout` seconds (then the connection is closed,
    as the lean one drops a socket whose reply is late); published messages
    go to `on_push` as the lean connection's pushes; `on_lost` runs once when
    the connection ends, including when redis-py reconnected by itself
    (a subscribe confirmation nobody asked for), so that the loop above
    subscribes again and its waiters poll for what was missed meanwhile.
    """

    def __init__(self, redis: Any, timeout: float | None, *, on_push: Callable[[Any], None],
                 on_lost: Callable[[], None]) -> None:
        self._pubsub = redis.pubsub()
        self._timeout = timeout or HEALTH_INTERVAL
        self._on_push, self._on_lost = on_push, on_lost
        self._answers: collections.deque[asyncio.Future[Any]] = collections.deque()
        self._reader: asyncio.Task[None] | None = None
        self._ended = False

    async def execute(self, *args: Any) -> Any:
        if self._ended:
            raise RedisConnectionError("the subscriber connection was closed")
        answer: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._answers.append(answer)
        try:
            command = str(args[0]).upper()
            if command == "SUBSCRIBE":
                await self._pubsub.subscribe(*args[1:])  # recorded: redis-py subscribes again on a reconnect
            elif command == "PING":
                await self._pubsub.ping()
            else:
                raise ValueError(f"a subscriber sends SUBSCRIBE and PING only, not {command}")
            if self._reader is None:
                self._reader = asyncio.create_task(self._read(), name="otel-lock subscriber reader")
            async with asyncio.timeout(self._timeout):
                return await answer
        except TimeoutError:
            self._end()
            raise RedisTimeoutError(f"the subscriber's {args[0]} was not answered within {self._timeout} s") from None
        finally:
            if answer in self._answers:
                self._answers.remove(answer)

    async def _read(self) -> None:
        try:
            while True:
                message = await self._pubsub.get_message(timeout=None)
                if message is None:
                    continue
                kind = message["type"]
                kind = kind.decode() if isinstance(kind, bytes) else kind
                if kind == "message":
                    self._on_push([b"message", message["channel"], message["data"]])
                elif self._answers:
                    answer = self._answers.popleft()
                    if not answer.done():
                        answer.set_result(message)
                elif kind == "subscribe":  # redis-py reconnected and subscribed again: notices were missed
                    break
        except Exception:  # noqa: BLE001  # whatever ended the reading, the loop above must hear of it
            pass
        self._end()

    def _end(self) -> None:
        """Stop reading, fail what waits for an answer, tell the loop once (closing is `aclose`'s)."""
        if self._ended:
            return
        self._ended = True
        reader = self._reader
        if reader is not None and reader is not asyncio.current_task():
            reader.cancel()  # before the socket closes: its redis-py retry would reconnect
        while self._answers:
            answer = self._answers.popleft()
            if not answer.done():
                answer.set_exception(RedisConnectionError("the subscriber connection was lost"))
        self._on_lost()

    async def aclose(self) -> None:
        self._ended = True
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._reader
        with contextlib.suppress(Exception):
            await asyncio.shield(self._pubsub.aclose())


class Waiter:
    """One caller waiting for one lock; `next()` gives a Grant, POLL, PROMOTED, or None (timer).

    One is made for every acquisition that may queue (before its first
    request, so that no grant can come too early), most of which never
    wait: the future `next()` awaits is made only when it has to wait.
    """

    __slots__ = ("id", "key", "_value", "_ready")

    def __init__(self, waiter_id: str, key: str) -> None:
        self.id = waiter_id
        self.key = key
        self._value: Grant | str | None = None  # the unread wake-up
        self._ready: asyncio.Future[None] | None = None  # what `next()` awaits while it waits

    def wake(self, value: Grant | str) -> None:
        # Wake-ups are not queued: the strongest unread one wins (a grant beats a poll).
        if self._value is None or _rank(value) > _rank(self._value):
            self._value = value
            _resolve(self._ready)

    @property
    def granted(self) -> bool:
        """An unread grant: the lock was handed to this waiter."""
        return isinstance(self._value, Grant)

    async def next(self, timeout: float | None) -> Grant | str | None:
        """The next wake-up, consumed, or None after `timeout` seconds."""
        if self._value is None:
            ready = self._ready = asyncio.get_running_loop().create_future()
            # a timer that ends the wait without a value: cheaper than a timeout scope per wait
            timer = None if timeout is None else ready.get_loop().call_later(timeout, _resolve, ready)
            try:
                await ready
            finally:
                self._ready = None
                if timer is not None:
                    timer.cancel()
        value, self._value = self._value, None
        return value


def _resolve(ready: asyncio.Future[None] | None) -> None:
    if ready is not None and not ready.done():
        ready.set_result(None)


class Waiting:
    """The manager's subscriber and its registry of local waiters."""

    sharded = False  # True: wake channels are per slot, published with SPUBLISH (Redis Cluster)

    def __init__(self, channel: str, subscriber: Callable[..., Subscriber] | None,
                 on_orphan: Callable[[str, str], None] | None = None,
                 on_idle: Callable[[], Awaitable[None]] | None = None) -> None:
        self._subscriber = subscriber  # makes a subscriber connection (on_push=, on_lost=); None: `start()` is its own
        self._on_orphan = on_orphan
        self._on_idle = on_idle  # called when idle (Sentinel: is the master still it?)
        self.channel = channel
        self._waiters: dict[str, Waiter] = {}
        self._by_key: dict[str, dict[str, Waiter]] = {}  # in arrival order
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
        queue = self._by_key.get(key)
        if queue is None:
            queue = self._by_key[key] = {}
        queue[waiter_id] = waiter
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

    def _set_subscribed(self, error: BaseException | None = None) -> None:
        if self._subscribed is not None and not self._subscribed.done():
            if error is None:
                self._subscribed.set_result(None)
            else:
                self._subscribed.set_exception(error)

    async def _listen(self) -> None:
        """Subscribe, watch, and subscribe again whenever the connection ends."""
        assert self._subscriber is not None
        lost = asyncio.Event()
        first = True
        while True:
            connection = self._subscriber(on_push=self._on_push, on_lost=lost.set)
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

    async def _watch(self, connection: Subscriber, lost: asyncio.Event) -> None:
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

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
            self._task = None
