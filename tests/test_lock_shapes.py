"""Permits (`semaphore()`) and shared holds (`lock(shared=True)`) in one process, against a real redis-server."""

from __future__ import annotations

import asyncio

import pytest

from otel_lock import LockError, LockLost, LockManager, LockTimeout


async def until(predicate, deadline: float = 10.0) -> None:
    """Poll Redis state until `predicate()` holds; fail instead of hanging."""
    async with asyncio.timeout(deadline):
        while not await predicate():
            await asyncio.sleep(0.01)


async def queued(client, queue: str, n: int) -> None:
    async def check() -> bool:
        return await client.zcard(queue) == n
    await until(check)


# -- permits -------------------------------------------------------------------


async def test_semaphore_lets_in_permits_holders_and_tells_the_limit(locks, other, redis_client):
    async with locks.semaphore("export:t3", permits=2) as one, other.semaphore("export:t3", permits=2) as two:
        assert one.key == two.key == "t:{export:t3}:permits"
        assert one.permits == two.permits == 2 and one.mode == "permit"
        assert two.token > one.token
        assert await redis_client.zcard(one.key) == 2
        assert await locks.try_lock("export:t3") is not None  # a lock of the same name is another key family
        with pytest.raises(LockTimeout):
            await other.acquire_permit("export:t3", permits=2, wait=0)
    assert await redis_client.exists("t:{export:t3}:permits", "t:{export:t3}:permits:t") == 0


async def test_each_semaphore_call_takes_a_permit_of_its_own(locks):
    async with locks.semaphore("s", permits=2) as one:
        async with locks.semaphore("s", permits=2) as two:
            assert one.owner != two.owner and two.depth == 1
            with pytest.raises(LockTimeout):
                await locks.acquire_permit("s", permits=2, wait=0)


async def test_a_release_wakes_the_first_waiter_with_a_fresh_token(locks, other, redis_client):
    holder = await locks.acquire_permit("s", permits=1)
    order: list[str] = []

    async def wait_for(name: str) -> None:
        async with other.semaphore("s", permits=1, wait=10.0) as held:
            order.append(name)
            assert held.token > holder.token

    first = asyncio.create_task(wait_for("first"))
    await queued(redis_client, "t:{s}:permits:q", 1)
    second = asyncio.create_task(wait_for("second"))
    await queued(redis_client, "t:{s}:permits:q", 2)
    assert await holder.release() is True
    await asyncio.gather(first, second)
    assert order == ["first", "second"]


async def test_a_waiter_is_woken_by_the_grant_notice_not_by_polling(locks, redis_url, redis_client):
    holder = await locks.acquire_permit("s", permits=1, lease=60.0)
    pubsub = redis_client.pubsub()
    await pubsub.psubscribe("*")
    # poll_cap=60 and a 60 s lease: no fallback poll can come before the bound below, only the notice
    other = LockManager.from_url(redis_url, namespace="t", poll_cap=60.0)
    waiter = asyncio.create_task(other.acquire_permit("s", permits=1, wait=60.0))
    await queued(redis_client, "t:{s}:permits:q", 1)
    await holder.release()
    held = await asyncio.wait_for(waiter, 20)
    notices = []
    while (message := await pubsub.get_message(timeout=0.5)) is not None:
        if message["type"] == "pmessage":
            notices.append(message["data"].decode())
    await pubsub.aclose()
    # the release published the grant to the waiter's manager; one ACQUIRE (the queued one) was all it sent
    assert any(n.startswith(f"{held.owner} {held.token} t:{{s}}:permits") for n in notices), notices
    await held.release()
    await other.aclose()


async def test_another_limit_for_a_key_in_use_is_refused(locks, other):
    async with locks.semaphore("s", permits=2):
        with pytest.raises(ValueError, match="permits=2"):
            await other.acquire_permit("s", permits=3, wait=0)
    async with other.semaphore("s", permits=3) as held:  # once idle, the limit may change
        assert held.permits == 3


@pytest.mark.parametrize("permits", [0, -1, 1.5, "2", True, None], ids=repr)
async def test_bad_permits_are_refused_before_redis(locks, permits):
    with pytest.raises(ValueError, match="permits must be a whole number"):
        await locks.acquire_permit("s", permits=permits)


async def test_a_crashed_holders_permit_returns_at_its_lease(locks, other, redis_client):
    # a holder that never releases and is never renewed (its manager gone): its permit comes back with its lease
    await locks.acquire_permit("s", permits=1, lease=0.5, cancel_on_lost=False)
    await locks.aclose()
    async with other.semaphore("s", permits=1, wait=10.0) as held:
        assert await redis_client.zcard(held.key) == 1


async def test_the_watchdog_renews_every_permit(redis_url, redis_client):
    async with LockManager.from_url(redis_url, namespace="t", lease=0.6) as locks:
        async with locks.semaphore("s", permits=3) as one, locks.semaphore("s", permits=3) as two:
            await asyncio.sleep(1.5)  # several leases long: renewals keep both
            assert not one.lost.is_set() and not two.lost.is_set()
            assert await redis_client.zcard(one.key) == 2


async def test_a_lost_permit_cancels_its_holder(redis_url, redis_client):
    async with LockManager.from_url(redis_url, namespace="t", lease=1.5) as locks:
        async def body() -> None:
            async with locks.semaphore("s", permits=1, cancel_on_lost=True) as held:
                await redis_client.zrem(held.key, held.owner)  # taken from it (an operator, a flush)
                await asyncio.sleep(60)

        with pytest.raises(LockLost):
            await asyncio.wait_for(asyncio.create_task(body()), 30)


# -- shared --------------------------------------------------------------------


async def test_shared_holders_overlap_and_exclude_an_exclusive_one(locks, other, redis_client):
    async with locks.lock("cat", shared=True) as one, other.lock("cat", shared=True) as two:
        assert one.mode == two.mode == "shared" and one.key == "t:{cat}"
        assert two.token > one.token
        assert await redis_client.hget("t:{cat}", "owner") == b"(shared)"
        assert await asyncio.create_task(other.try_lock("cat")) is None  # another task: a caller like any other
    async with locks.lock("cat") as writer:
        assert writer.mode == "exclusive"
        assert await other.try_lock("cat", shared=True) is None
    assert await redis_client.exists("t:{cat}", "t:{cat}:sh", "t:{cat}:sh:t") == 0


async def test_a_shared_request_queues_behind_a_waiting_exclusive_one(locks, other, redis_client):
    reader = await locks.acquire("cat", shared=True, lease=60.0)
    writer = asyncio.create_task(other.acquire("cat", wait=30.0))
    await queued(redis_client, "t:{cat}:q", 1)
    assert await other.try_lock("cat", shared=True) is None  # not starved: the writer is next
    late = asyncio.create_task(other.acquire("cat", shared=True, wait=30.0))
    await queued(redis_client, "t:{cat}:q", 2)
    await reader.release()
    held = await writer
    assert held.mode == "exclusive" and not late.done()
    await held.release()
    later = await late
    assert later.mode == "shared" and later.token > held.token
    await later.release()


@pytest.mark.parametrize("gives_up", ["cancelled", "timed out"])
async def test_a_writer_that_gives_up_lets_in_the_shared_waiters_it_kept_out(locks, redis_url, redis_client, gives_up):
    # Regression: the exclusive LEAVE did not look at a key held shared, so the readers queued behind a writer
    # that gave up stayed queued beside the shared holders until their fallback poll (one every poll_cap).
    readers_side = LockManager.from_url(redis_url, namespace="t", poll_cap=60.0)  # no poll can let them in here
    try:
        reader = await locks.acquire("cat", shared=True, lease=60.0)
        writer = asyncio.create_task(locks.acquire("cat", wait=30.0 if gives_up == "cancelled" else 0.5))
        await queued(redis_client, "t:{cat}:q", 1)
        readers = [asyncio.create_task(readers_side.acquire("cat", shared=True, wait=30.0)) for _ in range(3)]
        await queued(redis_client, "t:{cat}:q", 4)
        if gives_up == "cancelled":
            writer.cancel()
        with pytest.raises(asyncio.CancelledError if gives_up == "cancelled" else LockTimeout):
            await writer
        held = await asyncio.wait_for(asyncio.gather(*readers), 10)  # without the fix: at their poll, in 48 s or more
        assert {h.mode for h in held} == {"shared"} and await redis_client.zcard("t:{cat}:sh") == 4
        for h in [reader, *held]:
            await h.release()
    finally:
        await readers_side.aclose()


async def test_a_shared_waiter_that_joins_from_the_head_lets_in_the_shared_waiters_behind_it(locks, other,
                                                                                              redis_client):
    # Regression: behind a writer that died queued (no LEAVE, its deadline passed), the first reader joined at its
    # poll and the readers behind it stayed queued, each let in by a poll of its own (only a manager's first
    # waiter polls: one reader per poll_cap).
    from otel_lock.lock._attempt import queue_record
    from otel_lock.lock._scripts import acquire

    reader = await locks.acquire("cat", shared=True, lease=60.0)
    dead = queue_record("dead", 1500, 30000, "dead", "", "nobody-listens", False, "")
    # ACQUIRE's ARGV: owner, waiter, lease_ms, -, queue_ms, ctx, fence_ttl_ms, channel, sharded
    assert (await acquire(redis_client, ("t:{cat}", "t:{cat}:fence", "t:{cat}:q", "t:{cat}:w"),
                          ["dead", dead, 30000, "0", 1500, "", 60000, "nobody-listens", "0"]))[0] == 0
    readers = []
    for n in range(3):
        readers.append(asyncio.create_task(other.acquire("cat", shared=True, wait=30.0)))
        await queued(redis_client, "t:{cat}:q", n + 2)
    first = await readers[0]  # at its poll, once the dead writer's deadline has passed
    assert await redis_client.zcard("t:{cat}:sh") == 4  # the others were let in by the same script
    for h in [reader, first, *await asyncio.gather(*readers[1:])]:
        await h.release()


async def test_an_exclusive_release_lets_in_every_shared_waiter_at_the_head(locks, other, redis_client):
    writer = await locks.acquire("cat", lease=60.0)
    readers = [asyncio.create_task(other.acquire("cat", shared=True, wait=30.0)) for _ in range(3)]
    await queued(redis_client, "t:{cat}:q", 3)
    second_writer = asyncio.create_task(locks.acquire("cat", wait=30.0))
    await queued(redis_client, "t:{cat}:q", 4)
    await writer.release()
    held = await asyncio.gather(*readers)
    assert {h.mode for h in held} == {"shared"} and len({h.owner for h in held}) == 3
    assert not second_writer.done()
    assert await redis_client.zcard("t:{cat}:sh") == 3
    for h in held:
        await h.release()
    (await second_writer)
    await (await second_writer).release()


async def test_shared_nests_in_its_task_and_an_exclusive_inside_it_is_refused(locks):
    async with locks.lock("cat", shared=True) as outer:
        async with locks.lock("cat", shared=True) as inner:
            assert inner.depth == 2 and inner.owner == outer.owner
        with pytest.raises(LockError, match="held shared by this task"):
            await locks.acquire("cat")
    async with locks.lock("cat") as writer:
        async with locks.lock("cat", shared=True) as inner:  # a shared request inside its own exclusive hold
            assert inner.depth == 2 and inner.owner == writer.owner


async def test_a_lost_shared_lease_is_told_and_cancels(redis_url, redis_client):
    async with LockManager.from_url(redis_url, namespace="t", lease=1.5) as locks:
        async def body() -> None:
            async with locks.lock("cat", shared=True, cancel_on_lost=True) as held:
                await redis_client.zrem("t:{cat}:sh", held.owner)
                await asyncio.sleep(60)

        with pytest.raises(LockLost):
            await asyncio.wait_for(asyncio.create_task(body()), 30)


async def test_a_crashed_shared_holder_lets_the_writer_in_at_its_lease(locks, other):
    await locks.acquire("cat", shared=True, lease=0.5, cancel_on_lost=False)
    await locks.aclose()
    async with other.lock("cat", wait=10.0) as writer:
        assert writer.mode == "exclusive"


async def test_force_release_of_a_shared_key_releases_every_reader(locks, other):
    one = await locks.acquire("cat", shared=True)
    two = await other.acquire("cat", shared=True)
    assert await locks.force_release("cat") is True
    writer = await asyncio.create_task(locks.acquire("cat", wait=1.0))
    assert writer.mode == "exclusive"
    await writer.release()
    assert await one.release() is False and await two.release() is False


async def test_shared_owner_is_refused(locks):
    with pytest.raises(TypeError, match="owner="):
        await locks.acquire("cat", shared=True, owner="me")
    with pytest.raises(TypeError, match="shared must be"):
        await locks.acquire("cat", shared="yes")


# -- telemetry -------------------------------------------------------------------


@pytest.fixture
def otel():
    from test_lock_telemetry import Telemetry

    telemetry = Telemetry()
    yield telemetry
    telemetry.tracer_provider.shutdown()
    telemetry.meter_provider.shutdown()


async def test_lock_mode_and_permits_in_use_against_the_limit(redis_url, otel):
    async with LockManager.from_url(redis_url, namespace="t", **otel.providers()) as locks:
        with otel.tracer.start_as_current_span("request"):
            async with locks.semaphore("export:t3", permits=2, name="export") as held:
                assert otel.gauge("otel_lock.permits.used", "export") == 1
                assert otel.gauge("otel_lock.permits.limit", "export") == 2
            async with locks.lock("cat", shared=True, name="catalogue"):
                pass
            async with locks.lock("price", name="price"):
                pass
        assert otel.gauge("otel_lock.permits.used", "export") == 0
        assert otel.gauge("otel_lock.permits.limit", "export") == 2
        modes = {dict(p.attributes)["lock.name"]: dict(p.attributes).get("lock.mode")
                 for _, p in otel.points("otel_lock.wait.duration") if p.count}
        assert modes == {"export": "permit", "catalogue": "shared", "price": None}  # exclusive series unchanged
        holds = {dict(p.attributes)["lock.name"]: dict(p.attributes).get("lock.mode")
                 for _, p in otel.points("otel_lock.hold.duration") if p.count}
        assert holds == modes
        spans = {s.name: s.attributes for s in otel.spans.get_finished_spans()}
        assert spans["lock acquire export"]["lock.mode"] == "permit"
        assert spans["lock hold export"]["lock.permits"] == 2 and spans["lock hold export"]["lock.token"] == held.token
        assert spans["lock acquire catalogue"]["lock.mode"] == "shared"
        assert spans["lock acquire price"]["lock.mode"] == "exclusive"


# -- topologies that refuse the shapes ---------------------------------------------


async def test_redlock_refuses_shared_holds_and_permits_before_a_byte_is_sent():
    from otel_lock import RedLockManager

    locks = RedLockManager.from_urls(["redis://127.0.0.1:1", "redis://127.0.0.1:2", "redis://127.0.0.1:3"])
    try:
        with pytest.raises(TypeError, match="RedLockManager does not offer semaphore"):
            await locks.acquire_permit("s", permits=2)
        with pytest.raises(TypeError, match="does not offer lock\\(shared=True\\)"):
            await locks.acquire("cat", shared=True)
    finally:
        await locks.aclose()


async def test_wait_replicas_refuses_shared_holds_and_permits_at_their_first_use(redis_url):
    async with LockManager.from_url(redis_url, namespace="t", wait_replicas=1,
                                    wait_replicas_timeout=0.05) as locks:
        with pytest.raises(LockError, match="not offered with wait_replicas"):
            await locks.acquire_permit("s", permits=2, wait=0)
        with pytest.raises(LockError, match="not offered with wait_replicas"):
            await locks.acquire("cat", shared=True, wait=0)


async def test_a_manager_says_which_shapes_it_refuses_before_any_call(redis_url):
    """`unsupported_reason(mode)`: what a start-up check (the middleware's) asks, without a round trip."""
    from otel_lock import RedLockManager

    async with LockManager.from_url(redis_url, namespace="t") as plain, \
            LockManager.from_url(redis_url, namespace="t", wait_replicas=1) as replicated:
        assert [plain.unsupported_reason(m) for m in ("exclusive", "shared", "permit")] == [None, None, None]
        assert replicated.unsupported_reason("exclusive") is None
        assert "wait_replicas" in replicated.unsupported_reason("permit")
        with pytest.raises(ValueError, match="mode must be one of exclusive, shared, permit, not 'reader'"):
            plain.unsupported_reason("reader")
    quorum = RedLockManager.from_urls(["redis://127.0.0.1:1", "redis://127.0.0.1:2", "redis://127.0.0.1:3"])
    try:
        assert "quorum" in quorum.unsupported_reason("shared")
    finally:
        await quorum.aclose()


# -- the scripts' hand-over paths, driven directly ---------------------------------


async def _queue_shared(client, waiter: str, channel: str) -> list:
    from otel_lock.lock._shapes import SHARED

    # ACQUIRE's ARGV: owner, waiter, lease_ms, -, queue_ms, ctx, fence_ttl_ms, channel, sharded
    return await SHARED.acquire(client, SHARED.keys("t:{cat}"), [waiter, waiter, 30000, "0", 20000, "", 60000,
                                                                 channel, "0"])


async def test_a_plain_release_to_a_shared_waiter_is_turned_shared_by_its_claim(locks, redis_client):
    writer = await locks.acquire("cat", lease=60.0)
    pubsub = redis_client.pubsub()
    await pubsub.subscribe("chan")  # the waiters' manager: a grant published there is delivered
    assert (await _queue_shared(redis_client, "w1", "chan"))[0] == 0
    assert (await _queue_shared(redis_client, "w2", "chan"))[0] == 0
    await writer.release()  # the unchanged RELEASE: w1 gets it as if exclusive
    assert await redis_client.hget("t:{cat}", "waiter") == b"w1"
    claimed = await _queue_shared(redis_client, "w1", "chan")  # w1's confirming ACQUIRE
    assert claimed[0] == 1
    assert await redis_client.hget("t:{cat}", "owner") == b"(shared)"
    assert sorted(await redis_client.zrange("t:{cat}:sh", 0, -1)) == [b"w1", b"w2"]  # w2 let in behind it
    assert await redis_client.hget("t:{cat}:sh:t", "u:w2") == b"w2"  # w2's grant, not claimed yet
    assert (await _queue_shared(redis_client, "w2", "chan"))[0] == 1
    await pubsub.aclose()


async def test_a_shared_waiter_leaving_an_unclaimed_grant_passes_it_on(locks, other, redis_client):
    from otel_lock.lock._shapes import SHARED

    writer = await locks.acquire("cat", lease=60.0)
    pubsub = redis_client.pubsub()
    await pubsub.subscribe("chan")
    await _queue_shared(redis_client, "w1", "chan")
    next_writer = asyncio.create_task(other.acquire("cat", wait=30.0))
    await queued(redis_client, "t:{cat}:q", 2)
    await writer.release()
    assert await redis_client.hget("t:{cat}", "waiter") == b"w1"
    assert await SHARED.leave(redis_client, SHARED.keys("t:{cat}"), ["w1", 60000]) == 1
    held = await asyncio.wait_for(next_writer, 20)
    assert held.mode == "exclusive" and held.token > writer.token
    await held.release()
    await pubsub.aclose()


async def test_the_last_shared_holder_leaving_hands_on_to_a_writer_and_not_past_it(locks, other, redis_client):
    reader = await locks.acquire("cat", shared=True, lease=60.0)
    writer = asyncio.create_task(other.acquire("cat", wait=30.0))
    await queued(redis_client, "t:{cat}:q", 1)
    late_reader = asyncio.create_task(other.acquire("cat", shared=True, wait=30.0))
    await queued(redis_client, "t:{cat}:q", 2)
    second_writer = asyncio.create_task(locks.acquire("cat", wait=30.0))
    await queued(redis_client, "t:{cat}:q", 3)
    await reader.release()
    first = await writer
    await first.release()
    shared = await late_reader
    assert not second_writer.done()  # the reader got in, the writer behind it still waits
    await shared.release()
    last = await second_writer
    assert first.token < shared.token < last.token  # one fence for every mode of the key
    await last.release()


async def test_a_permit_handed_to_a_waiter_that_left_goes_to_the_next_one(locks, other, redis_client):
    from otel_lock.lock._shapes import PERMIT

    holder = await locks.acquire_permit("s", permits=1, lease=60.0)
    pubsub = redis_client.pubsub()
    await pubsub.subscribe("chan")  # the first waiter's manager: its grant is delivered, then it leaves
    keys = PERMIT.keys("t:{s}")
    assert (await PERMIT.acquire(redis_client, keys, ["w1", "w1", 30000, "0", 20000, "", 60000, "chan", "0", 1]))[0] == 0
    second = asyncio.create_task(other.acquire_permit("s", permits=1, wait=30.0))
    await queued(redis_client, "t:{s}:permits:q", 2)
    await holder.release()
    assert await redis_client.zrange("t:{s}:permits", 0, -1) == [b"w1"]  # handed to w1, not claimed
    assert await PERMIT.leave(redis_client, keys, ["w1", 60000]) == 1
    held = await asyncio.wait_for(second, 20)
    assert held.token > holder.token
    await held.release()
    await pubsub.aclose()


async def test_a_cancelled_permit_waiter_leaves_the_queue(locks, other, redis_client):
    holder = await locks.acquire_permit("s", permits=1, lease=60.0)
    first = asyncio.create_task(other.acquire_permit("s", permits=1, wait=30.0))
    await queued(redis_client, "t:{s}:permits:q", 1)
    second = asyncio.create_task(other.acquire_permit("s", permits=1, wait=30.0))
    await queued(redis_client, "t:{s}:permits:q", 2)
    first.cancel()
    await queued(redis_client, "t:{s}:permits:q", 1)
    await holder.release()
    held = await asyncio.wait_for(second, 20)
    assert await redis_client.zrange(held.key, 0, -1) == [held.owner.encode()]
    await held.release()
    with pytest.raises(asyncio.CancelledError):
        await first
