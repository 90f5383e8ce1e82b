"""otel_lock.telemetry.setup(): resource, idempotency, respect for an existing SDK, /metrics."""

from __future__ import annotations

import gc

import logging
import os
import subprocess
import sys
import textwrap

import httpx
import pytest
from opentelemetry import metrics, trace
from opentelemetry.sdk.metrics import MeterProvider
from starlette.applications import Starlette
from starlette.routing import Route

from otel_lock import telemetry
from otel_lock.telemetry._instruments import LockCounts, get_telemetry


@pytest.fixture(autouse=True)
def clean_otel(monkeypatch):
    for name in ("OTEL_SERVICE_NAME", "OTEL_RESOURCE_ATTRIBUTES", "OTEL_EXPORTER_OTLP_ENDPOINT",
                 "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT"):
        monkeypatch.delenv(name, raising=False)
    # Managers earlier tests closed but the garbage collector has not freed yet still report their
    # (idle) lock names, up to the name limit of the fresh collectors these tests install.
    gc.collect()
    telemetry._reset_for_tests()
    yield
    telemetry._reset_for_tests()


def test_resource_names_the_service_and_a_unique_instance():
    installed = telemetry.setup("shop", resource_attributes={"deployment.environment": "test"})
    attributes = installed.resource.attributes
    assert attributes["service.name"] == "shop"
    assert attributes["deployment.environment"] == "test"
    assert str(os.getpid()) in attributes["service.instance.id"]
    assert telemetry.default_instance_id() != telemetry.default_instance_id()


def test_explicit_instance_id_wins():
    installed = telemetry.setup("shop", "replica-a")
    assert installed.resource.attributes["service.instance.id"] == "replica-a"


def test_otel_service_name_replaces_only_the_default(monkeypatch):
    monkeypatch.setenv("OTEL_SERVICE_NAME", "from-env")
    assert telemetry.setup().resource.attributes["service.name"] == "from-env"
    telemetry._reset_for_tests()
    assert telemetry.setup("explicit").resource.attributes["service.name"] == "explicit"


def test_instance_id_from_otel_resource_attributes_is_kept(monkeypatch):
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "service.instance.id=pod-7")
    assert telemetry.setup().resource.attributes["service.instance.id"] == "pod-7"


@pytest.mark.parametrize("kwargs, problem", [
    ({"service_name": ""}, "service_name"),
    ({"service_name": None}, "service_name"),
    ({"service_instance_id": ""}, "service_instance_id"),
    ({"resource_attributes": ["a"]}, "resource_attributes"),
    # read for their truth, "false" (an environment variable passed on) meant true
    ({"otlp": "false"}, "otlp must be True, False or None"),
    ({"prometheus": 0}, "prometheus must be True, False or None"),
    ({"flush_on_signal": "no"}, "flush_on_signal must be True, False or None"),
])
def test_bad_arguments_are_named(kwargs, problem):
    with pytest.raises(ValueError, match=problem):
        telemetry.setup(**kwargs)
    assert telemetry.current() is None


def test_setup_twice_returns_the_first_result():
    first = telemetry.setup("shop")
    second = telemetry.setup("other", prometheus=False)
    assert second is first
    assert metrics.get_meter_provider() is first.meter_provider


def test_without_otlp_no_tracer_sdk_is_installed():
    installed = telemetry.setup()
    assert not installed.otlp
    assert type(trace.get_tracer_provider()).__name__ == "ProxyTracerProvider"


def test_an_existing_sdk_is_kept(caplog):
    own = MeterProvider()
    metrics.set_meter_provider(own)
    with caplog.at_level(logging.WARNING, logger="otel_lock.telemetry"):
        installed = telemetry.setup()
    assert not installed.installed
    assert installed.meter_provider is own
    assert metrics.get_meter_provider() is own
    assert "already installed" in caplog.text
    own.shutdown()


async def _scrape(installed, accept: str = "") -> httpx.Response:
    telemetry_ = get_telemetry(meter_provider=installed.meter_provider)  # the instruments of that provider
    attrs = {"lock.name": "stock:{path.product_id}"}
    telemetry_.wait_duration.record(0.02, {**attrs, "lock.outcome": "acquired", "lock.contended": True})
    telemetry_.hold_duration.record(0.2, {**attrs, "lock.release.outcome": "released"})
    telemetry_.errors.add(1, {**attrs, "lock.operation": "acquire", "error.type": "timeout"})
    telemetry_.renewals.add(1, {**attrs, "lock.renewal.outcome": "ok"})
    counts = LockCounts(installed.meter_provider)  # what a manager keeps; the observable counters read it at scrape time
    telemetry_.gauges.add(counts)
    counts.active["stock:{path.product_id}"] += 1
    counts.pending["stock:{path.product_id}"] += 1
    telemetry_.idempotency_requests.add(1, {"http.route": "/api/orders", "idempotency.outcome": "stored"})
    app = Starlette(routes=[Route("/metrics", telemetry.metrics_endpoint)])
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
        return await client.get("/metrics", headers={"accept": accept} if accept else {})


@pytest.mark.parametrize("series", [
    'otel_lock_wait_duration_seconds_count{lock_contended="true",lock_name="stock:{path.product_id}",'
    'lock_outcome="acquired"',
    'otel_lock_hold_duration_seconds_count{lock_name="stock:{path.product_id}",lock_release_outcome="released"',
    'otel_lock_errors_total{error_type="timeout",lock_name="stock:{path.product_id}",lock_operation="acquire"',
    'otel_lock_renewals_total{lock_name="stock:{path.product_id}",lock_renewal_outcome="ok"',
    'otel_lock_active{lock_name="stock:{path.product_id}"',
    'otel_lock_pending{lock_name="stock:{path.product_id}"',
    'otel_lock_idempotency_requests_total{http_route="/api/orders",idempotency_outcome="stored"',
])
async def test_metrics_endpoint_uses_the_documented_prometheus_names(series):
    response = await _scrape(telemetry.setup("shop", "r1"))
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    assert series in response.text, [l for l in response.text.splitlines() if "active" in l or "pending" in l][:20]


async def test_metrics_endpoint_speaks_openmetrics_when_asked():
    response = await _scrape(telemetry.setup(), "application/openmetrics-text; version=1.0.0")
    assert response.headers["content-type"].startswith("application/openmetrics-text")
    assert response.text.rstrip().endswith("# EOF")


async def test_wait_buckets_are_the_advisory_seconds():
    text = (await _scrape(telemetry.setup())).text
    assert 'otel_lock_wait_duration_seconds_bucket{' in text
    assert 'le="0.001"' in text and 'le="30.0"' in text
    assert 'otel_lock_hold_duration_seconds_bucket{' in text and 'le="120.0"' in text


def test_whole_path_in_a_fresh_process():
    """Global providers, the ASGI instrumentation and the lock instruments, as an app uses them."""
    script = textwrap.dedent("""
        import asyncio, httpx
        from starlette.applications import Starlette
        from starlette.responses import JSONResponse
        from starlette.routing import Route
        from otel_lock import telemetry
        from otel_lock.telemetry._instruments import get_telemetry

        installed = telemetry.setup("shop", "replica-a")

        async def deduct(request):
            get_telemetry().wait_duration.record(0.01, {"lock.name": "stock:{path.product_id}",
                                                        "lock.outcome": "acquired"})
            return JSONResponse({})

        app = Starlette(routes=[Route("/api/stock/{product_id}/deduct", deduct, methods=["POST"]),
                                Route("/metrics", telemetry.metrics_endpoint)])
        app = installed.instrument_app(app)

        async def main():
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
                await client.post("/api/stock/7/deduct")
                print((await client.get("/metrics")).text)
        asyncio.run(main())
    """)
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env,
                         timeout=60, check=True).stdout
    assert 'target_info{service_instance_id="replica-a",service_name="shop"' in out
    # The lock's metrics come from the prometheus-client fast path (labels sorted, no otel_scope_*).
    counts = [line for line in out.splitlines() if line.startswith("otel_lock_wait_duration_seconds_count{")]
    assert len(counts) == 1 and 'lock_name="stock:{path.product_id}"' in counts[0] and counts[0].endswith(" 1.0")
    assert 'lock_outcome="acquired"' in counts[0]
    # HTTP duration per route template (never the concrete path); /metrics itself is excluded.
    assert 'http_target="/api/stock/{product_id}/deduct"' in out
    assert "http_server_duration_milliseconds_bucket{" in out
    assert "/api/stock/7/deduct" not in out
    assert 'http_target="/metrics"' not in out


async def _exposition(accept: str = "") -> str:
    app = Starlette(routes=[Route("/metrics", telemetry.metrics_endpoint)])
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
        return (await client.get("/metrics", headers={"accept": accept} if accept else {})).text


def _samples(text: str, family: str) -> dict[str, float]:
    return {line.rpartition(" ")[0]: float(line.rpartition(" ")[2]) for line in text.splitlines()
            if line.startswith(family + "{")}


async def test_series_exist_at_zero_before_their_first_event(redis_client):
    """Regression test: counters were born at their first event, so increase() missed a replica's first lost lease,
    its first Redis errors and its first circuit opening (a series born at 1 has no earlier sample)."""
    from otel_lock import LockManager

    installed = telemetry.setup("shop", "r1")
    locks = LockManager(redis_client, namespace="seeded", meter_provider=installed.meter_provider)
    try:
        started = await _exposition()
        # The manager's: Redis errors by operation and type, circuit openings of its pool.
        errors = _samples(started, "otel_lock_errors_total")
        assert errors['otel_lock_errors_total{error_type="redis_unavailable",lock_operation="acquire"}'] == 0
        assert len(errors) == 12 and set(errors.values()) == {0}
        assert _samples(started, "otel_lock_circuit_opened_total") == {
            'otel_lock_circuit_opened_total{db_client_connection_pool_name="seeded"}': 0}
        assert 'lock_name="stock"' not in started
        async with locks.lock("stock:1", name="stock"):
            held = await _exposition()
    finally:
        await locks.aclose()
    # A lock name's, from its first sight: lost and failed renewals, timeouts (and acquisitions).
    renewals = _samples(held, "otel_lock_renewals_total")
    assert renewals == {f'otel_lock_renewals_total{{lock_name="stock",lock_renewal_outcome="{outcome}"}}': 0
                        for outcome in ("ok", "lost", "error")}
    waits = _samples(held, "otel_lock_wait_duration_seconds_count")
    assert waits['otel_lock_wait_duration_seconds_count{lock_contended="true",lock_name="stock",'
                 'lock_outcome="timeout"}'] == 0
    assert waits['otel_lock_wait_duration_seconds_count{lock_contended="false",lock_name="stock",'
                 'lock_outcome="acquired"}'] == 1


async def test_a_manager_made_before_setup_has_its_series_seeded_on_the_new_route(redis_client):
    """The app module makes its manager at import, `setup()` runs later (a lifespan): the seeds follow."""
    from otel_lock import LockManager

    locks = LockManager(redis_client, namespace="early")
    try:
        async with locks.lock("a", name="early-name"):
            pass
        telemetry.setup("shop", "r1")
        text = await _exposition()
    finally:
        await locks.aclose()
    assert 'otel_lock_circuit_opened_total{db_client_connection_pool_name="early"} 0.0' in text
    assert 'otel_lock_renewals_total{lock_name="early-name",lock_renewal_outcome="lost"} 0.0' in text


async def test_the_routes_lock_names_have_series_at_zero_from_start_up(redis_client):
    """A route's first lease, lost before the next scrape, was scraped as a series born at 1 (no alert):
    the middleware names its routes' locks at start-up, so their series exist before the first request."""
    from otel_lock import LockManager, LockMiddleware, locked
    from starlette.responses import PlainTextResponse

    telemetry.setup("shop", "r1")
    locks = LockManager(redis_client, namespace="routes-seeded")

    @locked("stock:{path.product_id}")
    async def deduct(request):
        return PlainTextResponse("ok")

    app = Starlette(routes=[Route("/stock/{product_id}/deduct", deduct, methods=["POST"])])
    app.add_middleware(LockMiddleware, manager=locks)
    try:
        try:
            from ._middleware_helpers import run_lifespan
        except ImportError:
            from _middleware_helpers import run_lifespan
        await run_lifespan(app)   # start-up (and shut-down) only: no request
        text = await _exposition()
    finally:
        await locks.aclose()
    assert 'otel_lock_renewals_total{lock_name="stock:{path.product_id}",lock_renewal_outcome="lost"} 0.0' in text


OPENMETRICS = "application/openmetrics-text; version=1.0.0"


async def test_openmetrics_counters_and_histograms_carry_created_and_the_text_format_does_not(redis_client):
    """OpenMetrics `_created` says when a series started (a restart is a new start, not a drop);
    the Prometheus text format has no such sample and stays as it was (no extra `*_created` gauges)."""
    import time

    from otel_lock import LockManager

    before = time.time()
    installed = telemetry.setup("shop", "r1")
    locks = LockManager(redis_client, namespace="created", meter_provider=installed.meter_provider)
    try:
        async with locks.lock("stock:1", name="stock"):
            pass
        openmetrics, text = await _exposition(OPENMETRICS), await _exposition()
    finally:
        await locks.aclose()
    after = time.time()
    # A lock counter seeded at 0 when the manager started, and the histogram of the acquisition.
    created = _samples(openmetrics, "otel_lock_renewals_created")
    assert set(created) == {f'otel_lock_renewals_created{{lock_name="stock",lock_renewal_outcome="{outcome}"}}'
                            for outcome in ("ok", "lost", "error")}
    waits = _samples(openmetrics, "otel_lock_wait_duration_seconds_created")
    assert 'otel_lock_wait_duration_seconds_created{lock_contended="false",lock_name="stock",' \
           'lock_outcome="acquired"}' in waits
    assert all(before <= value <= after for value in [*created.values(), *waits.values()])
    errors = _samples(openmetrics, "otel_lock_errors_created")
    # the manager's seeded Redis-error series (no lock name) and the lock name's deadlock series, each with its start
    assert len([name for name in errors if 'lock_name=""' in name]) == 12
    assert 'otel_lock_errors_created{error_type="deadlock",lock_name="stock",lock_operation="acquire"}' in errors
    # prometheus-client's strict OpenMetrics parser reads it back: `_created` where the format puts it.
    from prometheus_client.openmetrics.parser import text_string_to_metric_families

    parsed = {f.name: f for f in text_string_to_metric_families(openmetrics)}
    assert any(s.name == "otel_lock_renewals_created" for s in parsed["otel_lock_renewals"].samples)
    assert "_created" not in text
    # The text exposition is the OpenMetrics one's samples less `_created`, in the text format's spelling.
    assert 'otel_lock_renewals_total{lock_name="stock",lock_renewal_outcome="ok"} 0.0' in text
    assert 'otel_lock_renewals_total{lock_name="stock",lock_renewal_outcome="ok"} 0.0' in openmetrics
