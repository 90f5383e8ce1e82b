"""A principal that is a FastAPI dependency, `principal=Depends(user_id)`, resolved by FastAPI itself.

The app's authentication lives in its dependencies (`CurrentUser =
Annotated[User, Depends(get_current_user)]`); a principal written as a
callable of the raw request would decode the token a second time, without
the app's checks. So `principal=` may be the dependency itself: FastAPI's
`solve_dependencies` resolves it on the request, with its sub-dependencies,
security schemes and the app's `dependency_overrides`, before the lock is
taken: a request the dependency rejects (its 401) never queues for or holds
the lock. Its `yield` dependencies are closed once the value is known, so a
database session is not kept open while the request waits for the lock.
The route resolves the dependency again for its handler (FastAPI gives no
way to hand it a value): it runs twice, but is written once.
"""

from __future__ import annotations

import inspect
from contextlib import AsyncExitStack
from typing import Any

from starlette.requests import Request


class Invalid(ValueError):
    """FastAPI rejects the dependency's own inputs (a missing header, say): a 422, as the route would give."""


_DEPENDANTS: dict[tuple[int, str], tuple[Any, Any]] = {}


def is_dependency(value: Any) -> bool:
    """A `fastapi.Depends(...)` (or `Security(...)`) marker."""
    try:
        from fastapi import params
    except ImportError:   # pragma: no cover - FastAPI is optional
        return False
    return isinstance(value, params.Depends)


async def from_dependency(marker: Any, request: Request, route: str) -> Any:
    """The dependency's value for this request, as FastAPI resolves it for a route at `route`."""
    from fastapi.dependencies.utils import solve_dependencies

    dependant = _dependant(marker, route)
    app = request.scope.get("app")
    overrides = app if getattr(app, "dependency_overrides", None) is not None else None
    async with AsyncExitStack() as stack:
        # FastAPI >= 0.12x closes yield dependencies through stacks in the scope: ours, closed below.
        scope = {**request.scope, "fastapi_astack": stack, "fastapi_inner_astack": stack,
                 "fastapi_function_astack": stack}
        request = Request(scope, request.receive)
        solved = await solve_dependencies(request=request, dependant=dependant, async_exit_stack=stack,
                                          dependency_overrides_provider=overrides, embed_body_fields=False)
        if solved.errors:
            raise Invalid("the request's credentials are not valid for this operation: "
                          + "; ".join(str(e.get("msg", e)) for e in solved.errors))
        return solved.values["principal"]


def _dependant(marker: Any, route: str) -> Any:
    """A one-parameter dependant, `principal = Depends(...)`, built once per (marker, route path)."""
    cached = _DEPENDANTS.get((id(marker), route))
    if cached is not None and cached[0] is marker:
        return cached[1]
    from fastapi.dependencies.utils import get_dependant

    def otel_lock_principal(principal: Any) -> Any:
        return principal

    otel_lock_principal.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
        [inspect.Parameter("principal", inspect.Parameter.KEYWORD_ONLY, default=marker)])
    dependant = get_dependant(path=route, call=otel_lock_principal)
    _DEPENDANTS[(id(marker), route)] = (marker, dependant)
    return dependant
