"""LockManager: acquire, re-enter, wait, release, lose.

Reentrancy is per key and per context: a context variable maps each key this
task (or its parent, when the task was spawned) holds to its lease, so a
nested `lock("k")` re-enters with the same owner while any other caller
(a sibling task, another request) acquires with a fresh owner and waits.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import random
import time
import uuid
from contextvars import ContextVar
from functools import partial
from types import MappingProxyType
from typing import Any, Mapping
from urllib.parse import urlsplit

import redis.asyncio as aioredis
from opentelemetry import trace
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.asyncio.retry import Retry

from . import _scripts
from ._connection import Connection
from ._errors import LockError, LockLost, LockTimeout, RedisUnavailable
from ._held import HeldLock, Lease, LockInfo, _LockContext
from ..telemetry._instruments import LockCounts, Telemetry, current_traceparent, get_telemetry, suppressed
from ._waiting import PROMOTED, Grant, Waiting
from ._watchdog import Watchdog

log = logging.getLogger("otel_lock")

MAX_KEY_LENGTH = 512
MIN_LEASE = 0.1
UNDO_RETRY = 0.25
_DEFAULT: Any = object()
_HELD: ContextVar[Mapping[tuple[str, str], "Lease"]] = ContextVar("otel_lock_held", default=MappingProxyType({}))
_MANAGER_OPTIONS = (
    "namespace", "lease", "wait", "cancel_on_lost", "fence_ttl", "grace", "poll_cap",
    "renew_interval", "tracer_provider", "meter_provider",
)


def _text(value: bytes | str | None) -> str:
    return value.decode() if isinstance(value, bytes) else (value or "")


def default_name(key: str) -> str:
    """`lock.name` when none is given: the key up to its first ':', so ids stay off metrics."""
    return key.split(":", 1)[0]


def _check_seconds(what: str, value: float, *, allow_zero: bool, allow_inf: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{what} must be a number of seconds, not {value!r}")
    if math.isnan(value) or value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"{what} must be {'>= 0' if allow_zero else '> 0'} seconds, not {value!r}")
    if math.isinf(value) and not allow_inf:
        raise ValueError(f"{what} must be finite, not {value!r}")
    return float(value)


class LockManager:
    """Hands out locks from one Redis; one subscriber and one watchdog per manager."""

    def __init__(self, redis: aioredis.Redis, *, namespace: str = "otel-lock", lease: float = 30.0,
                 wait: float = 5.0, cancel_on_lost: bool = False, fence_ttl: float = 3600.0,
                 grace: float = 0.5, poll_cap: float = 0.5, renew_interval: float | None = None,
                 tracer_provider=None, meter_provider=None) -> None:
        if not isinstance(namespace, str) or not namespace or "{" in namespace or "}" in namespace:
            raise ValueError(f"namespace must be a non-empty string without '{{' or '}}', not {namespace!r}")
        self.redis = redis
        self.namespace = namespace
        self.lease = _check_seconds("lease", lease, allow_zero=False)
        if self.lease < MIN_LEASE:
            raise ValueError(f"lease must be at least {MIN_LEASE} s, not {lease!r}")
        self.renew_interval = self.lease / 3 if renew_interval is None else _check_seconds(
            "renew_interval", renew_interval, allow_zero=False)
        if self.renew_interval >= self.lease:
            raise ValueError(f"lease ({lease} s) must be longer than the renewal interval ({self.renew_interval} s)")
        self.wait = _check_seconds("wait", wait, allow_zero=True, allow_inf=True)
        self.cancel_on_lost = bool(cancel_on_lost)
        self.fence_ttl_ms = int(_check_seconds("fence_ttl", fence_ttl, allow_zero=False) * 1000)
        self.grace_ms = int(_check_seconds("grace", grace, allow_zero=False) * 1000)
        self.poll_cap = _check_seconds("poll_cap", poll_cap, allow_zero=False)
        self.telemetry: Telemetry = get_telemetry(tracer_provider, meter_provider)
        self._counts = LockCounts(meter_provider)
        self.telemetry.gauges.add(self._counts)
        self.id = uuid.uuid4().hex[:12]
        self._ids = itertools.count(1)
        # The hot path (scripts, renewals, the subscriber) uses a lean pipelined
        # connection to the same server when the client allows; else redis-py.
        self._direct = Connection.for_client(redis)
        self._client = self._direct or redis
        subscriber = partial(Connection.for_client, redis) if self._direct else None
        self._waiting = Waiting(redis, f"{namespace}:wake:{self.id}", subscriber)
        self._watchdog = Watchdog(self)
        self._owns_client = False
        self._background: set[asyncio.Task] = set()

    @classmethod
    def from_url(cls, url: str, **options: Any) -> "LockManager":
        """A manager with its own client; Redis options (socket_timeout, ...) go to redis-py."""
        scheme = urlsplit(url).scheme if isinstance(url, str) else None
        if scheme not in ("redis", "rediss", "unix"):
            raise ValueError(f"unknown Redis URL scheme in {url!r}: use redis://, rediss:// or unix://")
        manager_options = {k: options.pop(k) for k in _MANAGER_OPTIONS if k in options}
        options.setdefault("socket_timeout", 2.0)
        options.setdefault("socket_connect_timeout", options["socket_timeout"])
        # One immediate retry of a refused/reset connection (a pooled connection
        # that died with a Redis restart); a timeout is not retried, so an outage
        # surfaces within the socket timeout.
        options.setdefault("retry", Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,)))
        manager = cls(aioredis.Redis.from_url(url, **options), **manager_options)
        manager._owns_client = True
        return manager

    # -- public API ----------------------------------------------------------

    def lock(self, key: str, *, wait: float | None = None, lease: float | None = None, owner: str | None = None,
             name: str | None = None, cancel_on_lost: bool | None = None) -> _LockContext:
        """`async with manager.lock("stock:1") as held:`; LockTimeout after `wait` seconds."""
        return _LockContext(self, dict(key=key, wait=wait, lease=lease, owner=owner, name=name,
                                       cancel_on_lost=cancel_on_lost))

    async def try_lock(self, key: str, *, lease: float | None = None, owner: str | None = None,
                       name: str | None = None, cancel_on_lost: bool | None = None) -> HeldLock | None:
        """Take the lock if it is free right now, else None (no waiting)."""
        try:
            return await self.acquire(key, wait=0, lease=lease, owner=owner, name=name, cancel_on_lost=cancel_on_lost)
        except LockTimeout:
            return None

    async def acquire(self, key: str, *, wait: float | None = None, lease: float | None = None,
                      owner: str | None = None, name: str | None = None,
                      cancel_on_lost: bool | None = None) -> HeldLock:
        """Acquire and return the hold; release it with `await held.release()`."""
        self._check_key(key)
        wait = self.wait if wait is None else _check_seconds("wait", wait, allow_zero=True, allow_inf=True)
        renew = lease is None
        lease = self.lease if lease is None else _check_seconds("lease", lease, allow_zero=False)
        if lease < 0.01:
            raise ValueError(f"lease must be at least 0.01 s, not {lease!r}")
        if owner is not None and (not isinstance(owner, str) or not owner):
            raise ValueError(f"owner must be a non-empty string, not {owner!r}")
        name = name or default_name(key)
        cancel_on_lost = self.cancel_on_lost if cancel_on_lost is None else cancel_on_lost
        held = _HELD.get().get((self.id, key)) if owner is None else None
        if held is not None and not held.ended and not held.lost.is_set():
            return await self._reenter(held)
        return await self._acquire(key, wait, lease, renew, owner, name, cancel_on_lost)

    async def held_locks(self) -> list[LockInfo]:
        """Every lock held in this namespace (SCAN, for operators)."""
        try:
            return await self._held_locks()
        except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
            raise RedisUnavailable(f"Redis is unavailable (listing locks): {exc}") from exc

    async def _held_locks(self) -> list[LockInfo]:
        pattern = _glob_escape(self.namespace) + ":{*}"
        keys = [_text(k) async for k in self.redis.scan_iter(match=pattern, count=1000)]
        if not keys:
            return []
        pipe = self.redis.pipeline(transaction=False)
        for key in keys:
            pipe.hgetall(key)
            pipe.pttl(key)
        answers = await pipe.execute()
        infos = []
        for key, fields, pttl in zip(keys, answers[::2], answers[1::2]):
            fields = {_text(k): _text(v) for k, v in fields.items()}
            if fields.get("owner"):
                infos.append(LockInfo(key, fields["owner"], int(fields.get("depth") or 0),
                                      max(pttl, 0) / 1000, int(fields.get("token") or 0)))
        return sorted(infos, key=lambda info: info.key)

    async def force_release(self, key: str) -> bool:
        """Release whoever holds `key` (an operator's last resort); waiters are handed the lock."""
        self._check_key(key)
        keys = self._keys(key)
        try:
            owner = await self.redis.hget(keys[0], "owner")
        except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
            raise RedisUnavailable(f"Redis is unavailable (forced release of {keys[0]}): {exc}", key=keys[0]) from exc
        released = bool(await self._call(_scripts.force_release, keys, [self.fence_ttl_ms, self.grace_ms],
                                         "release", default_name(key)))
        if released:
            log.warning("otel-lock: forced release of %s (owner was %s)", keys[0], _text(owner))
        return released

    async def aclose(self) -> None:
        """Stop the watchdog and subscriber; locks still held expire after their lease."""
        await self._watchdog.aclose()
        await self._waiting.aclose()
        for task in list(self._background):
            task.cancel()
        if self._direct is not None:
            await self._direct.aclose()
        if self._owns_client:
            await self.redis.aclose()

    async def __aenter__(self) -> "LockManager":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # -- acquiring -------------------------------------------------------------

    def _keys(self, key: str) -> tuple[str, str, str, str]:
        lock = f"{self.namespace}:{{{key}}}"
        return lock, lock + ":fence", lock + ":q", lock + ":w"

    @staticmethod
    def _check_key(key: str) -> None:
        if not isinstance(key, str) or not key:
            raise ValueError(f"lock key must be a non-empty string, not {key!r}")
        if len(key) > MAX_KEY_LENGTH:
            raise ValueError(f"lock key is {len(key)} characters long; the limit is {MAX_KEY_LENGTH}")
        if "{" in key or "}" in key:
            raise ValueError(f"lock key {key!r} must not contain '{{' or '}}' (they delimit the Redis Cluster hash tag)")

    async def _reenter(self, lease: Lease) -> HeldLock:
        telemetry = self.telemetry
        with telemetry.acquire_span(lease.name) as span:
            res = await self._acquire_call(self._keys(lease.lock_key),
                                           [lease.owner, "-", lease.renew_ms, "1", "-1", "", self.fence_ttl_ms, ""],
                                           lease.name)
            if res[0] != 1:
                self._lose(lease, "the lease was gone when the lock was re-entered")
                raise LockLost(f"lease of {lease.key} was lost before re-entry", key=lease.key)
            lease.depth += 1
            depth = int(res[2])
            if span.is_recording():
                span.set_attributes({"lock.name": lease.name, "lock.key": lease.key, "lock.owner": lease.owner,
                                     "lock.token": lease.token, "lock.depth": depth, "lock.attempts": 1,
                                     "lock.contended": False, "lock.outcome": "acquired"})
            telemetry.wait_duration.record(0.0, {"lock.name": lease.name, "lock.outcome": "acquired",
                                                 "lock.contended": False})
        return HeldLock(lease, depth)

    async def _acquire(self, key: str, wait: float, lease: float, renew: bool, owner: str | None,
                       name: str, cancel_on_lost: bool) -> HeldLock:
        telemetry = self.telemetry
        loop = asyncio.get_running_loop()
        start = loop.time()
        deadline = start + wait
        waiter_id = f"{self.id}:{next(self._ids)}"
        owner = owner or waiter_id
        reenter = "0" if owner == waiter_id else "1"
        keys = self._keys(key)
        lease_ms = int(lease * 1000)
        ctx = current_traceparent() if trace.get_current_span().get_span_context().is_valid else ""
        outcome, error_type, contended, attempts = "error", None, False, 0
        granted_for = lease

        def args(queue_ms: str) -> list:
            return [owner, waiter_id, lease_ms, reenter, queue_ms, ctx, self.fence_ttl_ms, self._waiting.channel]

        def budget() -> str:
            return "0" if math.isinf(wait) else str(max(1, int((deadline - loop.time()) * 1000)))

        with telemetry.acquire_span(name) as span:
            try:
                queued = wait > 0 and self._waiting.ready
                sent_us = time.monotonic_ns() // 1000
                res = await self._acquire_call(keys, args(budget() if queued else "-1"), name)
                attempts = 1
                if res[0] != 1:
                    contended = True
                    telemetry.link_holder(span, _text(res[2]))
                    if wait <= 0:
                        raise LockTimeout(f"lock {keys[0]} is held by another owner", key=keys[0])
                    res, granted_for, more = await self._wait(keys, args, budget, queued, deadline, res, sent_us, name)
                    attempts += more
                outcome = "acquired"
            except LockTimeout:
                outcome, error_type = "timeout", "timeout"
                telemetry.set_error(span, "timeout")
                raise
            except asyncio.CancelledError:
                outcome = "cancelled"
                raise
            except RedisUnavailable:
                error_type = "redis_unavailable"
                telemetry.set_error(span, "redis unavailable")
                raise
            except LockError:
                error_type = "redis_error"
                telemetry.set_error(span, "redis error")
                raise
            finally:
                now = loop.time()
                metric = {"lock.name": name, "lock.outcome": outcome, "lock.contended": contended}
                if error_type:
                    metric["error.type"] = error_type
                telemetry.wait_duration.record(now - start, metric)
                if span.is_recording():
                    span.set_attributes({"lock.name": name, "lock.key": keys[0], "lock.owner": owner,
                                         "lock.attempts": attempts, "lock.contended": contended,
                                         "lock.outcome": outcome})
            token, depth = int(res[1]), int(res[2])
            if span.is_recording():
                span.set_attributes({"lock.token": token, "lock.depth": depth})
        held_lease = Lease(self, key, name, owner, token, lease, renew, cancel_on_lost, now, granted_for)
        held_lease.shared = reenter == "1"
        if depth > 1:  # explicit shared owner that already held it
            held_lease.depth = depth
        self._counts.active[name] += 1
        self._watchdog.add(held_lease)
        _HELD.set(MappingProxyType({**_HELD.get(), (self.id, key): held_lease}))
        return HeldLock(held_lease, depth)

    async def _wait(self, keys, args, budget, queued, deadline, res, sent_us, name):
        """Wait in the queue until handed the lock, polling only as a fallback."""
        loop = asyncio.get_running_loop()
        self._counts.pending[name] += 1
        waiter = None
        attempts = 0
        try:
            try:
                await self._waiting.start()
            except (RedisError, OSError) as exc:
                raise RedisUnavailable(f"Redis is unavailable (subscribe): {exc}", key=keys[0]) from exc
            waiter = self._waiting.add(args("-")[1], keys[0])
            if not queued:
                sent_us = time.monotonic_ns() // 1000
                res = await self._acquire_call(keys, args(budget()), name)
                attempts += 1
                if res[0] == 1:
                    return res, math.inf, attempts
            clock = _RedisClock()
            clock.note(res, sent_us)
            pttl = int(res[1])
            while True:
                remaining = deadline - loop.time()
                value = waiter.grant() if remaining <= 0 else None
                if remaining <= 0 and value is None:
                    raise LockTimeout(f"lock {keys[0]} was not acquired within the wait", key=keys[0])
                if value is None:
                    timeout = remaining
                    if self._waiting.is_first(waiter):
                        timeout = min(timeout, self._poll_delay(pttl))
                    value = await waiter.next(None if math.isinf(timeout) else timeout)
                if isinstance(value, Grant):
                    left = clock.grace_left(value, self.grace_ms / 1000)
                    if left is not None:
                        return [1, value.token, 1], left, attempts
                    # Read too late (the process was paused, or its loop blocked):
                    # the grant may have expired and gone to someone else. Ask Redis.
                elif value == PROMOTED or (value is None and deadline <= loop.time()):
                    continue
                sent_us = time.monotonic_ns() // 1000
                res = await self._acquire_call(keys, args(budget()), name)
                attempts += 1
                if res[0] == 1:
                    return res, math.inf, attempts
                clock.note(res, sent_us)
                pttl = int(res[1])
        except BaseException:
            if waiter is not None:
                await asyncio.shield(self._abandon(keys, args("-"), waiter, name))
            raise
        finally:
            if waiter is not None:
                self._waiting.remove(waiter)
            self._counts.pending[name] -= 1

    async def _acquire_call(self, keys, args, name):
        """ACQUIRE, safe to cancel: a reply that arrives after its caller left is undone."""
        call = asyncio.ensure_future(self._call(_scripts.acquire, keys, args, "acquire", name))
        try:
            return await asyncio.shield(call)
        except asyncio.CancelledError:
            call.add_done_callback(partial(self._undo_acquire, keys, args, name))
            raise
        except RedisUnavailable:
            # The script may have run and only its reply was lost: the caller
            # is told "no", so nothing it might have taken may stay behind.
            if args[0] == args[1]:  # a fresh owner; a re-entry's undo would hit the outer hold
                self._background_task(self._release_when_back(keys, args[0], name, int(args[2]) / 1000, args))
            raise

    def _undo_acquire(self, keys, args, name, call: asyncio.Future) -> None:
        if call.cancelled():
            return
        if call.exception() is not None:
            if isinstance(call.exception(), RedisUnavailable) and args[0] == args[1]:
                self._background_task(self._release_when_back(keys, args[0], name, int(args[2]) / 1000, args))
            return
        if call.result()[0] == 1:
            private = "1" if args[0] == args[1] else "0"  # a re-entry's undo only takes back its own count
            self._background_task(self._call(_scripts.release, keys,
                                             [args[0], self.fence_ttl_ms, self.grace_ms, private], "release", name))
        elif args[4] != "-1":
            self._background_task(self._leave(keys, args, name))

    def _leave(self, keys, args, name):
        return self._call(_scripts.leave, keys, [args[1], args[0], self.fence_ttl_ms, self.grace_ms], "release", name)

    async def _release_when_back(self, keys, owner: str, name: str, lease: float, args=None) -> None:
        """Release a private owner (and leave its queue), retried until Redis answers or the lease ran out."""
        loop = asyncio.get_running_loop()
        give_up = loop.time() + lease
        while True:
            try:
                await self._call(_scripts.release, keys, [owner, self.fence_ttl_ms, self.grace_ms, "1"],
                                 "release", name)
                if args is not None:
                    await self._leave(keys, args, name)
                return
            except RedisUnavailable:
                if loop.time() > give_up:
                    return
                await asyncio.sleep(UNDO_RETRY)

    def _background_task(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background_done)

    def _background_done(self, task: asyncio.Task) -> None:
        self._background.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("otel-lock: background clean-up (undo or release) failed: %s", task.exception())

    def _poll_delay(self, pttl_ms: int) -> float:
        """Fallback poll: when the holder's lease would run out, at most `poll_cap`, jittered."""
        bound = self.poll_cap if pttl_ms < 0 else min(pttl_ms / 1000, self.poll_cap)
        return max(0.005, bound) * random.uniform(0.8, 1.1)

    async def _abandon(self, keys, args, waiter, name) -> None:
        """A waiter gives up: leave the queue, or pass on a lock handed to it meanwhile."""
        owner, waiter_id = args[0], args[1]
        try:
            if waiter.grant() is not None:
                private = "1" if owner == waiter_id else "0"
                await self._call(_scripts.release, keys, [owner, self.fence_ttl_ms, self.grace_ms, private],
                                 "release", name)
            else:
                await self._call(_scripts.leave, keys, [waiter_id, owner, self.fence_ttl_ms, self.grace_ms],
                                 "release", name)
        except LockError as error:
            # The queue entry expires with its deadline; a hand-over to us after `grace`.
            log.warning("otel-lock: could not leave the queue of %s: %s", keys[0], error)

    # -- releasing and losing ------------------------------------------------

    def _forget(self, held: HeldLock) -> None:
        """Drop the key from this context's held map when its outermost hold ends."""
        lease = held._lease
        if lease.depth > 1:
            return
        current = _HELD.get()
        ident = (self.id, lease.lock_key)
        if current.get(ident) is lease:
            _HELD.set(MappingProxyType({k: v for k, v in current.items() if k != ident}))

    async def _release(self, held: HeldLock) -> bool:
        lease = held._lease
        if lease.ended:
            return False
        lease.depth -= 1
        final = lease.depth <= 0
        if final:
            self._watchdog.discard(lease)  # never renew what is being released
        keys = self._keys(lease.lock_key)
        release_all = "1" if final and not lease.shared else "0"
        try:
            res = await self._call(_scripts.release, keys, [lease.owner, self.fence_ttl_ms, self.grace_ms,
                                                            release_all], "release", lease.name)
        except LockError as error:
            if final:
                self._end(lease, "error")
                if isinstance(error, RedisUnavailable) and not lease.shared:
                    # Let the next caller in as soon as Redis is back, not after the lease.
                    self._background_task(self._release_when_back(keys, lease.owner, lease.name,
                                                                  lease.renew_ms / 1000))
            raise
        if res == -1:
            outcome = "lost" if lease.renew else "expired"
            if not lease.lost.is_set():
                self._lose(lease, "the lock was no longer ours at release", count=False)
            self._end(lease, outcome)
            return False
        if final:
            self._end(lease, "released")
        return True

    def _end(self, lease: Lease, outcome: str) -> None:
        if lease.ended:
            return
        lease.ended = True
        self._watchdog.discard(lease)
        loop = asyncio.get_running_loop()
        self.telemetry.hold_duration.record(loop.time() - lease.acquired_at,
                                            {"lock.name": lease.name, "lock.release.outcome": outcome})
        self._counts.active[lease.name] -= 1
        if lease.span.is_recording():
            lease.span.add_event(f"lock {outcome}", {"lock.name": lease.name, "lock.token": lease.token})

    def _lose(self, lease: Lease, reason: str, count: bool = True) -> None:
        """The lease is gone: tell the holder, and cancel it if it asked for that."""
        if lease.lost.is_set():
            return
        lease.lost_reason = reason
        lease.lost.set()
        self._watchdog.discard(lease)
        if count and lease.renew:
            self.telemetry.renewals.add(1, {"lock.name": lease.name, "lock.renewal.outcome": "lost"})
        if lease.span.is_recording():
            lease.span.add_event("lock lost", {"lock.name": lease.name, "lock.token": lease.token,
                                               "lock.lost.reason": reason})
        log.warning("otel-lock: lease of %s lost: %s", lease.key, reason)
        task = lease.task
        if lease.cancel_on_lost and task is not None and not task.done() and not lease.ended:
            lease.cancelled_by_us = True
            task.cancel(f"otel-lock: lease of {lease.key} lost")

    def _count_renewal(self, lease: Lease, outcome: str, error: BaseException | None = None) -> None:
        self.telemetry.renewals.add(1, {"lock.name": lease.name, "lock.renewal.outcome": outcome})
        if error is not None:
            self.telemetry.errors.add(1, {"lock.name": lease.name, "lock.operation": "renew",
                                          "error.type": _error_type(error)})
            if lease.span.is_recording():
                lease.span.add_event("lock renewal failed", {"lock.name": lease.name, "error.type": _error_type(error)})

    # -- Redis -----------------------------------------------------------------

    async def _call(self, script: _scripts.Script, keys, args, operation: str, name: str):
        try:
            if self._direct is not None:  # no Redis instrumentation sees the lean connection
                return await script(self._direct, keys, args)
            with suppressed():
                return await script(self.redis, keys, args)
        except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
            self.telemetry.errors.add(1, {"lock.name": name, "lock.operation": operation,
                                          "error.type": "redis_unavailable"})
            raise RedisUnavailable(f"Redis is unavailable ({operation} {keys[0]}): {exc}", key=keys[0]) from exc
        except RedisError as exc:
            self.telemetry.errors.add(1, {"lock.name": name, "lock.operation": operation,
                                          "error.type": "redis_error"})
            raise LockError(f"Redis refused {operation} of {keys[0]}: {exc}", key=keys[0]) from exc


def _error_type(error: BaseException) -> str:
    if isinstance(error, (RedisConnectionError, RedisTimeoutError, OSError)):
        return "redis_unavailable"
    return "redis_error"


def _glob_escape(text: str) -> str:
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


class _RedisClock:
    """Redis' time as seen from here, to tell how old a hand-over is when it is read.

    Queued replies carry Redis' TIME, taken after the request was sent, so
    `redis time - local monotonic time at sending` bounds the offset between
    the two clocks from above (the local side never steps),
    however late the reply is read (a blocked loop, a stalled socket). With
    that bound a grant can only look older than it is, never fresher: a grant
    that waited in the socket while this process was stopped is caught, and
    a fresh one costs at most a needless check.
    """

    def __init__(self) -> None:
        self.offset_us: int | None = None

    def note(self, reply, sent_us: int) -> None:
        if len(reply) > 3 and int(reply[3]) > 0:
            bound = int(reply[3]) - sent_us
            self.offset_us = bound if self.offset_us is None else min(self.offset_us, bound)

    def grace_left(self, grant: Grant, grace: float) -> float | None:
        """Seconds of the hand-over's lease left, or None when too little is left to trust it."""
        if self.offset_us is None:
            return grace
        left = grace - (time.monotonic_ns() // 1000 + self.offset_us - grant.at_us) / 1e6
        return left if left > grace / 2 else None
