"""Checking what callers pass: durations, keys, manager options; the small helpers they share."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from ._breaker import Breaker

if TYPE_CHECKING:
    from ..telemetry._instruments import LockCounts, Telemetry

MAX_KEY_LENGTH = 512
MIN_LEASE = 0.1
_MANAGER_OPTIONS = (
    "namespace", "lease", "wait", "cancel_on_lost", "fence_ttl", "poll_cap",
    "renew_interval", "tracer_provider", "meter_provider", "wait_replicas", "wait_replicas_timeout",
    "breaker_failures", "breaker_cooldown",
)


def _text(value: bytes | str | None) -> str:
    return value.decode() if isinstance(value, bytes) else (value or "")


def default_name(key: str) -> str:
    """`lock.name` when none is given: the key's leading word or its id's shape, never the id (telemetry._bounds)."""
    from ..telemetry._bounds import key_name

    return key_name(key)


def _check_seconds(what: str, value: float, *, allow_zero: bool, allow_inf: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{what} must be a number of seconds, not {value!r}")
    if math.isnan(value) or value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"{what} must be {'>= 0' if allow_zero else '> 0'} seconds, not {value!r}")
    if math.isinf(value) and not allow_inf:
        raise ValueError(f"{what} must be finite, not {value!r}")
    return float(value)


def _glob_escape(text: str) -> str:
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


class CommonOptions:
    """What every manager (single Redis or RedLock) checks the same way."""

    namespace: str
    lease: float
    renew_interval: float
    wait: float
    cancel_on_lost: bool
    fence_ttl_ms: int
    poll_cap: float
    breaker_failures: int
    breaker_cooldown: float

    def _set_common_options(self, namespace: str, lease: float, renew_interval: float | None, wait: float,
                            cancel_on_lost: bool, fence_ttl: float, poll_cap: float) -> None:
        if not isinstance(namespace, str) or not namespace or "{" in namespace or "}" in namespace:
            raise ValueError(f"namespace must be a non-empty string without '{{' or '}}', not {namespace!r}")
        self.namespace = namespace
        self.lease = _check_seconds("lease", lease, allow_zero=False)
        if self.lease < MIN_LEASE:
            raise ValueError(f"lease must be at least {MIN_LEASE} s, not {lease!r}")
        self.renew_interval = self.lease / 3 if renew_interval is None else _check_seconds(
            "renew_interval", renew_interval, allow_zero=False)
        if self.renew_interval >= self.lease:
            raise ValueError(f"lease ({lease} s) must be longer than the renewal interval ({self.renew_interval} s)")
        self.wait = _check_seconds("wait", wait, allow_zero=True, allow_inf=True)
        self.cancel_on_lost = bool(cancel_on_lost)
        self.fence_ttl_ms = int(_check_seconds("fence_ttl", fence_ttl, allow_zero=False) * 1000)
        self.poll_cap = _check_seconds("poll_cap", poll_cap, allow_zero=False)

    def _set_breaker(self, failures: int, cooldown: float, telemetry: Telemetry, counts: LockCounts) -> Breaker:
        """The circuit breaker of `_breaker.py`, seen in otel_lock.circuit.state / .opened under the namespace."""
        if isinstance(failures, bool) or not isinstance(failures, int) or failures < 0:
            raise ValueError(f"breaker_failures must be a whole number >= 0 (0 turns the breaker off), "
                             f"not {failures!r}")
        self.breaker_failures = failures
        self.breaker_cooldown = _check_seconds("breaker_cooldown", cooldown, allow_zero=False)
        pool = {"db.client.connection.pool.name": self.namespace}

        def opened() -> None:
            telemetry.circuit_opened.add(1, pool)
        breaker = Breaker(failures, self.breaker_cooldown, on_open=opened)
        counts.watch_circuit(breaker.state, self.namespace)
        return breaker
