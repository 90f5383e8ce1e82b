"""The Redis data model carries a version: two layouts never share a namespace untold.

A rolling deploy across a data-model change runs old and new replicas side by
side; if both used one namespace, neither would see the other's locks. The
namespace key `<ns>:model` says which model uses it, and a manager of another
model refuses at first use, naming the fix.
"""

from __future__ import annotations

import pytest

from otel_lock import LockManager, RedisMisconfigured, RedLockManager
from otel_lock.cli._redis_server import RedisServer
from otel_lock.lock import _scripts


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
