"""Cardinality bounded by construction: lock names from keys, and a hard limit per instrument.

Two layers, so no key shape and no caller can flood a metric or a span name:

- `key_name(key)` is the `lock.name` of a lock taken without `name=`: the
  key's leading word (`stock:1001`, `product-1001`, `stock/1001`,
  `stock_1001`, `sku1001` -> `stock`, `product`, ..., `sku`), or the shape of
  an id that has no word in front of it (`1001` -> `{number}`, a uuid ->
  `{uuid}`, an e-mail address -> `{email}`, a hex digest -> `{hex}`,
  anything else -> `{key}`). Never the id itself.
- `ValueLimit`: at most `limit` distinct values of one attribute on one
  instrument (`OTEL_LOCK_NAME_LIMIT`, default 100). Later values fold into
  `OVERFLOW`, with one warning per instrument and attribute, so an app that
  passes ids as explicit names still gets a flat series count, and the
  other attributes (outcome, error type) keep their meaning in the overflow
  series. Both recording paths, the observed gauges and span names use it.
"""

from __future__ import annotations

import logging
import os
import re
import threading
from functools import lru_cache
from typing import Iterable

log = logging.getLogger("otel_lock.telemetry")

OVERFLOW = "_overflow"
LIMIT_ENV = "OTEL_LOCK_NAME_LIMIT"
DEFAULT_LIMIT = 100
MAX_WORD = 64

_UUID = re.compile(r"[0-9a-fA-F]{8}-?[0-9a-fA-F]{4}-?[0-9a-fA-F]{4}-?[0-9a-fA-F]{4}-?[0-9a-fA-F]{12}(?![0-9a-zA-Z])")
_HEX = re.compile(r"(?=[0-9a-fA-F]*[0-9])(?=[0-9a-fA-F]*[a-fA-F])[0-9a-fA-F]{8,}(?![0-9a-zA-Z])")
_NUMBER = re.compile(r"[0-9]")
_WORD = re.compile(r"[^\W\d_]+")  # letters of any script, no digits, no underscore
_SEGMENT_END = re.compile(r"[:/]")


@lru_cache(maxsize=4096)
def key_name(key: str) -> str:
    """A bounded `lock.name` for a raw key: its leading word, or the shape of the id it starts with."""
    if _UUID.match(key):
        return "{uuid}"
    if "@" in key and "@" in _SEGMENT_END.split(key, 1)[0]:
        return "{email}"
    if _HEX.match(key):
        return "{hex}"
    if _NUMBER.match(key):
        return "{number}"
    word = _WORD.match(key)
    if word is None or len(word.group()) > MAX_WORD:
        return "{key}"
    return word.group()


def configured_limit() -> int:
    """`OTEL_LOCK_NAME_LIMIT`: distinct values per attribute and instrument (a bad value warns, default kept)."""
    value = os.environ.get(LIMIT_ENV, "").strip()
    if not value:
        return DEFAULT_LIMIT
    try:
        limit = int(value)
        if limit < 1:
            raise ValueError
    except ValueError:
        log.warning("otel-lock: %s=%r is not a whole number >= 1; using %d", LIMIT_ENV, value, DEFAULT_LIMIT)
        return DEFAULT_LIMIT
    return limit


class ValueLimit:
    """The first `limit` distinct values of one attribute pass; later ones become `OVERFLOW` (warned once)."""

    __slots__ = ("what", "limit", "_seen", "_warned", "_lock")

    def __init__(self, what: str, limit: int | None = None) -> None:
        self.what = what
        self.limit = configured_limit() if limit is None else limit
        self._seen: set[str] = set()
        self._warned = False
        self._lock = threading.Lock()

    def admit(self, value: str) -> str:
        if value in self._seen:
            return value
        with self._lock:
            if value in self._seen or len(self._seen) < self.limit:
                self._seen.add(value)
                return value
            warn, self._warned = not self._warned, True
        if warn:
            # The value's shape only (key_name): an explicit name may carry an id or an address.
            log.warning(
                "otel-lock: %s has %d distinct values, its limit (%s); every further new value (the first "
                "looks like %r) is recorded as %r. Give locks a template or an explicit name without ids "
                "(`name=`), or raise %s.", self.what, self.limit, LIMIT_ENV, key_name(value), OVERFLOW, LIMIT_ENV)
        return OVERFLOW


class Limits:
    """One `ValueLimit` per attribute of one instrument, for the attributes it declares."""

    __slots__ = ("instrument", "_by_attribute")

    def __init__(self, instrument: str, attributes: Iterable[str]) -> None:
        self.instrument = instrument
        self._by_attribute = {name: ValueLimit(f"{name} on {instrument}") for name in attributes}

    def admit(self, attribute: str, value: str) -> str | None:
        """The value to record (`OVERFLOW` past the limit), or None for an attribute the instrument lacks."""
        limit = self._by_attribute.get(attribute)
        return None if limit is None else limit.admit(value)

