"""A child process for the multi-process lock tests: holds lock keys `count` times.

Run as `python _holder_child.py '<json: url or urls, keys, count, tasks>'`:
`url` makes a `LockManager.from_url` (one Redis, Sentinel or Cluster), `urls`
a `RedLockManager.from_urls`. Each task holds every key in turn. Prints one
JSON line per hold: its key, token, and start and end on `time.monotonic()`
(system wide on Linux, so the parent can compare the intervals of two
processes), then `{"done": true}`.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time

from otel_lock import LockManager, RedLockManager


async def main(spec: dict) -> None:
    if "urls" in spec:
        locks = RedLockManager.from_urls(spec["urls"], lease=5.0, wait=30.0)
    else:
        locks = LockManager.from_url(spec["url"], lease=5.0, wait=30.0)

    async def worker() -> None:
        for _ in range(spec["count"]):
            for key in spec["keys"]:
                async with locks.lock(key) as held:
                    start = time.monotonic()
                    await asyncio.sleep(0.001)
                    end = time.monotonic()
                    print(json.dumps({"key": key, "token": held.token, "start": start, "end": end}), flush=True)

    await asyncio.gather(*(worker() for _ in range(spec["tasks"])))
    await locks.aclose()
    print(json.dumps({"done": True}), flush=True)


if __name__ == "__main__":
    asyncio.run(main(json.loads(sys.argv[1])))
