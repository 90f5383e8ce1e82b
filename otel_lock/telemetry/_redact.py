"""One switch that keeps concrete lock keys and owners out of spans.

A lock key is built from request data (`order:user:alice-secret-42`) and an
explicit owner is often a user or job id; both end up as span attributes.
`OTEL_LOCK_REDACT` (or `setup(redact=...)`, or `configure_redaction()`) picks:

- ``off`` (default): spans carry them as they are;
- ``hash``: each becomes ``h:`` + 24 hex digits of an HMAC-SHA256, keyed by
  ``OTEL_LOCK_HASH_SECRET`` when set. The same key hashes the same on every
  replica, so one key's holders and waiters can still be found together;
- ``drop``: the attributes are removed.

Metrics never carry them in any mode (they use `lock.name`, the template).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
from functools import lru_cache
from typing import TYPE_CHECKING, Mapping

if TYPE_CHECKING:
    from opentelemetry.util.types import AttributeValue

ENV = "OTEL_LOCK_REDACT"
SECRET_ENV = "OTEL_LOCK_HASH_SECRET"
MODES = ("off", "hash", "drop")
REDACTED = ("lock.key", "lock.owner")
_PREFIX = "h:"
_DIGITS = 24


def _parse(value: str | None, source: str) -> str:
    mode = (value or "off").strip().lower()
    if mode in ("", "0", "false", "no"):
        return "off"
    if mode in ("1", "true", "yes", "on"):
        return "hash"
    if mode not in MODES:
        raise ValueError(f"{source} must be one of {', '.join(MODES)}, not {value!r}")
    return mode


_mode = "off"
_secret = b""


def configure_redaction(mode: str | None = None, secret: str | bytes | None = None) -> str:
    """Set the mode (None: read $OTEL_LOCK_REDACT) and the HMAC secret (None: $OTEL_LOCK_HASH_SECRET)."""
    global _mode, _secret
    _mode = _parse(os.environ.get(ENV) if mode is None else mode, ENV if mode is None else "redact")
    if secret is None:
        secret = os.environ.get(SECRET_ENV, "otel-lock:redact")
    _secret = secret.encode() if isinstance(secret, str) else bytes(secret)
    _hash.cache_clear()
    return _mode


def redaction_mode() -> str:
    return _mode


@lru_cache(maxsize=4096)
def _hash(value: str) -> str:
    if value.startswith(_PREFIX) and len(value) == len(_PREFIX) + _DIGITS:
        return value  # already hashed: applying the switch twice changes nothing
    digest = hmac.new(_secret, value.encode("utf-8", "surrogatepass"), hashlib.sha256).hexdigest()
    return _PREFIX + digest[:_DIGITS]


def redact(attributes: Mapping[str, AttributeValue]) -> Mapping[str, AttributeValue]:
    """A copy without raw keys and owners (the same dict when redaction is off or nothing matches)."""
    if _mode == "off" or not any(name in attributes for name in REDACTED):
        return attributes
    out = dict(attributes)
    for name in REDACTED:
        if name in out:
            if _mode == "drop":
                del out[name]
            else:
                out[name] = _hash(str(out[name]))
    return out


try:
    configure_redaction()
except ValueError as error:
    # A typo in the environment must neither stop the import nor leak keys: hash.
    logging.getLogger("otel_lock.telemetry").warning("otel-lock: %s; using 'hash'", error)
    configure_redaction("hash")
