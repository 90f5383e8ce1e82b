"""Protection follows the handler: a guarded handler runs held, or is refused, wherever it is called from.

`@locked`/`@idempotent` put a thin guard around the handler (same kind of
callable, `functools.wraps`, so FastAPI and Starlette see the original
signature). Around the route's app, LockMiddleware sets a `Mark` in a
context variable naming the guards of the endpoint it protects; the first of
them to run consumes it. Every other call of a guarded handler is a direct
call (from another handler, a background task, a test): it takes its own
lock, with the key rendered from the call's arguments, or is refused:

    the route's call, marked held       runs (the middleware holds the lock)
    the route's call, marked at_call    takes the lock from its arguments now
    the route's call, marked unbound    refused (500 lock-binding-mismatch)
    a direct call, coroutine handler    held under its own lock (re-entrant)
    a direct call, anything else        DirectCallRefused, naming why
    no LockMiddleware ever prepared it  refused (500 lock-middleware-missing)
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import logging
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping, TypeVar, cast

from anyio import from_thread

from ..lock import HeldLock, LockDeadlock, LockError, LockLost, Locks
from ._after_auth import DEFERRED
from ._answers import Answer, lock_answer, release_quietly, runs_unlocked
from ._binding import RouteBinding, Unrenderable
from ._keys import TemplateValueError
from ._keyset import TooManyKeys
from ._shapes import holding

if TYPE_CHECKING:
    from ._annotations import Locked
    from ._types import Scope

log = logging.getLogger("otel_lock.middleware")

GUARD_ATTR = "__otel_lock_guard__"
CALLS_ATTR = "__otel_lock_calls__"      # the DirectCalls a LockMiddleware installed on the guard
_HTTP_METHODS = ("get", "head", "post", "put", "patch", "delete", "options")
_reported: set[tuple[int, str]] = set()
F = TypeVar("F", bound=Callable[..., Any])

HELD, AT_CALL, UNBOUND, UNLOCKED = "held", "at_call", "unbound", "unlocked"


class LockMiddlewareMissing(RuntimeError):
    """An annotated handler ran without LockMiddleware protecting it."""


class DirectCallRefused(RuntimeError):
    """A guarded handler was called directly in a way that cannot be held under its lock."""


@dataclass(frozen=True)
class Hold:
    """How a guarded handler takes its own lock from its arguments."""

    locks: Callable[[], Locks | None]
    secret: Callable[[], bytes]
    locked: Locked
    binding: RouteBinding
    route: str

    async def keys(self, arguments: Mapping[str, Any]) -> tuple[str, ...]:
        values = await self.binding.call_values(arguments)
        rule = self.locked
        return rule.template.render(values.__getitem__, self.secret() if rule.hash_parts else None, rule.max_keys)


@dataclass(frozen=True)
class DirectCalls:
    """What a direct call of a guarded handler does: installed by the LockMiddleware that prepared it."""

    hold: Hold | None               # None: no @locked (only @idempotent)
    idempotent: bool
    enabled: bool


@dataclass(eq=False)
class Mark:
    """Set by the middleware around the route's app: what it did for this request."""

    kind: str
    guards: frozenset[int]
    hold: Hold | None = None
    scope: Scope | None = None
    taken: tuple[str, ...] | None = None   # at_call: the keys the middleware holds already (None: none)
    used: bool = False
    # held, behind a route class that wraps the handler: the handler's own deadlock is answered at the
    # guard (the class might make any exception a 500)
    answers: Locked | None = None

    @classmethod
    def held(cls, guards: frozenset[int], answers: Locked | None = None) -> Mark:
        return cls(HELD, guards, answers=answers)

    @classmethod
    def unbound(cls, guards: frozenset[int]) -> Mark:
        return cls(UNBOUND, guards)

    @classmethod
    def unlocked(cls, guards: frozenset[int]) -> Mark:
        return cls(UNLOCKED, guards)


MARK: contextvars.ContextVar[Mark | None] = contextvars.ContextVar("otel_lock_mark", default=None)


class marked:
    """`with marked(mark):` the route's app runs with this mark (a class: it is on every request's path)."""

    __slots__ = ("mark", "token")

    def __init__(self, mark: Mark) -> None:
        self.mark = mark

    def __enter__(self) -> None:
        self.token = MARK.set(self.mark)

    def __exit__(self, *exc: object) -> None:
        MARK.reset(self.token)


def install_direct_calls(guard_fn: Any, calls: DirectCalls) -> None:
    """Tell a guard how to hold its direct calls (the last middleware to prepare it wins)."""
    setattr(guard_fn, CALLS_ATTR, calls)


def guard(endpoint: F) -> F:
    """The guarded form of a handler (functions), or the class with guarded HTTP methods."""
    target: Any = endpoint  # inspected below; `endpoint` keeps the caller's type
    if getattr(target, GUARD_ATTR, False):
        return endpoint
    if inspect.isclass(target):
        for name in _HTTP_METHODS:
            method = target.__dict__.get(name)
            if inspect.isfunction(method) and not getattr(method, GUARD_ATTR, False):
                setattr(target, name, _wrap(method))
        return endpoint
    if not inspect.isfunction(target) and not inspect.ismethod(target):
        return endpoint  # an ASGI app object or a partial: annotated, not guarded
    return _wrap(endpoint)


def guard_functions(endpoint: Any, method: str | None = None) -> list[Any]:
    """The guards a route's call of `endpoint` enters (through functools.wraps wrappers)."""
    found: list[Any] = []
    targets: list[Any] = [endpoint]
    if inspect.isclass(endpoint):
        targets = [endpoint.__dict__.get(m) for m in _HTTP_METHODS
                   if method is None or m == method.lower() or (method.upper() == "HEAD" and m == "get")]
    for target in targets:
        seen = 0
        while target is not None and seen < 32:
            if getattr(target, GUARD_ATTR, False) and all(target is not f for f in found):
                found.append(target)
            target = getattr(target, "__wrapped__", None) or getattr(target, "func", None)
            seen += 1
    return found


def _wrap(fn: F) -> F:
    guarded = _guarded(fn)
    functools.update_wrapper(guarded, fn)
    try:
        # Annotations resolved in the handler's own module: a framework that evaluates
        # string annotations (`from __future__ import annotations`) in the *wrapper's*
        # globals, as FastAPI < 0.116 does, would otherwise not find the handler's types.
        setattr(guarded, "__signature__", inspect.signature(fn, eval_str=True))
    except (NameError, TypeError, SyntaxError):
        pass  # a forward reference not defined yet: the framework resolves it via __wrapped__
    setattr(guarded, GUARD_ATTR, True)
    return cast(F, guarded)  # update_wrapper: the same signature and kind of callable as fn


def _guarded(fn: Callable[..., Any]) -> Callable[..., Any]:
    """A wrapper of the same kind as `fn` (coroutine, async generator, generator, plain function)."""
    if inspect.iscoroutinefunction(fn):
        async def guarded_coroutine(*args: Any, **kwargs: Any) -> Any:
            entry = _entry(guarded_coroutine, fn)
            if entry is None:
                return await fn(*args, **kwargs)
            return await entry.run(fn, args, kwargs)
        return guarded_coroutine
    if inspect.isasyncgenfunction(fn):
        async def guarded_async_generator(*args: Any, **kwargs: Any) -> Any:
            entry = _entry(guarded_async_generator, fn)
            if entry is None:
                async for item in fn(*args, **kwargs):
                    yield item
                return
            async with entry.held(fn, args, kwargs):
                async for item in fn(*args, **kwargs):
                    yield item
        return guarded_async_generator
    if inspect.isgeneratorfunction(fn):
        def guarded_generator(*args: Any, **kwargs: Any) -> Any:
            entry = _entry(guarded_generator, fn)
            if entry is not None:
                # Nothing holds a plain generator (start-up refuses one on a route that needs it): refused.
                raise entry.refusal(fn)
            yield from fn(*args, **kwargs)
        return guarded_generator

    def guarded(*args: Any, **kwargs: Any) -> Any:
        entry = _entry(guarded, fn)
        if entry is None:
            return fn(*args, **kwargs)
        return entry.call_sync(fn, args, kwargs)
    return guarded


def plain_function(fn: Any) -> bool:
    """A plain `def` handler (FastAPI runs it in its threadpool)."""
    return inspect.isfunction(fn) and not (inspect.isgeneratorfunction(fn) or inspect.isasyncgenfunction(fn)
                                           or inspect.iscoroutinefunction(fn))


def _deferred_taken() -> bool:
    deferred = DEFERRED.get()
    return deferred is None or deferred.done


def _entry(guard_fn: Any, fn: Callable[..., Any]) -> _Entry | None:
    """None: run as is; otherwise what to do instead."""
    mark = MARK.get()
    if mark is not None and not mark.used and id(guard_fn) in mark.guards:
        mark.used = True   # the route's one call; any further call is a direct one
        if mark.kind == HELD and not _deferred_taken():
            return _Refusal(500, "lock-not-taken", _name(fn) + ": the route's lock is taken by a dependency "
                            "LockMiddleware added after the security dependencies, and it did not run (was it "
                            "overridden?); the handler refuses to run unlocked")
        if mark.kind == HELD and mark.answers is not None and (inspect.iscoroutinefunction(fn) or plain_function(fn)):
            return _AnsweringDeadlocks(mark.answers)
        if mark.kind in (HELD, UNLOCKED):
            return None
        if mark.kind == UNBOUND:
            return _Refusal(500, "lock-binding-mismatch", _name(fn) + ": LockMiddleware found a value of the "
                            "lock key invalid for the route's declared types and took no lock, yet the framework "
                            "accepted the request; it refuses to run unlocked (please report the route and request)")
        assert mark.hold is not None
        return _RouteHold(mark.hold, mark.scope, mark.taken)
    calls: DirectCalls | None = getattr(guard_fn, CALLS_ATTR, None)
    if calls is None:
        return _Refusal(500, "lock-middleware-missing",
                        f"{_name(fn)} is annotated with @locked/@idempotent but ran without LockMiddleware "
                        f"protecting it: add app.add_middleware(LockMiddleware, manager=...) to the app, write "
                        f"@locked/@idempotent right below @app.<method>, and keep wrapping decorators between "
                        f"them transparent (functools.wraps)")
    if not calls.enabled:
        return None   # LockMiddleware(enabled=False): annotated handlers run without locks, on purpose
    return _DirectHold(calls)


class _Entry:
    async def run(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        raise NotImplementedError

    def held(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        raise NotImplementedError

    def call_sync(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        raise NotImplementedError

    def refusal(self, fn: Callable[..., Any]) -> Exception:
        """What a plain generator handler raises instead of running."""
        return DirectCallRefused(f"{_name(fn)} is a plain generator: it cannot be held under its lock; make it "
                                 f"return its answer (or an async generator)")


class _Refusal(_Entry):
    """Answer 500 problem+json instead of running (generators raise: they cannot answer)."""

    def __init__(self, status: int, type_name: str, detail: str) -> None:
        self.status, self.type_name, self.detail = status, type_name, detail

    def _report(self) -> None:
        if (hash(self.detail), self.type_name) not in _reported:
            _reported.add((hash(self.detail), self.type_name))
            log.error("otel-lock: %s", self.detail)

    async def run(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        return self.call_sync(fn, args, kwargs)

    def call_sync(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        self._report()
        return Answer(self.status, self.type_name, self.detail).response()

    def held(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        self._report()
        raise LockMiddlewareMissing(self.detail)

    def refusal(self, fn: Callable[..., Any]) -> Exception:
        self._report()
        return LockMiddlewareMissing(self.detail)


class _DirectHold(_Entry):
    """A direct call: held under the handler's own lock, its key from the call's arguments."""

    def __init__(self, calls: DirectCalls) -> None:
        self.calls = calls

    def _hold(self, fn: Callable[..., Any]) -> Hold:
        if self.calls.idempotent:
            raise DirectCallRefused(f"{_name(fn)} is @idempotent: Idempotency-Keys belong to HTTP requests, so a "
                                    f"direct call cannot honour one; call the route, or move the work into a "
                                    f"function without the annotation")
        assert self.calls.hold is not None  # a guard carries @locked, @idempotent or both
        return self.calls.hold

    async def run(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        async with self.held(fn, args, kwargs):
            return await fn(*args, **kwargs)

    @asynccontextmanager
    async def held(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        hold = self._hold(fn)
        manager = hold.locks()
        if manager is None:
            raise DirectCallRefused(f"{_name(fn)}: LockMiddleware has no lock manager yet to hold this call")
        try:
            keys = await hold.keys(_arguments(fn, args, kwargs))
        except Unrenderable as error:
            raise DirectCallRefused(f"{_name(fn)} was called directly and its lock key "
                                    f"{hold.locked.template.template!r} cannot be built from the call: {error}") \
                from None
        async with holding(manager, hold.locked, keys, cancel_on_lost=True):
            yield

    def refusal(self, fn: Callable[..., Any]) -> Exception:
        self._hold(fn)   # an @idempotent handler: refused for that first
        return super().refusal(fn)

    def call_sync(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        self._hold(fn)
        raise DirectCallRefused(f"{_name(fn)} was called directly: a plain (def) or generator handler cannot take "
                                f"an asyncio lock around a direct call; call the route, make the handler "
                                f"`async def`, or move the work into a function without the annotation")


class _AnsweringDeadlocks(_Entry):
    """The route's call, held by the middleware, behind a route class: a handler's own deadlock is the 409.

    On a plain route that exception reaches the middleware, which answers it;
    a route class that wraps the handler could make it a 500 first.
    """

    def __init__(self, rule: Locked) -> None:
        self.rule = rule

    async def run(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        try:
            return await fn(*args, **kwargs)
        except LockDeadlock as error:
            return lock_answer(error, self.rule).response()

    def call_sync(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        try:
            return fn(*args, **kwargs)
        except LockDeadlock as error:
            return lock_answer(error, self.rule).response()


class _RouteHold(_Entry):
    """The route's call on a route whose class may change the request: the key of the handler's arguments.

    The middleware took the key it read from the wire (`taken`, None if it
    could not read one). When the handler's arguments give the same key, the
    call runs under that lock; otherwise the route class changed the request,
    and the call takes the key of its arguments now: a coroutine around its
    await, a plain function around its run in the threadpool (the wait runs on
    the event loop while the worker thread waits for it).
    """

    def __init__(self, hold: Hold, scope: Scope | None, taken: tuple[str, ...] | None) -> None:
        self.hold, self.scope, self.taken = hold, scope, taken

    async def run(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        found = await self._keys(_arguments(fn, args, kwargs))
        if isinstance(found, Answer):
            return found.response()
        rule, manager = self.hold.locked, self.hold.locks()
        try:
            if found is None or manager is None:
                return await fn(*args, **kwargs)
            return await self._held(fn, args, kwargs, manager, found)
        except LockDeadlock as error:
            # A wait of the handler's own (it holds ours and took another by hand) closed a cycle: the
            # 409 the middleware answers, given here, before a route class that turns any exception of
            # its handler into a 500 sees it.
            return lock_answer(error, rule).response()

    async def _held(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], manager: Locks,
                    found: tuple[str, ...]) -> Any:
        rule = self.hold.locked
        entered = False
        try:
            async with holding(manager, rule, found, cancel_on_lost=True) as held:
                entered = True
                self._remember(held)
                return await fn(*args, **kwargs)
        except LockLost as error:
            return lock_answer(error, rule).response()
        except LockError as error:
            if entered:
                raise  # the handler's own
            if runs_unlocked(error, rule, manager):
                return await fn(*args, **kwargs)
            return lock_answer(error, rule).response()

    def call_sync(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        try:
            taken = from_thread.run(self._acquire, _arguments(fn, args, kwargs))
        except RuntimeError as error:   # not in a worker thread of the serving loop: nothing to wait on
            return Answer(500, "lock-route-unsupported", f"{_name(fn)} ran outside the threadpool of its route, "
                          f"so its lock cannot be taken around it: {error}").response()
        if isinstance(taken, Answer):
            return taken.response()
        try:
            if taken is None:
                return fn(*args, **kwargs)
            try:
                result = fn(*args, **kwargs)
            finally:
                from_thread.run(release_quietly, taken)
        except LockDeadlock as error:  # the handler's own wait (the blocking facade's), as in run()
            return lock_answer(error, self.hold.locked).response()
        if taken.lost.is_set():
            return lock_answer(LockLost("the lock was lost", key=taken.key), self.hold.locked).response()
        return result

    async def _keys(self, arguments: dict[str, Any]) -> tuple[str, ...] | Answer | None:
        """The keys to take now; None: run as it is (the middleware holds these keys already)."""
        if self.hold.locks() is None:
            return Answer(500, "lock-manager-missing", "LockMiddleware has no lock manager")
        try:
            keys = await self.hold.keys(arguments)
        except TooManyKeys as error:
            return Answer(422, "lock-keys-too-many", str(error))
        except TemplateValueError as error:
            return Answer(400, "lock-key-invalid", str(error))
        except Unrenderable as error:
            return Answer(500, "lock-route-unsupported", str(error))
        return None if keys == self.taken else keys

    async def _acquire(self, arguments: dict[str, Any]) -> Answer | HeldLock | None:
        """For a worker thread: the held lock (None: run as it is), never cancelled when lost (a thread cannot be)."""
        found = await self._keys(arguments)
        if not isinstance(found, tuple):
            return found
        rule, manager = self.hold.locked, self.hold.locks()
        assert manager is not None   # _keys answers for a missing one
        # Only a plain one-key lock reaches here: start-up refuses a plain handler for other shapes.
        try:
            held = await manager.acquire(found[0], wait=rule.wait, lease=rule.lease, name=rule.lock_name,
                                         cancel_on_lost=False)
        except LockError as error:
            return None if runs_unlocked(error, rule, manager) else lock_answer(error, rule)
        self._remember(held)
        return held

    def _remember(self, held: Any) -> None:
        if self.scope is not None:
            self.scope.setdefault("state", {})["lock"] = held


class _FailClosedRoute:
    """A route's app whose endpoint is an annotated but unguarded function (`@locked` above `@app.post`)."""

    def __init__(self, app: Any, detail: str) -> None:
        self.app, self.detail = app, detail

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and MARK.get() is None:
            await Answer(500, "lock-middleware-missing", self.detail).send(send)
            return
        await self.app(scope, receive, send)


def fail_closed_route(route: Any) -> bool:
    """Make `route` refuse requests no LockMiddleware marked; False if it already does.

    Its `handle` is wrapped (the router calls it, also through FastAPI's
    included routers); LockMiddleware's own hook then wraps this one.
    """
    handle = getattr(route, "handle", None)
    if handle is None or isinstance(route.__dict__.get("handle"), _FailClosedRoute):
        return False
    name = _name(getattr(route, "endpoint", route))
    route.handle = _FailClosedRoute(handle, f"{name} is annotated with @locked/@idempotent written above the route "
                                      f"decorator, and no LockMiddleware protects it: put the annotation right "
                                      f"below @app.<method>(...), and add app.add_middleware(LockMiddleware, "
                                      f"manager=...) to the app")
    return True


@functools.cache
def _signature(fn: Callable[..., Any]) -> inspect.Signature:
    return inspect.signature(fn)


def _arguments(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    bound = _signature(fn).bind_partial(*args, **kwargs)
    return dict(bound.arguments)


def _name(fn: Callable[..., Any]) -> str:
    return str(getattr(fn, "__qualname__", repr(fn)))
