"""Other ASGI frameworks (Litestar, Quart): `rules=` matched in front of the app, or start-up says what is not supported.

Regression tests: Litestar's `.routes` list was taken for a Starlette router,
so rules never applied (without lifespan two requests ran the handler at once;
under uvicorn start-up failed with a misleading "matches no route"); on Quart
a completed response was never replayed.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest

from otel_lock import LockMiddleware, idempotent, locked

try:
    from ._middleware_helpers import client_for, lock_key, make_manager, run_lifespan, serving
except ImportError:
    from _middleware_helpers import client_for, lock_key, make_manager, run_lifespan, serving

litestar = pytest.importorskip("litestar")
quart = pytest.importorskip("quart")


class Counter:
    """A read-modify-write that shows two handlers at once."""

    def __init__(self) -> None:
        self.inside = self.most_inside = self.runs = 0

    async def run(self) -> int:
        self.inside += 1
        self.most_inside = max(self.most_inside, self.inside)
        try:
            runs = self.runs
            await asyncio.sleep(0.02)   # the slow part of the work
            self.runs = runs + 1
            return self.runs
        finally:
            self.inside -= 1


RULES = {
    "POST /stock/{pid}/deduct": locked("stock:{path.pid}", wait=5),
    "POST /orders": [idempotent(shared_scope=True), locked("orders", wait=5)],
}


def litestar_app(counter: Counter):
    from litestar import Litestar, Request, post
    from litestar.params import FromPath, JSONBody

    @post("/stock/{pid:int}/deduct", status_code=200)
    async def deduct(pid: FromPath[int], request: Request) -> dict:
        return {"runs": await counter.run(), "key": request.scope["state"]["lock"].key}

    @post("/orders", status_code=201)
    async def orders(data: JSONBody[dict]) -> dict:
        return {"order": await counter.run(), "for": data["item"]}

    return Litestar([deduct, orders])


def quart_app(counter: Counter):
    from quart import Quart, request

    app = Quart(__name__)

    @app.post("/stock/<int:pid>/deduct")
    async def deduct(pid: int):
        return {"runs": await counter.run(), "key": request.scope["state"]["lock"].key}

    @app.post("/orders")
    async def orders():
        body = await request.get_json()
        return {"order": await counter.run(), "for": body["item"]}, 201

    return app


FRAMEWORKS = {"litestar": litestar_app, "quart": quart_app}


async def _exercise(client: httpx.AsyncClient, counter: Counter, framework: str) -> None:
    answers = await asyncio.gather(*(client.post("/stock/7/deduct") for _ in range(4)))
    assert [r.status_code for r in answers] == [200] * 4, [r.text for r in answers]
    assert counter.most_inside == 1                       # never two at once
    assert {r.json()["key"] for r in answers} == {lock_key("stock:7")}
    if framework == "quart":
        return   # idempotency on Quart: test_quart_answers_are_replayed below
    await _replays(client, counter)


async def _replays(client: httpx.AsyncClient, counter: Counter) -> None:
    before = counter.runs
    first = await client.post("/orders", json={"item": "a"}, headers={"idempotency-key": '"k-1"'})
    retry = await client.post("/orders", json={"item": "a"}, headers={"idempotency-key": '"k-1"'})
    other = await client.post("/orders", json={"item": "b"}, headers={"idempotency-key": '"k-1"'})
    assert first.status_code == 201, first.text
    assert retry.status_code == 201 and retry.json() == first.json(), retry.text
    assert retry.headers.get("idempotent-replayed") == "true"
    assert other.status_code == 422                        # the same key for another request
    assert counter.runs == before + 1                      # the retry did not run the handler


@pytest.mark.parametrize("framework", sorted(FRAMEWORKS))
async def test_rules_protect_the_app_without_lifespan(redis_url, framework):
    counter = Counter()
    async with make_manager(redis_url) as manager:
        app = LockMiddleware(FRAMEWORKS[framework](counter), manager=manager, rules=RULES)
        async with client_for(app) as client:   # httpx's ASGITransport sends no lifespan
            await _exercise(client, counter, framework)


@pytest.mark.parametrize("framework", sorted(FRAMEWORKS))
async def test_rules_protect_the_app_under_uvicorn_with_lifespan(redis_url, framework):
    counter = Counter()
    async with make_manager(redis_url) as manager:
        app = LockMiddleware(FRAMEWORKS[framework](counter), manager=manager, rules=RULES)
        async with serving(app) as (host, port):
            async with httpx.AsyncClient(base_url=f"http://{host}:{port}") as client:
                await _exercise(client, counter, framework)


async def test_quart_answers_are_replayed(redis_url):
    counter = Counter()
    async with make_manager(redis_url) as manager:
        app = LockMiddleware(quart_app(counter), manager=manager, rules=RULES)
        async with client_for(app) as client:
            await _replays(client, counter)


async def test_decorators_on_litestar_handlers_fail_the_start_up_saying_use_rules(redis_url):
    from litestar import Litestar, post
    from litestar.params import FromPath

    @post("/stock/{pid:int}")
    @locked("stock:{path.pid}")
    async def deduct(pid: FromPath[int]) -> dict:
        return {}

    async with make_manager(redis_url) as manager:
        messages = await run_lifespan(LockMiddleware(Litestar([deduct]), manager=manager))
    assert messages[0]["type"] == "lifespan.startup.failed"
    text = messages[0]["message"]
    assert "/stock/{pid:int}" in text and "Litestar" in text and "rules=" in text, text


async def test_decorators_on_quart_views_fail_the_start_up_saying_use_rules(redis_url):
    from quart import Quart

    app = Quart(__name__)

    @app.post("/stock/<int:pid>")
    @locked("stock:{path.pid}")
    async def deduct(pid: int):
        return {}

    async with make_manager(redis_url) as manager:
        messages = await run_lifespan(LockMiddleware(app, manager=manager))
    assert messages[0]["type"] == "lifespan.startup.failed"
    text = messages[0]["message"]
    assert "deduct" in text and "Quart" in text and "rules=" in text, text


# Spellings of one path that the frameworks' routers may lead to the same handler.
SPELLINGS = ["/stock/7/deduct", "/stock/7/deduct/", "//stock/7//deduct", "/stock/+7/deduct", "/stock/%207/deduct",
             "/stock/07/deduct"]


def raw(path: str) -> httpx.URL:
    """The path exactly as written (httpx would read `//stock` as a host)."""
    return httpx.URL("http://test").copy_with(raw_path=path.encode())


@pytest.mark.parametrize("framework", sorted(FRAMEWORKS))
async def test_every_spelling_the_router_leads_to_a_protected_handler_is_locked_as_one_resource(redis_url,
                                                                                                framework):
    counter = Counter()
    async with make_manager(redis_url) as manager:
        app = LockMiddleware(FRAMEWORKS[framework](counter), manager=manager, rules=RULES)
        async with client_for(app) as client:
            answers = await asyncio.gather(*(client.post(raw(p)) for p in SPELLINGS))
            before = counter.runs
            charged = await client.post("/orders", json={"item": "a"}, headers={"idempotency-key": '"k-9"'})
            retried = await client.post(raw("//orders/"), json={"item": "a"}, headers={"idempotency-key": '"k-9"'})
    ran = [r for r in answers if r.status_code == 200]
    # A handler reached without its lock answers 500 (it reads the lock from the scope): none may.
    assert all(r.status_code in (200, 307, 308, 404) for r in answers), [(r.url, r.status_code) for r in answers]
    assert {r.json()["key"] for r in ran} == {lock_key("stock:7")}
    assert before == len(ran) and counter.most_inside == 1
    if framework == "litestar":
        assert len(ran) == len(SPELLINGS)                  # Litestar leads every spelling to the handler
    assert charged.status_code == 201
    assert retried.status_code in (201, 404, 307, 308) and counter.runs == before + 1


@pytest.mark.parametrize("framework", sorted(FRAMEWORKS))
async def test_a_rule_naming_no_route_of_the_framework_fails_the_start_up(redis_url, framework):
    async with make_manager(redis_url) as manager:
        app = LockMiddleware(FRAMEWORKS[framework](Counter()), manager=manager,
                             rules={**RULES, "POST /stock/{pid}/deduce": locked("stock:{path.pid}")})
        messages = await run_lifespan(app)
    assert messages[0]["type"] == "lifespan.startup.failed"
    assert "/stock/{pid}/deduce" in messages[0]["message"] and "/stock/{pid}/deduct" in messages[0]["message"]
