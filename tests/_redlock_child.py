"""A child process for tests/test_redlock.py: holds one RedLock key `count` times.

Run as `python _redlock_child.py '<json: urls, key, count>'`. Prints one JSON
line per hold: its token and its start and end on `time.monotonic()` (system
wide on Linux, so the parent can compare the intervals of two processes),
then `{"done": true}`.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time

from otel_lock import RedLockManager


async def main(urls: list[str], key: str, count: int, tasks: int) -> None:
    locks = RedLockManager.from_urls(urls, lease=5.0, wait=30.0)

    async def worker() -> None:
        for _ in range(count):
            async with locks.lock(key) as held:
                start = time.monotonic()
                await asyncio.sleep(0.001)
                end = time.monotonic()
                print(json.dumps({"token": held.token, "start": start, "end": end}), flush=True)

    await asyncio.gather(*(worker() for _ in range(tasks)))
    await locks.aclose()
    print(json.dumps({"done": True}), flush=True)


if __name__ == "__main__":
    spec = json.loads(sys.argv[1])
    asyncio.run(main(spec["urls"], spec["key"], spec["count"], spec["tasks"]))
