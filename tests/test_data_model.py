"""The Redis data model carries a version: two layouts never share a namespace untold.

A rolling deploy across a data-model change runs old and new replicas side by
side; if both used one namespace, neither would see the other's locks. The
namespace key `<ns>:model` says which model uses it, and a manager of another
model refuses at first use, naming the fix. The claim stays awake
(`_server_watch.py`): a running manager makes it again after a FLUSH, a
restart without persistence or a week of uptime, and refuses as soon as it
finds another model there.
"""

from __future__ import annotations

import asyncio

import pytest

from _proc_helpers import keys, queued, until

from otel_lock import LockError, LockManager, RedisMisconfigured, RedLockManager
from otel_lock.cli._redis_server import RedisServer, stop_servers
from otel_lock.lock import _scripts, _server_watch

LEASE = 0.2  # the guard's tick is half the default lease (its floor lowered below)
DEADLINE = 10.0  # a bound that turns a hang into a failure, not a timing


@pytest.fixture
async def locks(redis_url):
    async with LockManager.from_url(redis_url) as manager:
        yield manager


@pytest.fixture
async def other(redis_url):
    async with LockManager.from_url(redis_url) as manager:
        yield manager


OURS = _scripts.MODEL
NEXT = max(OURS, *_scripts.SHARES_WITH) + 1  # a model to come, which shares no namespace with this one


def speak(monkeypatch, model: int, shares_with: tuple[int, ...]) -> None:
    """Make the managers that start from now on write `model` and share a namespace with `shares_with`."""
    import otel_lock.lock._core as core
    monkeypatch.setattr(_scripts, "MODEL", model)
    monkeypatch.setattr(core, "MODEL", model)
    monkeypatch.setattr(_scripts, "SHARES_WITH", shares_with)
    monkeypatch.setattr(core, "SHARES_WITH", shares_with)


@pytest.fixture
def next_model(monkeypatch):
    """Make managers created inside `with` speak the model after this one."""
    def use(model: int) -> None:
        speak(monkeypatch, model, ())
    return use


async def test_a_manager_of_another_model_refuses_the_namespace(redis_url, redis_client, next_model):
    async with LockManager.from_url(redis_url, namespace="shop") as old:
        async with old.lock("stock:1"):
            pass
        assert await redis_client.get("shop:model") == str(_scripts.MODEL).encode()
        next_model(NEXT)
        async with LockManager.from_url(redis_url, namespace="shop") as new:
            with pytest.raises(RedisMisconfigured,
                               match=rf"data model {OURS}.*namespace='shop-v{NEXT}'.*shop:model") as refused:
                await new.acquire("stock:1")
            assert refused.value.key is None
            with pytest.raises(RedisMisconfigured):  # every call, until the operator acts
                await new.try_lock("stock:2")
            assert await redis_client.exists("shop:{stock:2}") == 0  # it took nothing
            async with old.lock("stock:1"):  # the running model goes on undisturbed
                pass
            async with LockManager.from_url(redis_url, namespace="shop-v2") as fresh:
                async with fresh.lock("stock:1"):  # the fix the message names
                    pass
            await redis_client.delete("shop:model")  # ... or the other: every old manager stopped
            async with new.lock("stock:1"):
                pass
        assert await redis_client.get("shop:model") == str(NEXT).encode()


@pytest.fixture
def awake(monkeypatch):
    """The guard ticks every LEASE / 2 s instead of at least every 2 s."""
    monkeypatch.setattr(_server_watch, "FLOOR", 0.01)


async def _refused(locks: LockManager, key: str) -> bool:
    try:
        await (await locks.acquire(key, wait=0.5)).release()
    except RedisMisconfigured:
        return True
    except LockError:  # the server is coming back
        return False
    return False


async def test_the_namespace_is_claimed_for_a_week_at_each_first_use(redis_url, redis_client):
    async with LockManager.from_url(redis_url, namespace="claim") as locks:
        await (await locks.acquire("k")).release()
    assert 0 < await redis_client.ttl("claim:model") <= _scripts.MODEL_TTL


async def test_redlock_refuses_when_any_master_holds_another_model(next_model):
    servers = [RedisServer().start() for _ in range(3)]
    try:
        import redis

        with redis.Redis(port=servers[2].port) as third:
            third.set("q:model", "7")
        async with RedLockManager.from_urls([s.url for s in servers], namespace="q") as locks:
            with pytest.raises(RedisMisconfigured, match="data model 7"):
                await locks.acquire("k")
    finally:
        stop_servers(servers)


async def test_a_running_manager_claims_the_namespace_again_after_a_flush(redis_url, redis_client, next_model,
                                                                          awake):
    """Regression: the claim was made only at a first use, so a FLUSH let another model start unrefused."""
    async with LockManager.from_url(redis_url, namespace="shop", lease=LEASE) as old:
        await (await old.acquire("stock:1")).release()
        await redis_client.flushall()
        await until(lambda: redis_client.exists("shop:model"), "the running manager's claim, made again")
        assert await redis_client.get("shop:model") == str(_scripts.MODEL).encode()
        next_model(NEXT)
        async with LockManager.from_url(redis_url, namespace="shop", lease=LEASE) as new:
            with pytest.raises(RedisMisconfigured, match=f"data model {OURS}"):
                await new.acquire("stock:1")


async def test_the_claim_outlives_its_ttl_while_a_manager_runs(redis_url, redis_client, awake):
    """A week of uptime, simulated: the claim about to expire, then expired, is made again for a week."""
    async with LockManager.from_url(redis_url, namespace="shop", lease=LEASE) as locks:
        await (await locks.acquire("stock:1")).release()
        await redis_client.expire("shop:model", 5)  # the last seconds of its week
        await until(lambda: _ttl_above(redis_client, 3600), "the claim renewed for a week")
        await redis_client.delete("shop:model")  # the week is over
        await until(lambda: _ttl_above(redis_client, 3600), "the claim made again")
        assert await redis_client.ttl("shop:model") <= _scripts.MODEL_TTL


async def _ttl_above(client, seconds: int) -> bool:
    return await client.ttl("shop:model") > seconds


async def test_a_running_manager_refuses_once_another_model_holds_the_namespace(redis_url, redis_client, awake):
    """After a FLUSH a manager of another model claimed first: the running ones refuse within a tick."""
    async with LockManager.from_url(redis_url, namespace="shop", lease=LEASE) as old:
        await (await old.acquire("stock:1")).release()
        assert old.health().ok and old.health().namespace_model == _scripts.MODEL
        await redis_client.flushall()
        await redis_client.set("shop:model", NEXT)
        await until(lambda: _refused(old, "stock:1"), "the running manager's refusal")
        with pytest.raises(RedisMisconfigured, match=rf"data model {NEXT}.*delete the key shop:model"):
            await old.acquire("stock:2")
        assert await redis_client.exists("shop:{stock:2}") == 0
        health = old.health()
        assert not health.ok and health.namespace_model == NEXT and f"data model {NEXT}" in health.problems[0]
        assert health.as_dict()["ok"] is False
        await redis_client.delete("shop:model")  # the operator's fix: the other model's managers stopped
        await (await old.acquire("stock:2")).release()
        assert old.health().ok and await redis_client.get("shop:model") == str(_scripts.MODEL).encode()


async def test_a_restart_without_persistence_is_claimed_again(fresh_redis, next_model, awake):
    import redis.asyncio as aioredis

    async with LockManager.from_url(fresh_redis.url, namespace="shop", lease=LEASE) as old:
        await (await old.acquire("stock:1")).release()
        fresh_redis.restart()  # an empty Redis: no claim, no scripts
        async with aioredis.Redis(port=fresh_redis.port) as client:
            await until(lambda: client.exists("shop:model"), "the claim made again after the restart")
        next_model(NEXT)
        async with LockManager.from_url(fresh_redis.url, namespace="shop", lease=LEASE) as new:
            with pytest.raises(RedisMisconfigured, match=f"data model {OURS}"):
                await new.acquire("stock:1")


async def test_redlock_claims_every_master_again_after_a_flush(awake):
    import redis.asyncio as aioredis

    servers = [RedisServer().start() for _ in range(3)]
    try:
        # a lease of 2 s: its master timeout (0.2 s) holds on a loaded machine; a tick every second
        async with RedLockManager.from_urls([s.url for s in servers], namespace="q", lease=2.0) as locks:
            await (await locks.acquire("k")).release()
            clients = [aioredis.Redis(port=s.port) for s in servers]
            try:
                for client in clients:
                    await client.flushall()

                async def claimed() -> bool:
                    return all([await client.get("q:model") == str(_scripts.MODEL).encode() for client in clients])
                await until(claimed, "the claim made again on every master")
            finally:
                for client in clients:
                    await client.aclose()
    finally:
        stop_servers(servers)


def test_a_manager_dropped_without_closing_is_collected_and_its_guard_ends(redis_url, awake):
    """Regression: the guard task held its manager strongly, so a manager its user dropped without
    aclose() stayed alive (with its connections and a tick every period) for the loop's whole life.

    On a loop of its own: the dropped manager's socket, never closed (that is the user's mistake here),
    is collected with that loop here, its ResourceWarning expected, instead of in whatever test runs
    when the garbage collector next comes by."""
    import gc
    import warnings
    import weakref

    async def dropped() -> None:
        locks = LockManager.from_url(redis_url, namespace="dropped", lease=LEASE)
        held = await locks.acquire("k")
        await held.release()
        guard = locks._runtimes.here().guard
        assert guard is not None and not guard.done()  # premise: the guard runs
        gone = weakref.ref(locks)
        del locks, held
        gc.collect()
        assert gone() is None

        async def ended() -> bool:
            return guard.done()
        await until(ended, "the guard of a collected manager ending at its next tick")

    asyncio.run(dropped())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)  # the socket the dropped manager never closed
        gc.collect()


# -- models 1 and 2 in one namespace: the previous release (0.2.0, model 1) beside this one -------------
# Model 1 queues a waiter's id with its entry in `:w`; model 2 queues the entry itself. The scripts are
# the same in both releases and read both, so one queue may hold both kinds. Which kind a waiter writes
# is chosen when its first queued request is sent (`_attempt.py`), so switching MODEL between queueing
# waiters makes one queue of both kinds in one process (tests/test_versions_mixed_fleet.py runs the real
# 0.2.0 beside this release).

async def _queue(monkeypatch, locks: LockManager, redis_client, key: str, model: int, **kw) -> asyncio.Task:
    monkeypatch.setattr(_scripts, "MODEL", model)
    before = await redis_client.zcard(keys(key)[1])
    task = asyncio.create_task(locks.acquire(key, wait=10, **kw))
    await queued(redis_client, key, before + 1)
    return task


async def test_a_queue_of_both_models_hands_over_in_order_with_growing_tokens(monkeypatch, locks, other,
                                                                               redis_client):
    holder = await locks.acquire("k")
    waiters = [await _queue(monkeypatch, other, redis_client, "k", model) for model in (1, 2, 1, 2)]
    lock, queue, entries = keys("k")
    members = await redis_client.zrange(queue, 0, -1)
    assert [m.startswith(b"[") for m in members] == [False, True, False, True]
    assert await redis_client.hlen(entries) == 2  # model 1's entries only
    tokens = [holder.token]
    await holder.release()
    for i, waiter in enumerate(waiters):
        held = await asyncio.wait_for(waiter, DEADLINE)
        assert all(not w.done() for w in waiters[i + 1:])  # first in, first served
        tokens.append(held.token)
        await held.release()
    assert tokens == sorted(set(tokens)), tokens  # strictly growing, across both kinds of hand-over
    assert tokens[2] == tokens[1] + 1 and tokens[4] == tokens[3] + 1  # a model 2 waiter: the next token
    assert await redis_client.exists(lock, queue, entries) == 0
    assert int(await redis_client.get(lock + ":fence")) == tokens[-1]  # the fence learnt the last one
    async with locks.lock("k") as again:
        assert again.token > tokens[-1]


async def test_waiters_of_both_models_leave_and_pass_a_hand_over_on(monkeypatch, locks, other, redis_client):
    holder = await locks.acquire("k")
    leaving = [await _queue(monkeypatch, other, redis_client, "k", model) for model in (1, 2)]
    staying = await _queue(monkeypatch, other, redis_client, "k", 2)
    for task in leaving:
        task.cancel()
    await queued(redis_client, "k", 1)  # the two left the queue
    assert await redis_client.hlen(keys("k")[2]) == 0
    await holder.release()
    held = await asyncio.wait_for(staying, DEADLINE)
    assert held.token == holder.token + 1
    await held.release()


async def test_a_shared_waiter_of_either_model_waits_behind_an_exclusive_one(monkeypatch, locks, other,
                                                                             redis_client):
    reader = await locks.acquire("k", shared=True)
    writer = await _queue(monkeypatch, other, redis_client, "k", 1)
    readers = [await _queue(monkeypatch, other, redis_client, "k", model, shared=True) for model in (2, 1)]
    assert not any(task.done() for task in (writer, *readers))  # FIFO: not past the exclusive waiter
    await reader.release()
    wrote = await asyncio.wait_for(writer, DEADLINE)
    assert not any(task.done() for task in readers)
    await wrote.release()
    for task in readers:
        await (await asyncio.wait_for(task, DEADLINE)).release()


async def test_managers_of_models_1_and_2_share_a_namespace(monkeypatch, redis_url, redis_client):
    for model, other_model in ((1, 2), (2, 1)):
        speak(monkeypatch, model, (other_model,))
        async with LockManager.from_url(redis_url, namespace="mixed") as locks:
            await (await locks.acquire("k")).release()
            assert locks.health().ok
        assert await redis_client.get("mixed:model") == str(model).encode()
    await redis_client.set("mixed:model", 0)  # a model neither shares with: refused by both
    for model, other_model in ((1, 2), (2, 1)):
        speak(monkeypatch, model, (other_model,))
        async with LockManager.from_url(redis_url, namespace="mixed") as locks:
            with pytest.raises(RedisMisconfigured, match="data model 0"):
                await locks.acquire("k")
