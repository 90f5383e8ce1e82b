"""How holds end: released (fast path or task), lost, expired; the counts, spans and events that go with it.

The manager core (`_core.py`) takes locks; a `Lease` and the watchdog reach
this object, never the manager, when a hold ends. Its methods are the
ending's whole interface; the manager keeps one per instance.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Callable

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, RedisError

from ._errors import LockError, RedisUnavailable, error_type
from ._held import Lease, forget
from ..telemetry._instruments import LockCounts, Telemetry

log = logging.getLogger("otel_lock")


def manager_closed(lease: Lease, what: str) -> RedisUnavailable:
    """A hold of a closed manager is neither released nor re-entered: a socket opened for it would never be
    closed, and the lock expires after its lease anyway."""
    return RedisUnavailable(f"lock {lease.key} was not {what}: its manager was closed, so it expires after its "
                            "lease", key=lease.key)


class HoldEnds:
    """Releases, losses and renewals of one manager's holds (on every loop: each lease knows its runtime)."""

    counts_depth = True  # nested holds are counted in Redis too (False: RedLock counts them locally)

    def __init__(self, telemetry: Telemetry, counts: LockCounts, identity: Callable[[], str]) -> None:
        self.telemetry: Telemetry = telemetry
        self.counts: LockCounts = counts
        self.identity: Callable[[], str] = identity

    def release(self, lease: Lease, *, outer: bool, child: bool) -> Releasing | asyncio.Future[bool]:
        """One hold on `lease` ends (`HeldLock.release()`): its outcome (False if the lock was no longer ours).

        The common case (the outer hold, nothing nested or shared, no renewal
        in flight) sends its RELEASE at once and is settled from the reply by
        whoever awaits it, or by the connection if nobody does any more: no
        task and no shield, as this is on every hand-over's path. Anything
        else runs as a task.
        """
        if lease.runtime.closed:
            return asyncio.ensure_future(self._release_closed(lease))
        if outer and not child and lease.depth == 1 and not lease.child_holds and not lease.ended \
                and lease.renewing is None:
            releasing = Releasing(self, lease)
            reply = lease.runtime.transport.send_release(lease, whole=not lease.explicit_owner,
                                                         on_orphan=releasing.settle)
            if reply is not None:
                lease.depth, lease.closing = 0, True
                lease.runtime.watchdog.discard(lease)  # never renew what is being released
                releasing.reply = reply
                return releasing
        return asyncio.ensure_future(self._release(lease, outer=outer, child=child))

    async def _release_closed(self, lease: Lease) -> bool:
        """Its manager is closed: nothing is sent (a socket opened now would never be closed); it expires.

        RedisUnavailable, as for a release Redis did not answer: a `with` block,
        the middleware and the blocking facade log it and go on.
        """
        if lease.ended:
            return False
        lost_before = bool(lease.lost_reason)
        self._end(lease, "lost" if lost_before else "error")
        if lost_before:
            return False
        raise manager_closed(lease, "released")

    def settle_release(self, lease: Lease, lost_before: bool, began: float, reply: Any) -> bool | LockError:
        """What the fast path's RELEASE answered (a reply, or the error), as `_let_go` would end the hold."""
        answer = lease.runtime.transport.release_answer(lease, time.perf_counter() - began, reply)
        if isinstance(answer, LockError):
            return self._release_failed(lease, True, lost_before, answer)
        return self._settle(lease, True, lost_before, answer)

    async def _release(self, lease: Lease, *, outer: bool, child: bool) -> bool:
        if child:
            lease.unnest(child=True)
        elif outer and lease.child_holds > 0:
            lease.closing = True  # no new child may enter; those inside finish first
            await lease.children_done.wait()
        if lease.ended:
            return False
        if not child:
            lease.depth -= 1
        final = lease.depth <= 0
        if not final and (not self.counts_depth or lease.shape.mode != "exclusive"):  # nested locally
            return not lease.lost.is_set()
        if final:
            lease.closing = True
            lease.runtime.watchdog.discard(lease)  # never renew what is being released
            if lease.renewing is not None:
                await asyncio.wait({lease.renewing})  # a renewal must not land after the release
        return await self.let_go(lease, final)

    async def let_go(self, lease: Lease, final: bool) -> bool:
        """Ask Redis to release one level (or the whole hold, when `final`), and end the hold accordingly."""
        transport = lease.runtime.transport
        lost_before = bool(lease.lost_reason)
        try:
            left = await transport.release(lease, whole=final and not lease.explicit_owner)
        except LockError as error:
            outcome = self._release_failed(lease, final, lost_before, error)
            if isinstance(outcome, LockError):
                raise outcome
            return outcome
        return self._settle(lease, final, lost_before, left)

    def _settle(self, lease: Lease, final: bool, lost_before: bool, left: int) -> bool:
        """Redis answered a release with the depth `left` (-1: not ours): end the hold accordingly."""
        if left == -1:
            self.lose(lease, "the lock was no longer ours at release")
            self._end(lease, "lost" if lease.renew else "expired")
            return False
        if final:
            self._end(lease, "released")
        return not lost_before

    def _release_failed(self, lease: Lease, final: bool, lost_before: bool, error: LockError) -> bool | LockError:
        """A release Redis did not answer (or refused): the error to raise, or False for a lost lease."""
        if final:
            self._end(lease, "lost" if lost_before else "error")
            if isinstance(error, RedisUnavailable) and not lease.explicit_owner:
                # Let the next caller in as soon as Redis is back, not after the lease.
                lease.runtime.transport.release_when_back(lease)
        if lost_before:
            return False  # the holder was told already; letting go cannot fail it twice
        return error

    def _end(self, lease: Lease, outcome: str) -> None:
        """The hold is over for its holder too: no renewal, no re-entry, out of the age gauge."""
        if lease.ended:
            return
        lease.ended = True
        # Nothing cancels or re-enters it any more; and a task whose result is this hold would
        # otherwise be a reference cycle with it, left to the cyclic collector.
        lease.task = None
        lease.runtime.watchdog.discard(lease)
        forget((self.identity(), lease.held_as), lease)
        self._finish(lease, outcome)
        self.counts.hold_ended(lease)  # a lost hold stays in the age gauge until its holder lets go

    def _finish(self, lease: Lease, outcome: str) -> None:
        """The hold is over in Redis: its duration, the active count and its span (once)."""
        if lease.finished:
            return
        lease.finished = True
        self.telemetry.hold_duration.record(lease.loop.time() - lease.acquired_at,
                                            _mode({"lock.name": lease.name, "lock.release.outcome": outcome}, lease))
        self.counts.active[lease.name] -= 1
        if lease.permits:
            self.counts.permit_returned(lease.name)
        self.telemetry.end_hold_span(lease.span, outcome)

    def lose(self, lease: Lease, reason: str) -> None:
        """The lease is gone: tell the holder (and cancel it if it asked), count it now, once."""
        if lease.lost_reason or lease.ended:
            return
        lease.runtime.watchdog.discard(lease)
        if lease.planned:
            # A once-per-period tick ran out as planned: its holder is long done, nobody overlaps.
            self._end(lease, "released")
            return
        lease.lost_reason = reason
        lease.lost.set()
        self.telemetry.renewals.add(1, _mode({"lock.name": lease.name, "lock.renewal.outcome": "lost"}, lease))
        if lease.span.is_recording():
            lease.span.add_event("lock lost", {"lock.name": lease.name, "lock.token": lease.token,
                                               "lock.lost.reason": reason})
        self._finish(lease, "lost" if lease.renew else "expired")
        log.warning("otel-lock: lease of %s lost: %s", lease.key, reason)
        for callback in lease.on_lost:
            callback()
        if not lease.runtime.closed:  # told after the manager closed: its clients are gone
            lease.runtime.transport.lost(lease)
        task = lease.task
        if lease.cancel_on_lost and task is not None and not task.done():
            lease.cancelled_by_us = True
            task.cancel(f"otel-lock: lease of {lease.key} lost")

    def renewed(self, lease: Lease, outcome: str, error: BaseException | None = None) -> None:
        """A renewal's outcome (ok, error), told by the watchdog."""
        self.telemetry.renewals.add(1, _mode({"lock.name": lease.name, "lock.renewal.outcome": outcome}, lease))
        if error is not None:
            kind = error_type(error)
            self.telemetry.errors.add(1, {"lock.name": lease.name, "lock.operation": "renew", "error.type": kind})
            if lease.span.is_recording():
                lease.span.add_event("lock renewal failed", {"lock.name": lease.name, "error.type": kind})


def _mode(attributes: dict[str, Any], lease: Lease) -> dict[str, Any]:
    """`lock.mode` on a metric of a shared or permit hold (absent: exclusive, as the series were before it)."""
    if lease.shape.mode != "exclusive":
        attributes["lock.mode"] = lease.shape.mode
    return attributes


class Releasing:
    """A RELEASE on the wire: `await wait()` gives its outcome, to every caller of `HeldLock.release()`.

    The first caller awaits the reply itself (one turn of the loop); if it is
    cancelled the connection hands the reply to `settle` instead, so the hold
    always ends. A Redis that forgot the script gets a task that loads it.
    """

    __slots__ = ("ends", "lease", "reply", "began", "lost_before", "outcome", "waiting", "done", "reloading")

    def __init__(self, ends: HoldEnds, lease: Lease) -> None:
        self.ends: HoldEnds = ends
        self.lease: Lease = lease
        self.reply: asyncio.Future[Any] | None = None
        self.began: float = time.perf_counter()
        self.lost_before: bool = bool(lease.lost_reason)
        self.outcome: bool | LockError | None = None
        self.waiting: bool = False
        self.done: asyncio.Future[bool] | None = None  # for the other callers, and after a cancelled one
        self.reloading: asyncio.Future[bool] | None = None  # the one release sent again after a NOSCRIPT

    async def wait(self) -> bool:
        reply = self.reply
        assert reply is not None  # set before it is handed out
        if self.outcome is None and not self.waiting and not reply.done():
            self.waiting = True
            try:
                answer: Any = await reply
            except (RedisError, OSError) as exc:
                answer = exc
            finally:
                self.waiting = False
            self.settle(answer)
        if self.outcome is None:  # another caller awaits the reply, or a task reloads the script
            if self.done is None:
                self.done = self.lease.loop.create_future()
                if reply.done() and not reply.cancelled():  # answered, nobody settled it yet
                    self.settle(reply.exception() or reply.result())
                self._tell()
            return await asyncio.shield(self.done)
        return self._result()

    def settle(self, answer: Any) -> None:
        """Redis answered (or the socket ended): end the hold once, and tell every caller waiting."""
        if self.outcome is not None or self.reloading is not None:
            return  # settled, or released again already: the same reply is read by `wait` and by a late look
        if isinstance(answer, NoScriptError):  # Redis forgot the script: load it, release again (once)
            self.reloading = asyncio.ensure_future(self.ends.let_go(self.lease, True))
            self.reloading.add_done_callback(self._from_task)
            return
        self.outcome = self.ends.settle_release(self.lease, self.lost_before, self.began, answer)
        self._tell()

    def _from_task(self, task: asyncio.Future[bool]) -> None:
        error = None if task.cancelled() else task.exception()
        self.outcome = (LockError(f"release of {self.lease.key} stopped", key=self.lease.key) if task.cancelled()
                        else error if isinstance(error, LockError) else task.result() if error is None
                        else LockError(f"release of {self.lease.key} failed: {error}", key=self.lease.key))
        self._tell()

    def _tell(self) -> None:
        if self.outcome is not None and self.done is not None and not self.done.done():
            if isinstance(self.outcome, LockError):
                self.done.set_exception(self.outcome)
            else:
                self.done.set_result(bool(self.outcome))

    def _result(self) -> bool:
        if isinstance(self.outcome, LockError):
            raise self.outcome
        return bool(self.outcome)
