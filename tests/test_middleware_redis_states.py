"""What a protected request gets when Redis refuses for good, or when a key value cannot be a Redis key.

A misconfigured Redis (a wrong database, a password, missing ACL rights)
is permanent: retrying cannot help and `fail_open` would only hide it, so
the answer is a problem+json 500 that names the fix, never `text/plain`.
A key value that is not valid text (a lone surrogate from JSON's
`"\\ud800"`) is percent-encoded into the key like any other byte, so it
locks, and never disturbs the connection other requests share.
"""

from __future__ import annotations

import pytest
from fastapi import FastAPI
from pydantic import BaseModel

from otel_lock import LockManager, LockMiddleware, limited, locked

from _middleware_helpers import client_for, lock_key, make_manager, problem


class Item(BaseModel):
    sku: str


def shop(manager: LockManager, fail_open: bool = False) -> FastAPI:
    app = FastAPI()
    app.add_middleware(LockMiddleware, manager=manager)
    runs: list[str] = []
    app.state.runs = runs

    @app.post("/items")
    @locked("item:{json.sku}", wait=0.2, fail_open=fail_open)
    async def buy(item: Item) -> dict[str, int]:
        runs.append(item.sku)
        return {"bought": len(runs)}

    return app


async def test_a_misconfigured_redis_is_a_problem_500_naming_the_fix(redis_url):
    url = redis_url.rsplit("/", 1)[0] + "/99"  # no such database
    for fail_open in (False, True):  # fail_open is for outages, not for a configuration that cannot work
        async with make_manager(url) as manager:
            app = shop(manager, fail_open=fail_open)
            async with client_for(app) as client:
                response = await client.post("/items", json={"sku": "a"})
        assert response.status_code == 500
        assert response.headers["content-type"] == "application/problem+json"
        body = problem(response)
        assert body["type"] == "redis-misconfigured"
        assert "database" in body["detail"].lower()
        assert app.state.runs == []


async def test_a_key_value_that_is_not_text_locks_its_escaped_bytes_and_the_connection_stays_in_step(
        redis_url, redis_client):
    async with make_manager(redis_url) as manager, make_manager(redis_url) as other:
        app = shop(manager)
        busy = await other.acquire("item:b")  # held by someone else: the next answer must say so
        async with client_for(app) as client:
            response = await client.post("/items", content=b'{"sku": "\\ud800"}',
                                         headers={"content-type": "application/json"})
            assert response.status_code == 200 and response.json() == {"bought": 1}
            refused = await client.post("/items", json={"sku": "b"})
            assert refused.status_code == 409 and problem(refused)["type"] == "lock-timeout"
            await busy.release()
            ok = await client.post("/items", json={"sku": "b"})
            assert ok.status_code == 200 and ok.json() == {"bought": 2}
    assert app.state.runs == ["\ud800", "b"]
    assert await redis_client.exists(lock_key("item:b")) == 0


async def test_a_redis_error_reply_to_the_lock_is_a_problem_500(redis_url, redis_client):
    """A key of another type where the lock's hash belongs (WRONGTYPE): problem+json, never text/plain."""
    async with make_manager(redis_url) as manager:
        app = shop(manager)
        await redis_client.set(lock_key("item:x"), "not a hash")
        async with client_for(app) as client:
            response = await client.post("/items", json={"sku": "x"})
    assert response.status_code == 500
    assert response.headers["content-type"] == "application/problem+json"
    assert problem(response)["type"] == "redis-error" and "WRONGTYPE" in problem(response)["detail"]
    assert app.state.runs == []


def test_the_former_body_timeout_name_warns_and_cannot_be_mixed():
    import pytest
    from starlette.applications import Starlette

    with pytest.warns(DeprecationWarning, match="body_idle_timeout"):
        LockMiddleware(Starlette(), body_timeout=3.0)
    with pytest.raises(TypeError, match="both"):
        LockMiddleware(Starlette(), body_timeout=3.0, body_idle_timeout=2.0)


@pytest.mark.parametrize("rule", [
    lambda: locked("item:{path.sku}", wait=1),
    lambda: locked("item:{path.sku}", "shelf:{path.sku}", wait=1),
    lambda: locked("item:{path.sku}", wait=1, shared=True),
    lambda: limited("item:{path.sku}", permits=2, wait=1),
    lambda: locked("item:{path.sku}", wait=1, release_after="response"),
], ids=["one-key", "two-keys", "shared", "permit", "release-after-response"])
async def test_a_handlers_error_answer_survives_a_release_that_finds_redis_gone(fresh_redis, rule):
    """The handler raised (a 404 HTTPException) and Redis went away meanwhile: its answer goes out as it is,
    the release's RedisUnavailable is logged, and the lock expires by itself (never a bare 500)."""
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.routing import Route

    @rule()
    async def missing(request):
        fresh_redis.stop()   # Redis goes away while the handler holds the lock
        raise HTTPException(404, "no such item")

    async with make_manager(fresh_redis.url, breaker=False) as manager:
        app = Starlette(routes=[Route("/items/{sku}", missing, methods=["POST"])])
        app.add_middleware(LockMiddleware, manager=manager)
        async with client_for(app) as client:
            response = await client.post("/items/a")
    assert response.status_code == 404
    assert response.text == "no such item"
