"""otel_lock.idempotency.requests: every outcome is counted once, with the route template."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from otel_lock import LockManager, LockMiddleware, idempotent

ROUTE = "/api/orders/{shop}"
SECRET_KEY = '"key-that-must-not-reach-metrics"'


@pytest.fixture
async def shop(redis_client):
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    locks = LockManager(redis_client, namespace="idem-telemetry", meter_provider=provider)
    release = asyncio.Event()
    entered = asyncio.Event()

    @idempotent(ttl=60, required=True, shared_scope=True)
    async def create(request: Request) -> JSONResponse:
        body = await request.json()
        if body.get("busy"):
            return JSONResponse({"busy": True}, status_code=429, headers={"Retry-After": "1"})
        if body.get("slow"):
            entered.set()
            await release.wait()
        return JSONResponse({"ok": True, **body}, status_code=201)

    app = Starlette(routes=[Route(ROUTE, create, methods=["POST"])])
    app.add_middleware(LockMiddleware, manager=locks)
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://shop")
    client.entered, client.release = entered, release
    yield client, reader
    release.set()
    await client.aclose()
    await locks.aclose()
    provider.shutdown()


def _counts(reader) -> dict[tuple[str, str], int]:
    counts: dict[tuple[str, str], int] = {}
    data = reader.get_metrics_data()
    for resource in data.resource_metrics if data else []:
        for scope in resource.scope_metrics:
            for metric in scope.metrics:
                if metric.name != "otel_lock.idempotency.requests":
                    continue
                for point in metric.data.data_points:
                    attributes = dict(point.attributes)
                    assert set(attributes) == {"http.route", "idempotency.outcome"}, attributes
                    assert SECRET_KEY.strip('"') not in str(attributes)
                    key = (attributes["http.route"], attributes["idempotency.outcome"])
                    counts[key] = counts.get(key, 0) + point.value
    return counts


async def _post(client, body: dict, key: str | None = SECRET_KEY) -> httpx.Response:
    headers = {"Idempotency-Key": key} if key is not None else {}
    return await client.post("/api/orders/berlin", json=body, headers=headers)


async def _stored(client):
    assert (await _post(client, {"n": 1})).status_code == 201


async def _replayed(client):
    await _stored(client)
    response = await _post(client, {"n": 1})
    assert response.status_code == 201 and response.headers["idempotent-replayed"] == "true"


async def _mismatch(client):
    await _stored(client)
    assert (await _post(client, {"n": 2})).status_code == 422


async def _conflict(client):
    first = asyncio.create_task(_post(client, {"slow": True}))
    await client.entered.wait()
    assert (await _post(client, {"slow": True})).status_code == 409
    client.release.set()
    assert (await first).status_code == 201


async def _not_stored(client):
    assert (await _post(client, {"busy": True})).status_code == 429


async def _missing_key(client):
    assert (await _post(client, {"n": 1}, key=None)).status_code == 400


async def _invalid_key(client):
    assert (await _post(client, {"n": 1}, key="not an sf-string")).status_code == 400


@pytest.mark.parametrize("outcome, scenario", [
    ("stored", _stored), ("replayed", _replayed), ("mismatch", _mismatch),
    ("conflict", _conflict), ("not_stored", _not_stored), ("missing_key", _missing_key),
    ("invalid_key", _invalid_key),
])
async def test_outcome_is_counted_with_the_route_template(shop, outcome, scenario):
    client, reader = shop
    await scenario(client)
    counts = _counts(reader)
    assert counts.get((ROUTE, outcome)) == 1, counts
    if outcome in ("missing_key", "invalid_key", "not_stored"):
        assert (ROUTE, "stored") not in counts  # rejected before the handler ran
