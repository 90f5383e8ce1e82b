"""Once per period: a scheduled job runs on exactly one replica per tick.

A tick is `int(time.time() // period)`: every replica computes the same one
without talking to the others. Each takes `<name>:tick:<tick>` once, without
waiting; the winner runs the job, the others skip. The tick's lock is never
released: it is taken with a fixed lease that runs out `keep` ticks after
the tick itself, so a replica that computed the tick late (a stalled loop, a
clock a little behind) finds it still held instead of running it a second
time. That expiry is planned: it is not a loss, counts nothing as lost and
logs nothing.

Fail closed: when Redis cannot be reached nobody can know whether another
replica runs the tick, so nobody does.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Awaitable, Callable

from ._errors import LockBusy, RedisUnavailable
from ._held import HeldLock
from ._options import MAX_LEASE, MIN_LEASE, check_key, check_seconds
from ..telemetry._instruments import Telemetry

log = logging.getLogger("otel_lock")

# A tick's lease runs from now to `keep` ticks after the tick: between keep and
# keep + 1 periods. At least MIN_LEASE (the shortest lease a manager takes):
# a lease of a few milliseconds runs out before the grant's reply is read, the
# grant is given back and the tick never runs, on every replica. At most
# MAX_LEASE, as any lease (a period of 1e16 s reaches past Redis' expiry times).

TakeTick = Callable[[str, float, str], Awaitable[HeldLock]]


def tick_of(period: float, now: float | None = None) -> int:
    return int((time.time() if now is None else now) // period)


def _check(name: str, period: float, keep: int) -> float:
    check_key(name)
    period_s = check_seconds("period", period, allow_zero=False)
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
        raise ValueError(f"keep must be a whole number of ticks >= 1, not {keep!r}")
    # divided, not multiplied: a huge int keep times a float overflows
    if keep + 1 > MAX_LEASE / period_s:
        raise ValueError(f"(keep + 1) * period, the tick's longest lease, must be at most {MAX_LEASE} s "
                         f"(under 2**53 ms), not keep={keep!r}, period={period!r}")
    if keep < MIN_LEASE / period_s:
        raise ValueError(f"keep * period, the tick's shortest lease, must be at least {MIN_LEASE} s (a shorter "
                         f"one runs out before Redis's reply is read), not keep={keep!r}, period={period!r}")
    return period_s


async def once_per_period(take: TakeTick, telemetry: Telemetry, name: str, period: float,
                          job: Callable[[int], Awaitable[Any]], keep: int) -> bool:
    period_s = _check(name, period, keep)
    now = time.time()
    tick = tick_of(period_s, now)
    return await _turn(take, telemetry, name, tick, (tick + 1 + keep) * period_s - now, job)


async def _turn(take: TakeTick, telemetry: Telemetry, name: str, tick: int, lease: float,
                job: Callable[[int], Awaitable[Any]]) -> bool:
    outcome = "failed"
    try:
        try:
            await take(f"{name}:tick:{tick}", lease, name)
        except LockBusy:
            outcome = "skipped"  # another replica has this tick
            return False
        except RedisUnavailable as error:
            outcome = "unavailable"
            log.warning("otel-lock: %s tick %d not run: Redis unavailable (%s)", name, tick, error)
            return False
        await job(tick)
        outcome = "ran"
        return True
    finally:
        telemetry.periodic_runs.add(1, {"lock.name": name, "periodic.outcome": outcome})


async def run_every(take: TakeTick, telemetry: Telemetry, name: str, period: float,
                    job: Callable[[int], Awaitable[Any]], keep: int) -> None:
    period_s = _check(name, period, keep)
    last = None
    while True:
        now = time.time()
        tick = tick_of(period_s, now)
        if tick == last:
            # Woke a hair before the boundary (loop clock vs wall clock): never the same tick twice.
            await asyncio.sleep(max(0.001, (tick + 1) * period_s - now))
            continue
        last = tick
        try:
            await _turn(take, telemetry, name, tick, (tick + 1 + keep) * period_s - now, job)
        except Exception:
            log.exception("otel-lock: %s tick %d failed", name, tick)
        await asyncio.sleep(max(0.0, (tick + 1) * period_s - time.time()))
