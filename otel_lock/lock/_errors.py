"""The exceptions of otel-lock.

    LockError                base of everything below; `.key`
     ├── LockTimeout         not acquired within `wait`; `.waited`
     │    └── LockBusy       a `try_lock` (wait=0) found the lock held
     ├── LockLost            the lease was lost while the caller held it; `.reason`
     ├── LockDeadlock        the wait would close a cycle of holders waiting on each other; `.cycle`
     ├── RedisUnavailable    transient: refused, reset, timed out, LOADING, a failover
     │                       under way, maxclients, OOM, an open circuit; `.retry_after`
     └── RedisMisconfigured  permanent: authentication, ACL rights, database number,
                             an unsupported server, a TLS certificate or protocol
                             problem; the message says what to fix

Bad arguments raise ValueError (or TypeError) with a message that names the
problem, before anything is sent to Redis.

Which Redis error becomes which class is decided here, once, for the whole
core: `to_lock_error()` wraps an error for the caller, `error_type()` names
it for metrics (`error.type`), `is_unavailable()` says whether it counts
against the circuit breaker. Transient states (unreachable, LOADING,
failover, maxclients, OOM) are unavailable; refusals that no retry can fix
(password, ACL rights, database number, a disabled command) are
misconfigured and do not open the breaker: Redis answered.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable

from redis.exceptions import (AuthenticationError, AuthenticationWrongNumberOfArgsError, AuthorizationError,
                              BusyLoadingError, ClusterDownError, MasterDownError, NoPermissionError,
                              OutOfMemoryError, ReadOnlyError, RedisClusterException, TryAgainError)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from ._scripts import SCRIPT_COMMANDS
from ._tls import WORDS as TLS_WORDS
from ._tls import TlsMisconfigured, fix_for


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


class LockDeadlock(LockError):
    """Refused at once: waiting for `key` would close a cycle of holders that wait on each other.

    `cycle`: one `(key, owner, holder)` per lock of the cycle, starting with
    the lock this caller asked for: the lock's full Redis key, the owner id
    holding it, and the task holding it (`task-name@pid/manager-id`; a
    thread's name, for the blocking facade). The last lock is one this
    caller holds, so its holder is the caller. Nothing was taken; the locks
    the caller already holds are still held.
    """

    def __init__(self, message: str, *, key: str | None = None,
                 cycle: tuple[tuple[str, str, str], ...] = ()) -> None:
        super().__init__(message, key=key)
        self.cycle = cycle


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


UNAVAILABLE, MISCONFIGURED, ERROR = "redis_unavailable", "redis_misconfigured", "redis_error"

# What the lock sends (its scripts' commands included), for the ACL rule a refusal names.
LOCK_COMMANDS = " ".join(f"+{c.lower()}" for c in ("EVALSHA", "EVAL", "SCRIPT|LOAD", "PING", "SUBSCRIBE", "SSUBSCRIBE",
                                                  "PUBLISH", "SPUBLISH", "HGETALL", "SCAN", *SCRIPT_COMMANDS))

# Coarse (a refused password is a ConnectionError in redis-py): classify with is_unavailable().
_UNAVAILABLE = (RedisConnectionError, RedisTimeoutError, OSError, ClusterDownError, ReadOnlyError, TryAgainError)


@dataclass(frozen=True)
class _Rule:
    """One kind of Redis error: matched by class, by error code (first word) or by words in the message."""

    kind: str
    classes: tuple[type[BaseException], ...] = ()
    codes: tuple[str, ...] = ()
    words: tuple[str, ...] = ()
    fix: str | Callable[[str, str | None, str], str] = ""

    def matches(self, error: BaseException, message: str) -> bool:
        return (isinstance(error, self.classes) or message.split(" ", 1)[0] in self.codes
                or any(word in message for word in self.words))


def _acl_fix(message: str, key: str | None, user: str) -> str:
    """The ACL rule a NOPERM (or a script's refused call) asks for, with the lock's own names."""
    named = re.search(r"User (\S+) has no permissions", message)
    namespace = key.partition(":{")[0] if key and ":{" in key else "<namespace>"
    lowered = message.lower()
    if "channel" in lowered:
        rule = f"&{namespace}:wake:*"  # Redis 7 users get no channels by default (acl-pubsub-default)
    elif "key" in lowered:
        rule = f"~{namespace}:*"
    else:
        command = re.search(r"run the '([^']+)' command", message)
        rule = f"+{command.group(1).lower()}" if command else LOCK_COMMANDS
    return (f"the ACL user lacks a right the lock needs: grant it with "
            f"`ACL SETUSER {named.group(1) if named else user} {rule}` (or in the ACL file)")


def _tls_fix(message: str, key: str | None, user: str) -> str:
    """What to change for a TLS failure seen through redis-py (the lean connection names its own fix)."""
    return fix_for(message) or ""


# First match wins. Misconfiguration first: redis-py makes a refused password (or certificate) a ConnectionError.
_RULES = (
    _Rule(MISCONFIGURED, (TlsMisconfigured,), words=TLS_WORDS, fix=_tls_fix),
    _Rule(MISCONFIGURED, words=("without any password configured", "no password is set"),
          fix="the server has no password but the URL gives one: remove it from the URL, or give the "
              "server one (requirepass)"),
    _Rule(MISCONFIGURED, codes=("NOAUTH",),
          words=("Authentication required", "unauthenticated", "must be called with the client already authenticated"),
          fix="the server requires a password: put it in the URL, redis://:PASSWORD@host:port/db "
              "(redis://USER:PASSWORD@host:port/db for an ACL user)"),
    _Rule(MISCONFIGURED, (AuthenticationError, AuthenticationWrongNumberOfArgsError, AuthorizationError),
          codes=("WRONGPASS",), words=("invalid password", "invalid username-password pair"),
          fix="the URL's user name or password is wrong, or the ACL user is disabled: check both "
              "against the server's ACL (ACL LIST)"),
    _Rule(MISCONFIGURED, (NoPermissionError,), codes=("NOPERM",),
          words=("no permissions to", "user executing the script can't"), fix=_acl_fix),
    _Rule(MISCONFIGURED, words=("DB index is out of range", "invalid DB index"),
          fix="the URL's database number is not below the server's `databases` setting (16 by "
              "default): use a lower one, or raise `databases`"),
    _Rule(MISCONFIGURED, words=("cluster support disabled",),
          fix="the server is not a Redis Cluster node: use a redis:// (or redis+sentinel://) URL for it"),
    _Rule(MISCONFIGURED, words=("unknown command",),
          fix="the server does not offer a command the lock needs (renamed or disabled by "
              "rename-command, or a server older than Redis 7.0)"),
    _Rule(UNAVAILABLE, words=("max number of clients reached",),
          fix="the server is at its maxclients limit: raise maxclients, or lower its clients' max_connections"),
    _Rule(UNAVAILABLE, (OutOfMemoryError,), codes=("OOM",), words=("used memory > 'maxmemory'",),
          fix="the server is out of memory (maxmemory, noeviction): free memory or raise maxmemory; keep the "
              "locks on a Redis of their own"),
    _Rule(UNAVAILABLE, (BusyLoadingError,), codes=("LOADING",),
          fix="the server is loading its data set after a restart"),
    _Rule(UNAVAILABLE, (ReadOnlyError,), codes=("READONLY",),
          fix="the server is a read-only replica: a failover is under way, or the URL names a replica "
              "instead of the master (or a redis+sentinel:// URL)"),
    _Rule(UNAVAILABLE, (MasterDownError,), codes=("MASTERDOWN",),
          fix="the replica has lost its master"),
    _Rule(UNAVAILABLE, (ClusterDownError, TryAgainError), codes=("CLUSTERDOWN", "TRYAGAIN"),
          fix="the cluster is failing over or resharding"),
    _Rule(UNAVAILABLE, codes=("MISCONF",),
          fix="the server cannot persist to disk and refuses writes (stop-writes-on-bgsave-error): check its disk"),
    _Rule(UNAVAILABLE, codes=("BUSY",), fix="a script is running too long on the server (busy-reply-threshold)"),
    _Rule(UNAVAILABLE, codes=("NOREPLICAS",), fix="too few replicas for min-replicas-to-write"),
    _Rule(UNAVAILABLE, (RedisConnectionError, RedisTimeoutError, OSError, RedisClusterException)),
)


def _text(error: BaseException) -> str:
    """The error as Redis wrote it: redis-py keeps the code ("LOADING", "NOPERM") apart from the message."""
    text, code = str(error), getattr(error, "status_code", None)
    return f"{code} {text}" if isinstance(code, str) and code and not text.startswith(code) else text


def _rule(error: BaseException) -> _Rule | None:
    text = _text(error)
    return next((rule for rule in _RULES if rule.matches(error, text)), None)


def error_type(error: BaseException) -> str:
    """`error.type` of a failed Redis call: redis_unavailable, redis_misconfigured or redis_error."""
    if isinstance(error, LockError):
        return (UNAVAILABLE if isinstance(error, RedisUnavailable)
                else MISCONFIGURED if isinstance(error, RedisMisconfigured) else ERROR)
    rule = _rule(error)
    return ERROR if rule is None else rule.kind


def is_unavailable(error: BaseException) -> bool:
    """Transient (the circuit breaker counts it as a failure); a misconfiguration is not."""
    return error_type(error) == UNAVAILABLE


_STATES: dict[str, tuple[type[LockError], str]] = {UNAVAILABLE: (RedisUnavailable, "is unavailable"), MISCONFIGURED: (RedisMisconfigured, "refused this client"),
           ERROR: (LockError, "answered with an error")}


def to_lock_error(error: BaseException, what: str, *, key: str | None = None, client: Any = None) -> LockError:
    """The LockError to raise for a failed Redis call: RedisUnavailable, RedisMisconfigured or LockError.

    `what` names the operation ("acquire of shop:{k}"), `client` the
    connection or redis-py client it went to (named by host:port, never
    with credentials). The message says what to fix when that is known.
    """
    if isinstance(error, LockError):
        return error
    rule = _rule(error)
    kind = ERROR if rule is None else rule.kind
    cls, state = _STATES[kind]
    where = "Redis" if client is None else f"Redis at {server_name(client)}"
    text = _text(error)
    message = f"{where} {state} ({what}): {type(error).__name__}: {text}".rstrip(": .")
    fix = getattr(error, "fix", None) if isinstance(error, TlsMisconfigured) else None
    if not fix:
        fix = "" if rule is None else rule.fix if isinstance(rule.fix, str) else rule.fix(text, key, user_name(client))
    return cls(f"{message}; {fix}" if fix else message, key=key)


def user_name(client: Any) -> str:
    """The ACL user a lean connection or a redis-py client logs in as ("default" without one)."""
    user = getattr(client, "username", None)
    if user is None:
        client = getattr(client, "_cluster", client)
        kw = getattr(getattr(client, "connection_pool", None), "connection_kwargs", None)
        if not isinstance(kw, dict) and callable(getattr(client, "get_connection_kwargs", None)):
            kw = client.get_connection_kwargs()  # a RedisCluster
        user = kw.get("username") if isinstance(kw, dict) else None
    return str(user) if user else "default"


def server_name(client: Any) -> str:
    """host:port of a lean connection or a redis-py client (a cluster's first nodes, a Sentinel service)."""
    server = getattr(client, "server", None)
    if isinstance(server, str):
        return server
    client = getattr(client, "_cluster", client)  # the lean connections routed over a cluster: name it
    pool = getattr(client, "connection_pool", None)
    service = getattr(pool, "service_name", None)
    if service is not None:
        return f"the master of Sentinel service {service!r}"
    kw = getattr(pool, "connection_kwargs", None)
    if isinstance(kw, dict):
        return str(kw.get("path") or f"{kw.get('host', '127.0.0.1')}:{kw.get('port', 6379)}")
    nodes = getattr(client, "startup_nodes", None)
    if nodes:
        names = [getattr(node, "name", str(node)) for node in list(nodes)[:3]]
        return "cluster " + ",".join(names) + (",..." if len(nodes) > 3 else "")
    return type(client).__name__
