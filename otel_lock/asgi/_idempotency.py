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

An answer that asks for a retry, or rejects the caller, leaves no record
(`_idem_capture`). The fingerprint (`_idem_request`) covers the method, the
route, the concrete path and query and the body, so a key reused for
another request is a 422, never a replay. The principal (`_idem_principal`)
is named by the app, never guessed.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import json
import logging
from typing import TYPE_CHECKING, Any, Awaitable, Callable

from starlette.requests import ClientDisconnect, Request

from ._annotations import Idempotent
from ._idem_capture import FREE, STORE, Capture
from ._idem_principal import Principal, PrincipalProblem, check_callable, choose, missing_setting, resolve
from ._idem_request import MAX_KEY, IdempotencyKeyError, canonical_body, fingerprint, parse_key
from ._types import Message, Receive, ResponseEnd, Scope, Send
from ..lock._errors import _UNAVAILABLE, LockTimeout, RedisUnavailable
from ._problem import send_problem

if TYPE_CHECKING:
    from ..lock import HeldLock, LockManager

__all__ = ["MAX_KEY", "IdempotencyGate", "IdempotencyKeyError", "canonical_body", "fingerprint", "parse_key"]

log = logging.getLogger("otel_lock.idempotency")

RECORD_SUFFIX = ":idempotency"
# The core's list (READONLY, CLUSTERDOWN, TRYAGAIN during a failover too): 503, never 500.
_REDIS_DOWN = (*_UNAVAILABLE, RedisUnavailable)

STARTED, DONE, UNKNOWN, TOMBSTONE = "started", "done", "unknown", "tombstone"
_UNKNOWN_CAUSES = {
    "failed": "failed (the handler raised or answered 5xx)",
    "interrupted": "was interrupted (client gone, lock lost or replica died)",
}

# Runs the business lock and the app; returns whether the handler was entered.
Inner = Callable[[Scope, Receive, Send], Awaitable[bool]]
# A stored outcome, as JSON in Redis: state, fp, route, and cause or the answer.
Record = dict[str, Any]


class IdempotencyGate:
    """Runs `inner` at most once per (principal, key); answers retries from the record.

    The middleware's one seam: `await gate(idem, route, scope, receive, send, body, inner)`
    once the body is buffered; `check(idem, route)` for a start-up walk of the routes.
    """

    def __init__(self, manager: LockManager, secret: bytes, principal: Principal | None = None) -> None:
        check_callable(principal, "LockMiddleware")
        self.manager = manager
        self.secret = secret
        self.principal = principal
        self._reported: set[str] = set()

    async def __call__(self, idem: Idempotent, route: str, scope: Scope, receive: Receive, send: Send,
                       body: bytes, inner: Inner) -> None:
        flow = _Flow(self, idem, route, scope, receive, send)
        await flow.run(body, inner)

    def check(self, idem: Idempotent, route: str) -> None:
        """Raise ValueError naming the route and the setting if it has no principal."""
        if choose(idem, self.principal) is None:
            raise ValueError(missing_setting(route))

    def report_missing(self, route: str) -> None:
        """Log the missing principal setting of `route`, once."""
        if route not in self._reported:  # once per route, not once per request
            self._reported.add(route)
            log.error("otel-lock: %s", missing_setting(route))

    def count(self, route: str, outcome: str) -> None:
        """Count one request in `otel_lock.idempotency.requests`."""
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
        source = choose(self.idem, self.gate.principal)
        if source is None:
            self.gate.report_missing(self.route)
            return await send_problem(self.send, 500, "idempotency-principal-not-configured",
                                      missing_setting(self.route))
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
        try:
            principal = await resolve(source, Request(self.scope, _body_once(body)), self.route)
        except PrincipalProblem as problem:
            return await send_problem(self.send, problem.status, problem.type, problem.detail,
                                      headers=problem.headers)
        scoped = f"{principal}\0{key}".encode("utf-8", "surrogatepass")
        scope_id = hmac.new(self.gate.secret, scoped, hashlib.sha256).hexdigest()[:32]
        self.lock_key = f"idem:{scope_id}"
        self.record_key = f"{self.gate.manager.namespace}:{{{self.lock_key}}}{RECORD_SUFFIX}"
        self.fp = fingerprint(self.gate.secret, self.scope, self.route, body)
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
        claimed = await self.gate.manager.try_lock(self.lock_key, name=label, cancel_on_lost=False)
        if claimed is None:
            return await self._busy()
        try:
            await self._owned(claimed, inner)
        finally:
            await _release_quietly(claimed)

    async def _answer_settled(self, record: Record) -> bool:
        """Answer from a record if it settles the request; False: started (maybe in flight)."""
        if record.get("fp") != self.fp:
            self.gate.count(self.route, "mismatch")
            await send_problem(self.send, 422, "idempotency-key-mismatch",
                               "this Idempotency-Key was already used with a different request "
                               "(payload, method, route, path or query); use a new key for a new request")
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
            how = _UNKNOWN_CAUSES.get(str(record.get("cause")), _UNKNOWN_CAUSES["interrupted"])
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

    async def _owned(self, held: HeldLock, inner: Inner) -> None:
        record = await self._load()
        if record is not None:
            if record.get("state") == STARTED and record.get("fp") == self.fp:
                # Started, yet nobody holds the lock: that attempt died mid-way.
                record = {**record, "state": UNKNOWN, "cause": "interrupted"}
                await self._store(record)
            await self._answer_settled(record)
            return
        await self._store({"state": STARTED, "fp": self.fp, "route": self.route})
        capture = Capture(self.idem.max_body)
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
            elif capture.stored and isinstance(error, Exception) and not isinstance(error, (OSError, ClientDisconnect)):
                # The answer went out, then the app failed (a yield dependency's commit,
                # a background task): what the stored answer claims may not have happened.
                await _shielded(self._unsettle(held))
            raise
        if not entered["handler"]:
            await self._forget()  # the business lock was not taken: nothing ran, a retry may run it
        elif not capture.finished:
            await self._settle(held, capture, None)  # client went away mid-response

    async def _settle(self, held: HeldLock, capture: Capture, error: BaseException | None) -> None:
        """Write the final record; on a lost lease someone else owns the record now."""
        if held.lost.is_set():
            return
        try:
            interrupted = _business_lock_lost(self.scope)
            # A client that went away (disconnect message, or the server's send
            # raising) is not a failure of the handler: 409, like a crash.
            gone = isinstance(error, (OSError, ClientDisconnect))
            if capture.status and not interrupted and (error is None or gone):
                verdict = capture.verdict()
                if verdict == FREE:
                    # The answer asks for a retry or rejects the caller: it says nothing
                    # about the operation, so the retry must run the handler.
                    await self._forget()
                    self.gate.count(self.route, "not_stored")
                    return
                if verdict == STORE and capture.finished and error is None:
                    await self._store_answer(capture)
                    capture.stored = True
                    self.gate.count(self.route, "stored")
                    return
            failed = not (gone or interrupted) and (
                isinstance(error, Exception) or (capture.finished and capture.status >= 500))
            if failed and self.idem.retry_on_5xx:
                await self._forget()
                self.gate.count(self.route, "not_stored")
                return
            await self._store({"state": UNKNOWN, "fp": self.fp, "route": self.route,
                               "cause": "failed" if failed else "interrupted"})
            self.gate.count(self.route, "stored")
        except _REDIS_DOWN as exc:
            log.warning("otel-lock: could not store the idempotency outcome (the claim stays 'started', "
                        "retries will get outcome-unknown): %s", exc)

    async def _unsettle(self, held: HeldLock) -> None:
        if held.lost.is_set():
            return
        try:
            await self._store({"state": UNKNOWN, "fp": self.fp, "route": self.route, "cause": "failed"})
        except _REDIS_DOWN as exc:
            log.warning("otel-lock: could not mark the idempotency outcome unknown: %s", exc)

    async def _store_answer(self, capture: Capture) -> None:
        if capture.chunks is None:
            await self._store({"state": TOMBSTONE, "fp": self.fp, "route": self.route})
            return
        await self._store({
            "state": DONE, "fp": self.fp, "route": self.route, "status": capture.status,
            "headers": capture.headers, "body": base64.b64encode(b"".join(capture.chunks)).decode(),
        })

    async def _replay(self, record: Record) -> None:
        body = base64.b64decode(record.get("body", ""))
        headers = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in record.get("headers", [])]
        headers += [(b"content-length", str(len(body)).encode()), (b"idempotent-replayed", b"true")]
        await self.send({"type": "http.response.start", "status": int(record["status"]), "headers": headers})
        await self.send({"type": "http.response.body", "body": body, "more_body": False})

    async def _load(self) -> Record | None:
        raw = await self.redis.get(self.record_key)
        if raw is None:
            return None
        try:
            record = json.loads(raw)
        except ValueError:
            return None
        return record if isinstance(record, dict) else None

    async def _store(self, record: Record) -> None:
        await self.redis.set(self.record_key, json.dumps(record, separators=(",", ":")),
                             px=int(self.idem.ttl * 1000))

    async def _forget(self) -> None:
        try:
            await self.redis.delete(self.record_key)
        except _REDIS_DOWN as exc:
            log.warning("otel-lock: could not drop an unused idempotency claim: %s", exc)


def _business_lock_lost(scope: Scope) -> bool:
    """The route's `@locked` lease was lost mid-way (the 503 lock-lost): the effects are unknown."""
    held = (scope.get("state") or {}).get("lock")
    lost = getattr(held, "lost", None)
    return bool(lost is not None and lost.is_set())


def _body_once(body: bytes) -> Receive:
    """A receive for the principal's Request: the buffered body, so `await request.body()` works."""
    async def receive() -> Message:
        return {"type": "http.request", "body": body, "more_body": False}
    return receive


async def _release_quietly(held: HeldLock) -> None:
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
