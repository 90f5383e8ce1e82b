"""Which routes get protected: Starlette routes, FastAPI (either decorator order), prefixes, mounts, rules."""

from __future__ import annotations

import functools

import pytest
from fastapi import APIRouter, FastAPI, Request
from starlette.applications import Starlette
from starlette.endpoints import HTTPEndpoint
from starlette.responses import JSONResponse
from starlette.routing import Mount, Route, Router

from otel_lock import LockMiddleware, idempotent, limited, locked
from otel_lock.asgi._routing import parse_rules, plan

try:
    from ._middleware_helpers import client_for, lock_key, make_manager
except ImportError:
    from _middleware_helpers import client_for, lock_key, make_manager


def planned(routes, rules=None):
    """{(template, method): annotations} of what the middleware would protect, and the problems found."""
    plans, problems = plan(routes, parse_rules(rules))
    return {(p.template, m): a for p in plans for m, a in p.methods.items()}, problems


async def held_key(request):
    lock = getattr(request.state, "lock", None)
    return JSONResponse({"key": lock.key if lock else None})


@locked("item:{path.item_id}")
async def locked_item(request):
    return await held_key(request)


# -- the plan made at start-up ---------------------------------------------------

def test_every_annotated_route_is_planned_with_its_template():
    other = locked("other:{path.x}")
    routes = [
        Route("/items/{item_id:int}", locked_item, methods=["POST"]),
        Route("/items/{x}", other(lambda r: None), methods=["POST"]),
        Route("/free", held_key),
    ]
    found, problems = planned(routes)
    assert found[("/items/{item_id:int}", "POST")].locked.template.template == "item:{path.item_id}"
    assert found[("/items/{x}", "POST")].locked is other
    assert ("/items/{item_id:int}", "GET") not in found  # a 405 is the router's business
    assert not any(template == "/free" for template, _ in found) and problems == []


def test_mount_and_nested_router_prefixes_compose_the_template():
    inner = Router(routes=[Route("/items/{item_id}", locked_item, methods=["POST"])])
    found, problems = planned([Mount("/api/{tenant}", routes=[Mount("/v1", app=inner)])])
    assert list(found) == [("/api/{tenant}/v1/items/{item_id}", "POST")] and problems == []


def test_http_endpoint_methods_are_annotated_one_by_one():
    class Items(HTTPEndpoint):
        @locked("items:{path.item_id}")
        async def post(self, request):
            return await held_key(request)

        async def get(self, request):
            return await held_key(request)

    found, _ = planned([Route("/items/{item_id}", Items)])
    assert ("/items/{item_id}", "POST") in found and ("/items/{item_id}", "GET") not in found


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
        found, _ = planned([Route("/{x}", endpoint)])
        assert found[("/{x}", "GET")].locked.template.template == name


def test_annotating_a_wrapper_does_not_annotate_its_target():
    async def target(request): ...
    wrapper = functools.wraps(target)(lambda request: target(request))
    locked("w:{path.x}")(wrapper)
    assert planned([Route("/{x}", target)]) == ({}, [])


def test_rules_match_route_templates_with_or_without_convertors():
    async def plain(request): ...
    routes = [Route("/stock/{pid:int}/deduct", plain, methods=["POST"])]
    found, problems = planned(routes, {"POST /stock/{pid}/deduct": locked("stock:{path.pid}")})
    assert found[("/stock/{pid:int}/deduct", "POST")].locked is not None and problems == []
    assert ("/stock/{pid:int}/deduct", "PUT") not in found


def test_rules_override_decorators():
    rule = locked("rule:{path.item_id}")
    found, _ = planned([Route("/items/{item_id}", locked_item, methods=["POST"])], {"POST /items/{item_id}": rule})
    assert found[("/items/{item_id}", "POST")].locked is rule


@pytest.mark.parametrize("rules, message", [
    ({"stock": locked("a")}, "must look like"),
    ({"POST /x": "not an annotation"}, "locked"),
    ({"POST /x": [locked("a"), locked("b")]}, "two locked"),
])
def test_bad_rules_are_rejected(rules, message):
    with pytest.raises(ValueError, match=message):
        parse_rules(rules)


@pytest.mark.parametrize("options, message", [
    (dict(lease=float("inf")), "lease must be at most 9007199254740 s"),
    (dict(lease=1e16), "lease must be at most 9007199254740 s"),
    (dict(lease=0.001), "lease must be at least 0.01 s"),
    (dict(retry_after=float("inf")), "retry_after must be at most 1000000000 s"),
    (dict(retry_after=1e300), "retry_after must be at most"),
    (dict(name="stock\udcff"), "surrogates not allowed"),
    (dict(fail_open="false"), "fail_open must be True or False"),
    (dict(hash_parts=0), "hash_parts must be True or False"),
])
def test_an_option_no_request_could_use_is_refused_at_decoration(options, message):
    """Regression: each passed the decorator and answered every request with a bare 500 (the manager refused the
    lease; `Retry-After: inf` could not be written, 1e300 was a 301-digit header); a name that is not text made
    every later /metrics scrape a 500; `fail_open="false"` (an environment variable) was read as true and ran the
    handler unlocked when Redis was away."""
    with pytest.raises(ValueError, match=message):
        locked("k", **options)
    with pytest.raises(ValueError, match=message):
        limited("k", permits=2, **options)


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

    found, _ = planned([Route("/items/{item_id}", Items)])
    assert {m for _, m in found} >= {"GET", "HEAD", "PUT"}


def test_rules_do_not_lock_404_or_405_of_a_routed_app():
    async def plain(request): ...
    found, problems = planned([Route("/x", plain, methods=["GET"])], {"/x": locked("x"), "/nowhere": locked("n")})
    assert ("/x", "GET") in found and ("/x", "POST") not in found
    assert [p.route for p in problems] == ["/nowhere"] and "matches no route" in problems[0].message


def test_a_rule_for_no_route_is_reported(redis_url, caplog):
    async def plain(request): ...
    app = LockMiddleware(Starlette(routes=[Route("/real", plain)]), rules={"POST /typo": locked("t")})
    app.prepare()
    assert "/typo" in caplog.text and "matches no route" in caplog.text


async def test_http_endpoint_methods_are_locked_through_the_middleware(redis_url):
    class Items(HTTPEndpoint):
        @locked("items:{path.item_id}")
        async def post(self, request):
            return await held_key(request)

        async def get(self, request):
            return await held_key(request)

    async with make_manager(redis_url) as manager:
        app = Starlette(routes=[Mount("/shop/{tenant}", routes=[Route("/items/{item_id:int}", Items)])])
        app.add_middleware(LockMiddleware, manager=manager)
        await assert_locked(app, "POST", "/shop/acme/items/007", "items:7", manager)
        await assert_locked(app, "GET", "/shop/acme/items/7", None, manager)


def test_a_plain_generator_handler_never_runs_unprotected():
    from otel_lock.asgi._guard import LockMiddlewareMissing

    ran = []

    @locked("report:{path.day}")
    def report(day: str):
        ran.append(day)
        yield day

    # No LockMiddleware ever prepared it: refused, as a function handler is, instead of streaming unlocked.
    with pytest.raises(LockMiddlewareMissing, match="ran without LockMiddleware"):
        list(report("monday"))
    assert ran == []
