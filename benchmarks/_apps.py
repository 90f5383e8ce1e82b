"""The endpoint under test, in the variants the middleware benchmark compares, served by uvicorn.

    python -m benchmarks._apps VARIANT PORT REDIS_URL

bare      POST /items/{id} answers {"id": ...}: no lock, no middleware
locked    the same handler with @locked("item:{path.id}") behind LockMiddleware
redis-py  the same handler taking redis-py's asyncio Lock by hand
"""

from __future__ import annotations

import sys
from contextlib import asynccontextmanager

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse
from starlette.routing import Route

WAIT = 10.0


async def healthz(request: Request) -> PlainTextResponse:
    return PlainTextResponse("ok")


def bare_app(url: str) -> Starlette:
    async def item(request: Request) -> JSONResponse:
        return JSONResponse({"id": request.path_params["id"]})

    return Starlette(routes=[Route("/items/{id}", item, methods=["POST"]), Route("/healthz", healthz)])


def locked_app(url: str, **manager_options) -> Starlette:
    from otel_lock import LockManager, LockMiddleware, locked

    manager = LockManager.from_url(url, namespace="bench", **manager_options)

    @locked("item:{path.id}", wait=WAIT)
    async def item(request: Request) -> JSONResponse:
        return JSONResponse({"id": request.path_params["id"]})

    @asynccontextmanager
    async def lifespan(app):
        yield
        await manager.aclose()

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

    @asynccontextmanager
    async def lifespan(app):
        yield
        await client.aclose()

    return Starlette(routes=[Route("/items/{id}", item, methods=["POST"]), Route("/healthz", healthz)],
                     lifespan=lifespan)


VARIANTS = {"bare": bare_app, "locked": locked_app, "redis-py": redis_py_app}


def main() -> None:
    import uvicorn

    variant, port, url = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    app = VARIANTS[variant](url)
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False, loop="asyncio",
                http="h11", lifespan="on")


if __name__ == "__main__":
    main()
