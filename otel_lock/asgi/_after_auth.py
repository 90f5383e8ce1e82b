"""Take a FastAPI route's lock once the caller is known: after its security dependencies, before the rest.

A request that authentication rejects must neither queue for the business
lock nor hold it while its token is checked; a dependency that reads the
resource (`item = Depends(get_item_or_404)`) must still run under it. So on a
route with security dependencies (a `fastapi.security` scheme, anything that
depends on one, or `Security(..., scopes=...)`), the middleware adds one
dependency of its own to the route, right after them: FastAPI resolves the
security dependencies, then ours, which takes the lock the middleware
prepared, then the others and the handler. The lock is released where it
always is, when the route's app call returns: `yield`-dependency exits and
background tasks run under it. `locked(after_auth=False)` keeps the lock in
front of every dependency; `after_auth=True` asks for this order and fails
the start-up on a route without security dependencies.
"""

from __future__ import annotations

import contextvars
from typing import Any, Awaitable, Callable

from ..lock import LockError

DEPTH = 8   # how deep a dependency is searched for a security scheme


class NotTaken(Exception):
    """The route's lock was not taken in the dependency: LockedApp answers for it (never the app's handlers)."""

    def __init__(self, error: LockError) -> None:
        super().__init__(str(error))
        self.error = error


class Deferred:
    """The lock LockedApp prepared and our dependency takes; `done` once taken (or run unlocked, fail_open)."""

    def __init__(self, take: Callable[[], Awaitable[None]]) -> None:
        self._take, self.done = take, False

    async def take(self) -> None:
        if not self.done:
            await self._take()
            self.done = True


DEFERRED: contextvars.ContextVar[Deferred | None] = contextvars.ContextVar("otel_lock_deferred", default=None)


async def otel_lock_route_lock() -> None:
    """The dependency the middleware adds (its name shows in tracebacks): take the route's lock here."""
    deferred = DEFERRED.get()
    if deferred is not None:
        await deferred.take()


def security_dependencies(dependant: Any) -> list[Any]:
    """The route's own dependencies that authenticate (in FastAPI's order)."""
    return [d for d in getattr(dependant, "dependencies", None) or () if _authenticates(d, DEPTH)]


def _authenticates(dependant: Any, depth: int) -> bool:
    from fastapi.security.base import SecurityBase

    # Security(..., scopes=[...]): `own_oauth_scopes` on FastAPI >= 0.12x, `security_scopes` before.
    scopes = getattr(dependant, "own_oauth_scopes", None) or getattr(dependant, "security_scopes", None)
    if isinstance(dependant.call, SecurityBase) or scopes:
        return True
    return depth > 0 and any(_authenticates(d, depth - 1) for d in dependant.dependencies)


def after_security(dependant: Any, path: str) -> None:
    """Put our dependency right after the security ones (which move first, in their order); once per dependant."""
    from fastapi.dependencies.utils import get_dependant

    deps = dependant.dependencies
    if any(d.call is otel_lock_route_lock for d in deps):
        return
    security = [d for d in deps if _authenticates(d, DEPTH)]
    rest = [d for d in deps if all(d is not s for s in security)]
    deps[:] = [*security, get_dependant(path=path, call=otel_lock_route_lock), *rest]
