"""The exceptions of otel-lock.

    LockError              base of everything below
     ├── LockTimeout       not acquired within `wait`
     ├── LockLost          the lease was lost while the caller held the lock
     └── RedisUnavailable  Redis could not be reached within the socket timeout

Bad arguments raise ValueError with a message that names the problem.
"""

from __future__ import annotations

from redis.exceptions import ClusterDownError, ReadOnlyError, TryAgainError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError


class LockError(Exception):
    """Base class; `key` is the lock's Redis key when one is concerned."""

    def __init__(self, message: str, *, key: str | None = None) -> None:
        super().__init__(message)
        self.key = key


class LockTimeout(LockError):
    """The lock was not acquired within the caller's `wait`."""


class LockLost(LockError):
    """The lease expired or was taken over while the holder still ran."""


class RedisUnavailable(LockError):
    """Redis did not answer (refused, reset, or timed out), or the circuit breaker is open.

    `retry_after`: seconds until the breaker lets a call through again, when
    it refused this one without asking Redis; None otherwise.
    """

    def __init__(self, message: str, *, key: str | None = None, retry_after: float | None = None) -> None:
        super().__init__(message, key=key)
        self.retry_after = retry_after


# Errors that mean "Redis cannot serve right now": refused, reset, timed out,
# still loading its data (LOADING is a ConnectionError in redis-py), a master
# that lost its link (MASTERDOWN) or a failover under way (READONLY,
# TRYAGAIN, CLUSTERDOWN). They become RedisUnavailable (HTTP 503), never 500.
_UNAVAILABLE = (RedisConnectionError, RedisTimeoutError, OSError, ClusterDownError, ReadOnlyError, TryAgainError)


def is_unavailable(error: BaseException) -> bool:
    return isinstance(error, _UNAVAILABLE)
