"""One protected request, top to bottom: body -> key -> idempotency -> lock -> app -> release.

It runs after routing, in place of the matched route's own app (or, on a
plain ASGI app, in front of it). The whole body is read first (`_body`),
so a client that never sends its body holds nothing. The key is built from
the values the handler will receive (`_binding`). The idempotency gate, if
the route has one, calls `LockedApp` as its `inner`. While the request
waits for its lock, a client that hangs up stops the wait. By default the
lock is held until the route's app call returns: FastAPI's
`yield`-dependency exit code and background tasks run under it. Time spent
blocked in `send` (a client that does not read) is bounded by `send_timeout`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..lock import LockDeadlock, LockError, LockLost, Locks, RedisUnavailable
from ._after_auth import DEFERRED, Deferred, NotTaken
from ._annotations import Idempotent, Locked
from ._answers import lock_answer, release_quietly, runs_unlocked
from ._binding import INVALID, RouteBinding
from ._body import BodyLimits, BodyRefused, Client, ClientGone, read_body
from ._deadlines import TimeBound
from ._guard import AT_CALL, Hold, Mark, marked
from ._keys import PRINCIPAL, TemplateValueError
from ._keyset import TooManyKeys
from ._shapes import holding
from ._values import CALLER
from .idempotency._principal import PrincipalProblem, request_of, resolve
from ._problem import send_problem
from ._types import ASGIApp, Message, Receive, ResponseEnd, Scope, Send

if TYPE_CHECKING:
    from ._middleware import LockMiddleware

log = logging.getLogger("otel_lock.middleware")
_ANONYMOUS = Idempotent()   # how a `{principal}` route without @idempotent answers nobody: 401, Bearer


@dataclass(frozen=True)
class Protection:
    """What the middleware does for one method of one route (or one rule), decided at start-up."""

    route: str                      # the route template, for answers, metrics and the idempotency scope
    locked: Locked | None
    idempotent: Idempotent | None
    binding: RouteBinding | None    # how the lock key's values reach the handler
    limits: BodyLimits
    guards: frozenset[int] = frozenset()   # the endpoint's guards this request may enter
    # A route class that may change the request (it overrides get_route_handler): the key read from
    # the wire is taken around the app as on any route, and checked at the handler's call against the
    # key of its arguments; where they differ (or the wire gave none), the guard takes that one then.
    at_call: bool = False
    hold: Hold | None = None        # how the guard takes it then
    after_auth: bool = False        # taken by our dependency, after the route's security dependencies
    principal: Any = None           # where `{principal}` of the key comes from (None: the key has none)
    route_class: bool = False       # a route class wraps the handler (overrides get_route_handler)


class SendTimeout(OSError):
    """The client did not take the response within send_timeout: treated like a client that went away."""


class ProtectedRequest:
    """One request's trip through the middleware; all per-request state lives here."""

    def __init__(self, mw: LockMiddleware, protection: Protection, app: ASGIApp, scope: Scope,
                 receive: Receive, send: Send) -> None:
        self.mw, self.protection, self.app = mw, protection, app
        self.scope, self.receive, self.send = scope, receive, send

    async def run(self) -> None:
        manager = self.mw.locks(self.scope)
        if manager is None:
            await send_problem(self.send, 500, "lock-manager-missing", self.mw.missing_manager())
            return
        try:
            body = await read_body(self.scope, self.receive, self.protection.limits)
        except BodyRefused as refused:
            await send_problem(self.send, refused.status, refused.type_name, refused.detail,
                               headers=[(b"connection", b"close")] if refused.close else None)
            return
        except ClientGone:
            return   # nothing to lock for
        try:
            principal = await self._principal(body)
        except PrincipalProblem as problem:   # nobody, or the app's authentication said no: nothing locked
            await send_problem(self.send, problem.status, problem.type_name, problem.detail, headers=problem.headers)
            return
        token = CALLER.set(principal[2:] if principal else None)
        try:
            await self._protect(manager, body, principal)
        finally:
            CALLER.reset(token)

    async def _principal(self, body: bytes) -> str | None:
        """The caller, for a key with `{principal}` (resolved once, before the key and the record)."""
        source, locked = self.protection.principal, self.protection.locked
        if source is None or locked is None:
            return None
        optional = any(p.optional for p in locked.template.parts if p.source == PRINCIPAL)
        return await resolve(source, request_of(self.scope, body), self.protection.route,
                             self.protection.idempotent or _ANONYMOUS, kind="lock", optional=optional)

    async def _protect(self, manager: Locks, body: bytes, principal: str | None) -> None:
        client = Client(body, self.receive)
        locked, idem = self.protection.locked, self.protection.idempotent
        keys: tuple[str, ...] | None = None
        if locked is not None:
            try:
                keys = await self._keys(locked, body)
            except TooManyKeys as error:   # refused before anything is taken, at_call or not
                await send_problem(self.send, 422, "lock-keys-too-many", str(error))
                return
            except TemplateValueError as error:
                if not self.protection.at_call:
                    await send_problem(self.send, 400, "lock-key-invalid", str(error))
                    return
            if keys is None and not self.protection.at_call:
                # The framework rejects a value of the key with its own 422: nothing to lock, nothing to store.
                with marked(Mark.unbound(self.protection.guards)):
                    await self.app(self.scope, client.receive, self.send)
                return
        inner = LockedApp(manager, self.protection, keys, self.app, client)
        send = BoundedSend(self.send, self.mw.send_timeout)
        try:
            if idem is None:
                await inner(self.scope, client.receive, send)
            else:
                await self.mw.gate(idem, self.protection.route, self.scope, client.receive, send, body, inner,
                                   None if idem.shared_scope else principal)
        except SendTimeout as error:
            log.warning("otel-lock: %s %s: %s; the response was cut off and the lock released",
                        self.scope.get("method"), self.protection.route, error)

    async def _keys(self, locked: Locked, body: bytes) -> tuple[str, ...] | None:
        """The lock names, or None when the framework will reject a value (422) anyway."""
        binding = self.protection.binding
        assert binding is not None  # every locked protection has one
        values = await binding.request_values(self.scope, body)
        if values is INVALID:
            return None
        return locked.template.render(values.__getitem__, self.mw.secret if locked.hash_parts else None,
                                      locked.max_keys)


class LockedApp:
    """The business lock (if any) around the route's app; returns whether the app was entered.

    The idempotency gate calls this as its `inner`.
    """

    def __init__(self, manager: Locks, protection: Protection, keys: tuple[str, ...] | None, app: ASGIApp,
                 client: Client) -> None:
        self.manager, self.protection, self.keys, self.app, self.client = manager, protection, keys, app, client

    async def _run_app(self, scope: Scope, receive: Receive, send: Send, deferred: Deferred | None = None) -> None:
        p = self.protection
        mark = (Mark(AT_CALL, p.guards, p.hold, scope, taken=self.keys) if p.at_call
                else Mark.held(p.guards, p.locked if p.route_class else None))
        token = DEFERRED.set(deferred)
        try:
            with marked(mark):
                await self.app(scope, receive, send)
        finally:
            DEFERRED.reset(token)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> bool:
        rule = self.protection.locked
        if rule is None or self.keys is None:
            await self._run_app(scope, receive, send)
            return True
        keys = self.keys
        held: Any = None   # a HeldLock, lock_all()'s holds, a permit; None: no keys at all (an empty list)
        started = entered = app_done = False
        end = ResponseEnd()
        early = rule.release_after == "response"
        after_auth = self.protection.after_auth

        async def watched_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            last = end.is_last(message)
            await send(message)
            if last and early and held is not None:
                # release_after="response": the next request may start while this
                # app still runs its background tasks and dependency exit code.
                await release_quietly(held)

        hold: Any = None   # the lock's context manager, once entered: left as `async with` would leave it

        async def take() -> None:
            nonlocal held, hold, entered
            try:
                async with self.client.cancel_on_disconnect():
                    context = holding(self.manager, rule, keys, cancel_on_lost=True)
                    held = await context.__aenter__()
                    hold = context
            except LockError as error:
                if not after_auth:
                    raise
                if runs_unlocked(error, rule, self.manager):
                    return
                raise NotTaken(error) from None   # through FastAPI's handlers, to us
            entered = True
            # The app's own state dict, never a copy: what the handler sets there is
            # what every middleware around us reads.
            scope.setdefault("state", {})["lock"] = held

        try:
            try:
                if after_auth:   # our dependency takes it, once the security dependencies passed
                    await self._run_app(scope, receive, watched_send, Deferred(take))
                else:
                    await take()
                    await self._run_app(scope, receive, watched_send)
                app_done = True
            except BaseException as error:
                if hold is None or not await hold.__aexit__(type(error), error, error.__traceback__):
                    raise
            else:
                if hold is not None:
                    await hold.__aexit__(None, None, None)
        except NotTaken as not_taken:
            await lock_answer(not_taken.error, rule).send(send)
            return False   # the handler never ran
        except ClientGone:
            return False   # hung up while waiting: no lock taken, the handler never ran
        except LockLost as error:
            if started:
                raise  # half a response is out: abort it, the server drops the connection
            await lock_answer(error, rule).send(send)
            return True
        except LockDeadlock as error:
            if entered and started:
                raise  # half a response is out
            # Ours, or one the handler took by hand (it holds ours and waits for another): the same 409.
            await lock_answer(error, rule).send(send)
            return entered   # whether the handler ran (the idempotency gate keeps its outcome)
        except LockError as error:
            if isinstance(error, RedisUnavailable) and app_done:
                return True  # the release failed; the lease expires by itself
            if entered:
                raise  # the handler's own
            return await self._not_taken(error, rule, scope, receive, send)
        return True

    async def _not_taken(self, error: LockError, rule: Locked, scope: Scope, receive: Receive, send: Send) -> bool:
        """Our lock could not be taken: answer for it (or, fail_open, run the app without it)."""
        if runs_unlocked(error, rule, self.manager):
            await self._run_app(scope, receive, send)
            return True
        await lock_answer(error, rule).send(send)
        return False


class BoundedSend:
    """`send` with a budget: the time a protected request may spend blocked on a client that does not read."""

    __slots__ = ("send", "budget", "left", "bound")

    def __init__(self, send: Send, budget: float) -> None:
        self.send, self.budget, self.left = send, budget, budget
        self.bound: TimeBound | None = None   # one for all the sends of the response

    async def __call__(self, message: Message) -> None:
        if self.left <= 0.0:   # spent by earlier sends: nothing more goes out
            raise SendTimeout("the client did not read the response within send_timeout")
        bound = self.bound
        if bound is None:
            bound = self.bound = TimeBound(self.budget)
        bound.seconds = self.left
        try:
            with bound:
                await self.send(message)
        except TimeoutError:
            self.left = 0.0
            raise SendTimeout("the client did not read the response within send_timeout") from None
        self.left -= bound.elapsed()
