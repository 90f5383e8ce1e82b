"""One attempt to take a lock: ask, queue, wait for a notice or poll, claim.

The attempt owns a fresh waiter id (and, unless the caller named an owner,
uses it as the owner id), so every Redis call it makes is safe to send again:
a repeated ACQUIRE of a lock that is already this attempt's answers "held".
That is what lets a waiter ride out a Redis restart: it re-queues until its
deadline instead of failing. Whatever the attempt may have taken when it
gives up (a cancelled call, a reply lost with the connection) is undone.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
from functools import partial
from typing import Any, Coroutine, Protocol

from . import _scripts
from ._errors import LockError, LockTimeout, RedisUnavailable, to_lock_error
from ._waiting import PROMOTED, Grant, Waiter, Waiting
from ..telemetry._instruments import LockCounts

log = logging.getLogger("otel_lock")

RETRY_FIRST = 0.05     # first pause after Redis went away while waiting (doubles up to poll_cap)
UNDO_RETRY = 0.25
MIN_POLL = 0.005


class Caller(Protocol):
    """The manager, as an attempt sees it."""

    fence_ttl_ms: int
    poll_cap: float
    wait_replicas: int
    _acquire_script: _scripts.Script
    _waiting: Waiting
    _counts: LockCounts

    async def _call(self, script: _scripts.Script, keys: tuple[str, ...], args: list[Any],
                    operation: str, name: str) -> Any: ...

    def _background_task(self, coro: Coroutine[Any, Any, Any]) -> None: ...


class Reply:
    """The ACQUIRE that took the lock: its answer and the loop time it was sent at."""

    __slots__ = ("token", "depth", "sent_at")

    def __init__(self, answer: list[Any], sent_at: float) -> None:
        self.token, self.depth, self.sent_at = int(answer[1]), int(answer[2]), sent_at


class Attempt:
    """Take `keys` for `owner` within `wait` seconds; `run()` returns the Reply or raises."""

    def __init__(self, manager: Caller, keys: tuple[str, ...], name: str, waiter_id: str, owner: str,
                 lease_ms: int, wait: float, ctx: str) -> None:
        self.manager, self.keys, self.name = manager, keys, name
        self.waiter_id, self.owner = waiter_id, owner
        self.private = owner == waiter_id  # undo may release it whole; an explicit owner is shared
        self.lease_ms, self.wait, self.ctx = lease_ms, wait, ctx
        self.loop = asyncio.get_running_loop()
        self.deadline = self.loop.time() + wait
        self.attempts = 0
        self.contended = False
        self.holder_ctx = ""
        self._waiter: Waiter | None = None
        self._maybe_taken = False  # a call failed after it may have run: undo on giving up
        self._queued_at: float | None = None  # send time of the first queued ACQUIRE

    def _args(self, queue: bool) -> list[Any]:
        if not queue:
            budget = "-1"
        elif math.isinf(self.wait):
            budget = "0"
        else:
            budget = str(max(1, int((self.deadline - self.loop.time()) * 1000)))
        waiting = self.manager._waiting
        return [self.owner, self.waiter_id, self.lease_ms, "0" if self.private else "1", budget,
                self.ctx, self.manager.fence_ttl_ms, waiting.channel_for(self.keys[0]),
                "1" if waiting.sharded else "0"]

    async def try_once(self) -> Reply | None:
        """One ACQUIRE without queueing: the Reply, or None when the lock is busy."""
        try:
            reply = await self._ask(queue=False)
            self.contended = reply is None
            return reply
        except RedisUnavailable:
            if self.private:
                self.manager._background_task(self._release_when_back())
            raise

    async def run(self) -> Reply:
        """Queue and wait (wait > 0); LockTimeout at the deadline."""
        waiting = self.manager._waiting
        queued = waiting.ready_for(self.keys[0])
        if queued:
            self._waiter = waiting.add(self.waiter_id, self.keys[0])
        try:
            reply = await self._ask(queue=queued)
            if reply is not None:
                return reply
            self.contended = True
            if self._waiter is None:
                await self._subscribe()
                self._waiter = waiting.add(self.waiter_id, self.keys[0])
                reply = await self._ask(queue=True)
                if reply is not None:
                    return reply
            pending = self.manager._counts.pending
            pending[self.name] += 1
            try:
                return await self._wait(self._waiter, self._pttl)
            finally:
                pending[self.name] -= 1
        except BaseException:
            await asyncio.shield(self._give_up())
            raise
        finally:
            if self._waiter is not None:
                waiting.remove(self._waiter)

    async def _subscribe(self) -> None:
        """Make sure a grant can reach this manager before a queued request names its channel."""
        try:
            await self.manager._waiting.start(self.keys[0])
        except LockError:
            raise
        except Exception as exc:
            raise to_lock_error(exc, "subscribe", key=self.keys[0], client=getattr(self.manager, "redis", None)) from exc

    async def _wait(self, waiter: Waiter, pttl: int) -> Reply:
        waiting = self.manager._waiting
        backoff = RETRY_FIRST
        while True:
            remaining = self.deadline - self.loop.time()
            if remaining <= 0 and not waiter.granted:
                raise LockTimeout(f"lock {self.keys[0]} was not acquired within {self.wait} s", key=self.keys[0])
            value = await waiter.next(None if math.isinf(remaining) else max(0.0, min(
                remaining, self._poll_delay(pttl) if waiting.is_first(waiter) else remaining)))
            if value == PROMOTED:
                continue
            if isinstance(value, Grant):
                reply = self._trust(value)
                if reply is not None:
                    return reply
            # A poll, the timer, or a grant too old to trust without asking: ask
            # Redis. A grant is consumed either way, so a stale one never makes
            # this loop spin.
            try:
                if not waiting.ready_for(self.keys[0]):
                    await self._subscribe()  # a cluster slot moved (failover, migration): follow it
                reply = await self._ask(queue=True)
            except RedisUnavailable:
                # Redis restarting or failing over: keep the place until the deadline.
                pause = min(backoff, self.deadline - self.loop.time())
                if pause <= 0:
                    raise
                backoff = min(backoff * 2, self.manager.poll_cap)
                await asyncio.sleep(pause)
                continue
            backoff = RETRY_FIRST
            if reply is not None:
                return reply
            pttl = self._pttl

    def _trust(self, grant: Grant) -> Reply | None:
        """A grant's lease is timed from the first queued request, which Redis ran before the hand-over.

        That bound needs no Redis clock. When less than half the lease would be
        left by it (a long wait, a late read), the grant is confirmed with one
        ACQUIRE instead, which times the lease from its own send.
        """
        if self._queued_at is None or self.manager.wait_replicas:
            return None  # with wait_replicas, a hand-over is confirmed by an ACQUIRE that WAITs
        left = self._queued_at + self._validity() - self.loop.time()
        return Reply([1, grant.token, 1], self._queued_at) if left >= self.lease_ms / 2000 else None

    def _validity(self) -> float:
        """The lease minus the drift margin, as the holder's Lease counts it."""
        lease = self.lease_ms / 1000
        return lease - (lease * 0.01 + 0.002)

    async def _ask(self, *, queue: bool) -> Reply | None:
        sent_at = self.loop.time()
        if queue and self._queued_at is None:
            self._queued_at = sent_at
        answer = await self._acquire_call(self._args(queue))
        self.attempts += 1
        if answer[0] == 1:
            if self.loop.time() < sent_at + self._validity():
                return Reply(answer, sent_at)
            # Read after the lease it granted ran out (a blocked loop, a stopped
            # process): the lock may be someone else's by now. Let go of it, if
            # it is still ours, and wait on; entering would overlap untold.
            await self.manager._call(_scripts.release, self.keys,
                                     [self.owner, self.manager.fence_ttl_ms, "1" if self.private else "0"],
                                     "release", self.name)
            self._pttl = -1
            return None
        self._pttl = int(answer[1])
        self.holder_ctx = _text(answer[2]) or self.holder_ctx
        return None

    _pttl = -1

    async def _acquire_call(self, args: list[Any]) -> Any:
        """ACQUIRE, safe to cancel: a reply that arrives after its caller left is undone."""
        manager = self.manager
        call = asyncio.ensure_future(manager._call(manager._acquire_script, self.keys, args, "acquire", self.name))
        try:
            return await asyncio.shield(call)
        except asyncio.CancelledError:
            call.add_done_callback(partial(self._undo_late_reply, args))
            raise
        except RedisUnavailable:
            # The script may have run and only its reply was lost: if the
            # attempt ends without the lock, nothing it took may stay behind.
            self._maybe_taken = True
            raise

    def _undo_late_reply(self, args: list[Any], call: asyncio.Future[Any]) -> None:
        manager = self.manager
        if call.cancelled():
            return
        error = call.exception()
        if error is not None:
            if isinstance(error, RedisUnavailable) and self.private:
                manager._background_task(self._release_when_back())
            return
        if call.result()[0] == 1:
            manager._background_task(manager._call(
                _scripts.release, self.keys, [self.owner, manager.fence_ttl_ms, "1" if self.private else "0"],
                "release", self.name))
        elif args[4] != "-1":
            manager._background_task(self._leave())

    def _leave(self) -> Coroutine[Any, Any, Any]:
        return self.manager._call(_scripts.leave, self.keys, [self.waiter_id, self.manager.fence_ttl_ms],
                                  "leave", self.name)

    async def _give_up(self) -> None:
        """Leave the queue (passing on a hand-over not claimed yet); undo a maybe-taken lock."""
        if self._maybe_taken and self.private:
            self.manager._background_task(self._release_when_back())
            return
        if self._waiter is None and not self._maybe_taken:
            return
        try:
            await self._leave()
        except RedisUnavailable:
            self.manager._background_task(self._release_when_back())
        except LockError as error:
            # The queue entry expires with its deadline; a hand-over to us with its lease.
            log.warning("otel-lock: could not leave the queue of %s: %s", self.keys[0], error)

    async def _release_when_back(self) -> None:
        """Release this attempt's owner and leave its queue, retried until Redis answers or the lease ran out."""
        manager = self.manager
        give_up = self.loop.time() + self.lease_ms / 1000
        while True:
            try:
                if self.private:
                    await manager._call(_scripts.release, self.keys, [self.owner, manager.fence_ttl_ms, "1"],
                                        "release", self.name)
                await self._leave()
                return
            except RedisUnavailable:
                if self.loop.time() > give_up or _cancelling():
                    return
                await asyncio.sleep(UNDO_RETRY)

    def _poll_delay(self, pttl_ms: int) -> float:
        """Fallback poll: when the holder's lease would run out, at most `poll_cap`, jittered."""
        cap = self.manager.poll_cap
        bound = cap if pttl_ms < 0 else min(pttl_ms / 1000, cap)
        return max(MIN_POLL, bound) * random.uniform(0.8, 1.1)


def _cancelling() -> bool:
    """The current task was asked to stop, even if a client library turned the CancelledError into an error."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


def _text(value: bytes | str | None) -> str:
    return value.decode() if isinstance(value, bytes) else (value or "")
