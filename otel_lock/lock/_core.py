"""The manager core: take, re-enter, release, lose, and tell, the same for every topology.

`LockManager` (one Redis, Sentinel, Cluster) and `RedLockManager` (a quorum
of masters) are this class with a constructor each; what differs between
them is the transport (`_script_transport.py`, `_quorum.py`), made per process and
event loop (`_runtime.py`).

Re-entry belongs to one task: the current context records which leases its
task holds (`_held.py`), and a nested `lock("k")` re-enters only in the task
that acquired it. A task spawned while the lock is held waits like any other
caller, unless the outer hold was taken with `share_with_children=True`, in
which case it re-enters and the outer release waits for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import time
import uuid
import weakref
from functools import partial
from types import TracebackType
from typing import Any, AsyncIterator, Awaitable, Callable, Iterable, Never, Self, TypeVar

from opentelemetry import trace
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, RedisError

from ._attempt import Acquisition, Reply
from ._background import Background
from ._breaker import Breaker
from ._cluster import is_moved
from ._deadlock import probe_for
from ._errors import (LockBusy, LockDeadlock, LockError, LockTimeout, RedisMisconfigured, RedisUnavailable, error_type,
                      to_lock_error)
from ._held import NEVER, HeldLock, Lease, LockContext, LockInfo, forget, held_here, remember
from ._listing import PAGE
from ._multi import HeldLocks, MultiLockContext, acquire_all, canonical
from ._options import (ManagerOptions, check_breaker, check_flag, check_key, check_seconds, check_text, default_name,
                       unknown_argument)
from ._periodic import once_per_period, run_every
from ._ending import HoldEnds, manager_closed
from .._fork import watch_fork
from ._runtime import Runtime, Runtimes
from ._transport import Transport
from ._scripts import MODEL, MODEL_TTL, SHARES_WITH, script_refused
from ._server_checks import ServerHealth, ServerReport
from ._server_watch import period, stay_awake
from ._shapes import EXCLUSIVE, PERMIT, SHAPES, SHARED, Shape
from ._watchdog import Watchdog
from opentelemetry.metrics import MeterProvider

from ..telemetry._instruments import LockCounts, Telemetry, current_traceparent, get_telemetry

log = logging.getLogger("otel_lock")
T = TypeVar("T")


class Topology:
    """What a manager's constructor chose: how to open a transport on a new loop."""

    owners = True        # an explicit `owner=` is offered
    shapes = True        # shared holds and permits are offered (`_shapes.py`)
    counts_depth = True  # nested holds are counted in Redis too (explicit owners share the depth)

    def shapes_refused(self) -> str | None:
        """Why shared holds and permits are not offered here, or None."""
        return None if self.shapes else "a quorum of masters holds one exclusive owner per round"

    def open(self, identity: str, next_owner: Callable[[], str], index: int,
             background: Background) -> tuple[Transport, Any, bool]:
        """(transport, client(s) it uses, whether the runtime closes them) for the current loop.

        `identity`: the manager's id in this process (its wake channel);
        `index`: how many runtimes it opened before in this process.
        """
        raise NotImplementedError

    def where(self) -> str:
        """The server(s), as `host:port`, for messages and spans."""
        raise NotImplementedError


class Core:
    """Hands out locks; see `LockManager` and `RedLockManager`."""

    namespace: str

    _topology: Topology  # set by the subclass's constructor, after this one

    def __init__(self, options: ManagerOptions, tracer_provider: trace.TracerProvider | None,
                 meter_provider: MeterProvider | None, breaker_failures: int, breaker_cooldown: float) -> None:
        self.options = options
        self.namespace = options.namespace
        self.telemetry: Telemetry = get_telemetry(tracer_provider, meter_provider)
        counts = self._counts = LockCounts(meter_provider)
        self.telemetry.gauges.add(counts)
        failures, cooldown = check_breaker(breaker_failures, breaker_cooldown)
        # New acquisitions fail at once while Redis keeps failing (docs/lock.md, "Circuit breaker").
        self._breaker = Breaker.for_pool(failures, cooldown, self.telemetry, counts, options.namespace)
        self.id: str = uuid.uuid4().hex[:12]
        self._ids = itertools.count(1)
        self._runtimes = Runtimes(self._open)
        self._ends = HoldEnds(self.telemetry, counts, lambda: self.id)
        # What the first use found of the server(s): `otel-lock doctor`'s checks (docs/lock.md, "Servers").
        self.server_reports: tuple[ServerReport, ...] = ()
        self._reports_pid = 0
        self._namespace_model: int | None = None  # the data model the namespace was last found in
        counts.watch_connections(self._connection_figures, pool_name=options.namespace)
        counts.watch_servers(self._server_verdicts)
        watch_fork(self._forked)

    # -- options, as attributes (read by the middleware and the docs' examples) --

    @property
    def lease(self) -> float:
        """The default lease, in seconds."""
        return self.options.lease

    @property
    def wait(self) -> float:
        """The default wait, in seconds."""
        return self.options.wait

    @property
    def cancel_on_lost(self) -> bool:
        """Whether a holder is cancelled when its lease is lost, by default."""
        return self.options.cancel_on_lost

    @property
    def breaker_failures(self) -> int:
        """Consecutive Redis-unavailable errors that open the circuit breaker (0: off)."""
        return self._breaker.failures

    @property
    def breaker_cooldown(self) -> float:
        """Seconds the circuit stays open before one acquisition may probe."""
        return self._breaker.cooldown

    @property
    def redis(self) -> Any:
        """The redis-py client of the current event loop (idempotency records, operator calls).

        Outside any event loop: the client the manager was given (or made first).
        """
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return self._topology_client()
        return self._runtimes.here().transport.records

    def _topology_client(self) -> Any:
        raise NotImplementedError

    # -- public API ----------------------------------------------------------

    def lock(self, key: str, *, wait: float | None = None, lease: float | None = None, name: str | None = None,
             cancel_on_lost: bool | None = None, share_with_children: bool = False, owner: str | None = None,
             shared: bool = False, **unknown: Never) -> LockContext:
        """`async with manager.lock("stock:1") as held:`; LockTimeout after `wait` seconds.

        `shared=True`: any number of shared holders at once, or one exclusive
        holder; a shared request queues behind a waiting exclusive one.
        """
        self._refuse(unknown, "lock()")
        return LockContext(partial(self.acquire, key, wait=wait, lease=lease, name=name, cancel_on_lost=cancel_on_lost,
                                   share_with_children=share_with_children, owner=owner, shared=shared))

    async def try_lock(self, key: str, *, lease: float | None = None, name: str | None = None,
                       cancel_on_lost: bool | None = None, share_with_children: bool = False,
                       owner: str | None = None, shared: bool = False, **unknown: Never) -> HeldLock | None:
        """Take the lock if it is free right now, else None (no waiting; counted as `busy`)."""
        self._refuse(unknown, "try_lock()")
        try:
            return await self.acquire(key, wait=0, lease=lease, name=name, cancel_on_lost=cancel_on_lost,
                                      share_with_children=share_with_children, owner=owner, shared=shared)
        except LockBusy:
            return None

    def semaphore(self, key: str, *, permits: int, wait: float | None = None, lease: float | None = None,
                  name: str | None = None, cancel_on_lost: bool | None = None, **unknown: Never) -> LockContext:
        """`async with manager.semaphore("export:t3", permits=2) as held:` at most `permits` holders at once.

        Each holder has its own lease (renewed by the watchdog with `lease=None`);
        a crashed holder's permit comes back when its lease runs out. Waiters
        are served in arrival order, woken when a permit is released.
        LockTimeout after `wait`; ValueError when the key is in use with
        another `permits`. Every call takes a permit of its own (no re-entry).
        """
        self._refuse(unknown, "semaphore()")
        return LockContext(partial(self.acquire_permit, key, permits=permits, wait=wait, lease=lease, name=name,
                                   cancel_on_lost=cancel_on_lost))

    async def acquire_permit(self, key: str, *, permits: int, wait: float | None = None, lease: float | None = None,
                             name: str | None = None, cancel_on_lost: bool | None = None,
                             **unknown: Never) -> HeldLock:
        """A permit of `key` (at most `permits` at once); release it with `await held.release()`."""
        self._refuse(unknown, "acquire_permit()")
        check_key(key)
        if isinstance(permits, bool) or not isinstance(permits, int) or permits < 1:
            raise ValueError(f"permits must be a whole number >= 1, not {permits!r}")
        self._check_shapes("semaphore()")
        wait_s, lease_s, cancel = self._check_common(wait, lease, name, cancel_on_lost)
        return await self._take(key, wait_s, lease_s, self.options.renew_interval if lease is None else NEVER,
                                None, name or default_name(key), cancel, False, shape=PERMIT, permits=permits)

    def unsupported_reason(self, mode: str) -> str | None:
        """Why this manager cannot take holds of `mode` (exclusive, shared or permit), or None.

        For a start-up check (the middleware refuses a route it could never serve); a call of that
        shape would be refused at its first use."""
        if mode not in SHAPES:
            raise ValueError(f"mode must be one of {', '.join(SHAPES)}, not {mode!r}")
        return None if mode == EXCLUSIVE.mode else self._topology.shapes_refused()

    def _check_shapes(self, what: str) -> None:
        if not self._topology.shapes:
            raise TypeError(f"{type(self).__name__} does not offer {what}: {self._topology.shapes_refused()} "
                            "(docs/lock.md, \"Shared locks and permits\"); use a LockManager")

    def _check_common(self, wait: float | None, lease: float | None, name: str | None,
                      cancel_on_lost: bool | None) -> tuple[float, float, bool]:
        wait_s = self.options.wait if wait is None else check_seconds("wait", wait, allow_zero=True, allow_inf=True)
        lease_s = self.options.check_lease(lease)
        if name is not None:
            check_text("name", name)
        cancel = self.options.cancel_on_lost if cancel_on_lost is None else check_flag("cancel_on_lost",
                                                                                         cancel_on_lost)
        return wait_s, lease_s, cancel

    async def acquire(self, key: str, *, wait: float | None = None, lease: float | None = None,
                      name: str | None = None, cancel_on_lost: bool | None = None,
                      share_with_children: bool = False, owner: str | None = None, shared: bool = False,
                      **unknown: Never) -> HeldLock:
        """Acquire and return the hold; release it with `await held.release()`.

        `owner=`: an explicit owner id shared by cooperating holders (LockManager
        only); by default every acquisition has its own. `shared=True`: a
        shared hold (see `lock()`); inside the task's own exclusive hold of
        the key it re-enters that, inside its own shared hold it nests, and
        an exclusive request inside the task's shared hold is refused
        (LockError: it would wait for itself).
        """
        self._refuse(unknown, "acquire()")
        check_key(key)
        self._check_owner(owner)
        if not isinstance(shared, bool):
            raise TypeError(f"shared must be True or False, not {shared!r}")
        if shared:
            self._check_shapes("lock(shared=True)")
            if owner is not None:
                raise TypeError("owner= is not offered with shared=True: every shared holder has its own lease")
        wait_s, lease_s, cancel = self._check_common(wait, lease, name, cancel_on_lost)
        check_flag("share_with_children", share_with_children)
        if owner is None:
            held = held_here((self.id, key))
            if held is not None and not held.ended:
                mine = held.task is asyncio.current_task()
                if (mine or held.share_with_children) and held.shape is SHARED and not shared:
                    raise LockError(f"lock {held.key} is held shared by this task: an exclusive hold of it would "
                                    "wait for itself (release the shared hold first)", key=held.key)
                if mine:
                    return await self._reenter(held, child=False)
                if held.share_with_children:
                    return await self._reenter(held, child=True)
                # a task spawned by the holder: another caller, it waits its turn
        return await self._take(key, wait_s, lease_s, self.options.renew_interval if lease is None else NEVER,
                                owner, name or default_name(key), cancel, share_with_children,
                                shape=SHARED if shared else EXCLUSIVE)

    def lock_all(self, keys: Iterable[str], *, wait: float | None = None, lease: float | None = None,
                 name: str | None = None, cancel_on_lost: bool | None = None, **unknown: Never) -> MultiLockContext:
        """`async with manager.lock_all(["account:7", "account:3"]) as held:`: every key, or LockTimeout.

        The keys are taken in one canonical order (by Redis key, duplicates
        folded) whatever order they are named in, within one `wait` for all
        of them, and released together; `held.tokens` is {key: fencing token}.
        """
        self._refuse(unknown, "lock_all()")
        return MultiLockContext(partial(self.acquire_all, keys, wait=wait, lease=lease, name=name,
                                        cancel_on_lost=cancel_on_lost))

    async def acquire_all(self, keys: Iterable[str], *, wait: float | None = None, lease: float | None = None,
                          name: str | None = None, cancel_on_lost: bool | None = None,
                          **unknown: Never) -> HeldLocks:
        """Acquire every key (all or nothing) and return the holds; release them with `await held.release()`."""
        self._refuse(unknown, "acquire_all()")
        ordered = canonical(keys)
        for key in ordered:
            check_key(key)
        wait_s, _, _ = self._check_common(wait, lease, name, cancel_on_lost)
        return await acquire_all(self.acquire, ordered, wait_s, self._redis_key, lease=lease, name=name,
                                 cancel_on_lost=cancel_on_lost)

    def _refuse(self, unknown: dict[str, Any], where: str) -> None:
        """Keyword arguments we do not take (redis-py's names are mapped to ours in the message)."""
        if unknown:
            raise TypeError(unknown_argument(unknown, f"{type(self).__name__}.{where}"))

    def _check_owner(self, owner: str | None) -> None:
        if owner is None:
            return
        if not self._topology.owners:
            raise TypeError(f"{type(self).__name__} does not offer owner=: each round of a quorum grant has its "
                            "own owner (docs/lock.md, RedLock quorum)")
        check_text("owner", owner)

    def expect_lock_names(self, names: Iterable[str]) -> None:
        """These lock names will be used (the middleware's routes at start-up): their series start at 0 now.

        Otherwise a name's series start at its first hold, and a lease lost
        before the next scrape is never seen as an increase by the alerts.
        """
        for name in names:
            self._counts.expect(name)

    async def held_locks(self) -> list[LockInfo]:
        """Every lock held in this namespace (SCAN, for operators), sorted by key."""
        infos = [info async for page in self._held_pages() for info in page]
        return sorted(infos, key=lambda info: info.key)

    async def _held_pages(self, page: int = PAGE) -> AsyncIterator[list[LockInfo]]:
        """The locks held in this namespace, one SCAN batch at a time: memory bounded by a page, not the namespace."""
        pattern = _glob_escape(self.namespace) + ":{*}"
        transport = self._runtimes.here().transport
        pages = transport.held_pages(pattern, page)
        try:
            while True:
                try:
                    infos = await anext(pages)
                except StopAsyncIteration:
                    return
                except (RedisError, OSError) as exc:
                    raise to_lock_error(exc, "listing locks", key=None, client=transport.records) from exc
                yield infos
        finally:
            await pages.aclose()

    async def force_release(self, key: str) -> bool:
        """Release whoever holds `key` (an operator's last resort); the next waiter gets it."""
        check_key(key)
        redis_key = self._redis_key(key)
        released, owner = await self._ask(lambda t: t.force_release(redis_key, default_name(key)),
                                          f"forced release of {redis_key}", redis_key)
        if released:
            log.warning("otel-lock: forced release of %s (owner was %s)", redis_key, owner or "unknown")
        return bool(released)

    async def once_per_period(self, name: str, period: float, job: Callable[[int], Awaitable[Any]], *,
                              keep: int = 2) -> bool:
        """Run `job(tick)` if this replica wins the current tick (`int(time.time() // period)`); True if it ran.

        Every replica may call it each tick; exactly one runs the job. The
        tick's lock is never released: it runs out `keep` ticks after its
        own, by plan, which is not a loss and logs nothing. Without Redis
        nobody can know who runs, so the job is skipped (fail closed). Runs,
        skips and failures are counted in `otel_lock.periodic.runs`; see
        docs/lock.md, "Once per period".
        """
        return await once_per_period(self._take_tick, self.telemetry, name, period, job, keep)

    async def run_every(self, name: str, period: float, job: Callable[[int], Awaitable[Any]], *,
                        keep: int = 2) -> None:
        """Forever: at each tick boundary, `once_per_period(name, period, job)`; a failed run is logged."""
        await run_every(self._take_tick, self.telemetry, name, period, job, keep)

    async def _take_tick(self, key: str, lease: float, name: str) -> HeldLock:
        return await self._take(key, 0, lease, NEVER, None, name, False, False, planned=True)

    async def aclose(self) -> None:
        """Stop the watchdog and subscriber; locks still held expire after their lease."""
        await self._runtimes.aclose()
        await self._close_clients()

    async def _close_clients(self) -> None:
        """Close the clients the manager made for itself outside any runtime."""

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.aclose()

    # -- acquiring -------------------------------------------------------------

    def _redis_key(self, key: str) -> str:
        return f"{self.namespace}:{{{key}}}"

    async def _take(self, key: str, wait: float, lease: float, renew_every: float, owner: str | None, name: str,
                    cancel_on_lost: bool, share_with_children: bool, planned: bool = False,
                    shape: Shape = EXCLUSIVE, permits: int = 0) -> HeldLock:
        runtime = self._runtimes.here()
        loop = runtime.loop
        start = loop.time()
        lock_base = self._redis_key(key)
        redis_key = shape.main_key(lock_base)
        waiter_id = self._next_owner()
        current = trace.get_current_span()
        recording = current.is_recording()  # no trace (a job, a benchmark): no span work at all
        ctx = current_traceparent() if current.get_span_context().is_valid else ""
        request = Acquisition((lock_base,), name, waiter_id, owner or waiter_id, int(lease * 1000), wait, ctx,
                          private=owner is None, shape=shape, permits=permits)
        if wait > 0 and owner is None:
            # Only a waiter that holds locks can close a cycle, whatever the shape (docs/lock.md, "Deadlocks").
            request.probe = probe_for(self.id, self.namespace)
        with self.telemetry.acquire_span(name) if recording else _NO_SPAN as span:
            outcome, error = "error", None  # type: str, BaseException | None
            try:
                take = runtime.transport.take(request) if runtime.checked else self._first_take(runtime, request)
                reply = await self._breaker.guarded(take)
                if reply is None:
                    outcome = "busy"  # a try_lock miss: an answer, not an error
                    raise LockBusy(f"lock {redis_key} is held by another owner", key=redis_key, waited=0.0)
                outcome = "acquired"
            except LockTimeout as exc:
                if not isinstance(exc, LockBusy):
                    outcome, error = "timeout", exc
                    exc.waited = loop.time() - start
                raise
            except asyncio.CancelledError:
                outcome = "cancelled"
                raise
            except LockError as exc:
                error = exc
                raise
            finally:
                now = loop.time()
                self._acquired(span, request, outcome, error, now - start)
            if span.is_recording():
                span.set_attributes({"lock.token": reply.token, "lock.depth": reply.depth})
        held = Lease(self._ends, key, redis_key, name, reply.owner or request.owner, reply.token, lease, renew_every,
                     cancel_on_lost, reply.sent_at, now, explicit_owner=owner is not None,
                     share_with_children=share_with_children, planned=planned, shape=shape, lock_base=lock_base,
                     permits=permits or None)
        held.runtime = runtime
        if reply.depth > 1:  # an explicit owner that already held it
            held.depth = reply.depth
        if recording:
            held.span = self.telemetry.start_hold_span(name, self.telemetry.redact({
                "lock.name": name, "lock.key": redis_key, "lock.owner": held.owner, "lock.token": reply.token,
                "lock.lease": lease, "lock.mode": shape.mode, **({"lock.permits": permits} if permits else {})}))
        if not planned:  # a tick's lock is held to the end of its lease on purpose: never "near its lease"
            self._counts.hold_started(held)
        self._counts.active[name] += 1
        if permits:
            self._counts.permit_taken(name, permits)
        runtime.watchdog.add(held)
        remember((self.id, held.held_as), held)  # a permit under its own name: every semaphore() takes one
        return HeldLock(held, reply.depth, outer=True)

    def _acquired(self, span: trace.Span, request: Acquisition, outcome: str, error: BaseException | None,
                  waited: float) -> None:
        """The telemetry of one acquisition: the wait metric, and the acquire span's attributes."""
        kind = _error_type(error)
        metric: dict[str, Any] = {"lock.name": request.name, "lock.outcome": outcome,
                                  "lock.contended": request.contended}
        if kind:
            metric["error.type"] = kind
        if request.shape is not EXCLUSIVE:  # absent: exclusive, so the series of plain locks stay as they were
            metric["lock.mode"] = request.shape.mode
        self.telemetry.wait_duration.record(waited, metric)
        if isinstance(error, LockDeadlock):
            self.telemetry.errors.add(1, {"lock.name": request.name, "lock.operation": "acquire",
                                          "error.type": "deadlock"})
            if span.is_recording():
                span.add_event("lock deadlock", {
                    "lock.deadlock.keys": [self._redacted_key(key) for key, _, _ in error.cycle],
                    "lock.deadlock.holders": [holder for _, _, holder in error.cycle]})
        if not span.is_recording():
            return
        self.telemetry.link_holder(span, request.holder_ctx)
        span.set_attributes(self.telemetry.redact({
            "lock.name": request.name, "lock.key": request.keys[0], "lock.owner": request.owner,
            "lock.attempts": request.attempts, "lock.contended": request.contended, "lock.outcome": outcome,
            "lock.mode": request.shape.mode}))
        if kind:
            self.telemetry.set_error(span, kind, self._topology.where())

    def _redacted_key(self, key: str) -> str:
        """A key as spans may carry it (`lock.key` redaction: hashed, or dropped to '')."""
        return str(self.telemetry.redact({"lock.key": key}).get("lock.key", ""))

    async def _first_take(self, runtime: Runtime, request: Acquisition) -> Reply | None:
        """The first acquisition on a loop: the first-use checks, then the take (both behind the breaker)."""
        what, key = f"acquire of {request.keys[0]}", request.keys[0]
        try:
            await runtime.first_use(lambda transport: self._check_server(transport, key, request.name))
        except (RedisError, OSError) as exc:
            error = to_lock_error(exc, what, key=key, client=runtime.transport.records)
            self._breaker.record(not isinstance(error, RedisUnavailable))
            raise error from exc
        runtime.keep_awake(lambda: stay_awake(weakref.ref(runtime), weakref.ref(self), period(self.options.lease)))
        return await runtime.transport.take(request)

    async def _check_server(self, transport: Transport, key: str, name: str) -> None:
        """At the first use on a loop (and again when the guard saw a change): the data model, the server checks.

        The server checks run once per process, and again after a refusal
        or when the guard (`_server_watch.py`) saw the server change. A
        refused server (too old, no script or key rights, evicting with
        `require_noeviction=True`) and another data model are
        RedisMisconfigured naming the fix; warnings (an evicting policy, no
        channel rights) are logged, and without channel rights waiters poll.
        """
        try:
            held = await self._claim_model(transport, key, name)  # the first call: its errors are an acquire's
        except LockError as exc:
            cause = exc.__cause__ or exc
            if isinstance(exc, RedisMisconfigured) and script_refused(cause) or is_moved(cause):
                # a server that refuses the claim's script commands, or a Cluster node behind a plain URL
                # (MOVED): the server checks say why, in doctor's words
                await self._check_reports(transport, key)
            raise
        await self._check_reports(transport, key)
        if held is not None:
            raise RedisMisconfigured(self._model_refusal())
        if not all(report.can_subscribe for report in self.server_reports):
            transport.poll_instead(None)  # the report's warning said why, with the rule to add

    async def _check_reports(self, transport: Transport, key: str) -> None:
        if self._reports_pid != os.getpid():
            await self._run_checks(transport)
        for report in self.server_reports:
            if report.refusals:
                raise RedisMisconfigured(f"{report.refusal_message()} (at the first use: acquire of {key})", key=key)

    async def _claim_model(self, transport: Transport, key: str = "", name: str = "otel-lock.model") -> int | None:
        """Claim the namespace for this data model for another MODEL_TTL; the other model holding it, or None."""
        model_key = f"{self.namespace}:model"
        held: int | None = await transport.check_model(model_key, MODEL, MODEL_TTL, key or model_key, name)
        self._namespace_model = MODEL if held is None else held
        return held

    def _model_refusal(self) -> str:
        return model_refusal(self.namespace, self._topology.where(), self._namespace_model)

    async def _run_checks(self, transport: Transport) -> tuple[ServerReport, ...]:
        """Run the server checks now, keep them (`server_reports`, `health()`, the verdict metric), log news."""
        reports = tuple(await transport.server_reports(self.namespace, self.options.require_noeviction))
        if _verdicts(reports) != _verdicts(self.server_reports):
            for report in reports:
                report.log()
        self.server_reports = reports
        # a refusal is checked again at the next first use (and at every tick of the guard)
        self._reports_pid = 0 if self._refused() else os.getpid()
        return reports

    def _refused(self) -> bool:
        return any(report.refusals for report in self.server_reports)

    async def check_servers(self) -> tuple[ServerReport, ...]:
        """Run the server checks now, on this loop's connections (what `otel-lock doctor` prints).

        The same checks as at the first use, through the same path; the
        result is kept as `server_reports` and in `health()`. Redis errors
        propagate as LockError / RedisUnavailable.
        """
        return await self._ask(self._run_checks, "server checks", None)

    def health(self) -> ServerHealth:
        """The current verdict on the server(s) and the namespace's data model, without a round trip.

        For an app's health endpoint: `ok` is False while the manager refuses
        acquisitions (a refused server check, another data model in the
        namespace); `problems` names each refusal and warning with its fix.
        Kept up to date while the manager runs (`_server_watch.py`).
        """
        problems = [f"{r.address or 'Redis'}: {c.name}: {c.detail}" + (f" (fix: {c.fix})" if c.fix else "")
                    for r in self.server_reports for c in r.checks if c.verdict in ("refusal", "warning")]
        foreign = self._namespace_model not in (None, MODEL, *SHARES_WITH)
        if foreign:
            problems.insert(0, self._model_refusal())
        return ServerHealth(ok=not foreign and not self._refused(), checked=bool(self.server_reports),
                            problems=tuple(problems), model=MODEL, namespace_model=self._namespace_model,
                            servers=self.server_reports)

    def _server_verdicts(self) -> dict[str, int]:
        """Per server: 0 usable, 1 usable with warnings, 2 refused (read by a metrics reader, on its thread)."""
        foreign = self._namespace_model not in (None, MODEL, *SHARES_WITH)
        return {r.address or "redis": 2 if foreign or r.refusals else 1 if r.warnings else 0
                for r in self.server_reports}

    def _next_owner(self) -> str:
        return f"{self.id}:{next(self._ids)}"

    async def _reenter(self, lease: Lease, *, child: bool) -> HeldLock:
        """A nested hold: counted locally before Redis is asked, so a final release cannot miss it."""
        if lease.runtime.closed:
            raise manager_closed(lease, "re-entered")
        lease.nest(child=child)
        depth = None
        try:
            with self.telemetry.acquire_span(lease.name) as span:
                depth = await lease.runtime.transport.reenter(lease)
                if depth is None:
                    self._ends.lose(lease, "the lease was gone when the lock was re-entered")
                    raise lease.lost_error()
                if span.is_recording():
                    span.set_attributes(self.telemetry.redact({
                        "lock.name": lease.name, "lock.key": lease.key, "lock.owner": lease.owner,
                        "lock.token": lease.token, "lock.depth": depth, "lock.attempts": 1,
                        "lock.contended": False, "lock.outcome": "acquired", "lock.mode": lease.shape.mode}))
                metric: dict[str, Any] = {"lock.name": lease.name, "lock.outcome": "acquired", "lock.contended": False}
                if lease.shape is not EXCLUSIVE:
                    metric["lock.mode"] = lease.shape.mode
                self.telemetry.wait_duration.record(0.0, metric)
        finally:
            if depth is None:
                lease.unnest(child=child)
        return HeldLock(lease, depth, child=child)

    # -- per loop, per process -------------------------------------------------------

    def _open(self, loop: asyncio.AbstractEventLoop, index: int) -> Runtime:
        background = Background("clean-up (undo, release or pass-on)")
        transport, client, owns = self._topology.open(self.id, self._next_owner, index, background)
        return Runtime(loop, transport, Watchdog(transport, self._ends), background, client, owns)

    def _forked(self) -> None:
        """In a forked child: a new identity (owner ids, wake channel), and none of the parent's connections."""
        self.id = uuid.uuid4().hex[:12]
        self._ids = itertools.count(1)
        self._runtimes.forked()

    def _connection_figures(self) -> tuple[int, int]:
        """(connections in use, replies awaited) over every loop: read by a metrics reader, on its own thread."""
        used = pending = 0
        for runtime in self._runtimes.all():
            one, two = runtime.transport.figures()
            used, pending = used + one, pending + two
        return used, pending

    async def _ask(self, ask: Callable[[Transport], Awaitable[T]], what: str, key: str | None) -> T:
        """An operator call on this loop's transport, its Redis errors as LockError / RedisUnavailable."""
        transport = self._runtimes.here().transport
        try:
            return await ask(transport)
        except (RedisError, OSError) as exc:
            raise to_lock_error(exc, what, key=key, client=transport.records) from exc


_NO_SPAN = contextlib.nullcontext(trace.INVALID_SPAN)


def _error_type(error: BaseException | None) -> str:
    if error is None:
        return ""
    if isinstance(error, LockDeadlock):
        return "deadlock"
    if isinstance(error, LockTimeout):
        return "timeout"
    return error_type(error)  # redis_unavailable, redis_misconfigured or redis_error


def model_refusal(namespace: str, where: str, held: int | None) -> str:
    """Why a manager refuses a namespace that another data model holds (also `otel-lock doctor`'s words)."""
    return (f"namespace {namespace!r} on {where} is in use by otel-lock data model {held}; "
            f"this otel-lock writes model {MODEL}, and two layouts in one namespace would not see each other's "
            f"locks. Finish the rollout in a new namespace (namespace='{namespace}-v{MODEL}'), or stop "
            f"every manager of model {held} and delete the key {namespace}:model")


def _verdicts(reports: tuple[ServerReport, ...]) -> list[tuple[str | None, tuple[tuple[str, str, str], ...]]]:
    """What a report says, for telling news from a repeat (a re-run that finds the same is not logged again)."""
    return [(r.address, tuple((c.name, c.verdict, c.state) for c in r.checks if c.verdict != "ok" and
                              c.name != "round trip")) for r in reports]


def _glob_escape(text: str) -> str:
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)
