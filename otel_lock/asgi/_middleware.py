"""LockMiddleware: match route -> read body -> build key -> idempotency -> acquire -> run app -> release.

Pure ASGI. It runs before the router, so it resolves the route itself
(`_routing`), and wraps `send` to release the lock right after the last body
message went out (streaming included). Per-request state lives in a
`_Request` object, never on the middleware.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any, Callable
from urllib.parse import parse_qsl

from ._annotations import MIB, Locked
from ._types import ASGIApp, Message, Receive, ResponseEnd, Scope, Send
from ..lock._errors import LockLost, LockTimeout, RedisUnavailable
from ._idempotency import IdempotencyGate
from ._keys import Part, TemplateValueError, json_value, resolve_secret
from ._problem import send_problem
from ._routing import RouteMatch, RouteResolver, find_routes

log = logging.getLogger("otel_lock.middleware")


class LockMiddleware:
    """Takes each annotated route's lock before the app runs; see docs/middleware.md."""

    def __init__(self, app: ASGIApp, manager: Any, rules: dict[str, Any] | None = None,
                 hash_secret: str | bytes | None = None, max_body: int = MIB,
                 principal: Callable[[Any], Any] | None = None) -> None:
        if manager is None:
            raise ValueError("LockMiddleware needs manager=LockManager(...)")
        if not isinstance(max_body, int) or max_body < 0:
            raise ValueError(f"max_body must be a non-negative number of bytes, got {max_body!r}")
        self.app = app
        self.manager = manager
        self.resolver = RouteResolver(rules)
        if hash_secret is None:
            hash_secret = getattr(manager, "hash_secret", None)
        self.secret = resolve_secret(hash_secret, getattr(manager, "namespace", "otel-lock"))
        self.max_body = max_body
        # principal: whose Idempotency-Keys these are, for @idempotent routes that don't say.
        self.gate = IdempotencyGate(manager, self.secret, principal=principal)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        routes = find_routes(self.app, scope)
        self.resolver.prepare_openapi(routes)
        match = self.resolver.resolve(scope, routes)
        if match is None:
            await self.app(scope, receive, send)
            return
        await _Request(self, match, scope, receive, send).run()


class _Request:
    """One request's trip through the middleware."""

    def __init__(self, mw: LockMiddleware, match: RouteMatch, scope: Scope, receive: Receive, send: Send) -> None:
        self.mw, self.match = mw, match
        self.scope, self.receive, self.send = scope, receive, send
        self.body = b""
        self.json: Any = _UNPARSED
        # What the router would set: HTTP instrumentations read the route
        # template from it, also for answers the middleware gives by itself.
        scope.setdefault("route", _RouteTemplate(match.route))

    async def run(self) -> None:
        locked, idem = self.match.locked, self.match.idempotent
        if idem is not None or (locked is not None and locked.template.needs_body):
            if not await self._buffer_body():
                return
        name = None
        if locked is not None:
            try:
                secret = self.mw.secret if locked.hash_parts else None
                name = locked.template.render(self._value, secret)
            except TemplateValueError as error:
                await send_problem(self.send, 400, "lock-key-invalid", str(error))
                return
        inner = _Locked(self.mw, locked, name)
        if idem is None:
            await inner(self.scope, self.receive, self.send)
        else:
            await self.mw.gate(idem, self.match.route, self.scope, self.receive, self.send, self.body, inner)

    async def _buffer_body(self) -> bool:
        """Read the body once (413 above max_body), then replay it to the app unchanged."""
        limit = self.mw.max_body
        declared = _header(self.scope, b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > limit):
            await self._too_large(declared.isdigit())
            return False
        chunks, size = [], 0
        while True:
            message = await self.receive()
            if message["type"] == "http.disconnect":
                return False  # the client is gone: nothing to lock for
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                await self._too_large(True)
                return False
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        self.body = b"".join(chunks)
        self.receive = _replay(self.body, self.receive)
        return True

    async def _too_large(self, numeric: bool) -> None:
        if not numeric:
            await send_problem(self.send, 400, "invalid-content-length", "Content-Length is not a number")
        else:
            await send_problem(self.send, 413, "request-too-large",
                               f"the request body exceeds {self.mw.max_body} bytes")

    def _value(self, part: Part) -> str:
        if part.source == "path":
            if part.field not in self.match.path_params:
                raise TemplateValueError(f"the route has no path parameter {part.field!r} (needed by {part.text})")
            value = str(self.match.path_params[part.field])
        elif part.source == "query":
            found = [v for k, v in parse_qsl(self.scope.get("query_string", b"").decode("latin-1"),
                                              keep_blank_values=True) if k == part.field]
            value = _single(found, f"query parameter {part.field!r}", part)
        elif part.source == "header":
            found = [v.decode("latin-1") for k, v in self.scope.get("headers", [])
                     if k.decode("latin-1").lower() == part.field]
            value = _single(found, f"header {part.field!r}", part)
        else:
            value = json_value(self._json(), part)
        if value == "":
            raise TemplateValueError(f"{part.text} is empty")
        return value

    def _json(self) -> Any:
        if self.json is _UNPARSED:
            try:
                self.json = json.loads(self.body)
            except (ValueError, RecursionError):
                raise TemplateValueError("the request body is not valid JSON") from None
        return self.json


class _Locked:
    """The business lock around the app; returns whether the handler was entered."""

    def __init__(self, mw: LockMiddleware, rule: Locked | None, name: str | None) -> None:
        self.mw, self.rule, self.name = mw, rule, name

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> bool:
        rule = self.rule
        if rule is None:
            await self.mw.app(scope, receive, send)
            return True
        held: Any = None
        started = entered = app_done = False
        end = ResponseEnd()

        async def release_after_last_body(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            last = end.is_last(message)
            await send(message)
            if last:
                # The response is out: let the next request in now, not after
                # background tasks. release() is idempotent; the exit releases too.
                await _release_quietly(held)

        try:
            async with self.mw.manager.lock(self.name, wait=rule.wait, lease=rule.lease, name=rule.lock_name,
                                            cancel_on_lost=True) as held:
                entered = True
                scope["state"] = {**scope.get("state", {}), "lock": held}
                await self.mw.app(scope, receive, release_after_last_body)
                app_done = True
        except LockTimeout:
            if entered:
                raise  # the handler's own lock, not ours
            await send_problem(send, rule.status, "lock-timeout",
                               f"the resource is busy (lock {rule.lock_name!r} not acquired within the wait)",
                               retry_after=_retry_after(rule))
            return False
        except RedisUnavailable:
            if app_done:
                return True  # the release failed; the lease expires by itself
            if entered:
                raise
            if rule.fail_open:
                # Counted by the manager as otel_lock.errors{error.type=redis_unavailable}.
                log.warning("otel-lock: Redis unavailable, running %s without its lock (fail_open)", rule.lock_name)
                await self.mw.app(scope, receive, send)
                return True
            await send_problem(send, 503, "redis-unavailable", "the lock service is unavailable",
                               retry_after=_retry_after(rule))
            return False
        except LockLost:
            if started:
                raise  # half a response is out: abort it, the server drops the connection
            await send_problem(send, 503, "lock-lost",
                               "the lock was lost while the request ran; its effects may be incomplete",
                               retry_after=_retry_after(rule))
        return True


def _retry_after(rule: Locked) -> float:
    return rule.retry_after if rule.retry_after is not None else 1.0


async def _release_quietly(held: Any) -> None:
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


def _single(values: list[str], what: str, part: Part) -> str:
    if not values:
        raise TemplateValueError(f"{what} is missing (needed by {part.text})")
    if len(values) > 1:
        raise TemplateValueError(f"{what} was sent more than once (needed by {part.text})")
    return values[0]


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", []):
        if key.lower() == name:
            return value.decode("latin-1").strip()
    return None


_UNPARSED = object()


@dataclass(frozen=True)
class _RouteTemplate:
    path_format: str
