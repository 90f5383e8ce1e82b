"""Permits and shared holds on a real Redis Cluster: every key of a shape in the lock's slot, wake-ups by
sharded pub/sub, renewals of leases on every master in one batch per node."""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis

from benchmarks._cluster_set import ClusterSet
from otel_lock import LockManager

BOUND = 30.0  # turns a hang into a failure; not a timing


@pytest.fixture(scope="module")
def cluster():
    c = asyncio.run(ClusterSet(masters=3).__aenter__())
    try:
        yield c
    finally:
        asyncio.run(c.__aexit__())


@pytest.fixture
async def flushed(cluster):
    for port in cluster.ports:
        async with aioredis.Redis(port=port) as node:
            await node.flushall()
    return cluster


async def _zcard(cluster: ClusterSet, lock: str, key: str) -> int:
    async with aioredis.Redis(port=await cluster.owner(lock)) as node:
        return int(await node.zcard(key))


async def test_permits_and_shared_holds_hand_over_by_sharded_notices(flushed):
    keys = [k for keys in (await flushed.keys_per_master(1)).values() for k in keys]
    async with LockManager.from_url(flushed.url, lease=60.0, poll_cap=60.0) as a, \
            LockManager.from_url(flushed.url, lease=60.0, poll_cap=60.0) as b:
        for key in keys:
            # poll_cap=60: only a wake-up can reach the waiters within BOUND
            permit = await a.acquire_permit(key, permits=1)
            waiter = asyncio.create_task(b.acquire_permit(key, permits=1, wait=BOUND))
            while await _zcard(flushed, key, f"otel-lock:{{{key}}}:permits:q") == 0:
                await asyncio.sleep(0.01)
            await permit.release()
            second = await asyncio.wait_for(waiter, BOUND)
            assert second.token > permit.token
            await second.release()

            writer = await a.acquire(key)
            readers = [asyncio.create_task(b.acquire(key, shared=True, wait=BOUND)) for _ in range(2)]
            while await _zcard(flushed, key, f"otel-lock:{{{key}}}:q") < 2:
                await asyncio.sleep(0.01)
            await writer.release()
            held = await asyncio.wait_for(asyncio.gather(*readers), BOUND)
            assert {h.mode for h in held} == {"shared"}
            for h in held:
                await h.release()


async def test_renewals_keep_permit_and_shared_leases_on_every_slot(flushed):
    keys = [f"shape:{i}" for i in range(30)]
    async with LockManager.from_url(flushed.url, lease=0.6) as locks:
        held = [await locks.acquire_permit(k, permits=2) for k in keys]
        held += [await locks.acquire(k, shared=True) for k in keys]
        await asyncio.sleep(2.0)  # the subject: about three leases pass, renewed every lease/3
        assert not any(h.lost.is_set() for h in held)
        for hold in held:
            assert await hold.release() is True
