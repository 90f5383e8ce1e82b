"""The lock under faults: killed subscribers, a restarted Redis, a stalling or
cut network, and cancellation at the worst moments.

Every wait has a generous bound that only turns a hang into a failure; the
bounds for "Redis unavailable" are a few socket timeouts, as the contract says.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest
import redis.asyncio as aioredis
from redis.exceptions import TimeoutError as RedisTimeoutError
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from _proc_helpers import DEADLINE, Agents, TcpProxy, keys, queued, until
from otel_lock import LockError, LockManager, LockTimeout, RedisUnavailable

pytestmark = pytest.mark.timeout(90)

SOCKET_TIMEOUT = 0.5
# A failing call may take a connect timeout plus a socket timeout (two, if a
# client retries once); anything near this bound is a hang.
UNAVAILABLE_BOUND = 4 * SOCKET_TIMEOUT + 2.0


@pytest.fixture
async def managers():
    made: list[LockManager] = []

    def make(url: str, **options) -> LockManager:
        manager = LockManager.from_url(url, **options)
        made.append(manager)
        return manager

    yield make
    for manager in made:
        await manager.aclose()


async def unavailable_within_bound(call) -> float:
    """Run `call()`; it must raise RedisUnavailable, and well before a hang."""
    start = time.monotonic()
    with pytest.raises(RedisUnavailable):
        async with asyncio.timeout(UNAVAILABLE_BOUND):
            await call()
    return time.monotonic() - start


# -- the subscriber connection killed -------------------------------------------


async def test_waiters_still_acquire_after_their_subscriber_is_killed(agents, managers, redis_url, redis_client):
    holder = managers(redis_url)
    hosts = await agents.start_many(["p1", "p2"])
    held = await holder.acquire("sub")
    waiters = []
    for i in range(4):
        host = hosts[i % 2]
        await host.send("hold", id=f"w{i}", key="sub", wait=DEADLINE)
        await queued(redis_client, "sub", i + 1)
        waiters.append((host, f"w{i}"))

    killed = await redis_client.client_kill_filter(_type="pubsub")
    assert killed >= 2  # every agent's subscriber (and ours, if it had one)
    # Released at once, while the subscribers reconnect: PUBLISH reaches nobody,
    # so the release skips those waiters (as it skips dead ones), and they take
    # the lock by their poll after reconnecting, in whatever order they poll.
    assert await held.release()
    left = dict((ident, host) for host, ident in waiters)
    while left:
        got = await _first_acquired(left)
        host = left.pop(got)
        await host.send("release", id=got)
        await host.expect("exited", got)
    assert await redis_client.exists(*keys("sub")) == 0


async def _first_acquired(waiting: dict) -> str:
    """The id of whichever waiter reports `acquired` first (one reader per agent)."""
    reads = {asyncio.create_task(host.expect("acquired")): host for host in set(waiting.values())}
    done, rest = await asyncio.wait(reads, timeout=DEADLINE, return_when=asyncio.FIRST_COMPLETED)
    for task in rest:
        task.cancel()
    await asyncio.gather(*rest, return_exceptions=True)
    assert done, f"none of {sorted(waiting)} acquired within {DEADLINE} s"
    event = next(iter(done)).result()
    waiting[event["id"]].last_token = event["token"]
    return event["id"]


# -- Redis killed and restarted -----------------------------------------------


async def test_redis_restart_mid_load_fails_fast_then_recovers(fresh_redis, managers):
    locks = managers(fresh_redis.url, socket_timeout=SOCKET_TIMEOUT, lease=3.0)
    holder = await locks.acquire("restart:held")
    ok, errors, slowest = [0], [], [0.0]
    enough = asyncio.Event()
    failing = asyncio.Event()
    stop = asyncio.Event()

    async def worker() -> None:
        while not stop.is_set():
            start = time.monotonic()
            try:
                async with asyncio.timeout(UNAVAILABLE_BOUND):
                    async with locks.lock("restart:load", wait=2.0) as held:
                        assert held.depth == 1
                ok[0] += 1
                if ok[0] % 20 == 0:
                    enough.set()
            except RedisUnavailable:
                slowest[0] = max(slowest[0], time.monotonic() - start)
                failing.set()
                await asyncio.sleep(0.01)  # back off; this is not synchronisation
            except BaseException as exc:  # a hang (TimeoutError) or anything unexpected
                errors.append(repr(exc))
                raise

    tasks = [asyncio.create_task(worker()) for _ in range(3)]
    try:
        await asyncio.wait_for(enough.wait(), DEADLINE)
        await asyncio.to_thread(fresh_redis.stop)
        await asyncio.wait_for(failing.wait(), DEADLINE)
        enough.clear()
        before = ok[0]
        await asyncio.to_thread(fresh_redis.start)
        await asyncio.wait_for(enough.wait(), DEADLINE)
        assert ok[0] > before
        # The restarted Redis is empty: the holder learns it at its next renewal.
        await asyncio.wait_for(holder.lost.wait(), DEADLINE)
    finally:
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)
    print(f"slowest RedisUnavailable while Redis was down: {slowest[0] * 1000:.0f} ms")
    assert errors == []
    assert not await holder.release()  # no longer ours, reported as such
    # The fence key died with Redis; tokens are seeded from Redis TIME and still grow.
    async with locks.lock("restart:held") as again:
        assert again.token > holder.token


async def test_call_while_redis_is_down_raises_redis_unavailable(fresh_redis, managers):
    locks = managers(fresh_redis.url, socket_timeout=SOCKET_TIMEOUT)
    await asyncio.to_thread(fresh_redis.stop)
    await unavailable_within_bound(lambda: locks.try_lock("down"))

    async def use_lock():
        async with locks.lock("down", wait=5.0):
            pass
    await unavailable_within_bound(use_lock)
    await asyncio.to_thread(fresh_redis.start)
    async with locks.lock("down", wait=5.0) as held:
        assert held.depth == 1


# -- a TCP proxy that stalls or cuts ----------------------------------------------


@pytest.fixture
async def proxy(redis_server):
    proxy = await TcpProxy("127.0.0.1", redis_server.port).start()
    yield proxy
    await proxy.aclose()


@pytest.mark.parametrize("fault", ["stall", "cut"])
async def test_stalled_or_cut_network_raises_redis_unavailable_then_recovers(
        proxy, managers, redis_url, fault, record_property):
    locks = managers(proxy.url, socket_timeout=SOCKET_TIMEOUT)
    async with locks.lock("net:a", wait=1.0):
        pass

    getattr(proxy, fault)()
    elapsed = [await unavailable_within_bound(lambda: locks.try_lock("net:b"))]

    async def use_lock():
        async with locks.lock("net:c", wait=5.0):
            pass
    elapsed.append(await unavailable_within_bound(use_lock))
    record_property("unavailable_after_s", [round(e, 3) for e in elapsed])
    print(f"{fault}: RedisUnavailable after {', '.join(f'{e * 1000:.0f} ms' for e in elapsed)}")

    proxy.forward()
    async with locks.lock("net:a", wait=5.0) as held:
        assert held.depth == 1
    held = await locks.try_lock("net:d")
    assert held is not None and await held.release()


async def test_holder_behind_a_stalled_network_learns_its_lease_is_lost(proxy, managers, redis_url):
    locks = managers(proxy.url, socket_timeout=SOCKET_TIMEOUT, lease=1.2)
    other = managers(redis_url)
    held = await locks.acquire("net:holder")
    proxy.stall()
    # No renewal can be confirmed: the lease is reported lost, not assumed alive.
    await asyncio.wait_for(held.lost.wait(), DEADLINE)
    async with other.lock("net:holder", wait=DEADLINE) as taken:
        assert taken.token > held.token
    proxy.forward()


# -- cancellation ----------------------------------------------------------------


async def test_cancelled_waiter_leaves_nothing_in_redis(managers, redis_url, redis_client):
    holder, waiter = managers(redis_url), managers(redis_url)
    held = await holder.acquire("cancel")
    task = asyncio.create_task(waiter.acquire("cancel", wait=DEADLINE))
    await queued(redis_client, "cancel", 1)

    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    lock, queue, waiting = keys("cancel")
    assert await redis_client.exists(queue, waiting) == 0
    assert (await redis_client.hget(lock, "owner")).decode() == held.owner
    assert await held.release()
    assert await redis_client.exists(lock, queue, waiting) == 0


async def test_waiter_that_times_out_leaves_the_queue(managers, redis_url, redis_client):
    holder, waiter = managers(redis_url), managers(redis_url)
    held = await holder.acquire("timeout")
    with pytest.raises(LockTimeout):
        await waiter.acquire("timeout", wait=0.2)
    lock, queue, waiting = keys("timeout")
    assert await redis_client.exists(queue, waiting) == 0
    assert await held.release()
    assert await redis_client.exists(lock) == 0


@pytest.mark.parametrize("steps", range(0, 40, 3), ids=lambda s: f"cancel-after-{s}-steps")
async def test_cancel_racing_a_hand_over_never_strands_the_lock(managers, redis_url, redis_client, steps):
    holder, first, second = managers(redis_url), managers(redis_url), managers(redis_url)
    name = "race"
    held = await holder.acquire(name)

    async def hold_forever(manager: LockManager) -> None:
        async with manager.lock(name, wait=DEADLINE):
            await asyncio.Event().wait()

    doomed = asyncio.create_task(hold_forever(first))
    await queued(redis_client, name, 1)

    async def take() -> int:
        async with second.lock(name, wait=DEADLINE) as h:
            return h.token
    survivor = asyncio.create_task(take())
    await queued(redis_client, name, 2)

    release = asyncio.create_task(held.release())
    for _ in range(steps):  # land the cancellation anywhere in the hand-over
        await asyncio.sleep(0)
    doomed.cancel()
    with pytest.raises(asyncio.CancelledError):
        await doomed
    # Whatever the interleaving, the cancelled waiter holds nothing now.
    owner = await redis_client.hget(keys(name)[0], "owner")
    assert owner is None or not owner.decode().startswith(first.id)
    assert await release
    assert await asyncio.wait_for(survivor, DEADLINE) > held.token
    assert await redis_client.exists(*keys(name)) == 0


async def test_acquire_whose_reply_was_lost_does_not_strand_the_lock(proxy, managers, redis_url, redis_client):
    locks = managers(proxy.url, socket_timeout=SOCKET_TIMEOUT)  # default lease: 30 s
    other = managers(redis_url)
    async with locks.lock("net:warm", wait=1.0):
        pass

    proxy.stall_replies()  # the acquire runs in Redis; its reply never comes back
    await unavailable_within_bound(lambda: locks.try_lock("net:ghost"))
    proxy.forward()

    # The caller was told it did not get the lock, so nobody may keep it for 30 s.
    async with other.lock("net:ghost", wait=5.0) as held:
        assert held.depth == 1


async def _nothing_left(redis_client, name: str, holder: str | None = None) -> None:
    """Within a bound far below the 30 s lease: no ghost owner and no ghost queue entry."""
    lock, queue, waiting = keys(name)

    async def clean():
        owner = await redis_client.hget(lock, "owner")
        return (owner is None or owner.decode() == holder) and await redis_client.exists(queue, waiting) == 0
    await until(clean, f"the cancelled acquire of {name} to leave nothing in Redis", timeout=2.0)


async def test_cancel_during_the_acquire_call_on_a_free_lock_leaves_nothing(proxy, managers, redis_client):
    locks = managers(proxy.url, socket_timeout=10.0)  # long: this is cancellation, not a timeout
    async with locks.lock("cx:warm", wait=1.0):
        pass
    proxy.stall_replies()  # the script runs in Redis; its reply waits in the proxy
    task = asyncio.create_task(locks.acquire("cx:free", wait=5.0))

    async def ran():
        return await redis_client.exists(keys("cx:free")[0])
    await until(ran, "the acquire to run in Redis")
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    proxy.forward()
    await _nothing_left(redis_client, "cx:free")


async def test_cancel_during_the_acquire_call_on_a_busy_lock_leaves_nothing(proxy, managers, redis_url, redis_client):
    holder = managers(redis_url)
    locks = managers(proxy.url, socket_timeout=10.0)
    held = await holder.acquire("cx:busy")
    with pytest.raises(LockTimeout):  # a contended wait starts the subscriber: later waits queue at once
        await locks.acquire("cx:busy", wait=0.05)
    proxy.stall_replies()
    task = asyncio.create_task(locks.acquire("cx:busy", wait=5.0))
    await queued(redis_client, "cx:busy", 1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    proxy.forward()
    await _nothing_left(redis_client, "cx:busy", holder=held.owner)


async def test_cancelled_acquire_whose_reply_is_then_lost_leaves_nothing(proxy, managers, redis_client):
    locks = managers(proxy.url, socket_timeout=10.0)
    async with locks.lock("cx:warm", wait=1.0):
        pass
    proxy.stall_replies()
    task = asyncio.create_task(locks.acquire("cx:cut", wait=5.0))

    async def ran():
        return await redis_client.exists(keys("cx:cut")[0])
    await until(ran, "the acquire to run in Redis")
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    proxy.cut()  # the late reply dies with the connection: the outcome is unknown
    proxy.forward()
    await _nothing_left(redis_client, "cx:cut")


async def test_reentry_whose_reply_was_lost_does_not_strand_the_lock(proxy, managers, redis_url):
    locks = managers(proxy.url, socket_timeout=SOCKET_TIMEOUT)  # default lease: 30 s
    other = managers(redis_url)
    async with locks.lock("net:nested", wait=1.0):
        proxy.stall_replies()  # the nested ACQUIRE runs (depth 2), its reply is lost
        with pytest.raises(RedisUnavailable):
            async with locks.lock("net:nested"):
                pass
        proxy.forward()
    # The outermost hold has ended: the lock must be free, not held for 30 s.
    async with other.lock("net:nested", wait=5.0) as held:
        assert held.depth == 1


def _renewals(reader: InMemoryMetricReader) -> dict[str, int]:
    """otel_lock.renewals by lock.renewal.outcome."""
    data = reader.get_metrics_data()
    counts: dict[str, int] = {}
    for rm in data.resource_metrics if data else []:
        for sm in rm.scope_metrics:
            for metric in sm.metrics:
                if metric.name == "otel_lock.renewals":
                    for point in metric.data.data_points:
                        outcome = point.attributes["lock.renewal.outcome"]
                        counts[outcome] = counts.get(outcome, 0) + point.value
    return counts


async def test_short_outage_does_not_lose_a_watched_lease(proxy):
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    locks = LockManager.from_url(proxy.url, socket_timeout=SOCKET_TIMEOUT, lease=3.0, meter_provider=provider)
    try:
        async with locks.lock("net:blip") as held:
            proxy.cut()

            async def renewal_failed():
                return _renewals(reader).get("error", 0) >= 1
            await until(renewal_failed, "a renewal to fail during the outage", every=0.02)
            proxy.forward()
            ok = _renewals(reader).get("ok", 0)

            async def renewed():
                return _renewals(reader).get("ok", 0) > ok
            # The watchdog retries well within the lease: the hold survives the blip.
            await until(renewed, "a renewal to succeed after the outage", every=0.02)
            assert not held.lost.is_set()
    finally:
        await locks.aclose()
        provider.shutdown()


async def test_killed_holder_process_frees_the_lock_when_its_lease_runs_out(agents, managers, redis_url):
    holder = await agents.start("holder", lease=1.0)
    await holder.send("hold", id="h", key="dead-holder")
    h = await holder.expect("acquired", "h")
    holder.signal(signal.SIGKILL)
    await holder.proc.wait()
    locks = managers(redis_url)
    async with locks.lock("dead-holder", wait=DEADLINE) as held:
        assert held.token > h["token"]


async def test_release_that_failed_during_an_outage_does_not_strand_the_lock(proxy, managers, redis_url):
    locks = managers(proxy.url, socket_timeout=SOCKET_TIMEOUT)  # default lease: 30 s
    other = managers(redis_url)
    async with locks.lock("net:unreleased", wait=1.0):
        proxy.cut()  # the release cannot reach Redis (and is logged, not raised)
    proxy.forward()
    async with other.lock("net:unreleased", wait=5.0) as held:
        assert held.depth == 1


async def test_redis_restart_with_waiters_in_other_processes_strands_nobody(fresh_redis, redis_url):
    group = Agents(fresh_redis.url)
    try:
        holder, *hosts = await group.start_many(["holder", "p1", "p2"], lease=3.0, socket_timeout=SOCKET_TIMEOUT)
        await holder.send("hold", id="h", key="reboot")
        h = await holder.expect("acquired", "h")
        client = aioredis.Redis.from_url(fresh_redis.url)
        try:
            for i, host in enumerate(hosts):
                await host.send("hold", id=f"w{i}", key="reboot", wait=DEADLINE)
                await queued(client, "reboot", i + 1)
        finally:
            await client.aclose()

        await asyncio.to_thread(fresh_redis.restart)  # the lock and its queue are gone
        # The holder hears it at its next renewal.
        await holder.expect("lost", "h")
        # A queued waiter whose deadline has not passed rides out the
        # restart (it re-queues once Redis answers) instead of failing. The queue
        # was lost with the data, so they come in whatever order they re-queue.
        tokens = []
        left = {f"w{i}": host for i, host in enumerate(hosts)}
        while left:
            got = await _first_acquired(left)
            host = left.pop(got)
            tokens.append(host.last_token)
            await host.send("release", id=got)
            await host.expect("exited", got)
        for i, host in enumerate([holder, *hosts]):
            await host.send("hold", id=f"again{i}", key="reboot", wait=DEADLINE)
            tokens.append((await host.expect("acquired", f"again{i}"))["token"])
            await host.send("release", id=f"again{i}")
            await host.expect("exited", f"again{i}")
        assert min(tokens) > h["token"]  # seeded from Redis TIME: still increasing
    finally:
        await group.close()


async def test_acquire_retried_by_redis_py_after_a_slow_reply_is_not_stranded(proxy, redis_url, managers, redis_client):
    # RESP3 keeps the manager on redis-py's own client; configured (as many
    # apps do) to retry on timeouts, it re-sends a command Redis may have run.
    client = aioredis.Redis.from_url(proxy.url, protocol=3, socket_timeout=SOCKET_TIMEOUT,
                                     retry_on_error=[RedisTimeoutError])
    locks = LockManager(client)  # default lease: 30 s
    other = managers(redis_url)
    try:
        async with locks.lock("py:warm", wait=1.0):
            pass
        proxy.stall_replies()  # Redis runs the acquire; the reply is late
        connections = proxy.accepted
        attempt = asyncio.create_task(locks.try_lock("py:slow"))

        async def ran():
            return await redis_client.exists(keys("py:slow")[0])

        async def reconnected():
            return proxy.accepted > connections or attempt.done()
        await until(ran, "the acquire to run in Redis")
        await until(reconnected, "redis-py to reconnect to retry (or give up)")
        print(f"reconnections: {proxy.accepted - connections}, attempt done: {attempt.done()}")
        proxy.forward()
        try:
            async with asyncio.timeout(UNAVAILABLE_BOUND):
                held = await attempt
        except LockError as error:
            print(f"the acquire raised {error!r}")
            held = None
        if held is not None:  # the caller got the lock it took: fine
            assert await held.release()
        # Either way, nobody may keep the lock for its 30 s lease now.
        async with other.lock("py:slow", wait=5.0) as taken:
            assert taken.depth == 1
    finally:
        await locks.aclose()
        await client.aclose()


async def test_frozen_redis_fails_fast_and_leaves_no_ghost_after_it_thaws(fresh_redis, managers):
    locks = managers(fresh_redis.url, socket_timeout=SOCKET_TIMEOUT)  # default lease: 30 s
    other = managers(fresh_redis.url)
    async with locks.lock("frozen:warm", wait=1.0):
        pass
    os.kill(fresh_redis.process.pid, signal.SIGSTOP)  # like a Redis stuck in a fork or swapping
    try:
        # The kernel still accepts and buffers the commands; Redis runs them when it thaws.
        await unavailable_within_bound(lambda: locks.try_lock("frozen:a"))

        async def use_lock():
            async with locks.lock("frozen:b", wait=5.0):
                pass
        await unavailable_within_bound(use_lock)
    finally:
        os.kill(fresh_redis.process.pid, signal.SIGCONT)
    # Whatever the frozen Redis ran late is undone: nobody waits out a 30 s lease.
    for name in ("frozen:a", "frozen:b"):
        async with other.lock(name, wait=5.0) as held:
            assert held.depth == 1


async def test_waiter_whose_subscriber_went_silent_still_gets_the_lock(proxy, managers, redis_url, redis_client,
                                                                      record_property):
    holder = managers(redis_url)
    locks = managers(proxy.url)
    held = await holder.acquire("silent")
    with pytest.raises(LockTimeout):  # starts the waiter's subscriber
        await locks.acquire("silent", wait=0.05)
    # Its connection stays up but delivers nothing: no error tells the waiter.
    proxy.stall_subscribers()
    waiter = asyncio.create_task(locks.acquire("silent", wait=DEADLINE))
    await queued(redis_client, "silent", 1)
    released_at = time.monotonic()
    assert await held.release()
    taken = await asyncio.wait_for(waiter, DEADLINE)  # the fallback poll finds its grant
    delay = time.monotonic() - released_at
    record_property("silent_subscriber_delay_s", round(delay, 3))
    print(f"waiter with a silent subscriber got the lock {delay * 1000:.0f} ms after the release")
    assert taken.token > held.token
    assert await taken.release()
    proxy.forward()


async def test_silent_subscriber_connection_is_replaced(proxy, managers, redis_url, brisk_health_checks):
    holder = managers(redis_url)
    locks = managers(proxy.url)
    held = await holder.acquire("silent2")
    with pytest.raises(LockTimeout):  # starts the waiter's subscriber
        await locks.acquire("silent2", wait=0.05)
    await held.release()
    subscriptions = proxy.subscriptions
    proxy.stall_subscribers()

    async def resubscribed():
        return proxy.subscriptions > subscriptions
    await until(resubscribed, "the silent subscriber to be noticed and replaced", timeout=8.0, every=0.05)
