"""Once per period: a job runs on exactly one replica per tick, and the tick lock's planned end is no loss.

Replicas are separate processes with their own managers (tests/_periodic_replica.py),
sharing one Redis: each tick's runs are recorded there and must be exactly one.
"""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis

from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from otel_lock import LockManager

ROOT = Path(__file__).resolve().parents[1]
PERIOD = 0.3


class Otel:
    """An in-memory meter provider and what it recorded."""

    def __init__(self) -> None:
        self.reader = InMemoryMetricReader()
        self.meter_provider = MeterProvider(metric_readers=[self.reader])

    def providers(self) -> dict:
        return {"meter_provider": self.meter_provider}

    def _points(self, name: str) -> list:
        data = self.reader.get_metrics_data()
        return [p for rm in (data.resource_metrics if data else []) for sm in rm.scope_metrics
                for m in sm.metrics if m.name == name for p in m.data.data_points]

    def attrs(self, name: str) -> list[dict]:
        return [dict(p.attributes) for p in self._points(name)]

    def sums(self, name: str) -> dict[tuple, int]:
        return {(p.attributes["lock.name"], p.attributes["periodic.outcome"]): p.value for p in self._points(name)}


def test_three_replicas_run_each_tick_exactly_once(redis_url):
    ticks = 8
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    replicas = [subprocess.Popen([sys.executable, str(ROOT / "tests" / "_periodic_replica.py"), redis_url,
                                  str(PERIOD), str(ticks), f"r{i}"], env=env, stderr=subprocess.PIPE, text=True)
                for i in range(3)]
    logs = [replica.communicate(timeout=60)[1] for replica in replicas]
    assert [replica.returncode for replica in replicas] == [0, 0, 0], logs
    with redis.Redis.from_url(redis_url) as client:
        runs = [entry.decode().split() for entry in client.lrange("periodic:runs", 0, -1)]
    by_tick: dict[str, list[str]] = {}
    for tick, replica in runs:
        by_tick.setdefault(tick, []).append(replica)
    assert len(by_tick) >= ticks - 2, by_tick  # the first and last tick may fall outside every replica's window
    assert all(len(who) == 1 for who in by_tick.values()), by_tick
    for log in logs:  # the planned end of every tick's lock is not a loss
        assert "lost" not in log and "WARNING" not in log, log


async def test_a_tick_is_won_once_and_its_planned_expiry_counts_no_loss(redis_url, caplog):
    otel = Otel()
    period = 0.2
    async with LockManager.from_url(redis_url, namespace="per", **otel.providers()) as a, \
            LockManager.from_url(redis_url, namespace="per", **otel.providers()) as b:
        ran: list[tuple[str, int]] = []

        def job(who: str):
            async def run(tick: int) -> None:
                ran.append((who, tick))
            return run

        # both replicas wake in the same tick: one runs, the other skips
        while time.time() % period > period / 2:  # leave the tick time to be taken twice
            await asyncio.sleep(0.01)
        first = await a.once_per_period("report", period, job("a"), keep=1)
        second = await b.once_per_period("report", period, job("b"), keep=1)
        assert (first, second) == (True, False) and len(ran) == 1
        tick = ran[0][1]
        # the tick's lock is kept (never released) and runs out, keep=1 tick after its own, by plan
        with redis.Redis.from_url(redis_url) as client:
            assert client.exists(f"per:{{report:tick:{tick}}}") == 1
        ended = {"lock.name": "report", "lock.release.outcome": "released"}
        deadline = time.monotonic() + 10
        while ended not in otel.attrs("otel_lock.hold.duration") and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert ended in otel.attrs("otel_lock.hold.duration")
    # no loss counted (the renewal outcomes exist, seeded at 0 before their first event)
    assert [p.value for p in otel._points("otel_lock.renewals") if p.value] == []
    runs = otel.sums("otel_lock.periodic.runs")
    assert runs[("report", "ran")] == 1 and runs[("report", "skipped")] == 1
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.records


async def test_without_redis_nobody_runs_the_tick(caplog):
    otel = Otel()
    async with LockManager.from_url("redis://127.0.0.1:1/0", socket_timeout=0.5, **otel.providers()) as locks:
        ran: list[int] = []

        async def job(tick: int) -> None:
            ran.append(tick)
        assert await locks.once_per_period("sync", 1.0, job) is False
    assert ran == []
    assert otel.sums("otel_lock.periodic.runs") == {("sync", "unavailable"): 1}


async def test_a_failing_job_is_counted_and_the_next_tick_still_runs(redis_url):
    otel = Otel()
    async with LockManager.from_url(redis_url, namespace="fail", **otel.providers()) as locks:
        runs: list[int] = []
        twice = asyncio.Event()

        async def job(tick: int) -> None:
            runs.append(tick)
            if len(runs) >= 2:
                twice.set()
            raise RuntimeError("the job broke")

        loop = asyncio.create_task(locks.run_every("flaky", 0.1, job))
        try:
            await asyncio.wait_for(twice.wait(), 10)
        finally:
            loop.cancel()
            await asyncio.gather(loop, return_exceptions=True)
    assert len(set(runs)) == len(runs) >= 2  # never the same tick twice
    assert otel.sums("otel_lock.periodic.runs")[("flaky", "failed")] >= 2


@pytest.mark.parametrize("kwargs, message", [
    ({"period": 0}, "period"), ({"period": -1}, "period"), ({"keep": 0}, "keep"), ({"keep": 1.5}, "keep"),
])
async def test_bad_arguments_are_refused_before_redis(redis_url, kwargs, message):
    async with LockManager.from_url(redis_url) as locks:
        async def job(tick: int) -> None:
            raise AssertionError("never runs")
        arguments = {"period": 1.0, "keep": 2, **kwargs}
        with pytest.raises(ValueError, match=message):
            await locks.once_per_period("x", arguments["period"], job, keep=arguments["keep"])


@pytest.mark.parametrize("period, keep, message", [
    (1e16, 2, r"\(keep \+ 1\) \* period, the tick's longest lease, must be at most 9007199254740 s"),
    (1e300, 2, r"\(keep \+ 1\) \* period, .* at most 9007199254740 s"),
    (10**30, 2, r"\(keep \+ 1\) \* period, .* at most 9007199254740 s"),
    (1.0, 10**30, r"\(keep \+ 1\) \* period, .* at most 9007199254740 s"),
    (0.001, 2, r"keep \* period, the tick's shortest lease, must be at least 0.1 s"),
    (0.09, 1, r"keep \* period, .* at least 0.1 s"),
], ids=["period-1e16", "period-1e300", "period-int-1e30", "keep-1e30", "period-1ms", "keep-1-period-90ms"])
async def test_a_tick_lease_redis_refuses_or_loses_is_a_value_error_before_anything_is_sent(period, keep, message):
    # An unreachable Redis: a call that sent anything would come back False (fail closed), not raise.
    async with LockManager.from_url("redis://127.0.0.1:1/0", socket_timeout=0.5) as locks:
        async def job(tick: int) -> None:
            raise AssertionError("never runs")
        with pytest.raises(ValueError, match=message):
            await locks.once_per_period("x", period, job, keep=keep)
        with pytest.raises(ValueError, match=message):
            await asyncio.wait_for(locks.run_every("x", period, job, keep=keep), 5)


@pytest.mark.parametrize("keep", [1, 2])
async def test_the_shortest_tick_lease_runs_every_time_on_one_replica(redis_url, keep):
    # Was: period=0.001 ran 0 times in 20 (its 2 ms lease ran out before the grant's reply was
    # read, the grant was given back and the call reported another replica's tick).
    period = 0.1 / keep
    async with LockManager.from_url(redis_url, namespace=f"floor{keep}") as locks:
        ran: list[int] = []

        async def job(tick: int) -> None:
            ran.append(tick)
        with pytest.raises(ValueError, match="at least 0.1 s"):
            await locks.once_per_period("below", period * 0.99, job, keep=keep)
        results = []
        for i in range(20):  # spread over a period: some calls fall just before a boundary, the shortest lease
            results.append(await locks.once_per_period(f"fresh-{i}", period, job, keep=keep))
            await asyncio.sleep(period / 20)
    assert results == [True] * 20 and len(ran) == 20


async def test_the_longest_tick_lease_is_accepted_by_redis(redis_url):
    # Was: period=1e16 reached Redis and came back as a LockError ("value is not an integer or out of range").
    longest = 9007199254740 // 3  # (keep + 1) * period == 9007199254740 s with keep=2
    async with LockManager.from_url(redis_url, namespace="ceiling") as locks:
        ran: list[int] = []

        async def job(tick: int) -> None:
            ran.append(tick)
        with pytest.raises(ValueError, match="at most 9007199254740 s"):
            await locks.once_per_period("above", longest + 1, job)
        assert await locks.once_per_period("far", longest, job) is True
    assert ran == [0]
    with redis.Redis.from_url(redis_url) as client:
        assert client.pttl("ceiling:{far:tick:0}") > (longest * 3 - time.time() - 60) * 1000
