"""The lock core's spans and metrics, read back from in-memory OpenTelemetry exporters."""

from __future__ import annotations

import asyncio

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from otel_lock import LockLost, LockManager, LockTimeout, RedisUnavailable
from otel_lock.cli._redis_server import free_port


class Telemetry:
    def __init__(self) -> None:
        self.spans = InMemorySpanExporter()
        self.tracer_provider = TracerProvider()
        self.tracer_provider.add_span_processor(SimpleSpanProcessor(self.spans))
        self.reader = InMemoryMetricReader()
        self.meter_provider = MeterProvider(metric_readers=[self.reader])
        self.tracer = self.tracer_provider.get_tracer("test")

    def providers(self) -> dict:
        return dict(tracer_provider=self.tracer_provider, meter_provider=self.meter_provider)

    def points(self, name: str) -> list:
        data = self.reader.get_metrics_data()
        found = []
        for resource in data.resource_metrics if data else []:
            for scope in resource.scope_metrics:
                for metric in scope.metrics:
                    if metric.name == name:
                        found.extend((metric, p) for p in metric.data.data_points)
        return found

    def attrs(self, name: str) -> list[dict]:
        return [dict(p.attributes) for _, p in self.points(name)]

    def counted(self, name: str) -> list[dict]:
        """Attributes of the counter points above 0 (the series seeded at 0 before their first event aside)."""
        return [dict(p.attributes) for _, p in self.points(name) if p.value > 0]

    def gauge(self, name: str, lock_name: str) -> float:
        """The observed value for one lock name (other tests' managers may report other names)."""
        [value] = [p.value for _, p in self.points(name) if p.attributes["lock.name"] == lock_name]
        return value

    def acquire_spans(self) -> list:
        return [s for s in self.spans.get_finished_spans() if s.name.startswith("lock acquire")]


@pytest.fixture
def otel():
    telemetry = Telemetry()
    yield telemetry
    telemetry.tracer_provider.shutdown()
    telemetry.meter_provider.shutdown()


@pytest.fixture
async def locks(redis_url, otel):
    manager = LockManager.from_url(redis_url, namespace="tel", **otel.providers())
    yield manager
    await manager.aclose()


async def test_acquired_lock_records_span_and_metrics(locks, otel):
    with otel.tracer.start_as_current_span("request"):
        async with locks.lock("stock:7", name="stock:{path.product_id}") as held:
            pass
    [span] = otel.acquire_spans()
    assert span.name == "lock acquire stock:{path.product_id}"
    assert span.kind.name == "INTERNAL"
    assert span.attributes["lock.name"] == "stock:{path.product_id}"
    assert span.attributes["lock.key"] == "tel:{stock:7}"
    assert span.attributes["lock.owner"] == held.owner
    assert span.attributes["lock.token"] == held.token
    assert span.attributes["lock.depth"] == 1
    assert span.attributes["lock.attempts"] == 1
    assert span.attributes["lock.contended"] is False
    assert span.attributes["lock.outcome"] == "acquired"
    assert span.status.status_code == StatusCode.UNSET
    request = next(s for s in otel.spans.get_finished_spans() if s.name == "request")
    [hold] = [s for s in otel.spans.get_finished_spans() if s.name == "lock hold stock:{path.product_id}"]
    assert hold.parent.span_id == request.context.span_id
    assert hold.attributes["lock.release.outcome"] == "released"
    assert hold.attributes["lock.token"] == held.token

    [(metric, point)] = otel.points("otel_lock.wait.duration")
    assert metric.unit == "s"
    assert dict(point.attributes) == {"lock.name": "stock:{path.product_id}", "lock.outcome": "acquired",
                                      "lock.contended": False}
    assert point.explicit_bounds[0] == 0.001 and point.explicit_bounds[-1] == 30.0
    [(hold, hold_point)] = otel.points("otel_lock.hold.duration")
    assert hold.unit == "s" and hold_point.explicit_bounds[-1] == 120.0
    assert dict(hold_point.attributes) == {"lock.name": "stock:{path.product_id}", "lock.release.outcome": "released"}
    assert otel.gauge("otel_lock.active", "stock:{path.product_id}") == 0


async def test_default_lock_name_keeps_ids_off_metrics(locks, otel):
    async with locks.lock("order:12345"):
        pass
    assert {a["lock.name"] for a in otel.attrs("otel_lock.wait.duration")} == {"order"}


async def test_contended_acquire_links_to_the_holder_span(redis_url, locks, otel):
    other = LockManager.from_url(redis_url, namespace="tel", **otel.providers())
    try:
        holding = asyncio.Event()
        done = asyncio.Event()

        async def holder():
            with otel.tracer.start_as_current_span("holder request") as span:
                async with locks.lock("k"):
                    holding.set()
                    await done.wait()
                return span.get_span_context()

        task = asyncio.create_task(holder())
        await holding.wait()
        with otel.tracer.start_as_current_span("waiter request"):
            waiting = asyncio.create_task(other.acquire("k", wait=10))
            while await other.redis.zcard("tel:{k}:q") == 0:
                await asyncio.sleep(0.01)
            done.set()
            held = await waiting
            await held.release()
        holder_ctx = await task
    finally:
        await other.aclose()
    waiter_span = [s for s in otel.acquire_spans() if s.attributes["lock.contended"]][0]
    assert waiter_span.attributes["lock.outcome"] == "acquired"
    assert [link.context.span_id for link in waiter_span.links] == [holder_ctx.span_id]
    assert {"lock.name": "k", "lock.outcome": "acquired", "lock.contended": True} in otel.attrs(
        "otel_lock.wait.duration")


async def test_timeout_is_an_error_span_and_a_timeout_outcome(redis_url, locks, otel):
    async with LockManager.from_url(redis_url, namespace="tel", **otel.providers()) as other:
        async with locks.lock("k"):
            with otel.tracer.start_as_current_span("request"), pytest.raises(LockTimeout):
                await other.acquire("k", wait=0.05)
    span = [s for s in otel.acquire_spans() if s.attributes["lock.outcome"] == "timeout"][0]
    assert span.status.status_code == StatusCode.ERROR and span.attributes["error.type"] == "timeout"
    assert {"lock.name": "k", "lock.outcome": "timeout", "lock.contended": True, "error.type": "timeout"} in otel.attrs(
        "otel_lock.wait.duration")
    assert otel.gauge("otel_lock.pending", "k") == 0


async def test_a_cancelled_wait_ends_its_span_unset_with_outcome_cancelled(redis_url, locks, otel):
    """The caller gave up (a client disconnect, a deadline): no error on the span, but the span ends."""
    async with LockManager.from_url(redis_url, namespace="tel", **otel.providers()) as other:
        async with locks.lock("k"):
            async def waiter() -> None:
                with otel.tracer.start_as_current_span("request"):
                    await other.acquire("k", wait=30.0)

            task = asyncio.create_task(waiter())
            async with asyncio.timeout(10):
                while {"lock.name": "k"} not in otel.counted("otel_lock.pending"):  # the wait has begun
                    await asyncio.sleep(0.01)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
    [span] = [s for s in otel.acquire_spans() if s.attributes["lock.outcome"] == "cancelled"]
    assert span.status.status_code == StatusCode.UNSET and "error.type" not in span.attributes


async def test_redis_error_is_counted_with_its_type(otel):
    port = free_port()
    async with LockManager.from_url(f"redis://127.0.0.1:{port}/0", socket_timeout=0.5,
                                    **otel.providers()) as locks:
        with otel.tracer.start_as_current_span("request"), pytest.raises(RedisUnavailable):
            await locks.acquire("k")
    # (a clean-up release of the maybe-taken lock may have been tried, and counted, meanwhile)
    assert [a for a in otel.counted("otel_lock.errors") if a["lock.operation"] == "acquire"] == [
        {"lock.name": "k", "lock.operation": "acquire", "error.type": "redis_unavailable"}]
    assert otel.attrs("otel_lock.wait.duration") == [
        {"lock.name": "k", "lock.outcome": "error", "lock.contended": False, "error.type": "redis_unavailable"}]
    [span] = otel.acquire_spans()
    assert span.status.status_code == StatusCode.ERROR
    # the failed span says what failed and where, by the database conventions
    assert span.attributes["error.type"] == "redis_unavailable"
    assert span.attributes["db.system.name"] == "redis"
    assert (span.attributes["server.address"], span.attributes["server.port"]) == ("127.0.0.1", port)


async def test_renewals_are_counted_ok(redis_url, otel):
    async with LockManager.from_url(redis_url, namespace="tel", lease=0.3, **otel.providers()) as locks:
        async with locks.lock("k"):
            async with asyncio.timeout(10):
                while not any(p.value >= 2 for _, p in otel.points("otel_lock.renewals")):
                    await asyncio.sleep(0.05)
    assert otel.counted("otel_lock.renewals") == [{"lock.name": "k", "lock.renewal.outcome": "ok"}]


async def test_lost_lease_is_counted_and_put_on_the_span(redis_url, otel):
    async with LockManager.from_url(redis_url, namespace="tel", lease=0.3, cancel_on_lost=True,
                                    **otel.providers()) as locks:
        with otel.tracer.start_as_current_span("request"):
            with pytest.raises(LockLost):
                async with asyncio.timeout(10):
                    async with locks.lock("k") as held:
                        await locks.redis.hset(held.key, "owner", "thief")
                        await asyncio.Event().wait()
    assert {"lock.name": "k", "lock.renewal.outcome": "lost"} in otel.attrs("otel_lock.renewals")
    assert {"lock.name": "k", "lock.release.outcome": "lost"} in otel.attrs("otel_lock.hold.duration")
    [hold] = [s for s in otel.spans.get_finished_spans() if s.name == "lock hold k"]
    assert "lock lost" in [e.name for e in hold.events]
    assert hold.attributes["lock.release.outcome"] == "lost"
    assert hold.status.status_code == StatusCode.ERROR


async def test_reentrant_hold_is_a_depth_two_span(locks, otel):
    with otel.tracer.start_as_current_span("request"):
        async with locks.lock("k"):
            async with locks.lock("k"):
                pass
    depths = sorted(s.attributes["lock.depth"] for s in otel.acquire_spans())
    assert depths == [1, 2]
    assert len(otel.attrs("otel_lock.hold.duration")) == 1


async def test_no_acquire_span_outside_a_trace_but_metrics_still_count(locks, otel):
    async with locks.lock("k"):
        pass
    assert otel.acquire_spans() == []
    assert otel.attrs("otel_lock.wait.duration") == [
        {"lock.name": "k", "lock.outcome": "acquired", "lock.contended": False}]


async def test_active_and_pending_are_read_from_the_managers(redis_url, locks, otel):
    async with LockManager.from_url(redis_url, namespace="tel", **otel.providers()) as other:
        async with locks.lock("k"):
            waiting = asyncio.create_task(other.acquire("k", wait=10))
            while await other.redis.zcard("tel:{k}:q") == 0:
                await asyncio.sleep(0.01)
            assert otel.gauge("otel_lock.active", "k") == 1
            assert otel.gauge("otel_lock.pending", "k") == 1
        held = await waiting
        assert otel.gauge("otel_lock.pending", "k") == 0
        await held.release()
    assert otel.gauge("otel_lock.active", "k") == 0
