"""The manager the app's lifespan owns: a factory, app.state.locks, the lifespan state; none is a clear error.

`LockMiddleware` takes the manager lazily, so the documented
pattern creates it on the serving loop and closes it at shutdown.
"""

from __future__ import annotations

import asyncio
import threading
from contextlib import asynccontextmanager

import pytest
from fastapi import FastAPI, Request
from fastapi.testclient import TestClient
from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route

from otel_lock import LockManager, LockMiddleware, locked

try:
    from ._middleware_helpers import NAMESPACE, client_for, problem, run_lifespan
except ImportError:
    from _middleware_helpers import NAMESPACE, client_for, problem, run_lifespan


def locked_app(**middleware) -> FastAPI:
    app = FastAPI(lifespan=middleware.pop("lifespan", None))

    @app.post("/stock/{pid}")
    @locked("stock:{path.pid}")
    async def deduct(pid: int, request: Request):
        return {"owner": request.state.lock.owner, "thread": threading.get_ident()}

    app.add_middleware(LockMiddleware, **middleware)
    return app


def test_a_factory_is_called_once_on_the_serving_loop(redis_url):
    made = []

    def factory():
        made.append((asyncio.get_running_loop(), threading.get_ident()))
        return LockManager.from_url(redis_url, namespace=NAMESPACE)

    app = locked_app(manager=factory)
    assert made == []   # nothing at import time
    with TestClient(app) as client:
        owners = {client.post("/stock/1").json()["owner"] for _ in range(3)}
        serving_thread = client.post("/stock/1").json()["thread"]
    assert len(made) == 1 and made[0][1] == serving_thread   # the test client's own loop thread, not ours
    assert len({o.rsplit(":", 1)[0] for o in owners}) == 1   # one manager: one owner prefix


def test_app_state_locks_from_the_lifespan_is_used_and_each_lifespan_gets_its_own(redis_url):
    closed = []

    @asynccontextmanager
    async def lifespan(app):
        app.state.locks = LockManager.from_url(redis_url, namespace=NAMESPACE)
        yield
        await app.state.locks.aclose()
        closed.append(app.state.locks)

    app = locked_app(lifespan=lifespan)
    prefixes = []
    for _ in range(2):   # two `with TestClient(app)` blocks, as a test module does
        with TestClient(app) as client:
            response = client.post("/stock/1")
            assert response.status_code == 200, response.text
            prefixes.append(response.json()["owner"].rsplit(":", 1)[0])
    assert len(closed) == 2 and prefixes[0] != prefixes[1]   # the second block did not use the closed manager


def test_the_lifespan_state_locks_is_used(redis_url):
    @asynccontextmanager
    async def lifespan(app):
        manager = LockManager.from_url(redis_url, namespace=NAMESPACE)
        yield {"locks": manager}
        await manager.aclose()

    async def handler(request):
        return JSONResponse({"key": request.state.lock.key})

    app = Starlette(routes=[Route("/x", locked("x")(handler), methods=["POST"])], lifespan=lifespan)
    app.add_middleware(LockMiddleware)
    with TestClient(app) as client:
        assert client.post("/x").json() == {"key": f"{NAMESPACE}:{{x}}"}


async def test_no_manager_without_lifespan_is_a_500_naming_the_settings_never_a_hang(redis_url, redis_client):
    app = locked_app()
    async with client_for(app) as client:
        response = await asyncio.wait_for(client.post("/stock/1"), 10)
        unprotected = await client.get("/docs")
    assert response.status_code == 500
    body = problem(response)
    assert body["type"] == "lock-manager-missing" and "app.state.locks" in body["detail"]
    assert unprotected.status_code == 200   # routes without annotations still work
    assert await redis_client.keys("*") == []


async def test_a_factory_that_returns_no_manager_fails_the_start_up():
    messages = await run_lifespan(locked_app(manager=lambda: "redis://127.0.0.1:6379/0"))
    assert messages[0]["type"] == "lifespan.startup.failed"
    assert "the factory returned 'redis://127.0.0.1:6379/0', not a lock manager" in messages[0]["message"]


@pytest.mark.parametrize("manager", ["redis://127.0.0.1:6379/0", 42, object()])
def test_something_else_than_a_manager_or_a_factory_is_refused_at_once(manager):
    with pytest.raises(TypeError, match="takes a lock manager"):
        LockMiddleware(Starlette(), manager=manager)
