"""The demo shop: the seed scenarios of otel-lock as a small Starlette app.

Read it as the how-to: `@locked` on the stock routes, `@idempotent` +
`@locked` on order submission, a nested `locks.lock(...)` for the product
inside the order handler, the fencing token on every stock write, a
`try_lock` job that runs on one replica per tick, and, for comparison,
`deduct-atomic`: the same sale as one Lua script, no lock; and a checkout of
a cart of several products under `@locked("stock:{json.items.*.sku}")`: one
lock per product, taken in one canonical order, each write fenced by its own
product's token; and order exports limited to two at once per user with
`@limited(..., permits=2)`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from redis.exceptions import ClusterDownError, ReadOnlyError, RedisClusterException, TryAgainError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from starlette.applications import Starlette
from starlette.endpoints import HTTPEndpoint
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from .. import (HeldLock, LockLost, LockManager, LockMiddleware, LockTimeout, RedisUnavailable, idempotent, limited,
                locked)
from ..asgi._keys import escape
from ..telemetry import metrics_endpoint
from ._job import run_job
from ._openapi import document as openapi_document
from ._problems import Problem, http_exception_handler, problem_handler, problem_response, unexpected_error_handler
from ._redis_info import redis_identity
from ._store import Store, valid_id

MAX_BODY = 64 * 1024
MAX_QUANTITY = 1000
MAX_STOCK = 1_000_000_000
LOCK_WAIT = 2.0  # seconds a buyer queues for a product before 409 lock-timeout
STOCK_LOCK = "stock:{path.product_id}"
# One lock per product of the cart: the same keys as STOCK_LOCK's (`stock:<id>`), so a checkout
# excludes the deduct and order routes on those products, on every replica.
CART_LOCK = "stock:{json.items.*.sku}"
MAX_CART_ITEMS = 20
# At most EXPORT_PERMITS exports of one user's orders run at once, on all replicas together.
EXPORT_LOCK = "export:user:{header.x-user-id}"
EXPORT_PERMITS = 2
EXPORT_WORK = 0.05  # seconds an export takes (think: rendering a file), so that exports overlap
MAX_REDIS_CONNECTIONS = 1000


@dataclass(frozen=True)
class DemoSettings:
    """How one replica of the shop runs; `from_env()` reads the demo's switches."""

    redis_url: str = "redis://127.0.0.1:6379/0"
    namespace: str = "otel-lock"
    replica_name: str = field(default_factory=socket.gethostname)
    job_interval: float = 10.0  # 0 turns the job off
    locks_enabled: bool = True
    work: float = 0.0  # seconds of simulated slow work (a payment call) between read and write
    lease: float = 30.0  # the stock lock's lease (renewed by the watchdog)

    @classmethod
    def from_env(cls, **overrides: Any) -> "DemoSettings":
        """`OTEL_LOCK_DEMO_DISABLE_LOCKS=1` removes every lock, to show what they prevent;
        `OTEL_LOCK_DEMO_WORK_MS=20` widens the read-modify-write window (and the hold time);
        `OTEL_LOCK_DEMO_LEASE=3` shortens the locks' lease (seconds; a stopped replica then loses it)."""
        disabled = os.environ.get("OTEL_LOCK_DEMO_DISABLE_LOCKS", "").strip().lower() in ("1", "true", "yes")
        work = _number("OTEL_LOCK_DEMO_WORK_MS", "0", "a number of milliseconds") / 1000
        lease = _number("OTEL_LOCK_DEMO_LEASE", "30", "a number of seconds (at least 0.3)")
        if lease < 0.3:
            raise ValueError("OTEL_LOCK_DEMO_LEASE must be a number of seconds (at least 0.3)")
        return cls(**{"locks_enabled": not disabled, "work": work, "lease": lease, **overrides})


def _number(variable: str, default: str, what: str) -> float:
    try:
        value = float(os.environ.get(variable, default) or default)
    except ValueError:
        raise ValueError(f"{variable} must be {what}") from None
    if value < 0 or value != value:
        raise ValueError(f"{variable} must be {what}")
    return value


@dataclass
class Shop:
    settings: DemoSettings
    locks: LockManager
    store: Store

    @contextlib.asynccontextmanager
    async def product_lock(self, product_id: str) -> AsyncIterator[HeldLock | None]:
        """The same lock `@locked(STOCK_LOCK)` takes for the stock routes, taken by hand."""
        if not self.settings.locks_enabled:
            yield None
            return
        # escape() is what the middleware applies to `{path.product_id}`: same key, same lock.
        key = f"stock:{escape(product_id)}"
        entered = False
        try:
            # cancel_on_lost: if the lease is lost mid-way, stop at once (LockLost -> 503).
            async with self.locks.lock(key, wait=LOCK_WAIT, name=STOCK_LOCK, cancel_on_lost=True) as held:
                entered = True
                yield held
        except LockTimeout:
            if entered:
                raise  # raised by the body, not by our acquire
            raise Problem(409, "lock-timeout", f"product {product_id} is busy, retry shortly",
                          {"Retry-After": "1"}) from None


# -- request parsing: every bad input ends as a 4xx problem ----------------


async def _json_object(request: Request, *, optional: bool = False) -> dict[str, Any]:
    body = await request.body()
    if len(body) > MAX_BODY:
        raise Problem(413, "request-too-large", f"request body is larger than {MAX_BODY} bytes")
    if not body.strip() and optional:
        return {}
    try:
        value = json.loads(body)
    except (ValueError, RecursionError):  # RecursionError: "[[[[..." nested deeper than the parser goes
        raise Problem(400, "invalid-json", "request body is not valid JSON") from None
    if not isinstance(value, dict):
        raise Problem(400, "invalid-body", "request body must be a JSON object")
    return value


def _int_field(body: dict[str, Any], name: str, low: int, high: int, default: int | None = None) -> int:
    value = body.get(name, default)
    # bool is an int subclass in Python; `true` is not a quantity.
    if type(value) is not int or not low <= value <= high:
        raise Problem(400, "invalid-body", f"'{name}' must be an integer from {low} to {high}")
    return value


def _product_id(value: object) -> str:
    if not isinstance(value, str) or not valid_id(value):
        raise Problem(400, "invalid-product-id",
                      "product id must be 1-64 characters: letters, digits, '_' or '-'")
    return value


def _user_id(value: str | None) -> str:
    if value is None or not valid_id(value):
        raise Problem(400, "invalid-user-id",
                      "X-User-Id must be 1-64 characters: letters, digits, '_' or '-'")
    return value


def _token(request: Request) -> int | None:
    """The fencing token of the lock the middleware took for this request."""
    held = getattr(request.state, "lock", None)
    return None if held is None else held.token


def _shop(request: Request) -> Shop:
    shop: Shop = request.app.state.shop
    return shop


def _stock_body(product_id: str, stock: int) -> JSONResponse:
    return JSONResponse({"product_id": product_id, "stock": stock})


# -- stock ---------------------------------------------------------------


@locked(STOCK_LOCK, wait=LOCK_WAIT)
async def put_stock(request: Request) -> JSONResponse:
    product_id = _product_id(request.path_params["product_id"])
    stock = _int_field(await _json_object(request), "stock", 0, MAX_STOCK)
    if not await _shop(request).store.put_stock(product_id, stock, _token(request)):
        raise Problem(409, "stale-fencing-token", "a newer lock holder already wrote this product")
    return _stock_body(product_id, stock)


async def get_stock(request: Request) -> JSONResponse:
    product_id = _product_id(request.path_params["product_id"])
    stock = await _shop(request).store.get_stock(product_id)
    if stock is None:
        raise Problem(404, "unknown-product", f"no product {product_id}; create it with PUT first")
    return _stock_body(product_id, stock)


async def _sell(shop: Shop, product_id: str, quantity: int, token: int | None) -> int:
    """Read, check, write: correct only while the product's lock is held."""
    store = shop.store
    stock = await store.get_stock(product_id)
    if stock is None:
        raise Problem(404, "unknown-product", f"no product {product_id}; create it with PUT first")
    if stock < quantity:
        raise Problem(409, "out-of-stock", f"product {product_id} has {stock} left, {quantity} asked")
    if shop.settings.work:
        await asyncio.sleep(shop.settings.work)
    written = await store.write_stock(product_id, stock - quantity, token)
    if written == 0:
        # Our lease ran out while we were paused and a newer holder has written since:
        # the fence refused our stale write, so nothing was oversold.
        raise Problem(409, "stale-fencing-token", "the lock was lost before the write; retry",
                      {"Retry-After": "1"})
    if written < 0:
        raise Problem(404, "unknown-product", f"product {product_id} was removed")
    return stock - quantity


@locked(STOCK_LOCK, wait=LOCK_WAIT)
async def deduct(request: Request) -> JSONResponse:
    product_id = _product_id(request.path_params["product_id"])
    quantity = _int_field(await _json_object(request, optional=True), "quantity", 1, MAX_QUANTITY, default=1)
    remaining = await _sell(_shop(request), product_id, quantity, _token(request))
    return _stock_body(product_id, remaining)


async def deduct_atomic(request: Request) -> JSONResponse:
    """The same sale as `deduct`, without a lock: one Lua script checks and decrements.

    Right for one counter; a lock is needed once the critical section spans
    several keys, another system, or slow work (docs/middleware.md).
    """
    product_id = _product_id(request.path_params["product_id"])
    quantity = _int_field(await _json_object(request, optional=True), "quantity", 1, MAX_QUANTITY, default=1)
    outcome, stock = await _shop(request).store.deduct_atomic(product_id, quantity)
    if outcome < 0:
        raise Problem(404, "unknown-product", f"no product {product_id}; create it with PUT first")
    if outcome == 0:
        raise Problem(409, "out-of-stock", f"product {product_id} has {stock} left, {quantity} asked")
    return _stock_body(product_id, stock)


# -- checkout: several products at once -------------------------------------


def _cart(body: dict[str, Any]) -> dict[str, int]:
    """The cart's quantity per product, in the order first named (one product named twice: added up)."""
    items = body.get("items")
    if not isinstance(items, list) or not 1 <= len(items) <= MAX_CART_ITEMS:
        raise Problem(400, "invalid-body", f"'items' must be a list of 1 to {MAX_CART_ITEMS} "
                                           "{\"sku\": ..., \"quantity\": n} objects")
    cart: dict[str, int] = {}
    for item in items:
        if not isinstance(item, dict):
            raise Problem(400, "invalid-body", "each item must be an object {\"sku\": ..., \"quantity\": n}")
        sku = _product_id(item.get("sku"))
        cart[sku] = cart.get(sku, 0) + _int_field(item, "quantity", 1, MAX_QUANTITY, default=1)
    if any(quantity > MAX_QUANTITY for quantity in cart.values()):
        raise Problem(400, "invalid-body", f"at most {MAX_QUANTITY} of one product per cart")
    return cart


def _product_token(request: Request, product_id: str) -> int | None:
    """The fencing token of the product's lock (`stock:<id>`) among those the middleware took for this request.

    None only when the shop runs without locks; a product the locks missed is a bug (KeyError, a 500).
    """
    held = getattr(request.state, "lock", None)
    return None if held is None else int(held.tokens[f"stock:{escape(product_id)}"])


@locked(CART_LOCK, wait=LOCK_WAIT, max_keys=MAX_CART_ITEMS)
async def checkout(request: Request) -> JSONResponse:
    """Buy every item of the cart or none: all products' stock is checked before any is written.

    The middleware holds one lock per product (`lock_all`, one canonical order whatever the cart's, so
    two carts naming the same products in opposite orders never wait on each other). Each product's
    write carries its own lock's fencing token. The writes are one per product (products live in
    different Cluster slots): a lease lost between two of them has that product's write refused (409,
    nothing oversold) and the rest not tried, leaving the products written before it sold without a
    checkout answer.
    """
    cart = _cart(await _json_object(request))
    shop = _shop(request)
    store = shop.store
    stocks = await asyncio.gather(*(store.get_stock(sku) for sku in cart))
    for (sku, quantity), stock in zip(cart.items(), stocks):
        if stock is None:
            raise Problem(404, "unknown-product", f"no product {sku}; create it with PUT first")
        if stock < quantity:
            raise Problem(409, "out-of-stock", f"product {sku} has {stock} left, {quantity} asked")
    if shop.settings.work:
        await asyncio.sleep(shop.settings.work)
    left: list[dict[str, Any]] = []
    for (sku, quantity), stock in zip(cart.items(), stocks):
        assert stock is not None
        written = await store.write_stock(sku, stock - quantity, _product_token(request, sku))
        if written == 0:
            raise Problem(409, "stale-fencing-token", f"the lock of product {sku} was lost before its write; "
                                                      "retry", {"Retry-After": "1"})
        if written < 0:
            raise Problem(404, "unknown-product", f"product {sku} was removed")
        left.append({"sku": sku, "quantity": quantity, "stock_left": stock - quantity})
    return JSONResponse({"checkout_id": uuid.uuid4().hex, "items": left, "replica": shop.settings.replica_name})


# -- orders --------------------------------------------------------------


def user_principal(request: Request) -> str | None:
    """Idempotency keys are scoped to the X-User-Id caller.

    Demo only: the header is client-controlled, so any client can claim any
    user. A real shop names a verified principal (docs/idempotency.md).
    """
    return request.headers.get("x-user-id")


@idempotent(ttl=86400, required=True, principal=user_principal, challenge='Demo realm="shop", header="X-User-Id"')
@locked("order:user:{header.x-user-id}", wait=LOCK_WAIT)
async def create_order(request: Request) -> JSONResponse:
    user = _user_id(request.headers.get("x-user-id"))
    body = await _json_object(request)
    product_id = _product_id(body.get("product_id"))
    quantity = _int_field(body, "quantity", 1, MAX_QUANTITY, default=1)
    shop = _shop(request)
    # The order lock is held; take the product's lock inside it. The core gives
    # this nested acquire a fresh owner (a different key), so it excludes the
    # deduct route on every replica.
    async with shop.product_lock(product_id) as held:
        remaining = await _sell(shop, product_id, quantity, None if held is None else held.token)
        order = {"order_id": uuid.uuid4().hex, "user": user, "product_id": product_id,
                 "quantity": quantity, "replica": shop.settings.replica_name}
        await shop.store.add_order(user, order)
    return JSONResponse({**order, "stock_left": remaining}, status_code=201,
                        headers={"Location": f"/api/orders?user={user}"})


async def list_orders(request: Request) -> JSONResponse:
    user = _user_id(request.query_params.get("user"))
    return JSONResponse({"orders": await _shop(request).store.orders(user)})


@limited(EXPORT_LOCK, permits=EXPORT_PERMITS, wait=LOCK_WAIT)
async def export_orders(request: Request) -> JSONResponse:
    """A slow report of the user's orders: at most EXPORT_PERMITS at once per user (429 + Retry-After past it)."""
    user = _user_id(request.headers.get("x-user-id"))
    shop = _shop(request)
    orders = await shop.store.orders(user)
    await asyncio.sleep(EXPORT_WORK + shop.settings.work)
    return JSONResponse({"user": user, "orders": len(orders),
                         "items": sum(int(order.get("quantity", 0)) for order in orders),
                         "replica": shop.settings.replica_name})


# One route per path, so that a 405 names every method the path allows (RFC 9110 15.5.6).
class StockItem(HTTPEndpoint):
    get = staticmethod(get_stock)
    put = staticmethod(put_stock)


class Orders(HTTPEndpoint):
    get = staticmethod(list_orders)
    post = staticmethod(create_order)



# -- job, health ---------------------------------------------------------


async def list_jobs(request: Request) -> JSONResponse:
    return JSONResponse({"runs": await _shop(request).store.runs()})


async def healthz(request: Request) -> JSONResponse:
    """Also answers 'do all replicas use the same Redis and namespace?': compare run_id.

    On a Cluster `run_id` names every primary (`_redis_info`).
    """
    shop = _shop(request)
    return JSONResponse({
        "status": "ok", "replica": shop.settings.replica_name, "namespace": shop.settings.namespace,
        "locks": shop.settings.locks_enabled, "redis": await redis_identity(shop.locks.redis),
        # what the lock manager's first use found of each server (otel-lock doctor's checks)
        "server_checks": [{"address": r.address, "server": r.server, "version": r.version,
                           "maxmemory_policy": r.maxmemory_policy, "ok": r.ok,
                           "warnings": [c.name for c in r.warnings], "refusals": [c.name for c in r.refusals]}
                          for r in shop.locks.server_reports],
    })


ENDPOINTS = {("/api/stock/{product_id}", "GET"): get_stock, ("/api/stock/{product_id}", "PUT"): put_stock,
             ("/api/stock/{product_id}/deduct", "POST"): deduct,
             ("/api/stock/{product_id}/deduct-atomic", "POST"): deduct_atomic,
             ("/api/orders", "GET"): list_orders, ("/api/orders", "POST"): create_order,
             ("/api/checkout", "POST"): checkout, ("/api/exports", "POST"): export_orders,
             ("/api/jobs", "GET"): list_jobs, ("/healthz", "GET"): healthz, ("/metrics", "GET"): metrics_endpoint}
OPENAPI = openapi_document(ENDPOINTS, {"max_body": MAX_BODY, "max_quantity": MAX_QUANTITY, "max_stock": MAX_STOCK,
                                       "max_cart_items": MAX_CART_ITEMS})


async def openapi_endpoint(request: Request) -> JSONResponse:
    """The shop's OpenAPI document: its handlers' answers and the middleware's (`_openapi`)."""
    return JSONResponse(OPENAPI)


async def redis_unavailable_handler(request: Request, exc: Exception) -> Response:
    return problem_response(503, "redis-unavailable", "Redis is not reachable; retry shortly", {"Retry-After": "1"})


async def lock_lost_handler(request: Request, exc: Exception) -> Response:
    # A lock the handler took itself lost its lease; the fenced write refused anything stale.
    return problem_response(503, "lock-lost", "a lock was lost while the request ran; retry",
                            {"Retry-After": "1"})


def create_app(settings: DemoSettings | None = None, locks: LockManager | None = None) -> Starlette:
    """The shop; `locks` defaults to a manager on `settings.redis_url`."""
    settings = settings or DemoSettings.from_env()
    # redis-py's pool refuses a 101st concurrent connection ("Too many connections"),
    # and a seckill burst queues a few hundred requests per replica at once.
    locks = locks or LockManager.from_url(settings.redis_url, namespace=settings.namespace, socket_timeout=2.0,
                                          max_connections=MAX_REDIS_CONNECTIONS, lease=settings.lease)
    shop = Shop(settings, locks, Store(locks.redis, settings.namespace))

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        job = None
        if settings.job_interval > 0:
            job_locks = locks if settings.locks_enabled else None
            job = asyncio.create_task(run_job(job_locks, settings.job_interval,
                                              lambda tick: shop.store.record_run(tick, settings.replica_name)),
                                      name="otel-lock demo job")
        try:
            yield
        finally:
            if job is not None:
                job.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await job
            await locks.aclose()

    app = Starlette(
        routes=[
            Route("/api/stock/{product_id}", StockItem, methods=["GET", "PUT"]),
            Route("/api/stock/{product_id}/deduct", deduct, methods=["POST"]),
            Route("/api/stock/{product_id}/deduct-atomic", deduct_atomic, methods=["POST"]),
            Route("/api/orders", Orders, methods=["GET", "POST"]),
            Route("/api/checkout", checkout, methods=["POST"]),
            Route("/api/exports", export_orders, methods=["POST"]),
            Route("/api/jobs", list_jobs, methods=["GET"]),
            Route("/healthz", healthz, methods=["GET"]),
            Route("/metrics", metrics_endpoint, methods=["GET"]),
            Route("/openapi.json", openapi_endpoint, methods=["GET"]),
        ],
        exception_handlers={
            Problem: problem_handler,
            HTTPException: http_exception_handler,
            RedisUnavailable: redis_unavailable_handler,
            LockLost: lock_lost_handler,
            RedisConnectionError: redis_unavailable_handler,
            RedisTimeoutError: redis_unavailable_handler,
            # A failover under way (a demoted master, a Cluster slot down or moving),
            # or no Cluster node reachable at start-up: the same 503 as the core's RedisUnavailable.
            ReadOnlyError: redis_unavailable_handler,
            ClusterDownError: redis_unavailable_handler,
            TryAgainError: redis_unavailable_handler,
            RedisClusterException: redis_unavailable_handler,
            Exception: unexpected_error_handler,
        },
        lifespan=lifespan,
    )
    app.state.shop = shop
    # enabled=False runs the annotated handlers without locks, deliberately (they refuse to run unprotected).
    app.add_middleware(LockMiddleware, manager=locks, enabled=settings.locks_enabled)
    return app
