"""LockMiddleware in FastAPI apps written the usual way: typed keys, yield dependencies, routers, OpenAPI.

Regression tests; among them, a request's route is matched only once.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import threading
import time
from typing import Annotated, Callable

import pytest
import redis.asyncio as aioredis
from fastapi import APIRouter, Body, Depends, FastAPI, Header, HTTPException, Query, Request
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import BaseModel
from starlette.routing import Mount

from otel_lock import LockManager, LockMiddleware, idempotent, locked
from otel_lock.asgi.idempotency import KEY_PATTERN

try:
    from ._middleware_helpers import client_for, disconnecting_call, lock_key, make_manager, metered, problem, run_lifespan
except ImportError:
    from _middleware_helpers import client_for, disconnecting_call, lock_key, make_manager, metered, problem, run_lifespan


class Shelf:
    """A stock table whose read-modify-write is slow enough to oversell without a lock."""

    def __init__(self, **stock: int) -> None:
        self.stock = dict(stock)
        self.sold: list[str] = []

    async def buy(self, product: str, buyer: str) -> JSONResponse:
        left = self.stock.get(product, 0)
        await asyncio.sleep(0.02)  # the slow part of a real purchase (a payment call), not synchronisation
        if left <= 0:
            return JSONResponse({"sold": False}, status_code=409)
        self.stock[product] = left - 1
        self.sold.append(buyer)
        return JSONResponse({"sold": True})


class Order(BaseModel):
    product_id: int
    quantity: int = 1


class Item(BaseModel):
    code: str


class Session:
    """A unit of work: writes are pending until the dependency commits them."""

    def __init__(self) -> None:
        self.pending: dict[str, int] = {}
        self.held_as: bytes | None = None


def shop_app(manager, shelf: Shelf) -> FastAPI:
    app = FastAPI()

    @app.post("/stock/{product_id}/deduct")
    @locked("stock:{path.product_id}", wait=5)
    async def deduct(product_id: int, request: Request):
        return await shelf.buy(str(product_id), request.url.path)

    @app.post("/orders")
    @locked("stock:{json.product_id}", wait=5)
    async def order(body: Order, request: Request):
        return await shelf.buy(str(body.product_id), repr(await request.body()))

    app.add_middleware(LockMiddleware, manager=manager)
    return app


async def test_seven_spellings_of_one_path_int_are_one_lock_one_item_sold(redis_url):
    paths = ["7", "07", "007", "+7", "%207", "7%20", "7.0"]
    shelf = Shelf(**{"7": 1})
    async with make_manager(redis_url) as manager:
        async with client_for(shop_app(manager, shelf)) as client:
            answers = await asyncio.gather(*(client.post(f"/stock/{p}/deduct") for p in paths))
    assert sorted(r.status_code for r in answers) == [200] + [409] * 6, [r.text for r in answers]
    assert len(shelf.sold) == 1 and shelf.stock["7"] == 0


async def test_seven_spellings_of_one_json_int_are_one_lock_one_item_sold(redis_url):
    bodies = ['{"product_id": 7}', '{"product_id": 7.0}', '{"product_id": "07"}', '{"product_id": " 7"}',
              '{"product_id": "+7"}', '{"quantity": 1, "product_id": "007"}', '{"product_id": "7 "}']
    shelf = Shelf(**{"7": 1})
    async with make_manager(redis_url) as manager:
        async with client_for(shop_app(manager, shelf)) as client:
            answers = await asyncio.gather(*(client.post("/orders", content=b, headers={"content-type":
                                                                                       "application/json"})
                                             for b in bodies))
    assert sorted(r.status_code for r in answers) == [200] + [409] * 6, [r.text for r in answers]
    assert len(shelf.sold) == 1


async def test_keys_show_the_typed_value_and_str_fields_keep_their_text(redis_url):
    async with make_manager(redis_url) as manager:
        app = FastAPI()

        @app.post("/sku/{code}")
        @locked("sku:{path.code}:{query.qty}:{header.x-tenant}")
        async def by_code(code: str, qty: int, x_tenant: Annotated[int, Header()], request: Request):
            return {"key": request.state.lock.key}

        @app.post("/items")
        @locked("item:{json.code}")
        async def item(body: Item, request: Request):
            return {"key": request.state.lock.key}

        @app.post("/embedded")
        @locked("emb:{json.order.product_id}:{json.note}")
        async def embedded(order: Order, note: Annotated[str, Body()], request: Request):
            return {"key": request.state.lock.key}

        app.add_middleware(LockMiddleware, manager=manager)
        async with client_for(app) as client:
            a = await client.post("/sku/01", params={"qty": "05"}, headers={"x-tenant": "+3"})
            b = await client.post("/sku/1", params={"qty": "5.0"}, headers={"x-tenant": "3"})
            c = await client.post("/items", json={"code": "1"})
            d = await client.post("/embedded", json={"order": {"product_id": "09"}, "note": "n"})
    assert a.json()["key"] == lock_key("sku:01:5:3")
    assert b.json()["key"] == lock_key("sku:1:5:3")
    assert c.json()["key"] == lock_key("item:1")
    assert d.json()["key"] == lock_key("emb:9:n")


async def test_values_fastapi_rejects_get_its_own_422_and_take_no_lock(redis_url):
    calls = []
    provider, reader = metered()
    async with make_manager(redis_url, meter_provider=provider) as manager:
        app = FastAPI()

        @app.post("/stock/{product_id}/deduct")
        @locked("stock:{path.product_id}")
        async def deduct(product_id: int):
            calls.append(product_id)

        @app.post("/items")
        @locked("item:{json.code}")
        async def item(body: Item):
            calls.append(body)

        @app.post("/q")
        @locked("q:{query.n}")
        async def q(n: Annotated[int, Query(gt=0)]):
            calls.append(n)

        app.add_middleware(LockMiddleware, manager=manager)
        async with client_for(app) as client:
            answers = [
                await client.post("/stock/abc/deduct"),
                await client.post("/stock/7.5/deduct"),
                await client.post("/items", json={"code": 1}),       # 1 is not a str: no coercion
                await client.post("/items", content=b"{not json", headers={"content-type": "application/json"}),
                await client.post("/q", params={"n": "0"}),
                await client.post("/q"),
            ]
    for response in answers:
        assert response.status_code == 422, response.text
        assert response.headers["content-type"] == "application/json"   # FastAPI's own answer, not ours
        assert isinstance(response.json()["detail"], list)
    assert calls == []
    data = reader.get_metrics_data()
    waits = [m for rm in (data.resource_metrics if data else []) for sm in rm.scope_metrics for m in sm.metrics
             if m.name == "otel_lock.wait.duration"]
    assert waits == []   # not one acquire was attempted


@pytest.mark.parametrize("release_after", ["app", "response"])
async def test_yield_dependency_commit_runs_under_the_lock(redis_url, redis_client, release_after):
    """The session-per-request pattern: the commit in the dependency's exit code, after the response."""
    stock = {"p": 1}
    commits = []   # (the owner the handler held as, the owner in Redis while its commit ran)

    async def get_session(request: Request):
        session = Session()
        yield session
        commits.append((session.held_as, await redis_client.hget(lock_key("stock:p"), "owner")))
        await asyncio.sleep(0.02)  # a slow commit
        stock.update(session.pending)

    async with make_manager(redis_url) as manager:
        app = FastAPI()

        @app.post("/stock/{pid}/buy")
        @locked("stock:{path.pid}", wait=5, release_after=release_after)
        async def buy(pid: str, session: Session = Depends(get_session)):
            session.held_as = await redis_client.hget(lock_key("stock:p"), "owner")
            if stock[pid] <= 0:
                return JSONResponse({"sold": False}, status_code=409)
            session.pending[pid] = stock[pid] - 1
            return {"sold": True}

        app.add_middleware(LockMiddleware, manager=manager)
        async with client_for(app) as client:
            answers = await asyncio.gather(client.post("/stock/p/buy"), client.post("/stock/p/buy"))
    statuses = sorted(r.status_code for r in answers)
    assert len(commits) == 2 and all(held_as is not None for held_as, _ in commits)
    if release_after == "app":
        assert statuses == [200, 409] and stock["p"] == 0
        assert all(at_commit == held_as for held_as, at_commit in commits)
    else:
        # Documented: with release_after="response" the commit runs after the lock is let go
        # (free, or already the other request's).
        assert all(at_commit != held_as for held_as, at_commit in commits)


async def test_one_route_match_per_request(redis_url):
    """Like Starlette's test_instrumentation_uses_actual_route_match_once, through routers and mounts."""
    matches = []

    from fastapi.routing import APIRoute

    class CountingRoute(APIRoute):
        def matches(self, scope):
            match, child = super().matches(scope)
            matches.append((self.path, match.name))
            return match, child

    async with make_manager(redis_url) as manager:
        app = FastAPI()
        router = APIRouter(prefix="/api", route_class=CountingRoute)

        @router.post("/items/{item_id}")
        @locked("item:{path.item_id}")
        async def item(item_id: int, request: Request):
            return {"key": request.state.lock.key}

        @router.get("/free")
        async def free():
            return {}

        app.include_router(router)
        sub = FastAPI()
        sub.router.route_class = CountingRoute

        @sub.get("/free")
        async def sub_free():
            return {}

        @sub.post("/orders/{oid}")
        @locked("order:{path.oid}")
        async def order(oid: int, request: Request):
            return {"key": request.state.lock.key}

        app.router.routes.append(Mount("/shop", app=sub))
        app.add_middleware(LockMiddleware, manager=manager)
        counts = {}
        async with client_for(app) as client:
            for path, key in (("/api/items/3", "item:3"), ("/api/free", None), ("/shop/orders/4", "order:4"),
                              ("/shop/free", None)):
                matches.clear()
                response = await (client.post(path) if key else client.get(path))
                assert response.status_code == 200, response.text
                if key:
                    assert response.json()["key"] == lock_key(key)
                counts[path] = sum(1 for _, verdict in matches if verdict == "FULL")
    # The framework's own matching (FastAPI asks an included route more than once), nothing more:
    # a locked route costs the same matches as its unlocked neighbour.
    assert counts["/api/items/3"] == counts["/api/free"]
    assert counts["/shop/orders/4"] == counts["/shop/free"] == 1


async def test_rules_on_fastapi_included_routes(redis_url):
    async with make_manager(redis_url) as manager:
        app = FastAPI()
        router = APIRouter(prefix="/v1")

        @router.post("/stock/{pid}/deduct")
        async def deduct(pid: int, request: Request):
            return {"key": request.state.lock.key}

        app.include_router(router)
        app.add_middleware(LockMiddleware, manager=manager,
                           rules={"POST /v1/stock/{pid}/deduct": locked("stock:{path.pid}")})
        async with client_for(app) as client:
            response = await client.post("/v1/stock/08/deduct")
    assert response.json()["key"] == lock_key("stock:8")


async def test_a_router_included_in_two_apps_is_protected_in_each_by_its_own_middleware(redis_url):
    """FastAPI's include_router shares the router's APIRoute objects between the apps that include it (an
    app factory called twice): the app that started first ran them unprotected, so its `def` and
    @idempotent handlers answered 500 and its other handlers took the later app's lock manager."""
    router = APIRouter()

    @router.post("/sync/{pid}")
    @locked("sync:{path.pid}")
    def sync_handler(pid: int, request: Request):
        return {"key": request.state.lock.key}

    @router.post("/orders/{pid}")
    @idempotent()
    @locked("order:{path.pid}")
    async def order(pid: int, request: Request):
        return {"key": request.state.lock.key}

    def create_app(manager) -> FastAPI:
        app = FastAPI()
        app.include_router(router, prefix="/api")
        app.add_middleware(LockMiddleware, manager=manager, principal=lambda request: "ann")
        return app

    second_manager = LockManager.from_url(redis_url, namespace="other")
    async with make_manager(redis_url) as first_manager:
        first, second = create_app(first_manager), create_app(second_manager)
        try:
            async with client_for(first) as first_client, client_for(second) as second_client:
                await run_lifespan(first)
                await run_lifespan(second)   # prepared last
                answers = [await client.post(path, headers={"idempotency-key": '"k1"'})
                           for client in (first_client, second_client) for path in ("/api/sync/07", "/api/orders/7")]
        finally:
            await second_manager.aclose()
    assert [a.status_code for a in answers] == [200] * 4, [a.text for a in answers]
    assert [a.json()["key"] for a in answers] == [lock_key("sync:7"), lock_key("order:7"),
                                                  lock_key("sync:7", "other"), lock_key("order:7", "other")]


async def test_sync_handlers_and_dependencies_run_protected(redis_url):
    """FastAPI runs `def` handlers in a thread pool: the protection mark must follow them there."""
    async with make_manager(redis_url) as manager:
        app = FastAPI()

        @app.post("/sync/{pid}")
        @locked("sync:{path.pid}")
        def sync_handler(pid: int, request: Request):
            return {"key": request.state.lock.key}

        app.add_middleware(LockMiddleware, manager=manager)
        async with client_for(app) as client:
            response = await client.post("/sync/2")
    assert response.status_code == 200 and response.json()["key"] == lock_key("sync:2")


def _problem_statuses(operation: dict) -> set[str]:
    return {status for status, answer in operation["responses"].items()
            if "application/problem+json" in answer.get("content", {})}


async def test_openapi_is_right_at_start_up_before_any_request(redis_url):
    async with make_manager(redis_url) as manager:
        app = FastAPI()

        def caller(request):
            return request.headers.get("x-user-id")

        @app.post("/orders")
        @idempotent(principal=caller)
        @locked("orders:{json.product_id}")
        async def orders(body: Order):
            return {}

        @app.post("/declared")
        @idempotent(required=False, principal=caller)
        async def declared(key: Annotated[str | None, Header(alias="Idempotency-Key", max_length=255)] = None):
            return {}

        router = APIRouter(prefix="/v1")

        @router.post("/stock/{pid}")
        @locked("stock:{path.pid}")
        async def stock(pid: int):
            return {}

        app.include_router(router)
        app.add_middleware(LockMiddleware, manager=manager)
        early = app.openapi()          # someone asked before start-up: cached without us
        assert "parameters" not in early["paths"]["/orders"]["post"]
        messages = await run_lifespan(app)
        assert messages[0]["type"] == "lifespan.startup.complete", messages
        schema = app.openapi()

    def idempotency_headers(path):
        params = schema["paths"][path]["post"].get("parameters", [])
        return [p for p in params if p["in"] == "header" and p["name"].lower() == "idempotency-key"]

    orders_op = schema["paths"]["/orders"]["post"]
    assert [p["schema"]["pattern"] for p in idempotency_headers("/orders")] == [KEY_PATTERN]
    assert idempotency_headers("/orders")[0]["required"] is True
    assert len(idempotency_headers("/declared")) == 1      # the handler's own, not a second one
    assert _problem_statuses(orders_op) == {"400", "401", "408", "409", "413", "422", "429", "500", "503", "507"}
    assert "application/json" in orders_op["responses"]["422"]["content"]   # FastAPI's validation error stays
    stock_op = schema["paths"]["/v1/stock/{pid}"]["post"]
    assert {"400", "408", "409", "413", "503"} <= _problem_statuses(stock_op)
    assert idempotency_headers("/v1/stock/{pid}") == []


async def test_starlette_path_convertors_type_the_key(redis_url):
    from starlette.applications import Starlette
    from starlette.routing import Route

    shelf = Shelf(**{"7": 1})

    async def deduct(request):
        return await shelf.buy(str(request.path_params["pid"]), request.url.path)

    async with make_manager(redis_url) as manager:
        app = Starlette(routes=[Route("/stock/{pid:int}/deduct", locked("stock:{path.pid}", wait=5)(deduct),
                                      methods=["POST"])])
        app.add_middleware(LockMiddleware, manager=manager)
        async with client_for(app) as client:
            answers = await asyncio.gather(*(client.post(f"/stock/{p}/deduct") for p in ("7", "07", "007", "0007")))
    assert sorted(r.status_code for r in answers) == [200, 409, 409, 409]
    assert len(shelf.sold) == 1


# -- custom route classes ------------------------------------------


class HeadersRoute(APIRoute):
    """mealie's kind: adds response headers, never touches the request."""

    def get_route_handler(self) -> Callable:
        original = super().get_route_handler()

        async def handler(request: Request) -> Response:
            response = await original(request)
            response.headers["x-app"] = "recipes"
            return response

        return handler


class TimedRoute(APIRoute):
    """FastAPI's docs ("Custom Request and APIRoute class"): times the call."""

    def get_route_handler(self) -> Callable:
        original = super().get_route_handler()

        async def handler(request: Request) -> Response:
            before = time.perf_counter()
            response = await original(request)
            response.headers["x-response-time"] = str(time.perf_counter() - before)
            return response

        return handler


class GzipRequest(Request):
    async def body(self) -> bytes:
        if not hasattr(self, "_body"):
            body = await super().body()
            self._body = gzip.decompress(body) if "gzip" in self.headers.getlist("content-encoding") else body
        return self._body


class GzipRoute(APIRoute):
    """FastAPI's docs: the handler gets another body than the bytes on the wire."""

    def get_route_handler(self) -> Callable:
        original = super().get_route_handler()

        async def handler(request: Request) -> Response:
            return await original(GzipRequest(request.scope, request.receive))

        return handler


class Recipe(BaseModel):
    name: str


def recipe_app(manager, route_class: type[APIRoute], sync: bool, entered: threading.Event,
               go: threading.Event, keys: list[str]) -> FastAPI:
    app = FastAPI()
    router = APIRouter(route_class=route_class)
    if sync:
        @router.post("/recipes", status_code=201)
        @locked("recipe-create:{json.name}", wait=0)
        def create(recipe: Recipe, request: Request):
            keys.append(request.state.lock.key)
            entered.set()
            assert go.wait(10)
            return {"name": recipe.name}
    else:
        @router.post("/recipes", status_code=201)
        @locked("recipe-create:{json.name}", wait=0)
        async def create(recipe: Recipe, request: Request):   # type: ignore[misc]
            keys.append(request.state.lock.key)
            entered.set()
            assert await asyncio.to_thread(go.wait, 10)
            return {"name": recipe.name}
    app.include_router(router)
    app.add_middleware(LockMiddleware, manager=manager)
    return app


def recipe_body(route_class: type[APIRoute], name: str) -> dict:
    raw = json.dumps({"name": name}).encode()
    if route_class is GzipRoute:
        return {"content": gzip.compress(raw), "headers": {"content-type": "application/json",
                                                           "content-encoding": "gzip"}}
    return {"content": raw, "headers": {"content-type": "application/json"}}


@pytest.mark.parametrize("sync", [False, True], ids=["async_def", "def"])
@pytest.mark.parametrize("route_class", [HeadersRoute, TimedRoute, GzipRoute])
async def test_custom_route_classes_are_locked_with_async_and_sync_handlers(redis_url, route_class, sync):
    entered, go, keys = threading.Event(), threading.Event(), []
    async with make_manager(redis_url) as manager:
        app = recipe_app(manager, route_class, sync, entered, go, keys)
        assert (await run_lifespan(app))[0]["type"] == "lifespan.startup.complete"
        async with client_for(app) as client:
            first = asyncio.create_task(client.post("/recipes", **recipe_body(route_class, "soup")))
            assert await asyncio.to_thread(entered.wait, 10)
            second = await client.post("/recipes", **recipe_body(route_class, "soup"))
            go.set()
            first_answer = await first
            after = await client.post("/recipes", **recipe_body(route_class, "soup"))
    assert first_answer.status_code == 201, first_answer.text
    assert second.status_code == 409 and problem(second)["type"] == "lock-timeout", second.text
    assert after.status_code == 201, after.text
    assert keys == [lock_key("recipe-create:soup")] * 2
    if route_class is HeadersRoute:
        assert first_answer.headers["x-app"] == "recipes"
    if route_class is TimedRoute:
        assert float(first_answer.headers["x-response-time"]) >= 0


async def test_a_headers_only_route_class_takes_the_lock_before_the_app_so_yield_exits_run_under_it(redis_url):
    held_at_exit: list[bool] = []

    async with make_manager(redis_url) as manager:
        async def unit_of_work(request: Request):
            yield
            # another task: the request's own would re-enter its hold
            held_at_exit.append(await asyncio.create_task(manager.try_lock("recipe-create:soup")) is None)

        app = FastAPI()
        router = APIRouter(route_class=HeadersRoute)

        @router.post("/recipes", status_code=201, dependencies=[Depends(unit_of_work)])
        @locked("recipe-create:{json.name}", wait=0)
        def create(recipe: Recipe):
            return {"name": recipe.name}

        app.include_router(router)
        app.add_middleware(LockMiddleware, manager=manager)
        async with client_for(app) as client:
            answer = await client.post("/recipes", json={"name": "soup"})
    assert answer.status_code == 201 and answer.headers["x-app"] == "recipes", answer.text
    assert held_at_exit == [True]


@pytest.mark.parametrize("sync", [False, True], ids=["async_def", "def"])
async def test_a_misconfigured_redis_is_the_same_problem_when_the_lock_is_taken_at_the_handlers_call(sync):
    from otel_lock.cli._redis_server import RedisServer

    with RedisServer() as server:
        admin = aioredis.Redis.from_url(server.url)
        await admin.config_set("requirepass", "s3cret")
        await admin.aclose()
        async with make_manager(server.url) as manager:
            app = recipe_app(manager, GzipRoute, sync, threading.Event(), threading.Event(), [])
            async with client_for(app) as client:
                answer = await client.post("/recipes", **recipe_body(GzipRoute, "soup"))
    assert answer.status_code == 500, answer.text
    body = problem(answer)
    assert body["type"] == "redis-misconfigured" and "password" in body["detail"] and "s3cret" not in answer.text


# -- the lock after the caller is known ---------------------------------


class Store:
    """One shop's stock and what its requests saw, shared by two replicas (two apps on one Redis)."""

    def __init__(self) -> None:
        self.stock = {1: 1}
        self.anonymous_in_auth = asyncio.Event()
        self.reject_anonymous = asyncio.Event()
        self.read_under: list[str | None] = []     # the lock held when the item was read
        self.exits_held: list[bool] = []           # the lock held at the yield dependency's exit


def store_app(manager, store: Store, after_auth: bool | None = None, wait: float = 0) -> FastAPI:
    bearer = HTTPBearer(auto_error=False)

    async def current_user(credentials: HTTPAuthorizationCredentials | None = Depends(bearer)) -> str:
        if credentials is None:
            store.anonymous_in_auth.set()
            await store.reject_anonymous.wait()   # a slow token check
            raise HTTPException(401, "sign in")
        return credentials.credentials

    async def get_item_or_404(item_id: int, request: Request) -> int:
        if item_id not in store.stock:
            raise HTTPException(404)
        lock = getattr(request.state, "lock", None)
        store.read_under.append(None if lock is None else lock.key)
        return store.stock[item_id]

    async def unit_of_work(item_id: int):
        yield
        # another task: the request's own would re-enter its hold
        store.exits_held.append(await asyncio.create_task(manager.try_lock(f"item:{item_id}")) is None)

    app = FastAPI()

    @app.post("/items/{item_id}/buy", dependencies=[Depends(unit_of_work)])
    @locked("item:{path.item_id}", wait=wait, after_auth=after_auth)
    async def buy(item_id: int, left: int = Depends(get_item_or_404), user: str = Depends(current_user)):
        if left <= 0:
            return JSONResponse({"sold": False}, status_code=409)
        await asyncio.sleep(0)   # a real purchase awaits something between the read and the write
        store.stock[item_id] = left - 1
        return {"sold": True, "to": user}

    app.add_middleware(LockMiddleware, manager=manager)
    return app


SIGNED_IN = {"authorization": "Bearer alice"}


async def test_a_request_authentication_rejects_neither_waits_for_nor_holds_the_business_lock(redis_url):
    store = Store()
    async with make_manager(redis_url) as one, make_manager(redis_url) as two:
        async with client_for(store_app(one, store)) as replica_1, client_for(store_app(two, store)) as replica_2:
            anonymous = asyncio.create_task(replica_1.post("/items/1/buy"))
            await asyncio.wait_for(store.anonymous_in_auth.wait(), 10)   # its token is being checked now
            bought = await replica_2.post("/items/1/buy", headers=SIGNED_IN)   # wait=0: a held lock is 409
            store.reject_anonymous.set()
            rejected = await anonymous
    assert bought.status_code == 200 and bought.json() == {"sold": True, "to": "alice"}, bought.text
    assert rejected.status_code == 401
    # The item was read under its lock, and the yield dependency's exit ran under it too.
    assert store.read_under == [lock_key("item:1")] and store.exits_held == [True]


async def test_a_dependency_that_reads_the_resource_runs_under_the_lock_across_replicas(redis_url):
    store = Store()
    async with make_manager(redis_url) as one, make_manager(redis_url) as two:
        async with client_for(store_app(one, store)) as replica_1, client_for(store_app(two, store)) as replica_2:
            answers = [await replica_1.post("/items/1/buy", headers=SIGNED_IN),
                       await replica_2.post("/items/1/buy", headers=SIGNED_IN)]
            concurrent = await asyncio.gather(*(r.post("/items/1/buy", headers=SIGNED_IN)
                                                for r in (replica_1, replica_2)))
    assert [a.status_code for a in answers] == [200, 409] and store.stock[1] == 0
    assert sorted(a.status_code for a in concurrent) == [409, 409]
    assert all(key == lock_key("item:1") for key in store.read_under) and len(store.read_under) >= 2


async def test_after_auth_false_keeps_the_lock_in_front_of_every_dependency(redis_url):
    store = Store()
    async with make_manager(redis_url) as one, make_manager(redis_url) as two:
        async with client_for(store_app(one, store, after_auth=False)) as replica_1, \
                client_for(store_app(two, store, after_auth=False)) as replica_2:
            anonymous = asyncio.create_task(replica_1.post("/items/1/buy"))
            await asyncio.wait_for(store.anonymous_in_auth.wait(), 10)   # it holds the lock meanwhile
            refused = await replica_2.post("/items/1/buy", headers=SIGNED_IN)
            store.reject_anonymous.set()
            rejected = await anonymous
    assert refused.status_code == 409 and problem(refused)["type"] == "lock-timeout"
    assert rejected.status_code == 401 and store.stock[1] == 1


async def test_after_auth_true_on_a_route_without_authentication_fails_the_start_up(redis_url):
    async with make_manager(redis_url) as manager:
        app = FastAPI()

        @app.post("/items/{item_id}/buy")
        @locked("item:{path.item_id}", after_auth=True)
        async def buy(item_id: int):
            return {}

        app.add_middleware(LockMiddleware, manager=manager)
        messages = await run_lifespan(app)
    assert messages[0]["type"] == "lifespan.startup.failed"
    assert "after_auth=True" in messages[0]["message"] and "/items/{item_id}/buy" in messages[0]["message"]


async def test_a_handler_whose_lock_dependency_was_overridden_refuses_to_run_unlocked(redis_url):
    from otel_lock.asgi._after_auth import otel_lock_route_lock

    store = Store()
    async with make_manager(redis_url) as manager:
        app = store_app(manager, store)
        app.dependency_overrides[otel_lock_route_lock] = lambda: None
        async with client_for(app) as client:
            answer = await client.post("/items/1/buy", headers=SIGNED_IN)
    assert answer.status_code == 500 and problem(answer)["type"] == "lock-not-taken"
    assert store.stock[1] == 1


async def test_a_client_that_hangs_up_while_its_lock_is_awaited_after_authentication_leaves_nothing(redis_url):
    store = Store()
    gone = asyncio.Event()
    gone.set()   # the server's next message after the body is the disconnect
    async with make_manager(redis_url) as manager:
        app = store_app(manager, store, wait=30)
        free = await asyncio.wait_for(disconnecting_call(app, "/items/1/buy", asyncio.Event(), method="POST",
                                                         headers=[(b"authorization", b"Bearer alice")]), 10)
        store.stock[1] = 1
        store.read_under.clear()
        async with make_manager(redis_url) as other, other.lock("item:1"):   # another replica holds the item
            sent = await asyncio.wait_for(disconnecting_call(app, "/items/1/buy", gone, method="POST",
                                                             headers=[(b"authorization", b"Bearer alice")]), 10)
    assert free[0]["status"] == 200                       # the same call, the lock free: it runs
    assert sent == [] and store.stock[1] == 1 and store.read_under == []


@locked("item:{path.item_id}")
async def _module_level_buy(item_id: int) -> dict:
    return {"item": item_id}


async def test_a_dropped_app_and_its_manager_are_collected_though_its_handler_lives_on(redis_url):
    """Regression: a guarded handler (module-level, and kept by FastAPI's caches) held its middleware
    strongly, so every app's manager, connections and telemetry series outlived the app."""
    import gc
    import weakref

    async def serve_once() -> weakref.ref:
        async with make_manager(redis_url) as manager:
            app = FastAPI()
            app.post("/buy/{item_id}")(_module_level_buy)
            app.add_middleware(LockMiddleware, manager=manager)
            async with client_for(app) as client:
                assert (await client.post("/buy/7")).json() == {"item": 7}
            return weakref.ref(manager)

    gone = await asyncio.create_task(serve_once())   # its own context, as a server's request task
    gc.collect()
    assert gone() is None
    with pytest.raises(Exception):   # the handler outlives its app: called directly, it finds no manager
        await _module_level_buy(item_id=7)
