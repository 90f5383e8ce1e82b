"""Who is still there, on real servers: waiters that hang up, state every middleware sees, body limits per route.

Regression tests: a request whose client disconnected while it waited still
took the lock and ran the purchase; `request.state` set inside a `@locked`
route was lost to outer middlewares (the scope's state was replaced by a
copy); limits were one global `max_body` and a whole-body timeout.
"""

from __future__ import annotations

import asyncio

from fastapi import FastAPI, Request
from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route

from otel_lock import LockMiddleware, locked

try:
    from ._middleware_helpers import (client_for, histogram_counts, lock_key, make_manager, metered, problem,
                                      serving, until, waiting)
except ImportError:
    from _middleware_helpers import (client_for, histogram_counts, lock_key, make_manager, metered, problem,
                                     serving, until, waiting)


def buyer_app(manager, ran: list) -> FastAPI:
    app = FastAPI()

    @app.post("/stock/{pid}/buy")
    @locked("stock:{path.pid}", wait=30)
    async def buy(pid: int):
        ran.append(pid)
        return {"bought": pid}

    app.add_middleware(LockMiddleware, manager=manager)
    return app


async def test_a_waiter_whose_client_hangs_up_stops_waiting_takes_no_lock_and_never_runs(redis_url, redis_client):
    ran: list = []
    provider, reader = metered()
    async with make_manager(redis_url, meter_provider=provider) as manager, make_manager(redis_url) as other:
        async with serving(buyer_app(manager, ran)) as (host, port):
            held = await other.try_lock("stock:1")
            reader_, writer = await asyncio.open_connection(host, port)
            writer.write(b"POST /stock/1/buy HTTP/1.1\r\nHost: shop\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 2\r\n\r\n{}")
            await writer.drain()
            await until(lambda: waiting(reader, "stock:{path.pid}") == 1, "the request to wait for the lock")
            writer.close()   # the client gives up (a timeout, a retry elsewhere)
            await writer.wait_closed()
            await until(lambda: waiting(reader, "stock:{path.pid}") == 0, "the waiter to stop waiting")
            # The wait is recorded once the waiter has also left the queue (a round trip after the gauge
            # drops): wait for that, not for one look.
            await until(lambda: _cancelled(histogram_counts(reader, "otel_lock.wait.duration")),
                        "the cancelled wait to be recorded")
            outcomes = histogram_counts(reader, "otel_lock.wait.duration")
            await held.release()
            # The lock is free and nobody takes it: the hung-up request did not stay queued.
            assert await redis_client.exists(lock_key("stock:1")) == 0
            import httpx

            async with httpx.AsyncClient(base_url=f"http://{host}:{port}") as client:
                after = await client.post("/stock/2/buy", json={})
    cancelled = _cancelled(outcomes)
    assert len(cancelled) == 1 and dict(cancelled[0])["lock.name"] == "stock:{path.pid}"
    assert ran == [2] and after.status_code == 200   # the server keeps serving; the gone buyer never ran
    assert await redis_client.exists(lock_key("stock:1")) == 0


def _cancelled(outcomes: dict[tuple, int]) -> list[tuple]:
    """The attribute sets of the wait-duration histogram's cancelled waits."""
    return [attrs for attrs in outcomes if dict(attrs).get("lock.outcome") == "cancelled"]


async def test_a_waiter_its_host_cancels_never_runs_and_leaves_no_lock(redis_url, redis_client):
    ran: list = []
    provider, reader = metered()
    async with make_manager(redis_url, meter_provider=provider) as manager, make_manager(redis_url) as other:
        app = buyer_app(manager, ran)
        held = await other.try_lock("stock:1")
        async with client_for(app) as client:
            request = asyncio.ensure_future(client.post("/stock/1/buy"))
            await until(lambda: waiting(reader, "stock:{path.pid}") == 1, "the request to wait for the lock")
            request.cancel()   # httpx's ASGITransport runs the app in the caller's task: this cancels it
            await asyncio.gather(request, return_exceptions=True)
            await until(lambda: waiting(reader, "stock:{path.pid}") == 0, "the waiter to stop waiting")
        await held.release()
    assert ran == [] and await redis_client.exists(lock_key("stock:1")) == 0


async def test_what_the_handler_puts_in_request_state_reaches_every_outer_middleware(redis_url):
    seen: list = []
    async with make_manager(redis_url) as manager:
        app = FastAPI()

        @app.post("/orders/{oid}")
        @locked("order:{path.oid}")
        async def order(oid: int, request: Request):
            assert request.state.user == "alice"         # set outside us, before
            request.state.audit = f"order {oid} placed"  # set inside, read outside after
            return {}

        class Audit:
            """A pure ASGI audit middleware, outside LockMiddleware."""

            def __init__(self, app) -> None:
                self.app = app

            async def __call__(self, scope, receive, send):
                if scope["type"] == "http":
                    request = Request(scope)
                    request.state.user = "alice"
                    await self.app(scope, receive, send)
                    seen.append(("asgi", request.state.audit, request.state.lock.token))
                    return
                await self.app(scope, receive, send)

        @app.middleware("http")
        async def metrics(request: Request, call_next):
            response = await call_next(request)
            seen.append(("http", request.state.audit, request.state.lock.depth))
            return response

        app.add_middleware(LockMiddleware, manager=manager)
        app.add_middleware(Audit)
        async with client_for(app) as client:
            response = await client.post("/orders/7")
    assert response.status_code == 200, response.text
    assert sorted(seen, key=str) == [("asgi", "order 7 placed", seen[-1][2]), ("http", "order 7 placed", 1)]
    assert isinstance(seen[-1][2], int) and seen[-1][2] > 0


async def test_lifespan_state_and_the_lock_meet_in_the_handler(redis_url):
    from contextlib import asynccontextmanager

    async with make_manager(redis_url) as manager:
        @asynccontextmanager
        async def lifespan(app):
            yield {"db": "the pool"}

        async def handler(request):
            return JSONResponse({"db": request.state.db, "key": request.state.lock.key})

        app = Starlette(routes=[Route("/x", locked("x")(handler), methods=["POST"])], lifespan=lifespan)
        app.add_middleware(LockMiddleware, manager=manager)
        async with serving(app) as (host, port):
            import httpx

            async with httpx.AsyncClient(base_url=f"http://{host}:{port}") as client:
                response = await client.post("/x")
    assert response.json() == {"db": "the pool", "key": lock_key("x")}


async def test_body_limits_are_per_route_and_the_idle_timeout_restarts_at_each_chunk(redis_url):
    async with make_manager(redis_url) as manager:
        app = FastAPI()

        @app.post("/small")
        @locked("small", max_body=10)
        async def small(request: Request):
            return {"size": len(await request.body())}

        @app.post("/upload")
        @locked("upload", body_idle_timeout=1.0)
        async def upload(request: Request):
            return {"size": len(await request.body())}

        @app.post("/default")
        @locked("default")
        async def default(request: Request):
            return {"size": len(await request.body())}

        app.add_middleware(LockMiddleware, manager=manager, max_body=100, body_idle_timeout=0.5)
        async with serving(app) as (host, port):
            import httpx

            async with httpx.AsyncClient(base_url=f"http://{host}:{port}") as client:
                too_big = await client.post("/small", content=b"x" * 11)
                fits = await client.post("/default", content=b"x" * 100)
                over_default = await client.post("/default", content=b"x" * 101)

            async def trickle(path: str, pause: float, chunks: int, declared: int) -> tuple[int, bytes]:
                reader, writer = await asyncio.open_connection(host, port)
                writer.write(f"POST {path} HTTP/1.1\r\nHost: shop\r\nContent-Length: {declared}\r\n\r\n".encode())
                for _ in range(chunks):
                    writer.write(b"x")
                    await writer.drain()
                    await asyncio.sleep(pause)   # the client's pace: the input of this test, not a wait for it
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
                writer.close()
                return int(head.split(b" ", 2)[1]), head

            # 6 chunks, 0.25 s apart: 1.5 s in all, more than the idle timeout of 1 s, never idle for 1 s.
            slow_but_alive, _ = await trickle("/upload", 0.25, 6, declared=6)
            # The route without its own limit gets the middleware's 0.5 s: one chunk, then silence.
            stalled, head = await trickle("/default", 0, 1, declared=2)
    assert too_big.status_code == 413 and problem(too_big)["type"] == "request-too-large"
    assert fits.status_code == 200 and over_default.status_code == 413
    assert slow_but_alive == 200
    assert stalled == 408 and b"connection: close" in head.lower()


async def test_an_idempotent_waiter_that_hangs_up_leaves_its_key_free_for_the_retry(redis_url):
    ran: list = []
    provider, reader = metered()
    async with make_manager(redis_url, meter_provider=provider) as manager, make_manager(redis_url) as other:
        from otel_lock import idempotent

        app = FastAPI()

        @app.post("/orders/{pid}")
        @idempotent(shared_scope=True)
        @locked("stock:{path.pid}", wait=30)
        async def order(pid: int):
            ran.append(pid)
            return {"order": len(ran)}

        app.add_middleware(LockMiddleware, manager=manager)
        held = await other.try_lock("stock:1")
        async with serving(app) as (host, port):
            _, writer = await asyncio.open_connection(host, port)
            writer.write(b'POST /orders/1 HTTP/1.1\r\nHost: shop\r\nIdempotency-Key: "retry-me"\r\n'
                         b"Content-Length: 0\r\n\r\n")
            await writer.drain()
            await until(lambda: waiting(reader, "stock:{path.pid}") == 1, "the request to wait for the lock")
            writer.close()
            await writer.wait_closed()
            await until(lambda: waiting(reader, "stock:{path.pid}") == 0, "the waiter to stop waiting")
            await held.release()
            import httpx

            async with httpx.AsyncClient(base_url=f"http://{host}:{port}") as client:
                retry = await client.post("/orders/1", headers={"idempotency-key": '"retry-me"'})
    # Nothing ran for the client that left, so its key is not "outcome unknown": the retry runs it once.
    assert retry.status_code == 200 and retry.json() == {"order": 1} and ran == [1], retry.text
