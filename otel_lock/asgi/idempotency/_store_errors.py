"""What a Redis error of the record store means: wait and retry (503), or fix the set-up (500).

Which it is, is the lock's decision (`lock._errors.error_type`), the one
classifier of the package: one Redis state (MISCONF, NOREPLICAS, BUSY, a
wrong password) answers the same from a locked route and from an idempotent
one, whichever of the lock and the record store meets it first. This module
only words the fix for the record store (its URL, its ACL rule) and wraps
the error in the store's own classes, which the gate answers as
problem+json, never as a bare 500.
"""

from __future__ import annotations

from typing import Awaitable, Callable, TypeVar

from redis.exceptions import AuthenticationError, AuthenticationWrongNumberOfArgsError, NoPermissionError, RedisError

from ...lock import RedisMisconfigured, RedisUnavailable
from ...lock._errors import MISCONFIGURED, UNAVAILABLE, error_type, to_lock_error

WHERE = "the idempotency record store"


class RecordStoreUnavailable(RedisUnavailable):
    """The record store cannot serve right now (503 + Retry-After)."""


class RecordStoreMisconfigured(RedisMisconfigured):
    """The record store refuses this client for good; the message says what to fix (500)."""


_NEEDS_PASSWORD = "requires a password: put it in the record store's URL (redis://:PASSWORD@host/db) or client"
_NO_PASSWORD = "has no password set, but one was sent: remove it from the record store's URL or client"
_WRONG_PASSWORD = "refused the user name or password: fix them in the record store's URL or client"
_ACL = ("denies this user a command or key it needs: allow it "
        "'+@read +@write +@scripting +info ~<namespace>:idem:*' (an ACL rule) on the record store")
# Words of a reply that name a permanent refusal, and what to fix.
_PERMANENT_TEXT = (
    ("authentication required", _NEEDS_PASSWORD),
    ("protocol error: unauthenticated", _NEEDS_PASSWORD),
    ("no password is set", _NO_PASSWORD),
    ("without any password configured", _NO_PASSWORD),
    ("invalid username-password", _WRONG_PASSWORD),
    ("invalid password", _WRONG_PASSWORD),
    ("db index is out of range", "has no such database number: fix the /db part of the record store's URL"),
)


def translate(error: BaseException) -> RecordStoreUnavailable | RecordStoreMisconfigured | None:
    """The core's error for a redis-py (or socket) error; None if it is not one."""
    if not isinstance(error, (RedisError, OSError)):
        return None
    text = _first_line(str(error))
    said = f"(Redis said: {text or type(error).__name__})"
    lowered = text.lower()
    kind = error_type(error)   # the lock's classifier; the wording below is the record store's own
    if kind == UNAVAILABLE:
        return RecordStoreUnavailable(f"{WHERE}: {to_lock_error(error, 'a call of the record store')}")
    for words, fix in _PERMANENT_TEXT:
        if words in lowered:
            return RecordStoreMisconfigured(f"{WHERE} {fix} {said}")
    if isinstance(error, (AuthenticationError, AuthenticationWrongNumberOfArgsError)):
        return RecordStoreMisconfigured(f"{WHERE} refused authentication: check the user and password of its URL {said}")
    if isinstance(error, NoPermissionError) or lowered.startswith("noperm"):
        return RecordStoreMisconfigured(f"{WHERE} {_ACL} {said}")
    if kind == MISCONFIGURED:
        return RecordStoreMisconfigured(f"{WHERE}: {to_lock_error(error, 'a call of the record store')}")
    # Anything else is a reply no retry will change (a proxy without scripting, a module
    # shadowing a command): name it, as a misconfiguration.
    return RecordStoreMisconfigured(f"{WHERE} answered with an unexpected error {said}")


def _first_line(text: str) -> str:
    text = text.strip()
    return text.splitlines()[0][:200] if text else ""


T = TypeVar("T")


async def translated(call: Callable[[], Awaitable[T]]) -> T:
    """Run one Redis call of the record store; its errors as the store's own (`translate`)."""
    try:
        return await call()
    except Exception as error:
        mapped = translate(error)
        if mapped is None:
            raise
        raise mapped from error
