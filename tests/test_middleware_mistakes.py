"""Protection never disappears without a word: fail closed, annotation mistakes at start-up, CORS order.

Also: a Content-Length that is not ASCII digits is the client's 400.
"""

from __future__ import annotations

import logging

import pytest
from fastapi import FastAPI, Request, WebSocket
from starlette.applications import Starlette
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import JSONResponse
from starlette.routing import Route

from otel_lock import LockManager, LockMiddleware, idempotent, locked

try:
    from ._middleware_helpers import client_for, lock_key, make_manager, problem, run_lifespan
except ImportError:
    from _middleware_helpers import client_for, lock_key, make_manager, problem, run_lifespan


async def test_annotated_handlers_without_the_middleware_fail_closed_and_log_once(caplog):
    ran = []
    app = FastAPI()

    @app.post("/stock/{pid}/deduct")
    @locked("stock:{path.pid}")
    async def deduct(pid: int):
        ran.append(pid)

    @app.post("/orders")
    @idempotent()
    def orders():
        ran.append("order")

    async def starlette_handler(request):
        ran.append("starlette")
        return JSONResponse({})

    plain = Starlette(routes=[Route("/s", locked("s")(starlette_handler), methods=["POST"])])
    caplog.set_level(logging.ERROR, "otel_lock")
    async with client_for(app) as client, client_for(plain) as other:
        answers = [await client.post("/stock/1/deduct"), await client.post("/stock/1/deduct"),
                   await client.post("/orders"), await other.post("/s")]
    for response in answers:
        assert response.status_code == 500
        body = problem(response)
        assert body["type"] == "lock-middleware-missing" and "LockMiddleware" in body["detail"]
    assert ran == []
    logged = [r.getMessage() for r in caplog.records if "LockMiddleware" in r.getMessage()]
    assert len(logged) == 3  # once per handler, not per request


def _hiding(fn):
    async def wrapper(*args, **kwargs):   # no functools.wraps: the annotation is hidden
        return await fn(*args, **kwargs)
    return wrapper


def mistaken_apps(manager) -> dict[str, tuple[FastAPI, str]]:
    """name -> (app, path of its broken route)."""
    hidden = FastAPI()

    @hidden.post("/hidden/{pid}")
    @_hiding
    @locked("stock:{path.pid}")
    async def hidden_handler(pid: int):
        return {}

    socket = FastAPI()

    @socket.websocket("/ws/{room}")
    @locked("room:{path.room}")
    async def chat(websocket: WebSocket, room: str):
        await websocket.accept()

    typo = FastAPI()

    @typo.post("/typo/{pid}")
    @locked("stock:{path.product_id}")
    async def typo_handler(pid: int):
        return {}

    apps = {"hidden": (hidden, "/hidden/{pid}"), "websocket": (socket, "/ws/{room}"), "typo": (typo, "/typo/{pid}")}
    for app, _ in apps.values():
        app.add_middleware(LockMiddleware, manager=manager)
    return apps


@pytest.mark.parametrize("case, words", [
    ("hidden", "functools.wraps"), ("websocket", "websocket"), ("typo", "no path parameter 'product_id'"),
])
async def test_annotation_mistakes_fail_the_start_up_naming_route_and_problem(redis_url, case, words):
    async with make_manager(redis_url) as manager:
        app, route = mistaken_apps(manager)[case]
        messages = await run_lifespan(app)
    assert messages[0]["type"] == "lifespan.startup.failed"
    assert route in messages[0]["message"] and words in messages[0]["message"]


@pytest.mark.parametrize("case, path", [("hidden", "/hidden/1"), ("typo", "/typo/1")])
async def test_without_lifespan_the_first_request_gets_500_naming_the_mistake_never_400(redis_url, caplog,
                                                                                        case, path):
    async with make_manager(redis_url) as manager:
        app, route = mistaken_apps(manager)[case]
        async with client_for(app) as client:
            response = await client.post(path)
    assert response.status_code == 500
    assert route in problem(response)["detail"]
    assert route in caplog.text


async def test_lock_middleware_outside_cors_is_warned_about_and_answers_still_carry_cors(redis_url, caplog):
    async with make_manager(redis_url) as manager, make_manager(redis_url) as other:
        app = FastAPI()

        @app.post("/stock/{pid}")
        @locked("stock:{path.pid}", wait=0)
        async def deduct(pid: int):
            return {}

        app.add_middleware(CORSMiddleware, allow_origins=["https://shop.example"])
        app.add_middleware(LockMiddleware, manager=manager)    # outside CORS: warned
        caplog.set_level(logging.WARNING, "otel_lock")
        assert (await run_lifespan(app))[0]["type"] == "lifespan.startup.complete"
        assert "CORSMiddleware" in caplog.text
        held = await other.try_lock("stock:1")
        async with client_for(app) as client:
            busy = await client.post("/stock/1", headers={"origin": "https://shop.example"})
        await held.release()
    # Answers come from the route, inside CORS, whatever the order.
    assert busy.status_code == 409 and busy.headers["access-control-allow-origin"] == "https://shop.example"


async def test_recommended_order_gives_no_cors_warning(redis_url, caplog):
    async with make_manager(redis_url) as manager:
        app = FastAPI()
        app.add_middleware(LockMiddleware, manager=manager)
        app.add_middleware(CORSMiddleware, allow_origins=["*"])
        caplog.set_level(logging.WARNING, "otel_lock")
        assert (await run_lifespan(app))[0]["type"] == "lifespan.startup.complete"
    assert "CORSMiddleware" not in caplog.text


@pytest.mark.parametrize("value", ["²", "١٢", "12a", "-1", "1 2", "+5"])
async def test_content_length_that_is_not_ascii_digits_gives_400(redis_url, value):
    async def handler(request: Request):
        return JSONResponse({"key": request.state.lock.key})

    sent = []

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "path": "/x",
             "raw_path": b"/x", "root_path": "", "query_string": b"", "scheme": "http",
             "headers": [(b"content-length", value.encode("utf-8"))], "client": ("127.0.0.1", 1),
             "server": ("test", 80)}
    async with make_manager(redis_url) as manager:
        app = Starlette(routes=[Route("/x", locked("x")(handler), methods=["POST"])])
        app.add_middleware(LockMiddleware, manager=manager)
        await app(scope, receive, send)
    assert sent[0]["status"] == 400
    assert b"invalid-content-length" in sent[1]["body"]


async def test_enabled_false_runs_annotated_handlers_unlocked_on_purpose(redis_url, caplog):
    async def handler(request: Request):
        return JSONResponse({"lock": getattr(request.state, "lock", None) is not None})

    async with make_manager(redis_url) as manager:
        app = Starlette(routes=[Route("/x", locked("x")(handler), methods=["POST"])])
        app.add_middleware(LockMiddleware, manager=manager, enabled=False)
        async with client_for(app) as client:
            response = await client.post("/x")
    assert response.status_code == 200 and response.json() == {"lock": False}
    assert "enabled=False" in caplog.text and lock_key("x")


async def test_an_annotated_http_endpoint_class_without_the_middleware_fails_closed():
    from starlette.endpoints import HTTPEndpoint

    ran = []

    @locked("items:{path.item_id}")
    class Items(HTTPEndpoint):
        async def post(self, request):
            ran.append("post")
            return JSONResponse({})

        def put(self, request):
            ran.append("put")
            return JSONResponse({})

    app = Starlette(routes=[Route("/items/{item_id}", Items)])
    async with client_for(app) as client:
        answers = [await client.post("/items/1"), await client.put("/items/1")]
    assert [r.status_code for r in answers] == [500, 500] and ran == []


# -- each cause its own problem type (lock-middleware-missing once covered three) -------


async def test_a_value_judged_invalid_that_the_framework_accepts_is_refused_as_a_binding_mismatch(
        redis_url, redis_client, monkeypatch):
    from otel_lock.asgi import _binding

    ran = []
    async with make_manager(redis_url) as manager:
        app = FastAPI()

        @app.post("/stock/{pid}")
        @locked("stock:{path.pid}")
        async def deduct(pid: int):
            ran.append(pid)

        app.add_middleware(LockMiddleware, manager=manager)

        async def disagree(self, scope, body):   # the middleware's binding and FastAPI's part ways
            return _binding.INVALID

        monkeypatch.setattr(_binding.RouteBinding, "request_values", disagree)
        async with client_for(app) as client:
            response = await client.post("/stock/1")
    assert response.status_code == 500 and ran == []
    body = problem(response)
    assert body["type"] == "lock-binding-mismatch" and "refuses to run unlocked" in body["detail"]
    assert await redis_client.keys("*") == []


async def test_a_route_class_the_middleware_cannot_handle_is_its_own_problem_type(redis_url):
    try:
        from .test_middleware_binding import GzipRoute, Purchase
    except ImportError:
        from test_middleware_binding import GzipRoute, Purchase

    async with make_manager(redis_url) as manager:
        app = FastAPI()
        app.router.route_class = GzipRoute

        @app.post("/buy")
        @locked("stock:{json.pid}")
        def buy(purchase: Purchase):   # a generator: it cannot be held around its call
            yield {}

        app.add_middleware(LockMiddleware, manager=manager)
        async with client_for(app) as client:
            response = await client.post("/buy", json={"pid": 1})
    assert response.status_code == 500
    body = problem(response)
    assert body["type"] == "lock-route-unsupported" and "GzipRoute" in body["detail"]


async def test_a_header_the_route_never_declares_is_the_clients_400_naming_it(redis_url):
    async with make_manager(redis_url) as manager:
        app = FastAPI()

        @app.post("/orders")
        @locked("order:user:{header.x-user-id}")
        async def order(request: Request):
            return {"key": request.state.lock.key}

        app.add_middleware(LockMiddleware, manager=manager)
        assert (await run_lifespan(app))[0]["type"] == "lifespan.startup.complete"   # not a template mistake
        async with client_for(app) as client:
            missing = await client.post("/orders")
            sent = await client.post("/orders", headers={"x-user-id": "u1"})
    assert missing.status_code == 400
    body = problem(missing)
    assert body["type"] == "lock-key-invalid" and "header 'x-user-id' is missing" in body["detail"]
    assert sent.json() == {"key": lock_key("order:user:u1")}


def test_enabled_that_is_not_true_or_false_is_refused(redis_url):
    """Regression: `enabled="false"` (an environment variable passed on) was read as true, silently."""
    for value in ("false", 0, None):
        with pytest.raises(ValueError, match="enabled must be True or False"):
            LockMiddleware(Starlette(), manager=LockManager.from_url(redis_url), enabled=value)
