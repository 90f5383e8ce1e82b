"""The library's own warnings (lease lost, circuit open, Redis errors) carry trace and span ids."""

from __future__ import annotations

import logging

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from otel_lock import LockManager
from otel_lock.cli._redis_server import free_port
from otel_lock.lock import LockError


@pytest.fixture
def spans():
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield provider, exporter
    provider.shutdown()


def _ids_of(records: list[logging.LogRecord], text: str) -> list[tuple[str, str]]:
    return [(r.trace_id, r.span_id) for r in records if text in r.getMessage() and hasattr(r, "trace_id")]


async def test_a_lease_lost_warning_names_the_trace_and_span_that_saw_it(spans, redis_client, caplog):
    provider, exporter = spans
    locks = LockManager(redis_client, namespace="logs", tracer_provider=provider)
    try:
        with provider.get_tracer("test").start_as_current_span("job") as job, \
                caplog.at_level(logging.WARNING, logger="otel_lock"):
            held = await locks.acquire("report:1", name="report", lease=30)
            for key in await redis_client.keys("logs*"):
                await redis_client.delete(key)  # taken from under the holder, as far as it can tell
            assert await held.release() is False
    finally:
        await locks.aclose()
    context = job.get_span_context()
    [(trace_id, span_id)] = _ids_of(caplog.records, "lost")
    assert (trace_id, span_id) == (format(context.trace_id, "032x"), format(context.span_id, "016x"))
    [record] = [r for r in caplog.records if "lost" in r.getMessage()]
    assert (record.otelTraceID, record.otelSpanID) == (trace_id, span_id)  # the logging instrumentation's names


async def test_circuit_open_and_redis_error_warnings_carry_the_requests_trace(spans, caplog):
    provider, exporter = spans
    locks = LockManager.from_url(f"redis://127.0.0.1:{free_port()}/0", namespace="logs-down", socket_timeout=0.5,
                                 breaker_failures=2, tracer_provider=provider)
    try:
        with provider.get_tracer("test").start_as_current_span("request") as request, \
                caplog.at_level(logging.WARNING, logger="otel_lock"):
            for _ in range(3):
                with pytest.raises(LockError):
                    await locks.acquire("stock:1", name="stock", wait=0.1)
    finally:
        await locks.aclose()
    ids = _ids_of(caplog.records, "circuit open")
    assert ids, [r.getMessage() for r in caplog.records]
    trace_ids = {format(span.context.span_id, "016x"): format(span.context.trace_id, "032x")
                 for span in exporter.get_finished_spans()}
    for trace_id, span_id in ids:
        assert trace_id == format(request.get_span_context().trace_id, "032x")
        assert trace_ids[span_id] == trace_id  # a span of that trace: the request's or its acquire's


async def test_a_warning_outside_any_span_carries_no_ids(caplog):
    with caplog.at_level(logging.WARNING, logger="otel_lock"):
        logging.getLogger("otel_lock").warning("otel-lock: something outside any request")
    [record] = caplog.records
    assert not hasattr(record, "trace_id") and not hasattr(record, "span_id")


def test_an_ended_span_left_in_a_context_gives_no_ids(spans, caplog):
    """A background task started under a request that ended since (the watchdog) must not name that trace."""
    from opentelemetry import context, trace

    provider, _ = spans
    span = provider.get_tracer("test").start_span("old request")
    span.end()
    token = context.attach(trace.set_span_in_context(span))
    try:
        with caplog.at_level(logging.WARNING, logger="otel_lock"):
            logging.getLogger("otel_lock").warning("otel-lock: lease of k lost: no renewal confirmed")
    finally:
        context.detach(token)
    assert not hasattr(caplog.records[0], "trace_id")
