"""Where the lock under test lives: one Redis, Sentinel, Redis Cluster or a RedLock quorum of three.

Each deployment starts its processes for one run (and stops them by pid),
gives the workers their URL(s) and the keys they contend for, and names the
masters whose `INFO commandstats` count the run's commands. The record of
who held what, and when, never lives in Redis: workers send it to the parent
through a pipe, on the system-wide monotonic clock, so no failover can eat
the evidence.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import tempfile

import redis.asyncio as aioredis
from redis.crc import key_slot

from otel_lock.cli._redis_server import RedisServer

from ._libs import KEY


class Server(RedisServer):
    """redis-server on a fixed port and data directory, so a crash and restart keeps (or not) its AOF."""

    def __init__(self, aof: bool = False) -> None:
        self.data = tempfile.mkdtemp(prefix="otel-lock-safety-")
        persistence = ("--appendonly", "yes", "--appendfsync", "always") if aof else ()
        super().__init__(extra_args=("--dir", self.data, *persistence))

    def crash(self) -> None:
        """SIGKILL by pid: no shutdown, no final save."""
        if self.process is not None:
            os.kill(self.process.pid, signal.SIGKILL)
            self.process.wait()
            self.process = None
            # start() makes a fresh (unused: --dir points at self.data) directory each time
            shutil.rmtree(getattr(self, "_dir", ""), ignore_errors=True)

    def stop(self) -> None:
        super().stop()
        shutil.rmtree(self.data, ignore_errors=True)


def _keys(fault) -> list[str]:
    return [KEY] if fault.keys == 1 else [f"{KEY}-{i}" for i in range(fault.keys)]


def _url(port: int) -> str:
    return f"redis://127.0.0.1:{port}/0"


class Single:
    """One redis-server (with AOF when the fault asks for it)."""

    name = "single"

    def __init__(self, fault) -> None:
        self.server = Server(aof=fault.aof)
        self.keys = _keys(fault)

    @property
    def url(self) -> str:
        return self.server.url

    async def start(self) -> None:
        await asyncio.to_thread(self.server.start)

    def masters(self) -> list[str]:
        return [self.server.url] if self.server.process is not None else []

    async def heal(self, run) -> None:
        if self.server.process is None:
            await asyncio.to_thread(self.server.start)
            await run.meter.begin()

    async def stop(self) -> None:
        await asyncio.to_thread(self.server.stop)


class Sentinel:
    """A master, a replica (replicating through a proxy that a fault can stall) and three sentinels."""

    name = "sentinel"

    def __init__(self, fault) -> None:
        from benchmarks._sentinel_set import SentinelSet  # here: it imports this package's proxy

        self.set = SentinelSet(proxy=True)
        self.keys = _keys(fault)
        self.master_port = 0  # the master of the moment; a failover fault moves it

    @property
    def url(self) -> str:
        return self.set.url

    async def start(self) -> None:
        await self.set.__aenter__()
        self.master_port = self.set.master.port

    def masters(self) -> list[str]:
        return [_url(self.master_port)]

    async def heal(self, run) -> None:
        if self.set.proxy is not None:
            self.set.proxy.forward()

    async def stop(self) -> None:
        await self.set.__aexit__()


class Cluster:
    """Three masters (each with a replica when the fault kills one); one contended key per master's slots."""

    name = "cluster"

    def __init__(self, fault) -> None:
        from benchmarks._cluster_set import ClusterSet  # here: it imports _sentinel_set, which imports this package

        self.set = ClusterSet(masters=3, replicas=1 if fault.replicas else 0)  # ports with a valid bus port
        self.keys: list[str] = []
        self.master_ports: list[int] = []

    @property
    def url(self) -> str:
        return self.set.url

    async def slot_owners(self) -> dict[int, int]:
        """slot -> port of the master serving it now."""
        async with aioredis.Redis(port=self.set.ports[0]) as client:
            ranges = await client.execute_command("CLUSTER", "SLOTS")
        return {slot: int(master[1]) for start, end, master, *_ in ranges
                for slot in range(int(start), int(end) + 1)}

    async def owner(self, key: str) -> int:
        return (await self.slot_owners())[key_slot(key.encode())]

    async def start(self) -> None:
        await self.set.__aenter__()
        owners = await self.slot_owners()
        self.master_ports = sorted(set(owners.values()))
        # The lock's keys share the hash tag {key}, so its slot is key_slot(key): one key per master.
        by_master: dict[int, str] = {}
        for i in range(1000):
            key = f"{KEY}-{i}"
            by_master.setdefault(owners[key_slot(key.encode())], key)
            if len(by_master) == len(self.master_ports):
                break
        self.keys = [by_master[port] for port in self.master_ports]

    def masters(self) -> list[str]:
        return [_url(port) for port in self.master_ports]

    async def heal(self, run) -> None:
        pass

    async def stop(self) -> None:
        await self.set.__aexit__()


class RedLock:
    """Three independent redis-servers without persistence; the workers use RedLockManager.from_urls."""

    name = "redlock"

    def __init__(self, fault) -> None:
        self.servers = [Server() for _ in range(3)]
        self.keys = _keys(fault)

    @property
    def url(self) -> list[str]:
        return [s.url for s in self.servers]

    async def start(self) -> None:
        for server in self.servers:
            await asyncio.to_thread(server.start)

    def masters(self) -> list[str]:
        return [s.url for s in self.servers if s.process is not None]

    async def heal(self, run) -> None:
        for server in self.servers:
            if server.process is None:
                await asyncio.to_thread(server.start)
                await run.meter.begin([server.url])

    async def stop(self) -> None:
        for server in self.servers:
            await asyncio.to_thread(server.stop)


DEPLOYMENTS = {d.name: d for d in (Single, Sentinel, Cluster, RedLock)}
