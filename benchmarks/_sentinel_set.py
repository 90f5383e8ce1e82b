"""A real Sentinel deployment on loopback: one master, one replica, three sentinels.

Every process is a `redis-server` started here and stopped by pid. The
replica replicates through a `TcpProxy`, so a test can stall replication
(the replica then misses what the master acknowledges) before it kills the
master. Down-after and failover timeouts are small: a failover takes a few
seconds.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import redis.asyncio as aioredis

from benchmarks.safety._proxy import TcpProxy
from otel_lock.cli._redis_server import RedisServer, _ping, free_port, stop_processes, stop_servers

SERVICE = "otel-lock-test"
# At 400 ms, a sentinel's new link to the replica it had just promoted could go without a PONG for longer
# than that: all three marked the new master down and failed over again, back to the old master that had
# just come back as a replica (1 failover under load in 8 to 15; 0 in 30 at 1000 ms).
DOWN_AFTER_MS = 1000
FAILOVER_TIMEOUT_MS = 3000
DEADLINE = 30.0
_NO_SYNC_DELAY = ("--repl-diskless-sync-delay", "0")  # a replica syncs at once, not after 5 s


async def until(predicate, what: str, timeout: float = DEADLINE, every: float = 0.05):
    deadline = time.monotonic() + timeout
    while True:
        value = await predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(every)


class SentinelSet:
    """`async with SentinelSet() as s:`; `s.url` is the redis+sentinel:// URL of the service."""

    def __init__(self, sentinels: int = 3, proxy: bool = True) -> None:
        self.master = RedisServer(extra_args=_NO_SYNC_DELAY)
        self.replica: RedisServer | None = None
        self.proxy: TcpProxy | None = None
        self._use_proxy = proxy  # False: the replica replicates directly (benchmarks: no Python hop)
        self.sentinel_ports = [free_port() for _ in range(sentinels)]
        self.sentinels: list[subprocess.Popen[bytes]] = []
        self._dir = tempfile.mkdtemp(prefix="otel-lock-sentinel-")

    @property
    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{p}" for p in self.sentinel_ports)
        return f"redis+sentinel://{hosts}/{SERVICE}"

    async def __aenter__(self) -> "SentinelSet":
        try:
            await self._start()
        except BaseException:
            await self.__aexit__()
            raise
        return self

    async def _start(self) -> None:
        self.master.start()
        upstream = self.master.port
        if self._use_proxy:
            self.proxy = await TcpProxy("127.0.0.1", self.master.port).start()
            upstream = self.proxy.port
        self.replica = RedisServer(extra_args=(*_NO_SYNC_DELAY, "--replicaof", "127.0.0.1", str(upstream)))
        self.replica.start()
        await until(lambda: self._link_up(self.replica.port), "the replica to sync")
        await until(lambda: self._online_replicas(self.master.port), "the master to count its replica")
        await until(lambda: self._acknowledges(self.master.port), "the replica to acknowledge a WAIT")
        binary = shutil.which("redis-server")
        # Each sentinel starts knowing its peers and the replica, as a sentinel that restarts reads them
        # back from the config it rewrote: otherwise they find each other by hello messages every 2 s.
        ids = {port: os.urandom(20).hex() for port in self.sentinel_ports}
        for port in self.sentinel_ports:
            conf = Path(self._dir) / f"sentinel-{port}.conf"
            known = "".join(f"sentinel known-sentinel {SERVICE} 127.0.0.1 {peer} {ids[peer]}\n"
                            for peer in self.sentinel_ports if peer != port)
            conf.write_text(
                f"port {port}\nbind 127.0.0.1\nprotected-mode no\ndir {self._dir}\n"
                f"sentinel myid {ids[port]}\n"
                f"sentinel monitor {SERVICE} 127.0.0.1 {self.master.port} 2\n"
                f"sentinel down-after-milliseconds {SERVICE} {DOWN_AFTER_MS}\n"
                f"sentinel failover-timeout {SERVICE} {FAILOVER_TIMEOUT_MS}\n"
                f"sentinel parallel-syncs {SERVICE} 1\n"
                f"sentinel known-replica {SERVICE} 127.0.0.1 {self.replica.port}\n{known}")
            self.sentinels.append(subprocess.Popen([binary, str(conf), "--sentinel"],
                                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        for port in self.sentinel_ports:
            await until(lambda: asyncio.to_thread(_ping, port), f"sentinel {port} to answer")
        # A failover needs a quorum of sentinels that know each other and the replica.
        for port in self.sentinel_ports:
            await until(lambda: self._sentinel_ready(port), f"sentinel {port} to see its peers and the replica")

    async def _link_up(self, port: int) -> bool:
        async with aioredis.Redis(port=port) as client:
            info = await client.info("replication")
        return info.get("master_link_status") == "up"

    async def _online_replicas(self, port: int) -> bool:
        """The master has marked its replica online (only then does WAIT count it)."""
        async with aioredis.Redis(port=port) as client:
            info = await client.info("replication")
        replica = info.get("slave0")
        return isinstance(replica, dict) and replica.get("state") == "online"

    async def _acknowledges(self, port: int) -> bool:
        async with aioredis.Redis(port=port) as client:
            await client.set("otel-lock-test:warm", 1)
            return int(await client.execute_command("WAIT", 1, 200)) >= 1

    async def _sentinel_ready(self, port: int) -> bool:
        """It knows its two peers and the replica, and is connected to each of them (no `disconnected` flag)."""
        async with aioredis.Redis(port=port, decode_responses=True) as client:
            peers = await client.execute_command("SENTINEL", "SENTINELS", SERVICE)
            replicas = await client.execute_command("SENTINEL", "REPLICAS", SERVICE)
        linked = [_fields(entry).get("flags", "") for entry in (*peers, *replicas)]
        return len(peers) == 2 and len(replicas) == 1 and not any("disconnected" in flags for flags in linked)

    async def master_port(self) -> int:
        """The master's port as the sentinels agree on it."""
        ports = set()
        for port in self.sentinel_ports:
            async with aioredis.Redis(port=port) as client:
                addr = await client.execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", SERVICE)
            ports.add(int(addr[1]))
        return ports.pop() if len(ports) == 1 else -1

    def kill_master(self) -> None:
        """SIGKILL by pid: no goodbye, no persistence."""
        assert self.master.process is not None
        os.kill(self.master.process.pid, signal.SIGKILL)
        self.master.process.wait()
        self.master.process = None
        shutil.rmtree(getattr(self.master, "_dir", ""), ignore_errors=True)

    async def failed_over(self) -> int:
        """Wait until every sentinel names the replica as master and it accepts writes; its port."""
        assert self.replica is not None
        port = self.replica.port
        await until(lambda: self._is(port), "the sentinels to promote the replica")
        return port

    async def _is(self, port: int) -> bool:
        if await self.master_port() != port:
            return False
        async with aioredis.Redis(port=port) as client:
            return (await client.info("replication"))["role"] == "master"

    async def demote_master(self) -> int:
        """`SENTINEL FAILOVER`: the master stays up and becomes a replica; the new master's port."""
        async with aioredis.Redis(port=self.sentinel_ports[0]) as client:
            await client.execute_command("SENTINEL", "FAILOVER", SERVICE)
        return await self.failed_over()

    async def bring_back_old_master(self) -> None:
        """The killed node restarts empty as a replica of the new master (what an operator does)."""
        assert self.replica is not None
        self.master = RedisServer(port=self.master.port,
                                  extra_args=(*_NO_SYNC_DELAY, "--replicaof", "127.0.0.1", str(self.replica.port)))
        self.master.start()
        await until(lambda: self._link_up(self.master.port), "the old master to sync as a replica")
        await until(lambda: self._online_replicas(self.replica.port), "the new master to count its replica")

    async def __aexit__(self, *exc: object) -> None:
        # The proxy goes first: a master told to stop waits (up to 10 s) for the replicas it still has
        # to acknowledge its last writes, and through an open proxy a stopped replica looks there still.
        if self.proxy is not None:
            await self.proxy.aclose()
        servers = [server for server in (self.replica, self.master) if server is not None]
        stop_processes([*self.sentinels, *(server.process for server in servers if server.process is not None)])
        stop_servers(servers)
        shutil.rmtree(self._dir, ignore_errors=True)


def _fields(entry: list[str] | dict[str, str]) -> dict[str, str]:
    """A SENTINEL SENTINELS/REPLICAS entry as a dict (RESP2 gives a flat list of name, value, ...)."""
    return entry if isinstance(entry, dict) else dict(zip(entry[::2], entry[1::2]))
