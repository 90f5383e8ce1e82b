"""Held locks, listed page by page: one SCAN batch, one pipeline for it, then the next.

A namespace may hold hundreds of thousands of locks. Reading every key first
and asking for all of them in one pipeline kept the whole namespace in the
client's memory, and one reply large enough to outlast the socket timeout
(`otel-lock locks` failed that way at 200,000 locks). Here at most one page
of keys and answers is held at a time, and the caller can print each page
as it comes.
"""

from __future__ import annotations

from typing import Any, AsyncGenerator

from ._held import LockInfo

PAGE = 1000  # keys per SCAN COUNT and per pipeline


async def key_pages(client: Any, pattern: str, page: int = PAGE) -> AsyncGenerator[list[str], None]:
    """The keys matching `pattern`, `page` at a time (SCAN may return a key twice: a page never does)."""
    batch: dict[str, None] = {}
    async for key in client.scan_iter(match=pattern, count=page):
        batch[_text(key)] = None
        if len(batch) >= page:
            yield list(batch)
            batch = {}
    if batch:
        yield list(batch)


async def describe(client: Any, keys: list[str]) -> dict[str, LockInfo]:
    """The locks among `keys` (one pipeline: HGETALL and PTTL each); a key gone or not a lock is left out."""
    pipe = client.pipeline(transaction=False)
    for key in keys:
        pipe.hgetall(key)
        pipe.pttl(key)
    answers = await pipe.execute(raise_on_error=False)
    found = {}
    for key, fields, pttl in zip(keys, answers[::2], answers[1::2]):
        if isinstance(fields, BaseException) or isinstance(pttl, BaseException):
            continue  # another type under a lock-shaped name (WRONGTYPE): not a lock
        text = {_text(k): _text(v) for k, v in fields.items()}
        if text.get("owner"):
            found[key] = LockInfo(key, text["owner"], int(text.get("depth") or 0), max(pttl, 0) / 1000,
                                  int(text.get("token") or 0))
    return found


async def held_pages(client: Any, pattern: str, page: int = PAGE) -> AsyncGenerator[list[LockInfo], None]:
    """The locks held on one Redis (or Cluster), a page at a time, each page sorted by key."""
    async for keys in key_pages(client, pattern, page):
        found = await describe(client, keys)
        if found:
            yield sorted(found.values(), key=lambda info: info.key)


def _text(value: bytes | str | None) -> str:
    return value.decode() if isinstance(value, bytes) else (value or "")
