"""The demo shop in-process (httpx ASGITransport, real Redis): answers, fencing, bad input."""

from __future__ import annotations

import json
from urllib.parse import quote

import httpx
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from otel_lock import LockManager
from otel_lock.asgi._problem import TYPE_BASE
from otel_lock.demo import DemoSettings, create_app
from otel_lock.demo import _app
from otel_lock.demo._store import Store

USER = {"X-User-Id": "alice"}


def shop(redis_url: str, **options) -> tuple:
    app = create_app(DemoSettings(redis_url=redis_url, namespace="t", job_interval=0, **options))
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://shop")
    return app, client


@pytest.fixture
async def client(redis_url):
    app, http = shop(redis_url)
    async with http:
        yield http
    await app.state.shop.locks.aclose()


def kind(response: httpx.Response) -> str:
    """The case name of a problem answer, whose `type` is the library's absolute tag: URI."""
    assert response.headers["content-type"] == "application/problem+json", response.text
    type_uri = response.json()["type"]
    assert type_uri.startswith(TYPE_BASE), type_uri
    return type_uri[len(TYPE_BASE):]


@pytest.mark.parametrize("deduct", ["deduct", "deduct-atomic"])
async def test_stock_put_get_deduct_and_sold_out(client, deduct):
    assert (await client.put("/api/stock/p1", json={"stock": 3})).json() == {"product_id": "p1", "stock": 3}
    assert (await client.get("/api/stock/p1")).json() == {"product_id": "p1", "stock": 3}
    assert (await client.post(f"/api/stock/p1/{deduct}")).json() == {"product_id": "p1", "stock": 2}
    assert (await client.post(f"/api/stock/p1/{deduct}", json={"quantity": 2})).json()["stock"] == 0
    sold_out = await client.post(f"/api/stock/p1/{deduct}")
    assert sold_out.status_code == 409 and kind(sold_out) == "out-of-stock"
    assert "out-of-stock" in sold_out.json()["type"] and "0 left" in sold_out.json()["detail"]
    assert (await client.get("/api/stock/p1")).json()["stock"] == 0


async def test_atomic_deduct_never_oversells_even_with_locks_off(redis_url):
    # The script needs no lock: with every lock removed, 60 concurrent buyers of 20 items sell 20.
    import asyncio

    app, client = shop(redis_url, locks_enabled=False, work=0.005)
    async with client:
        await client.put("/api/stock/p1", json={"stock": 20})
        answers = await asyncio.gather(*(client.post("/api/stock/p1/deduct-atomic") for _ in range(60)))
        left = (await client.get("/api/stock/p1")).json()["stock"]
    await app.state.shop.locks.aclose()
    sold = [a.json()["stock"] for a in answers if a.status_code == 200]
    assert sorted(sold) == list(range(20)) and left == 0
    assert sum(a.status_code == 409 and kind(a) == "out-of-stock" for a in answers) == 40


async def test_orders_are_scoped_to_the_demo_principal_x_user_id(client):
    await client.put("/api/stock/p1", json={"stock": 5})
    key = {"Idempotency-Key": '"same-key"'}
    alice = await client.post("/api/orders", json={"product_id": "p1"}, headers={**key, "X-User-Id": "alice"})
    bob = await client.post("/api/orders", json={"product_id": "p1"}, headers={**key, "X-User-Id": "bob"})
    assert alice.status_code == bob.status_code == 201
    assert bob.json()["user"] == "bob" and "idempotent-replayed" not in bob.headers


async def test_order_is_created_once_and_listed(client):
    await client.put("/api/stock/p1", json={"stock": 5})
    headers = {**USER, "Idempotency-Key": '"k-1"'}
    first = await client.post("/api/orders", json={"product_id": "p1", "quantity": 2}, headers=headers)
    assert first.status_code == 201
    order = first.json()
    assert order["user"] == "alice" and order["stock_left"] == 3
    again = await client.post("/api/orders", json={"quantity": 2, "product_id": "p1"}, headers=headers)
    assert again.headers["idempotent-replayed"] == "true" and again.json() == order
    listed = (await client.get("/api/orders", params={"user": "alice"})).json()["orders"]
    assert [o["order_id"] for o in listed] == [order["order_id"]]
    assert (await client.get("/api/stock/p1")).json()["stock"] == 3


@pytest.mark.parametrize("method, path, kwargs, status, problem", [
    ("GET", "/api/stock/nope", {}, 404, "unknown-product"),
    ("POST", "/api/stock/nope/deduct", {}, 404, "unknown-product"),
    ("POST", "/api/stock/nope/deduct-atomic", {}, 404, "unknown-product"),
    ("POST", "/api/stock/p1/deduct-atomic", {"json": {"quantity": 0}}, 400, "invalid-body"),
    ("POST", "/api/stock/p1/deduct-atomic", {"json": {"quantity": "1"}}, 400, "invalid-body"),
    ("POST", "/api/stock/p1/deduct-atomic", {"content": b"{"}, 400, "invalid-json"),
    ("POST", "/api/stock/a%3Ab/deduct-atomic", {}, 400, "invalid-product-id"),
    ("POST", "/api/stock/p1/deduct-atomic", {"json": {"quantity": 11}}, 409, "out-of-stock"),
    ("PUT", "/api/stock/p1", {"content": b"{not json"}, 400, "invalid-json"),
    ("PUT", "/api/stock/p1", {"content": b"[" * 60000}, 400, "invalid-json"),
    ("PUT", "/api/stock/p1", {"json": [1]}, 400, "invalid-body"),
    ("PUT", "/api/stock/p1", {"json": {"stock": -1}}, 400, "invalid-body"),
    ("PUT", "/api/stock/p1", {"json": {"stock": "100"}}, 400, "invalid-body"),
    ("PUT", "/api/stock/p1", {"json": {"stock": True}}, 400, "invalid-body"),
    ("PUT", "/api/stock/p1", {"json": {"stock": 1.5}}, 400, "invalid-body"),
    ("PUT", "/api/stock/p1", {"json": {}}, 400, "invalid-body"),
    ("PUT", "/api/stock/a%3Ab", {"json": {"stock": 1}}, 400, "invalid-product-id"),
    ("POST", "/api/stock/p1/deduct", {"json": {"quantity": 0}}, 400, "invalid-body"),
    ("POST", "/api/stock/p1/deduct", {"content": b"\xff\xfe"}, 400, "invalid-json"),
    ("POST", "/api/stock/p1/deduct", {"content": b"x" * (70 * 1024)}, 413, "request-too-large"),
    ("GET", "/api/orders", {}, 400, "invalid-user-id"),
    ("GET", "/api/orders?user=a%20b", {}, 400, "invalid-user-id"),
    ("POST", "/api/orders", {"json": {"product_id": "p1"}, "headers": USER}, 400, "idempotency-key-missing"),
    ("POST", "/api/orders", {"json": {"product_id": "p1"}, "headers": {"Idempotency-Key": '"k"'}},
     400, "lock-key-invalid"),
    ("POST", "/api/orders", {"json": {"product_id": 7}, "headers": {**USER, "Idempotency-Key": '"k"'}},
     400, "invalid-product-id"),
    ("POST", "/api/orders", {"json": {"product_id": "nope"}, "headers": {**USER, "Idempotency-Key": '"k"'}},
     404, "unknown-product"),
    ("POST", "/api/checkout", {"json": {"items": []}}, 400, "invalid-body"),
    ("POST", "/api/checkout", {"json": {"items": "p1"}}, 400, "lock-key-invalid"),
    ("POST", "/api/checkout", {"json": {"items": [{"quantity": 1}]}}, 400, "lock-key-invalid"),
    ("POST", "/api/checkout", {"json": {"items": [{"sku": "p1", "quantity": 0}]}}, 400, "invalid-body"),
    ("POST", "/api/checkout", {"json": {"items": [{"sku": "p1"}, {"sku": "a b"}]}}, 400, "invalid-product-id"),
    ("POST", "/api/checkout", {"json": {"items": [{"sku": "p1"}, {"sku": "nope"}]}}, 404, "unknown-product"),
    ("POST", "/api/checkout", {"json": {"items": [{"sku": "p1", "quantity": 6}, {"sku": "p1", "quantity": 5}]}},
     409, "out-of-stock"),
    ("POST", "/api/checkout", {"json": {"items": [{"sku": f"p{n}"} for n in range(21)]}}, 422, "lock-keys-too-many"),
    ("POST", "/api/exports", {}, 400, "lock-key-invalid"),
    ("POST", "/api/exports", {"headers": {"X-User-Id": "a b"}}, 400, "invalid-user-id"),
    ("DELETE", "/api/stock/p1", {}, 405, "method-not-allowed"),
    ("GET", "/api/nothing", {}, 404, "not-found"),
], ids=lambda v: v if isinstance(v, str) else None)
async def test_bad_input_gets_a_named_4xx(client, method, path, kwargs, status, problem):
    await client.put("/api/stock/p1", json={"stock": 10})
    response = await client.request(method, path, **kwargs)
    assert response.status_code == status, response.text
    assert kind(response).endswith(problem)
    assert (await client.get("/api/stock/p1")).json()["stock"] == 10


async def test_a_stale_fencing_token_cannot_write(redis_url, redis_client):
    async with LockManager(redis_client, namespace="t") as locks, LockManager(redis_client, namespace="t") as later:
        store = Store(redis_client, "t")
        old = await locks.acquire("stock:p1", lease=60, wait=0)
        await locks.force_release("stock:p1")  # as if its lease had run out during a pause
        new = await later.acquire("stock:p1", lease=60, wait=0)  # another replica takes over
        assert new.token > old.token
        assert await store.put_stock("p1", 10, new.token)
        assert await store.write_stock("p1", 9, new.token) == 1
        assert await store.write_stock("p1", 5, old.token) == 0  # the late writer is refused
        assert await store.get_stock("p1") == 9
        assert await store.write_stock("p2", 5, new.token) == -1
        await new.release()


async def test_tokens_beyond_float_precision_are_compared_exactly(redis_client):
    store = Store(redis_client, "t")
    big = 2**60
    assert await store.put_stock("p1", 10, big + 1)
    assert await store.write_stock("p1", 9, big) == 0
    assert await store.write_stock("p1", 9, big + 2) == 1


async def test_deduct_refused_by_the_fence_answers_409_and_keeps_stock(client, redis_client):
    await client.put("/api/stock/p1", json={"stock": 10})
    # A holder from the future has written: our request's token is older than the fence.
    await redis_client.hset("t:demo:stock:p1", "fence", str(10**30))
    response = await client.post("/api/stock/p1/deduct")
    assert response.status_code == 409 and kind(response) == "stale-fencing-token"
    assert (await client.get("/api/stock/p1")).json()["stock"] == 10


async def test_an_order_waits_for_the_same_product_lock_as_deduct(client, redis_client, monkeypatch):
    monkeypatch.setattr(_app, "LOCK_WAIT", 0.05)
    await client.put("/api/stock/p1", json={"stock": 10})
    async with LockManager(redis_client, namespace="t") as other:
        # Another replica deducting p1 right now, under the route's lock.
        async with other.lock("stock:p1", wait=0):
            busy = await client.post("/api/orders", json={"product_id": "p1"},
                                     headers={**USER, "Idempotency-Key": '"busy-1"'})
    assert busy.status_code == 409 and kind(busy) == "lock-timeout"
    assert busy.headers["retry-after"] == "1"
    assert (await client.get("/api/stock/p1")).json()["stock"] == 10


def _cart(*items: tuple[str, int]) -> dict:
    return {"items": [{"sku": sku, "quantity": quantity} for sku, quantity in items]}


async def _stocks(client, *products: str) -> list[int]:
    return [(await client.get(f"/api/stock/{p}")).json()["stock"] for p in products]


async def test_checkout_buys_every_item_of_the_cart_or_none(client):
    await client.put("/api/stock/a", json={"stock": 5})
    await client.put("/api/stock/b", json={"stock": 1})
    bought = await client.post("/api/checkout", json=_cart(("b", 1), ("a", 2), ("a", 1)))
    assert bought.status_code == 200, bought.text
    assert bought.json()["items"] == [{"sku": "b", "quantity": 1, "stock_left": 0},
                                      {"sku": "a", "quantity": 3, "stock_left": 2}]
    sold_out = await client.post("/api/checkout", json=_cart(("a", 1), ("b", 1)))
    assert sold_out.status_code == 409 and kind(sold_out) == "out-of-stock" and "product b" in sold_out.text
    assert await _stocks(client, "a", "b") == [2, 0]  # a was not deducted either


async def test_checkout_writes_each_product_with_its_own_locks_token(client, redis_client):
    await client.put("/api/stock/a", json={"stock": 5})
    await client.put("/api/stock/b", json={"stock": 5})
    async with LockManager(redis_client, namespace="t") as other:
        for _ in range(3):  # b's lock has been taken more often than a's: its token is ahead
            async with other.lock("stock:b"):
                pass
    assert (await client.post("/api/checkout", json=_cart(("a", 1), ("b", 1)))).status_code == 200
    fences = [int(await redis_client.hget(f"t:demo:stock:{p}", "fence")) for p in "ab"]
    assert fences[0] < fences[1]
    # A holder from the future has written b: the checkout's token for b is refused, nothing oversold.
    await redis_client.hset("t:demo:stock:b", "fence", str(10**30))
    stale = await client.post("/api/checkout", json=_cart(("b", 1)))
    assert stale.status_code == 409 and kind(stale) == "stale-fencing-token"
    assert await _stocks(client, "b") == [4]


async def test_a_checkout_waits_for_every_products_lock_and_takes_none_on_timeout(client, redis_client):
    await client.put("/api/stock/a", json={"stock": 5})
    await client.put("/api/stock/b", json={"stock": 5})
    async with LockManager(redis_client, namespace="t") as other:
        # Another replica deducting b right now, under the stock route's lock (the same key).
        async with other.lock("stock:b", wait=0):
            busy = await client.post("/api/checkout", json=_cart(("a", 1), ("b", 1)))
        assert busy.status_code == 409 and kind(busy) == "lock-timeout"
        async with other.lock("stock:a", wait=0):  # a was released when b timed out
            pass
    assert await _stocks(client, "a", "b") == [5, 5]


async def test_carts_naming_products_in_opposite_orders_neither_oversell_nor_deadlock(redis_url):
    import asyncio

    app, client = shop(redis_url, work=0.002)
    async with client:
        for product in ("a", "b", "c"):
            await client.put(f"/api/stock/{product}", json={"stock": 10})
        carts = [_cart(("a", 1), ("b", 1), ("c", 1)), _cart(("c", 1), ("b", 1), ("a", 1))] * 20
        answers = await asyncio.gather(*(client.post("/api/checkout", json=cart) for cart in carts))
        left = await _stocks(client, "a", "b", "c")
    await app.state.shop.locks.aclose()
    assert sum(a.status_code == 200 for a in answers) == 10
    assert all(a.status_code == 409 and kind(a) == "out-of-stock" for a in answers if a.status_code != 200)
    assert left == [0, 0, 0]


async def test_exports_run_at_most_two_at_once_per_user(client, redis_client):
    await client.put("/api/stock/p1", json={"stock": 5})
    await client.post("/api/orders", json={"product_id": "p1", "quantity": 2},
                      headers={**USER, "Idempotency-Key": '"e-1"'})
    assert (await client.post("/api/exports", headers=USER)).json() == {
        "user": "alice", "orders": 1, "items": 2, "replica": (await client.get("/healthz")).json()["replica"]}
    async with LockManager(redis_client, namespace="t") as other:
        # Two exports of alice's running elsewhere: both permits of her key are taken.
        async with other.semaphore("export:user:alice", permits=2), other.semaphore("export:user:alice", permits=2):
            bob = await client.post("/api/exports", headers={"X-User-Id": "bob"})
            full = await client.post("/api/exports", headers=USER)
    assert bob.status_code == 200 and bob.json()["orders"] == 0  # a limit per user
    assert full.status_code == 429 and kind(full) == "concurrency-limit" and "retry-after" in full.headers
    assert (await client.post("/api/exports", headers=USER)).status_code == 200  # the permits came back


async def test_disabled_locks_take_no_lock(redis_url, monkeypatch):
    monkeypatch.setenv("OTEL_LOCK_DEMO_DISABLE_LOCKS", "1")
    monkeypatch.setenv("OTEL_LOCK_DEMO_WORK_MS", "2")
    settings = DemoSettings.from_env(redis_url=redis_url, namespace="t", job_interval=0)
    assert not settings.locks_enabled and settings.work == 0.002
    app, client = shop(redis_url, locks_enabled=False)
    async with client, LockManager.from_url(redis_url, namespace="t") as other:
        await client.put("/api/stock/p1", json={"stock": 2})
        async with other.lock("stock:p1", wait=0):  # would block a locked shop
            assert (await client.post("/api/stock/p1/deduct")).status_code == 200
    await app.state.shop.locks.aclose()


def test_bad_work_setting_is_named(monkeypatch):
    monkeypatch.setenv("OTEL_LOCK_DEMO_WORK_MS", "slow")
    with pytest.raises(ValueError, match="OTEL_LOCK_DEMO_WORK_MS"):
        DemoSettings.from_env()


async def test_healthz_and_metrics(client):
    health = (await client.get("/healthz")).json()
    assert health["status"] == "ok" and health["namespace"] == "t" and health["redis"]["run_id"]
    assert (await client.put("/api/stock/p9", json={"stock": 1})).status_code == 200
    assert (await client.post("/api/stock/p9/deduct")).status_code == 200  # the lock manager's first use
    [server] = (await client.get("/healthz")).json()["server_checks"]  # what it found of the server
    assert server["ok"] is True and server["version"] and server["refusals"] == []
    metrics = await client.get("/metrics")
    assert metrics.status_code == 200 and metrics.headers["content-type"].startswith("text/plain")


async def test_redis_down_answers_503_then_recovers(fresh_redis):
    app, client = shop(fresh_redis.url)
    async with client:
        assert (await client.put("/api/stock/p1", json={"stock": 1})).status_code == 200
        fresh_redis.stop()
        for response in (await client.get("/healthz"), await client.get("/api/stock/p1"),
                         await client.post("/api/stock/p1/deduct")):
            assert response.status_code == 503, response.text
            assert kind(response) == "redis-unavailable" and response.headers["retry-after"]
        fresh_redis.start()
        assert (await client.put("/api/stock/p1", json={"stock": 1})).status_code == 200
        assert (await client.post("/api/stock/p1/deduct")).status_code == 200
    await app.state.shop.locks.aclose()


async def test_a_demoted_master_answers_503_not_500(fresh_redis):
    """A failover under way: the old master is a replica now and refuses writes (READONLY)."""
    import redis.asyncio as aioredis

    from otel_lock.cli._redis_server import free_port

    app, client = shop(fresh_redis.url)
    admin = aioredis.Redis(port=fresh_redis.port)
    async with client:
        assert (await client.put("/api/stock/p1", json={"stock": 2})).status_code == 200
        await admin.execute_command("REPLICAOF", "127.0.0.1", free_port())  # a master that never answers
        for response in (await client.post("/api/stock/p1/deduct-atomic"), await client.post("/api/stock/p1/deduct")):
            assert response.status_code == 503, response.text
            assert kind(response) == "redis-unavailable" and response.headers["retry-after"]
        assert (await client.get("/api/stock/p1")).json()["stock"] == 2  # reads still work, nothing was sold
        await admin.execute_command("REPLICAOF", "NO", "ONE")
        assert (await client.post("/api/stock/p1/deduct-atomic")).json()["stock"] == 1
    await admin.aclose()
    await app.state.shop.locks.aclose()


# -- hypothesis: whatever arrives, the answer is never a 5xx --------------

ascii_text = st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=80)
ids = st.one_of(st.sampled_from(["p1", "nope", "", "-", "a" * 65]), st.text(max_size=40))
def _containers(inner):
    return st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False) | st.text(max_size=20),
    _containers, max_leaves=10,
)
bodies = st.one_of(
    st.none(), st.binary(max_size=200),
    st.fixed_dictionaries({}, optional={"stock": json_values, "quantity": json_values, "product_id": json_values}),
    json_values,
)


ROUTES = [
    ("PUT", "/api/stock/{id}"), ("GET", "/api/stock/{id}"), ("POST", "/api/stock/{id}/deduct"),
    ("POST", "/api/stock/{id}/deduct-atomic"),
    ("POST", "/api/orders"), ("GET", "/api/orders?user={id}"), ("GET", "/api/jobs"), ("GET", "/healthz"),
]
METHODS = ["GET", "PUT", "POST", "DELETE", "PATCH", "HEAD", "OPTIONS"]
header_values = {
    "Idempotency-Key": st.one_of(st.sampled_from(['"k1"', '"k2"', "k1", '"k1", "k2"', '""']), ascii_text),
    "X-User-Id": st.one_of(st.sampled_from(["alice", "bob", "", "a:b", "a" * 65]), ascii_text),
    "Content-Type": st.one_of(st.sampled_from(["application/json", "text/plain"]), ascii_text),
}


@st.composite
def requests(draw):
    pid = quote(draw(ids), safe="")
    # Mostly real routes with their own method, so requests get past routing into the handlers.
    method, template = draw(st.one_of(
        st.sampled_from(ROUTES),
        st.tuples(st.sampled_from(METHODS), st.sampled_from([t for _, t in ROUTES] + ["/{id}"])),
    ))
    headers = {}
    for name, values in header_values.items():
        value = draw(st.one_of(st.none(), values))
        if value is not None:
            headers[name] = value
    body = draw(bodies)
    content = body if isinstance(body, (bytes, type(None))) else json.dumps(body).encode()
    return method, template.format(id=pid), headers, content


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(request=requests())
async def test_no_input_gets_a_5xx(client, request):
    method, path, headers, content = request
    if not getattr(client, "_seeded", False):
        await client.put("/api/stock/p1", json={"stock": 1000})
        client._seeded = True
    response = await client.request(method, path, headers=headers, content=content)
    event(f"{response.status_code} {path.split('?')[0].rsplit('/', 1)[-1][:8]}")
    assert response.status_code < 500, (response.status_code, response.text)
    if response.status_code >= 400 and method != "HEAD":
        assert response.headers["content-type"] == "application/problem+json"


async def test_a_lost_product_lock_answers_503_not_500(redis_url, redis_client):
    import asyncio

    # Short leases so the watchdog notices the loss quickly; long work so the loss lands inside it.
    locks = LockManager(redis_client, namespace="t", lease=0.3)
    app = create_app(DemoSettings(redis_url=redis_url, namespace="t", job_interval=0, work=5.0), locks=locks)
    store = app.state.shop.store
    await store.put_stock("p1", 10, None)
    reading = asyncio.Event()
    get_stock = store.get_stock

    async def get_stock_then_signal(product_id):
        value = await get_stock(product_id)
        reading.set()
        return value

    store.get_stock = get_stock_then_signal
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://shop") as client, \
            LockManager(redis_client, namespace="t") as operator:
        order = asyncio.create_task(client.post("/api/orders", json={"product_id": "p1"},
                                                headers={**USER, "Idempotency-Key": '"lost-1"'}))
        await reading.wait()  # inside the product lock, before the write
        assert await operator.force_release("stock:p1")
        response = await order
    assert response.status_code == 503 and kind(response) == "lock-lost", response.text
    assert await get_stock("p1") == 10
    await locks.aclose()


def test_summary_quantiles_interpolate_like_histogram_quantile():
    from otel_lock.cli._scrape import Histogram

    hist = Histogram(count=10)
    hist.buckets.update({0.1: 5, 0.5: 10, float("inf"): 10})
    assert hist.quantile(0.5) == pytest.approx(0.1)
    assert hist.quantile(0.75) == pytest.approx(0.3)
    tail = Histogram(count=10)
    tail.buckets.update({0.1: 5, 0.5: 8, float("inf"): 10})
    assert tail.quantile(0.99) == 0.5  # in the +Inf bucket: the highest finite bound, as Prometheus does
    assert Histogram().quantile(0.5) is None


async def test_the_lock_or_script_snippet_of_middleware_md_runs_as_pasted(redis_url, redis_client):
    # docs/middleware.md, "When a lock, when a script": the snippet, with only the Redis URL changed.
    import re
    from pathlib import Path

    doc = (Path(__file__).resolve().parent.parent / "docs" / "middleware.md").read_text()
    section = doc.split("## When a lock, when a script", 1)[1]
    source = re.search(r"```python\n(.*?)```", section, flags=re.S).group(1)
    namespace: dict = {"__name__": "docs_snippet"}
    exec(compile(source.replace("redis://127.0.0.1:6379/0", redis_url), "middleware.md", "exec"), namespace)
    await redis_client.set("stock:7", 2)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(namespace["app"]), base_url="http://x") as client:
        answers = [await client.post("/api/stock/7/deduct") for _ in range(3)]
    await namespace["redis"].aclose()
    assert [a.status_code for a in answers] == [200, 200, 409]
    assert [a.json() for a in answers[:2]] == [{"stock": 1}, {"stock": 0}]
