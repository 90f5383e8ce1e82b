"""Attach an annotation to a handler and guard it: below `idempotency/` and `_annotations`, which both use it.

Kept apart so the options of `@idempotent` (in `idempotency/`) and of
`@locked` (in `_annotations`) reach it without importing each other.
"""

from __future__ import annotations

import logging
import sys
import types
from typing import TYPE_CHECKING, Any, Callable, TypeVar

from ._guard import fail_closed_route, guard

if TYPE_CHECKING:
    from ._annotations import Locked
    from .idempotency import Idempotent

log = logging.getLogger("otel_lock.middleware")

ATTR = "__otel_lock__"
# A handler (function, method, HTTPEndpoint class or ASGI app): decorating returns it with its own type.
F = TypeVar("F", bound=Callable[..., Any])


def attach(obj: F, kind: str, annotation: Locked | Idempotent) -> F:
    existing = getattr(obj, ATTR, None) or {}
    if kind in existing:
        spelled = "@locked or @limited" if kind == "locked" else f"@{kind}"
        raise ValueError(f"{getattr(obj, '__qualname__', obj)!r} already has a {spelled} annotation: one per "
                         f"route (several keys go in one @locked(\"a:{{...}}\", \"b:{{...}}\"))")
    # A new dict, never an update: functools.wraps shares __dict__ between a
    # wrapper and its target, and annotating one must not annotate the other.
    setattr(obj, ATTR, {**existing, kind: annotation})
    guarded = guard(obj)
    if guarded is not obj:
        setattr(guarded, ATTR, {**existing, kind: annotation})
        _fail_closed_if_registered(obj, kind, sys._getframe(2))
    return guarded


def _fail_closed_if_registered(fn: Any, kind: str, frame: Any) -> None:
    """`@locked` written above `@app.post`: the route registered `fn` itself, unguarded.

    The decorating frame holds the app or router whose decorator ran just
    before ours; its route for `fn` is made to refuse requests that no
    LockMiddleware protects, and a warning names the fix.
    """
    # Apps and routers only: no attribute look-up on modules or classes (a module's __getattr__ may warn).
    holders = [v for v in (*frame.f_locals.values(), *frame.f_globals.values())
               if not isinstance(v, (types.ModuleType, type)) and isinstance(getattr(v, "routes", None), list)]
    for holder in holders:
        for route in holder.routes:
            if getattr(route, "endpoint", None) is fn and fail_closed_route(route):
                log.warning("otel-lock: @%s is written above @%s.<method>(%r) on %s: the route registered the "
                            "function before the annotation; put @%s right below the route decorator. Until then "
                            "the route depends on LockMiddleware alone (without it, it answers 500)",
                            kind, type(holder).__name__, getattr(route, "path", "?"),
                            getattr(fn, "__qualname__", fn), kind)
