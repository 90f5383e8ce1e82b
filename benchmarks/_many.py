"""Many locks held by one task: the cost of each acquire and release as the number held grows.

A task that takes N locks (a batch job locking every row it touches) must pay
the same per lock at N = 16,000 as at N = 500. Run in one process, one task,
uncontended keys; redis-py's Lock beside it.

    python -m benchmarks._worker '{"mode": "many", "lib": "otel-lock", "url": ..., "counts": [500, 16000]}'
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Callable

import redis.asyncio as aioredis

from otel_lock import LockManager


async def _otel_lock(url: str, n: int) -> tuple[float, float]:
    async with LockManager.from_url(url, namespace=f"many{n}", lease=120.0) as locks:
        await (await locks.acquire("warm")).release()
        t0 = time.perf_counter()
        held = [await locks.acquire(f"k{i}") for i in range(n)]
        t1 = time.perf_counter()
        for hold in held:
            await hold.release()
        t2 = time.perf_counter()
    return t1 - t0, t2 - t1


async def _redis_py(url: str, n: int) -> tuple[float, float]:
    client = aioredis.Redis.from_url(url)
    try:
        await client.ping()
        t0 = time.perf_counter()
        held = []
        for i in range(n):
            lock = client.lock(f"many{n}:k{i}", timeout=120.0)
            await lock.acquire()
            held.append(lock)
        t1 = time.perf_counter()
        for lock in held:
            await lock.release()
        t2 = time.perf_counter()
    finally:
        await client.aclose()
    return t1 - t0, t2 - t1


LIBS = {"otel-lock": _otel_lock, "redis-py": _redis_py}


def run(spec: dict, send: Callable[[dict], None], await_start: Callable[[], tuple[float, float]]) -> dict:
    send({"ready": True})
    await_start()
    rows: list[dict[str, Any]] = []
    for n in spec["counts"]:
        acquire, release = asyncio.run(LIBS[spec["lib"]](spec["url"], n))
        rows.append({"held": n, "acquire_us": acquire / n * 1e6, "release_us": release / n * 1e6})
    return {"rows": rows}
