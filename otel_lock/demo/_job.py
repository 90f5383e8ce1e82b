"""The scheduled job: every replica wakes each tick, exactly one runs it (`Locks.run_every`).

A tick is wall-clock time // interval, so all replicas agree on it without
talking. The manager's once-per-period API takes the tick's lock without
waiting and keeps it, by plan, until two ticks after its own: a replica that
computed the tick late finds it still held and skips it. Without Redis
nobody can know who runs a tick, so nobody does (fail closed).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Awaitable, Callable

if TYPE_CHECKING:
    from .. import LockManager

log = logging.getLogger("otel_lock.demo.job")
JOB = "job"  # the lock name; each tick's key is job:tick:<tick>


async def run_job(locks: "LockManager | None", interval: float, work: Callable[[int], Awaitable[None]]) -> None:
    """Forever: on each tick boundary, `work(tick)` on exactly one replica.

    `locks=None` (locks disabled) runs on every replica, which is the bug
    this job exists to show.
    """
    if locks is not None:
        await locks.run_every(JOB, interval, work)
        return
    last = None
    while True:
        tick = int(time.time() // interval)
        if tick != last:  # woke a hair before the boundary: never the same tick twice on one replica
            last = tick
            try:
                await work(tick)
            except Exception:
                log.exception("job tick %d failed", tick)
        await asyncio.sleep(max(0.001, (tick + 1) * interval - time.time()))
