"""Keys built from the values the handler receives, for every way FastAPI and Pydantic bind them.

Regression tests for keys that were not what the handler sees:
AliasChoices spellings that locked different keys (two buyers inside "the"
lock), `{json.*}` on a Form route and FastAPI's GzipRequest recipe that
answered 500 `lock-middleware-missing`.
"""

from __future__ import annotations

import asyncio
import datetime
import decimal
import enum
import gzip
import ipaddress
import json
import uuid
from typing import Annotated, Callable, Literal

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from fastapi import APIRouter, Body, FastAPI, File, Form, Header, Path, Query, Request, UploadFile
from fastapi.routing import APIRoute
from pydantic import (AliasChoices, AnyUrl, BaseModel, ConfigDict, Field, HttpUrl, IPvAnyAddress, SecretStr, StringConstraints,
                      conint, create_model)
from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route

from otel_lock import LockMiddleware, locked

try:
    from ._middleware_helpers import client_for, lock_key, make_manager, metered, problem, run_lifespan
except ImportError:
    from _middleware_helpers import client_for, lock_key, make_manager, metered, problem, run_lifespan


class Shelf:
    """Stock whose read-modify-write oversells without a lock (the await is the slow part of a purchase)."""

    def __init__(self, stock: int = 1) -> None:
        self.stock = stock
        self.sold = 0
        self.keys: list[str] = []

    async def buy(self, request: Request) -> JSONResponse:
        self.keys.append(request.state.lock.key)
        left = self.stock
        await asyncio.sleep(0.02)
        if left <= 0:
            return JSONResponse({"sold": False}, status_code=409)
        self.stock = left - 1
        self.sold += 1
        return JSONResponse({"sold": True, "key": request.state.lock.key})


class Purchase(BaseModel):
    product_id: int = Field(validation_alias=AliasChoices("productId", "pid"))
    quantity: int = 1


class Line(BaseModel):
    sku: str
    qty: int = 1


class Basket(BaseModel):
    customer: Annotated[int, Field(alias="customerId")]
    lines: list[Line]


class Order(BaseModel):
    basket: Basket


class Filters(BaseModel):
    tenant: int
    page: int = 1


JSON = {"content-type": "application/json"}


def shop(manager, shelf: Shelf, template: str, handler_kind: str = "model") -> FastAPI:
    app = FastAPI()

    if handler_kind == "model":
        @app.post("/buy")
        @locked(template, wait=5)
        async def buy(purchase: Purchase, request: Request):
            return await shelf.buy(request)
    else:
        @app.post("/buy")
        @locked(template, wait=5)
        async def buy_embedded(purchase: Annotated[Purchase, Body(embed=True)], request: Request):
            return await shelf.buy(request)

    app.add_middleware(LockMiddleware, manager=manager)
    return app


@pytest.mark.parametrize("template, kind", [
    ("stock:{json.pid}", "model"), ("stock:{json.productId}", "model"), ("stock:{json.product_id}", "model"),
    ("stock:{json.purchase.pid}", "embedded"),
])
async def test_every_alias_choice_and_spelling_is_one_lock_one_sale(redis_url, template, kind):
    shelf = Shelf(stock=1)
    wrap = (lambda b: {"purchase": b}) if kind == "embedded" else (lambda b: b)
    bodies = [{"pid": "07"}, {"pid": 7}, {"productId": 7}, {"productId": "7.0"}, {"pid": " 7"}]
    async with make_manager(redis_url) as manager:
        async with client_for(shop(manager, shelf, template, kind)) as client:
            answers = await asyncio.gather(*(client.post("/buy", json=wrap(b)) for b in bodies))
    assert sorted(r.status_code for r in answers) == [200, 409, 409, 409, 409], [r.text for r in answers]
    assert shelf.sold == 1
    prefix = "stock:"
    assert set(shelf.keys) == {lock_key(prefix + "7")}


async def test_a_value_that_fails_validation_is_not_locked_and_gets_fastapis_422(redis_url, redis_client):
    shelf = Shelf()
    async with make_manager(redis_url) as manager:
        async with client_for(shop(manager, shelf, "stock:{json.pid}")) as client:
            answers = [await client.post("/buy", json=body) for body in
                       ({"pid": "abc"}, {"nothing": 1}, [1], {"pid": 7, "quantity": "many"})]
            answers.append(await client.post("/buy", content=b"{not json", headers=JSON))
    assert [r.status_code for r in answers] == [422] * 5, [r.text for r in answers]
    assert all(r.headers["content-type"] == "application/json" for r in answers)  # FastAPI's own answer
    assert shelf.keys == [] and await redis_client.keys("*") == []


async def test_alias_query_header_and_parameter_model_values_are_the_handlers(redis_url):
    async with make_manager(redis_url) as manager:
        app = FastAPI()

        @app.get("/items")
        @locked("item:{query.item-id}:{query.n}:{header.x-tenant}:{header.x_region}")
        async def items(n: Annotated[int, Query(alias="count")], request: Request,
                        item_id: Annotated[int, Query(alias="item-id")],
                        x_tenant: Annotated[int, Header()], x_region: Annotated[str, Header()] = "eu"):
            return {"key": request.state.lock.key, "item_id": item_id, "n": n}

        @app.get("/reports")
        @locked("report:{query.tenant}:{query.page}")
        async def reports(filters: Annotated[Filters, Query()], request: Request):
            return {"key": request.state.lock.key}

        app.add_middleware(LockMiddleware, manager=manager)
        async with client_for(app) as client:
            a = await client.get("/items", params={"item-id": "007", "count": "+3"}, headers={"x-tenant": "05"})
            b = await client.get("/items", params={"item-id": "7", "count": "3"},
                                 headers={"x-tenant": "5", "x-region": "us"})
            c = await client.get("/reports", params={"tenant": "09"})
            d = await client.get("/items", params={"item-id": "x", "count": "3"}, headers={"x-tenant": "5"})
    assert a.json()["key"] == lock_key("item:7:3:5:eu"), a.text     # the default the handler receives
    assert b.json()["key"] == lock_key("item:7:3:5:us"), b.text
    assert c.json()["key"] == lock_key("report:9:1"), c.text
    assert d.status_code == 422


async def test_nested_models_lists_and_aliases_inside_them(redis_url):
    async with make_manager(redis_url) as manager:
        app = FastAPI()

        @app.post("/orders")
        @locked("order:{json.basket.customerId}:{json.basket.lines.0.sku}")
        async def order(body: Order, request: Request):
            return {"key": request.state.lock.key}

        app.add_middleware(LockMiddleware, manager=manager)
        async with client_for(app) as client:
            a = await client.post("/orders", json={"basket": {"customerId": "042", "lines": [{"sku": "a:b"}]}})
            b = await client.post("/orders", json={"basket": {"customerId": 42, "lines": []}})
    assert a.json()["key"] == lock_key("order:42:a%3Ab")
    # No first line: the key cannot be built. The client's mistake, not the template's.
    assert b.status_code == 400 and problem(b)["type"] == "lock-key-invalid"


async def test_form_values_are_locked_as_the_handler_receives_them(redis_url):
    shelf = Shelf(stock=1)
    async with make_manager(redis_url) as manager:
        app = FastAPI()

        @app.post("/buy")
        @locked("stock:{form.pid}", wait=5)
        async def buy(product_id: Annotated[int, Form(alias="pid")], request: Request):
            return await shelf.buy(request)

        app.add_middleware(LockMiddleware, manager=manager)
        async with client_for(app) as client:
            forms = [{"pid": "07"}, {"pid": "7"}, {"pid": "+7"}]
            urlencoded = [client.post("/buy", data=f) for f in forms]
            multipart = [client.post("/buy", data={"pid": "7.0"}, files={"note": ("n.txt", b"x")})]
            answers = await asyncio.gather(*urlencoded, *multipart)
            invalid = await client.post("/buy", data={"pid": "seven"})
    assert sorted(r.status_code for r in answers) == [200, 409, 409, 409], [r.text for r in answers]
    assert shelf.sold == 1 and set(shelf.keys) == {lock_key("stock:7")}
    assert invalid.status_code == 422


class Signup(BaseModel):
    email: str
    plan: str = "free"


async def test_form_models_and_upload_metadata(redis_url):
    async with make_manager(redis_url) as manager:
        app = FastAPI()

        @app.post("/signup")
        @locked("signup:{form.email}:{form.plan}")
        async def signup(data: Annotated[Signup, Form()], request: Request):
            return {"key": request.state.lock.key}

        @app.post("/upload")
        @locked("upload:{form.doc.filename}:{form.doc.size}")
        async def upload(doc: Annotated[UploadFile, File()], request: Request):
            return {"key": request.state.lock.key, "read": len(await doc.read())}

        app.add_middleware(LockMiddleware, manager=manager)
        async with client_for(app) as client:
            a = await client.post("/signup", data={"email": "a@b.example"})
            b = await client.post("/upload", files={"doc": ("report.pdf", b"%PDF" * 10, "application/pdf")})
    assert a.json()["key"] == lock_key("signup:a%40b.example:free")
    assert b.json() == {"key": lock_key("upload:report.pdf:40"), "read": 40}  # the handler still reads it all


async def test_a_form_within_fastapis_form_limits_is_locked_not_refused(redis_url):
    """Forms were parsed with Starlette's default limits, not the app's, router's or route's `form_limits`:
    1,500 fields (or a 2 MiB field) that FastAPI accepts were judged invalid, left unlocked, and the
    handler refused to run (500 lock-binding-mismatch)."""
    async with make_manager(redis_url) as manager:
        app = FastAPI(form_limits={"max_part_size": 4 * 1024 * 1024})
        router = APIRouter(form_limits={"max_fields": 5000})

        @router.post("/survey")
        @locked("survey:{form.name}", max_body=4 * 1024 * 1024)
        async def survey(name: Annotated[str, Form()], request: Request):
            return {"key": request.state.lock.key}

        @app.post("/note", form_limits={"max_fields": 5000})
        @locked("note:{form.name}", max_body=4 * 1024 * 1024)
        async def note(name: Annotated[str, Form()], text: Annotated[str, Form()], request: Request):
            return {"key": request.state.lock.key, "length": len(text)}

        @app.post("/small", form_limits={"max_fields": 2})
        @locked("small:{form.name}")
        async def small(name: Annotated[str, Form()]):
            return {}

        app.include_router(router, prefix="/r")
        app.add_middleware(LockMiddleware, manager=manager)
        many = {"name": "ann", **{f"q{i}": "x" for i in range(1500)}}
        async with client_for(app) as client:
            fields = await client.post("/r/survey", data=many)
            routes = await client.post("/note", data=many)
            large = await client.post("/note", files={"name": (None, "ann"), "text": (None, "x" * 2 * 1024 * 1024)})
            over = await client.post("/small", data={"name": "ann", "a": "1", "b": "2"})
    assert fields.json() == {"key": lock_key("survey:ann")}
    assert routes.status_code == 422   # no `text`: FastAPI's own answer, not a refusal
    assert large.json() == {"key": lock_key("note:ann"), "length": 2 * 1024 * 1024}
    assert over.status_code == 400     # the route's own, smaller limit: FastAPI's answer


async def test_a_starlette_route_reads_raw_form_fields(redis_url):
    async def handler(request):
        form = await request.form()
        return JSONResponse({"key": request.state.lock.key, "sku": form["sku"]})

    async with make_manager(redis_url) as manager:
        app = Starlette(routes=[Route("/s", locked("sku:{form.sku}")(handler), methods=["POST"])])
        app.add_middleware(LockMiddleware, manager=manager)
        async with client_for(app) as client:
            a = await client.post("/s", data={"sku": "A 1"})
            b = await client.post("/s", files={"sku": (None, b"B2")})
            c = await client.post("/s", data={"other": "x"})
    assert a.json() == {"key": lock_key("sku:A%201"), "sku": "A 1"}
    assert b.json()["key"] == lock_key("sku:B2")
    assert c.status_code == 400 and problem(c)["type"] == "lock-key-invalid"


class GzipRequest(Request):
    """FastAPI's documented recipe (docs: "Custom Request and APIRoute class")."""

    async def body(self) -> bytes:
        if not hasattr(self, "_body"):
            body = await super().body()
            if "gzip" in self.headers.getlist("Content-Encoding"):
                body = gzip.decompress(body)
            self._body = body
        return self._body


class GzipRoute(APIRoute):
    def get_route_handler(self) -> Callable:
        original_route_handler = super().get_route_handler()

        async def custom_route_handler(request: Request):
            request = GzipRequest(request.scope, request.receive)
            return await original_route_handler(request)

        return custom_route_handler


async def test_gzip_bodies_of_the_documented_route_class_recipe_are_one_lock(redis_url, redis_client):
    shelf = Shelf(stock=1)
    async with make_manager(redis_url) as manager:
        app = FastAPI()
        app.router.route_class = GzipRoute

        @app.post("/buy")
        @locked("stock:{json.pid}", wait=5)
        async def buy(purchase: Purchase, request: Request):
            return await shelf.buy(request)

        app.add_middleware(LockMiddleware, manager=manager)
        assert (await run_lifespan(app))[0]["type"] == "lifespan.startup.complete"
        async with client_for(app) as client:
            zipped = [client.post("/buy", content=gzip.compress(json.dumps(b).encode()),
                                  headers={**JSON, "content-encoding": "gzip"})
                      for b in ({"pid": "07"}, {"productId": 7})]
            plain = [client.post("/buy", json={"pid": 7.0})]
            answers = await asyncio.gather(*zipped, *plain)
            invalid = await client.post("/buy", content=gzip.compress(b'{"pid": "x"}'),
                                        headers={**JSON, "content-encoding": "gzip"})
    assert sorted(r.status_code for r in answers) == [200, 409, 409], [r.text for r in answers]
    assert shelf.sold == 1 and set(shelf.keys) == {lock_key("stock:7")}
    assert invalid.status_code == 422
    assert await redis_client.keys("*:{stock:7}") == []


def _mistake(handler_factory) -> FastAPI:
    app = FastAPI()
    handler_factory(app)
    return app


def json_on_form(app):
    @app.post("/signup")
    @locked("signup:{json.email}")
    async def signup(email: Annotated[str, Form()]):
        return {}


def form_on_json(app):
    @app.post("/buy")
    @locked("stock:{form.pid}")
    async def buy(purchase: Purchase):
        return {}


def unknown_field(app):
    @app.post("/buy")
    @locked("stock:{json.sku}")
    async def buy(purchase: Purchase):
        return {}


def whole_model(app):
    @app.post("/orders")
    @locked("order:{json.basket}")
    async def order(body: Order):
        return {}


def whole_upload(app):
    @app.post("/upload")
    @locked("upload:{form.doc}")
    async def upload(doc: UploadFile):
        return {}


def optional_param(app):
    @app.get("/items")
    @locked("items:{query.tenant}")
    async def items(tenant: str | None = None):
        return {}


def list_without_index(app):
    @app.post("/orders")
    @locked("order:{json.basket.lines.sku}")
    async def order(body: Order):
        return {}


def gzip_header_not_an_argument(app):
    app.router.route_class = GzipRoute

    @app.post("/buy")
    @locked("stock:{json.pid}:{header.x-shop}")
    async def buy(purchase: Purchase):
        return {}


def gzip_generator_handler(app):
    app.router.route_class = GzipRoute

    @app.post("/buy")
    @locked("stock:{json.pid}")
    def buy(purchase: Purchase):
        yield {}


@pytest.mark.parametrize("factory, route, words", [
    (json_on_form, "/signup", "write {form.email}"),
    (form_on_json, "/buy", "write {json.pid}"),
    (unknown_field, "/buy", "Purchase has no field 'sku' (its fields: product_id (productId, pid), quantity)"),
    (whole_model, "/orders", "not one value"),
    (whole_upload, "/upload", "{form.doc.filename}"),
    (optional_param, "/items", "write {query.tenant?} to lock on it when there is one"),
    (list_without_index, "/orders", "is a list: index it"),
    (gzip_header_not_an_argument, "/buy", "{header.x-shop} is not among the handler's own parameters"),
    (gzip_generator_handler, "/buy", "a generator handler cannot be held around"),
], ids=lambda v: v.__name__ if callable(v) else None)
async def test_what_cannot_be_bound_fails_the_start_up_naming_route_and_fix(redis_url, factory, route, words):
    async with make_manager(redis_url) as manager:
        app = _mistake(factory)
        app.add_middleware(LockMiddleware, manager=manager)
        messages = await run_lifespan(app)
    assert messages[0]["type"] == "lifespan.startup.failed"
    assert f"route {route}" in messages[0]["message"] and words in messages[0]["message"], messages[0]["message"]


async def test_without_lifespan_an_unbindable_route_answers_500_and_never_400(redis_url, redis_client):
    async with make_manager(redis_url) as manager:
        app = _mistake(json_on_form)
        app.add_middleware(LockMiddleware, manager=manager)
        async with client_for(app) as client:
            response = await client.post("/signup", data={"email": "a@b"})
    assert response.status_code == 500
    assert problem(response)["type"] == "lock-annotation-invalid" and "{form.email}" in problem(response)["detail"]
    assert await redis_client.keys("*") == []


async def test_a_value_fastapi_rejects_is_counted_nowhere_and_takes_no_lock(redis_url):
    provider, reader = metered()
    async with make_manager(redis_url, meter_provider=provider) as manager:
        async with client_for(shop(manager, Shelf(), "stock:{json.pid}")) as client:
            assert (await client.post("/buy", json={"pid": "x"})).status_code == 422
    data = reader.get_metrics_data()
    names = {m.name for rm in (data.resource_metrics if data else []) for sm in rm.scope_metrics for m in sm.metrics}
    assert "otel_lock.wait.duration" not in names


def list_param(app):
    @app.get("/items")
    @locked("items:{query.tag}")
    async def items(tag: Annotated[list[str], Query()]):
        return {}


async def test_a_placeholder_naming_a_list_parameter_fails_the_start_up(redis_url):
    async with make_manager(redis_url) as manager:
        app = _mistake(list_param)
        app.add_middleware(LockMiddleware, manager=manager)
        messages = await run_lifespan(app)
    assert messages[0]["type"] == "lifespan.startup.failed"
    assert "route /items" in messages[0]["message"] and "not one value" in messages[0]["message"]


# -- equal for the handler means the same key; keys that start up never blame the client


def replica(manager, shelf: Shelf) -> FastAPI:
    """One replica of a shop whose handlers read the number as JSON does: 7 and 7.0 are one product."""
    app = FastAPI()
    router = APIRouter(prefix="/shop")

    @router.post("/buy")
    @locked("stock:{json.product}", wait=5)
    async def buy(request: Request):
        await request.json()
        return await shelf.buy(request)

    @router.post("/buy-typed")
    @locked("stock:{json.product}", wait=5)
    async def buy_typed(product: Annotated[float, Body(embed=True)], request: Request):
        return await shelf.buy(request)

    app.include_router(router)
    app.add_middleware(LockMiddleware, manager=manager)
    return app


async def test_7_and_7_0_of_a_raw_json_body_are_one_lock_no_oversell(redis_url):
    """Regression test: raw JSON numbers rendered with str(): `7` and `7.0` were two locks and two sales."""
    shelf = Shelf(stock=1)          # one database behind two replicas
    async with make_manager(redis_url) as one, make_manager(redis_url) as two:
        async with client_for(replica(one, shelf)) as a, client_for(replica(two, shelf)) as b:
            spellings = [b"7", b"7.0", b"7.00", b"70e-1", b"0.7E1"]
            answers = await asyncio.gather(*((a, b)[i % 2].post("/shop/buy", content=b'{"product": %s}' % s,
                                                                 headers=JSON) for i, s in enumerate(spellings)),
                                           b.post("/shop/buy-typed", json={"product": 7.0}))
    assert sorted(r.status_code for r in answers) == [200] + [409] * 5, [r.text for r in answers]
    assert shelf.sold == 1 and set(shelf.keys) == {lock_key("stock:7")}


async def test_fractions_a_double_cannot_tell_apart_are_one_lock_as_the_handler_reads_them(redis_url):
    """Regression test: raw JSON fractions were keyed exactly (`7.0000000000000001`), while the handler's
    `request.json()` reads them as the double 7.0: four spellings of product 7 were four locks, four sales."""
    shelf = Shelf(stock=1)
    async with make_manager(redis_url) as one, make_manager(redis_url) as two:
        async with client_for(replica(one, shelf)) as a, client_for(replica(two, shelf)) as b:
            spellings = [b"7", b"7.0000000000000001", b"6.9999999999999999", b"7.00000000000000001"]
            answers = await asyncio.gather(*((a, b)[i % 2].post("/shop/buy", content=b'{"product": %s}' % s,
                                                                 headers=JSON) for i, s in enumerate(spellings)))
    assert sorted(r.status_code for r in answers) == [200] + [409] * 3, [r.text for r in answers]
    assert shelf.sold == 1 and set(shelf.keys) == {lock_key("stock:7")}


@pytest.mark.parametrize("strict, where", [(True, "app"), (False, "app"), (False, "router")])
async def test_a_body_without_content_type_is_locked_only_where_fastapi_reads_it_as_json(redis_url, strict, where):
    """Regression test: FastAPI (`strict_content_type`, its default) answers 422 to a JSON body sent without a
    Content-Type, but the middleware read it as JSON and locked it: with the key busy, the client waited and got
    409 lock-timeout instead of FastAPI's 422. A route that is not strict reads it as JSON, and is locked."""
    if "strict_content_type" not in FastAPI.__init__.__code__.co_varnames:
        pytest.skip("this FastAPI has no strict_content_type: it reads such a body as JSON, and so do we")
    async with make_manager(redis_url) as manager, make_manager(redis_url) as other:
        app = FastAPI(strict_content_type=strict if where == "app" else True)
        router = APIRouter(strict_content_type=strict) if where == "router" else app.router

        @router.post("/buy")
        @locked("stock:{json.product_id}", wait=0.2)
        async def buy(purchase: Purchase):
            return {"bought": purchase.product_id}

        if where == "router":
            app.include_router(router)
        app.add_middleware(LockMiddleware, manager=manager)
        held = await other.acquire("stock:7")
        try:
            async with client_for(app) as client:
                answer = await client.post("/buy", content=b'{"pid": 7}')
        finally:
            await held.release()
    assert "content-type" not in {k.lower() for k in answer.request.headers}
    if strict:
        assert answer.status_code == 422 and "detail" in answer.json(), answer.text   # FastAPI's own answer
    else:
        assert answer.status_code == 409 and answer.json()["type"].endswith("lock-timeout"), answer.text


class Booking(BaseModel):
    room: int
    at: datetime.datetime


async def test_one_slot_at_two_utc_offsets_is_one_booking(redis_url):
    """Regression test: `09:00Z` and `10:00+01:00` (one slot) were two keys, and both clients were told "booked"."""
    shelf = Shelf(stock=1)
    async with make_manager(redis_url) as manager:
        app = FastAPI()

        @app.post("/bookings")
        @locked("slot:{json.room}:{json.at}", wait=5)
        async def book(booking: Booking, request: Request):
            return await shelf.buy(request)

        app.add_middleware(LockMiddleware, manager=manager)
        async with client_for(app) as client:
            answers = await asyncio.gather(*(client.post("/bookings", json={"room": 1, "at": at})
                                             for at in ("2026-03-01T09:00:00Z", "2026-03-01T10:00:00+01:00",
                                                        "2026-03-01T04:00-05:00")))
    assert sorted(r.status_code for r in answers) == [200, 409, 409], [r.text for r in answers]
    assert set(shelf.keys) == {lock_key("slot:1:2026-03-01T09%3A00%3A00Z")}


class Level(str, enum.Enum):
    LOW = "low"


@pytest.mark.parametrize("route, signature", [
    ("/items/{item_id}", "plain"), ("/items/{id}", "alias"), ("/items/{item_id:int}", "convertor"),
])
async def test_a_typed_path_value_is_locked_as_the_handler_receives_it(redis_url, redis_client, route, signature):
    """The path parameter's value is validated by the field itself (the fast way): same keys, same 422s."""
    async with make_manager(redis_url) as manager:
        app = FastAPI()
        template = "item:{path.id}" if signature == "alias" else "item:{path.item_id}"
        if signature == "alias":
            @app.post(route)
            @locked(template)
            async def item_aliased(item_id: Annotated[int, Path(alias="id", gt=0)], request: Request):
                return {"key": request.state.lock.key, "id": item_id}
        else:
            @app.post(route)
            @locked(template)
            async def item(item_id: Annotated[int, Path(gt=0)], request: Request):
                return {"key": request.state.lock.key, "id": item_id}

        app.add_middleware(LockMiddleware, manager=manager)
        async with client_for(app) as client:
            answers = [await client.post(f"/items/{v}") for v in ("07", "7", "abc", "0", "-1")]
    good, bad = answers[:2], answers[2:]
    assert [r.status_code for r in good] == [200, 200], [r.text for r in answers]
    assert good[0].json() == good[1].json() == {"key": lock_key("item:7"), "id": 7}
    # What the route refuses (not a number, not > 0, or no route for it at all) is FastAPI's answer: nothing locked.
    assert all(r.status_code in (404, 422) for r in bad), [r.text for r in bad]
    assert all(r.headers["content-type"] == "application/json" for r in bad)
    left = await redis_client.keys("*")
    assert sorted(left) == [b"mwtest:model", b"mwtest:{item:7}:fence"], left   # only the good requests' lock



SCALARS = [   # a type FastAPI can declare, two spellings of one value a client may send
    (HttpUrl, "HTTP://Shop.Example:80/a", "http://shop.example/a"),
    (AnyUrl, "https://Example.com", "https://example.com/"),
    (ipaddress.IPv4Address, "10.0.0.1", "10.0.0.1"),
    (ipaddress.IPv6Address, "2001:DB8::1", "2001:db8:0:0:0:0:0:1"),
    (IPvAnyAddress, "::FFFF:1.2.3.4", "::ffff:102:304"),
    (datetime.timedelta, "PT1H", 3600),
    (datetime.time, "09:00Z", "10:00+01:00"),
    (datetime.date, "2026-03-01", "2026-03-01"),
    (decimal.Decimal, "7.50", 7.5),
    (uuid.UUID, "0000000A-0000-0000-0000-000000000001", "0000000a000000000000000000000001"),
    (Level, "low", "low"),
    (Literal["a", "b"], "a", "a"),
    (Annotated[str, StringConstraints(max_length=8)], "x", "x"),
    (conint(gt=0), "7", 7.0),
    (bool, "true", 1),
]


@pytest.mark.parametrize("kind, first, second", SCALARS, ids=lambda v: getattr(v, "__name__", None) or str(v)[:20])
async def test_every_scalar_type_fastapi_declares_starts_up_and_gives_one_key(redis_url, kind, first, second):
    """Regression test: HttpUrl, IPv4Address and timedelta passed the start-up check, then answered 400."""
    model = create_model("Body", value=(kind, ...))
    async with make_manager(redis_url) as manager:
        app = FastAPI()

        async def things(body, request: Request):
            return {"key": request.state.lock.key}

        things.__annotations__["body"] = model    # a real class: this module's annotations are strings
        app.post("/things")(locked("thing:{json.value}")(things))
        app.add_middleware(LockMiddleware, manager=manager)
        assert (await run_lifespan(app))[0]["type"] == "lifespan.startup.complete"
        async with client_for(app) as client:
            a = await client.post("/things", json={"value": first})
            b = await client.post("/things", json={"value": second})
    assert a.status_code == b.status_code == 200, (a.text, b.text)
    assert a.json()["key"] == b.json()["key"]


@pytest.mark.parametrize("kind, fix", [(SecretStr, "a secret"), (bytes, "bytes"), (dict[str, int], "an object"),
                                       (frozenset[int], "an object or a list")])
async def test_a_type_with_no_canonical_text_fails_the_start_up_naming_a_fix(redis_url, kind, fix):
    model = create_model("Body", value=(kind, ...))

    def handler(app):
        async def things(body):
            return {}

        things.__annotations__["body"] = model
        app.post("/things")(locked("thing:{json.value}")(things))

    async with make_manager(redis_url) as manager:
        app = _mistake(handler)
        app.add_middleware(LockMiddleware, manager=manager)
        messages = await run_lifespan(app)
    assert messages[0]["type"] == "lifespan.startup.failed"
    assert "route /things" in messages[0]["message"] and fix in messages[0]["message"], messages[0]["message"]


class Subscribe(BaseModel):
    list_id: int
    email: str | None = None


def optional_email(template: str):
    def handler(app):
        @app.post("/subscribe")
        @locked(template)
        async def subscribe(body: Subscribe, request: Request):
            return {"key": request.state.lock.key}
    return handler


async def test_an_optional_field_is_named_as_such_at_start_up_and_locked_with_a_fallback(redis_url):
    """Regression test: a field `X | None = None` was reported as having "no default"."""
    async with make_manager(redis_url) as manager:
        refused = _mistake(optional_email("sub:{json.email|casefold}"))
        refused.add_middleware(LockMiddleware, manager=manager)
        failed = (await run_lifespan(refused))[0]
        app = _mistake(optional_email("sub:{json.list_id}:{json.email?|casefold}"))
        app.add_middleware(LockMiddleware, manager=manager)
        assert (await run_lifespan(app))[0]["type"] == "lifespan.startup.complete"
        async with client_for(app) as client:
            sent = await client.post("/subscribe", json={"list_id": 1, "email": "Ann@Example.com"})
            same = await client.post("/subscribe", json={"list_id": 1, "email": "ann@example.COM"})
            absent = await client.post("/subscribe", json={"list_id": 1})
            null = await client.post("/subscribe", json={"list_id": 1, "email": None})
    assert failed["type"] == "lifespan.startup.failed"
    assert "no default" not in failed["message"] and "its default is None" in failed["message"]
    assert "{json.email?|casefold}" in failed["message"], failed["message"]
    assert sent.json()["key"] == same.json()["key"] == lock_key("sub:1:ann%40example.com")
    assert absent.json()["key"] == null.json()["key"] == lock_key("sub:1:%n")


async def test_an_optional_header_and_query_value_fall_back_to_the_marker(redis_url):
    async with make_manager(redis_url) as manager:
        app = FastAPI()

        @app.get("/feed")
        @locked("feed:{header.x-tenant?}:{query.page?}")
        async def feed(request: Request, x_tenant: Annotated[str | None, Header()] = None):
            return {"key": request.state.lock.key}

        app.add_middleware(LockMiddleware, manager=manager)
        async with client_for(app) as client:
            bare = await client.get("/feed")
            full = await client.get("/feed", params={"page": "2"}, headers={"x-tenant": "acme"})
    assert bare.json()["key"] == lock_key("feed:%n:%n"), bare.text
    assert full.json()["key"] == lock_key("feed:acme:2"), full.text


class Spelled(BaseModel):
    model_config = ConfigDict(extra="allow")     # {json.raw}: whatever JSON value the client sent
    qty: int
    price: float
    amount: decimal.Decimal
    at: datetime.datetime


def _spelled_binding():
    from fastapi.routing import APIRoute as Route_

    from otel_lock.asgi._binding import RouteBinding
    from otel_lock.asgi._keys import parse_template

    app = FastAPI()

    @app.post("/q")
    async def spelled(order: Spelled):
        return {}

    route = next(r for r in app.routes if isinstance(r, Route_))
    template = parse_template("q:{json.qty}:{json.price}:{json.amount}:{json.at}:{json.raw}")
    return template, RouteBinding(template, route.dependant)


SPELLED = _spelled_binding()


@settings(max_examples=60, deadline=None)
@given(qty=st.integers(-10**6, 10**6), mantissa=st.integers(-10**6, 10**6), exponent=st.integers(-4, 4),
       moment=st.datetimes(min_value=datetime.datetime(2000, 1, 2), max_value=datetime.datetime(2100, 1, 1)),
       offsets=st.lists(st.integers(-14 * 60, 14 * 60), min_size=2, max_size=2), pick=st.randoms())
def test_equivalent_spellings_through_fastapis_own_validation_are_one_key(qty, mantissa, exponent, moment,
                                                                          offsets, pick):
    """As a property: what the handler cannot tell apart gives one key."""
    template, binding = SPELLED
    number = decimal.Decimal(mantissa).scaleb(exponent)
    numbers = [format(number, "f"), format(number.quantize(decimal.Decimal(1).scaleb(exponent - 2)), "f"),
               f"{mantissa}e{exponent}", f"{mantissa * 100}E{exponent - 2:+d}"]
    integers = [str(qty), f"{qty}.0", f"{qty}e0", f'"{qty}"', f"{qty * 10}e-1"]
    instant = moment.replace(tzinfo=datetime.timezone.utc)
    instants = [instant.isoformat()] + [
        instant.astimezone(datetime.timezone(datetime.timedelta(minutes=m))).isoformat() for m in offsets]
    keys = set()
    for _ in range(4):
        body = ('{"qty": %s, "price": %s, "amount": %s, "at": "%s", "raw": %s}' % (
            pick.choice(integers), pick.choice(numbers), pick.choice(numbers), pick.choice(instants),
            pick.choice(numbers))).encode()
        scope = {"type": "http", "method": "POST", "path": "/q", "query_string": b"",
                 "headers": [(b"content-type", b"application/json")]}
        values = asyncio.run(binding.request_values(scope, body))
        assert isinstance(values, dict), body
        keys.add(template.render(values.__getitem__))
    assert len(keys) == 1, keys


async def test_a_list_query_parameter_fails_the_start_up_with_a_fix_that_works(redis_url):
    """Regression test: the start-up said to write {query.ids.0} or {query.ids.<field>}, which the decorator
    then refuses (only a body's values take steps): the message names what does work."""
    async with make_manager(redis_url) as manager:
        app = FastAPI()

        @app.post("/items")
        @locked("items:{query.ids}")
        async def items(ids: Annotated[list[int], Query()]):
            return {"ids": ids}

        app.add_middleware(LockMiddleware, manager=manager)
        messages = await run_lifespan(app)
    assert messages[0]["type"] == "lifespan.startup.failed"
    assert "lock_all" in messages[0]["message"] and "{json.ids.*}" in messages[0]["message"]
    assert ".0 for" not in messages[0]["message"]
    locked("items:{json.ids.*}")  # the template it suggests is one the decorator takes
