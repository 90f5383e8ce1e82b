"""A circuit breaker: stop sending new acquisitions to a Redis that keeps failing.

Without it, every request against a dead or frozen Redis holds a pooled
connection for a socket timeout and leaves clean-up behind; a burst piles
up and outlives the outage. After `failures` consecutive "Redis
unavailable" errors the circuit opens: new acquisitions fail at once with
RedisUnavailable (with `retry_after`) and touch no socket. After the
cool-down, one acquisition goes through as a probe (half-open). Any Redis
answer closes the circuit; a failed probe re-opens it with twice the
cool-down, up to MAX_COOLDOWN.

Only acquisitions are refused. Releases, queue leaves, renewals and
clean-ups always go through (a holder can always let go, and a recovered
Redis frees released locks at once); their answers still feed the breaker,
so the first one that succeeds closes it.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Coroutine, TypeVar

from ._errors import RedisUnavailable

if TYPE_CHECKING:
    from ..telemetry._instruments import LockCounts, Telemetry

log = logging.getLogger("otel_lock")

CLOSED, OPEN, HALF_OPEN = 0, 1, 2   # the values of the otel_lock.circuit.state gauge
MAX_COOLDOWN = 30.0
T = TypeVar("T")


def _nothing() -> None:
    pass


class Breaker:
    """One manager's circuit; `failures=0` turns it off."""

    def __init__(self, failures: int, cooldown: float, *, on_open: Callable[[], None] = _nothing,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.failures, self.cooldown = failures, cooldown
        self._on_open, self._clock = on_open, clock
        self._failed = 0                         # consecutive failures while closed
        self._open_until: float | None = None    # None: closed
        self._current = cooldown                 # this opening's cool-down (doubles on failed probes)
        self._probe = 0                          # the probe let through and not ended yet (0: none)
        self._probes = 0
        self._answered_at = -math.inf            # the clock when a call was last answered

    @classmethod
    def for_pool(cls, failures: int, cooldown: float, telemetry: Telemetry, counts: LockCounts,
                 pool: str) -> Breaker:
        """A manager's breaker, seen in otel_lock.circuit.state / .opened under the pool (namespace) name."""
        attributes = {"db.client.connection.pool.name": pool}

        def opened() -> None:
            telemetry.circuit_opened.add(1, attributes)
        breaker = cls(failures, cooldown, on_open=opened)
        counts.watch_circuit(breaker.state, pool)
        return breaker

    def state(self) -> int:
        """CLOSED, OPEN or HALF_OPEN (cool-down over: the next acquisition probes, or one does now).

        Also read by a metrics reader on its own thread: a few attribute reads.
        """
        until = self._open_until
        if until is None:
            return CLOSED
        return OPEN if self._clock() < until else HALF_OPEN

    def retry_in(self) -> float:
        """Seconds until the circuit lets a probe through (0 when closed or half-open)."""
        until = self._open_until
        return 0.0 if until is None else max(0.0, until - self._clock())

    def admit(self) -> int:
        """Let a new acquisition through, or raise RedisUnavailable at once; a probe gets a number for `done`."""
        if self._open_until is None:
            return 0
        left = self.retry_in()
        if left > 0:
            raise RedisUnavailable(f"Redis is unavailable: circuit open, retry in {math.ceil(left * 10) / 10:g} s",
                                   retry_after=left)
        if self._probe:
            raise RedisUnavailable("Redis is unavailable: circuit half-open, a probe is under way",
                                   retry_after=self.cooldown)
        self._probes += 1
        self._probe = self._probes
        return self._probe

    def done(self, probe: int) -> None:
        """An admitted acquisition ended; a probe that got no answer (cancelled) lets the next one probe."""
        if probe and probe == self._probe:
            self._probe = 0

    def guarded(self, call: Coroutine[Any, Any, T]) -> Awaitable[T]:
        """`call` itself while the circuit is closed (no coroutine around it on every acquisition), else `guard`."""
        return call if self._open_until is None else self.guard(call)

    async def guard(self, call: Coroutine[Any, Any, T]) -> T:
        """Await `call` if admitted; else close it unstarted and raise RedisUnavailable (`guarded` calls it)."""
        try:
            probe = self.admit()
        except RedisUnavailable:
            call.close()
            # One turn of the loop first: a caller that retries at once must not starve the probe's reply
            # (and every other task) by failing without ever giving the loop a turn.
            await asyncio.sleep(0)
            raise
        try:
            return await call
        finally:
            self.done(probe)

    def record(self, reachable: bool, *, partial: bool = False, took: float = 0.0) -> None:
        """Feed one Redis call's outcome: answered (even with an error reply), or unavailable.

        `partial`: the call (sent `took` seconds ago) went to one part of the
        deployment (a Cluster slot's master). Its failure counts only when no
        partial call was answered since the cool-down before it was sent: one
        master down must not shut every slot out (its calls in flight fail in
        a burst, with no answer between them).
        """
        if reachable:
            if partial:  # the clock is read only where a failure may be weighed against it
                self._answered_at = self._clock()
            if self._failed or self._open_until is not None:
                self._close()
            return
        if not self.failures or partial and self._answered_at >= self._clock() - took - self.cooldown:
            return
        state = self.state()
        if state == CLOSED:
            self._failed += 1
            if self._failed >= self.failures:
                self._open(self.cooldown)
                log.warning("otel-lock: Redis unavailable %d times in a row: circuit open, new acquisitions "
                            "fail at once for %g s", self._failed, self.cooldown)
                self._on_open()
        elif state == HALF_OPEN:
            # The probe (or a call still in flight) failed: Redis is still down; wait longer.
            self._open(min(max(MAX_COOLDOWN, self.cooldown), self._current * 2))
        # OPEN: calls sent before it opened are still failing; that is no news.

    def _open(self, cooldown: float) -> None:
        self._current = cooldown
        self._open_until = self._clock() + cooldown
        self._probe = 0

    def _close(self) -> None:
        if self._open_until is not None:
            log.info("otel-lock: Redis answers again: circuit closed")
        self._failed = 0
        self._open_until = None
        self._current = self.cooldown
        self._probe = 0
