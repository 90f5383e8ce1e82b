"""The faults, each injected for real while the workers contend.

Stall lengths are fractions of the lease L. "Short" stalls stay under
L minus the renewal interval (L/3), so a renewing lock must show no overlap;
"long" ones outlast L, so overlaps are expected and each must be fenced. The
only other fault that may let two holders overlap is a Redis that comes back
empty (or a failover to a replica that missed the grant); kills, cuts, short
stalls and a restart with AOF must not.

Each fault names the deployments it makes sense on (`where`): the process
faults run anywhere, the crashes and proxies of one Redis on a single Redis,
and each other deployment has its own (failover, slot migration, a master of
the quorum killed or restarted empty).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import signal
import time
from dataclasses import dataclass

import redis.asyncio as aioredis
from redis.crc import key_slot

SHORT = (0.25, 0.55)  # x lease: under lease - renewal interval (2/3 L), with room for a round trip
LONG = (1.3, 1.6)  # x lease: past the lease
ANYWHERE = ("single", "sentinel", "cluster", "redlock")
# A failover here takes ~2.5-3 s. The lease outlasts it, and 40% of the holds last 0.5-0.9 L, so that holders
# ride through the failover and a lock lost in it is still believed held when the new master grants it again.
FAILOVER_WINDOW = 10.0  # s: the failover inside the window, and load after it
FAILOVER_LEASE = 6.0  # s
RIDE_THROUGH = (0.4, 0.5, 0.9)
FAILOVER_KEYS = 3  # long holds on one key would starve the waiters: three keys, as a service has


@dataclass
class Fault:
    name: str
    what: str
    hold_stall: tuple | None = None  # (probability per hold, shortest, longest) in x lease
    wait_stall: tuple | None = None  # (probability per check, shortest, longest) in x lease
    aof: bool = False
    proxy: bool = False
    sync_ok: bool = True  # meaningful for a sync library (threads) too
    act: object = None  # async fn(run, rng) injecting the fault until cancelled
    short: bool = False  # stalls under lease - renewal interval
    long: bool = False  # stalls past the lease: overlaps expected, each stale holder fenced and told at its next await
    forgets: bool = False  # Redis loses the lock (restart without persistence, failover): overlaps may come, fenced
    where: tuple = ANYWHERE  # the deployments it applies to
    options: dict | None = None  # manager options of the workers (e.g. wait_replicas)
    replicas: bool = False  # a Cluster with a replica per master
    min_window: float = 0.0  # s: the run's window is at least this long
    min_lease: float = 0.0  # s: the run's lease is at least this long
    long_hold: tuple = (0.05, 0.2, 0.5)  # (probability per hold, shortest, longest) in x lease: slow async work
    keys: int = 1  # contended keys (a Cluster run always has one per master)

    @property
    def baseline_load(self) -> bool:
        """The no-fault run's load (lease, hold lengths, keys): only then are its commands per handoff comparable."""
        return not self.min_lease and self.long_hold == Fault.long_hold and self.keys == 1

    @property
    def may_overlap(self) -> bool:
        """Only a stall past the lease or a Redis (or failover) that forgot the lock may let two holders overlap."""
        return self.long or self.forgets

    def worker(self, lease: float) -> dict:
        # every run: some holds are long (by default 5%, 0.2-0.5 L of async work), so a fault can land inside one
        p, a, b = self.long_hold
        config: dict = {"long_hold": [p, a * lease, b * lease]}
        if self.hold_stall:
            p, a, b = self.hold_stall
            config["hold_stall"] = [p, a * lease, b * lease]
        if self.wait_stall:
            p, a, b = self.wait_stall
            config["wait_stall"] = [p, a * lease, b * lease]
        return config

    async def inject(self, run) -> None:
        if self.act is not None:
            await self.act(run, random.Random())

    async def heal(self, run) -> None:
        """After the window: let every stopped process and stalled proxy go, so the run can drain."""
        for worker in run.workers:
            if worker.killed_at is None and worker.proc.returncode is None:
                worker.proc.send_signal(signal.SIGCONT)
            if worker.proxy is not None:
                worker.proxy.forward()
        await run.deployment.heal(run)


def _span(rng, lease: float, bounds) -> float:
    return rng.uniform(bounds[0] * lease, bounds[1] * lease)


async def _next_holder(run, rng, timeout: float = 2.0):
    """A worker process that holds the lock now (the parent learns it from the workers' events)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        holders = run.holders()
        if holders:
            return rng.choice(holders)
        await asyncio.sleep(0.005)
    return None


def sigstop(bounds):
    async def act(run, rng) -> None:
        while True:
            await asyncio.sleep(rng.uniform(0.2, 0.5) * run.lease)
            worker = await _next_holder(run, rng)
            if worker is None:
                continue
            begin = time.monotonic()
            worker.proc.send_signal(signal.SIGSTOP)
            try:
                await asyncio.sleep(_span(rng, run.lease, bounds))
            finally:
                worker.proc.send_signal(signal.SIGCONT)
                run.pause(worker, begin, time.monotonic())
    return act


def sigkill(holder: bool):
    async def act(run, rng) -> None:
        while True:
            await asyncio.sleep(rng.uniform(0.4, 0.8) * run.lease)
            if holder:
                worker = await _next_holder(run, rng)
            else:
                waiters = run.waiters()
                worker = rng.choice(waiters) if waiters else None
            if worker is None:
                continue
            await run.kill(worker)
            run.background(run.spawn())  # keep the contention up (a replacement starts in ~0.5 s)
    return act


async def restart(run, rng) -> None:
    """Crash Redis (SIGKILL) twice per window, down for 0.2 s, back on the same port."""
    for _ in range(2):
        await asyncio.sleep(run.profile.window / 3)
        await run.meter.pause()
        run.server.crash()
        await asyncio.sleep(0.2)
        await asyncio.to_thread(run.server.start)
        await run.meter.begin()


def proxy_stall(bounds):
    async def act(run, rng) -> None:
        while True:
            await asyncio.sleep(rng.uniform(0.2, 0.5) * run.lease)
            worker = await _next_holder(run, rng)
            if worker is None:
                continue
            worker.proxy.stall()
            try:
                await asyncio.sleep(_span(rng, run.lease, bounds))
            finally:
                worker.proxy.forward()
    return act


async def proxy_cut(run, rng) -> None:
    while True:
        await asyncio.sleep(rng.uniform(0.15, 0.3) * run.lease)
        worker = await _next_holder(run, rng)
        if worker is None:
            continue
        worker.proxy.cut()
        await asyncio.sleep(0.1)
        worker.proxy.forward()


async def client_kill(run, rng) -> None:
    """Kill every client connection (commands and pub/sub, but ours) on every master every ~0.3 s.

    The sentinels' own links are spared (and replication links, which are not
    clients): cutting them every 0.3 s makes the sentinels judge a live master
    down and fail over, which is `partition-sentinels`' fault, not this one's.
    """
    while True:
        await asyncio.sleep(rng.uniform(0.2, 0.4))
        for url in run.deployment.masters():
            client = aioredis.Redis.from_url(url, socket_timeout=5)
            try:
                mine = await client.client_id()
                for conn in await client.client_list():
                    if int(conn["id"]) != mine and not conn.get("name", "").startswith("sentinel-") \
                            and not set(conn.get("flags", "")) & {"S", "M"}:
                        await client.execute_command("CLIENT", "KILL", "ID", conn["id"])
            finally:
                await client.aclose()


EVICT_HEADROOM = 2 << 20  # bytes of maxmemory above what Redis uses when the fault starts
FILL_VALUE = b"x" * 1024
FILL_BATCH = 100


def evict(policy: str):
    """A `maxmemory` just above what Redis uses, `policy`, and a writer that keeps it full.

    The filler's keys carry a TTL (cache entries, idempotency records), so a
    volatile-* policy has more than the locks to choose from. Its PSETEX is a
    command the locks never send (the meter leaves it out). `injected` counts
    the lock keys Redis evicted (keyspace notifications of `evicted`).
    """
    async def act(run, rng) -> None:
        client = aioredis.Redis.from_url(run.server.url, socket_timeout=5)
        events = aioredis.Redis.from_url(run.server.url, socket_timeout=None).pubsub()
        counter = asyncio.create_task(_count_evicted_locks(run, events))
        try:
            used = int((await client.info("memory"))["used_memory"])
            await client.config_set("maxmemory-policy", policy)
            await client.config_set("maxmemory", used + EVICT_HEADROOM)
            i = 0
            while True:
                pipe = client.pipeline(transaction=False)
                for _ in range(FILL_BATCH):
                    pipe.psetex(f"filler:{i}", 600_000, FILL_VALUE)
                    i += 1
                await pipe.execute()
                await asyncio.sleep(0.005)
        finally:
            counter.cancel()
            # Bounded: a pub/sub connection of a full Redis may never answer its UNSUBSCRIBE.
            with contextlib.suppress(Exception, asyncio.CancelledError):
                async with asyncio.timeout(5.0):
                    await asyncio.gather(counter, return_exceptions=True)
                    await events.aclose()
                    await client.aclose()
    return act


async def _count_evicted_locks(run, events) -> None:
    client = aioredis.Redis.from_url(run.server.url, socket_timeout=5)
    try:
        await client.config_set("notify-keyspace-events", "Ee")
    finally:
        await client.aclose()
    await events.subscribe("__keyevent@0__:evicted")
    async for message in events.listen():
        key = message.get("data")
        if message.get("type") == "message" and isinstance(key, bytes) and key.startswith(b"safety:{") \
                and key.endswith(b"}"):
            run.injected += 1


# -- Sentinel -------------------------------------------------------------------


async def sentinel_kill(run, rng) -> None:
    """Stall replication until the master grants a long hold (at most 3 s), then SIGKILL the master; once.

    The replica misses what the master granted during the stall, as an
    asynchronous replica does under load: that is the failover that can lose
    an acknowledged lock (and that `wait_replicas` must not let happen). The
    killed master then comes back empty as a replica of the new one, as an
    operator brings it back, so that `wait_replicas=1` can be met again.
    """
    sentinels = run.deployment.set
    await asyncio.sleep(run.window / 5)
    sentinels.proxy.stall()
    # kill once a hold granted during the stall will outlast the failover (none comes with wait_replicas)
    await _long_hold_since(run, time.monotonic(), timeout=3.0)
    await run.meter.pause(run.deployment.masters()[0])
    sentinels.kill_master()
    run.deployment.master_port = await sentinels.failed_over()
    run.injected += 1
    await run.meter.begin(run.deployment.masters())
    await sentinels.bring_back_old_master()


async def sentinel_partition(run, rng) -> None:
    """Cut the sentinels off the master (their connections killed every 0.1 s) until they fail it over; once.

    The workers still reach the old master, as in a partition that isolates
    the sentinels, and it grants on until the sentinels demote it.
    """
    sentinels = run.deployment.set
    await asyncio.sleep(run.window / 5)
    old = run.deployment.masters()[0]
    client = aioredis.Redis.from_url(old, socket_timeout=5)
    try:
        while await sentinels.master_port() == run.deployment.master_port:
            for conn in await client.client_list():
                if conn.get("name", "").startswith("sentinel-"):
                    await client.execute_command("CLIENT", "KILL", "ID", conn["id"])
            await asyncio.sleep(0.1)
        await run.meter.pause(old)
    finally:
        await client.aclose()
    run.deployment.master_port = await sentinels.failed_over()
    run.injected += 1
    await run.meter.begin(run.deployment.masters())


# -- Cluster --------------------------------------------------------------------


async def _long_hold_since(run, since: float, timeout: float) -> str | None:
    """The key of a hold that started after `since` and plans to run past a failover (~3 s); None at timeout."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for worker in run.live():
            for start in worker.open.values():
                if start["start"] >= since and start.get("plan", 0) >= 0.5 * run.lease:
                    return start["key"]
        await asyncio.sleep(0.005)
    return None


def _held_key(run, rng) -> str:
    """A contended key that a worker holds now (else any of them)."""
    held = [start["key"] for w in run.live() for start in w.open.values() if "key" in start]
    return rng.choice(held or run.deployment.keys)


async def cluster_kill_master(run, rng) -> None:
    """SIGKILL the master serving the slot of a long hold that just began, once; its replica takes over."""
    cluster = run.deployment
    await asyncio.sleep(run.window / 5)
    key = await _long_hold_since(run, time.monotonic(), timeout=3.0) or _held_key(run, rng)
    port = await cluster.owner(key)
    await run.meter.pause(f"redis://127.0.0.1:{port}/0")
    cluster.set.kill(port)
    await cluster.set.failed_over(port)
    cluster.master_ports = sorted(set((await cluster.slot_owners()).values()))
    run.injected += 1
    await run.meter.begin(cluster.masters())


async def cluster_migrate(run, rng) -> None:
    """Move a held key's slot (its keys with it) to another master every 0.3-0.6 L, as a reshard does."""
    cluster = run.deployment
    while True:
        await asyncio.sleep(rng.uniform(0.3, 0.6) * run.lease)
        key = _held_key(run, rng)
        source = await cluster.owner(key)
        target = rng.choice([p for p in cluster.master_ports if p != source])
        await cluster.set.migrate_slot(key_slot(key.encode()), target)
        run.injected += 1


# -- RedLock --------------------------------------------------------------------


def redlock_master(restart: bool):
    """SIGKILL one master of the quorum (the same one each time): kept down, or back empty 0.2 s later, twice."""
    async def act(run, rng) -> None:
        server = run.deployment.servers[0]
        for _ in range(2 if restart else 1):
            await asyncio.sleep(run.window / 3)
            await run.meter.pause(server.url)
            server.crash()
            run.injected += 1
            if restart:
                await asyncio.sleep(0.2)
                await asyncio.to_thread(server.start)
                await run.meter.begin([server.url])
    return act


FAILOVER = {"min_window": FAILOVER_WINDOW, "min_lease": FAILOVER_LEASE, "long_hold": RIDE_THROUGH,
            "keys": FAILOVER_KEYS}

FAULTS = {f.name: f for f in [
    Fault("none", "no fault"),
    Fault("stall-hold-short", "10% of holds block their loop 0.25-0.55 L right after acquiring",
          hold_stall=(0.1, *SHORT), short=True),
    Fault("stall-hold-long", "10% of holds block their loop 1.3-1.6 L right after acquiring",
          hold_stall=(0.1, *LONG), long=True),
    Fault("stall-wait-short", "a process whose tasks all wait blocks its loop 0.25-0.55 L",
          wait_stall=(0.5, *SHORT), sync_ok=False, short=True),
    Fault("stall-wait-long", "a process whose tasks all wait blocks its loop 1.3-1.6 L",
          wait_stall=(0.3, *LONG), sync_ok=False, long=True),
    Fault("sigstop-short", "SIGSTOP a holder process for 0.25-0.55 L, then SIGCONT", act=sigstop(SHORT), short=True),
    Fault("sigstop-long", "SIGSTOP a holder process for 1.3-1.6 L, then SIGCONT", act=sigstop(LONG), long=True),
    Fault("sigkill-holder", "SIGKILL a holder process every 0.4-0.8 L (a new one starts)", act=sigkill(True)),
    Fault("sigkill-waiter", "SIGKILL a process that holds nothing every 0.4-0.8 L (a new one starts)",
          act=sigkill(False)),
    Fault("restart-aof", "crash (SIGKILL) and restart Redis with AOF (fsync always) twice, 0.2 s down",
          act=restart, aof=True, where=("single",)),
    Fault("restart-noaof", "crash (SIGKILL) and restart Redis without persistence twice, 0.2 s down", act=restart,
          forgets=True, where=("single",)),
    Fault("proxy-stall-short", "stall the holder's TCP proxy 0.25-0.55 L", act=proxy_stall(SHORT), proxy=True,
          short=True, where=("single",)),
    Fault("proxy-stall-long", "stall the holder's TCP proxy 1.3-1.6 L", act=proxy_stall(LONG), proxy=True, long=True,
          where=("single",)),
    Fault("proxy-cut", "cut the holder's connections every 0.15-0.3 L, refused for 0.1 s", act=proxy_cut,
          proxy=True, where=("single",)),
    Fault("client-kill", "CLIENT KILL TYPE normal and TYPE pubsub on every master every 0.2-0.4 s",
          act=client_kill),
    Fault("evict", "maxmemory 2 MB above use, volatile-lru, a writer of TTL'd 1 KB keys keeping Redis full",
          act=evict("volatile-lru"), forgets=True, where=("single",)),
    Fault("evict-allkeys", "the same with allkeys-lru", act=evict("allkeys-lru"), forgets=True, where=("single",)),
    Fault("failover-kill", "stall replication, then SIGKILL the master: Sentinel promotes the replica",
          act=sentinel_kill, forgets=True, where=("sentinel",), **FAILOVER),
    Fault("failover-kill-wait", "the same, the workers with wait_replicas=1", act=sentinel_kill,
          options={"wait_replicas": 1}, where=("sentinel",), **FAILOVER),
    Fault("partition-sentinels", "cut the sentinels off the live master until they fail it over",
          act=sentinel_partition, forgets=True, where=("sentinel",), **FAILOVER),
    Fault("cluster-kill-master", "SIGKILL the master of a held key's slot: its replica is promoted",
          act=cluster_kill_master, forgets=True, replicas=True, where=("cluster",), **FAILOVER),
    Fault("cluster-migrate", "migrate a held key's slot to another master every 0.3-0.6 L",
          act=cluster_migrate, where=("cluster",)),
    Fault("redlock-kill-one", "SIGKILL one of the three masters, kept down", act=redlock_master(restart=False),
          where=("redlock",)),
    Fault("redlock-restart-empty", "SIGKILL one master and restart it empty (no persistence) 0.2 s later, twice",
          act=redlock_master(restart=True), where=("redlock",)),
]}

QUICK_SET = ["none", "stall-hold-short", "stall-hold-long", "stall-wait-long", "sigstop-short", "sigstop-long",
             "sigkill-holder", "sigkill-waiter", "restart-aof", "restart-noaof", "proxy-stall-long", "proxy-cut",
             "client-kill", "evict"]

# Per deployment: the quick set (CI for single and cluster) and the full set (`--full --deployment ...`).
QUICK_SETS = {
    "single": QUICK_SET,
    "sentinel": ["none", "sigstop-long", "failover-kill", "failover-kill-wait"],
    "cluster": ["none", "sigstop-long", "cluster-kill-master", "cluster-migrate"],
    "redlock": ["none", "sigstop-long", "redlock-kill-one", "redlock-restart-empty"],
}
FULL_SETS = {
    "single": [f.name for f in FAULTS.values() if "single" in f.where],
    "sentinel": QUICK_SETS["sentinel"] + ["partition-sentinels", "stall-hold-long", "sigstop-short", "sigkill-holder",
                                          "client-kill"],
    "cluster": QUICK_SETS["cluster"] + ["stall-hold-long", "sigstop-short", "sigkill-holder", "client-kill"],
    "redlock": QUICK_SETS["redlock"] + ["stall-hold-long", "sigstop-short", "sigkill-holder", "client-kill"],
}
