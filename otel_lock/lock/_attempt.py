"""One attempt to take a lock on one Redis (or Sentinel, or Cluster): ask, queue, wait for a notice or poll, claim.

The attempt owns a fresh waiter id (and, unless the caller named an owner,
uses it as the owner id), so every Redis call it makes is safe to send again:
a repeated ACQUIRE of a lock that is already this attempt's answers "held".
That is what lets a waiter ride out a Redis restart: it re-queues until its
deadline instead of failing. Whatever the attempt may have taken when it
gives up (a cancelled call, a reply lost with the connection) is undone.

Without a wake channel (an ACL user with no pub/sub rights) the attempt
polls without queueing: fair hand-over needs the notice.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import time
from dataclasses import dataclass
from functools import partial
from json.encoder import encode_basestring_ascii as _json_str  # a JSON string, as json.dumps writes it
from typing import TYPE_CHECKING, Any, Coroutine

from redis.exceptions import NoScriptError, RedisError

from . import _deadlock, _scripts
from ._errors import LockDeadlock, LockError, LockTimeout, RedisUnavailable, is_unavailable
from ._options import NO_DEADLINE_ABOVE
from ._shapes import EXCLUSIVE, Shape
from ._waiting import POLL, PROMOTED, Grant, Waiter

if TYPE_CHECKING:
    from ._script_transport import ScriptTransport

log = logging.getLogger("otel_lock")

RETRY_FIRST = 0.05     # first pause after Redis went away while waiting (doubles up to poll_cap)
UNDO_RETRY = 0.25
MIN_POLL = 0.005
GIVE_UP_WAIT = 0.1     # how long a cancelled or timed-out caller waits for its clean-up (the rest runs on)


@dataclass(slots=True)
class Acquisition:
    """One acquisition as a transport sees it; the transport fills in what it found on the way."""

    keys: tuple[str, ...]
    name: str
    waiter_id: str
    owner: str
    lease_ms: int
    wait: float
    ctx: str                       # the caller's traceparent, stored with the lock
    private: bool = True           # the owner is this attempt's alone (not an explicit `owner=`)
    attempts: int = 0
    contended: bool = False
    holder_ctx: str = ""           # traceparent of the holder found busy
    probe: _deadlock.Probe | None = None  # a waiter that holds locks: checked for a deadlock before it waits
    shape: Shape = EXCLUSIVE       # exclusive, shared or permit: its scripts and keys (`_shapes.py`)
    permits: int = 0               # a permit's limit (ACQUIRE's ARGV[10])


class Reply:
    """The ACQUIRE that took the lock: its token, depth and the loop time it was sent at."""

    __slots__ = ("token", "depth", "sent_at", "owner")

    def __init__(self, token: int, depth: int, sent_at: float, owner: str | None = None) -> None:
        self.token, self.depth, self.sent_at = token, depth, sent_at
        self.owner = owner  # the owner it was granted to, when the transport chose it (a RedLock round)


def validity(lease_ms: int) -> float:
    """The lease minus the drift margin, as the holder's Lease counts it."""
    lease = lease_ms / 1000
    return lease - (lease * 0.01 + 0.002)


def poll_delay(pttl_ms: int, cap: float) -> float:
    """Fallback poll: when the holder's lease would run out, at most `cap`, jittered."""
    bound = cap if pttl_ms < 0 else min(pttl_ms / 1000, cap)
    return max(MIN_POLL, bound) * random.uniform(0.8, 1.1)


def queue_record(waiter_id: str, budget_ms: int, lease_ms: int, owner: str, ctx: str, channel: str, sharded: bool,
                 how: str) -> str:
    """A waiter's queue entry (data model 2): `json.dumps([...], separators=(",", ":"))`, written out.

    `how` is the wait's mode letter, absent ("") for an exclusive wait. Made
    once per queued attempt, which is on every contended hand-over's path.
    """
    tail = f',"{how}"]' if how else "]"
    return (f"[{_json_str(waiter_id)},{budget_ms},{lease_ms},{_json_str(owner)},{_json_str(ctx)},"
            f"{_json_str(channel)},{1 if sharded else 0}{tail}")


class Attempt:
    """Take `request.keys` within `request.wait` seconds; `run()` returns the Reply or raises."""

    __slots__ = ("transport", "request", "loop", "deadline", "_waiter", "_maybe_taken", "_queued_at", "_pttl",
                 "_refusal", "_check_timer", "_check", "_member")

    def __init__(self, transport: ScriptTransport, request: Acquisition) -> None:
        self.transport, self.request = transport, request
        self.loop = asyncio.get_running_loop()
        self.deadline = self.loop.time() + request.wait
        self._waiter: Waiter | None = None
        self._maybe_taken = False  # a call failed after it may have run: undo on giving up
        self._queued_at: float | None = None  # send time of the first queued ACQUIRE
        self._pttl = -1
        self._refusal: LockDeadlock | None = None  # the deadlock check found this wait closes a cycle
        self._check_timer: asyncio.TimerHandle | None = None
        self._check: asyncio.Future[None] | None = None
        self._member: str | None = None  # this waiter's queue member (data model 2: its whole entry)

    def _args(self, queue: bool) -> list[Any]:
        r = self.request
        if not queue:
            budget = "-1"
        elif r.wait > NO_DEADLINE_ABOVE:  # inf, or as good as it
            budget = "0"
        else:
            budget = str(max(1, int((self.deadline - self.loop.time()) * 1000)))
        waiting = self.transport.waiting
        channel = waiting.channel_for(r.keys[0])
        args = [r.owner, self._queue_member(budget, channel) if queue else r.waiter_id, r.lease_ms,
                "0" if r.private else "1", budget, r.ctx, self.transport.fence_ttl_ms, channel,
                "1" if waiting.sharded else "0"]
        if r.permits:
            args.append(r.permits)
        return args

    def _queue_member(self, budget: str, channel: str) -> str:
        """The waiter as its queue knows it: its entry itself (model 2), the same string for every request.

        A request sent again keeps the place of the first (ZADD NX), and LEAVE
        names the member: so it is made once, with the first request's wait
        budget (the entry's deadline is its arrival plus that budget). A key's
        wake channel never changes for its manager (on a Cluster, the slot's).
        """
        if _scripts.MODEL < 2:  # a manager of model 1 (a test of a mixed namespace)
            return self.request.waiter_id
        if self._member is None:
            r = self.request
            self._member = queue_record(r.waiter_id, int(budget), r.lease_ms, r.owner, r.ctx, channel,
                                        self.transport.waiting.sharded,
                                        "" if r.shape.mode == "exclusive" else _deadlock.HOW[r.shape.mode])
        return self._member

    def _waiter_name(self) -> str:
        """What LEAVE and the deadlock records name this waiter by: its queue member once it has one."""
        return self._member if self._member is not None else self.request.waiter_id

    async def try_once(self) -> Reply | None:
        """One ACQUIRE without queueing: the Reply, or None when the lock is busy."""
        try:
            reply = await self._ask(queue=False)
            self.request.contended = reply is None
            return reply
        except RedisUnavailable:
            if self.request.private:
                self.transport.background(self._release_when_back())
            raise

    async def run(self) -> Reply:
        """Queue and wait (wait > 0); LockTimeout at the deadline."""
        waiting, key = self.transport.waiting, self.request.keys[0]
        queued = not self.transport.polling and waiting.ready_for(key)
        if queued:
            self._waiter = waiting.add(self.request.waiter_id, key)
        try:
            reply = await self._ask(queue=queued)
            if reply is not None:
                return reply
            self.request.contended = True
            if self._waiter is None and await self._subscribe():
                self._waiter = waiting.add(self.request.waiter_id, key)
                reply = await self._ask(queue=True)
                if reply is not None:
                    return reply
            if self.request.probe is not None:
                await self._check_deadlock(self.request.probe, key)
            pending = self.transport.pending
            pending[self.request.name] += 1
            try:
                return await self._wait()
            finally:
                pending[self.request.name] -= 1
        except BaseException:
            await self._give_up_soon()
            raise
        finally:
            if self._waiter is not None:
                waiting.remove(self._waiter)
            if self._check_timer is not None:
                self._check_timer.cancel()
            probe = self.request.probe
            if probe is not None and probe.recorded and self._waiter is None:
                # a polling waiter's record is an edge until deleted; a queued one's stops being one as it leaves
                self.transport.background(_deadlock.over(self.transport, probe, self._waiter_name(),
                                                         self.request.name))

    async def _check_deadlock(self, probe: _deadlock.Probe, key: str) -> None:
        """Would this wait close a cycle? A queued waiter asks while it waits, so the check adds no latency.

        It asks once it has waited CHECK_AFTER (a wait that ends sooner was no
        deadlock, and costs no check). A refusal wakes the waiter, which
        raises it unless the lock was handed to it meanwhile (then the cycle
        is broken already). A polling waiter (no queue place to keep) asks
        before its first poll.
        """
        if self._waiter is None:
            await self._deadlock_check(probe, key)
            return
        self._check_timer = self.loop.call_later(_deadlock.CHECK_AFTER, self._start_check, probe, key, self._waiter)

    def _deadlock_check(self, probe: _deadlock.Probe, key: str) -> Coroutine[Any, Any, None]:
        return _deadlock.check(self.transport, probe, key, self._waiter_name(), self.deadline - self.loop.time(),
                               self._waiter is not None, self.request.name, self.request.shape.mode)

    def _start_check(self, probe: _deadlock.Probe, key: str, waiter: Waiter) -> None:
        self._check_timer = None
        self._check = asyncio.ensure_future(self._deadlock_check(probe, key))  # referenced while it runs
        self._check.add_done_callback(partial(self._checked, waiter))

    def _checked(self, waiter: Waiter, check: asyncio.Future[None]) -> None:
        error = None if check.cancelled() else check.exception()
        if isinstance(error, LockDeadlock):
            self._refusal = error
            waiter.wake(POLL)
        elif error is not None:
            log.warning("otel-lock: deadlock check of %s failed, waiting without it: %s", self.request.keys[0], error)

    async def _subscribe(self) -> bool:
        """Make sure a grant can reach this manager before a queued request names its channel.

        False: no wake channel can be had (no pub/sub rights): poll instead.
        """
        if self.transport.polling:
            return False
        try:
            await self.transport.waiting.start(self.request.keys[0])
            return True
        except LockError:
            raise
        except Exception as exc:
            if self.transport.refused_channels(exc):
                return False
            raise self.transport.calls.error(exc, "subscribe", self.request.keys[0]) from exc

    async def _wait(self) -> Reply:
        waiting, waiter = self.transport.waiting, self._waiter
        backoff = RETRY_FIRST
        while True:
            if self._refusal is not None and not (waiter is not None and waiter.granted):
                raise self._refusal
            remaining = self.deadline - self.loop.time()
            if remaining <= 0 and not (waiter is not None and waiter.granted):
                raise LockTimeout(f"lock {self.request.keys[0]} was not acquired within {self.request.wait} s",
                                  key=self.request.keys[0], waited=self.request.wait)
            value = await self._next(waiter, remaining)
            if self._refusal is not None and not isinstance(value, Grant):
                raise self._refusal
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
                queue = waiter is not None
                if queue and not waiting.ready_for(self.request.keys[0]):
                    await self._subscribe()  # a cluster slot moved (failover, migration): follow it
                reply = await self._ask(queue=queue)
            except RedisUnavailable:
                # Redis restarting or failing over: keep the place until the deadline.
                pause = min(backoff, self.deadline - self.loop.time())
                if pause <= 0:
                    raise
                backoff = min(backoff * 2, self.transport.poll_cap)
                await asyncio.sleep(pause)
                continue
            backoff = RETRY_FIRST
            if reply is not None:
                return reply

    async def _next(self, waiter: Waiter | None, remaining: float) -> Grant | str | None:
        """The next wake-up, or None when it is time to look (the fallback poll or the deadline)."""
        cap = self.transport.poll_cap
        if waiter is None:  # polling without a queue place
            await asyncio.sleep(max(0.0, min(remaining, poll_delay(self._pttl, cap))))
            return None
        first = self.transport.waiting.is_first(waiter)
        timeout = None if math.isinf(remaining) else max(0.0, min(
            remaining, poll_delay(self._pttl, cap) if first else remaining))
        return await waiter.next(timeout)

    def _trust(self, grant: Grant) -> Reply | None:
        """A grant's lease is timed from the first queued request, which Redis ran before the hand-over.

        That bound needs no Redis clock. When less than half the lease would be
        left by it (a long wait, a late read), the grant is confirmed with one
        ACQUIRE instead, which times the lease from its own send.
        """
        if self._queued_at is None or not self.transport.trust_grants or not self.request.shape.trust_grants:
            # with wait_replicas, a hand-over is confirmed by an ACQUIRE that WAITs; a shared one always
            # is (a plain RELEASE hands it over as if exclusive: the ACQUIRE turns it shared)
            return None
        left = self._queued_at + validity(self.request.lease_ms) - self.loop.time()
        return Reply(grant.token, 1, self._queued_at) if left >= self.request.lease_ms / 2000 else None

    async def _ask(self, *, queue: bool) -> Reply | None:
        r = self.request
        sent_at = self.loop.time()
        if queue and self._queued_at is None:
            self._queued_at = sent_at
        answer = await self._acquire_call(self._args(queue))
        r.attempts += 1
        if answer[0] == -2:
            raise ValueError(f"semaphore {r.keys[0]} is in use with permits={int(answer[1])}, not "
                             f"permits={r.permits}: every holder of one key must name the same limit "
                             "(it may change once no permit is held)")
        if answer[0] == 1:
            if self.loop.time() < sent_at + validity(r.lease_ms):
                return Reply(int(answer[1]), int(answer[2]), sent_at)
            # Read after the lease it granted ran out (a blocked loop, a stopped
            # process): the lock may be someone else's by now. Let go of it, if
            # it is still ours, and wait on; entering would overlap untold.
            await self._release()
            self._pttl = -1
            return None
        self._pttl = int(answer[1])
        r.holder_ctx = _text(answer[2]) or r.holder_ctx
        return None

    def _release(self) -> Coroutine[Any, Any, Any]:
        r, t = self.request, self.transport
        return t.call(r.shape.release, r.keys, [r.owner, t.fence_ttl_ms, "1" if r.private else "0"], "release",
                      r.name)

    async def _acquire_call(self, args: list[Any]) -> Any:
        """ACQUIRE, safe to cancel: a reply that arrives after its caller left is undone.

        On the lean connection the command is written at once and its reply's
        future awaited (no task: this is the hot path); else, or when Redis
        forgot the script, a task makes the call.
        """
        t, r = self.transport, self.request
        reply = t.link.send_now(t.acquire_for(r.shape), r.keys, args, on_orphan=partial(self._undo_raw_reply, args))
        if reply is None:
            return await self._acquire_task(args)
        began = time.perf_counter()
        try:
            answer = await reply  # cancelled here, the reply goes to _undo_raw_reply
        except NoScriptError:
            return await self._acquire_task(args)  # Redis restarted or flushed its scripts: load, then call
        except (RedisError, OSError) as exc:
            error = t.calls.failed(exc, time.perf_counter() - began, "acquire", r.name, r.keys[0])
            if isinstance(error, RedisUnavailable):
                self._maybe_taken = True  # the script may have run and only its reply was lost
            raise error from exc
        t.calls.ok(time.perf_counter() - began, "acquire", r.name)
        return answer

    def _undo_raw_reply(self, args: list[Any], reply: Any) -> None:
        """The reply (or error) of an ACQUIRE whose caller was cancelled: undo whatever it granted."""
        if isinstance(reply, Exception):
            if is_unavailable(reply) and self.request.private:
                self.transport.background(self._release_when_back())
            return
        if reply[0] == 1:
            self.transport.background(self._release())
        elif args[4] != "-1":
            self.transport.background(self._leave())

    async def _acquire_task(self, args: list[Any]) -> Any:
        t = self.transport
        call = asyncio.ensure_future(t.call(t.acquire_for(self.request.shape), self.request.keys, args, "acquire",
                                            self.request.name))
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
        if call.cancelled():
            return
        error = call.exception()
        if error is not None:
            if isinstance(error, RedisUnavailable) and self.request.private:
                self.transport.background(self._release_when_back())
            return
        if call.result()[0] == 1:
            self.transport.background(self._release())
        elif args[4] != "-1":
            self.transport.background(self._leave())

    def _leave(self) -> Coroutine[Any, Any, Any]:
        r, t = self.request, self.transport
        return t.call(r.shape.leave, r.shape.leave_keys(r.keys), [self._waiter_name(), t.fence_ttl_ms], "leave",
                      r.name)

    async def _give_up_soon(self) -> None:
        """Clean up, waiting at most GIVE_UP_WAIT: behind a stalled reply the rest runs in the background."""
        work = self.transport.background(self._give_up())
        await asyncio.wait({work}, timeout=GIVE_UP_WAIT)

    async def _give_up(self) -> None:
        """Leave the queue (passing on a hand-over not claimed yet); undo a maybe-taken lock."""
        if self._maybe_taken and self.request.private:
            await self._release_when_back()
            return
        if self._waiter is None and not self._maybe_taken:
            return
        try:
            await self._leave()
        except RedisUnavailable:
            await self._release_when_back()
        except LockError as error:
            # The queue entry expires with its deadline; a hand-over to us with its lease.
            log.warning("otel-lock: could not leave the queue of %s: %s", self.request.keys[0], error)

    async def _release_when_back(self) -> None:
        """Release this attempt's owner and leave its queue, retried until Redis answers or the lease ran out."""
        give_up = self.loop.time() + self.request.lease_ms / 1000
        while True:
            try:
                if self.request.private:
                    await self.transport.call(self.request.shape.release, self.request.keys,
                                              [self.request.owner, self.transport.fence_ttl_ms, "1"], "release",
                                              self.request.name)
                await self._leave()
                return
            except RedisUnavailable:
                if self.loop.time() > give_up or cancelling():
                    return
                await asyncio.sleep(UNDO_RETRY)


def cancelling() -> bool:
    """The current task was asked to stop, even if a client library turned the CancelledError into an error."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


def _text(value: bytes | str | None) -> str:
    return value.decode() if isinstance(value, bytes) else (value or "")
