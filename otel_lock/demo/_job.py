"""The scheduled job: every replica wakes each tick, exactly one runs it.

A tick is wall-clock time // interval, so all replicas agree on it without
talking. Each tries `job:tick:<n>` once (`try_lock`, no waiting): the winner
runs, the others skip. The lock is kept until two more ticks have passed
(by the clock, whether or not this replica won them), so a replica that
computed tick n and then stalled (a busy CPU, a GC pause) cannot take it
after the winner let go; the lease (three ticks) outlasts that, so every
hold ends `released`, never `expired`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from typing import TYPE_CHECKING, Awaitable, Callable

from redis.exceptions import RedisError

from ..lock._errors import RedisUnavailable

if TYPE_CHECKING:
    from .. import HeldLock, LockManager

log = logging.getLogger("otel_lock.demo.job")
KEEP_TICKS = 2  # ticks a won tick's lock is kept after its own


async def run_job(
    locks: "LockManager | None",
    interval: float,
    work: Callable[[int], Awaitable[None]],
) -> None:
    """Forever: on each tick boundary try the tick's lock and run `work(tick)` if won.

    `locks=None` (locks disabled) runs on every replica, which is the bug
    this job exists to show.
    """
    kept: deque[tuple[int, HeldLock]] = deque()  # (tick, held), oldest first
    last = None
    while True:
        tick = int(time.time() // interval)
        if tick == last:
            # Woke a hair before the boundary (loop clock vs wall clock). Trying the
            # same tick again would re-enter our own lock and run it twice.
            await asyncio.sleep(max(0.001, (tick + 1) * interval - time.time()))
            continue
        last, held = tick, None
        await release_old(kept, tick)  # before this tick's work, which may be slow
        try:
            if locks is not None:
                # Fixed lease: a tick's lock must expire by itself even if this replica dies.
                held = await locks.try_lock(f"job:tick:{tick}", lease=KEEP_TICKS * interval + interval,
                                            name="job:tick")
            if locks is None or held is not None:
                await work(tick)
        except (RedisUnavailable, RedisError) as error:
            # Fail closed: without Redis nobody can know whether another replica runs this tick.
            log.warning("job tick %d not run: Redis unavailable (%s)", tick, error)
        except Exception:
            # A failed tick is logged and the next one still runs.
            log.exception("job tick %d failed", tick)
        if held is not None:
            kept.append((tick, held))
        await asyncio.sleep(max(0.0, (tick + 1) * interval - time.time()))


async def release_old(kept: deque[tuple[int, HeldLock]], now_tick: int) -> None:
    """Release the holds of ticks at least KEEP_TICKS old, by tick age (not by later wins)."""
    while kept and kept[0][0] <= now_tick - KEEP_TICKS:
        await _release(kept.popleft()[1])


async def _release(held: HeldLock) -> None:
    try:
        await held.release()
    except Exception:
        log.warning("could not release a job lock; its lease expires by itself", exc_info=True)
