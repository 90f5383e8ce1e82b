"""The /metrics fast path: same names and values as the SDK's Prometheus reader, one reader per destination."""

from __future__ import annotations

import httpx
import pytest
from opentelemetry.exporter.prometheus import PrometheusMetricReader
from opentelemetry.sdk.metrics import MeterProvider
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from starlette.applications import Starlette
from starlette.routing import Route

from otel_lock import LockManager, telemetry
from otel_lock.telemetry._instruments import LockCounts, Telemetry, get_telemetry
from otel_lock.telemetry._names import RECORDED
from otel_lock.telemetry._prom import FastMetrics

from _telemetry_helpers import OtlpReceiver

RECORDS = [
    ("wait_duration", 0.003, {"lock.name": "stock:{path.product_id}", "lock.outcome": "acquired",
                              "lock.contended": False}),
    ("wait_duration", 0.7, {"lock.name": "stock:{path.product_id}", "lock.outcome": "acquired",
                            "lock.contended": True}),
    ("wait_duration", 0.0, {"lock.name": "job:tick", "lock.outcome": "busy", "lock.contended": True}),
    ("wait_duration", 5.0, {"lock.name": "stock:{path.product_id}", "lock.outcome": "timeout",
                            "lock.contended": True, "error.type": "timeout"}),
    ("hold_duration", 12.0, {"lock.name": "job:tick", "lock.release.outcome": "released"}),
    ("errors", 1, {"lock.name": "job:tick", "lock.operation": "acquire", "error.type": "redis_unavailable"}),
    ("renewals", 2, {"lock.name": "stock:{path.product_id}", "lock.renewal.outcome": "ok"}),
    ("idempotency_requests", 1, {"http.route": "/api/orders", "idempotency.outcome": "conflict"}),
    ("redis_duration", 0.0004, {"lock.name": "job:tick", "lock.operation": "release"}),
    ("circuit_opened", 1, {"db.client.connection.pool.name": "shop"}),
    ("fail_open", 3, {"lock.name": "stock:{path.product_id}"}),
]


RECORDED_FAMILIES = tuple(spec.prom for spec in RECORDED)


def samples(registry) -> set:
    """(name, labels, value) of every recorded otel_lock sample, minus what only one path adds.

    Observed gauges are left out: they read every live manager in the process.
    """
    out = set()
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for sample in family.samples:
            if not sample.name.startswith(RECORDED_FAMILIES) or sample.name.endswith("_created"):
                continue
            labels = {k: v for k, v in sample.labels.items() if v != "" and not k.startswith("otel_scope_")}
            if "le" in labels:
                labels["le"] = str(float(labels["le"]))
            out.add((sample.name, frozenset(labels.items()), float(sample.value)))
    return out


def record(instruments, records=RECORDS) -> None:
    for attr, value, attributes in records:
        instrument = getattr(instruments, attr) if not isinstance(instruments, dict) else instruments[attr]
        (instrument.add if attr in ("errors", "renewals", "idempotency_requests", "circuit_opened", "fail_open") else instrument.record)(
            value, dict(attributes))


def test_fast_path_exposes_what_the_sdk_reader_exposes():
    sdk_registry, fast_registry = CollectorRegistry(), CollectorRegistry()
    provider = MeterProvider(metric_readers=[PrometheusMetricReader(registry=sdk_registry)])
    try:
        record(Telemetry(meter_provider=provider))
        record(FastMetrics(fast_registry).instruments)
        record(FastMetrics(CollectorRegistry()).instruments)  # a second registry shares no state
        sdk, fast = samples(sdk_registry), samples(fast_registry)
        assert len(sdk) > 40
        assert fast == sdk
    finally:
        provider.shutdown()


def test_a_bound_child_is_reused_and_label_sets_stay_apart():
    fast = FastMetrics(CollectorRegistry()).instruments["wait_duration"]
    for _ in range(3):
        fast.record(0.01, {"lock.name": "a", "lock.outcome": "acquired", "lock.contended": False})
    fast.record(0.01, {"lock.outcome": "acquired", "lock.name": "a", "lock.contended": False})  # other order
    fast.record(0.01, {"lock.name": "b", "lock.outcome": "busy", "lock.contended": True})
    children = {id(child) for child in fast._children.values()}
    assert len(children) == 2


@pytest.fixture
def clean(monkeypatch):
    for name in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
                 "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT", "OTEL_METRICS_EXPORTER", "OTEL_SERVICE_NAME",
                 "OTEL_RESOURCE_ATTRIBUTES"):
        monkeypatch.delenv(name, raising=False)
    telemetry._reset_for_tests()
    yield
    telemetry._reset_for_tests()


async def scrape(installed) -> str:
    app = Starlette(routes=[Route("/metrics", telemetry.metrics_endpoint)])
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
        return (await client.get("/metrics")).text


def families(text: str) -> list[str]:
    return [line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ")]


async def test_a_manager_made_before_setup_records_into_the_fast_path(clean, redis_client):
    locks = LockManager(redis_client, namespace="fast-before")  # global providers: still the API's proxies
    try:
        installed = telemetry.setup("shop", "r1")
        async with locks.lock("stock:1", name="stock:{id}"):
            text = await scrape(installed)
            assert 'otel_lock_active{lock_name="stock:{id}"} 1.0' in text
        text = await scrape(installed)
    finally:
        await locks.aclose()
    assert any(line.startswith("otel_lock_wait_duration_seconds_count{") and 'lock_name="stock:{id}"' in line
               for line in text.splitlines())
    assert 'otel_lock_active{lock_name="stock:{id}"} 0.0' in text
    assert "otel_scope_name" not in "".join(line for line in text.splitlines() if line.startswith("otel_lock"))
    own = families(text)
    assert len(own) == len(set(own)), "a family exposed twice breaks the Prometheus scrape"


async def test_both_destinations_read_one_recording(clean, monkeypatch, redis_client):
    """/metrics and OTLP read the same children: each measurement is recorded once and exported by both."""
    with OtlpReceiver() as receiver:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.endpoint)
        installed = telemetry.setup("shop", "r1", prometheus=True)
        assert installed.otlp
        locks = LockManager(redis_client, namespace="fast-both")
        try:
            async with locks.lock("stock:1", name="stock:{id}"):
                pass
        finally:
            await locks.aclose()
        text = await scrape(installed)
        own = families(text)
        assert len(own) == len(set(own))
        assert 'otel_lock_wait_duration_seconds_count{lock_contended="false",lock_name="stock:{id}",' \
               'lock_outcome="acquired"} 1.0' in text
        assert installed.meter_provider.force_flush()
        assert receiver.wait_for(lambda: any(m.name == "otel_lock.wait.duration" for m in receiver.metrics))
        waits = [m for m in receiver.metrics if m.name == "otel_lock.wait.duration"]
        assert sum(p.count for m in waits for p in m.histogram.data_points) == 1
        # the HTTP instrumentation's provider has no second copy: one otel_lock scope per export
        telemetry._reset_for_tests()


def test_otel_metrics_exporter_otlp_means_no_prometheus_reader(clean, monkeypatch):
    with OtlpReceiver() as receiver:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.endpoint)
        monkeypatch.setenv("OTEL_METRICS_EXPORTER", "otlp")
        installed = telemetry.setup("shop", "r1")
        assert len(installed.meter_provider._metric_readers) == 1
        # /metrics answers with the replica's resource only (Prometheus' `up`, OtelLockTelemetryMissing)
        text = generate_latest(installed.registry).decode()
        assert [line.split("{")[0] for line in text.splitlines() if not line.startswith("#")] == ["target_info"]
        assert 'service_instance_id="r1"' in text
        # Lock metrics are recorded on the fast path and leave by OTLP.
        get_telemetry().errors.add(1, {"lock.name": "a", "lock.operation": "acquire", "error.type": "x"})
        assert installed.meter_provider.force_flush()
        assert receiver.wait_for(lambda: any(m.name == "otel_lock.errors" for m in receiver.metrics))
        telemetry._reset_for_tests()  # while the receiver still answers the final export


def test_otel_metrics_exporter_is_checked(clean, monkeypatch):
    monkeypatch.setenv("OTEL_METRICS_EXPORTER", "prometheus,statsd")
    with pytest.raises(ValueError, match="statsd"):
        telemetry.setup("shop")


def test_bad_redact_argument_is_named(clean):
    with pytest.raises(ValueError, match="redact must be one of off, hash, drop"):
        telemetry.setup("shop", redact="yes")


def test_gauges_of_global_managers_are_served_by_the_fast_path(clean):
    installed = telemetry.setup("shop", "r1")
    counts = LockCounts()
    counts.pending["stock:{id}"] += 3
    counts.watch_connections(lambda: (2, 1), pool_name="shop")
    counts.watch_circuit(lambda: 1)
    text = generate_latest(installed.registry).decode()
    assert 'otel_lock_pending{lock_name="stock:{id}"} 3.0' in text
    assert ('otel_lock_redis_connection_count{db_client_connection_pool_name="shop",'
            'db_client_connection_state="used"} 2.0') in text
    assert 'otel_lock_redis_connection_pending_requests{db_client_connection_pool_name="shop"} 1.0' in text
    assert 'otel_lock_circuit_state{db_client_connection_pool_name="shop"} 1.0' in text


async def test_a_manager_given_the_installed_provider_is_on_the_fast_path_too(clean, redis_client):
    """`meter_provider=installed.meter_provider` must not put a second copy of the families on /metrics."""
    installed = telemetry.setup("shop", "r1")
    named = LockManager(redis_client, namespace="fast-named", meter_provider=installed.meter_provider)
    unnamed = LockManager(redis_client, namespace="fast-unnamed")
    try:
        async with named.lock("a:1", name="a"), unnamed.lock("b:1", name="b"):
            text = await scrape(installed)
    finally:
        await named.aclose()
        await unnamed.aclose()
    own = families(text)
    assert len(own) == len(set(own)), own
    assert 'otel_lock_active{lock_name="a"} 1.0' in text and 'otel_lock_active{lock_name="b"} 1.0' in text
    waits = [line for line in text.splitlines() if line.startswith("otel_lock_wait_duration_seconds_count{")
             and not line.endswith(" 0.0")]  # the outcomes seeded at 0 before their first event aside
    assert len(waits) == 2 and all("otel_scope_name" not in line for line in waits)


def test_threads_recording_at_once_lose_nothing_and_share_children():
    import threading

    registry = CollectorRegistry()
    fast = FastMetrics(registry).instruments["errors"]
    start = threading.Barrier(4)

    def work(n: int) -> None:
        start.wait()
        for i in range(2000):
            # half the threads build the dict in the other order: same label set
            attrs = ({"lock.name": f"n{i % 5}", "lock.operation": "acquire"} if n % 2 else
                     {"lock.operation": "acquire", "lock.name": f"n{i % 5}"})
            fast.add(1, attrs)

    threads = [threading.Thread(target=work, args=(n,)) for n in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    lines = [line for line in generate_latest(registry).decode().splitlines()
             if line.startswith("otel_lock_errors_total{")]
    assert len(lines) == 5
    assert sum(float(line.rsplit(" ", 1)[1]) for line in lines) == 8000
