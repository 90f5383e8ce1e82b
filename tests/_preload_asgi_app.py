"""A FastAPI app with an import-time LockManager, used at import too: `gunicorn --preload -k uvicorn workers`.

The master imports this module (and takes a start-up lock in `asyncio.run`)
before it forks the workers; each worker then serves the same module-level
manager on its own event loop. Each request deducts one unit of stock as a
plain read-modify-write under the product's lock and records what it saw,
for tests/test_lock_preload.py.
"""

from __future__ import annotations

import asyncio
import os

import redis.asyncio as aioredis
from fastapi import FastAPI

from otel_lock import LockManager, LockMiddleware, locked

URL = os.environ["OTEL_LOCK_TEST_REDIS_URL"]
locks = LockManager.from_url(URL, namespace="preload")


async def _start_up() -> None:
    async with locks.lock("start-up"):  # in the master, before the fork: the manager was used
        pass

asyncio.run(_start_up())

app = FastAPI()
app.add_middleware(LockMiddleware, manager=locks)


@app.post("/stock/{product_id}/deduct")
@locked("stock:{path.product_id}", wait=30.0)
async def deduct(product_id: int) -> dict[str, int]:
    redis = locks.redis  # this worker's client, on this worker's loop
    if await redis.incr("inside") != 1:
        await redis.incr("overlaps")
    left = int(await redis.get(f"stock:{product_id}") or 0)
    await asyncio.sleep(0.001)  # widen the read-modify-write window
    await redis.set(f"stock:{product_id}", left - 1)
    await redis.sadd("pids", os.getpid())
    await redis.decr("inside")
    return {"left": left - 1, "pid": os.getpid()}
