"""The lock core in one process, against a real redis-server."""

from __future__ import annotations

import asyncio
import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from otel_lock import LockError, LockLost, LockManager, LockTimeout, RedisUnavailable
from otel_lock.cli._redis_server import free_port
from otel_lock.lock._attempt import queue_record


async def until(predicate, deadline: float = 10.0) -> None:
    """Poll Redis state until `predicate()` holds; fail instead of hanging."""
    async with asyncio.timeout(deadline):
        while not await predicate():
            await asyncio.sleep(0.01)


async def queued(redis_client, key: str, n: int) -> None:
    await until(lambda: _zcard_is(redis_client, f"t:{{{key}}}:q", n))


async def _zcard_is(client, key, n):
    return await client.zcard(key) == n


async def test_lock_sets_owner_token_and_releases(locks, redis_client):
    async with locks.lock("stock:1") as held:
        assert held.key == "t:{stock:1}"
        assert held.depth == 1
        assert await redis_client.hget(held.key, "owner") == held.owner.encode()
        assert isinstance(held.token, int) and held.token > 0
        assert not held.lost.is_set()
    assert await redis_client.exists("t:{stock:1}") == 0


async def test_reentrancy_in_one_task_keeps_token_and_counts_depth(locks, other, redis_client):
    async with locks.lock("k") as outer:
        async with locks.lock("k") as inner:
            assert inner.depth == 2
            assert inner.token == outer.token and inner.owner == outer.owner
            assert await redis_client.hget(outer.key, "depth") == b"2"
        assert await redis_client.hget(outer.key, "depth") == b"1"
        assert await other.try_lock("k") is None
    assert await redis_client.exists("t:{k}") == 0


async def test_concurrent_task_waits_for_the_holder(locks, redis_client):
    events = []
    go = asyncio.Event()

    async def second():
        await go.wait()
        async with locks.lock("k"):
            events.append("second acquired")

    task = asyncio.create_task(second())  # spawned before the lock is held: not a child of the hold
    async with locks.lock("k"):
        go.set()
        await queued(redis_client, "k", 1)
        events.append("first releasing")
    await asyncio.wait_for(task, 5)
    assert events == ["first releasing", "second acquired"]


async def test_sibling_tasks_taking_a_new_key_exclude_each_other(locks):
    inside = 0
    overlaps = []
    entered = []

    async def child(i):
        nonlocal inside
        async with locks.lock("b") as held:
            inside += 1
            overlaps.append(inside)
            entered.append(held.owner)
            await asyncio.sleep(0.01)
            inside -= 1

    async with locks.lock("a"):
        await asyncio.gather(*(child(i) for i in range(3)))
    assert overlaps == [1, 1, 1]
    assert len(set(entered)) == 3


async def test_a_task_spawned_by_the_holder_is_another_caller(locks):
    """Re-entry belongs to the task that acquired the lock, like threading.RLock."""
    async with locks.lock("a"):
        async def child():
            async with locks.lock("a", wait=0):
                pass

        with pytest.raises(LockTimeout):
            await asyncio.create_task(child())


async def test_two_managers_are_two_clients_even_in_one_task(locks, other):
    async with locks.lock("k"):
        assert await other.try_lock("k") is None


async def test_explicit_owner_shares_ownership(locks, other):
    async with locks.lock("k", owner="batch-7") as first:
        held = await other.try_lock("k", owner="batch-7")
        assert held is not None and held.depth == 2 and held.token == first.token
        assert await held.release()


async def test_a_release_whose_script_redis_forgot_releases_one_level_only(locks, other, redis_client):
    """Regression: a RELEASE answered NOSCRIPT was sent again twice (`wait` and a second look at the same
    reply each started a reload), so with an owner shared by two holders the first holder's release took
    both levels: the lock was free while the second holder still held it."""
    first = await locks.acquire("k", owner="batch-7")
    second = await other.try_lock("k", owner="batch-7")
    assert second is not None and second.depth == 2
    await redis_client.script_flush()
    assert await first.release()

    async def no_release_in_flight() -> bool:
        return not [t for t in asyncio.all_tasks() if "let_go" in repr(t.get_coro())]
    await until(no_release_in_flight)
    assert await redis_client.hget("t:{k}", "depth") == b"1"
    assert await locks.try_lock("k") is None  # still the second holder's
    assert await second.release()
    assert await redis_client.exists("t:{k}") == 0


async def test_release_by_a_non_owner_never_deletes_the_lock(locks, redis_client):
    held = await locks.acquire("k")
    await redis_client.hset("t:{k}", "owner", "someone-else")
    assert await held.release() is False
    assert await redis_client.hget("t:{k}", "owner") == b"someone-else"
    assert held.lost.is_set()


async def test_fixed_lease_expires_without_renewal(locks, other, redis_client):
    held = await locks.acquire("k", lease=0.3)
    assert 0 < await redis_client.pttl("t:{k}") <= 300
    async with asyncio.timeout(5):
        await held.lost.wait()
    async with other.lock("k", wait=5) as taken:
        assert taken.token > held.token
    assert await held.release() is False


async def test_watchdog_keeps_a_lease_alive_past_three_leases(redis_url, redis_client):
    async with LockManager.from_url(redis_url, namespace="t", lease=0.3) as locks:
        async with locks.lock("k") as held:
            await asyncio.sleep(1.2)  # four leases of wall time: the premise, not a synchronisation
            assert not held.lost.is_set()
            assert await redis_client.hget("t:{k}", "owner") == held.owner.encode()
            assert await redis_client.pttl("t:{k}") > 0


async def test_lease_lost_cancels_the_holder_with_lock_lost(redis_url, redis_client):
    async with LockManager.from_url(redis_url, namespace="t", lease=0.3, cancel_on_lost=True) as locks:
        never = asyncio.Event()
        with pytest.raises(LockLost, match="lost"):
            async with asyncio.timeout(10):
                async with locks.lock("k") as held:
                    await redis_client.delete("t:{k}")
                    await never.wait()
        assert held.lost.is_set()


async def test_lease_lost_is_signalled_without_cancelling(locks, redis_client):
    async with LockManager(locks.redis, namespace="t", lease=0.3) as short:
        held = await short.acquire("k")
        await redis_client.hset("t:{k}", "owner", "thief")
        async with asyncio.timeout(10):
            await held.lost.wait()
        assert await held.release() is False


async def test_cancelled_waiter_leaves_nothing_in_redis(locks, other, redis_client):
    held = await locks.acquire("k")
    waiter = asyncio.create_task(other.acquire("k", wait=30))
    await queued(redis_client, "k", 1)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert await redis_client.zcard("t:{k}:q") == 0
    assert await redis_client.hlen("t:{k}:w") == 0
    assert await held.release()
    assert await redis_client.exists("t:{k}") == 0


async def test_timed_out_waiter_leaves_the_queue(locks, other, redis_client):
    async with locks.lock("k"):
        with pytest.raises(LockTimeout):
            await other.acquire("k", wait=0.2)
        assert await redis_client.zcard("t:{k}:q") == 0
    assert await redis_client.exists("t:{k}") == 0


async def test_cancelled_release_still_releases(locks, redis_client):
    held = await locks.acquire("k")
    task = asyncio.create_task(held.release())
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert await held.release() is True
    assert await redis_client.exists("t:{k}") == 0


async def test_release_wakes_waiters_in_arrival_order(locks, redis_url, redis_client):
    managers = [LockManager.from_url(redis_url, namespace="t") for _ in range(4)]
    order = []

    async def wait_turn(i, manager):
        async with manager.lock("k", wait=30):
            order.append(i)

    try:
        async with locks.lock("k"):
            tasks = []
            for i, manager in enumerate(managers):
                tasks.append(asyncio.create_task(wait_turn(i, manager)))
                await queued(redis_client, "k", i + 1)
        await asyncio.wait_for(asyncio.gather(*tasks), 10)
    finally:
        for manager in managers:
            await manager.aclose()
    assert order == [0, 1, 2, 3]


async def test_releasing_worker_does_not_take_the_lock_straight_back(locks, other, redis_client):
    first = await locks.acquire("k")
    waiter = asyncio.create_task(other.acquire("k", wait=10))
    await queued(redis_client, "k", 1)
    assert await first.release()
    assert await locks.try_lock("k") is None  # handed to the waiter, not up for grabs
    held = await asyncio.wait_for(waiter, 5)
    assert held.token > first.token
    await held.release()


async def test_a_contended_hand_over_costs_twelve_redis_commands(locks, other, redis_client):
    """A waiter's queued ACQUIRE and a holder's RELEASE to the head waiter, counted by Redis (inside scripts too).

    12: the two EVALSHA; in ACQUIRE one HMGET of the lock, TIME, ZADD of the waiter's entry (the queue
    member itself), the queue's PTTL and the lock's; in RELEASE one HMGET (owner, the token the next one
    follows), ZPOPMIN, HSET and PEXPIRE of the lock, PUBLISH. No fence, no clock, no waiters hash. (The
    waiter that finds no queue also sets the queue's expiry: the first one is not counted.)
    """
    for manager in (locks, other):  # started: their start-up checks are not counted
        async with manager.lock("warm-up"):
            pass
    holder = await locks.acquire("k")
    first = asyncio.create_task(other.acquire("k", wait=10))
    await queued(redis_client, "k", 1)
    await redis_client.config_resetstat()
    second = asyncio.create_task(other.acquire("k", wait=10))
    await queued(redis_client, "k", 2)
    await holder.release()
    held = await asyncio.wait_for(first, 5)
    stats = await redis_client.info("commandstats")
    await held.release()
    await (await asyncio.wait_for(second, 5)).release()
    counted = {name.removeprefix("cmdstat_"): s["calls"] for name, s in stats.items()
               if name not in ("cmdstat_config|resetstat", "cmdstat_zcard")}
    assert sum(counted.values()) <= 12, sorted(counted.items())
    assert held.token == holder.token + 1  # the next token follows the last


@settings(max_examples=300, deadline=None)
@given(texts=st.lists(st.text(), min_size=4, max_size=4), numbers=st.lists(st.integers(0, 2**53), min_size=2,
                                                                          max_size=2),
       sharded=st.booleans(), how=st.sampled_from(["", "s", "p"]))
def test_a_queue_record_is_the_json_of_its_fields(texts, numbers, sharded, how):
    """The waiter's queue entry is written out by hand (a hot path): byte for byte what json.dumps writes."""
    waiter_id, owner, ctx, channel = texts
    record = [waiter_id, numbers[0], numbers[1], owner, ctx, channel, 1 if sharded else 0] + ([how] if how else [])
    assert queue_record(waiter_id, numbers[0], numbers[1], owner, ctx, channel, sharded, how) == \
        json.dumps(record, separators=(",", ":"))


async def test_an_explicit_owner_with_quotes_queues_as_a_readable_record(redis_url, redis_client):
    """A user-named owner and namespace with quotes, backslashes and non-ASCII: the queue member parses back."""
    owner, namespace = 'job "7" \\ café', 'ns"\\é'
    async with LockManager.from_url(redis_url, namespace=namespace) as locks, \
            LockManager.from_url(redis_url, namespace=namespace) as other:
        holder = await locks.acquire("k")
        waiter = asyncio.create_task(other.acquire("k", wait=10, owner=owner))
        queue = f"{namespace}:{{k}}:q"
        await until(lambda: _zcard_is(redis_client, queue, 1))
        [member] = await redis_client.zrange(queue, 0, -1)
        record = json.loads(member)
        assert record[3] == owner and record[5].startswith(namespace)
        await holder.release()
        held = await asyncio.wait_for(waiter, 5)
        assert held.owner == owner
        await held.release()


async def test_try_lock_on_a_busy_key_does_not_queue(locks, other, redis_client):
    async with locks.lock("k"):
        assert await other.try_lock("k") is None
        assert await redis_client.exists("t:{k}:q") == 0


async def test_tokens_increase_for_a_reused_key(locks):
    tokens = []
    for _ in range(20):
        async with locks.lock("k") as held:
            tokens.append(held.token)
    assert tokens == sorted(set(tokens))


async def test_fence_state_expires_but_tokens_still_increase(redis_url, redis_client):
    async with LockManager.from_url(redis_url, namespace="f", fence_ttl=0.3) as locks:
        for i in range(200):
            async with locks.lock(f"order:{i}"):
                pass
        async with locks.lock("order:0") as before:
            pass
        assert await redis_client.dbsize() > 1
        await until(lambda: _dbsize_is(redis_client, 1))  # what stays: f:model, the namespace's data model
        async with locks.lock("order:0") as after:
            assert after.token > before.token


async def _dbsize_is(client, n):
    return await client.dbsize() == n


async def test_held_locks_and_force_release(locks, other, redis_client):
    held = await locks.acquire("stock:9")
    infos = await other.held_locks()
    assert [(i.key, i.owner, i.depth, i.token) for i in infos] == [("t:{stock:9}", held.owner, 1, held.token)]
    assert 0 < infos[0].ttl <= 30
    waiter = asyncio.create_task(other.acquire("stock:9", wait=10))
    await queued(redis_client, "stock:9", 1)
    assert await other.force_release("stock:9") is True
    taken = await asyncio.wait_for(waiter, 5)
    assert await held.release() is False
    assert await taken.release() is True
    assert await other.force_release("stock:9") is False


async def test_redis_unreachable_raises_redis_unavailable_not_a_hang():
    locks = LockManager.from_url(f"redis://127.0.0.1:{free_port()}/0", socket_timeout=0.5)
    try:
        async with asyncio.timeout(10):
            with pytest.raises(RedisUnavailable):
                await locks.acquire("k")
    finally:
        await locks.aclose()
    assert issubclass(RedisUnavailable, LockError)


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda m: m.acquire(""), "non-empty"),
        (lambda m: m.acquire("x" * 513), "limit is 512"),
        (lambda m: m.acquire("a{b}"), "hash tag"),
        (lambda m: m.acquire(42), "non-empty string"),
        (lambda m: m.acquire("k", wait=-1), "wait must be >= 0"),
        (lambda m: m.acquire("k", wait=math.nan), "wait must be >= 0"),
        (lambda m: m.acquire("k", lease=-2), "lease must be > 0"),
        (lambda m: m.acquire("k", lease=0), "lease must be > 0"),
        (lambda m: m.acquire("k", lease="5"), "number of seconds"),
        (lambda m: m.acquire("k", owner=""), "owner must be"),
        (lambda m: m.acquire("k", lease=1e16), "lease must be at most 9007199254740 s"),
        # a name that is not text broke every later /metrics scrape (500) and its spans' OTLP export
        (lambda m: m.acquire("k", name="stock\udcff"), "surrogates not allowed"),
        (lambda m: m.acquire_all(["k"], name="stock\udcff"), "surrogates not allowed"),
        (lambda m: m.acquire_permit("k", permits=2, name="stock\udcff"), "surrogates not allowed"),
        (lambda m: m.acquire("k", owner="own\udcff"), "owner 'own\\\\udcff' cannot be encoded as UTF-8"),
    ],
    ids=["empty", "oversized", "braces", "not-a-string", "negative-wait", "nan-wait",
         "negative-lease", "zero-lease", "string-lease", "empty-owner", "lease-beyond-redis",
         "name-not-text", "lock-all-name-not-text", "permit-name-not-text", "owner-not-text"],
)
async def test_bad_arguments_raise_value_error(locks, call, message):
    with pytest.raises(ValueError, match=message):
        await call(locks)


@pytest.mark.parametrize("call", [
    lambda m: m.acquire("k", cancel_on_lost="false"),
    lambda m: m.acquire("k", cancel_on_lost=0),
    lambda m: m.acquire("k", share_with_children="yes"),
    lambda m: m.acquire_all(["k"], cancel_on_lost="no"),
    lambda m: m.acquire_permit("k", permits=2, cancel_on_lost=1),
    lambda m: m.try_lock("k", cancel_on_lost="false"),
], ids=["cancel-string", "cancel-zero", "share-string", "lock-all", "permit", "try-lock"])
async def test_a_flag_that_is_not_true_or_false_is_refused_not_read_for_its_truth(locks, redis_client, call):
    """Regression: `cancel_on_lost="false"` was read as true (bool("false")), and 0 as false, silently."""
    with pytest.raises(TypeError, match="must be True or False"):
        await call(locks)
    assert await redis_client.keys("*{k}*") == []   # refused before anything was taken


@pytest.mark.parametrize("given", ["url", None, 42, "blocking"])
def test_a_client_that_is_not_redis_asyncio_is_refused_naming_its_type(redis_url, given):
    """Regression: a URL string failed at first use as AttributeError 'str' object has no attribute
    'connection_pool', and a blocking redis.Redis half-worked (the lean connection spoke for it) until a
    pooled call awaited one of its methods."""
    import redis

    client = {"url": redis_url, "blocking": redis.Redis.from_url(redis_url)}.get(given, given)
    with pytest.raises(TypeError, match="LockManager takes a redis.asyncio.Redis or redis.asyncio.RedisCluster"):
        LockManager(client)


def test_a_manager_flag_that_is_not_true_or_false_is_refused(redis_url):
    for options in (dict(cancel_on_lost="false"), dict(require_noeviction="no")):
        with pytest.raises(TypeError, match="must be True or False"):
            LockManager.from_url(redis_url, **options)


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(lease=1.0, renew_interval=2.0), "longer than the renewal interval"),
        (dict(lease=0.01), "at least"),
        (dict(wait=-1), "wait must be >= 0"),
        (dict(namespace=""), "namespace"),
        (dict(fence_ttl=0), "fence_ttl"),
        (dict(lease=1e16), "lease must be at most"),
        (dict(fence_ttl=1e16), "fence_ttl must be at most"),
    ],
    ids=["lease-shorter-than-renewal", "tiny-lease", "negative-wait", "empty-namespace", "zero-fence-ttl",
         "lease-beyond-redis", "fence-ttl-beyond-redis"],
)
def test_bad_manager_options_raise_value_error(options, message):
    with pytest.raises(ValueError, match=message):
        LockManager(object(), **options)


@pytest.mark.parametrize("wait", [1e10, 1e16, 1e300])
async def test_a_wait_too_long_for_redis_queues_without_deadline_and_gets_the_lock(locks, other, redis_client, wait):
    """Regression: a finite wait whose deadline Redis cannot store (1e16 s) failed with Redis' own error."""
    held = await locks.acquire("k")
    waiting = asyncio.create_task(other.acquire("k", wait=wait))
    await until(lambda: _zcard_is(redis_client, "t:{k}:q", 1))
    assert await held.release()
    handed = await asyncio.wait_for(waiting, 10)
    assert handed.token > held.token
    await handed.release()


async def test_the_longest_lease_is_kept_by_redis(locks, other, redis_client):
    """A waiter's lease is written by another client's release: the longest one allowed must not fail it."""
    held = await locks.acquire("k")
    waiting = asyncio.create_task(other.acquire("k", lease=9007199254740, wait=10))
    await until(lambda: _zcard_is(redis_client, "t:{k}:q", 1))
    assert await held.release()
    handed = await asyncio.wait_for(waiting, 10)
    assert await redis_client.pttl("t:{k}") > 9_000_000_000_000_000 - 60_000
    await handed.release()


def test_unknown_url_scheme_is_rejected():
    with pytest.raises(ValueError, match="unknown Redis URL scheme"):
        LockManager.from_url("http://127.0.0.1:6379")


async def test_re_entry_after_a_forced_release_is_lock_lost_not_a_fresh_lock(locks, other, redis_client):
    async with locks.lock("k") as outer:
        assert await other.force_release("k")
        with pytest.raises(LockLost):
            async with locks.lock("k"):
                pass
        assert outer.lost.is_set()
    assert await redis_client.exists("t:{k}") == 0


async def test_listing_locks_without_redis_is_redis_unavailable():
    async with LockManager.from_url(f"redis://127.0.0.1:{free_port()}/0", socket_timeout=0.5) as locks:
        with pytest.raises(RedisUnavailable):
            await locks.held_locks()
        with pytest.raises(RedisUnavailable):
            await locks.force_release("k")


async def test_a_held_lock_is_one_key_and_its_fence_is_written_when_it_goes(locks, redis_client):
    """Data model 2: the fence is not written on acquire; the release writes the token there."""
    held = await locks.acquire("k")
    assert sorted(await redis_client.keys("t:{k}*")) == [b"t:{k}"]
    await held.release()
    assert sorted(await redis_client.keys("t:{k}*")) == [b"t:{k}:fence"]
    assert int(await redis_client.get("t:{k}:fence")) == held.token


# -- a waiter's local wake-ups (no Redis: the order in which notices, polls and the timer are read) ----------


async def test_a_waiters_strongest_unread_wake_up_wins_and_is_read_once():
    from otel_lock.lock._waiting import POLL, PROMOTED, Grant, Waiter

    waiter = Waiter("w", "k")
    waiter.wake(Grant(7))  # nobody waits yet: kept
    waiter.wake(POLL)      # weaker: does not replace it
    assert waiter.granted
    assert await waiter.next(0) == Grant(7)
    assert not waiter.granted
    waiter.wake(PROMOTED)
    waiter.wake(Grant(8))  # stronger: replaces the unread promotion
    assert await waiter.next(None) == Grant(8)
    assert await waiter.next(0) is None  # consumed: the next read waits (here: its timer, at once)


async def test_a_grant_after_the_timer_ended_the_wait_is_still_read():
    from otel_lock.lock._waiting import Grant, Waiter

    waiter = Waiter("w", "k")
    reading = asyncio.ensure_future(waiter.next(0))
    await asyncio.sleep(0)  # the reader armed its timer, due now
    # Due with it: both run in one turn of the loop, before the reader resumes, whichever runs first.
    asyncio.get_running_loop().call_later(0, waiter.wake, Grant(3))
    assert await reading == Grant(3)


async def test_a_cancelled_wait_leaves_the_next_wake_up_for_the_next_read():
    from otel_lock.lock._waiting import Grant, Waiter

    waiter = Waiter("w", "k")
    reading = asyncio.ensure_future(waiter.next(None))
    await asyncio.sleep(0)
    reading.cancel()
    with pytest.raises(asyncio.CancelledError):
        await reading
    waiter.wake(Grant(5))
    assert await waiter.next(None) == Grant(5)


async def test_the_next_local_waiter_polls_once_the_first_one_left(redis_url, other, redis_client):
    """Only a manager's first waiter of a key polls; when it leaves, the next one must start polling.

    A holder whose lease runs out unreleased sends no notice: polling is the
    only way the remaining waiter learns the lock is free. Without it, that
    waiter would sit until its own deadline (30 s here).
    """
    async with LockManager.from_url(redis_url, namespace="t", poll_cap=0.2) as waiters:
        gone = await other.acquire("left", lease=1.0)  # a holder that will never release
        first = asyncio.create_task(waiters.acquire("left", wait=30))
        await queued(redis_client, "left", 1)
        second = asyncio.create_task(waiters.acquire("left", wait=30))
        await queued(redis_client, "left", 2)
        first.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first
        held = await asyncio.wait_for(second, 10)  # the lease ends after 1 s; a poll finds the lock free
        assert held.token > gone.token
        await held.release()


@pytest.mark.parametrize("cancel_on_lost", [False, True])
async def test_a_lock_held_when_its_manager_closes_is_told_lost_when_its_lease_runs_out(redis_url, cancel_on_lost):
    """Regression: after aclose() nothing watched the lease any more: `held.lost` never fired (a holder awaiting
    it waited forever, another manager long since holding the key), the hold's gauges and span stayed open."""
    manager = LockManager.from_url(redis_url, namespace="t", lease=1.0, cancel_on_lost=cancel_on_lost)
    entered, told = asyncio.Event(), asyncio.Event()
    holds = []

    async def holder() -> None:
        holds.append(await manager.acquire("closing"))
        entered.set()
        await holds[0].lost.wait()
        told.set()
        await asyncio.sleep(10)   # runs on unprotected, unless it asked to be cancelled

    task = asyncio.create_task(holder())
    await entered.wait()
    await manager.aclose()
    # 8 s bound a hang: the 1 s lease runs out long before
    if cancel_on_lost:
        done, _ = await asyncio.wait({task}, timeout=8)
        assert done and task.cancelled()
    else:
        await asyncio.wait_for(told.wait(), 8)
        assert not task.done()   # told, not cancelled
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    assert holds[0].lost.is_set()


async def test_a_release_or_reentry_after_its_manager_closed_sends_nothing_and_says_why(redis_url, redis_client, caplog):
    """Regression: the release (and a nested re-entry) opened a new socket on the closed manager (never closed
    again: a ResourceWarning at exit) for a lock that expires by itself anyway."""
    manager = LockManager.from_url(redis_url, namespace="t")
    held = await manager.acquire("after-close")
    async with manager.lock("after-close-block"):
        await manager.aclose()
        # the block's end logs what its release could not do, and goes on
    with pytest.raises(RedisUnavailable, match="not re-entered: its manager was closed"):
        async with manager.lock("after-close"):   # the task's nested hold: nothing sent either
            pass
    with pytest.raises(RedisUnavailable, match="not released: its manager was closed"):
        await held.release()
    assert await redis_client.exists("t:{after-close}", "t:{after-close-block}") == 2   # nothing was sent
    assert "after-close-block" in caplog.text
