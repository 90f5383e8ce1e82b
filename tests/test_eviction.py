"""A held lock that Redis evicts for real (maxmemory, an evicting policy, memory filled) is told at
the holder's next renewal and counted lost; the next holder's token is larger (fenced).

`volatile-ttl` with a filler of keys without a TTL makes the lock's own keys the only candidates,
so the eviction is certain rather than likely; benchmarks/safety's `evict` fault measures the
likely case under load.
"""

from __future__ import annotations

import asyncio
import time

import pytest
import redis.asyncio as aioredis
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from otel_lock import LockManager
from otel_lock.cli._redis_server import RedisServer


@pytest.fixture
def server():
    with RedisServer() as s:
        yield s


async def _evict(admin: aioredis.Redis, key: str) -> int:
    """Fill Redis until `key` is evicted; the number of keys Redis evicted meanwhile."""
    used = int((await admin.info("memory"))["used_memory"])
    await admin.config_set("maxmemory-policy", "volatile-ttl")
    await admin.config_set("maxmemory", used + (1 << 20))
    value = b"x" * 4096
    deadline = time.monotonic() + 30
    i = 0
    while await admin.exists(key):
        assert time.monotonic() < deadline, "Redis never evicted the lock"
        pipe = admin.pipeline(transaction=False)
        for _ in range(50):
            pipe.set(f"filler:{i}", value)  # no TTL: only the lock's keys are volatile
            i += 1
        await pipe.execute(raise_on_error=False)
    await admin.config_set("maxmemory", 0)  # room again for the next holder
    return int((await admin.info("stats"))["evicted_keys"])


def _renewal_outcomes(reader: InMemoryMetricReader) -> set[str]:
    data = reader.get_metrics_data()
    return {point.attributes["lock.renewal.outcome"]
            for rm in (data.resource_metrics if data else []) for sm in rm.scope_metrics for m in sm.metrics
            if m.name == "otel_lock.renewals" for point in m.data.data_points}


async def test_an_evicted_lock_is_told_at_the_next_renewal_counted_lost_and_fenced(server):
    reader = InMemoryMetricReader()
    admin = aioredis.Redis(port=server.port)
    # a lease far longer than the wait below: only a renewal can tell the holder in time
    holder = LockManager.from_url(server.url, namespace="ev", lease=30.0, renew_interval=0.2,
                                  meter_provider=MeterProvider([reader]))
    rival = LockManager.from_url(server.url, namespace="ev", lease=30.0)
    try:
        held = await holder.acquire("order:1")
        assert await _evict(admin, held.key) >= 1
        # the next renewal (every 0.2 s) finds no owner, long before the 30 s lease could run out
        await asyncio.wait_for(held.lost.wait(), timeout=10)
        assert "lost" in _renewal_outcomes(reader)
        second = await rival.acquire("order:1", wait=1)
        assert second.token > held.token
        assert await held.release() is False
        await second.release()
    finally:
        await holder.aclose()
        await rival.aclose()
        await admin.aclose()

