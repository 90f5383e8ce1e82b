"""One mapping from a lock or Redis failure to the HTTP problem a client gets.

The route's lock (taken around the route's app, or at the handler's call)
and the idempotency gate answer the same failure the same way: a busy
resource is the rule's status (409 by default; a `@limited` route's
429 `concurrency-limit`), a wait that would close a cycle of waiters 409
`lock-deadlock` (the cycle's keys hashed), a lost lease and an
unavailable Redis are 503 with Retry-After, a misconfigured Redis is a 500
that names the fix, any other error reply of Redis a 500 `redis-error`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from starlette.responses import Response

from ..lock import HeldLock, LockDeadlock, LockError, LockLost, LockTimeout, Locks, RedisMisconfigured, RedisUnavailable
from ..telemetry._redact import _hash
from ._problem import CONTENT_TYPE, problem_body, retry_after_value, send_problem
from ._types import Send

if TYPE_CHECKING:
    from ._annotations import Locked

log = logging.getLogger("otel_lock.middleware")


@dataclass(frozen=True)
class Answer:
    """A problem+json answer, sent over ASGI or returned as a Starlette response."""

    status: int
    type_name: str
    detail: str
    retry_after: float | None = None

    async def send(self, send: Send) -> None:
        await send_problem(send, self.status, self.type_name, self.detail, retry_after=self.retry_after)

    def response(self) -> Response:
        headers = {"retry-after": retry_after_value(self.retry_after).decode()} \
            if self.retry_after is not None else None
        return Response(problem_body(self.status, self.type_name, self.detail), status_code=self.status,
                        headers=headers, media_type=CONTENT_TYPE.decode())


def redis_answer(error: LockError, service: str, retry_after: float) -> Answer:
    """What a failed call to Redis answers; `service` names it ("the lock service", "the idempotency store")."""
    if isinstance(error, RedisUnavailable):
        # An open circuit breaker knows when it lets a call through again.
        return Answer(503, "redis-unavailable", f"{service} is unavailable",
                      retry_after if error.retry_after is None else error.retry_after)
    if isinstance(error, RedisMisconfigured):
        # Permanent: retrying cannot help, and fail_open would hide it. The message names the fix.
        return Answer(500, "redis-misconfigured", f"{service} is misconfigured: {error}")
    # Redis answered with an error (a key of another type in the namespace, ...).
    return Answer(500, "redis-error", f"{service} failed: {error}")


def lock_answer(error: LockError, rule: Locked) -> Answer:
    """What a route's lock that was not taken (or was lost) answers."""
    if isinstance(error, LockDeadlock):
        return Answer(409, "lock-deadlock", f"the wait for lock {rule.lock_name!r} would close a cycle of requests "
                      f"waiting on each other ({_cycle_text(error)}); it was refused at once: retry",
                      retry_after(rule))
    if isinstance(error, LockTimeout) and rule.mode == "permit":
        return Answer(rule.status, "concurrency-limit", f"too many requests run at once (limit {rule.lock_name!r}: "
                      f"{rule.permits} at a time); no permit came within the wait", retry_after(rule))
    if isinstance(error, LockTimeout):
        return Answer(rule.status, "lock-timeout",
                      f"the resource is busy (lock {rule.lock_name!r} not acquired within the wait)",
                      retry_after(rule))
    if isinstance(error, LockLost):
        return Answer(503, "lock-lost", "the lock was lost while the request ran; its effects may be incomplete",
                      retry_after(rule))
    if not isinstance(error, RedisUnavailable):
        log.error("otel-lock: %s", error)
    return redis_answer(error, "the lock service", retry_after(rule))


def _cycle_text(error: LockDeadlock) -> str:
    """The cycle's keys as the client may see them: hashed (they are other requests' keys), in its order.

    The hash is the one `OTEL_LOCK_REDACT=hash` puts on spans, so an operator finds the cycle there;
    owners and holders are left out.
    """
    keys = [_hash(key) for key, _owner, _holder in error.cycle]
    return "keys " + " -> ".join(keys) if keys else "its keys are on the acquire span"


def runs_unlocked(error: LockError, rule: Locked, manager: Locks) -> bool:
    """fail_open: an unavailable Redis runs the handler without its lock (counted); nothing else does."""
    if not (rule.fail_open and isinstance(error, RedisUnavailable)):
        return False
    count_fail_open(manager, rule)
    return True


def retry_after(rule: Locked) -> float:
    return rule.retry_after if rule.retry_after is not None else 1.0


def count_fail_open(manager: Locks, rule: Locked) -> None:
    """The manager counted the Redis error (otel_lock.errors); this counts the unlocked run."""
    telemetry: Any = getattr(manager, "telemetry", None)
    if telemetry is None:
        from ..telemetry._instruments import get_telemetry

        telemetry = get_telemetry()
    telemetry.fail_open.add(1, {"lock.name": rule.lock_name})
    log.warning("otel-lock: Redis unavailable, running %s without its lock (fail_open)", rule.lock_name)


async def release_quietly(held: HeldLock | Any) -> None:
    """Release after the response: a Redis that is gone now only delays the lock's expiry.

    `held` is whatever the route's shape holds (a HeldLock, lock_all()'s holds, a permit) or None (no keys).
    """
    if held is None:
        return
    try:
        await held.release()
    except RedisUnavailable as error:
        log.warning("otel-lock: could not release %s, it will expire by itself: %s", getattr(held, "key", held),
                    error)
