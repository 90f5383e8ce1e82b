"""One protected request: read body -> build key -> idempotency -> acquire -> run app -> release.

It runs after routing, around the matched route's own app. The whole body
is read (bounded by `max_body` and the body-read timeout) before any lock
is requested, so a client that never sends its body holds nothing. By
default the lock is held until the route's app call returns: FastAPI's
`yield`-dependency exit code and background tasks run under it. Time spent
blocked in `send` (a client that does not read) is bounded by `send_timeout`.
"""

from __future__ import annotations

import asyncio
import logging
import re
from typing import TYPE_CHECKING, Any

from ..lock._errors import LockLost, LockTimeout, RedisUnavailable
from ..lock._held import HeldLock
from ._annotations import Locked
from ._guard import PROTECTED, ROUTE_STATE, UNCHECKED
from ._keys import Part, TemplateValueError
from ._problem import send_problem
from ._routing import Annotated, RouteMatch
from ._typed import INVALID, TypedFields, Values
from ._types import ASGIApp, Message, Receive, ResponseEnd, Scope, Send

if TYPE_CHECKING:
    from ._middleware import LockMiddleware

log = logging.getLogger("otel_lock.middleware")
_DIGITS = re.compile(rb"[0-9]{1,18}")   # ASCII only: '²'.isdigit() is True, int('²') raises


class SendTimeout(OSError):
    """The client did not take the response within send_timeout: treated like a client that went away."""


class Flow:
    """One request's trip through the middleware; all per-request state lives here."""

    def __init__(self, mw: LockMiddleware, annotated: Annotated | RouteMatch, route: str, typed: TypedFields | None,
                 app: ASGIApp, scope: Scope, receive: Receive, send: Send) -> None:
        self.mw, self.annotated, self.route, self.typed, self.app = mw, annotated, route, typed, app
        self.scope, self.receive, self.send = scope, receive, send
        self.body = b""

    async def run(self) -> None:
        if not await self._read_body():
            return
        locked, idem = self.annotated.locked, self.annotated.idempotent
        name = None
        if locked is not None:
            try:
                name = await self._key(locked)
            except TemplateValueError as error:
                await send_problem(self.send, 400, "lock-key-invalid", str(error))
                return
            if name is INVALID:
                # FastAPI rejects this value with its own 422: nothing to lock, nothing to store.
                token = ROUTE_STATE.set(UNCHECKED)
                try:
                    await self.app(self.scope, self.receive, self.send)
                finally:
                    ROUTE_STATE.reset(token)
                return
        inner = Protected(self.mw, locked, name, self.app)
        send = BoundedSend(self.send, self.mw.send_timeout)
        try:
            if idem is None:
                await inner(self.scope, self.receive, send)
            else:
                await self.mw.gate(idem, self.route, self.scope, self.receive, send, self.body, inner)
        except SendTimeout as error:
            log.warning("otel-lock: %s %s: %s; the response was cut off and the lock released",
                        self.scope.get("method"), self.route, error)

    async def _key(self, locked: Locked) -> Any:
        """The lock name, or INVALID when the framework will reject a value (422) anyway."""
        values = Values(self.scope, self.body, self.typed)
        found: dict[Part, str] = {}
        for part in locked.template.parts:
            value = await values.get(part)
            if value is INVALID:
                return INVALID
            found[part] = value
        return locked.template.render(found.__getitem__, self.mw.secret if locked.hash_parts else None)

    async def _read_body(self) -> bool:
        """Read the whole body (413 above max_body, 408 past body_timeout), then replay it to the app."""
        limit = self.mw.max_body
        declared = _header(self.scope, b"content-length")
        if declared is not None:
            if not _DIGITS.fullmatch(declared):
                await send_problem(self.send, 400, "invalid-content-length",
                                   "Content-Length must be a number of bytes (ASCII digits)")
                return False
            if int(declared) > limit:
                await self._too_large()
                return False
        chunks: list[bytes] = []
        size = 0
        try:
            async with asyncio.timeout(self.mw.body_timeout):
                while True:
                    message = await self.receive()
                    if message["type"] == "http.disconnect":
                        return False  # the client is gone: nothing to lock for
                    chunk = message.get("body", b"")
                    size += len(chunk)
                    if size > limit:
                        await self._too_large()
                        return False
                    chunks.append(chunk)
                    if not message.get("more_body", False):
                        break
        except TimeoutError:
            await send_problem(self.send, 408, "request-body-timeout",
                               f"the request body did not arrive within {self.mw.body_timeout:g} s",
                               headers=[(b"connection", b"close")])
            return False
        self.body = b"".join(chunks)
        self.receive = _replay(self.body, self.receive)
        return True

    async def _too_large(self) -> None:
        await send_problem(self.send, 413, "request-too-large", f"the request body exceeds {self.mw.max_body} bytes",
                           headers=[(b"connection", b"close")])


class Protected:
    """The business lock (if any) around the route's app; returns whether the app was entered.

    The call into the idempotency gate passes this as `inner`.
    """

    def __init__(self, mw: LockMiddleware, rule: Locked | None, name: str | None, app: ASGIApp) -> None:
        self.mw, self.rule, self.name, self.app = mw, rule, name, app

    async def _run_app(self, scope: Scope, receive: Receive, send: Send) -> None:
        token = ROUTE_STATE.set(PROTECTED)
        try:
            await self.app(scope, receive, send)
        finally:
            ROUTE_STATE.reset(token)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> bool:
        rule = self.rule
        if rule is None:
            await self._run_app(scope, receive, send)
            return True
        name = self.name
        assert name is not None  # a rule comes with the name its template rendered
        held: HeldLock | None = None
        started = entered = app_done = False
        end = ResponseEnd()
        early = rule.release_after == "response"

        async def watched_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            last = end.is_last(message)
            await send(message)
            if last and early:
                # release_after="response": the next request may start while this
                # app still runs its background tasks and dependency exit code.
                assert held is not None  # the app runs inside the hold
                await _release_quietly(held)

        try:
            async with self.mw.manager.lock(name, wait=rule.wait, lease=rule.lease, name=rule.lock_name,
                                            cancel_on_lost=True) as held:
                entered = True
                scope["state"] = {**scope.get("state", {}), "lock": held}
                await self._run_app(scope, receive, watched_send)
                app_done = True
        except LockTimeout:
            if entered:
                raise  # the handler's own lock, not ours
            await send_problem(send, rule.status, "lock-timeout",
                               f"the resource is busy (lock {rule.lock_name!r} not acquired within the wait)",
                               retry_after=_retry_after(rule))
            return False
        except RedisUnavailable as error:
            if app_done:
                return True  # the release failed; the lease expires by itself
            if entered:
                raise
            if rule.fail_open:
                # The manager counted the Redis error (otel_lock.errors); this counts the unlocked run.
                self.mw.manager.telemetry.fail_open.add(1, {"lock.name": rule.lock_name})
                log.warning("otel-lock: Redis unavailable, running %s without its lock (fail_open)", rule.lock_name)
                await self._run_app(scope, receive, send)
                return True
            # An open circuit breaker knows when it lets a call through again.
            await send_problem(send, 503, "redis-unavailable", "the lock service is unavailable",
                               retry_after=_retry_after(rule) if error.retry_after is None else error.retry_after)
            return False
        except LockLost:
            if started:
                raise  # half a response is out: abort it, the server drops the connection
            await send_problem(send, 503, "lock-lost",
                               "the lock was lost while the request ran; its effects may be incomplete",
                               retry_after=_retry_after(rule))
        return True


class BoundedSend:
    """`send` with a budget: the time a protected request may spend blocked on a client that does not read."""

    __slots__ = ("send", "left")

    def __init__(self, send: Send, budget: float) -> None:
        self.send, self.left = send, budget

    async def __call__(self, message: Message) -> None:
        loop = asyncio.get_running_loop()
        began = loop.time()
        try:
            async with asyncio.timeout(max(self.left, 0.0)):
                await self.send(message)
        except TimeoutError:
            self.left = 0.0
            raise SendTimeout("the client did not read the response within send_timeout") from None
        self.left -= loop.time() - began


def _retry_after(rule: Locked) -> float:
    return rule.retry_after if rule.retry_after is not None else 1.0


async def _release_quietly(held: HeldLock) -> None:
    try:
        await held.release()
    except RedisUnavailable as error:
        log.warning("otel-lock: could not release %s, it will expire by itself: %s", held.key, error)


def _replay(body: bytes, receive: Receive) -> Receive:
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()  # disconnects still reach the app

    return replay


def _header(scope: Scope, name: bytes) -> bytes | None:
    headers: list[tuple[bytes, bytes]] = scope.get("headers", [])
    for key, value in headers:
        if key.lower() == name:
            return value.strip()
    return None
