"""The lean connection on a Redis Cluster: one per master, each script sent to its slot's node.

redis-py's cluster client costs about as much CPU per command as a whole
hand-over does on one Redis (docs/benchmarks.md, Deployments), so the lock's
scripts and renewals bypass it when they can: a lean `Connection` per
master, a slot map read with `CLUSTER SLOTS`, and the two redirections a
script can meet during a resharding:

- `MOVED slot host:port`: the slot lives elsewhere now; remember it and resend;
- `ASK slot host:port`: the slot is being migrated and this key is already
  there; resend once to that node, after `ASKING`.

A node that cannot be reached makes the map be read again (a failover
promotes a replica at another address) and the call fail as unavailable;
callers retry as they do on one Redis. `TRYAGAIN` (a script whose keys are
half migrated) is an unavailable answer too.
"""

from __future__ import annotations

import asyncio
from typing import Any, Awaitable, Callable

from redis.asyncio.cluster import RedisCluster
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import AskError, MovedError, NoPermissionError, RedisClusterException, RedisError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from ._clients import Settings
from ._cluster import slot_of
from ._connection import Connection
from ._tls import TlsMisconfigured

MAX_REDIRECTS = 5
Address = tuple[str, int]


class RoutedConnections:
    """`evalsha` / `script_load` like a client, each call on the node serving its first key."""

    def __init__(self, cluster: RedisCluster, settings: Settings) -> None:
        self._cluster = cluster
        self._kwargs = settings.credentials()
        self._kwargs.pop("db")  # a cluster has database 0 only
        self._nodes: dict[Address, Connection] = {}
        self._slots: dict[int, Address] = {}
        self._reading = asyncio.Lock()
        self._reads = 0  # slot maps read so far

    @property
    def in_flight(self) -> int:
        return sum(c.in_flight for c in self._nodes.values())

    @property
    def open_connections(self) -> int:
        return sum(1 for c in self._nodes.values() if c.connected)

    def _connection(self, address: Address) -> Connection:
        connection = self._nodes.get(address)
        if connection is None:
            connection = self._nodes[address] = Connection(host=address[0], port=address[1], **self._kwargs)
        return connection

    async def address(self, slot: int) -> Address:
        """The master serving `slot` as the scripts are sent to it (the map read first if it has none for it)."""
        address = self._slots.get(slot)
        if address is None:
            await self._read_slots()
            address = self._slots.get(slot)
            if address is None:
                raise RedisConnectionError(f"no cluster master serves slot {slot}")
        return address

    async def _read_slots(self) -> None:
        """Read the slot map from the first node that answers (known ones first, then redis-py's).

        Callers that queued while another read it take that map: each reading
        it again in turn would ask a stopped node first, a timeout per caller.
        """
        reads = self._reads
        async with self._reading:
            if self._reads != reads:
                return
            try:
                await self._cluster.initialize()
            except (RedisError, RedisClusterException, OSError):
                # redis-py read the nodes, then failed a command on its default node (a master that is
                # down): the nodes it knows, or the start-up nodes, can still answer for the map
                pass
            known = [*self._cluster.get_nodes(), *self._cluster.nodes_manager.startup_nodes.values()]
            candidates = list(dict.fromkeys([*self._nodes, *((n.host, int(n.port)) for n in known)]))
            error: Exception | None = None
            for address in candidates:
                try:
                    ranges = await self._connection(address).execute("CLUSTER", "SLOTS")
                except (RedisError, OSError) as exc:
                    error = exc
                    continue
                slots: dict[int, Address] = {}
                for start, end, master, *_replicas in ranges:
                    host = master[0].decode() if isinstance(master[0], bytes) else str(master[0])
                    owner = (host or address[0], int(master[1]))
                    for slot in range(int(start), int(end) + 1):
                        slots[slot] = owner
                self._slots = slots
                self._reads += 1
                return
            if isinstance(error, (TlsMisconfigured, NoPermissionError)):
                raise error  # the same on every node and every retry: say what to fix (a certificate, ACL rights)
            raise RedisConnectionError(f"no cluster node answered CLUSTER SLOTS: {error}")

    async def masters(self) -> list[Address]:
        """The masters that serve slots now (the map read first if none is known)."""
        if not self._slots:
            await self._read_slots()
        return sorted(set(self._slots.values()))

    def sender(self, address: Address) -> Callable[..., Awaitable[Any]]:
        """Send one command to the node at `address` on its lean connection."""
        return self._connection(address).execute

    def forget(self, address: Address) -> None:
        """A node went away: its slots are looked up again at their next use."""
        self._slots = {slot: a for slot, a in self._slots.items() if a != address}

    async def execute(self, slot: int, *command: Any) -> Any:
        address = await self.address(slot)
        for _ in range(MAX_REDIRECTS):
            connection = self._connection(address)
            try:
                return await connection.execute(*command)
            except ResponseError as exc:
                kind, _, target = _redirect(exc)
                if kind == "MOVED":
                    address = self._slots[slot] = target
                    continue
                if kind == "ASK":
                    asking, answer = await self._connection(target).execute_many([("ASKING",), command])
                    if isinstance(answer, Exception):
                        raise answer
                    return answer
                raise
            except (RedisConnectionError, RedisTimeoutError, OSError):
                self.forget(address)
                raise
        raise ResponseError(f"{command[0]} was redirected more than {MAX_REDIRECTS} times (slot {slot})")

    def evalsha(self, sha: str, numkeys: int, *args: Any) -> Any:
        return self.execute(slot_of(str(args[0])), "EVALSHA", sha, numkeys, *args)

    def eval(self, source: str, numkeys: int, *args: Any) -> Any:
        return self.execute(slot_of(str(args[0])), "EVAL", source, numkeys, *args)

    async def script_load(self, source: str) -> Any:
        """Load on every master: a replica promoted after a failover starts without scripts."""
        if not self._slots:
            await self._read_slots()
        answers = await asyncio.gather(*(self._connection(a).execute("SCRIPT", "LOAD", source)
                                         for a in set(self._slots.values())), return_exceptions=True)
        # A master that is down gets the script at its keys' next NOSCRIPT; only all down is an error.
        loaded = [a for a in answers if not isinstance(a, BaseException)]
        if not loaded:
            raise answers[0]
        return loaded[0]

    async def aclose(self) -> None:
        nodes, self._nodes = list(self._nodes.values()), {}
        for connection in nodes:
            await connection.aclose()


def _redirect(error: ResponseError) -> tuple[str, int, Address]:
    """('MOVED' or 'ASK', slot, address) of a redirection, else ('', -1, ('', 0))."""
    if isinstance(error, AskError):  # a MovedError is one too; redis-py's parser has read slot and address
        return "MOVED" if isinstance(error, MovedError) else "ASK", error.slot_id, error.node_addr
    # redis-py before 6 maps ASK and MOVED only in its cluster parser: read the plain error's text
    kind, _, rest = str(error).partition(" ")
    slot, _, node = rest.partition(" ")
    host, _, port = node.rpartition(":")
    if kind in ("MOVED", "ASK") and slot.isdigit() and port.isdigit():
        return kind, int(slot), (host, int(port))
    return "", -1, ("", 0)
