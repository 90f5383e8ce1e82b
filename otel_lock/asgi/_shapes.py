"""Which manager call holds a route's keys: the one place that maps an annotation to a lock shape.

    @locked("k:{...}")                     manager.lock(key)
    @locked("a:{...}", "b:{...}")          manager.lock_all(keys)      (also one `*` template: a list's keys)
    @locked("k:{...}", shared=True)        manager.lock(key, shared=True)
    @limited("k:{...}", permits=N)         manager.semaphore(key, permits=N)

A manager without the call a route needs (an older or a third-party one)
fails the start-up naming the method, never the first request. A request
whose `lock_all()` keys are none at all (an empty list) holds nothing: the
handler gets an empty `HeldLocks` (`tokens == {}`), so it reads one shape.
"""

from __future__ import annotations

from contextlib import AbstractAsyncContextManager, nullcontext
from typing import TYPE_CHECKING, Any, cast

from ..lock import HeldLocks

if TYPE_CHECKING:
    from ..lock import Locks
    from ._annotations import Locked


def method_of(rule: Locked) -> str:
    """The manager method that holds this rule's keys."""
    if rule.mode == "permit":
        return "semaphore"
    if rule.several:
        return "lock_all"
    return "lock"


def missing_method(manager: Locks | None, rule: Locked) -> str | None:
    """Why `manager` cannot hold this rule's keys (a start-up error), or None."""
    method = method_of(rule)
    if manager is None:
        return None
    if not callable(getattr(manager, method, None)):
        return (f"{rule.annotation}({rule.template.template!r}) needs the lock manager's {method}(), which "
                f"{type(manager).__name__} does not have: use otel_lock's LockManager (or RedLockManager) of a "
                f"version with it")
    # A quorum of masters (RedLockManager) holds one exclusive owner per round, and a grant confirmed by
    # WAIT (wait_replicas) is one owner's: their calls would refuse each request; the start-up refuses the
    # route instead.
    ask = getattr(manager, "unsupported_reason", None)
    why = ask(rule.mode) if callable(ask) else None
    if rule.mode != "exclusive" and why is not None:
        what = "semaphore()" if rule.mode == "permit" else "lock(shared=True)"
        return (f"{rule.annotation}({rule.template.template!r}) needs the lock manager's {what}, which "
                f"{type(manager).__name__} does not offer ({why}): use a LockManager without wait_replicas for "
                f"this route, or an exclusive @locked")
    return None


def holding(manager: Locks, rule: Locked, keys: tuple[str, ...], *,
            cancel_on_lost: bool) -> AbstractAsyncContextManager[Any]:
    """`async with holding(...) as held:` the rule's keys, its way."""
    options: dict[str, Any] = {"wait": rule.wait, "lease": rule.lease, "name": rule.lock_name,
                               "cancel_on_lost": cancel_on_lost}
    method = method_of(rule)
    call: Any = getattr(manager, method, None)
    if call is None:
        raise TypeError(missing_method(manager, rule))
    if method == "lock_all" and not keys:
        return nullcontext(HeldLocks([], []))
    if method == "lock_all":
        made = call(list(keys), **options)
    elif method == "semaphore":
        made = call(keys[0], permits=rule.permits, **options)
    elif rule.mode == "shared":
        made = call(keys[0], shared=True, **options)
    else:
        made = call(keys[0], **options)
    return cast("AbstractAsyncContextManager[Any]", made)
