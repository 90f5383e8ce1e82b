"""The lock on every deployment, under the same 8-process contention, beside the peers.

    .venv/bin/python -m benchmarks.run --only deployments            # 2-3 minutes on 2 CPUs
    .venv/bin/python -m benchmarks.run --only deployments --quick    # 40-60 s, no uncontended column,
                                                                     # nothing tracked written

All servers are started here on free loopback ports and stopped by pid at
the end: the single Redis (run.py's), a Sentinel set (master, replica,
three sentinels; benchmarks/_sentinel_set.py), a Redis Cluster of three
masters (benchmarks/_cluster_set.py) and three independent masters for
RedLock. Every row is the same run of bench_lock.contended(): 8 worker
processes (one waiter each) take 3 keys in turn, one key per Cluster master
(so on the Cluster the load spreads over the slots of every master; on the
other deployments the keys are just 3 keys), critical section = a local
increment. Each row also gets one uncontended worker (acquire + release on
one key, not in --quick), the base price of a lock on that deployment. Rows
are interleaved over the rounds; the best round by hand-overs/s is kept,
every round listed.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from contextlib import AsyncExitStack
from dataclasses import dataclass, field

from otel_lock.cli._redis_server import RedisServer

from . import bench_lock
from ._adapters import available
from ._cluster_set import ClusterSet
from ._harness import best_rounds, rotate
from ._sentinel_set import SentinelSet


@dataclass(frozen=True)
class Row:
    id: str
    deployment: str  # which servers: single, sentinel, cluster, redlock
    lib: str  # a benchmarks._adapters name
    where: str  # the table's words for the deployment and the lock
    lock: str
    options: dict = field(default_factory=dict)  # for the lock's manager


WAIT_1 = {"wait_replicas": 1, "wait_replicas_timeout": 0.5}
ROWS = (
    Row("single", "single", "otel-lock", "single Redis", "otel-lock `LockManager`"),
    Row("single-python-redis-lock", "single", "python-redis-lock", "single Redis", "python-redis-lock"),
    Row("sentinel", "sentinel", "otel-lock", "Sentinel (master + 1 replica)", "otel-lock, no WAIT"),
    Row("sentinel-wait1", "sentinel", "otel-lock", "Sentinel (master + 1 replica)", "otel-lock, `wait_replicas=1`",
        WAIT_1),
    Row("cluster", "cluster", "otel-lock", "Cluster (3 masters)", "otel-lock `LockManager`"),
    Row("redlock", "redlock", "otel-lock-redlock", "3 independent masters", "otel-lock `RedLockManager`"),
    Row("redlock-pottery", "redlock", "pottery", "3 independent masters", "pottery `Redlock`"),
)
# Most of a row's time is starting its worker processes (about 0.5 s of CPU each for Python and redis-py),
# not the measured window: --quick skips the uncontended cycles, and smoke (the test suite's check of the
# shape: every row's contention, nothing timed) also uses 2 processes.
SIZES = {
    "full": {"rounds": 2, "contended_s": 4.0, "uncontended_s": 1.5, "processes": 8},
    "quick": {"rounds": 1, "contended_s": 1.0, "uncontended_s": None, "processes": 8},
    "smoke": {"rounds": 1, "contended_s": 0.3, "uncontended_s": None, "processes": 2},
}
KEYS_PER_MASTER = 1


@dataclass
class Target:
    url: str  # what the lock is given (several URLs, space-separated, for a quorum)
    servers: list[str]  # the masters behind it, flushed before and counted around each window
    shape: str


def run(single_url: str, size: str = "full") -> dict:
    """Every row against fresh servers (single_url is the single Redis); size: a key of SIZES."""
    if size not in SIZES:
        raise ValueError(f"unknown benchmark size {size!r}: use one of {', '.join(SIZES)}")
    return asyncio.run(_run(single_url, SIZES[size] | {"size": size}))


async def _run(single_url: str, plan: dict) -> dict:
    # a peer missing from the venv (the `bench` extra) is skipped, not a crash in a worker
    rows = [r for r in ROWS if available(r.lib)]
    out: dict = {**plan, "rows": [], "failures": [], "every_round": {"contended": [], "uncontended": []}}
    async with AsyncExitStack() as stack:
        _say("starting servers: Sentinel set, Cluster, 3 RedLock masters")
        sentinel = await stack.enter_async_context(SentinelSet(proxy=False))
        cluster = await stack.enter_async_context(ClusterSet(masters=3))
        masters = [stack.enter_context(RedisServer()) for _ in range(3)]
        targets = {
            "single": Target(single_url, [single_url], "one redis-server, redis:// URL"),
            "sentinel": Target(sentinel.url, [sentinel.master.url],
                               "1 master + 1 replica + 3 sentinels, redis+sentinel:// URL"),
            "cluster": Target(cluster.url, [f"redis://127.0.0.1:{p}" for p in cluster.ports],
                              "3 masters (redis-cli --cluster create), no replicas, redis+cluster:// URL"),
            "redlock": Target(" ".join(m.url for m in masters), [m.url for m in masters],
                              "3 independent redis-servers, redis:// URLs"),
        }
        out["keys"] = await _spread_keys(cluster)
        out["deployments"] = {name: t.shape for name, t in targets.items()}
        names = [k["key"] for k in out["keys"]]
        for r in range(plan["rounds"]):
            for row in rotate(rows, r):
                target = targets[row.deployment]
                common = {"row": row.id, "deployment": row.deployment, "where": row.where, "lock": row.lock,
                          "options": row.options, "round": r + 1}
                if plan["uncontended_s"]:
                    _attempt(out, "uncontended", f"{row.id}: uncontended, round {r + 1}", common,
                             bench_lock.uncontended, row.lib, target.url, plan["uncontended_s"], options=row.options,
                             servers=target.servers)
                _attempt(out, "contended", f"{row.id}: {plan['processes']} processes on {len(names)} keys, "
                         f"round {r + 1}", common, bench_lock.contended, row.lib, target.url, plan["contended_s"],
                         workers=plan["processes"], processes=plan["processes"], keys=names,
                         options=row.options, servers=target.servers)
    every = out["every_round"]
    best_cycle = {b["row"]: b for b in best_rounds(every["uncontended"], "cycles_per_s", True, lambda x: x["row"])}
    for best in best_rounds(every["contended"], "handoffs_per_s", True, lambda x: x["row"]):
        cycle = best_cycle.get(best["row"], {})
        out["rows"].append({**best, "cycle_p50_ms": cycle.get("p50_ms"), "cycle_p99_ms": cycle.get("p99_ms"),
                            "cycle_redis_commands": cycle.get("redis_commands_per_cycle"),
                            "cycle_rounds": cycle.get("rounds", [])})
    order = [r.id for r in ROWS]
    out["rows"].sort(key=lambda x: order.index(x["row"]))
    return out


async def _spread_keys(cluster: ClusterSet) -> list[dict]:
    """KEYS_PER_MASTER lock keys on each Cluster master (a lock's slot is its key's: the hash tag is {key})."""
    from redis.crc import key_slot

    per_master = await cluster.keys_per_master(KEYS_PER_MASTER, prefix="bench:hot")
    return [{"key": key, "slot": key_slot(key.encode()), "cluster_master_port": port}
            for port in sorted(per_master) for key in per_master[port]]


def _attempt(out: dict, table: str, what: str, common: dict, fn, *args, **kwargs) -> None:
    # one row failing must not cost the other rows of the run
    _say(what)
    load = os.getloadavg()[0]
    try:
        row = fn(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - reported in the docs
        _say(f"FAILED: {what}: {exc!r}")
        out["failures"].append({"what": what, "error": repr(exc)})
        return
    out["every_round"][table].append({**row, **common, "load_1m_before": round(load, 2)})


def _say(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)
