"""The telemetry hooks the lock core calls: hold span, redaction, hold/lease and Redis gauges.

Driven at the instrument level with in-memory SDK readers and exporters; the
core's calls into them are covered by test_lock_telemetry.py.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from otel_lock import telemetry
from otel_lock.telemetry import _redact
from otel_lock.telemetry._instruments import LockCounts, get_telemetry
from otel_lock.telemetry._names import REDIS_BUCKETS, WAIT_BUCKETS


@pytest.fixture
def otel():
    spans = InMemorySpanExporter()
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(spans))
    reader = InMemoryMetricReader()
    meter_provider = MeterProvider(metric_readers=[reader])
    yield SimpleNamespace(spans=spans, reader=reader, tracer=tracer_provider.get_tracer("test"),
                          telemetry=get_telemetry(tracer_provider, meter_provider), meter_provider=meter_provider)
    tracer_provider.shutdown()
    meter_provider.shutdown()


@pytest.fixture(autouse=True)
def redaction_off():
    telemetry.configure_redaction("off")
    yield
    _redact.configure_redaction()


def points(reader, name: str) -> list:
    data = reader.get_metrics_data()
    return [(dict(p.attributes), p) for rm in (data.resource_metrics if data else []) for sm in rm.scope_metrics
            for m in sm.metrics if m.name == name for p in m.data.data_points]


def hold(name: str, age: float, lease: float) -> SimpleNamespace:
    return SimpleNamespace(name=name, acquired_at=time.monotonic() - age, lease_seconds=lease)


# -- the hold span -------------------------------------------------------------


def test_hold_span_is_an_internal_child_of_the_request_span(otel):
    with otel.tracer.start_as_current_span("POST /api/stock/{product_id}/deduct") as request:
        span = otel.telemetry.start_hold_span("stock:{path.product_id}", {"lock.name": "stock:{path.product_id}",
                                                                          "lock.token": 7})
    otel.telemetry.end_hold_span(span, "released")
    [held] = [s for s in otel.spans.get_finished_spans() if s.name.startswith("lock hold")]
    assert held.name == "lock hold stock:{path.product_id}"
    assert held.kind == SpanKind.INTERNAL
    assert held.parent.span_id == request.get_span_context().span_id
    assert held.attributes["lock.release.outcome"] == "released"
    assert held.attributes["lock.token"] == 7
    assert held.status.status_code == StatusCode.UNSET
    # It outlives the request span: ended after it, whatever the framework did.
    [outer] = [s for s in otel.spans.get_finished_spans() if s.name.startswith("POST")]
    assert held.end_time >= outer.end_time


def test_hold_span_is_not_current_so_later_spans_are_not_its_children(otel):
    with otel.tracer.start_as_current_span("request") as request:
        span = otel.telemetry.start_hold_span("n", {})
        with otel.tracer.start_as_current_span("work"):
            pass
        otel.telemetry.end_hold_span(span, "released")
    [work] = [s for s in otel.spans.get_finished_spans() if s.name == "work"]
    assert work.parent.span_id == request.get_span_context().span_id


@pytest.mark.parametrize("outcome", ["lost", "expired", "error"])
def test_hold_span_ending_badly_is_an_error(otel, outcome):
    with otel.tracer.start_as_current_span("request"):
        span = otel.telemetry.start_hold_span("n", {"lock.name": "n"})
    span.add_event("lock lost", {"lock.lost.reason": "renewal found another owner"})
    otel.telemetry.end_hold_span(span, outcome)
    [held] = [s for s in otel.spans.get_finished_spans() if s.name == "lock hold n"]
    assert held.status.status_code == StatusCode.ERROR
    assert held.attributes["lock.release.outcome"] == outcome
    assert [e.name for e in held.events] == ["lock lost"]


def test_no_hold_span_outside_a_recording_span(otel):
    span = otel.telemetry.start_hold_span("n", {"lock.name": "n"})
    assert not span.is_recording()
    otel.telemetry.end_hold_span(span, "released")  # harmless
    assert otel.spans.get_finished_spans() == ()


# -- redaction -----------------------------------------------------------------


def test_redaction_off_keeps_the_attributes_as_given(otel):
    attributes = {"lock.key": "otel-lock:{order:user:alice-secret-42}", "lock.owner": "alice"}
    assert otel.telemetry.redact(attributes) is attributes


def test_hash_mode_hashes_key_and_owner_the_same_way_everywhere(otel):
    telemetry.configure_redaction("hash", secret="s3")
    raw = {"lock.name": "order:user:{header.x-user-id}", "lock.key": "otel-lock:{order:user:alice-secret-42}",
           "lock.owner": "alice", "lock.token": 3}
    out = otel.telemetry.redact(raw)
    assert "alice" not in str(out)
    assert out["lock.name"] == raw["lock.name"] and out["lock.token"] == 3
    assert out["lock.key"].startswith("h:") and len(out["lock.key"]) == 26
    assert raw["lock.key"].startswith("otel-lock:")  # the caller's dict is not changed
    # Stable (find one key's holders and waiters), idempotent (safe to apply twice), keyed.
    assert otel.telemetry.redact(dict(raw)) == out
    assert otel.telemetry.redact(out) == out
    telemetry.configure_redaction("hash", secret="other")
    assert otel.telemetry.redact(dict(raw))["lock.key"] != out["lock.key"]


def test_drop_mode_removes_key_and_owner(otel):
    telemetry.configure_redaction("drop")
    assert otel.telemetry.redact({"lock.key": "k", "lock.owner": "o", "lock.name": "n"}) == {"lock.name": "n"}


def test_hold_span_attributes_are_redacted(otel):
    telemetry.configure_redaction("hash")
    with otel.tracer.start_as_current_span("request"):
        span = otel.telemetry.start_hold_span("order", {"lock.key": "otel-lock:{order:alice}", "lock.owner": "bob"})
    otel.telemetry.end_hold_span(span, "released")
    [held] = [s for s in otel.spans.get_finished_spans() if s.name == "lock hold order"]
    assert "alice" not in str(dict(held.attributes)) and "bob" not in str(dict(held.attributes))


@pytest.mark.parametrize("mode", ["hashed", "HASHES", "yes please"])
def test_unknown_redaction_mode_is_named(mode):
    with pytest.raises(ValueError, match="off, hash, drop"):
        telemetry.configure_redaction(mode)


def test_redaction_env_is_read(monkeypatch):
    monkeypatch.setenv("OTEL_LOCK_REDACT", "drop")
    assert telemetry.configure_redaction() == "drop"
    monkeypatch.setenv("OTEL_LOCK_REDACT", "1")
    assert telemetry.configure_redaction() == "hash"


# -- hold age and lease gauges -------------------------------------------------


def test_hold_age_and_lease_are_those_of_the_oldest_hold(otel):
    counts = LockCounts(otel.meter_provider)
    young, old = hold("job:tick", 1.0, 15.0), hold("job:tick", 12.0, 15.0)
    other = hold("stock:{path.product_id}", 0.5, 30.0)
    for h in (young, old, other):
        counts.hold_started(h)
    ages = {a["lock.name"]: p.value for a, p in points(otel.reader, "otel_lock.hold.age")}
    leases = {a["lock.name"]: p.value for a, p in points(otel.reader, "otel_lock.lease")}
    assert 12.0 <= ages["job:tick"] < 13.0 and leases["job:tick"] == 15.0
    assert 0.5 <= ages["stock:{path.product_id}"] < 1.5 and leases["stock:{path.product_id}"] == 30.0
    counts.hold_ended(old)
    ages = {a["lock.name"]: p.value for a, p in points(otel.reader, "otel_lock.hold.age")}
    assert 1.0 <= ages["job:tick"] < 2.0
    counts.hold_ended(young)
    counts.hold_ended(young)  # twice: harmless
    ages = {a["lock.name"]: p.value for a, p in points(otel.reader, "otel_lock.hold.age")}
    assert "job:tick" not in ages


def test_a_holder_that_never_releases_shows_growing_age(otel):
    counts = LockCounts(otel.meter_provider)
    stuck = hold("stuck", 40.0, 30.0)
    counts.hold_started(stuck)
    [(_, first)] = [(a, p) for a, p in points(otel.reader, "otel_lock.hold.age") if a["lock.name"] == "stuck"]
    assert first.value > 30.0  # past its lease: the alert's ratio is above 1


# -- Redis client metrics ------------------------------------------------------


def test_connection_gauges_pull_from_the_manager(otel):
    counts = LockCounts(otel.meter_provider)
    state = {"used": 2, "pending": 5}
    counts.watch_connections(lambda: (state["used"], state["pending"]), pool_name="shop")
    used = [(a, p.value) for a, p in points(otel.reader, "otel_lock.redis.connection.count")]
    assert ({"db.client.connection.state": "used", "db.client.connection.pool.name": "shop"}, 2) in used
    state["pending"] = 0
    pending = [(a, p.value) for a, p in points(otel.reader, "otel_lock.redis.connection.pending_requests")]
    assert ({"db.client.connection.pool.name": "shop"}, 0) in pending


def test_connection_gauges_can_be_pushed_and_a_failing_source_is_skipped(otel):
    pushed, failing = LockCounts(otel.meter_provider), LockCounts(otel.meter_provider)
    pushed.pool_name = "pushed"
    pushed.connections(1, 3)
    failing.pool_name = "failing"
    failing.watch_connections(lambda: 1 / 0)
    used = {a["db.client.connection.pool.name"]: p.value
            for a, p in points(otel.reader, "otel_lock.redis.connection.count")}
    assert used.get("pushed") == 1 and "failing" not in used


def test_redis_operation_histogram_has_sub_millisecond_buckets(otel):
    otel.telemetry.redis_duration.record(0.0004, {"lock.name": "n", "lock.operation": "acquire"})
    [(attributes, point)] = points(otel.reader, "otel_lock.redis.operation.duration")
    assert attributes == {"lock.name": "n", "lock.operation": "acquire"}
    assert tuple(point.explicit_bounds) == REDIS_BUCKETS and REDIS_BUCKETS[0] < 0.001


def test_wait_buckets_fall_on_the_alert_threshold():
    assert 0.5 in WAIT_BUCKETS  # OtelLockWaitP95High: p95 > 0.5 s
