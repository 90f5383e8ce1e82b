"""Protection follows the handler wherever it is called from; the decorator order that left a route bare.

Regression tests: a guarded handler called directly from another locked
handler ran without its own lock (3 deductions at once), and `@locked`
written above `@app.post` without the middleware ran silently unprotected.
"""

from __future__ import annotations

import asyncio
import logging

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.applications import Starlette
from starlette.routing import Route

from otel_lock import LockMiddleware, LockTimeout, idempotent, locked
from otel_lock.asgi._guard import DirectCallRefused

try:
    from ._middleware_helpers import client_for, lock_key, make_manager, metered, problem, run_lifespan, until, waiting
except ImportError:
    from _middleware_helpers import client_for, lock_key, make_manager, metered, problem, run_lifespan, until, waiting


class Stock:
    """A read-modify-write that oversells when two run at once; counts how many ran at once."""

    def __init__(self, left: int) -> None:
        self.left = left
        self.inside = 0
        self.most_inside = 0
        self.sold = 0

    async def deduct(self) -> bool:
        self.inside += 1
        self.most_inside = max(self.most_inside, self.inside)
        try:
            left = self.left
            await asyncio.sleep(0.02)   # the slow part of a purchase
            if left <= 0:
                return False
            self.left = left - 1
            self.sold += 1
            return True
        finally:
            self.inside -= 1


def shop(manager, stock: Stock) -> FastAPI:
    app = FastAPI()

    @app.post("/stock/{product_id}/deduct")
    @locked("stock:{path.product_id}", wait=5)
    async def deduct(product_id: int):
        ok = await stock.deduct()
        return JSONResponse({"sold": ok}, status_code=200 if ok else 409)

    @app.post("/orders/{order_id}")
    @locked("order:{path.order_id}", wait=5)
    async def order(order_id: int, request: Request):
        # A locked handler calling another guarded handler directly, as refactored code does.
        return await deduct(product_id=7)

    @app.post("/bulk")
    async def bulk(request: Request):
        return await deduct(7)   # an unlocked route, a positional argument

    app.state.deduct = deduct
    app.add_middleware(LockMiddleware, manager=manager)
    return app


async def test_a_guarded_handler_called_from_other_handlers_is_held_under_its_own_lock(redis_url):
    stock = Stock(left=2)
    async with make_manager(redis_url) as manager:
        app = shop(manager, stock)
        async with client_for(app) as client:
            calls = [client.post(f"/orders/{n}") for n in range(4)]
            calls += [client.post("/bulk"), client.post("/bulk"), client.post("/stock/7/deduct")]
            answers = await asyncio.gather(*calls)
    assert stock.most_inside == 1                  # never two deductions at once
    assert stock.sold == 2 and stock.left == 0
    assert sorted(r.status_code for r in answers) == [200, 200, 409, 409, 409, 409, 409], [r.text for r in answers]


async def test_a_direct_call_from_plain_code_waits_for_the_lock_like_any_caller(redis_url):
    stock = Stock(left=1)
    provider, reader = metered()
    async with make_manager(redis_url, meter_provider=provider) as manager, make_manager(redis_url) as other:
        app = shop(manager, stock)
        assert (await run_lifespan(app))[0]["type"] == "lifespan.startup.complete"
        deduct = app.state.deduct
        held = await other.try_lock("stock:7")
        call = asyncio.ensure_future(deduct(product_id=7))
        await until(lambda: waiting(reader, "stock:{path.product_id}") == 1, "the direct call to wait")
        assert not call.done() and stock.sold == 0
        await held.release()
        response = await asyncio.wait_for(call, 10)
    assert response.status_code == 200 and stock.sold == 1


async def test_a_direct_call_past_its_wait_raises_lock_timeout(redis_url):
    async with make_manager(redis_url) as manager, make_manager(redis_url) as other:
        app = FastAPI()

        @app.post("/p/{pid}")
        @locked("p:{path.pid}", wait=0.2)
        async def handler(pid: int):
            return {"ran": pid}

        app.add_middleware(LockMiddleware, manager=manager)
        await run_lifespan(app)
        held = await other.try_lock("p:1")
        with pytest.raises(LockTimeout):
            await handler(1)
        await held.release()
        assert await handler(1) == {"ran": 1}


async def test_a_handler_calling_itself_re_enters_its_lock(redis_url):
    depths = []
    async with make_manager(redis_url) as manager:
        app = FastAPI()

        @app.post("/p/{pid}")
        @locked("p:{path.pid}")
        async def handler(pid: int, request: Request, again: bool = True):
            depths.append(request.state.lock.depth)
            if again:
                await handler(pid, request, again=False)
            return {}

        app.add_middleware(LockMiddleware, manager=manager)
        async with client_for(app) as client:
            assert (await client.post("/p/1")).status_code == 200
    assert depths == [1, 1]   # request.state.lock is the route's hold; the nested call held depth 2 inside it


async def test_direct_calls_that_cannot_be_held_are_refused_naming_why(redis_url):
    async with make_manager(redis_url) as manager:
        app = FastAPI()

        @app.post("/sync/{pid}")
        @locked("p:{path.pid}")
        def sync_handler(pid: int):
            return {}

        @app.post("/header")
        @locked("u:{header.x-user-id}")
        async def by_header():
            return {}

        @app.post("/idem")
        @idempotent(shared_scope=True)
        async def idem():
            return {}

        app.add_middleware(LockMiddleware, manager=manager)
        await run_lifespan(app)
        with pytest.raises(DirectCallRefused, match="async def"):
            sync_handler(1)
        with pytest.raises(DirectCallRefused, match=r"\{header.x-user-id\} is not among the handler's own parameters"):
            await by_header()
        with pytest.raises(DirectCallRefused, match="Idempotency-Keys belong to HTTP requests"):
            await idem()


async def test_a_starlette_handler_called_directly_takes_the_key_from_its_request(redis_url):
    keys = []

    @locked("item:{path.item_id}")
    async def item(request):
        keys.append(request.state.lock.key if "lock" in request.state._state else None)
        return JSONResponse({})

    async def outer(request):
        return await item(request)   # passes its own request on: path_params of /outer/{item_id}

    provider, reader = metered()
    async with make_manager(redis_url, meter_provider=provider) as manager, make_manager(redis_url) as other:
        app = Starlette(routes=[Route("/items/{item_id}", item, methods=["POST"]),
                                Route("/outer/{item_id}", outer, methods=["POST"])])
        app.add_middleware(LockMiddleware, manager=manager)
        async with client_for(app) as client:
            held = await other.try_lock("item:5")
            call = asyncio.ensure_future(client.post("/outer/5"))
            await until(lambda: waiting(reader, "item:{path.item_id}") == 1, "the direct call to wait")
            assert not call.done()
            await held.release()
            assert (await call).status_code == 200
    assert keys == [None]   # the direct call does not pose as the route: request.state.lock stays unset


def test_locked_above_the_route_decorator_fails_closed_and_says_the_fix(caplog):
    ran = []
    caplog.set_level(logging.WARNING, "otel_lock")
    app = FastAPI()

    @locked("stock:{path.pid}")
    @app.post("/stock/{pid}")
    async def deduct(pid: int):
        ran.append(pid)

    assert "put @locked right below the route decorator" in caplog.text
    from fastapi.testclient import TestClient

    with TestClient(app) as client:
        response = client.post("/stock/1")
    assert response.status_code == 500 and ran == []
    body = problem(response)
    assert body["type"] == "lock-middleware-missing"
    assert "right below @app.<method>" in body["detail"] and "LockMiddleware" in body["detail"]


async def test_locked_above_the_route_decorator_still_works_with_the_middleware(redis_url):
    async with make_manager(redis_url) as manager:
        app = FastAPI()

        @idempotent(shared_scope=True)
        @locked("stock:{path.pid}")
        @app.post("/stock/{pid}")
        async def deduct(pid: int, request: Request):
            return {"key": request.state.lock.key}

        app.add_middleware(LockMiddleware, manager=manager)
        async with client_for(app) as client:
            response = await client.post("/stock/07", headers={"idempotency-key": '"k1"'})
    assert response.status_code == 200 and response.json() == {"key": lock_key("stock:7")}


def test_locked_above_an_included_routers_decorator_fails_closed_too():
    from fastapi import APIRouter
    from fastapi.testclient import TestClient

    ran = []
    router = APIRouter(prefix="/shop")

    @locked("stock:{path.pid}")
    @router.post("/stock/{pid}")
    async def deduct(pid: int):
        ran.append(pid)

    app = FastAPI()
    app.include_router(router, prefix="/api")
    with TestClient(app) as client:
        response = client.post("/api/shop/stock/1")
    assert response.status_code == 500 and ran == []
    assert problem(response)["type"] == "lock-middleware-missing"
