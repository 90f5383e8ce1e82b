"""The machine's own limit for a hand-over: one token passed around N processes through Redis.

Worker i waits for the token on its own channel (SUBSCRIBE, woken by a
PUBLISH) or its own list (BLPOP, woken by an LPUSH), and passes it to worker
i+1 the same way. A lock hand-over between the same processes does at least
this much: one process is told, by Redis, that it may go on. Both rings use
the lock's own lean connection (hiredis, no redis-py layers), so the ratio
"lock hand-overs / ring hops" measures what the lock adds to the bare trip.

    python -m benchmarks._worker '{"mode": "ring", "via": "pubsub", "url": ..., "index": 0, "size": 8}'
"""

from __future__ import annotations

import asyncio
import time
from functools import partial
from typing import Any, Awaitable, Callable

from otel_lock.lock._connection import Connection

from . import _counting

PREFIX = "bench:ring"


def _connection(url: str, **extra: Any) -> Connection:
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    return Connection(host=parts.hostname or "127.0.0.1", port=parts.port or 6379, **extra)


async def _pubsub(spec: dict, send: Callable[[dict], None], await_start: Callable[[], tuple[float, float]]) -> dict:
    index, size = spec["index"], spec["size"]
    mine, nxt = f"{PREFIX}:{index}", f"{PREFIX}:{(index + 1) % size}"
    hops = [0, 0.0]  # in the window, and the stop time
    out = _connection(spec["url"])
    loop = asyncio.get_running_loop()

    def on_push(reply: Any) -> None:
        if reply[0] != b"message":
            return
        if time.monotonic() < hops[1]:
            hops[0] += 1
            loop.create_task(out.execute("PUBLISH", nxt, "t"))

    sub = _connection(spec["url"], on_push=on_push)
    await sub.execute("SUBSCRIBE", mine)
    await out.execute("PING")
    send({"ready": True})
    start, stop = await loop.run_in_executor(None, await_start)
    hops[1] = stop
    await asyncio.sleep(max(0.0, start - time.monotonic()))
    cpu, sleeps = time.process_time(), _counting.sleeps()
    if index == 0:
        await out.execute("PUBLISH", nxt, "t")
    await asyncio.sleep(max(0.0, stop - time.monotonic()))
    cpu, sleeps = time.process_time() - cpu, _counting.sleeps() - sleeps
    await sub.aclose()
    await out.aclose()
    return {"hops": hops[0], "cpu": cpu, "sleeps": sleeps}


async def _circulate(index: int, await_start: Callable[[], tuple[float, float]],
                     take: Callable[[], Awaitable[bool]], pass_on: Callable[[], Awaitable[Any]]) -> dict:
    """From the common start to the common stop: whenever `take()` got the token, `pass_on()` it."""
    start, stop = await asyncio.get_running_loop().run_in_executor(None, await_start)
    await asyncio.sleep(max(0.0, start - time.monotonic()))
    cpu, sleeps = time.process_time(), _counting.sleeps()
    if index == 0:
        await pass_on()
    hops = 0
    while time.monotonic() < stop:
        if await take():
            hops += 1
            await pass_on()
    return {"hops": hops, "cpu": time.process_time() - cpu, "sleeps": _counting.sleeps() - sleeps}


async def _lists(spec: dict, send: Callable[[dict], None], await_start: Callable[[], tuple[float, float]],
                 queued: bool = False) -> dict:
    """The BLPOP ring; `queued`: with one more round trip per hop after the token is passed, a lock's floor.

    A lock whose waiters queue costs a holder three waits per cycle where a
    ring hop costs two: the grant, its release's reply, and the reply to the
    next acquisition's request to queue (off the hand-over's path, but on the
    CPU). The queued ring does exactly that with no lock logic: its rate is
    what a queued lock's hand-over can reach on this connection.
    """
    index, size = spec["index"], spec["size"]
    mine, nxt = f"{PREFIX}:{index}", f"{PREFIX}:{(index + 1) % size}"
    conn = _connection(spec["url"], timeout=None)
    await conn.execute("DEL", mine)
    send({"ready": True})

    async def take() -> bool:
        return await conn.execute("BLPOP", mine, 0.05) is not None

    async def pass_on() -> None:
        await conn.execute("LPUSH", nxt, "t")
        if queued:
            await conn.execute("PING")  # the next acquisition's request to queue, answered at once

    try:
        return await _circulate(index, await_start, take, pass_on)
    finally:
        await conn.aclose()


async def _redis_py_pubsub(spec: dict, send: Callable[[dict], None],
                           await_start: Callable[[], tuple[float, float]]) -> dict:
    """The same ring through redis-py's asyncio client (hiredis parser): what an app would write."""
    import redis.asyncio as aioredis

    index, size = spec["index"], spec["size"]
    mine, nxt = f"{PREFIX}:{index}", f"{PREFIX}:{(index + 1) % size}"
    client = aioredis.Redis.from_url(spec["url"])
    pubsub = client.pubsub()
    await pubsub.subscribe(mine)
    await pubsub.get_message(timeout=1.0)  # the subscribe confirmation
    await client.ping()
    send({"ready": True})

    async def take() -> bool:
        message = await pubsub.get_message(timeout=0.05)
        return message is not None and message["type"] == "message"

    try:
        return await _circulate(index, await_start, take, lambda: client.publish(nxt, "t"))
    finally:
        await pubsub.aclose()
        await client.aclose()


async def _redis_py_lists(spec: dict, send: Callable[[dict], None],
                          await_start: Callable[[], tuple[float, float]]) -> dict:
    """The BLPOP/LPUSH ring through redis-py's asyncio client."""
    import redis.asyncio as aioredis

    index, size = spec["index"], spec["size"]
    mine, nxt = f"{PREFIX}:{index}", f"{PREFIX}:{(index + 1) % size}"
    client = aioredis.Redis.from_url(spec["url"])
    await client.delete(mine)
    send({"ready": True})

    async def take() -> bool:
        return await client.blpop([mine], timeout=0.05) is not None

    try:
        return await _circulate(index, await_start, take, lambda: client.lpush(nxt, "t"))
    finally:
        await client.aclose()


def run(spec: dict, send: Callable[[dict], None], await_start: Callable[[], tuple[float, float]]) -> dict:
    via = {"pubsub": _pubsub, "lists": _lists, "lists-queued": partial(_lists, queued=True),
           "redis-py": _redis_py_pubsub, "redis-py-lists": _redis_py_lists}[spec["via"]]
    return asyncio.run(via(spec, send, await_start))

