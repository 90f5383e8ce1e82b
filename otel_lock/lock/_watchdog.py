"""One renewal loop per manager and event loop: batched lease renewals and lost-lease detection.

Every lease with `lease=None` is renewed every lease/3. All leases that are
at least half-way to their renewal time go out together in one batch (one
round trip per node), so 10,000 held locks cost a few round trips per tick,
not 10,000 tasks. A lease is lost when Redis says the owner changed, or when
no renewal confirmed it before `expires_at` (monotonic clock, minus drift);
a fixed lease is watched the same way, so its expiry under a live holder is
told (and counted) the moment it happens.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import TYPE_CHECKING

from ._held import NEVER, Lease

if TYPE_CHECKING:
    from ._ending import HoldEnds
    from ._transport import Transport

log = logging.getLogger("otel_lock")

RETRY_AFTER_ERROR = 0.5


class Watchdog:
    def __init__(self, transport: Transport, ends: HoldEnds) -> None:
        self._transport = transport
        self._ends = ends
        self._leases: set[Lease] = set()
        self._changed = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._wake_at = NEVER
        self._timer: asyncio.TimerHandle | None = None

    def add(self, lease: Lease) -> None:
        self._leases.add(lease)
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run(), name="otel-lock watchdog")
        else:
            # due before the loop's next wake-up: wake it then (a timer, not a wake-up now:
            # taking a lock costs no turn of the watchdog)
            self._wake_by(min(lease.renew_at, lease.expires_at))

    def _wake_by(self, when: float) -> None:
        if when >= self._wake_at:
            return
        if self._timer is not None:
            self._timer.cancel()
        self._wake_at = when
        self._timer = asyncio.get_running_loop().call_at(when, self._changed.set)

    def discard(self, lease: Lease) -> None:
        self._leases.discard(lease)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            now = loop.time()
            for lease in [l for l in self._leases if l.expires_at <= now]:
                self._leases.discard(lease)
                lease.check_validity()
            due = [l for l in self._leases if l.renew_at - l.renew_every / 2 <= now]
            if any(l.renew_at <= now for l in due):
                await self._renew(due)
                continue
            # Sleeping with nothing held costs nothing; an earlier deadline wakes us.
            self._changed.clear()
            self._wake_at = NEVER
            self._wake_by(min((min(l.renew_at, l.expires_at) for l in self._leases), default=NEVER))
            await self._changed.wait()
            self._wake_at = NEVER

    async def _renew(self, leases: list[Lease]) -> None:
        loop = asyncio.get_running_loop()
        sent_at = loop.time()
        batch = asyncio.ensure_future(self._transport.renew(leases))
        for lease in leases:
            lease.renewing = batch  # a release waits for it (a renewal must not land after the release)
        try:
            results = await asyncio.shield(batch)
        finally:
            for lease in leases:
                if lease.renewing is batch:
                    lease.renewing = None
        for lease, result in zip(leases, results):
            if lease not in self._leases:
                continue  # released while the renewal was in flight
            if isinstance(result, BaseException):
                # retry soon, and well before the lease runs out even with a short lease
                lease.renew_at = min(lease.expires_at, sent_at + min(RETRY_AFTER_ERROR, lease.renew_every / 2))
                self._ends.renewed(lease, "error", result)
            elif not result:
                self._leases.discard(lease)
                self._ends.lose(lease, "the lease was taken over or expired")
            else:
                lease.confirmed(sent_at)
                self._ends.renewed(lease, "ok")

    async def aclose(self) -> None:
        """Stop renewing; a lease still held is told lost when it runs out, as if this loop had kept watching it.

        Its holder may run on after the manager closed (a shutdown that did not
        wait for it): nothing renews it, so it must not believe it still holds.
        """
        if self._timer is not None:
            self._timer.cancel()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
            self._task = None
        loop = asyncio.get_running_loop()
        for lease in self._leases:
            if lease.expires_at < NEVER:
                loop.call_at(lease.expires_at + 0.001, lease.check_validity)  # never a hair early
        self._leases.clear()
