"""Telemetry end to end through the lock core: the hooks of otel_lock.telemetry as the core calls them.

The hooks themselves are tested in test_telemetry_hooks.py; these prove the
core calls them.
"""

from __future__ import annotations

import asyncio

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from otel_lock import LockManager, telemetry
from otel_lock.telemetry import _redact



class Otel:
    def __init__(self) -> None:
        self.spans = InMemorySpanExporter()
        self.tracer_provider = TracerProvider()
        self.tracer_provider.add_span_processor(SimpleSpanProcessor(self.spans))
        self.reader = InMemoryMetricReader()
        self.meter_provider = MeterProvider(metric_readers=[self.reader])
        self.tracer = self.tracer_provider.get_tracer("test")

    def points(self, name: str) -> list:
        data = self.reader.get_metrics_data()
        return [(dict(p.attributes), p) for rm in (data.resource_metrics if data else []) for sm in rm.scope_metrics
                for m in sm.metrics if m.name == name for p in m.data.data_points]

    def named(self, prefix: str) -> list:
        return [s for s in self.spans.get_finished_spans() if s.name.startswith(prefix)]


@pytest.fixture
def otel():
    o = Otel()
    yield o
    o.tracer_provider.shutdown()
    o.meter_provider.shutdown()
    _redact.configure_redaction()


@pytest.fixture
async def locks(redis_url, otel):
    managers = [LockManager.from_url(redis_url, namespace="wiring", tracer_provider=otel.tracer_provider,
                                     meter_provider=otel.meter_provider) for _ in range(2)]
    yield managers
    for manager in managers:
        await manager.aclose()


async def test_a_try_lock_miss_is_busy_not_a_timeout(locks, otel):
    first, second = locks
    with otel.tracer.start_as_current_span("job tick"):
        async with first.lock("job:tick:7", name="job:tick"):
            assert await second.try_lock("job:tick:7", name="job:tick") is None
    misses = [(a, p) for a, p in otel.points("otel_lock.wait.duration") if a["lock.outcome"] != "acquired"]
    assert [a for a, _ in misses] == [{"lock.name": "job:tick", "lock.outcome": "busy", "lock.contended": True}]
    [miss_span] = [s for s in otel.named("lock acquire") if s.attributes["lock.outcome"] == "busy"]
    assert miss_span.status.status_code == StatusCode.UNSET


async def test_each_hold_has_its_span_from_acquired_to_released(locks, otel):
    with otel.tracer.start_as_current_span("POST /api/stock/{product_id}/deduct") as request:
        async with locks[0].lock("stock:7", name="stock:{path.product_id}"):
            pass
    [hold] = otel.named("lock hold")
    assert hold.name == "lock hold stock:{path.product_id}"
    assert hold.parent.span_id == request.get_span_context().span_id
    assert hold.attributes["lock.release.outcome"] == "released"


async def test_hash_mode_hashes_keys_and_owners_on_every_lock_span(locks, otel):
    telemetry.configure_redaction("hash")
    with otel.tracer.start_as_current_span("request"):
        async with locks[0].lock("order:user:alice-secret-42", name="order:user:{header.x-user-id}",
                                 owner="alice"):
            pass
    spans = otel.named("lock ")
    assert {s.name.split()[1] for s in spans} == {"acquire", "hold"}
    for span in spans:
        assert "alice" not in str(dict(span.attributes)), span.name
        assert span.attributes["lock.key"].startswith("h:")


async def test_current_holds_feed_hold_age_and_lease(locks, otel):
    async with locks[0].lock("report:1", name="report", lease=5.0):
        ages = {a["lock.name"]: p.value for a, p in otel.points("otel_lock.hold.age")}
        leases = {a["lock.name"]: p.value for a, p in otel.points("otel_lock.lease")}
        assert ages["report"] >= 0 and leases["report"] == 5.0
    assert "report" not in {a["lock.name"] for a, _ in otel.points("otel_lock.hold.age")}


async def test_an_expired_hold_is_not_active(locks, otel, redis_client):
    held = await locks[0].acquire("short:1", name="short", lease=0.2)
    try:
        # The fixed lease runs out in Redis while the holder still "works".
        for _ in range(200):
            if not await redis_client.exists("wiring:{short:1}"):
                break
            await asyncio.sleep(0.01)  # bounded polling of Redis's own expiry
        active = {a["lock.name"]: p.value for a, p in otel.points("otel_lock.active")}
        assert active.get("short", 0) == 0
    finally:
        assert await held.release() is False


async def test_redis_round_trips_are_timed_per_operation(locks, otel):
    async with locks[0].lock("k", name="k"):
        pass
    operations = {a["lock.operation"] for a, _ in otel.points("otel_lock.redis.operation.duration")}
    assert {"acquire", "release"} <= operations


async def test_a_batched_renewal_is_timed_once_per_round_trip(locks, otel):
    """1,200 leases go out as two script calls in one round trip: one timing, not one per call."""
    held = await asyncio.gather(*(locks[0].acquire(f"bulk:{i}", name="bulk") for i in range(1200)))
    try:
        await locks[0]._runtimes.here().watchdog._renew([h._lease for h in held])
        counts = [p.count for a, p in otel.points("otel_lock.redis.operation.duration")
                  if a == {"lock.name": "bulk", "lock.operation": "renew"}]
        assert counts == [1]
    finally:
        for hold in held:
            await hold.release()


async def test_connections_in_use_are_reported(locks, otel):
    async with locks[0].lock("k", name="k"):
        used = [p.value for a, p in otel.points("otel_lock.redis.connection.count")
                if a["db.client.connection.state"] == "used"]
    assert used and sum(used) >= 1
