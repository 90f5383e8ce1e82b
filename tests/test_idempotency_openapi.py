"""The published OpenAPI matches every answer the middleware can give, and the route's own entries win."""

from __future__ import annotations

import re

from fastapi import FastAPI
from pydantic import BaseModel

from otel_lock import LockMiddleware, idempotent, locked
from otel_lock.asgi._openapi import answers, protected_operation
from otel_lock.asgi.idempotency import KEY_PATTERN

try:
    from ._middleware_helpers import make_manager, run_lifespan
except ImportError:
    from _middleware_helpers import make_manager, run_lifespan


class Order(BaseModel):
    product_id: str


def caller(request) -> str | None:
    return request.headers.get("x-user-id")


async def published(redis_url, app: FastAPI) -> dict:
    async with make_manager(redis_url) as manager:
        app.add_middleware(LockMiddleware, manager=manager)
        messages = await run_lifespan(app)
        assert messages[0]["type"] == "lifespan.startup.complete", messages
        return app.openapi()


async def test_the_routes_own_responses_win_and_gain_the_problem_body(redis_url):
    app = FastAPI()

    @app.post("/orders", status_code=201,
              responses={409: {"description": "Out of stock"}, 503: {"description": "Payments are down"}})
    @idempotent(principal=caller)
    @locked("order:{json.product_id}")
    async def orders(order: Order):
        return {}

    responses = (await published(redis_url, app))["paths"]["/orders"]["post"]["responses"]
    assert responses["409"]["description"] == "Out of stock"
    assert responses["503"]["description"] == "Payments are down"
    assert "application/problem+json" in responses["409"]["content"]
    assert responses["409"]["headers"]["Retry-After"]["schema"]["type"] == "integer"
    assert responses["201"]["description"] == "Successful Response"     # untouched


async def test_every_answer_of_the_middleware_is_published(redis_url):
    app = FastAPI()

    @app.post("/orders")
    @idempotent(principal=caller)
    @locked("order:{json.product_id}", status=423)
    async def orders(order: Order):
        return {}

    @app.post("/forbidden")
    @idempotent(principal=caller, unauthenticated_status=403, challenge=None)
    async def forbidden(order: Order):
        return {}

    paths = (await published(redis_url, app))["paths"]
    responses = paths["/orders"]["post"]["responses"]
    for status in ("400", "401", "408", "409", "413", "422", "423", "429", "500", "503", "507"):
        assert "application/problem+json" in responses[status]["content"], status
    assert "application/json" in responses["422"]["content"]       # FastAPI's validation error stays
    assert set(responses["401"]["headers"]) == {"WWW-Authenticate"}
    assert {"Retry-After"} <= set(responses["423"]["headers"]) and {"Retry-After"} <= set(responses["507"]["headers"])
    forbidden = paths["/forbidden"]["post"]["responses"]
    assert "403" in forbidden and "401" not in forbidden and "headers" not in forbidden["403"]


async def test_the_key_schema_is_exactly_what_is_accepted(redis_url):
    app = FastAPI()

    @app.post("/orders")
    @idempotent(principal=caller, required=False)
    async def orders(order: Order):
        return {}

    (header,) = [p for p in (await published(redis_url, app))["paths"]["/orders"]["post"]["parameters"]
                 if p["name"] == "Idempotency-Key"]
    assert header["required"] is False and header["schema"] == {"type": "string", "pattern": KEY_PATTERN}
    pattern = re.compile(header["schema"]["pattern"])
    # Judged as the middleware answers them: `a b` (answered 400), a valid 255-character sf-string (201).
    assert not pattern.fullmatch("a b") and pattern.fullmatch('"' + "k" * 255 + '"')
    assert not pattern.fullmatch('"' + "k" * 256 + '"') and pattern.fullmatch('"' + '\\"' * 255 + '"')


def test_a_hand_written_operation_keeps_its_own_entries():
    operation = {"responses": {"200": {"description": "Sold"},
                               "409": {"description": "Sold out", "content": {"application/json": {}}}}}
    merged = protected_operation(operation, locked("stock:{path.id}"), idempotent(shared_scope=True))
    assert merged["responses"]["409"]["description"] == "Sold out"
    assert set(merged["responses"]["409"]["content"]) == {"application/json", "application/problem+json"}
    assert operation["responses"]["409"]["content"] == {"application/json": {}}     # the input is not changed
    assert set(merged["responses"]) >= set(answers([locked("stock:{path.id}")], idempotent(shared_scope=True)))
