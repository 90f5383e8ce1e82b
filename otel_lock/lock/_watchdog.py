"""One renewal loop per manager: batched lease renewals and lost-lease detection.

Every lease with `lease=None` is renewed every lease/3.
All leases that are at least half-way to their renewal time go out together
in one pipelined round trip, so 10,000 held locks cost a few round trips per
tick, not 10,000 tasks. On a Redis Cluster a script may touch one slot only,
so the batch is one call per slot, sent to the nodes concurrently. A lease is lost when Redis says the owner changed, or
when no renewal confirmed it before `expires_at` (monotonic clock, minus drift).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import TYPE_CHECKING, Any, Protocol, Sequence

from redis.exceptions import NoScriptError, RedisError

from . import _scripts
from ..telemetry._instruments import Telemetry, suppressed
from ._cluster import slot_of
from ._errors import error_type
from ._held import NEVER, Lease
from ._replicas import check_acks, with_wait

if TYPE_CHECKING:
    import redis.asyncio as aioredis
    from redis.asyncio.cluster import RedisCluster

    from ._connection import Connection
    from ._sentinel import MasterWatch

log = logging.getLogger("otel_lock")

BATCH = 1000            # keys per script call (the pipeline carries all calls in one round trip)
RETRY_AFTER_ERROR = 0.5


class Renewer(Protocol):
    """The manager, as its watchdog sees it (abstract, so this module imports no manager)."""

    redis: aioredis.Redis | RedisCluster
    telemetry: Telemetry
    _direct: Connection | None
    _client: _scripts.ScriptClient
    wait_replicas: int
    wait_replicas_timeout: float
    _master_watch: MasterWatch | None
    _cluster: bool

    def _lose(self, lease: Lease, reason: str, count: bool = True) -> None: ...

    def _count_renewal(self, lease: Lease, outcome: str, error: BaseException | None = None) -> None: ...


class Watchdog:
    def __init__(self, manager: Renewer) -> None:
        self._manager = manager
        self._leases: set[Lease] = set()
        self._changed = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._wake_at = NEVER

    def add(self, lease: Lease) -> None:
        self._leases.add(lease)
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run(), name="otel-lock watchdog")
        elif min(lease.renew_at, lease.expires_at) < self._wake_at:
            self._changed.set()  # due before the loop's next wake-up

    def discard(self, lease: Lease) -> None:
        self._leases.discard(lease)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            now = loop.time()
            for lease in [l for l in self._leases if l.expires_at <= now]:
                reason = "no renewal confirmed the lease in time" if lease.renew else "the fixed lease ran out"
                self._manager._lose(lease, reason)
            due = [l for l in self._leases if l.renew_at - l.renew_every / 2 <= now]
            if any(l.renew_at <= now for l in due):
                await self._renew(due)
                continue
            # Sleeping with nothing held costs nothing; an earlier deadline wakes us.
            self._wake_at = min((min(l.renew_at, l.expires_at) for l in self._leases), default=NEVER)
            self._changed.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(None if self._wake_at == NEVER else max(0.0, self._wake_at - now)):
                    await self._changed.wait()
            self._wake_at = NEVER

    async def _renew(self, leases: list[Lease]) -> None:
        manager = self._manager
        loop = asyncio.get_running_loop()
        sent_at = loop.time()
        chunks = self._chunks(leases)
        began = time.perf_counter()
        results: list[Any]
        try:
            if manager._master_watch is not None:
                await manager._master_watch.check()  # never renew on a demoted master
            with suppressed():
                results = await self._send(chunks)
        except (RedisError, OSError) as exc:
            results = [exc] * len(chunks)
        self._record(chunks, results, time.perf_counter() - began)
        for chunk, answers in zip(chunks, results):
            if isinstance(answers, BaseException):
                if not isinstance(answers, (RedisError, OSError)):
                    raise answers
                for lease in chunk:
                    # retry soon, and well before the lease runs out even with a short lease
                    lease.renew_at = min(lease.expires_at, sent_at + min(RETRY_AFTER_ERROR, lease.renew_every / 2))
                    manager._count_renewal(lease, "error", answers)
                continue
            for lease, ok in zip(chunk, answers):
                if lease not in self._leases:
                    continue  # released while the renewal was in flight
                if not ok:
                    manager._lose(lease, "the lease was taken over or expired")
                    continue
                lease.confirmed(sent_at)
                manager._count_renewal(lease, "ok")

    def _chunks(self, leases: list[Lease]) -> list[list[Lease]]:
        """Script calls of at most BATCH keys; on a Redis Cluster, one slot's keys per call."""
        groups: list[list[Lease]] = [leases]
        if self._manager._cluster:
            by_slot: dict[int, list[Lease]] = {}
            for lease in leases:
                by_slot.setdefault(slot_of(lease.key), []).append(lease)
            groups = list(by_slot.values())
        return [group[i:i + BATCH] for group in groups for i in range(0, len(group), BATCH)]

    def _record(self, chunks: list[list[Lease]], results: list[Any], seconds: float) -> None:
        """One batched round trip: its time, once per lock name (and outcome) it renewed."""
        outcomes: dict[tuple[str, str], None] = {}
        for chunk, answers in zip(chunks, results):
            error = ""
            if isinstance(answers, BaseException):
                error = error_type(answers)
            outcomes.update(((lease.name, error), None) for lease in chunk)
        for name, error in outcomes:
            attributes = {"lock.name": name, "lock.operation": "renew"}
            if error:
                attributes["error.type"] = error
            self._manager.telemetry.redis_duration.record(seconds, attributes)

    async def _send(self, chunks: Sequence[list[Lease]]) -> list[Any]:
        manager = self._manager
        if manager._cluster:
            # One call per slot, each routed (and redirected) to its node; the calls
            # to one node share its socket. A node that is down fails its own
            # slots' renewals only.
            client = manager._client
            if client is manager.redis:
                await manager.redis.initialize()  # (see LockManager._call)
            return await asyncio.gather(*(
                _scripts.renew(client, [l.key for l in chunk],
                               [a for l in chunk for a in (l.owner, l.renew_ms)]) for chunk in chunks),
                return_exceptions=True)
        calls: list[tuple[Any, ...]] = []
        for chunk in chunks:
            keys = [l.key for l in chunk]
            calls.append(("EVALSHA", _scripts.renew.sha, len(keys), *keys,
                          *[a for l in chunk for a in (l.owner, l.renew_ms)]))
        try:
            return await self._send_once(calls)
        except NoScriptError:
            await manager._client.script_load(_scripts.renew.source)
        return await self._send_once(calls)

    async def _send_once(self, calls: list[tuple[Any, ...]]) -> list[Any]:
        manager = self._manager
        if manager.wait_replicas:
            # A renewal counts once the replicas have it (WAIT on the same connection).
            timeout_ms = int(manager.wait_replicas_timeout * 1000)
            *results, acked = await with_wait(manager._direct or manager.redis, calls, manager.wait_replicas,
                                              timeout_ms)
            errors = [r for r in results if isinstance(r, Exception)]
            if errors:
                raise errors[0]
            check_acks(acked, manager.wait_replicas, timeout_ms)
            return results
        if manager._direct is not None:
            results = await manager._direct.execute_many(calls)
            errors = [r for r in results if isinstance(r, Exception)]
            if errors:
                raise errors[0]
            return results
        pipe = manager.redis.pipeline(transaction=False)
        for call in calls:
            pipe.execute_command(*call)
        answers: list[Any] = await pipe.execute()
        return answers

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
        self._leases.clear()

