"""`idempotent(...)`: a route's Idempotency-Key handling, checked when the route is decorated.

A wrong option must fail at import time with a message naming it, not turn
every request into a 500 later (`ttl=0.0001` once became a Redis "invalid
expire time" on each call).
"""

from __future__ import annotations

import math
import re
import warnings
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, TypeVar

from .._attach import attach
from ._principal import Principal, check_callable

MIB = 1024 * 1024
MIN_TTL = 1.0                   # a record must outlive the request that writes it
MAX_TTL = 366 * 86400.0         # a year and a day: keys are retry tokens, not archives
MAX_STORED_RESPONSE = 64 * MIB
# RFC 9110 11.6.1: challenge = auth-scheme [ 1*SP ( token68 / #auth-param ) ], one header line.
_CHALLENGE = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+(?: [\x20-\x7e]*)?")
F = TypeVar("F", bound=Callable[..., Any])


@dataclass(frozen=True)
class Idempotent:
    """What `idempotent(...)` returns: a route's Idempotency-Key handling, as a decorator or a `rules=` value."""

    ttl: float = 86400.0
    required: bool = True
    principal: Principal | None = None
    wait_for_inflight: float = 0.0
    retry_on_5xx: bool = False
    max_stored_response: int = MIB
    retry_after: float = 1.0
    shared_scope: bool = False
    unauthenticated_status: int = 401
    challenge: str | None = "Bearer"

    kind: ClassVar[str] = "idempotent"

    def __call__(self, endpoint: F) -> F:
        return attach(endpoint, self.kind, self)


def idempotent(
    *, ttl: float = 86400, required: bool = True, principal: Principal | None = None,
    shared_scope: bool = False, wait_for_inflight: float = 0, retry_on_5xx: bool = False,
    max_stored_response: int | None = None, retry_after: float = 1, unauthenticated_status: int = 401,
    challenge: str | None = "Bearer", max_body: int | None = None,
) -> Idempotent:
    """Honour the Idempotency-Key header: run once, replay the stored response to retries.

    Keys are scoped to `principal(request)` (here or on LockMiddleware), or to
    one space shared by every caller with `shared_scope=True`: say which.
    A request whose principal is None gets `unauthenticated_status` (401,
    with `WWW-Authenticate: <challenge>`). `max_stored_response` (default
    1 MiB) is the largest response body stored for replay; `max_body` is its
    old, deprecated name (it read like the request limit).
    """
    if max_body is not None:
        if max_stored_response is not None:
            raise ValueError("idempotent(...): give max_stored_response= only (max_body is its deprecated name)")
        warnings.warn("idempotent(max_body=...) is deprecated: it is the stored-response limit, now named "
                      "max_stored_response (the request body limit belongs to LockMiddleware)",
                      DeprecationWarning, stacklevel=2)
        max_stored_response = max_body
    if max_stored_response is None:
        max_stored_response = MIB
    _seconds("ttl", ttl, MIN_TTL, MAX_TTL)
    _seconds("wait_for_inflight", wait_for_inflight, 0.0, float(ttl))
    _seconds("retry_after", retry_after, 0.0, float(ttl))
    for name, value in (("required", required), ("shared_scope", shared_scope), ("retry_on_5xx", retry_on_5xx)):
        if not isinstance(value, bool):
            raise ValueError(f"idempotent({name}=...) must be True or False, got {value!r}")
    if not _is_int(max_stored_response) or not 0 <= max_stored_response <= MAX_STORED_RESPONSE:
        raise ValueError(f"idempotent(max_stored_response=...) must be a number of bytes from 0 to "
                         f"{MAX_STORED_RESPONSE}, got {max_stored_response!r}")
    _check_unauthenticated(unauthenticated_status, challenge)
    check_callable(principal, "idempotent(...)")
    if principal is not None and shared_scope:
        raise ValueError("idempotent(...): give either principal= (keys scoped per caller) "
                         "or shared_scope=True (one scope for every caller), not both")
    return Idempotent(float(ttl), required, principal, float(wait_for_inflight), retry_on_5xx, max_stored_response,
                      float(retry_after), shared_scope, unauthenticated_status, challenge)


def _check_unauthenticated(status: Any, challenge: Any) -> None:
    if not _is_int(status) or not 400 <= status <= 499:
        raise ValueError(f"idempotent(unauthenticated_status=...) must be a 4xx status, got {status!r}")
    if challenge is None:
        if status == 401:
            raise ValueError("idempotent(challenge=None) needs unauthenticated_status other than 401: "
                             "a 401 must carry a WWW-Authenticate challenge (RFC 9110 15.5.2)")
        return
    if not isinstance(challenge, str) or not _CHALLENGE.fullmatch(challenge):
        raise ValueError("idempotent(challenge=...) must be a WWW-Authenticate challenge such as 'Bearer' or "
                         f"'Basic realm=\"shop\"' (printable ASCII, one line), got {challenge!r}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _seconds(name: str, value: Any, low: float, high: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or not low <= value <= high:
        raise ValueError(f"idempotent({name}=...) must be a number of seconds from {low:g} to {high:g}, "
                         f"got {value!r}")
