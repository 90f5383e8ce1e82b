"""Wake-on-release on a Redis Cluster: sharded pub/sub, one subscriber per node in use.

A release's SPUBLISH reaches only the node that serves the lock's slot, so
a release costs that one node, not the whole cluster (plain PUBLISH is
broadcast to every node). A manager subscribes, per slot it waits in, to
`<channel>:{<slot tag>}` on the master serving that slot, on one lean
connection per node. A subscription is made before the waiter's first
queued request and checked again before each later one, so after a
failover or a slot migration (the node then drops the subscription with an
SUNSUBSCRIBE) it is made again on the slot's new master. While it is gone
the waiters poll, as on one Redis when the subscriber reconnects.

The slot's node is looked up in the map the lock's scripts follow: the lean
connections' own (`_routed.py`) when they are in use. redis-py's map is
read again only after one of redis-py's own commands failed, which the lean
path never sends: after a failover it would name the dead master for good.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any, Callable

from redis.asyncio.cluster import RedisCluster
from redis.exceptions import AskError, RedisClusterException, RedisError, ResponseError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from ._clients import Settings
from ._cluster import slot_of, slot_tag
from ._connection import Connection
from ._routed import Address, RoutedConnections
from ._waiting import Waiting

log = logging.getLogger("otel_lock")

MAX_REDIRECTS = 5


class _Node:
    """One subscriber connection to one cluster node, and the channels subscribed on it."""

    def __init__(self, connection: Connection) -> None:
        self.connection = connection
        self.channels: set[str] = set()
        self.lost = asyncio.Event()
        self.task: asyncio.Task[None] | None = None


class ShardedWaiting(Waiting):
    """`Waiting` whose wake channel depends on the lock's slot."""

    sharded = True

    def __init__(self, redis: RedisCluster, settings: Settings, channel: str,
                 on_orphan: Callable[[str, str], None] | None, routed: RoutedConnections | None = None) -> None:
        super().__init__(channel, None, on_orphan)
        self._settings = settings
        self._cluster = redis
        self._routed = routed  # the lean connections, when the scripts go through them: their slot map
        self._nodes: dict[tuple[str, int], _Node] = {}
        self._subscriptions: dict[str, asyncio.Future[None]] = {}  # channel -> done once subscribed
        self._connecting = asyncio.Lock()
        self._slot_channels: dict[int, str] = {}

    def channel_for(self, key: str) -> str:
        slot = slot_of(key)
        channel = self._slot_channels.get(slot)
        if channel is None:  # at most one per slot
            channel = self._slot_channels[slot] = f"{self.channel}:{{{slot_tag(slot)}}}"
        return channel

    def ready_for(self, key: str) -> bool:
        done = self._subscriptions.get(self.channel_for(key))
        return done is not None and done.done() and done.exception() is None

    async def start(self, key: str | None = None) -> None:
        """Subscribe to the wake channel of `key`'s slot on the node serving it; at once if already."""
        assert key is not None, "a cluster subscription is per slot"
        channel = self.channel_for(key)
        done = self._subscriptions.get(channel)
        if done is None or (done.done() and done.exception() is not None):
            done = asyncio.get_running_loop().create_future()
            self._subscriptions[channel] = done
            task = asyncio.ensure_future(self._subscribe(channel, done))
            task.add_done_callback(_retrieve)
        await asyncio.shield(done)

    async def _subscribe(self, channel: str, done: asyncio.Future[None]) -> None:
        try:
            address = await self._address(channel)
            for _ in range(MAX_REDIRECTS):
                try:
                    subscriber = await self._node(address)
                    await subscriber.connection.execute("SSUBSCRIBE", channel)
                except ResponseError as exc:
                    if isinstance(exc, AskError):  # MOVED or ASK: redis-py's parser has read the address
                        address = exc.node_addr
                        continue
                    raise
                except (RedisConnectionError, RedisTimeoutError, OSError):
                    await self._unreachable(address)
                    raise
                subscriber.channels.add(channel)
                if not done.done():
                    done.set_result(None)
                return
            raise RedisError(f"SSUBSCRIBE {channel} was redirected more than {MAX_REDIRECTS} times")
        except BaseException as exc:
            if self._subscriptions.get(channel) is done:
                del self._subscriptions[channel]
            if not done.done():
                done.set_exception(exc if isinstance(exc, Exception) else RedisError(f"subscribe stopped: {exc!r}"))
            if not isinstance(exc, Exception):
                raise

    async def _address(self, channel: str) -> Address:
        """The master serving the channel's slot, as the lock's scripts find it."""
        if self._routed is not None:
            return await self._routed.address(slot_of(channel))
        await self._cluster.initialize()
        node = self._cluster.get_node_from_key(channel)
        if node is None:
            raise RedisError(f"no cluster node serves the slot of {channel}")
        return node.host, int(node.port)

    async def _unreachable(self, address: Address) -> None:
        """`address` did not answer (a master failed over): the next subscribe must not look it up again."""
        if self._routed is not None:
            self._routed.forget(address)  # its slots are read again at their next use
            return
        with contextlib.suppress(RedisError, RedisClusterException, OSError):
            # redis-py refreshes its map only after its own commands failed, and none may run meanwhile
            await self._cluster.nodes_manager.initialize()

    async def _node(self, address: tuple[str, int]) -> _Node:
        async with self._connecting:
            node = self._nodes.get(address)
            if node is not None and not node.lost.is_set():
                return node
            holder: list[_Node] = []
            options = self._settings.credentials()
            options.pop("db")  # a cluster has database 0 only
            connection = Connection(host=address[0], port=address[1], **options,
                                    on_push=lambda reply: self._on_node_push(holder[0], reply),
                                    on_lost=lambda: holder[0].lost.set())
            node = _Node(connection)
            holder.append(node)
            await connection.connect()
            self._nodes[address] = node
            node.task = asyncio.create_task(self._keep(address, node), name="otel-lock shard subscriber")
            return node

    async def _keep(self, address: tuple[str, int], node: _Node) -> None:
        """Watch one node's connection; when it drops, forget its subscriptions and let waiters poll."""
        try:
            await self._watch(node.connection, node.lost)
        finally:
            if self._nodes.get(address) is node:
                del self._nodes[address]
            for channel in node.channels:
                self._subscriptions.pop(channel, None)
            await node.connection.aclose()
            if node.channels:
                log.warning("otel-lock lost its shard subscriber on %s:%s; waiters poll until it is back", *address)
                self._poll_all()

    def _on_node_push(self, node: _Node, reply: Any) -> None:
        kind = reply[0]
        if kind == b"smessage":
            self._deliver(reply[2])
        elif kind == b"sunsubscribe":
            # The slot moved away (migration, failover): subscribe again where it lives now.
            channel = reply[1].decode() if isinstance(reply[1], bytes) else str(reply[1])
            node.channels.discard(channel)
            self._subscriptions.pop(channel, None)
            self._poll_all()

    async def aclose(self) -> None:
        nodes, self._nodes = list(self._nodes.values()), {}
        for node in nodes:
            node.channels.clear()  # closing on purpose: nothing to report
            if node.task is not None:
                node.task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await node.task
            await node.connection.aclose()
        self._subscriptions.clear()


def _retrieve(task: asyncio.Future[None]) -> None:
    if not task.cancelled():
        task.exception()
