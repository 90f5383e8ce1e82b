"""LockManager: acquire, re-enter, release, lose.

Re-entry belongs to one task: a context variable maps each key the current
context holds to its lease, and a nested `lock("k")` re-enters only when the
caller is the task that acquired it. A task spawned while the lock is held
inherits the map but not the hold: it acquires with a fresh owner and waits
like any other caller, unless the outer hold was taken with
`share_with_children=True`, in which case it re-enters and the outer release
waits for it.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid
from functools import partial
from types import MappingProxyType, TracebackType
from typing import Any, Coroutine
from urllib.parse import urlsplit

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster
from opentelemetry import trace
from opentelemetry.metrics import MeterProvider
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError

from . import _scripts
from ._attempt import Attempt
from ._background import Background
from ._cluster import SCHEME as CLUSTER_SCHEME
from ._cluster import cluster_client, is_cluster
from ._connection import Connection
from ._errors import LockBusy, LockError, LockLost, LockTimeout, RedisUnavailable, to_lock_error
from ._ending import Ending, _error_type
from ._options import (MAX_KEY_LENGTH, _MANAGER_OPTIONS, CommonOptions, _check_seconds, _glob_escape, _text,
                       default_name)
from ._held import HELD, NEVER, HeldLock, Lease, LockContext, LockInfo
from ._replicas import Replicated, check_replicas
from ._routed import RoutedConnections
from ._sentinel import SCHEME as SENTINEL_SCHEME
from ._sentinel import MasterConnection, MasterWatch, master_client
from ._sharded import ShardedWaiting
from ._waiting import Waiting
from ._watchdog import Watchdog
from ..telemetry._instruments import LockCounts, Telemetry, current_traceparent, get_telemetry, suppressed

log = logging.getLogger("otel_lock")

class LockManager(Ending, CommonOptions):
    """Hands out locks from one Redis; one subscriber and one watchdog per manager."""

    def __init__(self, redis: aioredis.Redis | RedisCluster, *, namespace: str = "otel-lock", lease: float = 30.0,
                 wait: float = 5.0, cancel_on_lost: bool = False, fence_ttl: float = 3600.0,
                 poll_cap: float = 0.5, renew_interval: float | None = None,
                 tracer_provider: trace.TracerProvider | None = None,
                 meter_provider: MeterProvider | None = None, wait_replicas: int = 0,
                 wait_replicas_timeout: float = 0.5, breaker_failures: int = 5,
                 breaker_cooldown: float = 1.0) -> None:
        self._set_common_options(namespace, lease, renew_interval, wait, cancel_on_lost, fence_ttl, poll_cap)
        self.redis: aioredis.Redis | RedisCluster = redis
        self._cluster = is_cluster(redis)
        if self._cluster and wait_replicas:
            raise ValueError("wait_replicas is not supported with Redis Cluster (it needs WAIT on the "
                             "connection that ran the script; see docs/lock.md)")
        replicas, replicas_timeout = check_replicas(redis, wait_replicas, wait_replicas_timeout)
        self.wait_replicas: int = replicas
        self.wait_replicas_timeout: float = replicas_timeout
        # With wait_replicas, ACQUIRE is followed by WAIT on its own connection (docs/lock.md, Sentinel).
        self._acquire_script: _scripts.Script = _scripts.acquire if not self.wait_replicas else Replicated(
            _scripts.acquire, self.wait_replicas, int(self.wait_replicas_timeout * 1000))
        self.telemetry: Telemetry = get_telemetry(tracer_provider, meter_provider)
        self._counts = LockCounts(meter_provider)
        self.telemetry.gauges.add(self._counts)
        self._counts.watch_connections(self._connection_figures, pool_name=namespace)
        # New acquisitions fail at once while Redis keeps failing (docs/lock.md, "Circuit breaker").
        self._breaker = self._set_breaker(breaker_failures, breaker_cooldown, self.telemetry, self._counts)
        self.id: str = uuid.uuid4().hex[:12]
        self._ids = itertools.count(1)
        # The hot path (scripts, renewals, the subscriber) uses a lean pipelined
        # connection to the same server when the client allows; else redis-py.
        plain = Connection.for_client(redis)
        # Behind Sentinel: leave a demoted master as soon as the Sentinels name another.
        self._master_watch = MasterWatch.for_client(redis)
        self._direct: Connection | None = plain or MasterConnection.for_master(redis, self._master_watch)
        # On a Redis Cluster: one lean connection per master, each script routed by slot.
        self._routed = RoutedConnections.for_client(redis)
        self._client: _scripts.ScriptClient = self._direct or self._routed or redis
        subscriber = partial(Connection.for_client, redis) if plain else (
            partial(MasterConnection.for_master, redis, self._master_watch) if self._direct else None)
        channel = f"{namespace}:wake:{self.id}"
        self._waiting = ShardedWaiting(redis, channel, self._pass_on) if isinstance(redis, RedisCluster) else Waiting(
            redis, channel, subscriber, self._pass_on,
            self._master_watch.check if self._master_watch is not None else None)
        self._watchdog = Watchdog(self)
        self._owns_client = False
        self._background = Background("clean-up (undo, release or pass-on)")

    @classmethod
    def from_url(cls, url: str, **options: Any) -> "LockManager":
        """A manager with its own client; Redis options (socket_timeout, ...) go to redis-py.

        The client's pool blocks when all `max_connections` (default 64) are
        busy, for at most `pool_timeout` seconds (default 5), so a burst
        queues instead of failing; past that the caller gets RedisUnavailable.
        """
        scheme = urlsplit(url).scheme if isinstance(url, str) else None
        if scheme not in ("redis", "rediss", "unix", SENTINEL_SCHEME, CLUSTER_SCHEME):
            raise ValueError(f"unknown Redis URL scheme in {url!r}: use redis://, rediss://, unix://, "
                             f"{SENTINEL_SCHEME}:// or {CLUSTER_SCHEME}://")
        manager_options = {k: options.pop(k) for k in _MANAGER_OPTIONS if k in options}
        options.setdefault("socket_timeout", 2.0)
        options.setdefault("socket_connect_timeout", options["socket_timeout"])
        options.setdefault("max_connections", 64)
        pool_timeout = _check_seconds("pool_timeout", options.pop("pool_timeout", 5.0), allow_zero=False)
        if scheme == CLUSTER_SCHEME:  # its own retry: see _cluster.cluster_client
            manager = cls(cluster_client(url, options), **manager_options)
            manager._owns_client = True
            return manager
        # One immediate retry of a refused/reset connection (a pooled connection
        # that died with a Redis restart); a timeout is not retried, so an outage
        # surfaces within the socket timeout.
        options.setdefault("retry", Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,)))
        if scheme == SENTINEL_SCHEME:
            client: aioredis.Redis = master_client(url, pool_timeout, options)
        else:
            client = aioredis.Redis.from_pool(
                aioredis.BlockingConnectionPool.from_url(url, timeout=pool_timeout, **options))
        manager = cls(client, **manager_options)
        manager._owns_client = True
        return manager

    # -- public API ----------------------------------------------------------

    def lock(self, key: str, *, wait: float | None = None, lease: float | None = None, owner: str | None = None,
             name: str | None = None, cancel_on_lost: bool | None = None,
             share_with_children: bool = False) -> LockContext:
        """`async with manager.lock("stock:1") as held:`; LockTimeout after `wait` seconds."""
        return LockContext(partial(self.acquire, key, wait=wait, lease=lease, owner=owner, name=name,
                                   cancel_on_lost=cancel_on_lost, share_with_children=share_with_children))

    async def try_lock(self, key: str, *, lease: float | None = None, owner: str | None = None,
                       name: str | None = None, cancel_on_lost: bool | None = None,
                       share_with_children: bool = False) -> HeldLock | None:
        """Take the lock if it is free right now, else None (no waiting; counted as `busy`)."""
        try:
            return await self.acquire(key, wait=0, lease=lease, owner=owner, name=name,
                                      cancel_on_lost=cancel_on_lost, share_with_children=share_with_children)
        except LockBusy:
            return None

    async def acquire(self, key: str, *, wait: float | None = None, lease: float | None = None,
                      owner: str | None = None, name: str | None = None, cancel_on_lost: bool | None = None,
                      share_with_children: bool = False) -> HeldLock:
        """Acquire and return the hold; release it with `await held.release()`."""
        self._check_key(key)
        wait = self.wait if wait is None else _check_seconds("wait", wait, allow_zero=True, allow_inf=True)
        lease_s = self.lease if lease is None else _check_seconds("lease", lease, allow_zero=False)
        if lease_s < 0.01:
            raise ValueError(f"lease must be at least 0.01 s, not {lease!r}")
        if owner is not None and (not isinstance(owner, str) or not owner):
            raise ValueError(f"owner must be a non-empty string, not {owner!r}")
        if owner is None:
            held = HELD.get().get((self.id, key))
            if held is not None and not held.ended:
                if held.task is asyncio.current_task():
                    return await self._reenter(held, child=False)
                if held.share_with_children:
                    return await self._reenter(held, child=True)
                # a task spawned by the holder: another caller, it waits its turn
        cancel_on_lost = self.cancel_on_lost if cancel_on_lost is None else bool(cancel_on_lost)
        renew_every = self.renew_interval if lease is None else NEVER
        return await self._acquire(key, wait, lease_s, renew_every, owner, name or default_name(key),
                                   cancel_on_lost, bool(share_with_children))

    async def held_locks(self) -> list[LockInfo]:
        """Every lock held in this namespace (SCAN, for operators)."""
        try:
            return await self._held_locks()
        except (RedisError, OSError) as exc:
            raise to_lock_error(exc, "listing locks", client=self.redis) from exc

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
        """Release whoever holds `key` (an operator's last resort); the next waiter gets it."""
        self._check_key(key)
        keys = self._keys(key)
        try:
            owner = await self.redis.hget(keys[0], "owner")
        except (RedisError, OSError) as exc:
            raise to_lock_error(exc, f"forced release of {keys[0]}", key=keys[0], client=self.redis) from exc
        released = bool(await self._call(_scripts.force_release, keys, [self.fence_ttl_ms], "release",
                                         default_name(key)))
        if released:
            log.warning("otel-lock: forced release of %s (owner was %s)", keys[0], _text(owner))
        return released

    async def aclose(self) -> None:
        """Stop the watchdog and subscriber; locks still held expire after their lease."""
        await self._watchdog.aclose()
        await self._waiting.aclose()
        # Before the client closes: a task cancelled mid-connect would otherwise
        # hand a fresh socket back to an already closed pool.
        await self._background.aclose()
        if self._direct is not None:
            await self._direct.aclose()
        if self._routed is not None:
            await self._routed.aclose()
        if self._owns_client:
            await self.redis.aclose()

    async def __aenter__(self) -> "LockManager":
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.aclose()

    # -- acquiring -------------------------------------------------------------

    def _keys(self, key: str) -> tuple[str, str, str, str]:
        return _lock_keys(f"{self.namespace}:{{{key}}}")

    @staticmethod
    def _check_key(key: str) -> None:
        if not isinstance(key, str) or not key:
            raise ValueError(f"lock key must be a non-empty string, not {key!r}")
        if len(key) > MAX_KEY_LENGTH:
            raise ValueError(f"lock key is {len(key)} characters long; the limit is {MAX_KEY_LENGTH}")
        if "{" in key or "}" in key:
            raise ValueError(f"lock key {key!r} must not contain '{{' or '}}' (they delimit the Redis Cluster hash tag)")

    async def _acquire(self, key: str, wait: float, lease: float, renew_every: float, owner: str | None,
                       name: str, cancel_on_lost: bool, share_with_children: bool) -> HeldLock:
        telemetry = self.telemetry
        loop = asyncio.get_running_loop()
        start = loop.time()
        waiter_id = f"{self.id}:{next(self._ids)}"
        keys = self._keys(key)
        ctx = current_traceparent() if trace.get_current_span().get_span_context().is_valid else ""
        attempt = Attempt(self, keys, name, waiter_id, owner or waiter_id, int(lease * 1000), wait, ctx)
        outcome, error_type = "error", None
        with telemetry.acquire_span(name) as span:
            try:
                reply = await self._breaker.guard(attempt.run() if wait > 0 else attempt.try_once())
                if reply is None:
                    outcome = "busy"  # a try_lock miss: an answer, not an error
                    raise LockBusy(f"lock {keys[0]} is held by another owner", key=keys[0])
                outcome = "acquired"
            except LockBusy:
                raise
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
            except LockError as error:
                error_type = _error_type(error)  # redis_error or redis_misconfigured
                telemetry.set_error(span, "redis error")
                raise
            finally:
                now = loop.time()
                metric: dict[str, Any] = {"lock.name": name, "lock.outcome": outcome,
                                          "lock.contended": attempt.contended}
                if error_type:
                    metric["error.type"] = error_type
                telemetry.wait_duration.record(now - start, metric)
                if span.is_recording():
                    telemetry.link_holder(span, attempt.holder_ctx)
                    span.set_attributes(telemetry.redact({
                        "lock.name": name, "lock.key": keys[0], "lock.owner": attempt.owner,
                        "lock.attempts": attempt.attempts, "lock.contended": attempt.contended,
                        "lock.outcome": outcome}))
            if span.is_recording():
                span.set_attributes({"lock.token": reply.token, "lock.depth": reply.depth})
        lease_obj = Lease(self, key, keys[0], name, attempt.owner, reply.token, lease, renew_every,
                          cancel_on_lost, reply.sent_at, now, explicit_owner=owner is not None,
                          share_with_children=share_with_children)
        if reply.depth > 1:  # an explicit owner that already held it
            lease_obj.depth = reply.depth
        lease_obj.span = telemetry.start_hold_span(name, telemetry.redact({
            "lock.name": name, "lock.key": keys[0], "lock.owner": lease_obj.owner, "lock.token": reply.token,
            "lock.lease": lease}))
        self._counts.hold_started(lease_obj)
        self._counts.active[name] += 1
        self._watchdog.add(lease_obj)
        HELD.set(MappingProxyType({**HELD.get(), (self.id, key): lease_obj}))
        return HeldLock(lease_obj, reply.depth, outer=True)

    async def _reenter(self, lease: Lease, *, child: bool) -> HeldLock:
        """A nested hold: counted locally before Redis is asked, so a final release cannot miss it."""
        lease.nest(child=child)
        held = False
        try:
            with self.telemetry.acquire_span(lease.name) as span:
                res = await self._reenter_call(lease)
                if res[0] != 1:
                    self._lose(lease, "the lease was gone when the lock was re-entered")
                    raise LockLost(f"lease of {lease.key} was lost before re-entry", key=lease.key)
                held = True
                if span.is_recording():
                    span.set_attributes(self.telemetry.redact({
                        "lock.name": lease.name, "lock.key": lease.key, "lock.owner": lease.owner,
                        "lock.token": lease.token, "lock.depth": int(res[2]), "lock.attempts": 1,
                        "lock.contended": False, "lock.outcome": "acquired"}))
                self.telemetry.wait_duration.record(0.0, {"lock.name": lease.name, "lock.outcome": "acquired",
                                                          "lock.contended": False})
        finally:
            if not held:
                lease.unnest(child=child)
        return HeldLock(lease, int(res[2]), child=child)

    async def _reenter_call(self, lease: Lease) -> Any:
        keys = self._keys(lease.lock_key)
        args = [lease.owner, "-", lease.renew_ms, "1", "-1", "", self.fence_ttl_ms, ""]
        call = asyncio.ensure_future(self._call(self._acquire_script, keys, args, "acquire", lease.name))
        try:
            return await asyncio.shield(call)
        except asyncio.CancelledError:
            call.add_done_callback(partial(self._undo_reentry, keys, lease))
            raise

    def _undo_reentry(self, keys: tuple[str, ...], lease: Lease, call: asyncio.Future[Any]) -> None:
        if not call.cancelled() and call.exception() is None and call.result()[0] == 1:
            self._background_task(self._call(_scripts.release, keys, [lease.owner, self.fence_ttl_ms, "0"],
                                             "release", lease.name))

    def _pass_on(self, waiter_id: str, redis_key: str) -> None:
        """A hand-over to a waiter this manager no longer has: pass it on now, not after its lease."""
        keys = _lock_keys(redis_key)
        self._background_task(self._call(_scripts.leave, keys, [waiter_id, self.fence_ttl_ms], "leave",
                                         default_name(redis_key.partition("{")[2])))

    def _background_task(self, coro: Coroutine[Any, Any, Any]) -> None:
        self._background.add(coro)

    # -- Redis -----------------------------------------------------------------

    def _connection_figures(self) -> tuple[int, int]:
        """(connections in use, replies awaited): read by a metrics reader, on its own thread."""
        redis = self.redis
        if self._routed is not None:
            return self._routed.open_connections, self._routed.in_flight
        if isinstance(redis, RedisCluster):  # each node keeps its own connections
            return sum(len(getattr(n, "_connections", ())) - len(getattr(n, "_free", ()))
                       for n in redis.get_nodes()), 0
        used = len(getattr(redis.connection_pool, "_in_use_connections", ()))
        pending = 0
        if self._direct is not None and self._direct.connected:
            used += 1
            pending = self._direct.in_flight
        return used, pending

    async def _call(self, script: _scripts.Script, keys: tuple[str, ...], args: list[Any], operation: str,
                    name: str) -> Any:
        began = time.perf_counter()
        try:
            if self._master_watch is not None:
                await self._master_watch.check()
            lean = self._direct or self._routed
            if lean is not None:  # no Redis instrumentation sees the lean connections
                answer = await script(lean, keys, args)
            else:
                if isinstance(self.redis, RedisCluster):
                    # redis-py sends commands issued before it has read the slot map to
                    # one node (MOVED, and after a few of those it drops every connection)
                    await self.redis.initialize()
                with suppressed():
                    answer = await script(self.redis, keys, args)
            self.telemetry.redis_duration.record(time.perf_counter() - began,
                                                 {"lock.name": name, "lock.operation": operation})
            self._breaker.record(True)
            return answer
        except (RedisError, OSError) as exc:
            error_type = _error_type(exc)
            self.telemetry.redis_duration.record(time.perf_counter() - began, {
                "lock.name": name, "lock.operation": operation, "error.type": error_type})
            self.telemetry.errors.add(1, {"lock.name": name, "lock.operation": operation, "error.type": error_type})
            self._breaker.record(error_type != "redis_unavailable")
            raise to_lock_error(exc, f"{operation} of {keys[0]}", key=keys[0], client=self._client) from exc


def _lock_keys(redis_key: str) -> tuple[str, str, str, str]:
    return redis_key, redis_key + ":fence", redis_key + ":q", redis_key + ":w"
