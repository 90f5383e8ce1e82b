"""Run as a script: a module-level manager, then fork, then every process contends for one key.

    python tests/_fork_holders.py URL MODE OUT

MODE: `os-fork` (two os.fork() children), `mp-fork` (two multiprocessing
"fork" children), `used-before-fork` (the parent takes a lock in
`asyncio.run` first, then forks two children and contends with them).
Each process writes one JSON line to OUT: its pid, the holds it made
(owner, token) and how many times it found someone else inside.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import sys

from otel_lock import LockManager

URL, MODE, OUT = sys.argv[1], sys.argv[2], sys.argv[3]
HOLDS = 40
locks = LockManager.from_url(URL, namespace="forked", lease=5.0)  # the import-time manager every example shows


async def contend() -> dict:
    redis = locks.redis
    holds, overlaps = [], 0
    for _ in range(HOLDS):
        async with locks.lock("k", wait=20) as held:
            if await redis.incr("forked:inside") != 1:
                overlaps += 1
            holds.append([held.owner, held.token])
            await asyncio.sleep(0.001)
            await redis.decr("forked:inside")
    await locks.aclose()
    return {"pid": os.getpid(), "holds": holds, "overlaps": overlaps}


def run_and_report() -> None:
    result = asyncio.run(asyncio.wait_for(contend(), 60))
    with open(OUT, "a") as out:
        out.write(json.dumps(result) + "\n")


def fork_children(count: int, also_parent: bool) -> None:
    pids = []
    for _ in range(count):
        pid = os.fork()
        if pid == 0:
            try:
                run_and_report()
            finally:
                os._exit(0)
        pids.append(pid)
    if also_parent:
        run_and_report()
    for pid in pids:
        os.waitpid(pid, 0)


def main() -> None:
    if MODE == "os-fork":
        fork_children(2, also_parent=False)
    elif MODE == "mp-fork":
        context = multiprocessing.get_context("fork")
        children = [context.Process(target=run_and_report) for _ in range(2)]
        for child in children:
            child.start()
        for child in children:
            child.join(90)
    elif MODE == "used-before-fork":
        async def start_up() -> None:
            async with locks.lock("start-up"):
                await asyncio.sleep(0.01)
        asyncio.run(start_up())
        fork_children(2, also_parent=True)
    else:
        raise SystemExit(f"unknown mode {MODE}")


if __name__ == "__main__":
    main()
