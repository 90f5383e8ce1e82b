"""Scenario (c): many held locks kept alive by renewal; what does one renewal tick cost?

otel-lock renews every held lock from one watchdog in batched round trips.
The peers have no shared watchdog: redis-py's Lock needs a task per lock
calling extend(), python-redis-lock starts a thread per auto-renewed lock,
and pottery's Redlock has no automatic renewal at all (not measured).
"""

from __future__ import annotations

import asyncio
import threading
import time

from . import _counting


def _window_open() -> dict:
    _counting.Counts.stamps = []
    return {"cpu": time.process_time(), "t": time.monotonic(), **_counting.Counts.snapshot()}


def _window_close(begin: dict, interval: float) -> dict:
    stamps, _counting.Counts.stamps = _counting.Counts.stamps or [], None
    end = {"cpu": time.process_time(), "t": time.monotonic(), **_counting.Counts.snapshot()}
    delta = {k: end[k] - begin[k] for k in begin}
    groups = _counting.bursts(stamps, gap=interval / 4)
    delta["bursts"] = [len(g) for g in groups]
    delta["burst_seconds"] = [g[-1] - g[0] for g in groups]
    return delta


async def _chunked(coros, size: int = 500) -> list:
    out = []
    for i in range(0, len(coros), size):
        out += await asyncio.gather(*coros[i:i + size])
    return out


async def _sleep_until(t: float) -> None:
    await asyncio.sleep(max(0.0, t - time.monotonic()))


async def _otel(spec: dict, send, await_start) -> dict:
    from otel_lock import LockManager

    lease, n = spec["lease"], spec["locks"]
    manager = LockManager.from_url(spec["url"], namespace="bench", lease=lease)
    t0 = time.monotonic()
    held = await _chunked([manager.try_lock(f"held:{i}", lease=None, name="held") for i in range(n)])
    setup = time.monotonic() - t0
    assert all(h is not None for h in held), "a held:* key was busy"
    send({"ready": True})
    start, stop = await asyncio.get_running_loop().run_in_executor(None, await_start)
    await _sleep_until(start)
    begin = _window_open()
    await _sleep_until(stop)
    result = _window_close(begin, lease / 3)
    result.update(setup_seconds=setup, interval=lease / 3, lost=sum(h.lost.is_set() for h in held))
    await _chunked([h.release() for h in held])
    await manager.aclose()
    return result


async def _redis_py(spec: dict, send, await_start) -> dict:
    import redis.asyncio as aioredis
    from redis.exceptions import LockError

    lease, n = spec["lease"], spec["locks"]
    client = aioredis.Redis.from_url(spec["url"])
    # the default pool opens a connection per concurrent command; bound them below the fd limit
    # (redis-py's BlockingConnectionPool hung here once tasks were cancelled)
    gate = asyncio.Semaphore(100)
    lost = acquired = 0
    all_acquired, stopping = asyncio.Event(), asyncio.Event()

    async def hold(i: int) -> None:
        # what a redis-py user writes for "keep it while I work": a task per lock calling extend()
        nonlocal lost, acquired
        lock = client.lock(f"held:{i}", timeout=lease)
        async with gate:
            assert await lock.acquire(blocking=False)
        acquired += 1
        if acquired == n:
            all_acquired.set()
        try:
            while not stopping.is_set():
                try:
                    await asyncio.wait_for(stopping.wait(), lease / 3)
                except TimeoutError:
                    async with gate:
                        await lock.extend(lease, replace_ttl=True)
        except LockError:
            lost += 1
            return
        try:
            async with gate:
                await lock.release()
        except LockError:
            lost += 1

    t0 = time.monotonic()
    tasks = [asyncio.create_task(hold(i)) for i in range(n)]
    await all_acquired.wait()
    setup = time.monotonic() - t0
    send({"ready": True})
    start, stop = await asyncio.get_running_loop().run_in_executor(None, await_start)
    await _sleep_until(start)
    begin = _window_open()
    await _sleep_until(stop)
    result = _window_close(begin, lease / 3)
    stopping.set()
    await asyncio.gather(*tasks)
    result.update(setup_seconds=setup, interval=lease / 3, lost=lost)
    await client.aclose()
    return result


def _python_redis_lock(spec: dict, send, await_start) -> dict:
    import redis
    import redis_lock

    lease, n = int(spec["lease"]), spec["locks"]
    interval = lease * 2 / 3  # its renewal thread runs every expire*2/3
    threading.stack_size(256 * 1024)  # thousands of renewal threads
    client = redis.Redis.from_url(spec["url"], max_connections=n + 10)
    t0 = time.monotonic()
    locks = []
    for i in range(n):
        lock = redis_lock.Lock(client, f"held:{i}", expire=lease, auto_renewal=True)
        assert lock.acquire(blocking=False)
        locks.append(lock)
    setup = time.monotonic() - t0
    send({"ready": True})
    start, stop = await_start()
    time.sleep(max(0.0, start - time.monotonic()))
    begin = _window_open()
    time.sleep(max(0.0, stop - time.monotonic()))
    result = _window_close(begin, interval)
    threads = threading.active_count()
    lost = 0
    for lock in locks:
        try:
            lock.release()
        except redis_lock.NotAcquired:
            lost += 1
    result.update(setup_seconds=setup, interval=interval, lost=lost, threads=threads)
    client.close()
    return result


def run(spec: dict, send, await_start) -> dict:
    lib = spec["lib"]
    if lib == "otel-lock":
        return asyncio.run(_otel(spec, send, await_start))
    if lib == "redis-py":
        return asyncio.run(_redis_py(spec, send, await_start))
    if lib == "python-redis-lock":
        return _python_redis_lock(spec, send, await_start)
    raise ValueError(f"scenario 'held' does not support {lib!r}")
