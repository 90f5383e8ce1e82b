"""One replica of tests/test_periodic.py: `run_every` for a few ticks, recording each run in Redis.

    python tests/_periodic_replica.py URL PERIOD TICKS NAME
"""

from __future__ import annotations

import faulthandler

faulthandler.dump_traceback_later(30, exit=True)  # a hang ends with every thread's stack on stderr (the test shows it)

import asyncio  # noqa: E402
import logging  # noqa: E402
import sys  # noqa: E402

import redis.asyncio as aioredis  # noqa: E402

from otel_lock import LockManager  # noqa: E402

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
