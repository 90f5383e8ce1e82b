"""How one event loop reaches a manager's Redis: one server, a Sentinel master, or a Cluster's masters.

A `Link` is built per process and loop (`_runtime.py`) from the client the
manager was given (or its twin). It offers the same things whatever
the topology, so the transport above it has no branch on it:

- `client`: what scripts are sent on (`evalsha` / `script_load`): the lean
  connection when the client allows (redis-py's own connection classes:
  TCP, TLS or unix socket; RESP2), else redis-py itself;
- `batch(calls)`: several script calls in one round trip (per node on a
  Cluster), errors returned in place;
- `groups(keys)`: which keys may share one script call (a Cluster script
  touches one slot);
- `waiting(channel, on_orphan)`: the wake-up subscriber (sharded pub/sub on
  a Cluster);
- `servers(where)` and `subscribe_probe(address)`: what the server checks
  run their commands and their SUBSCRIBE on (every master of a Cluster).

`wait_replicas=n` wraps a link so that every write is followed by `WAIT n`
on the same connection (`_replicas.py`).
"""

from __future__ import annotations

import asyncio
import dataclasses
from functools import partial
from typing import Any, Awaitable, Callable

from redis.asyncio.cluster import RedisCluster

from . import _scripts
from ._clients import Settings, is_plain, lean_connection, settings_of
from ._cluster import slot_of
from ._connection import Connection
from ._replicas import Replicated, check_acks, with_wait
from ._routed import RoutedConnections
from ._sentinel import MasterConnection, MasterWatch
from ._sharded import ShardedWaiting
from ._waiting import PubSubConnection, Waiting
from ..telemetry._instruments import suppressed

BATCH = 1000  # keys per renewal script call (a batch carries all calls in one round trip)


class Link:
    """One server through redis-py (RESP3, a connection class of the caller's own): the base of every link."""

    sharded = False       # wake-ups on shard channels, server checks per master (a Cluster)
    trusts_grants = True  # a hand-over published by a release is the waiter's without asking again

    def __init__(self, redis: Any, settings: Settings) -> None:
        self.redis = redis
        self.settings = settings
        self.client: _scripts.ScriptClient = redis
        self.acquire_script: _scripts.Script = _scripts.acquire

    async def prepare(self) -> None:
        """Called before every script (Sentinel: still the master?)."""

    def send_now(self, script: _scripts.Script, keys: tuple[str, ...], args: list[Any],
                 on_orphan: Callable[[Any], None] | None = None) -> asyncio.Future[Any] | None:
        """The script on the wire now, its reply's future; None when the call needs `call()` (an await first).

        `on_orphan` gets the reply (or the error) if the future was cancelled first.
        """
        return None

    async def call(self, script: _scripts.Script, keys: tuple[str, ...], args: list[Any]) -> Any:
        await self.prepare()
        with suppressed():  # no Redis instrumentation span per lock call
            return await script(self.client, keys, args)

    async def batch(self, calls: list[tuple[Any, ...]]) -> list[Any]:
        await self.prepare()
        pipe = self.redis.pipeline(transaction=False)
        for call in calls:
            pipe.execute_command(*call)
        with suppressed():
            answers: list[Any] = await pipe.execute(raise_on_error=False)
        return answers

    def groups(self, keys: list[str]) -> list[range]:
        return [range(i, min(i + BATCH, len(keys))) for i in range(0, len(keys), BATCH)]

    @property
    def sender(self) -> Any:
        """What a batch is sent on, one connection (WAIT counts the writes of its own connection)."""
        return self.redis

    async def servers(self, where: str) -> list[tuple[str, Callable[..., Awaitable[Any]]]]:
        """(address, send one command) for every server the locks live on: the server checks' targets."""
        await self.prepare()
        return [(where, self.redis.execute_command)]

    def subscribe_probe(self, address: str) -> Callable[[str], Awaitable[None]] | None:
        """Subscribe once on a connection of its own to the server at `address`, as the waiters will."""
        return partial(subscribe_once, self.redis, False)

    def waiting(self, channel: str, on_orphan: Callable[[str, str], None]) -> Waiting:
        # redis-py's PubSub under the one subscriber loop (its health PING, its re-subscribe)
        return Waiting(channel, partial(PubSubConnection, self.redis, self.settings.timeout), on_orphan,
                       self._idle_check())

    def _idle_check(self) -> Callable[[], Awaitable[None]] | None:
        return None

    def figures(self) -> tuple[int, int]:
        """(connections in use, replies awaited): read by a metrics reader on its own thread."""
        return len(getattr(self.redis.connection_pool, "_in_use_connections", ())), 0

    async def aclose(self) -> None:
        """Close what this link opened itself (the manager closes a client it owns)."""


class LeanLink(Link):
    """One server (or the Sentinels' master) over the lean connection; redis-py for the rest."""

    def __init__(self, redis: Any, settings: Settings, make: Callable[..., Connection]) -> None:
        super().__init__(redis, settings)
        self._make = make
        self.connection = make()
        self.client = self.connection

    async def call(self, script: _scripts.Script, keys: tuple[str, ...], args: list[Any]) -> Any:
        await self.prepare()
        return await script(self.connection, keys, args)

    def send_now(self, script: _scripts.Script, keys: tuple[str, ...], args: list[Any],
                 on_orphan: Callable[[Any], None] | None = None) -> asyncio.Future[Any] | None:
        return self.connection.send_now("EVALSHA", script.sha, len(keys), *keys, *args, on_orphan=on_orphan)

    async def batch(self, calls: list[tuple[Any, ...]]) -> list[Any]:
        await self.prepare()
        return await self.connection.execute_many(calls)

    @property
    def sender(self) -> Any:
        return self.connection

    async def servers(self, where: str) -> list[tuple[str, Callable[..., Awaitable[Any]]]]:
        await self.prepare()
        return [(where, self.connection.execute)]

    def waiting(self, channel: str, on_orphan: Callable[[str, str], None]) -> Waiting:
        return Waiting(channel, self._make, on_orphan, self._idle_check())

    def figures(self) -> tuple[int, int]:
        used, _ = super().figures()
        if self.connection.connected:
            return used + 1, self.connection.in_flight
        return used, 0

    async def aclose(self) -> None:
        await self.connection.aclose()


class SentinelLink(LeanLink):
    """The Sentinels' master over the lean connection, left as soon as the Sentinels name another."""

    def __init__(self, redis: Any, settings: Settings, watch: MasterWatch) -> None:
        self.watch = watch
        super().__init__(redis, settings, partial(MasterConnection, redis.connection_pool, watch,
                                                  **settings.credentials()))

    async def prepare(self) -> None:
        await self.watch.check()

    def send_now(self, script: _scripts.Script, keys: tuple[str, ...], args: list[Any],
                 on_orphan: Callable[[Any], None] | None = None) -> asyncio.Future[Any] | None:
        return None if self.watch.due() else super().send_now(script, keys, args, on_orphan)

    def _idle_check(self) -> Callable[[], Awaitable[None]] | None:
        return self.watch.check


class SentinelPyLink(Link):
    """The Sentinels' master through redis-py (RESP3, a connection class of its own): the same master check."""

    def __init__(self, redis: Any, settings: Settings, watch: MasterWatch) -> None:
        super().__init__(redis, settings)
        self.watch = watch

    async def prepare(self) -> None:
        await self.watch.check()

    def _idle_check(self) -> Callable[[], Awaitable[None]] | None:
        return self.watch.check


class ClusterLink(Link):
    """A Redis Cluster: scripts routed by slot (lean connections per master when allowed), wake-ups sharded."""

    sharded = True

    def __init__(self, redis: RedisCluster, settings: Settings) -> None:
        super().__init__(redis, settings)
        self.routed = RoutedConnections(redis, settings) if settings.lean else None
        if self.routed is not None:
            self.client = self.routed

    async def prepare(self) -> None:
        if self.routed is None:
            # redis-py sends commands issued before it has read the slot map to one
            # node (MOVED, and after a few of those it drops every connection)
            await self.redis.initialize()

    async def call(self, script: _scripts.Script, keys: tuple[str, ...], args: list[Any]) -> Any:
        await self.prepare()
        if self.routed is not None:
            return await script(self.routed, keys, args)
        with suppressed():
            return await script(self.redis, keys, args)

    async def batch(self, calls: list[tuple[Any, ...]]) -> list[Any]:
        """One call per slot, each routed (and redirected) to its node; a node that is down fails its own only."""
        await self.prepare()
        routed = self.routed
        if routed is not None:
            sends = [routed.execute(slot_of(str(call[3])), *call) for call in calls]
        else:
            sends = [self.redis.execute_command(*call) for call in calls]
        with suppressed():
            return list(await asyncio.gather(*sends, return_exceptions=True))

    async def masters(self) -> list[tuple[str, Callable[..., Awaitable[Any]]]]:
        """(address, send one command) for every master that serves slots now: the server checks' targets."""
        if self.routed is not None:
            return [(f"{host}:{port}", self.routed.sender((host, port))) for host, port in await self.routed.masters()]
        await self.redis.initialize()
        return [(f"{node.host}:{node.port}", partial(self.redis.execute_command, target_nodes=node))
                for node in self.redis.get_primaries()]

    async def servers(self, where: str) -> list[tuple[str, Callable[..., Awaitable[Any]]]]:
        return await self.masters()

    def subscribe_probe(self, address: str) -> Callable[[str], Awaitable[None]] | None:
        """SSUBSCRIBE on the master at `address`, over a lean connection with the manager's TLS and credentials."""
        settings = self.settings
        if not settings.lean:
            return None  # a connection class of the caller's own: the right stays as ACL DRYRUN or the probe found it
        host, _, port = address.rpartition(":")
        node = dataclasses.replace(settings, host=host, port=int(port), path=None, db=0,
                                   timeout=settings.timeout or 2.0, connect_timeout=settings.connect_timeout or 2.0)

        async def on_node(channel: str) -> None:
            connection = lean_connection(node)
            try:
                await connection.execute("SSUBSCRIBE", channel)
            finally:
                await connection.aclose()
        return on_node

    def groups(self, keys: list[str]) -> list[range | list[int]]:  # type: ignore[override]
        by_slot: dict[int, list[int]] = {}
        for i, key in enumerate(keys):
            by_slot.setdefault(slot_of(key), []).append(i)
        return [group[i:i + BATCH] for group in by_slot.values() for i in range(0, len(group), BATCH)]

    def waiting(self, channel: str, on_orphan: Callable[[str, str], None]) -> Waiting:
        return ShardedWaiting(self.redis, self.settings, channel, on_orphan, self.routed)

    def figures(self) -> tuple[int, int]:
        if self.routed is not None:
            return self.routed.open_connections, self.routed.in_flight
        return sum(len(getattr(n, "_connections", ())) - len(getattr(n, "_free", ()))
                   for n in self.redis.get_nodes()), 0

    async def aclose(self) -> None:
        if self.routed is not None:
            await self.routed.aclose()


class ReplicatedLink(Link):
    """Any one-server link whose writes count only once `replicas` replicas acknowledged them (WAIT)."""

    trusts_grants = False  # a hand-over is confirmed by an ACQUIRE that WAITs

    def __init__(self, inner: Link, replicas: int, timeout_ms: int) -> None:
        super().__init__(inner.redis, inner.settings)
        self.inner, self.replicas, self.timeout_ms = inner, replicas, timeout_ms
        self.client = inner.client
        self.acquire_script = Replicated(_scripts.acquire, replicas, timeout_ms)

    async def prepare(self) -> None:
        await self.inner.prepare()

    async def call(self, script: _scripts.Script, keys: tuple[str, ...], args: list[Any]) -> Any:
        return await self.inner.call(script, keys, args)

    async def batch(self, calls: list[tuple[Any, ...]]) -> list[Any]:
        """The calls, then WAIT on the same connection; a short acknowledgement fails every call."""
        await self.inner.prepare()
        with suppressed():
            *results, acked = await with_wait(self.inner.sender, calls, self.replicas, self.timeout_ms)
        try:
            check_acks(acked, self.replicas, self.timeout_ms)
        except Exception as error:
            return [r if isinstance(r, Exception) else error for r in results]
        return results

    def waiting(self, channel: str, on_orphan: Callable[[str, str], None]) -> Waiting:
        return self.inner.waiting(channel, on_orphan)

    def figures(self) -> tuple[int, int]:
        return self.inner.figures()

    async def aclose(self) -> None:
        await self.inner.aclose()


def link_for(redis: Any, wait_replicas: int = 0, wait_replicas_timeout_ms: int = 500) -> Link:
    """The link for a redis-py client on the current loop."""
    settings = settings_of(redis)
    link: Link
    if isinstance(redis, RedisCluster):
        return ClusterLink(redis, settings)
    watch = MasterWatch.for_client(redis)
    if watch is not None:
        link = SentinelLink(redis, settings, watch) if settings.lean else SentinelPyLink(redis, settings, watch)
    elif is_plain(redis) and settings.lean:
        link = LeanLink(redis, settings, partial(lean_connection, settings))
    else:
        link = Link(redis, settings)
    return ReplicatedLink(link, wait_replicas, wait_replicas_timeout_ms) if wait_replicas else link


async def subscribe_once(client: Any, sharded: bool, channel: str, timeout: float = 2.0) -> None:
    """SUBSCRIBE (SSUBSCRIBE) `channel` on a connection of `client`'s own, then leave: raises if refused."""
    pubsub = client.pubsub()
    try:
        if sharded:
            await pubsub.execute_command("SSUBSCRIBE", channel)
            await pubsub.parse_response(block=True, timeout=timeout)
        else:
            await pubsub.subscribe(channel)
            await pubsub.get_message(timeout=timeout)
    finally:
        await pubsub.aclose()
