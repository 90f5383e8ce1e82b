"""Idempotency-Key (draft-ietf-httpapi-idempotency-key-header, Stripe practice).

One record per (principal, key) in Redis, next to a lock of the same hash
tag. The lock is the in-flight marker: it has a lease that the manager's
watchdog renews while the handler runs, so a crashed replica's claim ends
by itself. The record says what happened:

    started    the handler was entered; seen while the lock is free, the
               attempt died (crash, lost lease): outcome unknown
    done       status, allow-listed headers and body, replayed to retries
    unknown    the handler raised, answered 5xx or the client went away (-> 409)
    tombstone  completed, but streamed or larger than max_body: not replayable

The route is stored (it is part of the fingerprint), so a key reused on
another route is a 422 like a changed payload, never a second execution.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import inspect
import json
import logging
import re
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from starlette.requests import ClientDisconnect, Request

from ._annotations import Idempotent
from ._types import Message, Receive, ResponseEnd, Scope, Send
from ..lock._errors import LockTimeout, RedisUnavailable
from ._problem import send_problem

log = logging.getLogger("otel_lock.idempotency")

MAX_KEY = 255
HEADER = b"idempotency-key"
RECORD_SUFFIX = ":idempotency"
# Replayed as stored; everything else (Set-Cookie, Authorization, hop-by-hop,
# Content-Length, which is recomputed) is dropped.
STORED_HEADERS = frozenset({
    "content-type", "content-encoding", "content-language", "content-location", "location", "etag",
    "last-modified", "link", "cache-control", "expires", "vary",
})
_BARE = re.compile(r"^[A-Za-z0-9\-._~+/=:]+$")
_REDIS_DOWN = (RedisConnectionError, RedisTimeoutError, OSError, RedisUnavailable)

STARTED, DONE, UNKNOWN, TOMBSTONE = "started", "done", "unknown", "tombstone"
_UNKNOWN_CAUSES = {
    "failed": "failed (the handler raised or answered 5xx)",
    "interrupted": "was interrupted (client gone or replica died)",
}

# Runs the business lock and the app; returns whether the handler was entered.
Inner = Callable[[Scope, Receive, Send], Awaitable[bool]]


class IdempotencyKeyError(ValueError):
    """The Idempotency-Key header is not a valid key (-> 400)."""


def parse_key(headers: list[tuple[bytes, bytes]]) -> str | None:
    """The key from an sf-string (`"abc"`), or a bare token (`abc`, accepted for compatibility)."""
    values = [value for name, value in headers if name.lower() == HEADER]
    if not values:
        return None
    if len(values) > 1:
        raise IdempotencyKeyError("Idempotency-Key was sent more than once")
    raw = values[0].decode("latin-1").strip(" \t")
    key = _sf_string(raw) if raw.startswith('"') else _bare(raw)
    if not 1 <= len(key) <= MAX_KEY:
        raise IdempotencyKeyError(f"Idempotency-Key must be 1 to {MAX_KEY} characters long")
    return key


def _sf_string(raw: str) -> str:
    """RFC 8941 sf-string: quoted printable ASCII with `\\"` and `\\\\` escapes, nothing after it."""
    out, i = [], 1
    while i < len(raw):
        ch = raw[i]
        if ch == "\\":
            if i + 1 >= len(raw) or raw[i + 1] not in '"\\':
                raise IdempotencyKeyError('Idempotency-Key: only \\" and \\\\ may be escaped')
            out.append(raw[i + 1])
            i += 2
        elif ch == '"':
            if i != len(raw) - 1:
                raise IdempotencyKeyError("Idempotency-Key must be a single quoted string (no parameters)")
            return "".join(out)
        elif not 0x20 <= ord(ch) <= 0x7E:
            raise IdempotencyKeyError("Idempotency-Key must be printable ASCII")
        else:
            out.append(ch)
            i += 1
    raise IdempotencyKeyError("Idempotency-Key has an unterminated quoted string")


def _bare(raw: str) -> str:
    if not _BARE.match(raw):
        raise IdempotencyKeyError(
            'Idempotency-Key must be a quoted string ("...") or a bare token of letters, digits and -._~+/=:')
    return raw


def default_principal(request: Request) -> str:
    """The caller: a hash of the Authorization header, else the client address."""
    auth = request.headers.get("authorization")
    if auth:
        return "auth:" + hashlib.sha256(auth.encode("latin-1", "replace")).hexdigest()
    client = request.client
    return "addr:" + (client.host if client else "unknown")


def canonical_body(body: bytes, content_type: str) -> bytes:
    """Canonical JSON (sorted keys, no whitespace) when the body is JSON, else the raw bytes."""
    if body and ("json" in content_type or not content_type):
        try:
            doc = json.loads(body)
            return b"j" + json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()
        except (ValueError, RecursionError, UnicodeDecodeError):
            pass
    return b"b" + body


def fingerprint(secret: bytes, method: str, route: str, body: bytes, content_type: str) -> str:
    mac = hmac.new(secret, digestmod=hashlib.sha256)
    for piece in (method.encode(), route.encode(), canonical_body(body, content_type)):
        mac.update(len(piece).to_bytes(8, "big"))  # length-prefixed: no piece can spill into the next
        mac.update(piece)
    return mac.hexdigest()


@dataclass
class _Capture:
    """What the handler sent, kept only while it stays replayable."""

    max_body: int
    status: int = 0
    headers: list | None = None
    chunks: list | None = None
    size: int = 0
    messages: int = 0
    finished: bool = False     # the final body message went out

    def start(self, message: Message) -> None:
        self.status = message["status"]
        self.headers = [[k.decode("latin-1"), v.decode("latin-1")] for k, v in message.get("headers", [])
                        if k.decode("latin-1").lower() in STORED_HEADERS]
        self.chunks = []

    def body(self, message: Message) -> None:
        chunk = message.get("body", b"")
        self.messages += 1
        self.size += len(chunk)
        if self.chunks is not None and self.size <= self.max_body and self.messages == 1:
            self.chunks.append(chunk)
        else:
            self.chunks = None  # streamed or too large: a tombstone, not a replay


class IdempotencyGate:
    """Runs `inner` at most once per (principal, key); answers retries from the record."""

    def __init__(self, manager: Any, secret: bytes) -> None:
        self.manager = manager
        self.secret = secret

    async def __call__(self, idem: Idempotent, route: str, scope: Scope, receive: Receive, send: Send,
                       body: bytes, inner: Inner) -> None:
        flow = _Flow(self, idem, route, scope, receive, send)
        await flow.run(body, inner)

    def count(self, route: str, outcome: str) -> None:
        self.manager.telemetry.idempotency_requests.add(1, {"http.route": route, "idempotency.outcome": outcome})


class _Flow:
    """One request through the gate; all per-request state lives here."""

    def __init__(self, gate: IdempotencyGate, idem: Idempotent, route: str, scope: Scope,
                 receive: Receive, send: Send) -> None:
        self.gate, self.idem, self.route = gate, idem, route
        self.scope, self.receive, self.send = scope, receive, send
        self.redis = gate.manager.redis
        self.response_started = False
        self.handler_called = False

    async def run(self, body: bytes, inner: Inner) -> None:
        try:
            key = parse_key(self.scope.get("headers", []))
        except IdempotencyKeyError as error:
            self.gate.count(self.route, "invalid_key")
            return await send_problem(self.send, 400, "idempotency-key-invalid", str(error))
        if key is None:
            if self.idem.required:
                self.gate.count(self.route, "missing_key")
                return await send_problem(self.send, 400, "idempotency-key-missing",
                                          "this operation requires an Idempotency-Key header")
            await inner(self.scope, self.receive, self.send)
            return
        principal = await self._principal()
        scoped = f"{principal}\0{key}".encode("utf-8", "surrogatepass")
        scope_id = hmac.new(self.gate.secret, scoped, hashlib.sha256).hexdigest()[:32]
        self.lock_key = f"idem:{scope_id}"
        self.record_key = f"{self.gate.manager.namespace}:{{{self.lock_key}}}{RECORD_SUFFIX}"
        content_type = _header(self.scope, b"content-type")
        self.fp = fingerprint(self.gate.secret, self.scope["method"], self.route, body, content_type)
        try:
            await self._gate(inner)
        except _REDIS_DOWN as error:
            if self.response_started or self.handler_called:
                raise  # the app's own error (an OSError from a file, say), not the store's
            log.warning("otel-lock: idempotency store unavailable: %s", error)
            if not isinstance(error, RedisUnavailable):  # the manager counts its own
                self.gate.manager.telemetry.errors.add(1, {
                    "lock.name": f"idempotency {self.route}", "lock.operation": "acquire",
                    "error.type": "redis_unavailable"})
            await send_problem(self.send, 503, "redis-unavailable", "the idempotency store is unavailable",
                               retry_after=self.idem.retry_after)

    async def _principal(self) -> str:
        if self.idem.principal is None:
            return default_principal(Request(self.scope))
        value = self.idem.principal(Request(self.scope))
        if inspect.isawaitable(value):
            value = await value
        # None or "" means "no opinion": fall back to the default rather than merge all callers.
        return default_principal(Request(self.scope)) if value is None or value == "" else "p:" + str(value)

    async def _gate(self, inner: Inner) -> None:
        record = await self._load()
        if record is not None and await self._answer_settled(record):
            return
        label = f"idempotency {self.route}"
        if self.idem.wait_for_inflight > 0:
            entered = False
            try:
                async with self.gate.manager.lock(self.lock_key, wait=self.idem.wait_for_inflight, name=label,
                                                  cancel_on_lost=False) as held:
                    entered = True
                    await self._owned(held, inner)
            except LockTimeout:
                if entered:
                    raise  # the handler's own, not ours
                await self._busy()
            return
        held = await self.gate.manager.try_lock(self.lock_key, name=label, cancel_on_lost=False)
        if held is None:
            return await self._busy()
        try:
            await self._owned(held, inner)
        finally:
            await _release_quietly(held)

    async def _answer_settled(self, record: dict) -> bool:
        """Answer from a record if it settles the request; False: started (maybe in flight)."""
        if record.get("fp") != self.fp:
            self.gate.count(self.route, "mismatch")
            await send_problem(self.send, 422, "idempotency-key-mismatch",
                               "this Idempotency-Key was already used with a different request "
                               "(payload, method or route); use a new key for a new request")
            return True
        state = record.get("state")
        if state == DONE:
            self.gate.count(self.route, "replayed")
            await self._replay(record)
            return True
        if state == UNKNOWN:
            # 409, not a replayed 500: clients retry 5xx automatically, and
            # retrying cannot help here.
            self.gate.count(self.route, "conflict")
            how = _UNKNOWN_CAUSES.get(record.get("cause"), _UNKNOWN_CAUSES["interrupted"])
            await send_problem(self.send, 409, "idempotency-outcome-unknown",
                               f"the first request with this Idempotency-Key {how}; its effects are unknown, "
                               "so it is not run again: check its result, then use a new key")
            return True
        if state == TOMBSTONE:
            self.gate.count(self.route, "conflict")
            await send_problem(self.send, 409, "idempotency-response-not-stored",
                               "the request with this Idempotency-Key completed, but its response was "
                               "streamed or too large to store, so it cannot be replayed")
            return True
        return False

    async def _busy(self) -> None:
        record = await self._load()
        # Finished between our two looks, or a different request: 422 is checked before 409.
        if record is not None and (record.get("state") != STARTED or record.get("fp") != self.fp):
            await self._answer_settled(record)
            return
        self.gate.count(self.route, "conflict")
        await send_problem(self.send, 409, "idempotency-request-in-flight",
                           "a request with this Idempotency-Key is still being processed; retry later",
                           retry_after=self.idem.retry_after)

    async def _owned(self, held: Any, inner: Inner) -> None:
        record = await self._load()
        if record is not None:
            if record.get("state") == STARTED and record.get("fp") == self.fp:
                # Started, yet nobody holds the lock: that attempt died mid-way.
                record = {**record, "state": UNKNOWN, "cause": "interrupted"}
                await self._store(record)
            await self._answer_settled(record)
            return
        await self._store({"state": STARTED, "fp": self.fp, "route": self.route})
        capture = _Capture(self.idem.max_body)
        entered = {"handler": False}
        end = ResponseEnd()

        async def send(message: Message) -> None:
            kind = message["type"]
            if kind == "http.response.start":
                self.response_started = True
                capture.start(message)
            elif kind == "http.response.body":
                capture.body(message)
            elif kind.startswith("http.response."):
                capture.chunks = None  # pathsend, zerocopysend, trailers: not replayable
            if end.is_last(message):
                capture.finished = True
                # Stored before the last byte goes out, so a client that
                # retries at once finds the outcome, not an in-flight claim.
                await self._settle(held, capture, None)
            await self.send(message)

        self.handler_called = True
        try:
            entered["handler"] = await inner(self.scope, self.receive, send)
        except BaseException as error:
            if not capture.finished:
                await _shielded(self._settle(held, capture, error))
            raise
        if not entered["handler"]:
            await self._forget()  # the business lock was not taken: nothing ran, a retry may run it
        elif not capture.finished:
            await self._settle(held, capture, None)  # client went away mid-response

    async def _settle(self, held: Any, capture: _Capture, error: BaseException | None) -> None:
        """Write the final record; on a lost lease someone else owns the record now."""
        if held.lost.is_set():
            return
        try:
            if capture.finished and capture.status < 500 and error is None:
                if capture.chunks is None:
                    await self._store({"state": TOMBSTONE, "fp": self.fp, "route": self.route})
                else:
                    await self._store({
                        "state": DONE, "fp": self.fp, "route": self.route, "status": capture.status,
                        "headers": capture.headers,
                        "body": base64.b64encode(b"".join(capture.chunks)).decode(),
                    })
                self.gate.count(self.route, "stored")
                return
            # A client that went away (disconnect message, or the server's send
            # raising) is not a failure of the handler: 409, like a crash.
            gone = isinstance(error, (OSError, ClientDisconnect))
            failed = (isinstance(error, Exception) and not gone) or (capture.finished and capture.status >= 500)
            if failed and self.idem.retry_on_5xx:
                await self._forget()
                return
            await self._store({"state": UNKNOWN, "fp": self.fp, "route": self.route,
                               "cause": "failed" if failed else "interrupted"})
            self.gate.count(self.route, "stored")
        except _REDIS_DOWN as exc:
            log.warning("otel-lock: could not store the idempotency outcome (the claim stays 'started', "
                        "retries will get outcome-unknown): %s", exc)

    async def _replay(self, record: dict) -> None:
        body = base64.b64decode(record.get("body", ""))
        headers = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in record.get("headers", [])]
        headers += [(b"content-length", str(len(body)).encode()), (b"idempotent-replayed", b"true")]
        await self.send({"type": "http.response.start", "status": int(record["status"]), "headers": headers})
        await self.send({"type": "http.response.body", "body": body, "more_body": False})

    async def _load(self) -> dict | None:
        raw = await self.redis.get(self.record_key)
        if raw is None:
            return None
        try:
            record = json.loads(raw)
        except ValueError:
            return None
        return record if isinstance(record, dict) else None

    async def _store(self, record: dict) -> None:
        await self.redis.set(self.record_key, json.dumps(record, separators=(",", ":")),
                             px=int(self.idem.ttl * 1000))

    async def _forget(self) -> None:
        try:
            await self.redis.delete(self.record_key)
        except _REDIS_DOWN as exc:
            log.warning("otel-lock: could not drop an unused idempotency claim: %s", exc)


def _header(scope: Scope, name: bytes) -> str:
    for key, value in scope.get("headers", []):
        if key.lower() == name:
            return value.decode("latin-1").lower()
    return ""


async def _release_quietly(held: Any) -> None:
    try:
        await held.release()
    except _REDIS_DOWN as exc:
        log.warning("otel-lock: could not release %s, it will expire by itself: %s", held.key, exc)


async def _shielded(coro: Awaitable[None]) -> None:
    """Finish writing an outcome even while the request is being cancelled."""
    task = asyncio.ensure_future(coro)
    try:
        await asyncio.shield(task)
    except asyncio.CancelledError:
        await task
        raise
