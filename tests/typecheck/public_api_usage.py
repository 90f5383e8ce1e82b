"""Typed user code against otel-lock's public API: type-checked, never run.

`mypy --strict` and `pyright` must accept this file with no errors; each
`assert_type` pins a type a user relies on (a token is an int, a decorated
handler keeps its signature, LockMiddleware fits Starlette's add_middleware).
pytest does not collect it (no `test_` prefix).
"""

from __future__ import annotations

import asyncio
import threading
from typing import assert_type

from fastapi import FastAPI
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.types import ASGIApp

from otel_lock import (HeldLock, HeldLocks, LockDeadlock, LockError, LockInfo, LockLost, LockManager, LockMiddleware,
                       LockTimeout, RedisUnavailable, idempotent, limited, locked)
from otel_lock.sync import SyncHeldLock, SyncHeldLocks, SyncLockManager


async def core(locks: LockManager) -> None:
    async with locks.lock("stock:1", wait=1.0) as held:
        assert_type(held, HeldLock)
        assert_type(held.key, str)
        assert_type(held.owner, str)
        assert_type(held.token, int)
        assert_type(held.depth, int)
        assert_type(held.lost, asyncio.Event)
    maybe = await locks.try_lock("job:cleanup")
    assert_type(maybe, HeldLock | None)
    if maybe is not None:
        assert_type(await maybe.release(), bool)
    assert_type(await locks.held_locks(), list[LockInfo])
    assert_type(await locks.force_release("stock:1"), bool)
    try:
        await locks.acquire("stock:2")
    except (LockTimeout, LockLost, RedisUnavailable) as error:
        assert_type(error.key, str | None)
    except LockError:
        pass
    async with LockManager.from_url("redis://127.0.0.1:6379/0", namespace="shop") as manager:
        assert_type(manager, LockManager)


async def several(locks: LockManager, sync_locks: SyncLockManager) -> None:
    async with locks.lock_all(["account:7", "account:3"], wait=5.0) as held:
        assert_type(held, HeldLocks)
        assert_type(held.tokens, dict[str, int])
        assert_type(held.keys, tuple[str, ...])
        assert_type(held.holds, tuple[HeldLock, ...])
        assert_type(held.lost, asyncio.Event)
    assert_type(await (await locks.acquire_all(("a", "b"))).release(), bool)
    try:
        await locks.acquire("k2")
    except LockDeadlock as deadlock:
        assert_type(deadlock.cycle, tuple[tuple[str, str, str], ...])
    with sync_locks.lock_all(["a", "b"]) as blocking:
        assert_type(blocking, SyncHeldLocks)
        assert_type(blocking.tokens, dict[str, int])
        assert_type(blocking.lost, threading.Event)


def who(request: Request) -> str | None:
    return request.headers.get("x-user-id")


@locked("stock:{path.product_id}", wait=2.0)
async def deduct(product_id: int) -> dict[str, int]:
    return {"product_id": product_id}


@idempotent(ttl=86400, required=True, principal=who)
async def order() -> dict[str, str]:
    return {}


@locked("account:{json.from_id}", "account:{json.to_id}", max_keys=2)
async def transfer(from_id: int, to_id: int) -> int:
    return from_id


@locked("catalogue:{path.item}", shared=True)
async def read_price(item: str) -> int:
    return 0


@limited("export:{header.x-tenant}", permits=2, wait=5.0)
async def export(x_tenant: str) -> bytes:
    return b""


async def decorated_handlers_keep_their_types() -> None:
    assert_type(await transfer(1, 2), int)
    assert_type(await read_price("9"), int)
    assert_type(await export("t3"), bytes)
    assert_type(await deduct(1), dict[str, int])
    assert_type(await order(), dict[str, str])
    await deduct("1")  # type: ignore[arg-type]  # the point: the decorator kept `product_id: int`


def fastapi_app(locks: LockManager) -> FastAPI:
    app = FastAPI()
    app.add_middleware(LockMiddleware, manager=locks, principal=who)
    app.post("/api/stock/{product_id}/deduct")(deduct)
    app.post("/api/orders")(order)
    return app


def starlette_app(locks: LockManager) -> Starlette:
    @locked("stock:{path.product_id}")
    async def put_stock(request: Request) -> JSONResponse:
        return JSONResponse({})

    assert_type(put_stock.__name__, str)
    app = Starlette()
    app.add_middleware(LockMiddleware, manager=locks, rules={"POST /x/{id}": [locked("x:{path.id}")]})
    rules = {"POST /y/{id}": [locked("y:{path.id}")]}   # a dict[str, list[Locked]] built beforehand
    app.add_middleware(LockMiddleware, manager=locks, rules=rules)
    return app


def wrapped_by_hand(inner: ASGIApp, locks: LockManager) -> ASGIApp:
    return LockMiddleware(inner, manager=locks)   # any ASGI app in, an ASGI app out


def blocking() -> None:
    with SyncLockManager.from_url("redis://127.0.0.1:6379/0") as locks:
        with locks.lock("job:cleanup", wait=5.0) as held:
            assert_type(held, SyncHeldLock)
            assert_type(held.token, int)
            assert_type(held.lost, threading.Event)
        assert_type(locks.held_locks(), list[LockInfo])
