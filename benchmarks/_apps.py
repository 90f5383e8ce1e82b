"""The endpoint under test, in the variants the middleware benchmark compares, served by uvicorn.

    python -m benchmarks._apps VARIANT PORT REDIS_URL

bare      POST /items/{id} answers {"id": ...}: no lock, no middleware
locked    the same handler with @locked("item:{path.id}") behind LockMiddleware
redis-py  the same handler taking redis-py's asyncio Lock by hand
demo      the demo shop, with BENCH_TELEMETRY=off|prom|prom-lock|otlp|otlp-lock (benchmarks._otel_modes)
two-pings the bare handler awaiting two PINGs through redis-py (the cost of 2 round trips here)
locked-via-redis-py  `locked` with otel-lock's Redis calls through redis-py instead of its lean connection
fastapi-locked, fastapi-redis-py  `locked` and `redis-py` as FastAPI apps (typed path parameter)
fastapi-otel-lock-by-hand  the FastAPI handler taking otel-lock's lock itself (diagnostic: the middleware's share)
fastapi-telemetry  `fastapi-locked` with FastAPI's native telemetry, BENCH_TELEMETRY as for `demo` and the
          FastAPI modes of benchmarks._otel_modes (framework spans on, without operation spans, sampled)
"""

from __future__ import annotations

import cProfile
import os
import signal
import sys
from contextlib import asynccontextmanager

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse
from starlette.routing import Route

WAIT = 10.0


async def healthz(request: Request) -> PlainTextResponse:
    return PlainTextResponse("ok")


def _closing(resource):
    """A lifespan that closes `resource` (the manager, or the redis-py client) when the server stops."""
    @asynccontextmanager
    async def lifespan(app):
        yield
        await resource.aclose()

    return lifespan


def bare_app(url: str) -> Starlette:
    async def item(request: Request) -> JSONResponse:
        return JSONResponse({"id": request.path_params["id"]})

    return Starlette(routes=[Route("/items/{id}", item, methods=["POST"]), Route("/healthz", healthz)])


def locked_app(url: str, via_redis_py: bool = False, **manager_options) -> Starlette:
    from otel_lock import LockManager, LockMiddleware, locked

    if via_redis_py:
        # a Redis subclass keeps otel-lock off its own lean connection: every call goes through redis-py
        import redis.asyncio as aioredis

        class Client(aioredis.Redis):
            pass

        manager = LockManager(Client.from_url(url, socket_timeout=2.0), namespace="bench", **manager_options)
    else:
        manager = LockManager.from_url(url, namespace="bench", **manager_options)

    @locked("item:{path.id}", wait=WAIT)
    async def item(request: Request) -> JSONResponse:
        return JSONResponse({"id": request.path_params["id"]})

    lifespan = _closing(manager)

    app = Starlette(routes=[Route("/items/{id}", item, methods=["POST"]), Route("/healthz", healthz)],
                    lifespan=lifespan)
    app.add_middleware(LockMiddleware, manager=manager)
    return app


def redis_py_app(url: str) -> Starlette:
    import redis.asyncio as aioredis

    client = aioredis.Redis.from_url(url, max_connections=1000)

    async def item(request: Request) -> JSONResponse:
        item_id = request.path_params["id"]
        async with client.lock(f"bench:item:{item_id}", timeout=30, blocking_timeout=WAIT):
            return JSONResponse({"id": item_id})

    lifespan = _closing(client)

    return Starlette(routes=[Route("/items/{id}", item, methods=["POST"]), Route("/healthz", healthz)],
                     lifespan=lifespan)


def two_pings_app(url: str) -> Starlette:
    """The bare handler plus two Redis round trips: what "2 round trips" cost inside this server, this run."""
    import redis.asyncio as aioredis

    client = aioredis.Redis.from_url(url, max_connections=1000)

    async def item(request: Request) -> JSONResponse:
        await client.ping()
        await client.ping()
        return JSONResponse({"id": request.path_params["id"]})

    lifespan = _closing(client)

    return Starlette(routes=[Route("/items/{id}", item, methods=["POST"]), Route("/healthz", healthz)],
                     lifespan=lifespan)


def fastapi_locked_app(url: str):
    """`locked` as FastAPI users write it: a typed path parameter, the route's decorator above @locked."""
    from fastapi import FastAPI

    from otel_lock import LockManager, LockMiddleware, locked

    manager = LockManager.from_url(url, namespace="bench")

    lifespan = _closing(manager)

    app = FastAPI(lifespan=lifespan, openapi_url=None)

    @app.post("/items/{id}")
    @locked("item:{path.id}", wait=WAIT)
    async def item(id: int) -> dict:
        return {"id": id}

    app.add_api_route("/healthz", healthz)
    app.add_middleware(LockMiddleware, manager=manager)
    return app


def fastapi_redis_py_app(url: str):
    """`redis-py` in the same FastAPI app: the lock taken by hand in the handler."""
    import redis.asyncio as aioredis
    from fastapi import FastAPI

    client = aioredis.Redis.from_url(url, max_connections=1000)

    lifespan = _closing(client)

    app = FastAPI(lifespan=lifespan, openapi_url=None)

    @app.post("/items/{id}")
    async def item(id: int) -> dict:
        async with client.lock(f"bench:item:{id}", timeout=30, blocking_timeout=WAIT):
            return {"id": id}

    app.add_api_route("/healthz", healthz)
    return app


def fastapi_otel_lock_by_hand_app(url: str):
    """The `fastapi-redis-py` handler taking otel-lock's lock by hand: the lock alone, without the middleware."""
    from fastapi import FastAPI

    from otel_lock import LockManager

    manager = LockManager.from_url(url, namespace="bench")
    app = FastAPI(lifespan=_closing(manager), openapi_url=None)

    @app.post("/items/{id}")
    async def item(id: int) -> dict:
        async with manager.lock(f"item:{id}", wait=WAIT):
            return {"id": id}

    app.add_api_route("/healthz", healthz)
    return app


def fastapi_telemetry_app(url: str):
    """`fastapi-locked` with FastAPI's native telemetry and otel-lock's as BENCH_TELEMETRY says (see _otel_modes)."""
    from fastapi import FastAPI

    from otel_lock import LockManager, LockMiddleware, locked
    from otel_lock.telemetry import metrics_endpoint

    from ._otel_modes import fastapi_telemetry, install

    mode = os.environ.get("BENCH_TELEMETRY", "off")
    setup = install(mode)
    manager = LockManager.from_url(url, namespace="bench")
    app = FastAPI(lifespan=_closing(manager), openapi_url=None, telemetry=fastapi_telemetry(mode))

    @app.post("/items/{id}")
    @locked("item:{path.id}", wait=WAIT)
    async def item(id: int) -> dict:
        return {"id": id}

    app.add_api_route("/healthz", healthz)
    app.add_api_route("/metrics", metrics_endpoint)
    app.add_middleware(LockMiddleware, manager=manager)
    return setup.instrument_app(app) if mode.endswith("-app") else app


def demo_app(url: str):
    """The demo shop (POST /api/stock/{id}/deduct is its locked endpoint), telemetry as BENCH_TELEMETRY says."""
    from otel_lock.demo import DemoSettings, create_app

    from ._otel_modes import install

    setup = install(os.environ.get("BENCH_TELEMETRY", "off"))
    app = create_app(DemoSettings(redis_url=url, namespace="bench", replica_name="bench", job_interval=0))
    return setup.instrument_app(app) if setup is not None else app


VARIANTS = {
    "bare": bare_app,
    "demo": demo_app,
    "two-pings": two_pings_app,
    "locked": locked_app,
    "locked-via-redis-py": lambda url: locked_app(url, via_redis_py=True),
    "redis-py": redis_py_app,
    "fastapi-locked": fastapi_locked_app,
    "fastapi-redis-py": fastapi_redis_py_app,
    "fastapi-telemetry": fastapi_telemetry_app,
    "fastapi-otel-lock-by-hand": fastapi_otel_lock_by_hand_app,
}


def main() -> None:
    import uvicorn

    variant, port, url = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    app = VARIANTS[variant](url)
    profile = os.environ.get("BENCH_PROFILE")  # cProfile the server, dumped when uvicorn stops on SIGTERM
    profiler = cProfile.Profile() if profile else None
    if profiler:
        # uvicorn re-raises SIGTERM after its graceful shutdown; a no-op handler lets us dump first
        signal.signal(signal.SIGTERM, lambda *_: None)
        profiler.enable()
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False, loop="asyncio",
                http="h11", lifespan="on")
    if profiler:
        profiler.disable()
        profiler.dump_stats(profile)


if __name__ == "__main__":
    main()
