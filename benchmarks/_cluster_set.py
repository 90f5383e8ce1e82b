"""A real Redis Cluster on loopback: masters made with `redis-cli --cluster create`.

Every node is a `redis-server --cluster-enabled yes` started here and stopped
by pid. With `replicas=1` each master gets a replica, so a test can kill a
master and watch its replica take over; the node timeout is small, so that
takes a couple of seconds. `migrate_slot` moves one slot (and its keys) to
another master the way `redis-cli --cluster reshard` does, step by step, so
a test can run load through the migration.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess

import redis.asyncio as aioredis
from redis.crc import key_slot

from benchmarks._sentinel_set import until
from otel_lock.cli._redis_server import RedisServer, free_port, stop_servers

NODE_TIMEOUT_MS = 1000
BUS_OFFSET = 10000  # a node also listens on port + 10000 (the cluster bus)


def _bus_safe_port() -> int:
    """A free port whose bus port (+10000) is a valid port and free too."""
    while True:
        port = free_port()
        if port + BUS_OFFSET < 65536 and _free(port + BUS_OFFSET):
            return port


def _free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _start_own(node: RedisServer, attempts: int = 5) -> None:
    """Start `node`, on another free port if another process bound the first before it did.

    (`start` waits for the node's own pid: a port another test worker's server took ends it. A
    cluster made of that port would take in a node of another cluster and never converge.)
    """
    for _ in range(attempts - 1):
        try:
            node.start()
            return
        except RuntimeError:  # it exited: "Address already in use"
            node.port = _bus_safe_port()
    node.start()


class ClusterSet:
    """`async with ClusterSet() as c:`; `c.url` is the redis+cluster:// URL of the cluster."""

    def __init__(self, masters: int = 3, replicas: int = 0) -> None:
        self.nodes = [RedisServer(port=_bus_safe_port(), extra_args=(
            "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
            "--cluster-node-timeout", str(NODE_TIMEOUT_MS), "--cluster-require-full-coverage", "no",
            "--cluster-allow-reads-when-down", "no", "--repl-diskless-sync-delay", "0"))
            for _ in range(masters * (1 + replicas))]
        self.masters, self.replicas = masters, replicas

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in self.nodes[:self.masters])

    @property
    def ports(self) -> list[int]:
        return [n.port for n in self.nodes if n.process is not None]

    async def __aenter__(self) -> "ClusterSet":
        try:
            for node in self.nodes:
                _start_own(node)
            binary = shutil.which("redis-cli")
            if binary is None:
                raise RuntimeError("redis-cli is not on PATH (Debian: apt-get install redis-tools)")
            subprocess.run([binary, "--cluster", "create", *(f"127.0.0.1:{n.port}" for n in self.nodes),
                            "--cluster-replicas", str(self.replicas), "--cluster-yes"],
                           check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=60)
            for node in self.nodes:
                await until(lambda: self._ready(node.port), f"cluster node {node.port} to be ready")
        except BaseException:
            await self.__aexit__()
            raise
        return self

    async def _ready(self, port: int) -> bool:
        async with aioredis.Redis(port=port) as client:
            info = await client.execute_command("CLUSTER", "INFO")
            if isinstance(info, bytes):
                info = info.decode()
            fields = dict(line.split(":", 1) for line in str(info).split() if ":" in line)
            if fields.get("cluster_state") != "ok" or fields.get("cluster_known_nodes") != str(len(self.nodes)):
                return False
            role = (await client.execute_command("ROLE"))[0]
            if role in (b"slave", "slave"):
                return (await client.info("replication")).get("master_link_status") == "up"
            return True

    async def owner(self, key: str) -> int:
        """The port of the master that serves `key`'s slot now."""
        slot = key_slot(key.encode())
        async with aioredis.Redis(port=self.ports[0]) as client:
            for start, end, master, *_ in await client.execute_command("CLUSTER", "SLOTS"):
                if int(start) <= slot <= int(end):
                    return int(master[1])
        raise AssertionError(f"no master serves slot {slot}")

    async def keys_per_master(self, per_master: int, prefix: str = "item") -> dict[int, list[str]]:
        """`per_master` keys `prefix:N` whose slots each master serves, by master port."""
        chosen: dict[int, list[str]] = {}
        i = 0
        while len(chosen) < self.masters or any(len(v) < per_master for v in chosen.values()):
            key = f"{prefix}:{i}"
            i += 1
            keys = chosen.setdefault(await self.owner(key), [])
            if len(keys) < per_master:
                keys.append(key)
        return chosen

    async def node_id(self, port: int) -> str:
        async with aioredis.Redis(port=port) as client:
            node_id = await client.execute_command("CLUSTER", "MYID")
        return node_id.decode() if isinstance(node_id, bytes) else str(node_id)

    async def migrate_slot(self, slot: int, target_port: int, batch: int = 10) -> None:
        """Move `slot` with its keys to the master on `target_port` (IMPORTING/MIGRATING, MIGRATE, NODE)."""
        async with aioredis.Redis(port=self.ports[0]) as client:
            source_port = next(int(m[1]) for s, e, m, *_ in await client.execute_command("CLUSTER", "SLOTS")
                               if int(s) <= slot <= int(e))
        source_id, target_id = await self.node_id(source_port), await self.node_id(target_port)
        async with aioredis.Redis(port=source_port) as source, aioredis.Redis(port=target_port) as target:
            await target.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", source_id)
            await source.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", target_id)
            while keys := await source.execute_command("CLUSTER", "GETKEYSINSLOT", slot, batch):
                await source.execute_command("MIGRATE", "127.0.0.1", target_port, "", 0, 5000, "KEYS", *keys)
            for port in self.ports:
                async with aioredis.Redis(port=port) as node:
                    role = (await node.execute_command("ROLE"))[0]
                    if role in (b"master", "master"):
                        await node.execute_command("CLUSTER", "SETSLOT", slot, "NODE", target_id)

    def kill(self, port: int) -> None:
        """SIGKILL the node on `port` by pid: no goodbye, no persistence."""
        node = next(n for n in self.nodes if n.port == port)
        assert node.process is not None
        os.kill(node.process.pid, signal.SIGKILL)
        node.process.wait()
        node.process = None

    async def failed_over(self, dead_port: int) -> None:
        """Wait until every slot the dead master served has a live master again."""
        async def covered() -> bool:
            async with aioredis.Redis(port=self.ports[0]) as client:
                slots = await client.execute_command("CLUSTER", "SLOTS")
            return all(int(m[1]) != dead_port for _, _, m, *_ in slots) and sum(
                int(e) - int(s) + 1 for s, e, *_ in slots) == 16384
        await until(covered, f"a replica to replace the master on {dead_port}")

    async def __aexit__(self, *exc: object) -> None:
        stop_servers(self.nodes)
