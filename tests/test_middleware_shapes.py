"""Beyond the mutex in the middleware: several templates in one @locked, a lock per element of a list, bounds, mistakes.

Apps are written the way users write them: Pydantic bodies with list fields
and aliases, routers, dependencies. Every ugly input answers a 4xx
problem (or FastAPI's own 422), never a 500.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import re
from typing import Annotated, Any, Callable

import pytest
from fastapi import APIRouter, Depends, FastAPI, Form, Request
from fastapi.responses import Response
from fastapi.routing import APIRoute
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import BaseModel, Field
from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route

from otel_lock import LockMiddleware, idempotent, locked

try:
    from ._middleware_helpers import client_for, lock_key, make_manager, problem, run_lifespan
except ImportError:
    from _middleware_helpers import client_for, lock_key, make_manager, problem, run_lifespan


class Transfer(BaseModel):
    from_id: int
    to_id: int
    amount: int


class Line(BaseModel):
    sku: str = Field(alias="SKU")
    qty: int = 1


class Cart(BaseModel):
    lines: list[Line]


class Bank:
    """Balances whose read-modify-write is slow enough to lose money without the locks."""

    def __init__(self, **balances: int) -> None:
        self.balances = {int(k[1:]): v for k, v in balances.items()}

    async def move(self, source: int, target: int, amount: int) -> None:
        a, b = self.balances[source], self.balances[target]
        await asyncio.sleep(0.005)   # the slow part of a real transfer (a ledger call), not synchronisation
        self.balances[source] = a - amount
        self.balances[target] = (b if source != target else a - amount) + amount


def bank_app(manager, bank: Bank) -> FastAPI:
    app = FastAPI()
    router = APIRouter(prefix="/api")

    @router.post("/transfers")
    @locked("account:{json.from_id}", "account:{json.to_id}", wait=30)
    async def transfer(body: Transfer, request: Request):
        await bank.move(body.from_id, body.to_id, body.amount)
        held = request.state.lock
        return {"keys": list(held.keys), "tokens": held.tokens}

    app.include_router(router)
    app.add_middleware(LockMiddleware, manager=manager)
    return app


def post_json(client, path: str, document: Any, headers: dict[str, str] | None = None):
    return client.post(path, content=json.dumps(document),
                       headers={"content-type": "application/json", **(headers or {})})


async def test_transfers_in_opposite_directions_never_time_out_and_lose_nothing(redis_url):
    bank = Bank(a1=1000, a2=1000, a3=1000)
    async with make_manager(redis_url) as manager:
        async with client_for(bank_app(manager, bank)) as client:
            pairs = [(1, 2), (2, 1), (2, 3), (3, 2), (3, 1), (1, 3)] * 4
            answers = await asyncio.gather(*(post_json(client, "/api/transfers",
                                                       {"from_id": s, "to_id": t, "amount": 10})
                                             for s, t in pairs))
    assert [r.status_code for r in answers] == [200] * len(pairs), [r.text for r in answers if r.status_code != 200]
    assert sum(bank.balances.values()) == 3000 and bank.balances == {1: 1000, 2: 1000, 3: 1000}
    # Both accounts, whichever order the body names them in: one canonical order.
    assert sorted(answers[0].json()["keys"]) == ["account:1", "account:2"]
    assert sorted(answers[1].json()["keys"]) == ["account:1", "account:2"]


async def test_a_transfer_to_oneself_is_one_key(redis_url):
    bank = Bank(a7=50)
    async with make_manager(redis_url) as manager:
        async with client_for(bank_app(manager, bank)) as client:
            answer = await post_json(client, "/api/transfers", {"from_id": 7, "to_id": "07", "amount": 5})
    assert answer.status_code == 200, answer.text
    assert answer.json()["keys"] == ["account:7"] and list(answer.json()["tokens"]) == ["account:7"]
    assert bank.balances == {7: 50}


def shop_stock(request: Request) -> dict[str, int]:
    """A dependency, as an app's repository would be."""
    return request.app.state.stock


def shop_app(manager, stock: dict[str, int], *, max_keys: int = 100, events: dict[str, asyncio.Event] | None = None):
    app = FastAPI()
    app.state.stock = stock

    @app.post("/checkout")
    @locked("stock:{json.lines.*.sku}", wait=30, max_keys=max_keys)
    async def checkout(cart: Cart, request: Request, shelf: Annotated[dict[str, int], Depends(shop_stock)]):
        for line in cart.lines:
            if events is not None and line.sku in events:
                events[line.sku].set()                       # "I hold my SKUs"
                await events[line.sku + ":go"].wait()        # until the other checkout holds its own
        left = {line.sku: shelf[line.sku] for line in cart.lines}
        await asyncio.sleep(0.005)   # the slow part (a payment call), not synchronisation
        if any(left[line.sku] < line.qty for line in cart.lines):
            return JSONResponse({"sold": False}, status_code=409)
        for line in cart.lines:
            shelf[line.sku] = left[line.sku] - line.qty
        return {"sold": True, "tokens": request.state.lock.tokens}

    app.add_middleware(LockMiddleware, manager=manager)
    return app


def cart(*skus: str) -> dict[str, Any]:
    return {"lines": [{"SKU": sku, "qty": 1} for sku in skus]}


async def test_multi_sku_checkouts_that_share_a_sku_never_oversell(redis_url):
    stock = {"apple": 3, "pear": 100, "plum": 100, "fig": 100}
    carts = [cart("pear", "apple"), cart("apple", "plum"), cart("fig", "apple", "fig"), cart("apple"),
             cart("plum", "apple", "pear"), cart("apple", "fig")]
    async with make_manager(redis_url) as manager:
        async with client_for(shop_app(manager, stock)) as client:
            answers = await asyncio.gather(*(post_json(client, "/checkout", c) for c in carts))
    statuses = sorted(r.status_code for r in answers)
    assert statuses == [200] * 3 + [409] * 3, [r.text for r in answers]
    assert stock["apple"] == 0
    sold = [r.json()["tokens"] for r in answers if r.status_code == 200]
    assert all("stock:apple" in tokens for tokens in sold)
    # The duplicate fig of the third cart is one key.
    assert all(list(tokens) == sorted(tokens) for tokens in sold)


async def test_checkouts_of_disjoint_skus_hold_their_locks_at_the_same_time(redis_url):
    events = {name: asyncio.Event() for name in ("apple", "apple:go", "pear", "pear:go")}
    stock = {"apple": 1, "pear": 1, "fig": 1}

    async def both_inside() -> None:
        await events["apple"].wait()
        await events["pear"].wait()     # each checkout holds its SKUs while the other one does
        events["apple:go"].set()
        events["pear:go"].set()

    async with make_manager(redis_url) as manager:
        async with client_for(shop_app(manager, stock, events=events)) as client:
            async with asyncio.timeout(20):
                first, second, _ = await asyncio.gather(post_json(client, "/checkout", cart("apple", "fig")),
                                                        post_json(client, "/checkout", cart("pear")), both_inside())
    assert first.status_code == 200 and second.status_code == 200, (first.text, second.text)
    assert set(first.json()["tokens"]) == {"stock:apple", "stock:fig"}


async def test_an_empty_cart_takes_no_lock_and_the_handler_sees_no_tokens(redis_url):
    async with make_manager(redis_url) as manager:
        async with client_for(shop_app(manager, {})) as client:
            answer = await post_json(client, "/checkout", {"lines": []})
    assert answer.status_code == 200 and answer.json() == {"sold": True, "tokens": {}}


@pytest.mark.parametrize("document", [
    {},                                              # no list
    {"lines": None},                                 # null list
    {"lines": {"SKU": "apple"}},                     # an object where the list belongs
    {"lines": "apple"},                              # a string where the list belongs
    {"lines": [{"qty": 1}]},                         # an element without the field
    {"lines": [{"SKU": None}]},                      # null in an element
    {"lines": [{"SKU": {"id": "apple"}}]},           # nested non-scalar
    {"lines": [None]},                               # a null element
], ids=["missing", "null", "object", "string", "element-missing", "element-null", "nested", "null-element"])
async def test_ugly_carts_of_a_declared_body_are_fastapi_422s_and_take_nothing(redis_url, document):
    async with make_manager(redis_url) as manager:
        async with client_for(shop_app(manager, {"apple": 1})) as client:
            answer = await post_json(client, "/checkout", document)
        assert await manager.held_locks() == []
    assert answer.status_code == 422, answer.text


async def test_ten_thousand_items_are_a_422_problem_before_any_lock(redis_url):
    document = cart(*(f"sku-{i}" for i in range(10_000)))
    async with make_manager(redis_url) as manager:
        async with client_for(shop_app(manager, {"fig": 1})) as client:
            too_many = await post_json(client, "/checkout", document)
            # the bound counts distinct keys: ten thousand lines of one SKU are one key
            folded = await post_json(client, "/checkout", {"lines": [{"SKU": "fig", "qty": 0}] * 10_000})
        assert await manager.held_locks() == []
    assert too_many.status_code == 422 and problem(too_many)["type"] == "lock-keys-too-many", too_many.text
    assert "more than 100 distinct lock keys" in problem(too_many)["detail"]
    assert "sku-" not in too_many.text   # the request's values are not echoed
    assert folded.status_code == 200 and list(folded.json()["tokens"]) == ["stock:fig"], folded.text


async def test_max_keys_is_per_route(redis_url):
    async with make_manager(redis_url) as manager:
        async with client_for(shop_app(manager, {"a": 5, "b": 5, "c": 5}, max_keys=2)) as client:
            two = await post_json(client, "/checkout", cart("a", "b", "a"))
            three = await post_json(client, "/checkout", cart("a", "b", "c"))
    assert two.status_code == 200, two.text
    assert three.status_code == 422 and problem(three)["type"] == "lock-keys-too-many"


def raw_app(manager) -> Starlette:
    """A Starlette route: nothing declares the body, so the keys come from the raw JSON."""
    @locked("stock:{json.items.*.sku}", "order:{json.order}", wait=5)
    async def checkout(request: Request):
        return JSONResponse({"keys": list(request.state.lock.keys)})

    @locked("sku:{json.*}", wait=5)
    async def skus(request: Request):
        return JSONResponse({"keys": list(request.state.lock.keys)})

    app = Starlette(routes=[Route("/checkout", checkout, methods=["POST"]), Route("/skus", skus, methods=["POST"])])
    app.add_middleware(LockMiddleware, manager=manager)
    return app


async def test_raw_json_lists_are_walked_folded_and_sorted(redis_url):
    async with make_manager(redis_url) as manager:
        async with client_for(raw_app(manager)) as client:
            answer = await post_json(client, "/checkout",
                                     {"order": 9, "items": [{"sku": "b"}, {"sku": "a"}, {"sku": 7.0}, {"sku": "b"}]})
            top = await post_json(client, "/skus", ["x", "y", "x"])
    assert answer.status_code == 200, answer.text
    assert answer.json()["keys"] == ["order:9", "stock:7", "stock:a", "stock:b"]
    assert top.json()["keys"] == ["sku:x", "sku:y"]


@pytest.mark.parametrize("document,said", [
    ({"order": 1}, "no field 'items.*.sku'"),
    ({"order": 1, "items": None}, "'items' is null"),
    ({"order": 1, "items": {"sku": "a"}}, "'items' must be a list"),
    ({"order": 1, "items": [{"sku": "a"}, {"nope": 1}]}, "no field"),
    ({"order": 1, "items": [{"sku": None}]}, "'items.*.sku' is null"),
    ({"order": 1, "items": [{"sku": {"deep": [1]}}]}, "must be a string or a number"),
    ({"order": 1, "items": [[{"sku": "a"}]]}, "no field"),
], ids=["missing", "null", "object", "element-missing", "element-null", "nested-object", "nested-list"])
async def test_ugly_raw_bodies_are_400_problems_naming_the_field(redis_url, document, said):
    async with make_manager(redis_url) as manager:
        async with client_for(raw_app(manager)) as client:
            answer = await post_json(client, "/checkout", document)
        assert await manager.held_locks() == []
    assert answer.status_code == 400 and problem(answer)["type"] == "lock-key-invalid", answer.text
    assert said in problem(answer)["detail"]


async def test_an_optional_list_may_be_absent(redis_url):
    async with make_manager(redis_url) as manager:
        @locked("order:{json.order}", "coupon:{json.coupons.*?}")
        async def order(request: Request):
            return JSONResponse({"keys": list(request.state.lock.keys)})

        app = Starlette(routes=[Route("/orders", order, methods=["POST"])])
        app.add_middleware(LockMiddleware, manager=manager)
        async with client_for(app) as client:
            none = await post_json(client, "/orders", {"order": 3})
            some = await post_json(client, "/orders", {"order": 3, "coupons": ["x", "y"]})
    assert none.json()["keys"] == ["order:3"]
    assert some.json()["keys"] == ["coupon:x", "coupon:y", "order:3"]


async def startup_failure(app) -> str:
    sent = await run_lifespan(app)
    assert sent[0]["type"] == "lifespan.startup.failed", sent
    return str(sent[0]["message"])


class Catalogue(BaseModel):
    lines: dict[str, Line]
    codes: list[str]


@pytest.mark.parametrize("template,said", [
    ("stock:{json.lines.*.sku}", "'*' walks a list, but lines is declared as dict"),
    ("stock:{json.codes.*.sku}", "is a single value"),
    ("stock:{json.lines.x.sku}:{json.codes.*.nope}", "is a single value"),
    ("stock:{json.codes}", "names an object or a list"),
], ids=["dict", "past-the-scalar", "second-template", "list-without-star"])
async def test_a_template_that_cannot_walk_the_declared_body_fails_the_start_up(redis_url, template, said):
    async with make_manager(redis_url) as manager:
        app = FastAPI()

        @app.post("/catalogue")
        @locked(template)
        async def catalogue(body: Catalogue):
            return {}

        app.add_middleware(LockMiddleware, manager=manager)
        message = await startup_failure(app)
    assert said in message, message


async def test_a_list_of_models_needs_a_field_after_the_star(redis_url):
    async with make_manager(redis_url) as manager:
        app = FastAPI()

        @app.post("/checkout")
        @locked("stock:{json.lines.*}")
        async def checkout(body: Cart):
            return {}

        app.add_middleware(LockMiddleware, manager=manager)
        assert "names an object or a list" in await startup_failure(app)


@pytest.mark.parametrize("make,said", [
    (lambda: locked("a:{json.x.*}:{json.y.*}"), "one '*' placeholder per template"),
    (lambda: locked("a:{json.x.*}", shared=True), "a shared lock is on one key"),
    (lambda: locked("a:{json.x}", "b:{json.y}", shared=True), "a shared lock is on one key"),
    (lambda: locked("a:{query.*}"), "ill-formed field"),
    (lambda: locked("a:{form.*}"), "ill-formed field"),
    (lambda: locked(), "needs a lock key template"),
    (lambda: locked("a:{json.x.*}", max_keys=0), "max_keys must be a positive"),
], ids=["two-stars", "shared-star", "shared-two", "query-star", "form-first-star", "none", "max-keys"])
def test_annotation_mistakes_are_refused_when_the_module_loads(make, said):
    with pytest.raises(ValueError, match=re.escape(said)):
        make()


async def test_a_direct_call_takes_every_key_of_the_handler(redis_url):
    bank = Bank(a1=100, a2=100)
    async with make_manager(redis_url) as manager:
        app = FastAPI()

        @app.post("/transfers")
        @locked("account:{json.from_id}", "account:{json.to_id}", wait=5)
        async def transfer(body: Transfer):
            await bank.move(body.from_id, body.to_id, body.amount)
            return {"held": sorted(info.key for info in await manager.held_locks())}

        @app.post("/refunds")
        async def refund(body: Transfer):
            return await transfer(Transfer(from_id=body.to_id, to_id=body.from_id, amount=body.amount))

        app.add_middleware(LockMiddleware, manager=manager)
        async with client_for(app) as client:
            answer = await post_json(client, "/refunds", {"from_id": 1, "to_id": 2, "amount": 5})
    assert answer.status_code == 200, answer.text
    assert len(answer.json()["held"]) == 2 and bank.balances == {1: 105, 2: 95}


async def test_an_idempotent_transfer_replays_and_its_keys_are_documented(redis_url):
    async with make_manager(redis_url) as manager:
        app = FastAPI()
        runs = []

        @app.post("/transfers")
        @idempotent(required=True, shared_scope=True)
        @locked("account:{json.from_id}", "account:{json.to_id}", wait=5)
        async def transfer(body: Transfer, request: Request):
            runs.append(body)
            return {"tokens": request.state.lock.tokens}

        app.add_middleware(LockMiddleware, manager=manager)
        async with client_for(app) as client:
            document = {"from_id": 1, "to_id": 2, "amount": 5}
            first = await post_json(client, "/transfers", document, headers={"idempotency-key": "t-1"})
            again = await client.post("/transfers", content=json.dumps(document),
                                      headers={"content-type": "application/json", "idempotency-key": "t-1"})
            other = await post_json(client, "/transfers", {**document, "to_id": 3}, headers={"idempotency-key": "t-1"})
            schema = (await client.get("/openapi.json")).json()
    assert first.status_code == 200 and again.json() == first.json() and len(runs) == 1
    assert other.status_code == 422
    responses = schema["paths"]["/transfers"]["post"]["responses"]
    assert "deadlock" in responses["409"]["description"]
    assert "more than 100 distinct lock keys" in responses["422"]["description"]


class Gate:
    """Requests that say they are inside, then wait to be let out: holders the test controls."""

    def __init__(self) -> None:
        self.inside: asyncio.Queue[str] = asyncio.Queue()
        self.out = asyncio.Event()

    async def hold(self, who: str) -> None:
        await self.inside.put(who)
        await self.out.wait()

    async def entered(self, count: int) -> list[str]:
        async with asyncio.timeout(20):
            return [await self.inside.get() for _ in range(count)]


def catalogue_app(manager, gate: Gate) -> FastAPI:
    app = FastAPI()
    prices = {"9": 100}

    @app.get("/catalogue/{item}")
    @locked("catalogue:{path.item}", shared=True, wait=5)
    async def read(item: str, request: Request):
        await gate.hold("read")
        return {"price": prices[item], "token": request.state.lock.token}

    @app.put("/catalogue/{item}")
    @locked("catalogue:{path.item}", wait=0.2, retry_after=3)
    async def write(item: str, price: int):
        prices[item] = price
        return {"price": price}

    app.add_middleware(LockMiddleware, manager=manager)
    return app


async def test_reads_run_beside_each_other_and_a_write_waits_for_them(redis_url):
    gate = Gate()
    async with make_manager(redis_url) as manager:
        async with client_for(catalogue_app(manager, gate)) as client:
            reads = [asyncio.create_task(client.get("/catalogue/9")) for _ in range(3)]
            assert await gate.entered(3) == ["read"] * 3          # three shared holders at once
            busy = await client.put("/catalogue/9", params={"price": 120})
            gate.out.set()
            answers = await asyncio.gather(*reads)
            written = await client.put("/catalogue/9", params={"price": 130})
    assert busy.status_code == 409 and problem(busy)["type"] == "lock-timeout"
    assert busy.headers["retry-after"] == "3"
    assert [r.json()["price"] for r in answers] == [100] * 3
    assert written.status_code == 200 and written.json() == {"price": 130}


def export_app(manager, gate: Gate) -> FastAPI:
    from otel_lock import limited

    app = FastAPI()

    @app.post("/exports")
    @limited("export:{header.x-tenant}", permits=2, wait=0.2, retry_after=7)
    async def export(request: Request):
        await gate.hold(request.headers["x-tenant"])
        return {"permits": request.state.lock.permits}

    app.add_middleware(LockMiddleware, manager=manager)
    return app


async def test_a_tenant_runs_two_exports_at_once_and_the_third_is_told_429(redis_url):
    gate = Gate()
    async with make_manager(redis_url) as manager:
        async with client_for(export_app(manager, gate)) as client:
            running = [asyncio.create_task(client.post("/exports", headers={"x-tenant": "t3"})) for _ in range(2)]
            assert await gate.entered(2) == ["t3", "t3"]
            third = await client.post("/exports", headers={"x-tenant": "t3"})
            other = asyncio.create_task(client.post("/exports", headers={"x-tenant": "t4"}))
            assert await gate.entered(1) == ["t4"]               # another tenant has permits of its own
            gate.out.set()
            done = await asyncio.gather(*running, other)
            later = await client.post("/exports", headers={"x-tenant": "t3"})
            missing = await client.post("/exports")
            schema = (await client.get("/openapi.json")).json()
    assert third.status_code == 429, third.text
    assert problem(third)["type"] == "concurrency-limit" and third.headers["retry-after"] == "7"
    assert "2 at a time" in problem(third)["detail"]
    assert [r.status_code for r in done] == [200] * 3 and done[0].json() == {"permits": 2}
    assert later.status_code == 200
    assert missing.status_code == 400 and problem(missing)["type"] == "lock-key-invalid"
    responses = schema["paths"]["/exports"]["post"]["responses"]
    assert "Retry-After" in responses["429"]["headers"] and "permit" in responses["429"]["description"]
    assert "409" not in responses


def test_limited_mistakes_are_refused_when_the_module_loads():
    from otel_lock import limited

    with pytest.raises(ValueError, match="permits must be a positive"):
        limited("export:{header.x-tenant}", permits=0)
    with pytest.raises(ValueError, match="a limit is on one key"):
        limited("export:{json.tenants.*}", permits=2)
    with pytest.raises(ValueError, match=re.escape("already has a @locked or @limited annotation")):
        @limited("a:{path.x}", permits=1)
        @locked("b:{path.x}")
        async def both(x: str): ...


async def test_a_repeated_form_field_is_walked_declared_or_raw(redis_url):
    async with make_manager(redis_url) as manager:
        app = FastAPI()

        @app.post("/tags")
        @locked("tag:{form.tags.*}")
        async def declared(tags: Annotated[list[str], Form()], request: Request):
            return {"keys": list(request.state.lock.keys)}

        @app.post("/raw")
        @locked("tag:{form.tag.*}")
        async def raw(request: Request):
            return {"keys": list(request.state.lock.keys)}

        app.add_middleware(LockMiddleware, manager=manager)
        async with client_for(app) as client:
            first = await client.post("/tags", data={"tags": ["b", "a", "b"]})
            second = await client.post("/raw", data={"tag": ["z", "y"]})
    assert first.json() == {"keys": ["tag:a", "tag:b"]}, first.text
    assert second.json() == {"keys": ["tag:y", "tag:z"]}, second.text


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


async def test_a_route_class_that_unzips_the_cart_takes_the_keys_of_the_handlers_cart(redis_url):
    async with make_manager(redis_url) as manager:
        app = FastAPI()
        router = APIRouter(route_class=GzipRoute)

        @router.post("/checkout")
        @locked("stock:{json.lines.*.sku}", wait=5)
        async def checkout(cart: Cart, request: Request):
            return {"held": sorted(info.key for info in await manager.held_locks())}

        app.include_router(router)
        app.add_middleware(LockMiddleware, manager=manager)
        assert (await run_lifespan(app))[0]["type"] == "lifespan.startup.complete"
        async with client_for(app) as client:
            answer = await client.post("/checkout", content=gzip.compress(json.dumps(cart("b", "a")).encode()),
                                       headers={"content-type": "application/json", "content-encoding": "gzip"})
    assert answer.status_code == 200, answer.text
    assert answer.json()["held"] == [lock_key("stock:a"), lock_key("stock:b")]


async def test_a_route_class_with_several_keys_and_a_def_handler_fails_the_start_up(redis_url):
    async with make_manager(redis_url) as manager:
        app = FastAPI()
        router = APIRouter(route_class=GzipRoute)

        @router.post("/checkout")
        @locked("stock:{json.lines.*.sku}")
        def checkout(cart: Cart):
            return {}

        app.include_router(router)
        app.add_middleware(LockMiddleware, manager=manager)
        assert "make it async def" in await startup_failure(app)


async def test_rules_and_hash_parts_work_with_several_keys(redis_url):
    async with make_manager(redis_url) as manager:
        async def checkout(request: Request):
            return JSONResponse({"keys": list(request.state.lock.keys)})

        app = Starlette(routes=[Route("/checkout", checkout, methods=["POST"])])
        app.add_middleware(LockMiddleware, manager=manager, rules={
            "POST /checkout": locked("stock:{json.items.*}", "user:{header.x-user}", hash_parts=True)})
        async with client_for(app) as client:
            answer = await post_json(client, "/checkout", {"items": ["alice@example.com", "b"]},
                                     headers={"x-user": "alice@example.com"})
    keys = answer.json()["keys"]
    assert answer.status_code == 200 and len(keys) == 3, answer.text
    assert all("alice" not in k and "%k" in k for k in keys)


async def queued(redis_client, name: str, count: int) -> None:
    """Until `count` callers wait in the lock's Redis queue."""
    async with asyncio.timeout(20):
        while await redis_client.zcard(lock_key(name) + ":q") != count:
            await asyncio.sleep(0.005)


class ErrorsAre500Route(APIRoute):
    """As some apps do (mealie's): any exception of a handler becomes the route class's own 500."""

    def get_route_handler(self) -> Callable:
        original = super().get_route_handler()

        async def handler(request: Request) -> Response:
            try:
                return await original(request)
            except Exception:  # noqa: BLE001
                return JSONResponse({"detail": "internal error"}, status_code=500)

        return handler


@pytest.mark.parametrize("route_class", [APIRoute, ErrorsAre500Route], ids=["plain route", "route class"])
async def test_a_wait_that_would_close_a_cycle_is_a_409_lock_deadlock_at_once(redis_url, redis_client, route_class):
    inside, go, job_holds = asyncio.Event(), asyncio.Event(), asyncio.Event()
    async with make_manager(redis_url) as manager, make_manager(redis_url) as other:
        app = FastAPI()
        router = APIRouter(route_class=route_class)

        @router.post("/orders/{order_id}/ship")
        @locked("order:{path.order_id}", wait=5)
        async def ship(order_id: int):
            inside.set()
            await go.wait()
            async with manager.lock("stock:x", wait=30):   # taken by hand, while the route holds order:1
                return {"shipped": order_id}

        app.include_router(router)

        async def job() -> int:
            """Another program that stacks lock() calls in the other order."""
            async with other.lock("stock:x"):
                job_holds.set()
                async with other.lock("order:1", wait=30) as held:
                    return held.token

        app.add_middleware(LockMiddleware, manager=manager)
        async with client_for(app) as client:
            request = asyncio.create_task(client.post("/orders/1/ship"))
            await inside.wait()
            stacked = asyncio.create_task(job())
            await job_holds.wait()
            await queued(redis_client, "order:1", 1)     # the job waits for the request's order:1
            while not await redis_client.keys("*:waits:*"):
                await asyncio.sleep(0.005)               # and has recorded it: the request's wait closes the cycle
            go.set()                                     # the request now waits for the job's stock:x
            async with asyncio.timeout(20):
                answer = await request
                token = await stacked                    # refused at once, the request let order:1 go
    assert answer.status_code == 409, answer.text
    body = problem(answer)
    assert body["type"] == "lock-deadlock" and answer.headers["retry-after"] == "1"
    assert "order:1" not in body["detail"] and "stock:x" not in body["detail"]
    assert body["detail"].count("h:") == 2               # the cycle's two keys, hashed
    assert isinstance(token, int)


@pytest.mark.parametrize("annotation", [
    lambda: locked("catalogue:{path.item}", shared=True),
    lambda: __import__("otel_lock").limited("catalogue:{path.item}", permits=2),
], ids=["shared", "limited"])
async def test_a_redlock_manager_refuses_shared_locks_and_permits_at_start_up(annotation):
    from otel_lock import RedLockManager

    # Never contacted: the start-up refuses the route before any request.
    manager = RedLockManager.from_urls([f"redis://127.0.0.1:{port}/0" for port in (1, 2, 3)], namespace="mwtest")
    try:
        app = FastAPI()

        @app.get("/catalogue/{item}")
        @annotation()
        async def read(item: str):
            return {}

        app.add_middleware(LockMiddleware, manager=manager)
        message = await startup_failure(app)
    finally:
        await manager.aclose()
    assert "RedLockManager does not offer" in message and "use a LockManager" in message, message


async def test_a_manager_with_wait_replicas_refuses_shared_locks_at_start_up(redis_url):
    async with make_manager(redis_url, wait_replicas=1) as manager:
        app = FastAPI()

        @app.get("/catalogue/{item}")
        @locked("catalogue:{path.item}", shared=True)
        async def read(item: str):
            return {}

        app.add_middleware(LockMiddleware, manager=manager)
        assert "wait_replicas" in await startup_failure(app)


async def test_a_header_named_by_any_template_is_part_of_the_idempotency_fingerprint(redis_url):
    async with make_manager(redis_url) as manager:
        app = FastAPI()

        @app.post("/checkout")
        @idempotent(shared_scope=True)
        @locked("stock:{json.lines.*.sku}", "till:{header.x-till}")
        async def checkout(cart: Cart):
            return {"lines": len(cart.lines)}

        app.add_middleware(LockMiddleware, manager=manager)
        async with client_for(app) as client:
            first = await post_json(client, "/checkout", cart("a"), {"idempotency-key": "c-1", "x-till": "1"})
            other_till = await post_json(client, "/checkout", cart("a"), {"idempotency-key": "c-1", "x-till": "2"})
            again = await post_json(client, "/checkout", cart("a"), {"idempotency-key": "c-1", "x-till": "1"})
    assert first.status_code == 200 and again.json() == first.json()
    assert other_till.status_code == 422 and problem(other_till)["type"] == "idempotency-key-mismatch", other_till.text


bearer = HTTPBearer()


async def test_several_keys_are_taken_after_the_security_dependency(redis_url):
    bank = Bank(a1=10, a2=10)
    async with make_manager(redis_url) as manager:
        app = FastAPI()

        @app.post("/transfers")
        @locked("account:{json.from_id}", "account:{json.to_id}")
        async def transfer(body: Transfer, request: Request,
                           credentials: Annotated[HTTPAuthorizationCredentials, Depends(bearer)]):
            await bank.move(body.from_id, body.to_id, body.amount)
            return {"keys": list(request.state.lock.keys)}

        app.add_middleware(LockMiddleware, manager=manager)
        async with client_for(app) as client:
            anonymous = await post_json(client, "/transfers", {"from_id": 2, "to_id": 1, "amount": 1})
            signed = await post_json(client, "/transfers", {"from_id": 2, "to_id": 1, "amount": 1},
                                     {"authorization": "Bearer t"})
    assert anonymous.status_code in (401, 403) and bank.balances == {1: 11, 2: 9}
    assert signed.json() == {"keys": ["account:1", "account:2"]}


async def test_two_templates_may_walk_the_same_list(redis_url):
    async with make_manager(redis_url) as manager:
        app = FastAPI()

        @app.post("/reserve")
        @locked("stock:{json.lines.*.sku}", "shelf:{json.lines.*.sku}", max_keys=4)
        async def reserve(cart: Cart, request: Request):
            return {"keys": list(request.state.lock.keys)}

        app.add_middleware(LockMiddleware, manager=manager)
        async with client_for(app) as client:
            two = await post_json(client, "/reserve", cart("b", "a", "b"))
            three = await post_json(client, "/reserve", cart("a", "b", "c"))
    assert two.json() == {"keys": ["shelf:a", "shelf:b", "stock:a", "stock:b"]}, two.text
    assert three.status_code == 422 and problem(three)["type"] == "lock-keys-too-many"


class Shipment(BaseModel):
    carts: list[Cart]


async def test_a_list_body_and_lists_in_lists_are_walked_declared(redis_url):
    async with make_manager(redis_url) as manager:
        app = FastAPI()

        @app.post("/skus")
        @locked("sku:{json.*}")
        async def skus(codes: list[int], request: Request):
            return {"keys": list(request.state.lock.keys)}

        @app.post("/shipments")
        @locked("stock:{json.carts.*.lines.*.sku}")
        async def ship(shipment: Shipment, request: Request):
            return {"keys": list(request.state.lock.keys)}

        app.add_middleware(LockMiddleware, manager=manager)
        async with client_for(app) as client:
            codes = await post_json(client, "/skus", [3, "03", 2])
            shipped = await post_json(client, "/shipments", {"carts": [cart("b", "a"), cart("c"), {"lines": []}]})
            ugly = await post_json(client, "/shipments", {"carts": [cart("b"), {"lines": "a"}]})
    assert codes.json() == {"keys": ["sku:2", "sku:3"]}, codes.text
    assert shipped.json() == {"keys": ["stock:a", "stock:b", "stock:c"]}, shipped.text
    assert ugly.status_code == 422
