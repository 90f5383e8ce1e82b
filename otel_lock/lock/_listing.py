"""Held locks, listed page by page: one SCAN batch, one pipeline for it, then the next.

A namespace may hold hundreds of thousands of locks. Reading every key first
and asking for all of them in one pipeline kept the whole namespace in the
client's memory, and one reply large enough to outlast the socket timeout
(`otel-lock locks` failed that way at 200,000 locks). Here at most one page
of keys and answers is held at a time, and the caller can print each page
as it comes.

Only the fields a row shows are read (HMGET owner depth token), so a huge
hash under a lock-shaped name is one small reply. A hand-written hash is
listed as it is, for the operator looking for a stuck lock: bytes that are
not UTF-8 shown backslash-escaped, a depth or token that is not a whole
number as UNKNOWN, a key without expiry with ttl NEVER. Only another type
under a lock-shaped name (WRONGTYPE) is "not a lock"; any other error, an
ACL refusal above all, is raised: never a shorter list.
"""

from __future__ import annotations

from typing import Any, AsyncGenerator

from ._held import NEVER, LockInfo

PAGE = 1000  # keys per SCAN COUNT and per pipeline
FIELDS = ("owner", "depth", "token")
UNKNOWN = -1  # depth or token: the field is missing or not a whole number


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
    """The locks among `keys` (one pipeline: HMGET and PTTL each); a key gone or not a lock is left out."""
    pipe = client.pipeline(transaction=False)
    for key in keys:
        raw = _raw(key)  # the key's own bytes, even when they are not UTF-8
        pipe.hmget(raw, FIELDS)
        pipe.pttl(raw)
    answers = await pipe.execute(raise_on_error=False)
    found = {}
    for key, fields, pttl in zip(keys, answers[::2], answers[1::2]):
        if _not_a_lock(fields) or _not_a_lock(pttl):
            continue
        owner, depth, token = fields
        if owner and pttl != -2:  # -2: deleted since the HMGET
            ttl = NEVER if pttl == -1 else pttl / 1000
            found[key] = LockInfo(_shown(_raw(key)), _shown(owner), _number(depth), ttl, _number(token))
    return found


async def held_pages(client: Any, pattern: str, page: int = PAGE) -> AsyncGenerator[list[LockInfo], None]:
    """The locks held on one Redis (or Cluster), a page at a time, each page sorted by key."""
    async for keys in key_pages(client, pattern, page):
        found = await describe(client, keys)
        if found:
            yield sorted(found.values(), key=lambda info: info.key)


def _not_a_lock(answer: Any) -> bool:
    """WRONGTYPE: another type under a lock-shaped name. Any other error (NOPERM...) is raised."""
    if not isinstance(answer, BaseException):
        return False
    if str(answer).startswith("WRONGTYPE"):
        return True
    raise answer


def _number(value: bytes | str | None) -> int:
    try:
        number = int(_shown(value))
    except ValueError:
        return UNKNOWN
    return number if number >= 0 else UNKNOWN


def _text(value: bytes | str | None) -> str:
    """A key as SCAN gave it, decoded so that `_raw` gives its bytes back (surrogateescape)."""
    return value.decode(errors="surrogateescape") if isinstance(value, bytes) else (value or "")


def _raw(key: str) -> bytes:
    return key.encode(errors="surrogateescape")


def _shown(value: bytes | str | None) -> str:
    """Printable text: bytes that are not UTF-8 backslash-escaped (b'\\xff' is shown as \\xff)."""
    return value.decode(errors="backslashreplace") if isinstance(value, bytes) else (value or "")
