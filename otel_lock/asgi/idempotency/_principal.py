"""Whose key is it: the principal an Idempotency-Key is scoped to.

There is no implicit principal. A client address is a proxy's address for
every user behind it, and an unnamed header is whatever the client chose to
send: either would let one caller be served another's stored response. So
the app names the principal (`principal=` on `@idempotent` or on
`LockMiddleware`), or opts into one shared scope (`shared_scope=True`);
with neither, the route answers 500 and says which setting is missing.

`principal=` is a callable of the request, or a FastAPI dependency,
`Depends(user_id)`: FastAPI resolves it (with its own sub-dependencies,
security schemes and `app.dependency_overrides`) on the request, before the
lock and the Idempotency-Key record, so an app's authentication is written
once. With Starlette's AuthenticationMiddleware outside ours,
`principal=authenticated_user` reads `scope["user"]`.

The answer decides, and it fails closed:

    str / int            the principal
    None or ""           nobody identified: 401 with the route's challenge
                         (or its `unauthenticated_status`), nothing runs
    raises HTTPException  that 4xx status and headers (a 401 without a
                         WWW-Authenticate gets the route's challenge);
                         a dependency whose inputs FastAPI rejects: 422
    raises anything else a bug in the app: 500, logged; nothing runs
"""

from __future__ import annotations

import inspect
import logging
from typing import TYPE_CHECKING, Any, Callable

from starlette.exceptions import HTTPException
from starlette.requests import Request

from ._principal_dependency import Invalid, from_dependency, is_dependency

if TYPE_CHECKING:
    from ._options import Idempotent

log = logging.getLogger("otel_lock.idempotency")

SHARED_SCOPE = "shared"
SHARED_PRINCIPAL = "s:"

# Whose keys: takes the request, returns (or awaits) a str or int; None or "" is nobody.
# (Or a fastapi.Depends(...) whose dependency returns one.)
Principal = Callable[[Request], Any]
Headers = list[tuple[bytes, bytes]]


class PrincipalProblem(Exception):
    """The request gets this answer instead of a principal."""

    def __init__(self, status: int, type_name: str, detail: str, headers: Headers | None = None) -> None:
        super().__init__(detail)
        self.status, self.type_name, self.detail, self.headers = status, type_name, detail, headers or []


def request_of(scope: Any, body: bytes) -> Request:
    """The principal's Request: the buffered body, so `await request.body()` works."""
    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": body, "more_body": False}
    return Request(scope, receive)


def missing_setting(route: str) -> str:
    return (f"@idempotent route {route} has no principal: pass principal=<callable(request)> to "
            "@idempotent(...) or to LockMiddleware(...), or shared_scope=True to @idempotent(...) "
            "if every caller may share one key space")


def choose(idem: Idempotent, fallback: Principal | None) -> Principal | str | None:
    """The route's own setting first, then the middleware's; None: not configured."""
    if idem.shared_scope:
        return SHARED_SCOPE
    return idem.principal if idem.principal is not None else fallback


async def resolve(source: Principal | str, request: Request, route: str, idem: Idempotent,
                  kind: str = "idempotency", optional: bool = False) -> str | None:
    """The scope string for this request (prefixed so shared and named scopes never meet).

    `kind` names the answers (`lock-principal-missing` for a `{principal}`
    key); `optional`: None for nobody instead of the unauthenticated answer.
    """
    if isinstance(source, str):  # SHARED_SCOPE, the only string `choose` gives
        return SHARED_PRINCIPAL
    try:
        if is_dependency(source):
            value = await from_dependency(source, request, route)
        else:
            value = source(request)
            if inspect.isawaitable(value):
                value = await value
    except HTTPException as error:
        if 400 <= error.status_code < 500:
            raise PrincipalProblem(error.status_code, f"{kind}-principal-rejected", str(error.detail),
                                   _with_challenge(error.status_code, _latin1(error.headers), idem)) from None
        raise _failed(route, error, kind) from error
    except Invalid as error:
        raise PrincipalProblem(422, f"{kind}-principal-rejected", str(error)) from None
    except Exception as error:
        raise _failed(route, error, kind) from error
    if value is None or value == "":
        if optional:
            return None
        status = idem.unauthenticated_status
        what = "the principal of its Idempotency-Key" if kind == "idempotency" else "its lock is per caller"
        raise PrincipalProblem(status, f"{kind}-principal-missing",
                               f"this operation needs an identified caller ({what}); authenticate and retry",
                               _with_challenge(status, [], idem))
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        log.error("otel-lock: the principal of %s is a %s; it must be a str (or int): a dependency such as "
                  "`def user_id(user: CurrentUser) -> str: return str(user.id)`", route, type(value).__name__)
        raise PrincipalProblem(500, f"{kind}-principal-error",
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


def _failed(route: str, error: Exception, kind: str = "idempotency") -> PrincipalProblem:
    # Fail closed: without a principal we cannot tell callers apart, and a
    # 401/403 would send a correctly authenticated client to log in again.
    log.error("otel-lock: the principal of %s raised %s: %s", route, type(error).__name__, error)
    return PrincipalProblem(500, f"{kind}-principal-error",
                            "the server could not determine the caller of this request")


def check_callable(principal: Any, where: str) -> None:
    """At configuration time: a callable that takes the request, or a FastAPI Depends(...)."""
    if principal is None or is_dependency(principal):
        return
    if not callable(principal):
        raise ValueError(f"{where}: principal must be a callable taking the request or a FastAPI "
                         f"Depends(<dependency>), got {principal!r}")
    try:
        inspect.signature(principal).bind(None)
    except TypeError:
        raise ValueError(f"{where}: principal must accept one argument (the request)") from None
    except ValueError:
        pass  # no signature to inspect (some builtins): find out on the first request


def authenticated_user(request: Request) -> str | None:
    """`principal=` for Starlette's AuthenticationMiddleware (outside LockMiddleware): `scope["user"]`'s identity.

    None (nobody) for an unauthenticated user. A user class without an
    `identity` (Starlette's SimpleUser) is named by its `display_name`.
    """
    if "user" not in request.scope:
        raise RuntimeError("scope['user'] is not set: add Starlette's AuthenticationMiddleware outside "
                           "LockMiddleware (app.add_middleware(LockMiddleware, ...) first, then "
                           "AuthenticationMiddleware), or give principal= another source")
    user = request.scope["user"]
    if not getattr(user, "is_authenticated", False):
        return None
    try:
        identity = user.identity
    except NotImplementedError:
        identity = user.display_name
    return None if identity is None else str(identity)
