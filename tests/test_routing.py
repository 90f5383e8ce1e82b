"""Route matching before the router: Starlette routes, FastAPI (either decorator order), prefixes, mounts, rules."""

from __future__ import annotations

import functools

import pytest
from fastapi import APIRouter, FastAPI, Request
from starlette.applications import Starlette
from starlette.endpoints import HTTPEndpoint
from starlette.responses import JSONResponse
from starlette.routing import Mount, Route, Router

from otel_lock import LockMiddleware, idempotent, locked
from otel_lock.asgi._routing import RouteResolver

try:
    from ._middleware_helpers import client_for, lock_key, make_manager
except ImportError:
    from _middleware_helpers import client_for, lock_key, make_manager


def scope(method: str, path: str) -> dict:
    return {"type": "http", "method": method, "path": path, "root_path": "", "headers": [], "query_string": b""}


async def held_key(request):
    lock = getattr(request.state, "lock", None)
    return JSONResponse({"key": lock.key if lock else None})


@locked("item:{path.item_id}")
async def locked_item(request):
    return await held_key(request)


# -- the resolver on its own ---------------------------------------------------

def test_first_full_match_wins_and_partial_is_not_locked():
    other = locked("other:{path.x}")
    routes = [
        Route("/items/{item_id:int}", locked_item, methods=["POST"]),
        Route("/items/{x}", other(lambda r: None), methods=["POST"]),
    ]
    resolver = RouteResolver()
    match = resolver.resolve(scope("POST", "/items/7"), routes)
    assert match.route == "/items/{item_id:int}" and match.path_params == {"item_id": 7}
    assert match.locked.template.template == "item:{path.item_id}"
    assert resolver.resolve(scope("GET", "/items/7"), routes) is None  # 405 is the router's business
    assert resolver.resolve(scope("POST", "/nowhere"), routes) is None


def test_mount_and_nested_router_prefixes_compose_the_template():
    inner = Router(routes=[Route("/items/{item_id}", locked_item, methods=["POST"])])
    routes = [Mount("/api/{tenant}", routes=[Mount("/v1", app=inner)])]
    match = RouteResolver().resolve(scope("POST", "/api/acme/v1/items/9"), routes)
    assert match.route == "/api/{tenant}/v1/items/{item_id}"
    assert match.path_params == {"tenant": "acme", "item_id": "9"}


def test_a_mount_that_takes_the_request_is_the_only_candidate():
    # The router gives /a/... to the Mount even if nothing inside matches: so must we.
    routes = [Mount("/a", routes=[Route("/x", held_key)]), Route("/a/y", locked_item, methods=["GET"])]
    assert RouteResolver().resolve(scope("GET", "/a/y"), routes) is None


def test_http_endpoint_methods_are_annotated_one_by_one():
    class Items(HTTPEndpoint):
        @locked("items:{path.item_id}")
        async def post(self, request):
            return await held_key(request)

        async def get(self, request):
            return await held_key(request)

    routes = [Route("/items/{item_id}", Items)]
    resolver = RouteResolver()
    assert resolver.resolve(scope("POST", "/items/1"), routes).locked is not None
    assert resolver.resolve(scope("GET", "/items/1"), routes) is None


def test_functools_wraps_copies_are_found():
    def logged(fn):
        @functools.wraps(fn)
        async def wrapper(request):
            return await fn(request)
        return wrapper

    @logged
    @locked("a:{path.x}")
    async def under(request): ...

    @locked("b:{path.x}")
    async def inner(request): ...

    over = logged(inner)  # registered wrapper whose target carries the annotation
    for endpoint, name in ((under, "a:{path.x}"), (over, "b:{path.x}")):
        match = RouteResolver().resolve(scope("GET", "/1"), [Route("/{x}", endpoint)])
        assert match.locked.template.template == name


def test_annotating_a_wrapper_does_not_annotate_its_target():
    async def target(request): ...
    wrapper = functools.wraps(target)(lambda request: target(request))
    locked("w:{path.x}")(wrapper)
    assert RouteResolver().resolve(scope("GET", "/1"), [Route("/{x}", target)]) is None


def test_rules_match_route_templates_with_or_without_convertors():
    async def plain(request): ...
    routes = [Route("/stock/{pid:int}/deduct", plain, methods=["POST"])]
    resolver = RouteResolver({"POST /stock/{pid}/deduct": locked("stock:{path.pid}")})
    assert resolver.resolve(scope("POST", "/stock/3/deduct"), routes).locked is not None
    assert resolver.resolve(scope("PUT", "/stock/3/deduct"), routes) is None


def test_rules_override_decorators():
    rule = locked("rule:{path.item_id}")
    resolver = RouteResolver({"POST /items/{item_id}": rule})
    match = resolver.resolve(scope("POST", "/items/1"), [Route("/items/{item_id}", locked_item, methods=["POST"])])
    assert match.locked is rule


@pytest.mark.parametrize("rules, message", [
    ({"stock": locked("a")}, "must look like"),
    ({"POST /x": "not an annotation"}, "locked"),
    ({"POST /x": [locked("a"), locked("b")]}, "two locked"),
])
def test_bad_rules_are_rejected(rules, message):
    with pytest.raises(ValueError, match=message):
        RouteResolver(rules)


def test_duplicate_decorator_is_rejected():
    with pytest.raises(ValueError, match="already has a @locked"):
        @locked("a")
        @locked("b")
        async def twice(request): ...


# -- through the middleware --------------------------------------------------------

async def assert_locked(app, method: str, path: str, name: str | None, manager) -> None:
    async with client_for(app) as client:
        response = await client.request(method, path, headers={"x-user-id": "u1"})
    assert response.status_code == 200, response.text
    assert response.json()["key"] == (lock_key(name) if name else None)


async def test_plain_starlette_routes(redis_url):
    async with make_manager(redis_url) as manager:
        app = Starlette(routes=[Route("/items/{item_id}", locked_item, methods=["POST"]),
                                Route("/free", held_key)])
        app.add_middleware(LockMiddleware, manager=manager)
        await assert_locked(app, "POST", "/items/5", "item:5", manager)
        await assert_locked(app, "GET", "/free", None, manager)


async def test_mounted_sub_app_and_router_prefix(redis_url):
    async with make_manager(redis_url) as manager:
        sub = Starlette(routes=[Route("/items/{item_id}", locked_item, methods=["POST"])])
        app = Starlette(routes=[Mount("/shop", app=sub), Mount("/v2", routes=[Route("/items/{item_id}", locked_item,
                                                                                    methods=["POST"])])])
        app.add_middleware(LockMiddleware, manager=manager)
        await assert_locked(app, "POST", "/shop/items/1", "item:1", manager)
        await assert_locked(app, "POST", "/v2/items/2", "item:2", manager)


async def test_fastapi_routes_in_either_decorator_order_and_router_prefix(redis_url):
    async with make_manager(redis_url) as manager:
        app = FastAPI()
        router = APIRouter(prefix="/api/v1")

        @app.post("/below/{item_id}")
        @locked("below:{path.item_id}")
        async def below(item_id: int, request: Request):
            return {"key": request.state.lock.key}

        @locked("above:{path.item_id}")
        @app.post("/above/{item_id}")
        async def above(item_id: int, request: Request):
            return {"key": request.state.lock.key}

        @router.post("/users/orders")
        @locked("orders:{header.x-user-id}")
        async def orders(request: Request):
            return {"key": request.state.lock.key}

        nested = APIRouter(prefix="/nested/{shop}")

        @nested.put("/items/{item_id}")
        @locked("nested:{path.shop}:{path.item_id}")
        async def nested_item(shop: str, item_id: int, request: Request):
            return {"key": request.state.lock.key}

        router.include_router(nested)
        app.include_router(router)
        app.add_middleware(LockMiddleware, manager=manager)
        await assert_locked(app, "PUT", "/api/v1/nested/acme/items/3", "nested:acme:3", manager)
        await assert_locked(app, "POST", "/below/1", "below:1", manager)
        await assert_locked(app, "POST", "/above/2", "above:2", manager)
        await assert_locked(app, "POST", "/api/v1/users/orders", "orders:u1", manager)


async def test_rules_without_touching_handlers(redis_url):
    async with make_manager(redis_url) as manager:
        app = Starlette(routes=[Route("/stock/{pid}/deduct", held_key, methods=["POST"])])
        app.add_middleware(LockMiddleware, manager=manager, rules={"POST /stock/{pid}/deduct": locked("stock:{path.pid}")})
        await assert_locked(app, "POST", "/stock/77/deduct", "stock:77", manager)


async def test_rules_on_a_plain_asgi_app(redis_url):
    async def raw_app(scope, receive, send):
        lock = scope.get("state", {}).get("lock")
        body = ('{"key": "%s"}' % lock.key).encode() if lock else b'{"key": null}'
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": body})

    async with make_manager(redis_url) as manager:
        app = LockMiddleware(raw_app, manager=manager, rules={"POST /jobs/{job}": locked("job:{path.job}")})
        await assert_locked(app, "POST", "/jobs/nightly", "job:nightly", manager)
        await assert_locked(app, "GET", "/jobs/nightly", None, manager)


async def test_fastapi_openapi_shows_idempotency_key_header(redis_url):
    async with make_manager(redis_url) as manager:
        app = FastAPI()

        @app.post("/orders")
        @idempotent()
        async def orders():
            return {}

        @idempotent(required=False)
        @app.post("/payments")
        async def payments():
            return {}

        @app.post("/plain")
        async def plain():
            return {}

        router = APIRouter(prefix="/v1")

        @router.post("/refunds")
        @idempotent()
        async def refunds():
            return {}

        app.include_router(router)
        app.add_middleware(LockMiddleware, manager=manager)
        async with client_for(app) as client:
            schema = (await client.get("/openapi.json")).json()
            again = (await client.get("/openapi.json")).json()
    assert schema == again

    def header(path):
        params = schema["paths"][path]["post"].get("parameters", [])
        return [p for p in params if p["in"] == "header" and p["name"] == "Idempotency-Key"]

    assert len(header("/orders")) == 1 and header("/orders")[0]["required"] is True
    assert len(header("/payments")) == 1 and header("/payments")[0]["required"] is False
    assert header("/plain") == []
    assert len(header("/v1/refunds")) == 1


def test_annotating_an_http_endpoint_class_covers_every_method():
    @locked("items:{path.item_id}")
    class Items(HTTPEndpoint):
        async def get(self, request): ...

        async def put(self, request): ...

    routes = [Route("/items/{item_id}", Items)]
    for method in ("GET", "HEAD", "PUT"):
        assert RouteResolver().resolve(scope(method, "/items/1"), routes).locked is not None


def test_rules_do_not_lock_404_or_405_of_a_routed_app():
    async def plain(request): ...
    resolver = RouteResolver({"/x": locked("x"), "/nowhere": locked("n")})
    routes = [Route("/x", plain, methods=["GET"])]
    assert resolver.resolve(scope("GET", "/x"), routes) is not None
    assert resolver.resolve(scope("POST", "/x"), routes) is None
    assert resolver.resolve(scope("GET", "/nowhere"), routes) is None


def test_a_rule_for_no_route_is_reported(caplog):
    async def plain(request): ...
    RouteResolver({"POST /typo": locked("t")}).prepare_openapi([Route("/real", plain)])
    assert "matches no route" in caplog.text
