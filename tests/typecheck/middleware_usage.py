"""User code that mounts LockMiddleware every documented way; must pass `mypy --strict` (tests/test_middleware_typing.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI
from starlette.applications import Starlette

from otel_lock import LockManager, LockMiddleware, Locks, RedLockManager, locked


def make_locks() -> Locks:
    return LockManager.from_url("redis://127.0.0.1:6379/0", namespace="shop")


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    app.state.locks = LockManager.from_url("redis://127.0.0.1:6379/0")
    yield
    await app.state.locks.aclose()


app = FastAPI(lifespan=lifespan)
app.add_middleware(LockMiddleware, manager=RedLockManager.from_urls(["redis://127.0.0.1:6379/0"]))
app.add_middleware(LockMiddleware, manager=LockManager.from_url("redis://127.0.0.1:6379/0"), max_body=1024,
                   body_idle_timeout=2.0)
app.add_middleware(LockMiddleware, manager=make_locks)
app.add_middleware(LockMiddleware)   # app.state.locks, set in the lifespan above

plain = Starlette()
wrapped: LockMiddleware = LockMiddleware(plain, manager=RedLockManager.from_urls(["redis://127.0.0.1:6379/0"]))
lazy = LockMiddleware(plain, manager=lambda: LockManager.from_url("redis://127.0.0.1:6379/0"))
ruled = LockMiddleware(plain, manager=make_locks, rules={"POST /x/{id}": locked("x:{path.id}", max_body=10)})
