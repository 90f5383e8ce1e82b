"""A child process for the multi-process tests of permits and shared holds.

Run as `python _shapes_child.py '<json spec>'`; `spec["do"]` says what:

- `permits`: `tasks` tasks each take a permit of `key` (`permits`) `count`
  times; inside, INCR `inside` and remember the largest value seen, then DECR.
  Prints `{"max": n, "tokens": [...]}`.
- `rw`: `tasks` tasks, task i exclusive if i % 3 == 0 else shared, `count`
  holds each; inside, a writer INCRs `writers` and checks `readers` is 0, a
  reader INCRs `readers` and checks `writers` is 0; a breach INCRs `breaches`.
  Prints `{"max_readers": n}`.
- `read_forever`: `tasks` tasks hold `key` shared, back to back and
  overlapping, until the key `stop` exists; counts holds in `reads`.
- `hold`: takes a permit (or a shared hold, `shared`), prints `{"token": t}`
  and waits to be killed.

Every line is JSON, then `{"done": true}`.
"""

from __future__ import annotations

import asyncio
import json
import sys

import redis.asyncio as aioredis

from otel_lock import LockManager


async def main(spec: dict) -> None:
    locks = LockManager.from_url(spec["url"], namespace="t", lease=spec.get("lease", 5.0), wait=60.0)
    r = aioredis.Redis.from_url(spec["url"])
    key = spec.get("key", "k")
    do = spec["do"]
    if do == "permits":
        best, tokens = 0, []

        async def worker() -> None:
            nonlocal best
            for _ in range(spec["count"]):
                async with locks.semaphore(key, permits=spec["permits"]) as held:
                    inside = await r.incr("inside")
                    best = max(best, inside)
                    tokens.append(held.token)
                    await asyncio.sleep(0.002)
                    await r.decr("inside")
        await asyncio.gather(*(worker() for _ in range(spec["tasks"])))
        print(json.dumps({"max": best, "tokens": tokens}), flush=True)
    elif do == "rw":
        most = 0

        async def rw(i: int) -> None:
            nonlocal most
            writer = i % 3 == 0
            for _ in range(spec["count"]):
                async with locks.lock(key, shared=not writer):
                    if writer:
                        if await r.incr("writers") != 1 or int(await r.get("readers") or 0):
                            await r.incr("breaches")
                        await asyncio.sleep(0.001)
                        await r.decr("writers")
                    else:
                        most = max(most, await r.incr("readers"))
                        if int(await r.get("writers") or 0):
                            await r.incr("breaches")
                        await asyncio.sleep(0.003)
                        await r.decr("readers")
        await asyncio.gather(*(rw(i) for i in range(spec["tasks"])))
        print(json.dumps({"max_readers": most}), flush=True)
    elif do == "read_forever":
        async def reader() -> None:
            while not await r.exists("stop"):
                async with locks.lock(key, shared=True):
                    await r.incr("reads")
                    await asyncio.sleep(0.01)
        await asyncio.gather(*(reader() for _ in range(spec["tasks"])))
    elif do == "hold":
        if spec.get("shared"):
            held = await locks.acquire(key, shared=True, cancel_on_lost=False)
        else:
            held = await locks.acquire_permit(key, permits=spec["permits"], cancel_on_lost=False)
        print(json.dumps({"token": held.token}), flush=True)
        await asyncio.Event().wait()
    await r.aclose()
    await locks.aclose()
    print(json.dumps({"done": True}), flush=True)


if __name__ == "__main__":
    asyncio.run(main(json.loads(sys.argv[1])))
