"""The exceptions of otel-lock.

    LockError                base of everything below; `.key`
     ├── LockTimeout         not acquired within `wait`; `.waited`
     │    └── LockBusy       a `try_lock` (wait=0) found the lock held
     ├── LockLost            the lease was lost while the caller held it; `.reason`
     ├── RedisUnavailable    transient: refused, reset, timed out, LOADING, a failover
     │                       under way, maxclients, OOM, an open circuit; `.retry_after`
     └── RedisMisconfigured  permanent: authentication, ACL rights, database number,
                             an unsupported server; the message says what to fix

Bad arguments raise ValueError (or TypeError) with a message that names the
problem, before anything is sent to Redis.
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
    """The lock was not acquired within the caller's `wait`; `waited` is how long the caller waited (s)."""

    def __init__(self, message: str, *, key: str | None = None, waited: float = 0.0) -> None:
        super().__init__(message, key=key)
        self.waited = waited


class LockBusy(LockTimeout):
    """A `wait=0` attempt (`try_lock`, `acquire(wait=0)`) found the lock held by another owner."""


class LockLost(LockError):
    """The lease expired or was taken over while the holder still ran; `reason` says which."""

    def __init__(self, message: str, *, key: str | None = None, reason: str = "") -> None:
        super().__init__(message, key=key)
        self.reason = reason


class RedisUnavailable(LockError):
    """Redis cannot serve right now (transient); retrying later may succeed.

    `retry_after`: seconds until the circuit breaker lets a call through
    again, when it refused this one without asking Redis; None otherwise.
    """

    def __init__(self, message: str, *, key: str | None = None, retry_after: float | None = None) -> None:
        super().__init__(message, key=key)
        self.retry_after = retry_after


class RedisMisconfigured(LockError):
    """Redis refuses this client for a reason retrying cannot fix (credentials, ACL, db, server version).

    The message names the setting to change; over HTTP it is a 500 that says so.
    """


# Errors that mean "Redis cannot serve right now": refused, reset, timed out,
# still loading its data (LOADING is a ConnectionError in redis-py), a master
# that lost its link (MASTERDOWN) or a failover under way (READONLY,
# TRYAGAIN, CLUSTERDOWN). They become RedisUnavailable (HTTP 503), never 500.
_UNAVAILABLE = (RedisConnectionError, RedisTimeoutError, OSError, ClusterDownError, ReadOnlyError, TryAgainError)


def is_unavailable(error: BaseException) -> bool:
    return isinstance(error, _UNAVAILABLE)
