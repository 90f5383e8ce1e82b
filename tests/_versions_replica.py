"""One replica of either release, for tests/test_versions_mixed_fleet.py.

Run as `.venv/bin/python -I` (this tree) or `.venv-0.1.0/bin/python -I` (the
previous release, built from its commit): `-I` keeps the checkout off
sys.path, so each imports its own otel_lock. It uses only what both releases
have. The parent sends one JSON command per line on stdin and reads one JSON
answer per line on stdout, so the test synchronises on what the replica
reports (ready, entered, done), never on sleeps.

    {"op": "post", "path", "headers", "body"}   send a request to this replica's app
    {"op": "hold", ...the same}                  send it; answer once its handler is running
    {"op": "release"}                            let the held handler finish; its response
    {"op": "count", "n"}                         n read-modify-write increments under one lock (and each hold's token)
    {"op": "exit"}

The handlers count their runs in Redis (`runs:<key>`), shared by every replica.
"""

from __future__ import annotations

import asyncio
import json
import sys

import httpx
import redis.asyncio as aioredis
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

import otel_lock
from otel_lock import LockManager, LockMiddleware, idempotent

NAMESPACE = "fleet"
SECRET = "fleet-secret"


class Replica:
    def __init__(self, url: str) -> None:
        self.manager = LockManager.from_url(url, namespace=NAMESPACE)
        self.redis = aioredis.Redis.from_url(url)
        self.entered = asyncio.Event()
        self.release = asyncio.Event()
        self.held: asyncio.Task | None = None

        async def run(request: Request) -> JSONResponse:
            runs = await self.redis.incr(f"runs:{request.headers['idempotency-key']}")
            if request.query_params.get("hold"):
                self.entered.set()
                await self.release.wait()
            return JSONResponse({"charge": runs, "pid": __import__("os").getpid()}, status_code=201)

        def user(request: Request) -> str | None:
            return request.headers.get("x-user")

        @idempotent(shared_scope=True)
        async def charge(request: Request) -> JSONResponse:
            return await run(request)

        @idempotent(principal=user)
        async def pay(request: Request) -> JSONResponse:
            return await run(request)

        app = Starlette(routes=[Route("/charge", charge, methods=["POST"]), Route("/pay", pay, methods=["POST"])])
        app.add_middleware(LockMiddleware, manager=self.manager, hash_secret=SECRET)
        self.client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://shop.example")

    async def post(self, cmd: dict) -> dict:
        response = await self.client.post(cmd["path"], headers=cmd.get("headers", {}),
                                          content=cmd.get("body", "").encode("latin-1"))
        return {"status": response.status_code, "headers": dict(response.headers), "body": response.text}

    async def hold(self, cmd: dict) -> dict:
        self.entered.clear()
        self.release.clear()
        self.held = asyncio.ensure_future(self.post(cmd))
        entered = asyncio.ensure_future(self.entered.wait())
        await asyncio.wait([entered, self.held], return_when=asyncio.FIRST_COMPLETED)
        if not entered.done():
            entered.cancel()
            return {"entered": False, "answer": await self.held}
        return {"entered": True}

    async def finish(self) -> dict:
        assert self.held is not None
        self.release.set()
        return await self.held

    async def count(self, n: int) -> dict:
        """Increments that lose an update unless the lock excludes every other holder."""
        most, holds = 0, []
        for _ in range(n):
            async with self.manager.lock("counter") as held:
                most = max(most, await self.redis.incr("inside"))
                value = int(await self.redis.get("counter") or 0)
                await asyncio.sleep(0)
                await self.redis.set("counter", value + 1)
                await self.redis.decr("inside")
                holds.append([value, held.token])  # the counter orders the holds
        return {"max_inside": most, "holds": holds}

    async def close(self) -> None:
        await self.client.aclose()
        await self.manager.aclose()
        await self.redis.aclose()


async def main(url: str) -> None:
    replica = Replica(url)
    loop = asyncio.get_running_loop()
    say({"ready": otel_lock.__file__})
    while True:
        line = await loop.run_in_executor(None, sys.stdin.readline)
        if not line:
            break
        cmd = json.loads(line)
        op = cmd["op"]
        if op == "exit":
            break
        if op == "post":
            say(await replica.post(cmd))
        elif op == "hold":
            say(await replica.hold(cmd))
        elif op == "release":
            say(await replica.finish())
        elif op == "count":
            say(await replica.count(int(cmd["n"])))
    await replica.close()


def say(answer: dict) -> None:
    sys.stdout.write(json.dumps(answer) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1]))
