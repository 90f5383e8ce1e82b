"""`lock_all`: several keys in one canonical order, all or nothing within one wait, released together."""

from __future__ import annotations

import asyncio

import pytest

from otel_lock import HeldLocks, LockBusy, LockLost, LockManager, LockTimeout


async def held_keys(redis_client) -> list[bytes]:
    return sorted(k for k in await redis_client.keys("t:{*}") if b"}:" not in k)


async def test_lock_all_takes_every_key_in_canonical_order_and_releases_them(locks, redis_client):
    async with locks.lock_all(["account:7", "account:3", "account:7"]) as held:
        assert isinstance(held, HeldLocks)
        assert held.keys == ("account:3", "account:7")
        assert [h.key for h in held.holds] == ["t:{account:3}", "t:{account:7}"]
        assert set(held.tokens) == {"account:3", "account:7"}
        for h in held.holds:
            assert await redis_client.hget(h.key, "owner") == h.owner.encode()
            assert held.tokens[h.key[3:-1]] == h.token
        assert not held.lost.is_set()
    assert await held_keys(redis_client) == []


async def test_the_order_is_the_redis_keys_not_the_bare_keys(locks):
    # "t:{ab}" sorts before "t:{a}" ('b' < '}'), although "a" < "ab"
    async with locks.lock_all(["a", "ab"]) as held:
        assert held.keys == ("ab", "a")


@pytest.mark.parametrize("keys, error", [([], ValueError), ("account:1", TypeError), ([1, "a"], TypeError),
                                         (["a", b"b"], TypeError), (["a{b}"], ValueError)],
                         ids=["empty", "one-string", "int", "bytes", "braces"])
async def test_bad_keys_are_refused_before_anything_is_taken(locks, redis_client, keys, error):
    with pytest.raises(error):
        async with locks.lock_all(keys):
            pass
    assert await held_keys(redis_client) == []


async def test_opposite_orders_never_wait_on_each_other(locks, other):
    async def transfer(manager, first, second, rounds, log):
        for _ in range(rounds):
            async with manager.lock_all([first, second], wait=10.0) as held:
                log.append(dict(held.tokens))
                await asyncio.sleep(0)

    log: list[dict[str, int]] = []
    await asyncio.gather(transfer(locks, "acct:a", "acct:b", 100, log), transfer(other, "acct:b", "acct:a", 100, log),
                         transfer(locks, "acct:b", "acct:a", 100, log))
    assert len(log) == 300
    for key in ("acct:a", "acct:b"):
        tokens = [entry[key] for entry in log]
        assert tokens == sorted(tokens) and len(set(tokens)) == len(tokens)  # strictly increasing across holders


async def test_a_timeout_on_a_later_key_leaves_nothing_held(locks, other, redis_client):
    async with other.lock("b"):
        with pytest.raises(LockTimeout) as caught:
            await locks.acquire_all(["b", "a", "c"], wait=0.2)
        assert caught.value.key == "t:{b}"
        assert not isinstance(caught.value, LockBusy)
        assert await redis_client.exists("t:{a}") == 0
        assert await redis_client.exists("t:{c}") == 0
    assert await held_keys(redis_client) == []
    async with other.lock("c"):
        with pytest.raises(LockTimeout):
            await locks.acquire_all(["a", "b", "c"], wait=0.2)
        assert await held_keys(redis_client) == [b"t:{c}"]


async def test_wait_zero_is_a_try_that_says_busy(locks, other, redis_client):
    async with other.lock("b"):
        with pytest.raises(LockBusy):
            await locks.acquire_all(["a", "b"], wait=0)
        assert await held_keys(redis_client) == [b"t:{b}"]


async def test_cancelled_mid_acquire_leaves_nothing_held(locks, other, redis_client):
    async with other.lock("b"):
        task = asyncio.create_task(locks.acquire_all(["a", "b"], wait=30.0))

        async def queued():
            return await redis_client.zcard("t:{b}:q") == 1
        async with asyncio.timeout(10):
            while not await queued():
                await asyncio.sleep(0.01)
        assert await redis_client.exists("t:{a}") == 1
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert await redis_client.exists("t:{a}") == 0
        assert await redis_client.zcard("t:{b}:q") == 0


async def test_reentry_is_per_key_as_for_lock(locks, redis_client):
    async with locks.lock("a") as outer:
        async with locks.lock_all(["b", "a"]) as held:
            inner = held.holds[0]
            assert inner.key == "t:{a}" and inner.depth == 2 and inner.token == outer.token
            assert await redis_client.hget("t:{a}", "depth") == b"2"
        assert await redis_client.hget("t:{a}", "depth") == b"1"
        assert await redis_client.exists("t:{b}") == 0


async def test_a_lost_lease_on_one_key_cancels_the_holder_with_lock_lost(redis_url, redis_client):
    async with LockManager.from_url(redis_url, namespace="t", lease=0.3, cancel_on_lost=True) as locks:
        never = asyncio.Event()
        with pytest.raises(LockLost, match="t:{b}"):
            async with asyncio.timeout(10):
                async with locks.lock_all(["a", "b"]) as held:
                    await redis_client.delete("t:{b}")
                    await never.wait()
        assert held.lost.is_set()
        assert await held_keys(redis_client) == []


async def test_a_lost_lease_on_one_key_sets_lost_without_cancelling(redis_url, redis_client):
    async with LockManager.from_url(redis_url, namespace="t", lease=0.3) as locks:
        held = await locks.acquire_all(["a", "b"])
        await redis_client.hset("t:{a}", "owner", "thief")
        async with asyncio.timeout(10):
            await held.lost.wait()
        assert not held.holds[1].lost.is_set()
        assert await held.release() is False
        assert await redis_client.exists("t:{b}") == 0


async def test_release_is_idempotent(locks, redis_client):
    held = await locks.acquire_all(["x", "y"])
    assert await held.release() is True
    assert await held.release() is True
    assert await held_keys(redis_client) == []


async def test_a_long_held_lease_re_entered_by_many_lock_all_keeps_no_listeners(locks):
    async with locks.lock("a") as outer:
        for _ in range(50):
            async with locks.lock_all(["a", "b"]):
                pass
        assert outer._lease.on_lost == []
