"""The demo job's tick locks end `released`, never `expired`, even on a replica that rarely wins.

Regression: holds were released after this replica won two more ticks, so a
replica winning every other tick kept each hold ~4 ticks on a 3-tick lease
(live: mean hold 21-22 s on a 15 s lease, 12 of 15 holds `expired`).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from types import SimpleNamespace

from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from otel_lock import LockManager
from otel_lock.demo._job import KEEP_TICKS, release_old, run_job

INTERVAL = 0.4
WINS = 4


def hold_outcomes(reader) -> dict[str, int]:
    data = reader.get_metrics_data()
    out: dict[str, int] = {}
    for rm in data.resource_metrics if data else []:
        for sm in rm.scope_metrics:
            for metric in sm.metrics:
                if metric.name == "otel_lock.hold.duration":
                    for point in metric.data.data_points:
                        if point.attributes["lock.name"] == "job:tick":
                            outcome = point.attributes["lock.release.outcome"]
                            out[outcome] = out.get(outcome, 0) + point.count
    return out


async def test_a_replica_winning_every_other_tick_releases_before_the_lease(redis_url):
    """Another replica takes every odd tick, so this one wins only even ticks."""
    reader = InMemoryMetricReader()
    meters = MeterProvider(metric_readers=[reader])
    mine = LockManager.from_url(redis_url, namespace="jobtest", meter_provider=meters)
    other = LockManager.from_url(redis_url, namespace="jobtest")
    first = int(time.time() // INTERVAL)  # the current tick too: the job starts in it
    for tick in range(first, first + 4 * WINS + 4):
        if tick % 2:
            assert await other.try_lock(f"job:tick:{tick}", lease=60, name="job:tick") is not None
    runs: list[int] = []
    done = asyncio.Event()

    async def work(tick: int) -> None:
        runs.append(tick)
        if len(runs) >= WINS:
            done.set()

    job = asyncio.create_task(run_job(mine, INTERVAL, work))
    try:
        await asyncio.wait_for(done.wait(), (4 * WINS + 4) * INTERVAL)
        await asyncio.sleep(INTERVAL)  # one more tick boundary: the releases due then happen
    finally:
        job.cancel()
        await asyncio.gather(job, return_exceptions=True)
        await mine.aclose()
        await other.aclose()
    assert all(tick % 2 == 0 for tick in runs), runs
    outcomes = hold_outcomes(reader)
    meters.shutdown()
    # Every hold at least KEEP_TICKS ticks old was released, none after its lease.
    assert outcomes.get("released", 0) >= WINS - 1, outcomes
    assert set(outcomes) == {"released"}, outcomes


async def test_release_is_by_tick_age_not_by_later_wins():
    released = []

    async def release():
        released.append(True)

    kept = deque([(10, SimpleNamespace(release=release)), (11, SimpleNamespace(release=release))])
    await release_old(kept, 11)
    assert released == [] and len(kept) == 2
    await release_old(kept, 12)  # tick 10 is two ticks old: released although nothing was won since
    assert len(released) == 1 and [tick for tick, _ in kept] == [11]
    await release_old(kept, 20)
    assert len(released) == 2 and not kept
