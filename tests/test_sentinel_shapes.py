"""Permits and shared holds through Sentinel: the master found by the sentinels, the same scripts."""

from __future__ import annotations

import asyncio

import pytest

from benchmarks._sentinel_set import SentinelSet
from otel_lock import LockManager

BOUND = 30.0  # turns a hang into a failure; not a timing


@pytest.fixture
async def sentinels():
    async with SentinelSet() as servers:
        yield servers


async def test_permits_and_shared_holds_through_sentinel(sentinels):
    async with LockManager.from_url(sentinels.url, lease=60.0, poll_cap=60.0) as a, \
            LockManager.from_url(sentinels.url, lease=60.0, poll_cap=60.0) as b:
        permit = await a.acquire_permit("export", permits=1)
        waiter = asyncio.create_task(b.acquire_permit("export", permits=1, wait=BOUND))
        reader = await a.acquire("cat", shared=True)
        writer = asyncio.create_task(b.acquire("cat", wait=BOUND))
        await permit.release()  # only the notice can wake the waiter within BOUND (poll_cap=60)
        second = await asyncio.wait_for(waiter, BOUND)
        assert second.permits == 1 and second.token > permit.token
        await reader.release()
        held = await asyncio.wait_for(writer, BOUND)
        assert held.mode == "exclusive"
        for hold in (second, held):
            assert await hold.release() is True
