"""The two quorum rounds of a RedLock hold: the grant (ACQUIRE, then CONFIRM) and the renewal.

Both send to every master at once and count answers against the quorum;
the manager (`_redlock.py`) times validity and decides what a failed round
means for the caller.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from . import _redlock_scripts as scripts
from ._errors import LockError
from ._held import Lease

if TYPE_CHECKING:
    from ._redlock import RedLockManager


class Round:
    """What one acquire round found: the token if granted, else why not."""

    def __init__(self) -> None:
        self.token = 0
        self.answered = 0            # masters that answered (granted or busy)
        self.silent: list[int] = []  # masters that did not answer the ACQUIRE (down, slow, refused)
        self.ttl = 0.0               # smallest TTL seen on a busy master, seconds
        self.error: LockError | None = None


async def grant(manager: RedLockManager, keys: tuple[str, str], owner: str, lease_ms: int, name: str,
                found: Round) -> bool:
    """ACQUIRE everywhere, then CONFIRM the maximum token on the masters that granted."""
    masters, quorum = manager.masters, manager.quorum
    answers = await masters.call(scripts.acquire, keys, [owner, lease_ms, manager.fence_ttl_ms], "acquire", name)
    granted, ttls = [], []
    for i, answer in enumerate(answers):
        if isinstance(answer, LockError):
            found.error = answer
            found.silent.append(i)
            continue
        found.answered += 1
        if answer[0] == 1:
            granted.append((i, int(answer[1])))
        else:
            ttls.append(max(int(answer[1]), 0) / 1000)
    if ttls:  # the next poll comes no later than the first holder's key runs out
        found.ttl = min(ttls)
    if len(granted) < quorum:
        return False
    token = max(t for _, t in granted)
    confirmed = await masters.call(scripts.confirm, keys, [owner, lease_ms, manager.fence_ttl_ms, str(token), "0"],
                                   "acquire", name, only=[i for i, _ in granted])
    if sum(1 for c in confirmed if c == 1) < quorum:
        return False
    found.token = token
    return True


async def keep(manager: RedLockManager, hold: Lease) -> None:
    """Renew a `lease=None` hold every `renew_every`; tell the holder once no quorum confirmed it in time.

    A fixed lease is only watched: `held.lost` is set when it runs out.
    """
    loop = asyncio.get_running_loop()
    keys = manager._keys(hold.lock_key)
    telemetry = manager.telemetry
    while not _over(hold):
        wake = min(hold.renew_at, hold.expires_at)
        await asyncio.sleep(max(0.0, wake - loop.time()))
        if _over(hold):
            return
        hold.check_validity()
        if hold.lost_reason or not hold.renew:
            continue
        sent_at = loop.time()
        renew = asyncio.ensure_future(manager.masters.call(
            scripts.confirm, keys, [hold.owner, hold.renew_ms, manager.fence_ttl_ms, str(hold.token), "1"],
            "renew", hold.name))
        manager._renewing[hold] = renew
        try:
            done, _ = await asyncio.wait({renew}, timeout=max(0.0, hold.expires_at - loop.time()))
            if not done:  # the expiry comes first: tell the holder now, not after the round
                hold.check_validity()
                await renew
        finally:
            manager._renewing.pop(hold, None)
        answers = renew.result()
        ours = sum(1 for a in answers if a == 1)
        others = sum(1 for a in answers if a == 0)
        if _ended(hold):
            return
        if ours >= manager.quorum and not hold.lost_reason:
            hold.confirmed(sent_at)
            telemetry.renewals.add(1, {"lock.name": hold.name, "lock.renewal.outcome": "ok"})
        elif others > len(answers) - manager.quorum:
            manager._lose(hold, f"{others} of {len(answers)} masters no longer hold it for this owner")
        else:
            telemetry.renewals.add(1, {"lock.name": hold.name, "lock.renewal.outcome": "error"})
            hold.renew_at = loop.time() + min(hold.renew_every, max(0.05, (hold.expires_at - loop.time()) / 3))
    if hold.lost_reason and not hold.ended:
        # stop blocking the others: the hold is no longer ours anyway
        await manager._release_all(keys, hold.owner, hold.name, hold.lease_seconds)


def _over(hold: Lease) -> bool:
    """Ended or lost (functions, so that type checkers do not narrow the flags across awaits)."""
    return hold.ended or bool(hold.lost_reason)


def _ended(hold: Lease) -> bool:
    return hold.ended
