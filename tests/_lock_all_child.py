"""A child process for the multi-process lock_all tests: takes several keys `count` times per task.

Run as `python _lock_all_child.py '<json: url, keys, count, tasks, how, wait>'`.
`how` is `lock_all` (`locks.lock_all(keys)`) or `by_hand` (one `lock()`
inside the other, in the order `keys` names them: what users stack today).
Prints `{"ready": true}`, waits for a `go` in Redis (BLPOP, so that every
child starts at once), then one JSON line per key per hold (key, token,
start, end on `time.monotonic()`, system wide on Linux), one
`{"refused": <exception name>}` per attempt that raised, and `{"done": true}`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import time

import redis.asyncio as aioredis

from otel_lock import LockError, LockManager


async def main(spec: dict) -> None:
    locks = LockManager.from_url(spec["url"], lease=5.0, wait=spec["wait"])
    r = aioredis.Redis.from_url(spec["url"])
    keys = spec["keys"]
    print(json.dumps({"ready": True}), flush=True)
    await r.blpop(["go"], timeout=60)

    async def hold_by_hand(stack: contextlib.AsyncExitStack) -> dict[str, int]:
        tokens = {}
        for key in keys:
            held = await stack.enter_async_context(locks.lock(key))
            tokens[key] = held.token
            await asyncio.sleep(0.002)  # the window in which the other order takes the next key
        return tokens

    async def worker() -> None:
        for _ in range(spec["count"]):
            try:
                async with contextlib.AsyncExitStack() as stack:
                    if spec["how"] == "lock_all":
                        tokens = (await stack.enter_async_context(locks.lock_all(keys))).tokens
                    else:
                        tokens = await hold_by_hand(stack)
                    start = time.monotonic()
                    await asyncio.sleep(0.001)
                    end = time.monotonic()
            except LockError as exc:
                print(json.dumps({"refused": type(exc).__name__}), flush=True)
                continue
            for key, token in tokens.items():
                print(json.dumps({"key": key, "token": token, "start": start, "end": end}), flush=True)

    await asyncio.gather(*(worker() for _ in range(spec["tasks"])))
    await locks.aclose()
    await r.aclose()
    print(json.dumps({"done": True}), flush=True)


if __name__ == "__main__":
    asyncio.run(main(json.loads(sys.argv[1])))
