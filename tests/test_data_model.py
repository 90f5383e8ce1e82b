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

from _proc_helpers import until

from otel_lock import LockError, LockManager, RedisMisconfigured, RedLockManager
from otel_lock.cli._redis_server import RedisServer
from otel_lock.lock import _scripts, _server_watch

LEASE = 0.2  # the guard's tick is half the default lease (its floor lowered below)


@pytest.fixture
def next_model(monkeypatch):
    """Make managers created inside `with` speak the model after this one."""
    def use(model: int) -> None:
        monkeypatch.setattr(_scripts, "MODEL", model)
        import otel_lock.lock._core as core
        monkeypatch.setattr(core, "MODEL", model)
    return use


async def test_a_manager_of_another_model_refuses_the_namespace(redis_url, redis_client, next_model):
    async with LockManager.from_url(redis_url, namespace="shop") as old:
        async with old.lock("stock:1"):
            pass
        assert await redis_client.get("shop:model") == str(_scripts.MODEL).encode()
        next_model(_scripts.MODEL + 1)
        async with LockManager.from_url(redis_url, namespace="shop") as new:
            with pytest.raises(RedisMisconfigured, match=r"data model 1.*namespace='shop-v2'.*shop:model") as refused:
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
        assert await redis_client.get("shop:model") == b"2"


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
        for server in servers:
            server.stop()


async def test_a_running_manager_claims_the_namespace_again_after_a_flush(redis_url, redis_client, next_model,
                                                                          awake):
    """Regression: the claim was made only at a first use, so a FLUSH let another model start unrefused."""
    async with LockManager.from_url(redis_url, namespace="shop", lease=LEASE) as old:
        await (await old.acquire("stock:1")).release()
        await redis_client.flushall()
        await until(lambda: redis_client.exists("shop:model"), "the running manager's claim, made again")
        assert await redis_client.get("shop:model") == str(_scripts.MODEL).encode()
        next_model(_scripts.MODEL + 1)
        async with LockManager.from_url(redis_url, namespace="shop", lease=LEASE) as new:
            with pytest.raises(RedisMisconfigured, match="data model 1"):
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
        await redis_client.set("shop:model", _scripts.MODEL + 1)
        await until(lambda: _refused(old, "stock:1"), "the running manager's refusal")
        with pytest.raises(RedisMisconfigured, match=r"data model 2.*delete the key shop:model"):
            await old.acquire("stock:2")
        assert await redis_client.exists("shop:{stock:2}") == 0
        health = old.health()
        assert not health.ok and health.namespace_model == 2 and "data model 2" in health.problems[0]
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
        next_model(_scripts.MODEL + 1)
        async with LockManager.from_url(fresh_redis.url, namespace="shop", lease=LEASE) as new:
            with pytest.raises(RedisMisconfigured, match="data model 1"):
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
        for server in servers:
            server.stop()


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
