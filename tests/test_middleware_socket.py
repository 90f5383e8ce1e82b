"""Slow clients on a real uvicorn socket hold no lock: the body is read first, sends are bounded."""

from __future__ import annotations

import asyncio
import socket
from contextlib import asynccontextmanager
from typing import AsyncIterator

import httpx
import uvicorn
from fastapi import Depends, FastAPI, Header, HTTPException, Request
from fastapi.responses import StreamingResponse

from otel_lock import LockMiddleware, locked

try:
    from ._middleware_helpers import lock_key, make_manager
except ImportError:
    from _middleware_helpers import lock_key, make_manager


@asynccontextmanager
async def serving(app) -> AsyncIterator[tuple[str, int]]:
    """uvicorn in this event loop on a pre-bound loopback socket (connections queue until it accepts)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    server = uvicorn.Server(uvicorn.Config(app, log_level="critical", lifespan="on"))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        yield sock.getsockname()
    finally:
        server.should_exit = True
        await task
        sock.close()


def authenticated(authorization: str = Header()) -> str:
    if authorization != "Bearer alice":
        raise HTTPException(401)
    return "alice"


def shop(manager, **options) -> FastAPI:
    app = FastAPI()

    @app.post("/stock/{pid}/deduct")
    @locked("stock:{path.pid}", wait=5)
    async def deduct(pid: int, request: Request, user: str = Depends(authenticated)):
        return {"key": request.state.lock.key, "user": user}

    @app.get("/export/{pid}")
    @locked("stock:{path.pid}", wait=1)
    async def export(pid: int):
        async def forever():
            chunk = b"x" * 65536
            while True:
                yield chunk
        return StreamingResponse(forever())

    app.add_middleware(LockMiddleware, manager=manager, **options)
    return app


async def read_status(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), head


async def test_a_client_that_never_sends_its_body_holds_no_lock_and_gets_408(redis_url, redis_client):
    async with make_manager(redis_url) as manager:
        async with serving(shop(manager, body_idle_timeout=1.0)) as (host, port):
            reader, writer = await asyncio.open_connection(host, port)
            writer.write(b"POST /stock/1/deduct HTTP/1.1\r\nHost: shop\r\nAuthorization: Bearer alice\r\n"
                         b"Content-Type: application/json\r\nContent-Length: 20\r\n\r\n")
            await writer.drain()
            async with httpx.AsyncClient(base_url=f"http://{host}:{port}") as client:
                # The stalled request is in the middleware, reading; the buyer is not kept out.
                buyer = await client.post("/stock/1/deduct", headers={"authorization": "Bearer alice"})
                assert buyer.status_code == 200, buyer.text
                assert buyer.json()["key"] == lock_key("stock:1")
            status, head = await asyncio.wait_for(read_status(reader), 10)
            body = await reader.read()
            writer.close()
    assert status == 408
    assert b"application/problem+json" in head and b"request-body-timeout" in body
    assert await redis_client.exists(lock_key("stock:1")) == 0


async def test_a_client_that_does_not_read_the_response_loses_the_lock_after_send_timeout(redis_url, redis_client):
    async with make_manager(redis_url) as manager:
        async with serving(shop(manager, send_timeout=0.5)) as (host, port):
            reader, writer = await asyncio.open_connection(host, port, limit=1024)
            writer.write(b"GET /export/1 HTTP/1.1\r\nHost: shop\r\n\r\n")
            await writer.drain()
            await read_status(reader)   # the response started; from now on we read nothing
            async with httpx.AsyncClient(base_url=f"http://{host}:{port}", timeout=30) as client:
                # The exporter blocks in send until send_timeout; then its lock is let go
                # (without the bound it would hold it for as long as the client stays connected).
                buyer = await client.post("/stock/1/deduct", headers={"authorization": "Bearer alice"})
            writer.close()
    assert buyer.status_code == 200, buyer.text
