"""HTTP server spans from `TelemetrySetup.instrument_app`: named by route, raw URLs out under redaction."""

from __future__ import annotations

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind
from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Mount, Route

from otel_lock import LockManager, LockMiddleware, locked, telemetry
from otel_lock.telemetry import _redact
from otel_lock.telemetry._setup import TelemetrySetup

from _middleware_helpers import client_for


@pytest.fixture
def spans():
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    meters = MeterProvider()
    yield exporter, TelemetrySetup(provider, meters, None)
    provider.shutdown()
    meters.shutdown()
    _redact.configure_redaction()


async def ok(request):
    return JSONResponse({"ok": True})


async def boom(request):
    raise RuntimeError("handler failed")


def shop() -> Starlette:
    return Starlette(routes=[
        Route("/api/stock/{product_id}/deduct", ok, methods=["POST"]),
        Route("/api/boom/{n}", boom),
        Mount("/v2", routes=[Route("/orders/{order_id}", ok)]),
    ])


def server_spans(exporter) -> list:
    return [s for s in exporter.get_finished_spans() if s.kind == SpanKind.SERVER]


async def test_server_span_is_named_by_route_template(spans):
    exporter, installed = spans
    async with client_for(installed.instrument_app(shop())) as client:
        assert (await client.post("/api/stock/alice-secret-42/deduct?user=alice")).status_code == 200
        assert (await client.get("/v2/orders/o-77")).status_code == 200
    first, second = server_spans(exporter)
    assert first.name == "POST /api/stock/{product_id}/deduct"
    assert first.attributes["http.route"] == "/api/stock/{product_id}/deduct"
    assert second.name == "GET /v2/orders/{order_id}"
    # Redaction off: the raw target stays, as the HTTP conventions describe it.
    assert "alice-secret-42" in first.attributes["http.target"]


async def test_unmatched_and_failing_requests_get_bounded_names(spans):
    exporter, installed = spans
    async with client_for(installed.instrument_app(shop())) as client:
        assert (await client.get("/scanner/probe-8231")).status_code == 404
        assert (await client.get("/api/boom/3")).status_code == 500
    unmatched, failed = server_spans(exporter)
    assert unmatched.name == "GET" and "http.route" not in unmatched.attributes
    assert failed.name == "GET /api/boom/{n}"


async def test_redaction_replaces_raw_target_and_url(spans):
    exporter, installed = spans
    telemetry.configure_redaction("hash")
    async with client_for(installed.instrument_app(shop())) as client:
        await client.post("/api/stock/alice-secret-42/deduct?user=alice")
        await client.get("/nope/alice-secret-42")
    matched, unmatched = server_spans(exporter)
    assert matched.attributes["http.target"] == "/api/stock/{product_id}/deduct"
    assert matched.attributes["http.url"] == "http://test/api/stock/{product_id}/deduct"
    for span in (matched, unmatched):
        assert "alice" not in str(dict(span.attributes)), span.name


async def test_answers_of_the_lock_middleware_are_named_by_route(spans, redis_url):
    """The middleware answers a bad request itself (before the router): the span still has the route."""
    exporter, installed = spans
    manager = LockManager.from_url(redis_url, namespace="http-spans")
    try:
        app = LockMiddleware(Starlette(routes=[
            Route("/orders/{order_id}", locked("order:{header.x-user-id}")(ok), methods=["POST"])]),
            manager=manager)
        async with client_for(installed.instrument_app(app)) as client:
            response = await client.post("/orders/o-1")  # no X-User-Id: 400 from the middleware
            assert response.status_code == 400
            assert (await client.post("/orders/o-2", headers={"x-user-id": "bob"})).status_code == 200
    finally:
        await manager.aclose()
    refused, served = server_spans(exporter)
    assert refused.name == served.name == "POST /orders/{order_id}"


async def test_a_fastapi_app_that_traces_natively_records_each_request_once():
    """FastAPI 0.165+ traces every request itself once an SDK is there: instrument_app must not add a second."""
    pytest.importorskip("fastapi.telemetry")
    from fastapi import FastAPI
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    exporter, reader = InMemorySpanExporter(), InMemoryMetricReader()
    provider, meters = TracerProvider(), MeterProvider(metric_readers=[reader])
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    app = FastAPI(telemetry={"tracer_provider": provider, "meter_provider": meters})

    @app.get("/orders/{order_id}")
    async def order(order_id: int) -> dict:
        if order_id == 0:
            raise RuntimeError("handler failed")
        return {"order_id": order_id}

    try:
        instrumented = TelemetrySetup(provider, meters, None).instrument_app(app)
        assert instrumented is app  # the app itself: its state, routes and dependency overrides stay reachable
        async with client_for(instrumented) as client:
            assert (await client.get("/orders/7?x=1")).status_code == 200
            assert (await client.get("/orders/0")).status_code == 500
        ok, failed = server_spans(exporter)
        assert len(exporter.get_finished_spans()) == 2, [s.name for s in exporter.get_finished_spans()]
        assert ok.name == failed.name == "GET /orders/{order_id}"
        assert (ok.attributes["http.status_code"], failed.attributes["http.status_code"]) == (200, 500)
        names = {m.name for rm in reader.get_metrics_data().resource_metrics for sm in rm.scope_metrics
                 for m in sm.metrics}
        assert "http.server.duration" in names and "http.server.request.duration" not in names, names
    finally:
        provider.shutdown()
        meters.shutdown()
