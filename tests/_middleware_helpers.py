"""Shared by the middleware, routing and idempotency tests: a manager, a client, Redis key names."""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager
from typing import AsyncIterator

import httpx
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from otel_lock import LockManager
from otel_lock.asgi._problem import TYPE_BASE

NAMESPACE = "mwtest"


def lock_key(name: str, namespace: str = NAMESPACE) -> str:
    """The Redis key of a lock name (the core's `<namespace>:{<name>}`)."""
    return f"{namespace}:{{{name}}}"


@asynccontextmanager
async def make_manager(url: str, **options) -> AsyncIterator[LockManager]:
    manager = LockManager.from_url(url, namespace=NAMESPACE, **options)
    try:
        yield manager
    finally:
        await manager.aclose()


@asynccontextmanager
async def client_for(app, **options) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://test", **options) as client:
        yield client


def metered() -> tuple[MeterProvider, InMemoryMetricReader]:
    reader = InMemoryMetricReader()
    return MeterProvider(metric_readers=[reader]), reader


def counter_points(reader: InMemoryMetricReader, name: str) -> dict[tuple, int]:
    """{sorted attribute items: value} of one counter."""
    data = reader.get_metrics_data()
    points: dict[tuple, int] = {}
    for rm in data.resource_metrics if data else []:
        for sm in rm.scope_metrics:
            for metric in sm.metrics:
                if metric.name == name:
                    for point in metric.data.data_points:
                        points[tuple(sorted(point.attributes.items()))] = point.value
    return points


def problem(response: httpx.Response) -> dict:
    """The RFC 9457 body, checked; `type` is given back as the case name (`lock-timeout`) to compare.

    Every problem type of the library is the one absolute URI scheme of `_problem.TYPE_BASE`.
    """
    assert response.headers["content-type"] == "application/problem+json", response.text
    body = response.json()
    assert body["status"] == response.status_code
    assert {"type", "title", "status", "detail"} <= body.keys()
    assert body["type"].startswith(TYPE_BASE), body["type"]
    return {**body, "type": body["type"][len(TYPE_BASE):]}


def empty_then_silent():
    """A server's receive for a request without a body whose client then stays connected and quiet."""
    requested = False

    async def receive():
        nonlocal requested
        if not requested:
            requested = True
            return {"type": "http.request", "body": b"", "more_body": False}
        await asyncio.Event().wait()

    return receive


async def disconnecting_call(app, path: str, disconnect: asyncio.Event, spec: str = "2.3", *,
                             method: str = "GET", body: bytes = b"", headers=()) -> list:
    """Drive the ASGI app by hand: a client that goes away once `disconnect` is set.

    ASGI 2.3 servers tell the app with an `http.disconnect` message; with 2.4
    `send` raises OSError as well.
    """
    sent = []
    requested = False

    async def receive():
        nonlocal requested
        if not requested:
            requested = True
            return {"type": "http.request", "body": body, "more_body": False}
        await disconnect.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        if spec >= "2.4" and disconnect.is_set():
            raise OSError("connection reset by peer")
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": spec}, "http_version": "1.1",
             "method": method, "scheme": "http", "path": path, "raw_path": path.encode(), "root_path": "",
             "query_string": b"", "headers": list(headers), "client": ("127.0.0.1", 5000), "server": ("test", 80)}
    try:
        await app(scope, receive, send)
    except Exception:  # the 2.4 path raises ClientDisconnect out of the app, as servers expect
        pass
    return sent


async def run_lifespan(app) -> list:
    """Start the app's lifespan as a server would, then shut it down; the messages the app sent."""
    inbox: asyncio.Queue = asyncio.Queue()
    sent: list = []
    started = asyncio.Event()

    async def receive():
        return await inbox.get()

    async def send(message):
        sent.append(message)
        if message["type"].startswith("lifespan.startup"):
            started.set()

    await inbox.put({"type": "lifespan.startup"})
    scope = {"type": "lifespan", "asgi": {"version": "3.0", "spec_version": "2.0"}, "state": {}}
    task = asyncio.create_task(app(scope, receive, send))
    await started.wait()
    if sent[0]["type"] == "lifespan.startup.complete":
        await inbox.put({"type": "lifespan.shutdown"})
        await task
    else:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    return sent


async def until(predicate, what: str = "the condition", timeout: float = 10.0) -> None:
    """Poll a (sync) predicate until it holds; fail naming `what` instead of hanging."""
    try:
        async with asyncio.timeout(timeout):
            while not predicate():
                await asyncio.sleep(0.005)
    except TimeoutError:
        raise AssertionError(f"timed out waiting for {what}") from None


def waiting(reader: InMemoryMetricReader, lock_name: str) -> int:
    """How many callers wait for `lock_name` now (the `otel_lock.pending` up-down counter)."""
    return sum(v for attrs, v in counter_points(reader, "otel_lock.pending").items()
               if dict(attrs).get("lock.name") == lock_name)


@asynccontextmanager
async def serving(app, **config) -> AsyncIterator[tuple[str, int]]:
    """uvicorn in this event loop on a pre-bound loopback socket (connections queue until it accepts)."""
    import socket

    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    server = uvicorn.Server(uvicorn.Config(app, log_level="critical", lifespan="on", **config))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        yield sock.getsockname()
    finally:
        server.should_exit = True
        await task
        sock.close()


def histogram_counts(reader: InMemoryMetricReader, name: str) -> dict[tuple, int]:
    """{sorted attribute items: count} of one histogram."""
    data = reader.get_metrics_data()
    counts: dict[tuple, int] = {}
    for rm in data.resource_metrics if data else []:
        for sm in rm.scope_metrics:
            for metric in sm.metrics:
                if metric.name == name:
                    for point in metric.data.data_points:
                        counts[tuple(sorted(point.attributes.items()))] = point.count
    return counts
