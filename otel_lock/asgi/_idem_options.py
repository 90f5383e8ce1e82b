"""`idempotent(...)` options, checked when the route is decorated.

A wrong option must fail at import time with a message naming it, not turn
every request into a 500 later (`ttl=0.0001` once became a Redis "invalid
expire time" on each call).
"""

from __future__ import annotations

import math
from typing import Any

from ._idem_principal import check_callable

MIN_TTL = 1.0                   # a record must outlive the request that writes it
MAX_TTL = 366 * 86400.0         # a year and a day: keys are retry tokens, not archives
MAX_STORED_BODY = 64 * 1024 * 1024


def check_idempotent_options(*, ttl: Any, required: Any, principal: Any, shared_scope: Any,
                             wait_for_inflight: Any, retry_on_5xx: Any, max_body: Any, retry_after: Any) -> None:
    _seconds("ttl", ttl, MIN_TTL, MAX_TTL)
    _seconds("wait_for_inflight", wait_for_inflight, 0.0, float(ttl))
    _seconds("retry_after", retry_after, 0.0, float(ttl))
    for name, value in (("required", required), ("shared_scope", shared_scope), ("retry_on_5xx", retry_on_5xx)):
        if not isinstance(value, bool):
            raise ValueError(f"idempotent({name}=...) must be True or False, got {value!r}")
    if not isinstance(max_body, int) or isinstance(max_body, bool) or not 0 <= max_body <= MAX_STORED_BODY:
        raise ValueError(f"idempotent(max_body=...) must be a number of bytes from 0 to {MAX_STORED_BODY}, "
                         f"got {max_body!r}")
    check_callable(principal, "idempotent(...)")
    if principal is not None and shared_scope:
        raise ValueError("idempotent(...): give either principal= (keys scoped per caller) "
                         "or shared_scope=True (one scope for every caller), not both")


def _seconds(name: str, value: Any, low: float, high: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or not low <= value <= high:
        raise ValueError(f"idempotent({name}=...) must be a number of seconds from {low:g} to {high:g}, "
                         f"got {value!r}")
