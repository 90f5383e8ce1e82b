"""lock_all when its own process stalls while it waits for a later key: what it returns must all be held.

A lock_all holds its first keys while it waits for the next. If the process
stalls past the lease meanwhile (a GC pause, a blocked loop, SIGSTOP), the
first keys' leases run out and another caller may take them. Found by the
safety checker's lock_all runs under `sigstop-long`: a hold returned with a
key already lost, its token below that of a hold which ended before it began
(fenced and told, but not "all or nothing").
"""

from __future__ import annotations

import asyncio
import time

import pytest

from otel_lock import LockManager

from _proc_helpers import until

LEASE = 1.0


@pytest.fixture
async def managers(redis_url):
    ours = LockManager.from_url(redis_url, namespace="t", lease=LEASE, wait=10.0)
    other = LockManager.from_url(redis_url, namespace="t", wait=10.0)
    yield ours, other
    await ours.aclose()
    await other.aclose()


async def test_a_key_lost_while_waiting_for_a_later_one_is_not_returned_as_held(managers, redis_client):
    ours, other = managers
    b = await other.acquire("b", lease=LEASE)  # no renewal: it ends by itself at its lease
    taking = asyncio.create_task(ours.acquire_all(["b", "a"]))  # canonical order: a, then b
    await until(lambda: redis_client.exists("t:{a}"), "lock_all holds a")
    await until(lambda: redis_client.zcard("t:{b}:q"), "lock_all waits for b")
    time.sleep(LEASE * 1.6)  # this process stalls past the lease: nothing renews a meanwhile
    # another caller takes a in the gap and lets it go again
    async with other.lock("a", wait=10.0) as rival:
        pass
    held = await taking
    try:
        assert not held.lost.is_set(), "lock_all returned with a lease already lost"
        for h in held.holds:
            assert await redis_client.hget(h.key, "owner") == h.owner.encode(), f"{h.key} is not held"
        assert held.tokens["a"] > rival.token
    finally:
        await held.release()
        await b.release()
