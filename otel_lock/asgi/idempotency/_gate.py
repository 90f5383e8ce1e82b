"""The gate: run the handler at most once per (principal, key); answer retries from the record.

One request through it, top to bottom (`IdempotentRequest.run`):

    principal configured?      500 idempotency-principal-not-configured
    key header                 400 idempotency-key-invalid / -missing (or run without one)
    principal of the request   401 (challenge) / the app's 4xx / 500
    record already there?      422 mismatch, replay, 409 unknown / not stored
    take the in-flight lock    409 in flight (or wait and replay)
    claim the record           429 over the principal's quota, 507 store full
    run the route (`inner`)    the answer is stored, freed or marked unknown

The in-flight lock is a lock of the manager, leased and renewed while the
handler runs, so a crashed replica's claim ends by itself. The record says
what happened:

    started    the handler was entered; seen while the lock is free, the
               attempt died (crash, lost lease): outcome unknown
    done       status, allow-listed headers and body, replayed to retries
    unknown    the handler raised, answered 5xx or the client went away (-> 409)
    tombstone  completed, but streamed or too large to store: not replayable
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
from typing import TYPE_CHECKING, Any, Awaitable, Callable

from starlette.requests import ClientDisconnect

from ...lock import LockError, LockTimeout, RedisMisconfigured, RedisUnavailable
from .._answers import redis_answer
from .._problem import send_problem
from .._types import Message, Receive, ResponseEnd, Scope, Send
from ._answer import FREE, STORE, Capture, replay_messages
from ._key import IdempotencyKeyError, parse_key
from ._legacy import LegacyRecords
from ._options import Idempotent
from ._principal import (SHARED_PRINCIPAL, Principal, PrincipalProblem, check_callable, choose, missing_setting,
                         request_of, resolve)
from ._store import Claim, IdempotencyStore, Record, RecordId, Written, answer_bound
from ._store_errors import RecordStoreMisconfigured, RecordStoreUnavailable, translate
from ._fingerprint_inputs import Inputs, inputs_of
from ._versions import Fingerprints, UnknownRecordVersion

if TYPE_CHECKING:
    from ...lock import HeldLock

log = logging.getLogger("otel_lock.idempotency")

STARTED, DONE, UNKNOWN, TOMBSTONE = "started", "done", "unknown", "tombstone"
_UNKNOWN_CAUSES = {
    "failed": "failed (the handler raised or answered 5xx)",
    "interrupted": "was interrupted (client gone, lock lost or replica died)",
}
_REDIS_ERRORS = (RedisUnavailable, RedisMisconfigured)
# Looks again at a key held without a record (seconds between them, about 90 ms in all): a claim follows its
# lock by a round trip, so a second request racing the first sees it, unless the first died before it.
_CLAIM_PAUSES = (0.002, 0.005, 0.01, 0.02, 0.05)
# Any other error of the lock core before the handler ran (an unexpected reply): still an answer.
_LOCK_ERRORS = (*_REDIS_ERRORS, LockError)

# Runs the business lock and the app; returns whether the handler was entered.
Inner = Callable[[Scope, Receive, Send], Awaitable[bool]]


class IdempotencyGate:
    """Runs `inner` at most once per (principal, key); answers retries from the record.

    The middleware's one seam: `await gate(idem, route, scope, receive, send, body, inner)`
    once the body is buffered; `check(idem, route)` for a start-up walk of the routes.
    `store`: where records live and how much room they may take (default: next
    to the locks, with the default caps).
    """

    def __init__(self, manager: Any, secret: bytes, principal: Principal | None = None,
                 store: IdempotencyStore | None = None) -> None:
        check_callable(principal, "LockMiddleware")
        if store is not None and not isinstance(store, IdempotencyStore):
            raise ValueError(f"idempotency_store must be an IdempotencyStore, got {store!r}")
        self.manager = manager
        self.secret = secret
        self.principal = principal
        self.store: IdempotencyStore = store if store is not None else IdempotencyStore()
        self._reported: set[tuple[str, str]] = set()

    async def __call__(self, idem: Idempotent, route: str, scope: Scope, receive: Receive, send: Send,
                       body: bytes, inner: Inner, principal: str | None = None) -> None:
        """`principal`: this request's, if the middleware resolved it already (for a `{principal}` key)."""
        request = IdempotentRequest(self, idem, route, scope, receive, send)
        request.inputs = inputs_of(scope, _lock_template(inner))
        request.known = principal
        await request.run(body, inner)

    def check(self, idem: Idempotent, route: str) -> None:
        """Raise ValueError naming the route and the setting if it has no principal."""
        if choose(idem, self.principal) is None:
            raise ValueError(missing_setting(route))

    def records(self) -> IdempotencyStore:
        """The record store, bound to the manager's Redis and namespace where not given.

        Bound again on every request when it shares the manager's Redis: a manager may
        serve several event loops with a client each.
        """
        store = self.store
        if store.shares_lock_redis or store.namespace is None:
            store.bind(getattr(self.manager, "redis", None), self.manager.namespace)
            if store.redis is None:
                raise RecordStoreMisconfigured("this lock manager has no single Redis for idempotency records: "
                                               "give LockMiddleware(idempotency_store=IdempotencyStore.from_url(...))")
        return store

    def legacy(self) -> LegacyRecords | None:
        """Release 0.1.0's records, on the manager's Redis and namespace (None: a manager without one)."""
        redis = getattr(self.manager, "redis", None)
        return LegacyRecords(redis, self.manager.namespace) if redis is not None else None

    def report_once(self, route: str, what: str, message: str, *args: Any) -> None:
        """Log a setting problem of `route` once, not once per request."""
        if (route, what) not in self._reported:
            self._reported.add((route, what))
            log.error(message, *args)

    def count(self, route: str, outcome: str) -> None:
        """Count one request in `otel_lock.idempotency.requests`."""
        self.manager.telemetry.idempotency_requests.add(1, {"http.route": route, "idempotency.outcome": outcome})


class IdempotentRequest:
    """One request through the gate; all per-request state lives here."""

    def __init__(self, gate: IdempotencyGate, idem: Idempotent, route: str, scope: Scope,
                 receive: Receive, send: Send) -> None:
        self.gate, self.idem, self.route = gate, idem, route
        self.scope, self.receive, self.send = scope, receive, send
        self.store: IdempotencyStore = gate.store
        self.response_started = False
        self.handler_called = False
        self.send_failed = False  # the server's send raised: the client is gone (uvicorn's ClientDisconnected...)
        self.seen: Record | None = None        # the record found before taking the in-flight lock
        self.legacy: LegacyRecords | None = None   # release 0.1.0's records, kept in step for one release
        self.written: Written | None = None    # what this request's last write costs, as counted
        self.inputs = Inputs()                 # the headers and cookies the handler reads, for the fingerprint
        self.known: str | None = None          # the principal, when the middleware resolved it already

    async def run(self, body: bytes, inner: Inner) -> None:
        source = choose(self.idem, self.gate.principal)
        if source is None:
            self.gate.report_once(self.route, "principal", "otel-lock: %s", missing_setting(self.route))
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
            principal = self.known or await resolve(source, request_of(self.scope, body), self.route, self.idem)
        except PrincipalProblem as problem:
            return await send_problem(self.send, problem.status, problem.type_name, problem.detail,
                                      headers=problem.headers)
        assert principal is not None   # not optional: nobody is answered above
        self._identify(principal, key, body)
        try:
            self.store = self.gate.records()
            self.legacy = self.gate.legacy()
            await self._gate(inner)
        except _LOCK_ERRORS as error:
            if self.response_started or self.handler_called:
                raise  # the app's own (its own locks, say), not the gate's
            await self._answer_redis_error(error)

    def _identify(self, principal: str, key: str, body: bytes) -> None:
        secret = self.gate.secret
        scoped = f"{principal}\0{key}".encode("utf-8", "surrogatepass")
        scope_id = hmac.new(secret, scoped, hashlib.sha256).hexdigest()[:32]
        owner = hmac.new(secret, b"principal\0" + principal.encode("utf-8", "surrogatepass"),
                         hashlib.sha256).hexdigest()[:32]
        self.lock_key = f"idem:{scope_id}"
        self.rid = RecordId(owner, scope_id, capped=principal != SHARED_PRINCIPAL)
        self.fps = Fingerprints.of(secret, self.scope, self.route, body, self.inputs)

    async def _answer_redis_error(self, error: LockError) -> None:
        ours = isinstance(error, (RecordStoreUnavailable, RecordStoreMisconfigured))
        transient = isinstance(error, RedisUnavailable) or _transient_cause(error)
        kind = "redis_unavailable" if transient else "redis_misconfigured"
        if ours:  # the manager counts the errors of its own calls
            self.gate.manager.telemetry.errors.add(1, {
                "lock.name": f"idempotency {self.route}", "lock.operation": "acquire", "error.type": kind})
        if transient:
            log.warning("otel-lock: idempotency of %s unavailable: %s", self.route, error)
            if not isinstance(error, RedisUnavailable):
                error = RedisUnavailable(str(error), key=error.key)
        else:
            self.gate.report_once(self.route, "misconfigured", "otel-lock: idempotency of %s: %s", self.route, error)
        await redis_answer(error, "the idempotency store", self.idem.retry_after).send(self.send)

    async def _gate(self, inner: Inner) -> None:
        self.seen = record = await self._load()
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
        try:
            same = self.fps.matches(record)
        except UnknownRecordVersion as error:
            return await self._unreadable(error)
        if not same:
            self.gate.count(self.route, "mismatch")
            await send_problem(self.send, 422, "idempotency-key-mismatch",
                               "this Idempotency-Key was already used with a different request (payload, "
                               "method, host, route, path or query); use a new key for a new request")
            return True
        state = record.get("state")
        if state == DONE:
            self.gate.count(self.route, "replayed")
            for message in replay_messages(record, self.scope.get("method", "")):
                await self.send(message)
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

    async def _unreadable(self, error: UnknownRecordVersion) -> bool:
        """A newer release's record: neither replayed nor run again (its outcome is unknown here)."""
        self.gate.report_once(self.route, "version", "otel-lock: an idempotency record of %s has a %s this "
                              "release cannot compare; it answers 409 until the newer release serves alone or "
                              "the record expires (docs/versioning.md)", self.route, error)
        self.gate.count(self.route, "conflict")
        await send_problem(self.send, 409, "idempotency-outcome-unknown",
                           "the first request with this Idempotency-Key was recorded by a newer release of "
                           "this service; it is not run again: retry later, or check its result")
        return True

    async def _busy(self) -> None:
        record = await self._load()
        for pause in _CLAIM_PAUSES:
            if record is not None:
                break
            # Held, not yet claimed: the first request writes its record a round trip after it takes the
            # lock. Looking again a few times lets a different payload meet its 422 here, not a 409.
            await asyncio.sleep(pause)
            record = await self._load()
        # Finished between our two looks, or a different request: 422 is checked before 409.
        if record is not None and (record.get("state") != STARTED or not self._matches(record)):
            await self._answer_settled(record)
            return
        self.gate.count(self.route, "conflict")
        await send_problem(self.send, 409, "idempotency-request-in-flight",
                           "a request with this Idempotency-Key is still being processed; retry later",
                           retry_after=self.idem.retry_after)

    async def _owned(self, held: HeldLock, inner: Inner) -> None:
        # Look again only if there was something to see: a claim finds a record itself. A 0.1.0
        # replica may have claimed since our first look: its record is read under the lock.
        if self.seen is not None:
            record = await self._load()
        else:
            record = await self.legacy.load(self.rid.scope) if self.legacy is not None else None
        if record is None:
            claim = await self.store.claim(self.rid, self._record(STARTED), self.idem.ttl,
                                           answer_bound(self.idem.max_stored_response))
            if claim.refused:
                return await self._refuse(claim)
            if claim.record is None:
                self.written = claim.written
                await self._claim_legacy()
                return await self._run(held, inner)
            record = claim.record
        if record.get("state") == STARTED and self._matches(record):
            # Started, yet nobody holds the lock: that attempt died mid-way.
            record = {**self._record(UNKNOWN), "cause": "interrupted"}
            await self._write(record)
        await self._answer_settled(record)

    async def _claim_legacy(self) -> None:
        """Claim in 0.1.0's layout too, so a 0.1.0 replica answers 409 in flight, not runs it again."""
        if self.legacy is None:
            return
        try:
            await self.legacy.write(self.rid.scope, self.fps.as_v1(self._record(STARTED)), self.idem.ttl)
        except BaseException:
            await _shielded(self._forget())  # nothing ran: the key stays free
            raise

    async def _load(self) -> Record | None:
        if self.legacy is None:
            return await self.store.load(self.rid)
        return await self.store.load(self.rid, (self.legacy.redis, self.legacy.key(self.rid.scope)))

    def _matches(self, record: Record) -> bool:
        try:
            return self.fps.matches(record)
        except UnknownRecordVersion:
            return False  # answered by _answer_settled (409), never run

    async def _refuse(self, claim: Claim) -> None:
        if claim.refused == "principal":
            self.gate.count(self.route, "over_quota")
            await send_problem(self.send, 429, "idempotency-quota-exceeded",
                               "this caller holds as many stored idempotent requests as it may; retry once "
                               "older ones have expired", retry_after=claim.retry_after)
            return
        self.gate.count(self.route, "storage_full")
        self.gate.report_once(self.route, "full", "otel-lock: the idempotency record store is full (its total "
                              "caps); %s answers 507 until records expire", self.route)
        await send_problem(self.send, 507, "idempotency-storage-full",
                           "the server cannot store more idempotent requests right now; retry later",
                           retry_after=claim.retry_after)

    async def _run(self, held: HeldLock, inner: Inner) -> None:
        capture = Capture(self.idem.max_stored_response)
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
            try:
                await self.send(message)
            except BaseException:
                self.send_failed = True
                raise

        self.handler_called = True
        try:
            entered = await inner(self.scope, self.receive, send)
        except BaseException as error:
            if not capture.finished:
                await _shielded(self._settle(held, capture, error))
            elif capture.stored and isinstance(error, Exception) and not self._client_gone(error):
                # The answer went out, then the app failed (a yield dependency's commit,
                # a background task): what the stored answer claims may not have happened.
                await _shielded(self._unsettle(held))
            raise
        if not entered:
            await self._forget()  # the business lock was not taken: nothing ran, a retry may run it
        elif not capture.finished:
            await self._settle(held, capture, None)  # client went away mid-response

    async def _settle(self, held: HeldLock, capture: Capture, error: BaseException | None) -> None:
        """Write the final record; on a lost lease someone else owns the record now."""
        if held.lost.is_set():
            return
        try:
            await self._write_outcome(capture, error)
        except _REDIS_ERRORS as exc:
            log.warning("otel-lock: could not store the idempotency outcome (the claim stays 'started', "
                        "retries will get outcome-unknown): %s", exc)

    async def _write_outcome(self, capture: Capture, error: BaseException | None) -> None:
        interrupted = _business_lock_lost(self.scope)
        # A client that went away (disconnect message, or the server's send
        # raising) is not a failure of the handler: 409, like a crash.
        gone = self._client_gone(error)
        if capture.status and not interrupted and (error is None or gone) and await self._write_answer(capture, error):
            return
        failed = not (gone or interrupted) and (
            isinstance(error, Exception) or (capture.finished and capture.status >= 500))
        if failed and self.idem.retry_on_5xx:
            await self._forget()
            self.gate.count(self.route, "not_stored")
            return
        await self._write({**self._record(UNKNOWN), "cause": "failed" if failed else "interrupted"})
        self.gate.count(self.route, "stored")

    def _client_gone(self, error: BaseException | None) -> bool:
        """Did `error` come of the client going away? Only if the server's send raised, or the body's read
        said so: an OSError of the app's own (a database, SMTP, `asyncio.timeout`) is the handler failing."""
        return error is not None and (self.send_failed or isinstance(error, ClientDisconnect))

    async def _write_answer(self, capture: Capture, error: BaseException | None) -> bool:
        """Free the key or store the answer, as its verdict says; False: the outcome is unknown."""
        verdict = capture.verdict()
        if verdict == FREE:
            # The answer asks for a retry or rejects the caller: it says nothing
            # about the operation, so the retry must run the handler.
            await self._forget()
            self.gate.count(self.route, "not_stored")
            return True
        if verdict == STORE and capture.finished and error is None:
            await self._store_answer(capture)
            capture.stored = True
            self.gate.count(self.route, "stored")
            return True
        return False

    async def _unsettle(self, held: HeldLock) -> None:
        if held.lost.is_set():
            return
        try:
            await self._write({**self._record(UNKNOWN), "cause": "failed"})
        except _REDIS_ERRORS as exc:
            log.warning("otel-lock: could not mark the idempotency outcome unknown: %s", exc)

    async def _store_answer(self, capture: Capture) -> None:
        if capture.chunks is None:
            await self._write(self._record(TOMBSTONE))
            return
        stored = await self._write({**self._record(DONE), **capture.answer()}, fallback=self._record(TOMBSTONE))
        if not stored:
            self.gate.report_once(self.route, "too-big", "otel-lock: an answer of %s did not fit the idempotency "
                                  "store's byte caps and was stored as not replayable", self.route)

    async def _write(self, record: Record, fallback: Record | None = None) -> bool:
        self.written, stored = await self.store.replace(self.rid, record, self.idem.ttl, self.written, fallback)
        if self.legacy is not None:
            kept = record if stored or fallback is None else fallback
            await self.legacy.write(self.rid.scope, self.fps.as_v1(kept), self.idem.ttl)
        return stored

    async def _forget(self) -> None:
        try:
            await self.store.forget(self.rid, self.written)
            if self.legacy is not None:
                await self.legacy.delete(self.rid.scope)
        except _REDIS_ERRORS as exc:
            log.warning("otel-lock: could not drop an unused idempotency claim: %s", exc)
        self.written = None

    def _record(self, state: str) -> Record:
        return self.fps.stamp({"state": state, "route": self.route})


def _transient_cause(error: LockError) -> bool:
    """A plain LockError of the core whose cause is transient (out of memory, say): wait, not fix."""
    return isinstance(translate(error.__cause__ or error), RecordStoreUnavailable)


def _business_lock_lost(scope: Scope) -> bool:
    """The route's `@locked` lease was lost mid-way (the 503 lock-lost): the effects are unknown."""
    held = (scope.get("state") or {}).get("lock")
    lost = getattr(held, "lost", None)
    return bool(lost is not None and lost.is_set())


async def _release_quietly(held: HeldLock) -> None:
    try:
        await held.release()
    except _REDIS_ERRORS as exc:
        log.warning("otel-lock: could not release %s, it will expire by itself: %s", held.key, exc)


async def _shielded(coro: Awaitable[None]) -> None:
    """Finish writing an outcome even while the request is being cancelled."""
    task = asyncio.ensure_future(coro)
    try:
        await asyncio.shield(task)
    except asyncio.CancelledError:
        await task
        raise


def _lock_template(inner: Inner) -> Any:
    """The key template of the business lock `inner` takes, if any (its headers are the handler's inputs)."""
    locked = getattr(getattr(inner, "protection", None), "locked", None)
    return getattr(locked, "template", None)
