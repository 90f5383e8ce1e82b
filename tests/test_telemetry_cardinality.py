"""Cardinality bounded by construction, whatever the key's shape or the client's Host.

Lock names of unnamed locks come from `key_name` (never the id); every
instrument admits a bounded number of values per attribute, on the fast path
and the SDK path alike, and so do span names and the observed gauges; HTTP
metrics keep no client-chosen value. The end-to-end test drives 20,000
distinct keys of several shapes, explicit per-id names and random Hosts, and
a real Prometheus scrapes /metrics throughout.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import random
import shutil
import uuid

import httpx
import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import CollectorRegistry, generate_latest, start_http_server
from prometheus_client.parser import text_string_to_metric_families
from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route

from otel_lock import LockManager, telemetry
from otel_lock.cli._redis_server import free_port
from otel_lock.telemetry._bounds import DEFAULT_LIMIT, OVERFLOW, key_name
from otel_lock.telemetry._instruments import LockCounts, Telemetry
from otel_lock.telemetry._names import OBSERVED
from otel_lock.telemetry._prom import FastMetrics, GaugeCollector

from _proc_helpers import until

ID = 1234567


def shapes(i: int) -> list[str]:
    """One key of every shape a shop writes, for id `i`."""
    return [f"product-{i}", f"stock/{i}", f"stock_{i}", f"stock:{i}", str(i), str(uuid.UUID(int=i)),
            uuid.UUID(int=i).hex, f"user{i}@example.com", f"first.last{i}@example.com", f"sku{i}",
            f"order.{i}", f"{i}-item", f"{i:x}deadbeef", f"cart:user:{i}@example.com"]


@pytest.mark.parametrize("key", shapes(ID))
def test_a_raw_key_gets_a_bounded_name_without_its_id(key):
    name = key_name(key)
    assert str(ID) not in name and f"{ID:x}" not in name and "example" not in name
    assert name == key_name(key.replace(str(ID), str(ID + 1)).replace(f"{ID:x}", f"{ID + 1:x}"))


def test_key_names_keep_the_business_word():
    assert [key_name(k) for k in ("stock:1001", "product-1001", "stock/1001", "stock_1001", "sku1001",
                                  "job:tick:12", "cleanup")] == [
        "stock", "product", "stock", "stock", "sku", "job", "cleanup"]
    assert {key_name(k) for k in ("1001", str(uuid.uuid4()), "a@b.c", "5f3a9c0e1b7d", " x")} == {
        "{number}", "{uuid}", "{email}", "{hex}", "{key}"}


async def test_an_unnamed_lock_is_named_by_key_name(redis_client):
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    locks = LockManager(redis_client, namespace="card-default", meter_provider=provider)
    try:
        for key in shapes(ID):
            async with locks.lock(key):
                pass
    finally:
        await locks.aclose()
    names = _sdk_values(reader, "otel_lock.wait.duration", "lock.name")
    provider.shutdown()
    assert names == {key_name(key) for key in shapes(ID)}
    assert not any(str(ID) in name for name in names)


def _sdk_values(reader, metric: str, attribute: str) -> set:
    data = reader.get_metrics_data()
    return {p.attributes.get(attribute) for rm in data.resource_metrics for sm in rm.scope_metrics
            for m in sm.metrics if m.name == metric for p in m.data.data_points}


ERRORS = {"lock.operation": "acquire", "error.type": "redis_unavailable"}


def test_the_fast_path_folds_names_past_the_limit_once_warned(caplog):
    registry = CollectorRegistry()
    fast = FastMetrics(registry).instruments["errors"]
    with caplog.at_level(logging.WARNING, logger="otel_lock.telemetry"):
        for i in range(DEFAULT_LIMIT * 3):
            fast.add(1, {"lock.name": f"report-{i}", **ERRORS})
            fast.add(1, {"lock.name": f"report-{i}", **ERRORS})  # a second record: the cache path
    lines = [line for line in generate_latest(registry).decode().splitlines() if line.startswith("otel_lock_errors_total{")]
    assert len(lines) == DEFAULT_LIMIT + 1
    overflow = [line for line in lines if f'lock_name="{OVERFLOW}"' in line]
    # the other labels keep their meaning in the overflow series, and nothing is lost
    assert overflow == [f'otel_lock_errors_total{{error_type="redis_unavailable",lock_name="{OVERFLOW}",'
                        f'lock_operation="acquire"}} {DEFAULT_LIMIT * 4}.0']
    assert len(fast._children) == DEFAULT_LIMIT, "an overflowing attribute set must not grow the cache"
    warnings = [r for r in caplog.records if OVERFLOW in r.getMessage()]
    assert len(warnings) == 1 and "otel_lock.errors" in warnings[0].getMessage()


def test_the_fast_path_keeps_only_declared_attributes():
    registry = CollectorRegistry()
    fast = FastMetrics(registry).instruments["renewals"]
    for i in range(50):
        fast.add(1, {"lock.name": "a", "lock.renewal.outcome": "ok", "lock.key": f"a:{i}"})
    text = generate_latest(registry).decode()
    assert "lock_key" not in text
    assert 'otel_lock_renewals_total{lock_name="a",lock_renewal_outcome="ok"} 50.0' in text


def test_the_sdk_path_folds_names_past_the_limit_too():
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    instruments = Telemetry(meter_provider=provider)
    for i in range(DEFAULT_LIMIT * 3):
        instruments.wait_duration.record(0.001, {"lock.name": f"report-{i}", "lock.outcome": "acquired",
                                                 "lock.contended": False, "lock.key": f"k{i}"})
    names = _sdk_values(reader, "otel_lock.wait.duration", "lock.name")
    keys = _sdk_values(reader, "otel_lock.wait.duration", "lock.key")
    provider.shutdown()
    assert len(names) == DEFAULT_LIMIT + 1 and OVERFLOW in names
    assert keys == {None}


def test_span_names_are_bounded():
    exporter = InMemorySpanExporter()
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(exporter))
    instruments = Telemetry(tracer_provider=tracer_provider)
    with tracer_provider.get_tracer("test").start_as_current_span("request"):
        for i in range(DEFAULT_LIMIT * 2):
            with instruments.acquire_span(f"report-{i}"):
                pass
            instruments.end_hold_span(instruments.start_hold_span(f"report-{i}", {}), "released")
    names = {span.name for span in exporter.get_finished_spans()}
    tracer_provider.shutdown()
    assert len(names) == 2 * (DEFAULT_LIMIT + 1) + 1
    assert f"lock acquire {OVERFLOW}" in names and f"lock hold {OVERFLOW}" in names


def test_observed_gauges_fold_names_and_forget_idle_ones():
    counts = LockCounts()
    for i in range(DEFAULT_LIMIT * 5):
        counts.active[f"report-{i}"] += 1
    collector = GaugeCollector()
    from otel_lock.telemetry import _counts

    points = _counts.observe("active", [counts], collector._limits["active"])
    assert len(points) == DEFAULT_LIMIT + 1
    assert sum(value for _, value in points) == DEFAULT_LIMIT * 5
    for i in range(DEFAULT_LIMIT * 5):
        counts.active[f"report-{i}"] -= 1
    assert len(counts.active) <= DEFAULT_LIMIT + 1, "idle names past the limit are forgotten"
    assert OBSERVED["active"].labels == ("lock.name",)
    del counts
    gc.collect()


# -- end to end: 20,000 keys, random Hosts, a real Prometheus ---------------------------------

SERVED_BY_PROMETHEUS = shutil.which("prometheus") is not None


@pytest.fixture
def installed(monkeypatch):
    for name in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_METRICS_EXPORTER", "OTEL_SERVICE_NAME",
                 "OTEL_RESOURCE_ATTRIBUTES", "OTEL_SEMCONV_STABILITY_OPT_IN"):
        monkeypatch.delenv(name, raising=False)
    telemetry._reset_for_tests()
    yield telemetry.setup("card-shop", "r1", prometheus=True, otlp=False, flush_on_signal=False)
    telemetry._reset_for_tests()


def shop(locks: LockManager) -> Starlette:
    async def lock_raw(request):
        async with locks.lock(request.path_params["key"]):  # a shop that locks the raw key
            return JSONResponse({})

    async def unavailable(request):
        return JSONResponse({}, status_code=503)

    return Starlette(routes=[Route("/raw/{key:path}", lock_raw, methods=["POST"]),
                             Route("/down", unavailable)])


def exposition(installed) -> dict[str, int]:
    """Samples per family in the /metrics text, the way Prometheus counts them."""
    out: dict[str, int] = {}
    for family in text_string_to_metric_families(generate_latest(installed.registry).decode()):
        out[family.name] = out.get(family.name, 0) + len(family.samples)
    return out


async def drive(locks, client, ids: range, rng: random.Random) -> dict[int, int]:
    statuses: dict[int, int] = {}
    for i in ids:
        for key in shapes(i)[:8]:
            async with locks.lock(key):
                pass
        async with locks.lock(f"report:{i}", name=f"report-{i}"):  # explicit per-id names: the hard limit
            pass
        host = f"{rng.getrandbits(64):x}.example.com:{rng.randrange(1, 65535)}"
        for path in (f"/raw/{shapes(i)[8 + i % 6]}", "/down"):
            response = await client.request("POST" if path.startswith("/raw") else "GET", path,
                                            headers={"host": host})
            statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
    return statuses


@pytest.mark.skipif(not SERVED_BY_PROMETHEUS, reason="prometheus binary not on PATH (Debian: apt-get install prometheus)")
async def test_twenty_thousand_keys_and_random_hosts_leave_the_series_flat(installed, redis_url):
    from otel_lock.cli._local_stack import Prometheus

    port = free_port()
    server, thread = start_http_server(port, addr="127.0.0.1", registry=installed.registry)
    locks = LockManager.from_url(redis_url, namespace="card")
    app = installed.instrument_app(shop(locks))
    rng = random.Random(18)
    # A scrape every 3 s, timeout 3 s (Prometheus caps it at the interval): the 20,000 keys used to
    # make /metrics take 10-40 s to render (up=0); now it stays a few thousand samples.
    prometheus = Prometheus([f"127.0.0.1:{port}"], scrape_interval="3s", evaluation_interval="5s").start()
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://shop") as client, \
                httpx.AsyncClient(base_url=prometheus.url, timeout=5.0) as api:
            first = await drive(locks, client, range(0, 1000), rng)
            half = exposition(installed)
            scraped_half = await _scraped_after_now(api)
            second = await drive(locks, client, range(1000, 2000), rng)
            full = exposition(installed)
            scraped_full = await _scraped_after_now(api)
            ups = await _query(api, 'min_over_time(up{job="otel-lock-replicas"}[1h])')
    finally:
        await locks.aclose()
        del locks, app  # its counts hold 2,000 names: gone before the next test's setup() reads every manager
        gc.collect()
        prometheus.stop()
        server.shutdown()
        server.server_close()
        thread.join(5)
    keys = 2000 * (8 + 1 + 1)  # distinct keys driven: 8 shapes locked directly, an explicit name, one by HTTP
    assert keys == 20_000 and first[200] == second[200] == 1000 and first[503] == second[503] == 1000
    assert full == half, {name: (half.get(name), n) for name, n in full.items() if half.get(name) != n}
    assert scraped_full == scraped_half < 20_000
    assert ups == [1.0], "every scrape answered within its timeout"
    text = generate_latest(installed.registry).decode()
    # No client-chosen value on HTTP metrics; the real 503s keep their route and status.
    assert "example.com" not in text and "http_server_name" not in text and "http_host" not in text
    assert "net_host" not in text and "size" not in "".join(full)
    downs = [sample for family in text_string_to_metric_families(text) for sample in family.samples
             if sample.name == "http_server_duration_milliseconds_count" and sample.labels.get("http_target") == "/down"]
    assert [(s.labels["http_status_code"], s.value) for s in downs] == [("503", 2000.0)]


async def _query(api, expr: str) -> list[float]:
    result = (await api.get("/api/v1/query", params={"query": expr})).json()["data"]["result"]
    return [float(series["value"][1]) for series in result]


async def _scraped_after_now(api) -> float:
    """scrape_samples_scraped of a scrape that started after this call."""
    since = float((await api.get("/api/v1/query", params={"query": "time()"})).json()["data"]["result"][1])

    async def fresh():
        return [at for at in await _query(api, 'timestamp(scrape_samples_scraped{job="otel-lock-replicas"})')
                if at > since]
    await until(fresh, "a scrape after the keys were driven")
    [samples] = await _query(api, 'scrape_samples_scraped{job="otel-lock-replicas"}')
    return samples
