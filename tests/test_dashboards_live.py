"""Every query of every dashboard panel returns data from a real Prometheus.

The local stack (redis-server, two `otel-lock serve` replicas, the Debian
prometheus binary with the compose scrape config and alert rules) runs under
the contended load loop. Rare events that a healthy load never produces
(timeouts of the stock lock, a lost lease, Redis errors) are caused for real
by a third process-like target: a LockManager in this test whose meter
provider is scraped by the same Prometheus job.
"""

from __future__ import annotations

import asyncio
import importlib.util
import math
import shutil
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
from opentelemetry.exporter.prometheus import PrometheusMetricReader
from opentelemetry.sdk.metrics import MeterProvider
from prometheus_client import CollectorRegistry, start_http_server

from otel_lock import LockManager, LockTimeout, RedisUnavailable
from otel_lock.cli._load_loop import LoadLoop
from otel_lock.cli._local_stack import LocalStack
from otel_lock.cli._redis_server import RedisServer, free_port
from otel_lock.telemetry._instruments import LockCounts, get_telemetry

pytestmark = pytest.mark.skipif(shutil.which("prometheus") is None,
                                reason="prometheus binary not on PATH (Debian: apt-get install prometheus)")

STOCK_LOCK = "stock:{path.product_id}"  # the demo's stock lock name, used as $lock_name
SUBSTITUTIONS = {"$__rate_interval_ms": "10000", "$__rate_interval": "10s", "$__range": "5m",
                 "$lock_name": STOCK_LOCK, "$job": ".*", "$instance": ".*"}  # _ms first: it extends the other
DEADLINE = 60.0
_KEEP: list = []  # LockCounts are held weakly by the readers: keep the fault target's alive


def _dashboards() -> dict:
    path = Path(__file__).resolve().parent.parent / "dashboards" / "generate.py"
    spec = importlib.util.spec_from_file_location("dashboards_generate", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return {name: build() for name, build in module.DASHBOARDS.items()}


def _queries() -> list[tuple[str, str, str]]:
    """(dashboard uid, panel title, PromQL with Grafana variables substituted)."""
    found = []
    for board in _dashboards().values():
        for panel in board["panels"]:
            for target in panel.get("targets", []):
                expr = target["expr"]
                for variable, value in SUBSTITUTIONS.items():
                    expr = expr.replace(variable, value)
                assert "$" not in expr, f"unsubstituted variable in {panel['title']}: {expr}"
                found.append((board["uid"], panel["title"], expr))
    return found


@pytest.fixture(scope="module")
def fault_target():
    """A /metrics endpoint of our own, fed by the LockManagers that cause the rare events."""
    registry = CollectorRegistry()
    provider = MeterProvider(metric_readers=[PrometheusMetricReader(registry=registry)])
    port = free_port()
    server, thread = start_http_server(port, addr="127.0.0.1", registry=registry)
    yield provider, f"127.0.0.1:{port}"
    server.shutdown()
    server.server_close()
    thread.join(5)
    provider.shutdown()


@pytest.fixture(scope="module")
def stack(fault_target):
    with LocalStack(replicas=2, job_interval=1.0, scrape_interval="1s", evaluation_interval="1s",
                    extra_targets=[fault_target[1]]) as stack:
        yield stack


async def _cause_rare_events(redis_url: str, meter_provider) -> None:
    """A timeout, a lost lease and a Redis error on the stock lock name, each for real."""
    holder = LockManager.from_url(redis_url, namespace="faults", lease=3.0, meter_provider=meter_provider)
    other = LockManager.from_url(redis_url, namespace="faults", meter_provider=meter_provider)
    try:
        async with holder.lock("stock:fault-timeout", name=STOCK_LOCK):
            with pytest.raises(LockTimeout):
                async with other.lock("stock:fault-timeout", name=STOCK_LOCK, wait=0.05):
                    pass
        async with holder.lock("stock:fault-lost", name=STOCK_LOCK, cancel_on_lost=False) as held:
            assert await other.force_release("stock:fault-lost")
            await asyncio.wait_for(held.lost.wait(), 10)
    finally:
        await holder.aclose()
        await other.aclose()

    # Until the core reports them (LockCounts.hold_started / watch_connections,
    # Telemetry.redis_duration), the hold, lease and Redis panels are fed here
    # at the instrument level, for a lock name of their own.
    counts = LockCounts(meter_provider)
    counts.hold_started(SimpleNamespace(name=STOCK_LOCK, acquired_at=time.monotonic() - 5, lease_seconds=30))
    counts.watch_connections(lambda: (1, 0), pool_name="faults")
    counts.permit_taken(STOCK_LOCK, 2)  # a semaphore's permit, for the permits panel
    _KEEP.append(counts)

    dead = RedisServer().start()
    dead.stop()
    unreachable = LockManager.from_url(dead.url, namespace="faults", socket_timeout=0.5, breaker_failures=1,
                                       meter_provider=meter_provider)  # one failure opens its circuit
    try:
        with pytest.raises(RedisUnavailable):
            async with unreachable.lock("stock:fault-redis", name=STOCK_LOCK, wait=0.2):
                pass
    finally:
        await unreachable.aclose()


async def _feed_redis_latency(meter_provider) -> None:
    """Redis round trips as the core will record them (Telemetry.redis_duration), until cancelled."""
    instrument = get_telemetry(meter_provider=meter_provider).redis_duration
    while True:
        instrument.record(0.0003, {"lock.name": STOCK_LOCK, "lock.operation": "acquire"})
        await asyncio.sleep(0.2)  # a steady trickle, so rate() sees an increase


def _has_data(result: list) -> bool:
    for series in result:
        values = [series["value"]] if "value" in series else series.get("values", [])
        if any(math.isfinite(float(value)) for _, value in values):
            return True
    return False


async def test_every_dashboard_query_returns_data(stack, fault_target):
    queries = _queries()
    assert len(queries) > 30
    load = LoadLoop(stack.replicas.urls, workers=4, seed=7)
    load_task = asyncio.create_task(load.run())
    try:
        await _cause_rare_events(stack.redis_url, fault_target[0])
        feeder = asyncio.create_task(_feed_redis_latency(fault_target[0]))
        pending = list(queries)
        deadline = time.monotonic() + DEADLINE
        async with httpx.AsyncClient(base_url=stack.prometheus.url, timeout=5.0) as client:
            while pending and time.monotonic() < deadline:
                still = []
                for query in pending:
                    response = await client.get("/api/v1/query", params={"query": query[2]})
                    body = response.json()
                    assert body["status"] == "success", f"{query[1]}: {body}"
                    if not _has_data(body["data"]["result"]):
                        still.append(query)
                pending = still
                if pending:
                    await asyncio.sleep(0.5)  # bounded polling while Prometheus scrapes
    finally:
        load.stop()
        await load_task
        if "feeder" in locals():
            feeder.cancel()
    assert not pending, "panels without data:\n" + "\n".join(f"{uid} / {title}: {expr}"
                                                             for uid, title, expr in pending)
    assert sum(count for status, count in load.requests.items() if 200 <= status < 300) > 0


async def test_lock_name_variable_lists_the_stock_lock(stack):
    variables = {v["name"]: v for v in _dashboards()["otel-lock-lock.json"]["templating"]["list"]}
    variable = variables["lock_name"]
    metric = variable["definition"].removeprefix("label_values(").split(",")[0].replace("$job", ".*")
    deadline = time.monotonic() + DEADLINE
    async with httpx.AsyncClient(base_url=stack.prometheus.url, timeout=5.0) as client:
        while True:
            response = await client.get("/api/v1/label/lock_name/values", params={"match[]": metric})
            if STOCK_LOCK in response.json()["data"] or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.5)
    assert STOCK_LOCK in response.json()["data"]


async def test_alert_rules_are_loaded_and_healthy(stack):
    async with httpx.AsyncClient(base_url=stack.prometheus.url, timeout=5.0) as client:
        groups = (await client.get("/api/v1/rules")).json()["data"]["groups"]
    rules = [rule for group in groups for rule in group["rules"]]
    assert {"OtelLockLeaseLost", "OtelLockWaitP95High", "OtelLockAcquireBudgetBurnFast"} <= {
        rule["name"] for rule in rules}
    assert all(rule["health"] in ("ok", "unknown") for rule in rules), [
        (rule["name"], rule.get("lastError")) for rule in rules if rule["health"] not in ("ok", "unknown")]
