"""One Redis call of the lock, seen once: its duration, its error, the breaker, the exception the caller gets.

Every topology's calls end here, so a script's round trip is timed and
classified the same way on one server, a Sentinel master, a Cluster node or
one master of a RedLock quorum. What an error means (transient, or a
misconfiguration with its fix) is decided in `_errors.py`.
"""

from __future__ import annotations

import time
from typing import Any, Awaitable

from redis.exceptions import RedisError

from ._breaker import Breaker
from ._errors import LockError, error_type, server_name, to_lock_error
from ..telemetry._instruments import Telemetry

__all__ = ["Calls", "batch_outcomes", "error_type", "record_batch"]


class Calls:
    """Times and classifies the calls of one manager (its telemetry and breaker) to one server."""

    __slots__ = ("telemetry", "breaker", "client", "partial")

    def __init__(self, telemetry: Telemetry, breaker: Breaker | None, client: Any, *, partial: bool = False) -> None:
        self.telemetry, self.breaker, self.client = telemetry, breaker, client
        self.partial = partial  # each call reaches one part of the deployment (a Cluster slot's master)

    @property
    def where(self) -> str:
        """The server, as `host:port` (no credentials)."""
        return server_name(self.client)

    async def __call__(self, call: Awaitable[Any], operation: str, name: str, key: str) -> Any:
        began = time.perf_counter()
        try:
            answer = await call
        except (RedisError, OSError) as exc:
            raise self.failed(exc, time.perf_counter() - began, operation, name, key) from exc
        self.ok(time.perf_counter() - began, operation, name)
        return answer

    def ok(self, seconds: float, operation: str, name: str) -> None:
        """Record a call that was answered (timed by its caller: a reply's future, not a coroutine)."""
        self.telemetry.redis_duration.record(seconds, {"lock.name": name, "lock.operation": operation})
        if self.breaker is not None:
            self.breaker.record(True, partial=self.partial)

    def failed(self, exc: BaseException, seconds: float, operation: str, name: str, key: str) -> LockError:
        """Record a failed call and return the error for its caller."""
        kind = error_type(exc)
        attributes = {"lock.name": name, "lock.operation": operation, "error.type": kind}
        self.telemetry.redis_duration.record(seconds, attributes)
        self.telemetry.errors.add(1, attributes)
        if self.breaker is not None:
            self.breaker.record(kind != "redis_unavailable", partial=self.partial, took=seconds)
        return self.error(exc, f"{operation} of {key}", key)

    def error(self, exc: BaseException, what: str, key: str | None) -> LockError:
        return to_lock_error(exc, what, key=key, client=self.client)


def record_batch(telemetry: Telemetry, outcomes: dict[tuple[str, str], None], seconds: float) -> None:
    """One batched round trip (renewals): its time, once per (lock name, error type) it carried."""
    for name, error in outcomes:
        attributes = {"lock.name": name, "lock.operation": "renew"}
        if error:
            attributes["error.type"] = error
        telemetry.redis_duration.record(seconds, attributes)


def batch_outcomes(names: list[str], results: list[bool | BaseException]) -> dict[tuple[str, str], None]:
    return {(name, error_type(r) if isinstance(r, BaseException) else ""): None for name, r in zip(names, results)}
