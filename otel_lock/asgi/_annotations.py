"""`@locked(...)`, `@limited(...)` and `@idempotent(...)`: route annotations read by LockMiddleware.

`@locked` names one key or several (templates, lists walked with `*`),
held exclusively or, for one key, shared; `@limited` caps the holders of one
key at `permits`. Both are a `Locked` (kind "locked": one per route), so
routing, key binding, fingerprints and OpenAPI treat them alike; `_shapes`
picks the manager call.

The decorator records itself in an attribute of the function and returns a
thin guard around it (`_guard`): placed below `@app.post`, the registered
handler then refuses to run without LockMiddleware instead of running
unlocked. Written above `@app.post`, the route already registered the bare
function: the decorator finds that route and makes it fail closed too (and
says so in a warning that names the fix). The same objects are the values
of `LockMiddleware(rules={...})`.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, TypeVar

from ..lock._options import MAX_LEASE, NO_DEADLINE_ABOVE, ManagerOptions, check_text
from ._attach import ATTR, attach
from ._keys import parse_template
from ._keyset import KeySet, check_one_wildcard
from .idempotency import Idempotent, idempotent

MIB = 1024 * 1024
__all__ = ["ATTR", "Idempotent", "Locked", "annotations_of", "idempotent", "limited", "locked"]
MAX_KEYS = 100        # the default bound on the distinct keys one request may name
# How a route's keys are held: one holder per key (one key or several), any number of shared
# holders (`shared=True`), or at most `permits` holders (`@limited`).
EXCLUSIVE, SHARED, PERMIT = "exclusive", "shared", "permit"
RELEASE_AFTER = ("app", "response")   # when the app call returns (default), or after the last body message
# A handler (function, method, HTTPEndpoint class or ASGI app): decorating returns it with its own type.
F = TypeVar("F", bound=Callable[..., Any])


def _check_seconds(what: str, value: float | None, *, allow_zero: bool, most: float | None = None) -> None:
    if value is None:
        return
    if not isinstance(value, (int, float)) or isinstance(value, bool) or value != value or value < 0 \
            or (value == 0 and not allow_zero):
        raise ValueError(f"{what} must be a {'non-negative' if allow_zero else 'positive'} number of seconds, got {value!r}")
    if most is not None and value > most:  # inf too: said here, not as a 500 on every request
        raise ValueError(f"{what} must be at most {most:.0f} s, got {value!r}")


SHORTEST_LEASE = ManagerOptions.min_lease


def _check_lease(lease: float | None) -> None:
    """What every manager takes (a RedLock quorum may ask for a longer minimum: its own check says so)."""
    _check_seconds("lease", lease, allow_zero=False, most=MAX_LEASE)
    if lease is not None and lease < SHORTEST_LEASE:
        raise ValueError(f"lease must be at least {SHORTEST_LEASE:g} s, got {lease!r}")


@dataclass(frozen=True)
class Locked:
    """What `locked(...)` and `limited(...)` return: a route's lock, as a decorator or a `rules=` value."""

    template: KeySet
    wait: float | None = None
    lease: float | None = None
    status: int = 409
    fail_open: bool = False
    hash_parts: bool = False
    name: str | None = None
    retry_after: float | None = None
    release_after: str = "app"
    max_body: int | None = None             # request body limit; None: the middleware's
    body_idle_timeout: float | None = None  # seconds without a body chunk; None: the middleware's
    after_auth: bool | None = None          # FastAPI: take the lock after the security dependencies; None: if any
    mode: str = EXCLUSIVE                   # exclusive, shared or permit (`lock.mode`)
    permits: int | None = None              # @limited: holders at once
    max_keys: int = MAX_KEYS                # distinct keys one request may name (several templates, `*`)

    kind: ClassVar[str] = "locked"

    @property
    def lock_name(self) -> str:
        """The metric/span label: the template(s) or an explicit name, never a concrete key."""
        return self.name or self.template.template

    @property
    def several(self) -> bool:
        """Taken with `lock_all()`: several templates, or a list walked with `*`."""
        return self.template.several

    @property
    def annotation(self) -> str:
        """How the user wrote it, for messages."""
        return "@limited" if self.mode == PERMIT else "@locked"

    def __call__(self, endpoint: F) -> F:
        return attach(endpoint, self.kind, self)


def locked(
    *templates: str, wait: float | None = None, lease: float | None = None, status: int = 409,
    fail_open: bool = False, hash_parts: bool = False, name: str | None = None, retry_after: float | None = None,
    release_after: str = "app", max_body: int | None = None, body_idle_timeout: float | None = None,
    after_auth: bool | None = None, shared: bool = False, max_keys: int = MAX_KEYS,
) -> Locked:
    """Take the lock(s) named by `templates` before the handler runs; release when the app call returns.

    Several templates (`"account:{json.from_id}", "account:{json.to_id}"`)
    or a list walked with `*` (`"stock:{json.items.*.sku}"`) name several
    keys: all are taken with the manager's `lock_all()` (one canonical
    order, all or nothing within `wait`), duplicates folded, at most
    `max_keys` per request (more: 422 `lock-keys-too-many`). `shared=True`
    (one key): any number of shared holders at once, beside no exclusive one.
    `release_after="response"` releases right after the last body message
    instead: background tasks and yield-dependency exit code then run unlocked.
    `max_body` (bytes) and `body_idle_timeout` (seconds without a body chunk)
    bound the body read before the lock; by default the middleware's.
    `after_auth` (FastAPI): take the lock after the route's security
    dependencies and before its other ones (None: when it has any; False:
    before every dependency; True: insist, failing the start-up without any).
    """
    keys = _key_set("locked", templates)
    check_flags(shared=shared, fail_open=fail_open, hash_parts=hash_parts)
    if shared and keys.several:
        raise ValueError(f"locked({keys.template!r}, shared=True): a shared lock is on one key; several "
                         f"templates or a '*' list name several (take them exclusively, or one shared key)")
    if not isinstance(max_keys, int) or isinstance(max_keys, bool) or max_keys < 1:
        raise ValueError(f"max_keys must be a positive number of keys, got {max_keys!r}")
    _check_common(wait, lease, retry_after, body_idle_timeout, max_body, status, name, release_after, after_auth)
    return Locked(keys, wait=wait, lease=lease, status=status, fail_open=fail_open, hash_parts=hash_parts,
                  name=name, retry_after=retry_after, release_after=release_after, max_body=max_body,
                  body_idle_timeout=None if body_idle_timeout is None else float(body_idle_timeout),
                  after_auth=after_auth, mode=SHARED if shared else EXCLUSIVE, max_keys=max_keys)


def limited(
    template: str, *, permits: int, wait: float | None = None, lease: float | None = None, status: int = 429,
    fail_open: bool = False, hash_parts: bool = False, name: str | None = None, retry_after: float | None = None,
    release_after: str = "app", max_body: int | None = None, body_idle_timeout: float | None = None,
    after_auth: bool | None = None,
) -> Locked:
    """At most `permits` requests per key run the handler at once (the manager's `semaphore()`).

    A request that gets no permit within `wait` is answered 429
    `concurrency-limit` with Retry-After (`status` changes the code). The
    other options are `locked`'s.
    """
    keys = _key_set("limited", (template,))
    if keys.several:
        raise ValueError(f"limited({template!r}): a limit is on one key; '*' names several")
    if not isinstance(permits, int) or isinstance(permits, bool) or permits < 1:
        raise ValueError(f"permits must be a positive number of holders, got {permits!r}")
    check_flags(fail_open=fail_open, hash_parts=hash_parts)
    _check_common(wait, lease, retry_after, body_idle_timeout, max_body, status, name, release_after, after_auth)
    return Locked(keys, wait=wait, lease=lease, status=status, fail_open=fail_open, hash_parts=hash_parts,
                  name=name, retry_after=retry_after, release_after=release_after, max_body=max_body,
                  body_idle_timeout=None if body_idle_timeout is None else float(body_idle_timeout),
                  after_auth=after_auth, mode=PERMIT, permits=permits, max_keys=1)


def _key_set(what: str, templates: tuple[str, ...]) -> KeySet:
    if not templates:
        raise ValueError(f"{what}() needs a lock key template, e.g. {what}(\"stock:{{path.product_id}}\")")
    parsed = tuple(parse_template(t) for t in templates)
    for template in parsed:
        check_one_wildcard(template)
    return KeySet(parsed)


def check_flags(**flags: object) -> None:
    """True/False options: a string such as "false" would be read as true (fail_open: the handler unlocked)."""
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise ValueError(f"{name} must be True or False, got {value!r}")


def _check_common(wait: float | None, lease: float | None, retry_after: float | None, body_idle_timeout: float | None,
                  max_body: int | None, status: int, name: str | None, release_after: str,
                  after_auth: bool | None) -> None:
    _check_seconds("wait", wait, allow_zero=True)
    _check_lease(lease)
    _check_seconds("retry_after", retry_after, allow_zero=True, most=NO_DEADLINE_ABOVE)
    _check_seconds("body_idle_timeout", body_idle_timeout, allow_zero=False)
    if max_body is not None and (not isinstance(max_body, int) or isinstance(max_body, bool) or max_body < 0):
        raise ValueError(f"max_body must be a non-negative number of bytes, got {max_body!r}")
    if not isinstance(status, int) or not 400 <= status <= 599:
        raise ValueError(f"status must be a 4xx or 5xx code, got {status!r}")
    if name is not None:
        check_text("name", name)
    if release_after not in RELEASE_AFTER:
        raise ValueError(f"release_after must be one of {', '.join(map(repr, RELEASE_AFTER))}, got {release_after!r}")
    if after_auth is not None and not isinstance(after_auth, bool):
        raise ValueError(f"after_auth must be True, False or None, got {after_auth!r}")


def annotations_of(endpoint: Any, method: str | None = None) -> dict[str, Any]:
    """Annotations of an endpoint: an HTTPEndpoint's method (then class), following `__wrapped__`."""
    found: dict[str, Any] = {}
    targets: list[Any] = []
    if inspect.isclass(endpoint) and method:
        handler = getattr(endpoint, method.lower(), None)
        if handler is None and method.upper() == "HEAD":
            handler = getattr(endpoint, "get", None)
        targets.append(handler)
    targets.append(endpoint)
    for target in targets:
        seen = 0
        while target is not None and seen < 32:  # a bound on pathological __wrapped__ cycles
            for kind, annotation in (getattr(target, ATTR, None) or {}).items():
                found.setdefault(kind, annotation)
            # functools.wraps-style wrappers, then functools.partial
            target = getattr(target, "__wrapped__", None) or getattr(target, "func", None)
            seen += 1
    return found
