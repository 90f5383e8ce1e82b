"""`redis+sentinel://` URLs: a redis-py client for the master a set of Sentinels names.

The lean hiredis connection is never used for such a client (it would keep
talking to one address); redis-py's Sentinel pool asks the Sentinels for the
master on every new connection and drops a connection whose server answers
READONLY (a demoted master), so scripts, renewals and the subscriber follow a
failover.

    redis+sentinel://[[username]:password@]host1[:26379][,host2[:26379]...]/service_name[/db]

The password (and username) in the URL are the *master's*; Sentinels that
require their own go in `sentinel_password=` / `sentinel_username=` options.
"""

from __future__ import annotations

import asyncio
import copy
import weakref
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel, SentinelConnectionPool
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ReadOnlyError, RedisError

from ._connection import Connection

from ._url_hosts import UrlForm

SCHEME = "redis+sentinel"
DEFAULT_PORT = 26379
_URL = UrlForm(SCHEME, "Sentinel", DEFAULT_PORT,
               f"{SCHEME}://[[user]:password@]host1[:{DEFAULT_PORT}][,host2[:port]...]/service_name[/db]")


@dataclass(frozen=True)
class SentinelTarget:
    """What a `redis+sentinel://` URL names."""

    sentinels: tuple[tuple[str, int], ...]
    service_name: str
    db: int = 0
    username: str | None = None
    password: str | None = None


def parse_url(url: str) -> SentinelTarget:
    """Parse and validate; a ValueError says what is wrong and shows the expected form."""
    parsed = _URL.parse(url)
    segments = parsed.path.split("/")[1:] if parsed.path else []
    if not segments or not segments[0]:
        raise _URL.error(url, "the service name (the master's name in the Sentinels' config) is missing")
    if len(segments) > 2 or (len(segments) == 2 and not segments[1].isdigit()):
        raise _URL.error(url, "after the service name only a database number may follow")
    return SentinelTarget(parsed.hosts, unquote(segments[0]), int(segments[1]) if len(segments) == 2 else 0,
                          parsed.username, parsed.password)


class _BlockingSentinelPool(SentinelConnectionPool, aioredis.BlockingConnectionPool):
    """Sentinel-managed connections with from_url's blocking pool: a burst queues, bounded by `timeout`."""


class SentinelMaster(aioredis.Redis):
    """The master's client; closing it also closes its clients of the Sentinels.

    It closes the clients it was created with, not `Sentinel.sentinels`:
    redis-py reorders that list from concurrent master look-ups (swapping
    the one that answered to the front), and two interleaved swaps can drop a
    client from it, whose sockets would then never be closed.
    """

    sentinel_clients: tuple[aioredis.Redis, ...] = ()

    async def aclose(self, close_connection_pool: bool | None = None) -> None:
        await super().aclose(close_connection_pool)
        clients, self.sentinel_clients = self.sentinel_clients, ()
        await asyncio.gather(*(client.aclose() for client in clients), return_exceptions=True)


REFRESH_EVERY = 0.5  # seconds between two "who is the master?" questions to the Sentinels


class MasterWatch:
    """Asks the Sentinels who the master is (at most every REFRESH_EVERY s) and leaves an old one at once.

    redis-py asks the Sentinels only when it opens a connection. After a
    `SENTINEL FAILOVER`, or a partition that healed, the old master keeps
    running and keeps answering as a master until the Sentinels reconfigure
    it (seconds later): pooled connections to it would go on taking and
    renewing locks that the new master does not know. The manager calls
    `check()` before its scripts and renewals; when the Sentinels name another
    master, every connection of the pool is closed (in-flight calls fail with
    RedisUnavailable, the failover is under way) and the next one goes to the
    new master.
    """

    def __init__(self, pool: SentinelConnectionPool) -> None:
        self.pool = pool
        self._next = 0.0
        self._seen: tuple[str, int] | None = None  # the master at this watch's last check
        self.leans: weakref.WeakSet[MasterConnection] = weakref.WeakSet()  # closed too when the master changes

    @classmethod
    def for_client(cls, client: Any) -> "MasterWatch | None":
        pool = getattr(client, "connection_pool", None)
        return cls(pool) if isinstance(pool, SentinelConnectionPool) and pool.is_master else None

    def due(self) -> bool:
        """Is it time to ask the Sentinels again (then a call must `await check()` first)?"""
        return asyncio.get_running_loop().time() >= self._next

    async def check(self) -> None:
        now = asyncio.get_running_loop().time()
        if now < self._next:
            return
        self._next = now + REFRESH_EVERY
        # Not the pool's `master_address` alone: any new pooled connection (the Idempotency-Key
        # records, the listing) asks the Sentinels too and overwrites it, and the switch went unseen.
        known = self._seen or self.pool.master_address
        try:
            current = await self.pool.get_master_address()  # type: ignore[no-untyped-call]
        except (RedisError, OSError):
            return  # no Sentinel answered: the call itself will tell
        self._seen = current = (str(current[0]), int(current[1]))
        if known is not None and current != (str(known[0]), int(known[1])):
            await self.pool.disconnect(inuse_connections=True)
        for lean in list(self.leans):
            if lean.connected and lean.master != current:
                lean.drop()  # a subscriber among them notices, and subscribes again on the new master

    def recheck(self) -> None:
        """Ask the Sentinels at the next call, not after REFRESH_EVERY (a master answered READONLY)."""
        self._next = 0.0


class MasterConnection(Connection):
    """The lean connection (see _connection.py) to whichever server the Sentinels name master.

    Every (re)connect asks the Sentinels for the address, as redis-py's own
    Sentinel connections do; `MasterWatch` closes it when the Sentinels name
    another master, and a READONLY answer (a demoted master) closes it and
    makes the next call ask them again. Calls in flight on a closed
    connection fail as unavailable: the failover is under way.
    """

    def __init__(self, pool: SentinelConnectionPool, watch: MasterWatch, **options: Any) -> None:
        super().__init__(**options)
        self._pool, self._watch = pool, watch
        self._named = False  # has a Sentinel named the master yet? Until then _host/_port are placeholders
        watch.leans.add(self)

    @property
    def server(self) -> str:
        """The master's host:port once a Sentinel named it; before, the service (not a made-up 127.0.0.1:6379)."""
        return super().server if self._named else f"the master of Sentinel service {self._pool.service_name!r}"

    async def connect(self) -> None:
        if self.connected:
            return
        try:
            host, port = await self._pool.get_master_address()  # type: ignore[no-untyped-call]
        except (RedisError, OSError) as exc:
            raise RedisConnectionError(f"no Sentinel named a master: {exc}") from exc
        self._host, self._port, self._named = str(host), int(port), True
        await super().connect()

    @property
    def master(self) -> tuple[str, int]:
        """The address the Sentinels named when this connection opened."""
        return self._host, self._port

    async def execute(self, *args: Any) -> Any:
        try:
            return await super().execute(*args)
        except ReadOnlyError:
            self._demoted()
            raise

    async def execute_many(self, commands: list[tuple[Any, ...]]) -> list[Any]:
        results = await super().execute_many(commands)
        if any(isinstance(r, ReadOnlyError) for r in results):
            self._demoted()
        return results

    def _demoted(self) -> None:
        self._watch.recheck()
        self.drop()


def master_client(url: str, pool_timeout: float, options: dict[str, Any]) -> SentinelMaster:
    """A client for the master of `url`; `options` are redis-py connection options (socket_timeout, ...)."""
    target = parse_url(url)
    sentinel_kwargs = {k: v for k, v in options.items() if k.startswith("socket_")}
    # redis-py's default retries a refused Sentinel with seconds of backoff; a
    # Sentinel that is down must cost one refused connect (or a socket timeout).
    sentinel_kwargs["retry"] = copy.deepcopy(options["retry"]) if "retry" in options else Retry(NoBackoff(), 0)
    for key in ("sentinel_username", "sentinel_password"):
        if key in options:
            sentinel_kwargs[key.removeprefix("sentinel_")] = options.pop(key)
    if target.username:
        options["username"] = target.username
    if target.password is not None:
        options["password"] = target.password
    sentinel = Sentinel(list(target.sentinels), sentinel_kwargs=sentinel_kwargs)  # type: ignore[no-untyped-call, unused-ignore]
    client: SentinelMaster = sentinel.master_for(target.service_name, redis_class=SentinelMaster,
                                 connection_pool_class=_BlockingSentinelPool, db=target.db,
                                 timeout=pool_timeout, **options)
    client.sentinel_clients = tuple(sentinel.sentinels)
    return client
