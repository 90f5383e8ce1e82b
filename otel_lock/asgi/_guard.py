"""Fail closed: an annotated handler that runs without LockMiddleware answers 500.

`@locked`/`@idempotent` put a thin guard around the handler (same kind of
callable, `functools.wraps`, so FastAPI and Starlette see the original
signature). LockMiddleware marks the request it protects in a context
variable, right around the route's app; a handler reached without that mark
ran without its lock, so the guard answers a problem+json 500 naming
LockMiddleware instead of running it (logged once per handler).
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import logging
from typing import Any, Callable, TypeVar, cast

log = logging.getLogger("otel_lock.middleware")

PROTECTED = "protected"      # the middleware holds what the annotation asks for
UNCHECKED = "unchecked"      # the middleware judged the request invalid and did not lock it
ROUTE_STATE: contextvars.ContextVar[str | None] = contextvars.ContextVar("otel_lock_route_state", default=None)
GUARD_ATTR = "__otel_lock_guard__"
_HTTP_METHODS = ("get", "head", "post", "put", "patch", "delete", "options")
_reported: set[int] = set()
F = TypeVar("F", bound=Callable[..., Any])


class LockMiddlewareMissing(RuntimeError):
    """An annotated handler ran without LockMiddleware protecting it."""


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
            refused = _refusal(fn)
            return refused if refused is not None else await fn(*args, **kwargs)
        return guarded_coroutine
    if inspect.isasyncgenfunction(fn):
        async def guarded_async_generator(*args: Any, **kwargs: Any) -> Any:
            _raise_if_unprotected(fn)
            async for item in fn(*args, **kwargs):
                yield item
        return guarded_async_generator
    if inspect.isgeneratorfunction(fn):
        def guarded_generator(*args: Any, **kwargs: Any) -> Any:
            _raise_if_unprotected(fn)
            yield from fn(*args, **kwargs)
        return guarded_generator

    def guarded(*args: Any, **kwargs: Any) -> Any:
        refused = _refusal(fn)
        return refused if refused is not None else fn(*args, **kwargs)
    return guarded


def _problem(fn: Callable[..., Any]) -> str | None:
    state = ROUTE_STATE.get()
    if state == PROTECTED:
        return None
    name = getattr(fn, "__qualname__", repr(fn))
    if state == UNCHECKED:
        problem = (f"otel-lock refused to run {name}: LockMiddleware found a key value invalid for the "
                   f"route's declared types and did not lock, yet the framework accepted the request")
    else:
        problem = (f"{name} is annotated with @locked/@idempotent but ran without LockMiddleware "
                   f"protecting it: add app.add_middleware(LockMiddleware, manager=...) to the app, and keep "
                   f"wrapping decorators between @app.<method> and @locked transparent (functools.wraps)")
    if id(fn) not in _reported:
        _reported.add(id(fn))
        log.error("otel-lock: %s", problem)
    return problem


def _refusal(fn: Callable[..., Any]) -> Any:
    problem = _problem(fn)
    if problem is None:
        return None
    from starlette.responses import Response

    from ._problem import CONTENT_TYPE, problem_body

    return Response(problem_body(500, "lock-middleware-missing", problem), status_code=500,
                    media_type=CONTENT_TYPE.decode())


def _raise_if_unprotected(fn: Callable[..., Any]) -> None:
    problem = _problem(fn)
    if problem is not None:
        raise LockMiddlewareMissing(problem)
