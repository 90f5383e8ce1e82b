"""@idempotent behind a new event loop per request: TestClient without `with`, pytest-asyncio's loop per test.

The gate's record store uses the lock manager's client of the current loop,
or (its own Redis, from_url) a client of its own per loop: never a client
whose connections belong to an event loop that has ended.
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.testclient import TestClient

from otel_lock import LockManager, LockMiddleware, idempotent
from otel_lock.asgi.idempotency import IdempotencyStore
from otel_lock.cli._redis_server import RedisServer


def _app(manager: LockManager, store: IdempotencyStore | None = None) -> tuple[FastAPI, list[str]]:
    app = FastAPI()
    app.add_middleware(LockMiddleware, manager=manager, idempotency_store=store)
    made: list[str] = []

    @app.post("/orders")
    @idempotent(shared_scope=True)
    async def order(request: Request) -> dict[str, int]:
        made.append(request.headers["idempotency-key"])
        return {"order": len(made)}

    return app, made


def _exercise(client: TestClient, made: list[str]) -> None:
    for n in range(4):  # each request on an event loop of its own
        first = client.post("/orders", headers={"Idempotency-Key": f'"k{n}"'})
        again = client.post("/orders", headers={"Idempotency-Key": f'"k{n}"'})
        assert first.status_code == 200 and again.status_code == 200, (first.text, again.text)
        assert again.json() == first.json() and again.headers["idempotent-replayed"] == "true"
    assert len(made) == 4  # the handler ran once per key, never for a retry


def test_records_next_to_the_locks_survive_a_new_loop_per_request(redis_url):
    app, made = _app(LockManager.from_url(redis_url, namespace="idl"))
    _exercise(TestClient(app), made)
    assert len(made) == 4


def test_records_on_their_own_redis_survive_a_new_loop_per_request(redis_url):
    with RedisServer() as records:
        store = IdempotencyStore.from_url(records.url, namespace="idl2")
        app, made = _app(LockManager.from_url(redis_url, namespace="idl2"), store)
        _exercise(TestClient(app), made)
        assert len(made) == 4
