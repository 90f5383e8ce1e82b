"""Checking what callers pass: durations, keys, manager options; the small helpers they share."""

from __future__ import annotations

import math

MAX_KEY_LENGTH = 512
MIN_LEASE = 0.1
_MANAGER_OPTIONS = (
    "namespace", "lease", "wait", "cancel_on_lost", "fence_ttl", "poll_cap",
    "renew_interval", "tracer_provider", "meter_provider", "wait_replicas", "wait_replicas_timeout",
)


def _text(value: bytes | str | None) -> str:
    return value.decode() if isinstance(value, bytes) else (value or "")


def default_name(key: str) -> str:
    """`lock.name` when none is given: the key up to its first ':', so ids stay off metrics."""
    return key.split(":", 1)[0]


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
