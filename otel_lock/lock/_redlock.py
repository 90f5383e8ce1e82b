"""RedLockManager: one lock over N independent Redis masters, held by a majority of them.

A grant needs N//2+1 masters. Every master gets its ACQUIRE at once, each
bounded by `master_timeout`; the hold is valid for `lease - elapsed - drift`
counted on the monotonic clock from the send time of those requests. A failed
round (no quorum, or no validity left) is released on every master at once
and retried after a jittered pause, until `wait`. There is no queue and no
pub/sub: waiters poll, at most every `poll_cap` and never past the holder's
remaining TTL. Holds, `lost`, `cancel_on_lost` and per-task re-entry behave
as in `LockManager`; see docs/lock.md, "RedLock quorum".
"""

from __future__ import annotations

import asyncio
import itertools
import random
import uuid
from functools import partial
from types import MappingProxyType, TracebackType
from typing import Any, Coroutine, Sequence
from urllib.parse import urlsplit

import redis.asyncio as aioredis
from opentelemetry import trace
from opentelemetry.metrics import MeterProvider

from . import _redlock_scripts as scripts
from ._redlock_cleanup import Cleanup
from ._redlock_rounds import Round, grant, keep
from ._errors import LockBusy, LockError, LockTimeout, RedisUnavailable
from ._background import Background
from ._held import HELD, NEVER, HeldLock, Lease, LockContext
from ._ending import HoldEnds, _error_type
from ._manager import LockManager
from ._options import CommonOptions, _check_seconds, default_name
from ..telemetry._instruments import LockCounts, Telemetry, get_telemetry

_OPTIONS = ("namespace", "lease", "wait", "cancel_on_lost", "fence_ttl", "poll_cap", "renew_interval",
            "master_timeout", "tracer_provider", "meter_provider", "breaker_failures", "breaker_cooldown")
MIN_MASTERS = 3


def _check_masters(given: object, name: str, kind: str, alternative: str) -> None:
    """A list (not one string) of at least MIN_MASTERS masters."""
    if isinstance(given, (str, bytes)) or not isinstance(given, Sequence):
        raise ValueError(f"{name} must be a list of {kind}, not {given!r}")
    if len(given) < MIN_MASTERS:
        raise ValueError(f"RedLock needs at least {MIN_MASTERS} independent masters, got {len(given)} {kind}: "
                         f"with fewer, one failure stops all locking (use {alternative} for one Redis)")


class RedLockManager(HoldEnds, CommonOptions):
    """Hands out locks held by a majority of N independent Redis masters."""

    def __init__(self, clients: Sequence[aioredis.Redis], *, namespace: str = "otel-lock", lease: float = 30.0,
                 wait: float = 5.0, cancel_on_lost: bool = False, fence_ttl: float = 3600.0,
                 poll_cap: float = 0.05, renew_interval: float | None = None, master_timeout: float | None = None,
                 tracer_provider: trace.TracerProvider | None = None,
                 meter_provider: MeterProvider | None = None, breaker_failures: int = 5,
                 breaker_cooldown: float = 1.0) -> None:
        _check_masters(clients, "clients", "redis.asyncio clients", "LockManager")
        if len({id(c) for c in clients}) != len(clients):
            raise ValueError("the same client is given twice: each master must be a different Redis")
        self._set_common_options(namespace, lease, renew_interval, wait, cancel_on_lost, fence_ttl, poll_cap)
        self.master_timeout: float = min(0.25, self.lease / 10) if master_timeout is None else _check_seconds(
            "master_timeout", master_timeout, allow_zero=False)
        if self.master_timeout * 4 > self.lease:
            raise ValueError(f"master_timeout ({master_timeout} s) must be at most a quarter of the lease "
                             f"({self.lease} s): a round takes up to two of them and must leave validity")
        self.telemetry: Telemetry = get_telemetry(tracer_provider, meter_provider)
        self.masters: scripts.Masters = scripts.Masters(clients, self.master_timeout, self.telemetry)
        # The Idempotency-Key records of LockMiddleware need one store: the first master
        # (docs/lock.md, "RedLock quorum"). The locks themselves never use it alone.
        self.redis: aioredis.Redis = clients[0]
        self.quorum: int = self.masters.quorum
        self._cleanup = Cleanup(self.masters)
        self._counts = LockCounts(meter_provider)
        self.telemetry.gauges.add(self._counts)
        # One breaker for the manager, fed by acquire rounds: it opens when a majority of the
        # masters is unreachable round after round (docs/lock.md, "Circuit breaker").
        self._breaker = self._set_breaker(breaker_failures, breaker_cooldown, self.telemetry, self._counts)
        self.id: str = uuid.uuid4().hex[:12]
        self._ids = itertools.count(1)
        self._background = Background("RedLock task")
        self._owns_clients = False
        # key -> loop time until which a new caller of this manager lets the pollers go first
        self._yield_until: dict[str, float] = {}
        # hold -> its renewal in flight; a release waits for it, so that a renewal's
        # take-if-free cannot land after the release and re-create the key
        self._renewing: dict[Lease, asyncio.Future[list[Any]]] = {}

    @classmethod
    def from_urls(cls, urls: Sequence[str], **options: Any) -> "RedLockManager":
        """A manager with one client per URL; redis-py options (socket_timeout, ...) apply to every one."""
        _check_masters(urls, "urls", "Redis URLs", "LockManager.from_url")
        seen = set()
        for url in urls:
            parts = urlsplit(url) if isinstance(url, str) else None
            if parts is None or parts.scheme not in ("redis", "rediss", "unix"):
                raise ValueError(f"unknown Redis URL scheme in {url!r}: use redis://, rediss:// or unix://")
            where = (parts.hostname, parts.port, parts.path) if parts.scheme == "unix" else (parts.hostname, parts.port)
            if where in seen:
                raise ValueError(f"{url!r} names a master already given: each master must be a different Redis")
            seen.add(where)
        mine = {k: options.pop(k) for k in _OPTIONS if k in options}
        # each call is bounded by master_timeout anyway; the socket timeout only closes a dead connection
        options.setdefault("socket_timeout", 2.0)
        options.setdefault("socket_connect_timeout", options["socket_timeout"])
        manager = cls([aioredis.Redis.from_url(url, **options) for url in urls], **mine)
        manager._owns_clients = True
        return manager

    # -- public API ----------------------------------------------------------

    def lock(self, key: str, *, wait: float | None = None, lease: float | None = None, name: str | None = None,
             cancel_on_lost: bool | None = None, share_with_children: bool = False) -> LockContext:
        """`async with manager.lock("stock:1") as held:`; LockTimeout after `wait` seconds."""
        return LockContext(partial(self.acquire, key, wait=wait, lease=lease, name=name,
                                   cancel_on_lost=cancel_on_lost, share_with_children=share_with_children))

    async def try_lock(self, key: str, *, lease: float | None = None, name: str | None = None,
                       cancel_on_lost: bool | None = None, share_with_children: bool = False) -> HeldLock | None:
        """Take the lock if a quorum grants it right now, else None (counted as `busy`)."""
        try:
            return await self.acquire(key, wait=0, lease=lease, name=name, cancel_on_lost=cancel_on_lost,
                                      share_with_children=share_with_children)
        except LockBusy:
            return None

    async def acquire(self, key: str, *, wait: float | None = None, lease: float | None = None,
                      name: str | None = None, cancel_on_lost: bool | None = None,
                      share_with_children: bool = False) -> HeldLock:
        """Acquire and return the hold; release it with `await held.release()`."""
        LockManager._check_key(key)
        wait_s = self.wait if wait is None else _check_seconds("wait", wait, allow_zero=True, allow_inf=True)
        lease_s = self.lease if lease is None else _check_seconds("lease", lease, allow_zero=False)
        if lease_s < self.master_timeout * 4:
            raise ValueError(f"lease ({lease_s} s) must be at least 4 x master_timeout ({self.master_timeout} s): "
                             "a round takes up to two of them and must leave validity")
        if name is not None and (not isinstance(name, str) or not name):
            raise ValueError(f"name must be a non-empty string, not {name!r}")
        held = HELD.get().get((self.id, key))
        if held is not None and not held.ended:
            if held.task is asyncio.current_task():
                return self._reenter(held, child=False)
            if held.share_with_children:
                return self._reenter(held, child=True)
            # a task spawned by the holder: another caller, it waits its turn
        cancel = self.cancel_on_lost if cancel_on_lost is None else bool(cancel_on_lost)
        return await self._acquire(key, wait_s, lease_s, self.renew_interval if lease is None else NEVER,
                                   name or default_name(key), cancel, bool(share_with_children))

    async def aclose(self) -> None:
        """Stop renewals and clean-ups; locks still held expire after their lease."""
        await self._background.aclose()
        self._cleanup.aclose()
        if self._owns_clients:
            for client in self.masters.clients:
                await client.aclose()

    async def __aenter__(self) -> "RedLockManager":
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.aclose()

    # -- acquiring -----------------------------------------------------------

    def _keys(self, key: str) -> tuple[str, str]:
        lock = f"{self.namespace}:{{{key}}}"
        return lock, lock + ":fence"

    async def _acquire(self, key: str, wait: float, lease: float, renew_every: float, name: str,
                       cancel_on_lost: bool, share_with_children: bool) -> HeldLock:
        loop = asyncio.get_running_loop()
        start = loop.time()
        deadline = start + wait
        keys = self._keys(key)
        owner = ""
        outcome, error_type, contended, rounds, probe = "error", None, False, 0, 0
        found, sent_at = Round(), start
        with self.telemetry.acquire_span(name) as span:
            try:
                probe = self._breaker.admit()
                await self._let_others_first(key, deadline)
                while True:
                    rounds += 1
                    # An owner per round: a failed round is undone by owner (in the background on a
                    # master that did not answer), which must never release a later round's grant.
                    owner = f"{self.id}:{next(self._ids)}"
                    sent_at = loop.time()
                    found = await self._round(keys, owner, lease, name)
                    self._breaker.record(found.answered >= self.quorum
                                         or not isinstance(found.error, RedisUnavailable))
                    if found.token:
                        break
                    contended = contended or found.answered >= self.quorum
                    if found.answered < self.quorum:
                        assert found.error is not None
                        raise found.error  # a majority is unreachable: fail fast, like the core
                    now = loop.time()
                    if wait == 0:
                        outcome = "busy"
                        raise LockBusy(f"lock {keys[0]} is held by another owner on a quorum", key=keys[0])
                    if now >= deadline:
                        outcome, error_type = "timeout", "timeout"
                        raise LockTimeout(f"lock {keys[0]} not acquired within {wait} s", key=keys[0])
                    pause = min(self.poll_cap, 0.005 * 2 ** min(rounds, 10))
                    pause = random.uniform(pause / 2, pause)
                    if found.ttl > 0:
                        pause = min(pause, found.ttl + 0.001)
                    await asyncio.sleep(min(pause, deadline - now))
                outcome = "acquired"
            except RedisUnavailable:
                error_type = "redis_unavailable"
                self.telemetry.set_error(span, "redis unavailable")
                raise
            except asyncio.CancelledError:
                outcome = "cancelled"
                raise
            except LockTimeout:
                self.telemetry.set_error(span, outcome)
                raise
            except LockError as error:
                error_type = _error_type(error)  # redis_error or redis_misconfigured
                self.telemetry.set_error(span, "redis error")
                raise
            finally:
                self._breaker.done(probe)
                now = loop.time()
                metric: dict[str, Any] = {"lock.name": name, "lock.outcome": outcome, "lock.contended": contended}
                if error_type:
                    metric["error.type"] = error_type
                self.telemetry.wait_duration.record(now - start, metric)
                if span.is_recording():
                    span.set_attributes(self.telemetry.redact({
                        "lock.name": name, "lock.key": keys[0], "lock.owner": owner, "lock.attempts": rounds,
                        "lock.contended": contended, "lock.outcome": outcome, "lock.token": found.token}))
        hold = Lease(self, key, keys[0], name, owner, found.token, lease, renew_every, cancel_on_lost,
                     sent_at, now, explicit_owner=False, share_with_children=share_with_children)
        hold.span = self.telemetry.start_hold_span(name, self.telemetry.redact({
            "lock.name": name, "lock.key": keys[0], "lock.owner": owner, "lock.token": found.token,
            "lock.lease": lease}))
        self._counts.hold_started(hold)
        self._counts.active[name] += 1
        self._background_task(keep(self, hold))
        HELD.set(MappingProxyType({**HELD.get(), (self.id, key): hold}))
        return HeldLock(hold, 1, outer=True)

    async def _let_others_first(self, key: str, deadline: float) -> None:
        """This manager just released `key` while others polled for it: give them one poll's head start.

        Without it, the releasing process takes the lock straight back (no queue
        holds its place for the waiters), and the waiters starve.
        """
        until = self._yield_until.get(key)
        if until is None:
            return
        now = asyncio.get_running_loop().time()
        if until <= now:
            del self._yield_until[key]
            return
        await asyncio.sleep(random.uniform(0.5, 1.0) * (min(until, deadline) - now))

    async def _round(self, keys: tuple[str, str], owner: str, lease: float, name: str) -> Round:
        """One acquire round on all masters; on failure every master is released before it returns."""
        loop = asyncio.get_running_loop()
        found = Round()
        sent_at = loop.time()
        lease_ms = int(lease * 1000)
        work = asyncio.ensure_future(grant(self, keys, owner, lease_ms, name, found))
        try:
            granted = await asyncio.shield(work)
        except asyncio.CancelledError:
            # a late grant must not outlive the cancelled caller
            work.add_done_callback(lambda _: self._background_task(self._release_all(keys, owner, name, lease)))
            raise
        drift = lease * 0.01 + 0.002
        if granted and sent_at + lease - drift - loop.time() > 0:
            return found
        found.token = 0
        # the masters that answered are released before the caller hears of the failure; the silent
        # ones (whose grant may still land) are asked in the background, so a dead master costs one
        # master_timeout per round, not two
        for index in found.silent:
            self._cleanup.add(index, keys[0], owner, name, lease)
        answered = [i for i in range(len(self.masters.clients)) if i not in found.silent]
        cleanup = self._background.add(self._release_all(keys, owner, name, lease, answered))
        await asyncio.shield(cleanup)  # a cancelled caller still releases everywhere
        return found

    def _reenter(self, hold: Lease, *, child: bool) -> HeldLock:
        """A nested hold (of the task that acquired, or a child it shares with): counted locally."""
        hold.nest(child=child)
        self.telemetry.wait_duration.record(0.0, {"lock.name": hold.name, "lock.outcome": "acquired",
                                                  "lock.contended": False})
        return HeldLock(hold, hold.depth, child=child)

    # -- keeping, releasing, losing ------------------------------------------

    async def _release(self, held: HeldLock) -> bool:
        hold = held._lease
        if held._child:
            hold.unnest(child=True)
            return not hold.ended and not hold.lost.is_set()
        if held._outer and hold.child_holds > 0:
            hold.closing = True  # no new child may enter; those inside finish first
            await hold.children_done.wait()
        if hold.ended:
            return False
        hold.depth -= 1
        if hold.depth > 0:
            return not hold.lost.is_set()
        hold.closing = True
        lost = hold.lost.is_set()
        hold.ended = True  # stops the renewals
        renewing = self._renewing.get(hold)
        if renewing is not None:
            await asyncio.wait({renewing})  # bounded by master_timeout
        keys = self._keys(hold.lock_key)
        answers = await self.masters.call(scripts.release, keys, [hold.owner], "release", hold.name)
        failed = [i for i, a in enumerate(answers) if isinstance(a, LockError)]
        for index in failed:
            self._cleanup.add(index, keys[0], hold.owner, hold.name, hold.lease_seconds)
        ours = sum(1 for a in answers if a in (1, 2))
        if any(a == 2 for a in answers):
            self._yield_until[hold.lock_key] = asyncio.get_running_loop().time() + self.poll_cap
            if len(self._yield_until) > 10_000:
                self._yield_until.clear()  # a bound, not a cache
        if ours >= self.quorum and not lost:
            self._end(hold, "released")
            return True
        if len(answers) - len(failed) < self.quorum and not lost:
            self._end(hold, "error")
            raise RedisUnavailable(f"release of {keys[0]} reached only {len(answers) - len(failed)} of "
                                   f"{len(answers)} masters; the rest expire after the lease", key=keys[0])
        if not lost:
            self._lose(hold, "the lock was no longer held by a quorum at release", count=False)
        self._end(hold, "lost" if hold.renew else "expired")
        return False

    async def _release_all(self, keys: tuple[str, str], owner: str, name: str, lease: float,
                           only: list[int] | None = None) -> None:
        which = list(range(len(self.masters.clients))) if only is None else only
        if not which:
            return
        answers = await self.masters.call(scripts.release, keys, [owner], "release", name, only=which)
        for index, answer in zip(which, answers):
            if isinstance(answer, LockError):
                self._cleanup.add(index, keys[0], owner, name, lease)

    def _end(self, hold: Lease, outcome: str) -> None:
        hold.ended = True
        self._finish(hold, outcome)

    def _background_task(self, coro: Coroutine[Any, Any, Any]) -> None:
        self._background.add(coro)
