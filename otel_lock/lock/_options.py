"""Checking what callers pass: durations, keys, manager options, and the option names people bring.

Everything is checked before anything is sent to Redis; a mistake is a
ValueError or TypeError that names it (and, for redis-py's and
python-redis-lock's option names, says which of ours to use instead).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from ..telemetry._bounds import key_name

MAX_KEY_LENGTH = 512
MIN_LEASE = 0.1
# Whole seconds whose milliseconds Lua's numbers hold exactly (2**53 ms); Redis refuses an expiry past
# 2**63 ms, which a lease of 1e16 s reaches, and a script that fails there has written half its work.
MAX_LEASE = 2**53 // 1000
# A longer wait is queued as one without deadline: its deadline in microseconds would not fit Lua's numbers,
# nor its queue's expiry Redis' (the waiter keeps its own deadline either way; 1e9 s is 31 years).
NO_DEADLINE_ABOVE = 1e9

# Option names other lock libraries use, and what to write here instead.
_THEIRS = {
    "timeout": "lease=<seconds> (how long the lock is held without renewal; redis-py's Lock calls it timeout), "
               "or socket_timeout=<seconds> for the Redis socket",
    "blocking_timeout": "wait=<seconds> (how long to wait for the lock)",
    "blocking": "try_lock(...) for blocking=False, or wait=<seconds>",
    "sleep": "nothing: waiters are woken on release, there is no polling interval to set",
    "expire": "lease=<seconds> (python-redis-lock's expire)",
    "auto_renewal": "lease=None (the default: the watchdog renews until release)",
    "thread_local": "nothing: holds belong to the task that acquired them",
    "raise_on_release_error": "nothing: release() returns False when the lock was no longer ours",
}


def unknown_argument(names: dict[str, Any] | list[str], where: str) -> str:
    """The message for keyword arguments `where` does not take."""
    listed = sorted(names)
    hints = [f"{n}=: use {_THEIRS[n]}" for n in listed if n in _THEIRS]
    text = f"{where} got unexpected keyword argument(s) {', '.join(map(repr, listed))}"
    return text + (" (" + "; ".join(hints) + ")" if hints else "")


def refuse_theirs(options: dict[str, Any], where: str) -> None:
    """Other libraries' lock option names, passed where redis-py client options go: a TypeError that maps them."""
    theirs = [name for name in options if name in _THEIRS]
    if theirs:
        raise TypeError(unknown_argument(theirs, where))


@lru_cache(maxsize=4096)
def default_name(key: str) -> str:
    """`lock.name` when none is given: the key's leading word or its id's shape, never the id (telemetry._bounds).

    Cached: it runs on every acquisition without a name (a few regular expressions each).
    """
    return key_name(key)


def check_seconds(what: str, value: float, *, allow_zero: bool, allow_inf: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{what} must be a number of seconds, not {value!r}")
    if math.isnan(value) or value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"{what} must be {'>= 0' if allow_zero else '> 0'} seconds, not {value!r}")
    if math.isinf(value) and not allow_inf:
        raise ValueError(f"{what} must be finite, not {value!r}")
    return float(value)


def check_expiry(what: str, given: object, seconds: float) -> float:
    """`seconds` if Redis can hold it as an expiry (at most MAX_LEASE), else ValueError naming `what`."""
    if seconds > MAX_LEASE:
        raise ValueError(f"{what} must be at most {MAX_LEASE} s (2**53 ms, what Redis' expiry times and Lua's "
                         f"numbers both hold), not {given!r}")
    return seconds


def check_key(key: object) -> None:
    """A lock key: a non-empty str, encodable, at most MAX_KEY_LENGTH, no hash-tag braces."""
    if not isinstance(key, str) or not key:
        raise ValueError(f"lock key must be a non-empty string, not {key!r}")
    if len(key) > MAX_KEY_LENGTH:
        raise ValueError(f"lock key is {len(key)} characters long; the limit is {MAX_KEY_LENGTH}")
    if "{" in key or "}" in key:
        raise ValueError(f"lock key {key!r} must not contain '{{' or '}}' (they delimit the Redis Cluster hash tag)")
    try:
        key.encode("utf-8")
    except UnicodeEncodeError as exc:  # a ValueError too; said before a byte is sent
        exc.add_note(f"lock key {key!r} cannot be encoded as UTF-8 (position {exc.start}): a lone surrogate, "
                     "from os.fsdecode() or undecodable input; decode bytes with errors='replace' or pass text")
        raise


def check_flag(what: str, value: object) -> bool:
    """A True/False option: anything else (the string "false", 0) is refused, not read for its truth."""
    if not isinstance(value, bool):
        raise TypeError(f"{what} must be True or False, not {value!r}")
    return value


def check_text(what: str, value: object) -> None:
    """A `name=` or `owner=`: a non-empty str that is UTF-8 text (Redis, metric labels and spans carry it)."""
    if not isinstance(value, str) or not value:
        raise ValueError(f"{what} must be a non-empty string, not {value!r}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        exc.add_note(f"{what} {value!r} cannot be encoded as UTF-8 (position {exc.start}): a lone surrogate, from "
                     "os.fsdecode() or undecodable input; decode bytes with errors='replace' or pass text")
        raise


@dataclass(frozen=True)
class ManagerOptions:
    """What every manager (single Redis or RedLock) checks the same way."""

    namespace: str = "otel-lock"
    lease: float = 30.0
    wait: float = 5.0
    cancel_on_lost: bool = False
    fence_ttl: float = 3600.0
    poll_cap: float = 0.5
    renew_interval: float = 10.0
    min_lease: float = 0.01
    min_lease_why: str = ""
    require_noeviction: bool = False  # refuse a server that may evict keys (docs/lock.md, "Servers")

    @classmethod
    def checked(cls, namespace: str, lease: float, renew_interval: float | None, wait: float, cancel_on_lost: bool,
                fence_ttl: float, poll_cap: float, require_noeviction: bool = False) -> ManagerOptions:
        if not isinstance(namespace, str) or not namespace or "{" in namespace or "}" in namespace:
            raise ValueError(f"namespace must be a non-empty string without '{{' or '}}', not {namespace!r}")
        lease_s = check_seconds("lease", lease, allow_zero=False)
        if lease_s < MIN_LEASE:
            raise ValueError(f"lease must be at least {MIN_LEASE} s, not {lease!r}")
        check_expiry("lease", lease, lease_s)
        every = lease_s / 3 if renew_interval is None else check_seconds("renew_interval", renew_interval,
                                                                         allow_zero=False)
        if every >= lease_s:
            raise ValueError(f"lease ({lease} s) must be longer than the renewal interval ({every} s)")
        return cls(namespace, lease_s, check_seconds("wait", wait, allow_zero=True, allow_inf=True),
                   check_flag("cancel_on_lost", cancel_on_lost),
                   check_expiry("fence_ttl", fence_ttl, check_seconds("fence_ttl", fence_ttl, allow_zero=False)),
                   check_seconds("poll_cap", poll_cap, allow_zero=False), every,
                   require_noeviction=check_flag("require_noeviction", require_noeviction))

    @property
    def fence_ttl_ms(self) -> int:
        return int(self.fence_ttl * 1000)

    def check_lease(self, lease: float | None) -> float:
        """A per-call lease (None: the manager's)."""
        if lease is None:
            return self.lease
        lease_s = check_seconds("lease", lease, allow_zero=False)
        if lease_s < self.min_lease:
            raise ValueError(f"lease must be at least {self.min_lease:g} s{self.min_lease_why}, not {lease!r}")
        return check_expiry("lease", lease, lease_s)


def check_breaker(failures: int, cooldown: float) -> tuple[int, float]:
    if isinstance(failures, bool) or not isinstance(failures, int) or failures < 0:
        raise ValueError(f"breaker_failures must be a whole number >= 0 (0 turns the breaker off), not {failures!r}")
    return failures, check_seconds("breaker_cooldown", cooldown, allow_zero=False)
