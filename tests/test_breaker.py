"""The circuit breaker: opens on a dead Redis, fails fast without touching it, closes by itself.

Real redis-server processes, stopped, frozen (SIGSTOP) and restarted by pid.
The state machine itself is driven by a fake clock: no test waits out a
cool-down on the wall clock except through a bounded poll.
"""

from __future__ import annotations

import asyncio
import os
import signal

import pytest
import redis
import redis.asyncio as aioredis
from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route

from _middleware_helpers import client_for, counter_points, metered, problem
from _proc_helpers import until
from otel_lock import LockManager, LockMiddleware, RedisUnavailable, RedLockManager, locked
from otel_lock.cli._redis_server import RedisServer, stop_servers
from otel_lock.lock._breaker import CLOSED, HALF_OPEN, MAX_COOLDOWN, OPEN, Breaker

pytestmark = pytest.mark.timeout(90)

SOCKET_TIMEOUT = 0.5
# A connect timeout plus a socket timeout (two, with redis-py's one retry), plus slack:
# anything near this bound is a hang, not a slow answer.
UNAVAILABLE_BOUND = 4 * SOCKET_TIMEOUT + 2.0
BOUND = 20.0


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def gauge(reader, pool: str) -> int | None:
    data = reader.get_metrics_data()
    for rm in data.resource_metrics if data else []:
        for sm in rm.scope_metrics:
            for metric in sm.metrics:
                if metric.name == "otel_lock.circuit.state":
                    for point in metric.data.data_points:
                        if point.attributes.get("db.client.connection.pool.name") == pool:
                            return point.value
    return None


def openings(reader, pool: str) -> int:
    return counter_points(reader, "otel_lock.circuit.opened").get((("db.client.connection.pool.name", pool),), 0)


async def unavailable_within_bound(call) -> RedisUnavailable:
    with pytest.raises(RedisUnavailable) as raised:
        async with asyncio.timeout(UNAVAILABLE_BOUND):
            await call()
    return raised.value


def connections_received(port: int) -> int:
    with redis.Redis(port=port) as client:
        return int(client.info("stats")["total_connections_received"])


# -- the state machine -------------------------------------------------------------


def test_opens_after_n_consecutive_failures_and_an_answer_resets_the_count():
    opened = []
    breaker = Breaker(3, 1.0, on_open=lambda: opened.append(1), clock=Clock())
    for reachable in (False, False, True, False, False):
        breaker.record(reachable)
    assert breaker.state() == CLOSED and breaker.admit() == 0
    breaker.record(False)
    assert breaker.state() == OPEN and opened == [1]
    with pytest.raises(RedisUnavailable, match="circuit open, retry in 1 s") as refused:
        breaker.admit()
    assert refused.value.retry_after == 1.0
    breaker.record(False)  # a call sent before it opened: no news
    assert opened == [1] and breaker.retry_in() == 1.0


def test_one_probe_at_a_time_and_a_failed_probe_doubles_the_cool_down_up_to_the_cap():
    clock = Clock()
    breaker = Breaker(1, 4.0, clock=clock)
    breaker.record(False)
    expected = 4.0
    for _ in range(6):
        clock.now += breaker.retry_in()
        assert breaker.state() == HALF_OPEN
        probe = breaker.admit()
        assert probe
        with pytest.raises(RedisUnavailable, match="probe is under way"):
            breaker.admit()  # everyone else still fails fast
        breaker.record(False)
        breaker.done(probe)
        expected = min(expected * 2, MAX_COOLDOWN)
        assert breaker.state() == OPEN and breaker.retry_in() == expected
    assert expected == MAX_COOLDOWN
    clock.now += breaker.retry_in()
    probe = breaker.admit()
    breaker.record(True)
    breaker.done(probe)
    assert breaker.state() == CLOSED
    breaker.record(False)  # the next opening starts from the configured cool-down again
    assert breaker.retry_in() == 4.0


def test_a_probe_that_got_no_answer_lets_the_next_caller_probe():
    clock = Clock()
    breaker = Breaker(1, 1.0, clock=clock)
    breaker.record(False)
    clock.now += 1.0
    first = breaker.admit()
    breaker.done(first)  # cancelled before Redis answered
    second = breaker.admit()
    assert second and second != first
    breaker.done(first)  # a late end of the old probe does not free the new one's slot
    with pytest.raises(RedisUnavailable):
        breaker.admit()


async def test_guard_closes_the_refused_call_unstarted():
    breaker = Breaker(1, 60.0)
    breaker.record(False)
    started = []

    async def call():
        started.append(1)

    coro = call()
    with pytest.raises(RedisUnavailable):
        await breaker.guard(coro)
    assert started == [] and coro.cr_frame is None  # closed, so no "never awaited" warning


def test_failures_of_one_part_count_only_while_no_call_is_answered():
    """A Cluster master down: its calls in flight fail in a burst; while the others answer, no circuit opens."""
    clock = Clock()
    breaker = Breaker(3, 1.0, clock=clock)
    breaker.record(True, partial=True)          # another master answered
    clock.now += 2.0
    for _ in range(10):                         # sent 1.5 s ago, within the cool-down of that answer
        breaker.record(False, partial=True, took=1.5)
    assert breaker.state() == CLOSED
    clock.now += 0.5
    for _ in range(3):                          # the whole cluster is silent since: it opens
        breaker.record(False, partial=True, took=0.1)
    assert breaker.state() == OPEN


def test_zero_failures_turns_it_off():
    breaker = Breaker(0, 1.0)
    for _ in range(100):
        breaker.record(False)
    assert breaker.state() == CLOSED and breaker.admit() == 0


@pytest.mark.parametrize("options, message", [
    ({"breaker_failures": -1}, "breaker_failures must be a whole number >= 0"),
    ({"breaker_failures": 2.5}, "breaker_failures must be a whole number >= 0"),
    ({"breaker_failures": True}, "breaker_failures must be a whole number >= 0"),
    ({"breaker_cooldown": 0}, "breaker_cooldown must be > 0 seconds"),
    ({"breaker_cooldown": float("inf")}, "breaker_cooldown must be finite"),
    ({"breaker_cooldown": "1"}, "breaker_cooldown must be a number of seconds"),
], ids=["negative", "fraction", "bool", "zero-cooldown", "inf-cooldown", "str-cooldown"])
async def test_bad_breaker_options_are_value_errors_on_both_managers(redis_url, options, message):
    with pytest.raises(ValueError, match=message):
        LockManager.from_url(redis_url, **options)
    clients = [aioredis.Redis.from_url(redis_url) for _ in range(3)]
    try:
        with pytest.raises(ValueError, match=message):
            RedLockManager(clients, **options)
    finally:
        for client in clients:
            await client.aclose()


async def test_from_url_passes_the_breaker_options_on(redis_url):
    async with LockManager.from_url(redis_url, breaker_failures=2, breaker_cooldown=0.5) as locks:
        assert (locks.breaker_failures, locks.breaker_cooldown) == (2, 0.5)
    async with LockManager.from_url(redis_url) as locks:
        assert (locks.breaker_failures, locks.breaker_cooldown) == (5, 1.0)


# -- against a real Redis ------------------------------------------------------------


async def test_opens_when_redis_is_killed_and_fails_fast_without_connecting(fresh_redis):
    provider, reader = metered()
    locks = LockManager.from_url(fresh_redis.url, namespace="brk", socket_timeout=SOCKET_TIMEOUT,
                                 breaker_failures=3, breaker_cooldown=60.0, meter_provider=provider)
    try:
        async with locks.lock("warm", wait=1.0):
            pass
        assert gauge(reader, "brk") == CLOSED
        await asyncio.to_thread(fresh_redis.stop)
        for i in range(3):
            # An explicit owner: these attempts leave no clean-up task to retry in the background.
            error = await unavailable_within_bound(lambda: locks.try_lock(f"k{i}", owner="o"))
            assert error.retry_after is None  # Redis itself was asked
        assert gauge(reader, "brk") == OPEN and openings(reader, "brk") == 1
        assert not locks._runtimes.here().background._tasks
        await asyncio.to_thread(fresh_redis.start)  # same port, a fresh process
        before = await asyncio.to_thread(connections_received, fresh_redis.port)

        async def use_lock():
            async with locks.lock("k", wait=5.0):
                pass
        for call in [lambda: locks.try_lock("k")] * 10 + [use_lock] * 10:
            with pytest.raises(RedisUnavailable, match="circuit open") as refused:
                await call()  # at once: nothing is sent, so nothing can hang
            assert 0 < refused.value.retry_after <= 60.0
        # Only the counting client itself connected (its one connection per call).
        assert await asyncio.to_thread(connections_received, fresh_redis.port) == before + 1
        assert gauge(reader, "brk") == OPEN and openings(reader, "brk") == 1
    finally:
        await locks.aclose()
        provider.shutdown()


async def test_closes_by_itself_once_redis_is_back(fresh_redis):
    provider, reader = metered()
    locks = LockManager.from_url(fresh_redis.url, namespace="brk2", socket_timeout=SOCKET_TIMEOUT,
                                 breaker_failures=2, breaker_cooldown=0.05, meter_provider=provider)
    try:
        await asyncio.to_thread(fresh_redis.stop)
        for _ in range(2):
            await unavailable_within_bound(lambda: locks.try_lock("k", owner="o"))
        assert openings(reader, "brk2") == 1

        async def half_open():
            return gauge(reader, "brk2") == HALF_OPEN
        await until(half_open, "the cool-down to end")
        # The probe finds Redis still down: the circuit opens again, for longer.
        await unavailable_within_bound(lambda: locks.try_lock("k", owner="o"))
        assert locks._breaker._current == 0.1

        await asyncio.to_thread(fresh_redis.start)

        async def acquired():
            try:
                return await locks.try_lock("k")
            except RedisUnavailable:
                return None
        held = await until(acquired, "the circuit to let a probe through and close", every=0.02)
        assert gauge(reader, "brk2") == CLOSED
        assert await held.release()
        assert openings(reader, "brk2") == 1  # re-opening after a failed probe is not a new opening
    finally:
        await locks.aclose()
        provider.shutdown()


async def test_a_frozen_redis_ends_in_redis_unavailable_and_releases_pass_the_open_circuit(fresh_redis):
    locks = LockManager.from_url(fresh_redis.url, namespace="brk3", socket_timeout=SOCKET_TIMEOUT,
                                 breaker_failures=2, breaker_cooldown=60.0)
    other = LockManager.from_url(fresh_redis.url, namespace="brk3")
    try:
        held = await locks.acquire("k", lease=30.0)  # a fixed lease: no renewal talks to Redis meanwhile
        os.kill(fresh_redis.process.pid, signal.SIGSTOP)  # the kernel still accepts: only timeouts tell
        try:
            # Concurrent callers each get RedisUnavailable within the socket timeout, not a hang.
            # An explicit owner: these attempts leave no clean-up task behind.
            await asyncio.gather(*(unavailable_within_bound(lambda i=i: locks.try_lock(f"x{i}", owner="o"))
                                   for i in range(2)))
            assert locks._breaker.state() == OPEN
            with pytest.raises(RedisUnavailable, match="circuit open"):
                await locks.try_lock("x2", owner="o")
        finally:
            os.kill(fresh_redis.process.pid, signal.SIGCONT)
        assert locks._breaker.state() == OPEN
        # The holder can always let go, and the lock is free at once, not after its 30 s lease.
        assert await held.release()
        assert locks._breaker.state() == CLOSED  # that answer closed the circuit
        again = await other.try_lock("k")
        assert again is not None and await again.release()
    finally:
        await locks.aclose()
        await other.aclose()


async def test_a_holder_whose_renewals_fail_is_told_lost_by_lease_minus_drift(fresh_redis):
    lease = 1.0
    drift = lease * 0.01 + 0.002
    locks = LockManager.from_url(fresh_redis.url, namespace="brk4", socket_timeout=SOCKET_TIMEOUT, lease=lease)
    loop = asyncio.get_running_loop()
    try:
        held = await locks.acquire("k")
        os.kill(fresh_redis.process.pid, signal.SIGSTOP)
        try:
            stopped_at = loop.time()
            # Every renewal Redis confirmed was sent before the stop: no lease may be believed past this.
            await asyncio.sleep(stopped_at + lease - drift - loop.time() + 0.001)
            assert held.lost.is_set()
            await asyncio.wait_for(held.lost.wait(), BOUND)  # and the watchdog told it too
        finally:
            os.kill(fresh_redis.process.pid, signal.SIGCONT)
        # What the thawed Redis says now depends on renewals it ran late; the holder was told in time.
        await held.release()
    finally:
        await locks.aclose()


async def test_redlock_opens_when_a_majority_is_down_and_releases_still_reach_every_master():
    servers = [RedisServer().start() for _ in range(3)]
    provider, reader = metered()
    try:
        locks = RedLockManager.from_urls([s.url for s in servers], namespace="brk5", lease=2.0,
                                         breaker_failures=2, breaker_cooldown=60.0, meter_provider=provider)
        async with locks:
            held = await locks.acquire("k", lease=30.0)  # fixed: no renewal has to survive the freeze
            for server in servers[1:]:
                os.kill(server.process.pid, signal.SIGSTOP)
            try:
                for _ in range(2):
                    await unavailable_within_bound(lambda: locks.try_lock("j"))
                with pytest.raises(RedisUnavailable, match="circuit open"):
                    await locks.try_lock("j")
                assert gauge(reader, "brk5") == OPEN and openings(reader, "brk5") == 1
            finally:
                for server in servers[1:]:
                    os.kill(server.process.pid, signal.SIGCONT)
            assert await held.release()  # not blocked by the open circuit
            with pytest.raises(RedisUnavailable, match="circuit open"):
                await locks.try_lock("j")  # one breaker for the manager, fed by acquire rounds only
    finally:
        stop_servers(servers)
        provider.shutdown()


# -- the middleware ------------------------------------------------------------------


def app_with(manager, *routes) -> Starlette:
    app = Starlette(routes=list(routes))
    app.add_middleware(LockMiddleware, manager=manager)
    return app


def ok():
    """A fresh handler per route: annotations live on the function object."""
    async def handler(request):
        return JSONResponse({"ok": True})
    return handler


async def test_middleware_answers_503_with_the_remaining_cool_down_as_retry_after(fresh_redis):
    async with LockManager.from_url(fresh_redis.url, namespace="brk6", socket_timeout=SOCKET_TIMEOUT,
                                    breaker_failures=1, breaker_cooldown=30.0) as manager:
        app = app_with(manager, Route("/s", locked("stock")(ok()), methods=["POST"]))
        async with client_for(app) as client:
            await asyncio.to_thread(fresh_redis.stop)
            asked = await client.post("/s")  # Redis was asked, and failed: the rule's Retry-After
            refused = await client.post("/s")  # the open circuit answers
    assert asked.status_code == 503 and asked.headers["retry-after"] == "1"
    assert refused.status_code == 503 and problem(refused)["type"] == "redis-unavailable"
    assert 1 < int(refused.headers["retry-after"]) <= 30  # the cool-down left, rounded up


async def test_fail_open_runs_are_counted(fresh_redis):
    provider, reader = metered()
    ran = []

    async def handler(request):
        ran.append(getattr(request.state, "lock", None))
        return JSONResponse({"ok": True})

    async with LockManager.from_url(fresh_redis.url, namespace="brk7", socket_timeout=SOCKET_TIMEOUT,
                                    breaker_failures=1, breaker_cooldown=30.0, meter_provider=provider) as manager:
        app = app_with(manager, Route("/f", locked("fo", fail_open=True)(handler), methods=["POST"]),
                       Route("/c", locked("fc")(ok()), methods=["POST"]))
        async with client_for(app) as client:
            assert (await client.post("/f")).status_code == 200
            await asyncio.to_thread(fresh_redis.stop)
            statuses = [(await client.post(path)).status_code for path in ("/f", "/f", "/c")]
    assert statuses == [200, 200, 503] and len(ran) == 3 and ran[1:] == [None, None]
    # One run with Redis asked, one refused by the open circuit: both ran unlocked, both counted.
    assert counter_points(reader, "otel_lock.fail_open") == {(("lock.name", "fo"),): 2}


async def test_an_open_circuit_fails_at_once_yet_lets_the_loop_turn():
    """Regression: a refused acquisition raised without giving the loop a turn, so a caller that retried at once
    (`while True: try: await acquire() except RedisUnavailable: ...`) spun the loop: the half-open probe's reply
    was never read, and the circuit never closed (a cluster slot migrated under load, now and then)."""
    breaker = Breaker(1, 60.0)
    breaker.record(False)  # open
    other_ran = asyncio.Event()

    async def other() -> None:
        other_ran.set()

    async def call() -> None:
        raise AssertionError("not admitted: never started")

    asyncio.get_running_loop().call_soon(lambda: asyncio.ensure_future(other()))
    for _ in range(100):
        if other_ran.is_set():
            break
        with pytest.raises(RedisUnavailable):
            await breaker.guarded(call())
    assert other_ran.is_set(), "the refused callers never let another task run"
