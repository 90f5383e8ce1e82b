"""One replica of tests/test_periodic.py: `run_every` for a few ticks, recording each run in Redis.

    python tests/_periodic_replica.py URL PERIOD TICKS NAME
"""

from __future__ import annotations

import asyncio
import logging
import sys

import redis.asyncio as aioredis

from otel_lock import LockManager

URL, PERIOD, TICKS, NAME = sys.argv[1], float(sys.argv[2]), int(sys.argv[3]), sys.argv[4]


async def main() -> None:
    logging.basicConfig(level=logging.INFO)
    async with LockManager.from_url(URL, namespace="periodic") as locks, aioredis.Redis.from_url(URL) as redis:
        async def record(tick: int) -> None:
            await redis.rpush("periodic:runs", f"{tick} {NAME}")

        try:
            await asyncio.wait_for(locks.run_every("job", PERIOD, record), PERIOD * TICKS)
        except TimeoutError:
            pass


asyncio.run(main())
