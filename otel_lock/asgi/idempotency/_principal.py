"""Whose key is it: the principal an Idempotency-Key is scoped to.

There is no implicit principal. A client address is a proxy's address for
every user behind it, and an unnamed header is whatever the client chose to
send: either would let one caller be served another's stored response. So
the app names the principal (`principal=` on `@idempotent` or on
`LockMiddleware`), or opts into one shared scope (`shared_scope=True`);
with neither, the route answers 500 and says which setting is missing.

The callable's answer decides, and it fails closed:

    str / int            the principal
    None or ""           nobody identified: 401 with the route's challenge
                         (or its `unauthenticated_status`), nothing runs
    raises HTTPException  that 4xx status and headers (a 401 without a
                         WWW-Authenticate gets the route's challenge)
    raises anything else a bug in the app: 500, logged; nothing runs
"""

from __future__ import annotations

import inspect
import logging
from typing import TYPE_CHECKING, Any, Callable

from starlette.exceptions import HTTPException
from starlette.requests import Request

if TYPE_CHECKING:
    from ._options import Idempotent

log = logging.getLogger("otel_lock.idempotency")

SHARED_SCOPE = "shared"
SHARED_PRINCIPAL = "s:"

# Whose keys: takes the request, returns (or awaits) a str or int; None or "" is nobody.
Principal = Callable[[Request], Any]
Headers = list[tuple[bytes, bytes]]


class PrincipalProblem(Exception):
    """The request gets this answer instead of a principal."""

    def __init__(self, status: int, type_name: str, detail: str, headers: Headers | None = None) -> None:
        super().__init__(detail)
        self.status, self.type_name, self.detail, self.headers = status, type_name, detail, headers or []


def missing_setting(route: str) -> str:
    return (f"@idempotent route {route} has no principal: pass principal=<callable(request)> to "
            "@idempotent(...) or to LockMiddleware(...), or shared_scope=True to @idempotent(...) "
            "if every caller may share one key space")


def choose(idem: Idempotent, fallback: Principal | None) -> Principal | str | None:
    """The route's own setting first, then the middleware's; None: not configured."""
    if idem.shared_scope:
        return SHARED_SCOPE
    return idem.principal if idem.principal is not None else fallback


async def resolve(source: Principal | str, request: Request, route: str, idem: Idempotent) -> str:
    """The scope string for this request (prefixed so shared and named scopes never meet)."""
    if isinstance(source, str):  # SHARED_SCOPE, the only string `choose` gives
        return SHARED_PRINCIPAL
    try:
        value = source(request)
        if inspect.isawaitable(value):
            value = await value
    except HTTPException as error:
        if 400 <= error.status_code < 500:
            raise PrincipalProblem(error.status_code, "idempotency-principal-rejected", str(error.detail),
                                   _with_challenge(error.status_code, _latin1(error.headers), idem)) from None
        raise _failed(route, error) from error
    except Exception as error:
        raise _failed(route, error) from error
    if value is None or value == "":
        status = idem.unauthenticated_status
        raise PrincipalProblem(status, "idempotency-principal-missing",
                               "this operation needs an identified caller (the principal of its "
                               "Idempotency-Key); authenticate and retry", _with_challenge(status, [], idem))
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        log.error("otel-lock: the principal callable of %s returned %s; it must return a str (or int)",
                  route, type(value).__name__)
        raise PrincipalProblem(500, "idempotency-principal-error",
                               "the server could not determine the caller of this request")
    return "p:" + str(value)


def _with_challenge(status: int, headers: Headers, idem: Idempotent) -> Headers:
    """RFC 9110 15.5.2: a 401 carries WWW-Authenticate; the app's own challenge wins."""
    if status != 401 or any(name == b"www-authenticate" for name, _ in headers) or idem.challenge is None:
        return headers
    return [*headers, (b"www-authenticate", idem.challenge.encode("ascii"))]


def _latin1(headers: Any) -> Headers:
    return [(str(k).lower().encode("latin-1", "replace"), str(v).encode("latin-1", "replace"))
            for k, v in (headers or {}).items()]


def _failed(route: str, error: Exception) -> PrincipalProblem:
    # Fail closed: without a principal we cannot tell callers apart, and a
    # 401/403 would send a correctly authenticated client to log in again.
    log.error("otel-lock: the principal callable of %s raised %s: %s", route, type(error).__name__, error)
    return PrincipalProblem(500, "idempotency-principal-error",
                            "the server could not determine the caller of this request")


def check_callable(principal: Any, where: str) -> None:
    """At configuration time: a callable that takes the request."""
    if principal is None:
        return
    if not callable(principal):
        raise ValueError(f"{where}: principal must be a callable taking the request, got {principal!r}")
    try:
        inspect.signature(principal).bind(None)
    except TypeError:
        raise ValueError(f"{where}: principal must accept one argument (the request)") from None
    except ValueError:
        pass  # no signature to inspect (some builtins): find out on the first request
