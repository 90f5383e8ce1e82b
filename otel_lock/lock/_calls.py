"""One Redis call of the lock, seen once: its duration, its error, the breaker, the exception the caller gets.

Every topology's calls end here, so a script's round trip is timed and
classified the same way on one server, a Sentinel master, a Cluster node or
one master of a RedLock quorum.
"""

from __future__ import annotations

import time
from typing import Any, Awaitable

from redis.exceptions import RedisError

from ._breaker import Breaker
from ._errors import LockError, RedisUnavailable, is_unavailable
from ..telemetry._instruments import Telemetry


def error_type(error: BaseException) -> str:
    """`error.type` of a failed Redis call."""
    return "redis_unavailable" if isinstance(error, RedisUnavailable) or is_unavailable(error) else "redis_error"


def lock_error(error: BaseException, what: str, key: str | None, where: str) -> LockError:
    """The exception a caller gets for a failed Redis call: transient or not, naming the server."""
    if is_unavailable(error):
        return RedisUnavailable(f"Redis at {where} is unavailable ({what}): {error}", key=key)
    return LockError(f"Redis at {where} refused {what}: {error}", key=key)


class Calls:
    """Times and classifies the calls of one manager (its telemetry and breaker), for one server address."""

    __slots__ = ("telemetry", "breaker", "where")

    def __init__(self, telemetry: Telemetry, breaker: Breaker | None, where: str) -> None:
        self.telemetry, self.breaker, self.where = telemetry, breaker, where

    async def __call__(self, call: Awaitable[Any], operation: str, name: str, key: str) -> Any:
        began = time.perf_counter()
        try:
            answer = await call
        except (RedisError, OSError) as exc:
            raise self.failed(exc, time.perf_counter() - began, operation, name, key) from exc
        self.telemetry.redis_duration.record(time.perf_counter() - began,
                                             {"lock.name": name, "lock.operation": operation})
        if self.breaker is not None:
            self.breaker.record(True)
        return answer

    def failed(self, exc: BaseException, seconds: float, operation: str, name: str, key: str) -> LockError:
        """Record a failed call and return the error for its caller."""
        kind = error_type(exc)
        attributes = {"lock.name": name, "lock.operation": operation, "error.type": kind}
        self.telemetry.redis_duration.record(seconds, attributes)
        self.telemetry.errors.add(1, attributes)
        if self.breaker is not None:
            self.breaker.record(kind != "redis_unavailable")
        return lock_error(exc, f"{operation} {key}", key, self.where)


def record_batch(telemetry: Telemetry, outcomes: dict[tuple[str, str], None], seconds: float) -> None:
    """One batched round trip (renewals): its time, once per (lock name, error type) it carried."""
    for name, error in outcomes:
        attributes = {"lock.name": name, "lock.operation": "renew"}
        if error:
            attributes["error.type"] = error
        telemetry.redis_duration.record(seconds, attributes)


def batch_outcomes(names: list[str], results: list[bool | BaseException]) -> dict[tuple[str, str], None]:
    return {(name, error_type(r) if isinstance(r, BaseException) else ""): None for name, r in zip(names, results)}
