"""The lock scenarios: uncontended cycles, 8 contending workers, many held locks, no thundering herd.

Each function runs one library in fresh worker processes against the given
Redis and returns one row of plain numbers (times in milliseconds).
"""

from __future__ import annotations

from collections import Counter

from ._adapters import RINGS
from ._harness import flush, percentile, run_workers

KEY = "bench:one"


def uncontended(lib: str, url: str, duration: float, profile: str | None = None, telemetry: str | None = None,
                env: dict | None = None, options: dict | None = None, servers: list[str] | None = None) -> dict:
    """(a) One worker, one key, acquire+release in a loop (`telemetry`: a benchmarks._otel_modes mode).

    `options` go to the lock's manager; `servers` are the redis:// URLs of every master behind `url`
    (flushed before, counted around the window), `url` itself when not given.
    """
    flush(servers or url)
    spec = {"mode": "cycle", "lib": lib, "url": url, "key": KEY, "profile": profile, "telemetry": telemetry,
            "options": options}
    [result], redis_delta, window = run_workers([spec], duration, servers or url, env=env)
    durations = result["durations"]
    return {
        "lib": lib,
        "cycles": len(durations),
        "cycles_per_s": len(durations) / window,
        "p50_ms": percentile(durations, 50) * 1e3,
        "p99_ms": percentile(durations, 99) * 1e3,
        "redis_commands_per_cycle": redis_delta["total"] / max(1, len(durations)),
        "client_cpu_per_cycle_us": result["window"]["cpu"] / max(1, len(durations)) * 1e6,
        "redis_calls": redis_delta["calls"],
    }


def analyse(records: list, window: float) -> dict:
    """Acquisitions, handoffs, waits, fairness and the mutual-exclusion check over merged hold intervals.

    A record is (worker, requested, entered, left[, key index]); handoffs and overlaps are counted per key.
    """
    by_key: dict = {}
    for record in records:
        by_key.setdefault(record[4] if len(record) > 4 else 0, []).append(record)
    handoffs = overlaps = 0
    for holds in by_key.values():
        last_exit = float("-inf")
        prev = None
        for wid, _req, enter, leave, *_ in sorted(holds, key=lambda r: r[2]):
            if enter < last_exit:
                overlaps += 1
            last_exit = max(last_exit, leave)
            if prev is not None and wid != prev:
                handoffs += 1
            prev = wid
    waits = [r[2] - r[1] for r in records]
    per_worker = Counter(r[0] for r in records)
    n = len(records)
    return {
        "acquisitions": n,
        "acquisitions_per_s": n / window,
        "handoffs": handoffs,
        "handoffs_per_s": handoffs / window,
        "wait_p50_ms": percentile(waits, 50) * 1e3,
        "wait_p99_ms": percentile(waits, 99) * 1e3,
        "busiest_share": max(per_worker.values()) / n if n else float("nan"),
        "workers_served": len(per_worker),
        "overlaps": overlaps,
    }


def contended(lib: str, url: str, duration: float, workers: int = 8, processes: int = 8,
              count: bool = False, profile_dir: str | None = None, keys: list[str] | None = None,
              options: dict | None = None, servers: list[str] | None = None) -> dict:
    """(b) and (d): `workers` waiters on one key spread over `processes` processes, tiny critical section.

    With `keys`, each worker takes those keys in turn instead; `options` and `servers` as for uncontended().
    """
    flush(servers or url)
    per = workers // processes
    specs = [
        {"mode": "contend", "lib": lib, "url": url, "key": KEY, "keys": keys, "options": options, "tasks": per,
         "worker_base": i * per, "count": count, "profile": f"{profile_dir}/contend-{i}.prof" if profile_dir else None}
        for i in range(processes)
    ]
    results, redis_delta, window = run_workers(specs, duration, servers or url)
    records = [tuple(r) for res in results for r in res["records"]]
    row = {"lib": lib, "workers": workers, "processes": processes, **analyse(records, window)}
    handoffs = max(1, row["handoffs"])
    cpu = sum(res["window"]["cpu"] for res in results)
    row.update(
        redis_commands_per_handoff=redis_delta["total"] / handoffs,
        redis_cpu_ms_per_handoff=redis_delta["cpu"] / handoffs * 1e3,
        client_cpu_ms_per_handoff=cpu / handoffs * 1e3,
        client_sleeps_per_handoff=sum(res["window"]["sleeps"] for res in results) / handoffs,
        redis_calls=redis_delta["calls"],
    )
    if count:
        row.update(
            client_commands_per_handoff=sum(res["window"]["commands"] for res in results) / handoffs,
            client_round_trips_per_handoff=sum(res["window"]["round_trips"] for res in results) / handoffs,
        )
    return row


def held(lib: str, url: str, locks: int, lease: float, ticks: int = 3) -> dict:
    """(c) `locks` locks held and renewed; cost of one renewal of all of them."""
    flush(url)
    interval = (int(lease) * 2 / 3) if lib == "python-redis-lock" else lease / 3
    spec = {"mode": "held", "lib": lib, "url": url, "locks": locks, "lease": lease, "count": True}
    [result], redis_delta, window = run_workers([spec], ticks * interval, url)
    # renewal intervals covered by the worker's own window (a starved process may overrun the nominal one)
    renewals = max(window, result["t"]) / interval
    bursts = result["bursts"]
    return {
        "lib": lib,
        "locks": locks,
        "interval_s": interval,
        "round_trips_per_tick": result["round_trips"] / renewals,
        "commands_per_tick": result["commands"] / renewals,
        "redis_commands_per_tick": redis_delta["total"] / renewals,
        "client_cpu_ms_per_tick": result["cpu"] / renewals * 1e3,
        "redis_cpu_ms_per_tick": redis_delta["cpu"] / renewals * 1e3,
        "bursts": len(bursts),
        "round_trips_per_burst": bursts,
        "burst_ms": [round(s * 1e3, 1) for s in result["burst_seconds"]],
        "lost": result["lost"],
        "setup_s": result["setup_seconds"],
        "threads": result.get("threads"),
        "redis_calls": redis_delta["calls"],
    }


def ring(url: str, duration: float, via: str, processes: int = 8) -> dict:
    """The machine's limit: one token passed around `processes` processes by Redis (`via`: a key of RINGS)."""
    flush(url)
    specs = [{"mode": "ring", "via": via, "url": url, "index": i, "size": processes} for i in range(processes)]
    results, redis_delta, window = run_workers(specs, duration, url)
    hops = sum(r["hops"] for r in results)
    return {
        "lib": RINGS[via],
        "processes": processes,
        "handoffs_per_s": hops / window,
        "redis_commands_per_handoff": redis_delta["total"] / max(1, hops),
        "client_cpu_ms_per_handoff": sum(r["cpu"] for r in results) / max(1, hops) * 1e3,
        "client_sleeps_per_handoff": sum(r["sleeps"] for r in results) / max(1, hops),
        "redis_cpu_ms_per_handoff": redis_delta["cpu"] / max(1, hops) * 1e3,
    }


def many(lib: str, url: str, counts: list[int]) -> list[dict]:
    """Per-lock cost of acquiring then releasing N locks held at once by one task, for each N in `counts`."""
    flush(url)
    [result], _, _ = run_workers([{"mode": "many", "lib": lib, "url": url, "counts": counts}], 0.0, url)
    return [{"lib": lib, **row} for row in result["rows"]]


def held_bytes(url: str) -> list[dict]:
    """What one held lock keeps in Redis: its keys and their `MEMORY USAGE`, per library (deterministic)."""
    import asyncio

    import redis

    def measure(client: redis.Redis) -> tuple[int, int]:
        keys = [k for k in client.keys("*") if not k.endswith(b":model")]  # otel-lock's namespace claim
        return len(keys), sum(client.memory_usage(k, samples=0) or 0 for k in keys)

    async def otel_lock(client: redis.Redis) -> tuple[int, int]:
        from otel_lock import LockManager

        async with LockManager.from_url(url, namespace="bench") as locks:
            async with locks.lock(KEY):
                return measure(client)

    rows = []
    for lib in ("otel-lock", "redis-py", "python-redis-lock"):
        flush(url)
        with redis.Redis.from_url(url) as client:
            if lib == "otel-lock":
                keys, size = asyncio.run(otel_lock(client))
            elif lib == "redis-py":
                with client.lock(KEY, timeout=30):
                    keys, size = measure(client)
            else:
                import redis_lock

                with redis_lock.Lock(client, KEY, expire=30):
                    keys, size = measure(client)
        rows.append({"lib": lib, "keys": keys, "bytes": size})
    return rows
