"""A reply whose caller gave up still reaches the lock: the hot path awaits reply futures with no task between.

An ACQUIRE or RELEASE is written at once and its caller awaits the reply's
future itself. A caller cancelled meanwhile cancels only that future; the
connection hands the reply to the lock instead, which undoes a grant nobody
will use and ends a release nobody waits for.
"""

from __future__ import annotations

import asyncio

from otel_lock import LockManager

from _proc_helpers import until


async def _sent(locks: LockManager) -> None:
    """Let the new task run to its first suspension: awaiting its reply, the command on the wire, unanswered.

    (One turn without I/O: the reply cannot have been read yet.)
    """
    await asyncio.sleep(0)
    assert locks._runtimes.here().transport.link.connection.in_flight == 1


async def test_a_cancelled_acquire_whose_grant_arrives_later_leaves_nothing_held(redis_url, redis_client):
    async with LockManager.from_url(redis_url, namespace="rep") as locks:
        await (await locks.acquire("warm")).release()  # connected, scripts loaded, first use done
        await until(lambda: _answered(locks), "the first use's checks to be answered")
        for _ in range(20):
            taking = asyncio.create_task(locks.acquire("k"))
            await _sent(locks)
            taking.cancel()
            await asyncio.gather(taking, return_exceptions=True)
            assert taking.cancelled()  # cancelled with the grant still to come: it must be undone
            await until(lambda: _free(redis_client, "rep:{k}"), "the late grant to be released")
            # and its reply read: the next round's command is then the only one on the wire
            await until(lambda: _answered(locks), "the release of the late grant to be answered")
        held = await locks.try_lock("k")
        assert held is not None and await held.release()


async def test_a_release_whose_caller_is_cancelled_still_ends_the_hold(redis_url, redis_client):
    async with LockManager.from_url(redis_url, namespace="rep") as locks:
        await (await locks.acquire("warm")).release()  # connected, scripts loaded, first use done
        # the first use's checks (the data model, the server's) answered: only this test's commands follow
        await until(lambda: _answered(locks), "the first use's checks to be answered")
        for _ in range(20):
            held = await locks.acquire("k")
            # nothing else on the wire (a late reply of the round before, a background check): ours is the one
            await until(lambda: _answered(locks), "the commands before this round to be answered")
            releasing = asyncio.create_task(held.release())
            await _sent(locks)
            releasing.cancel()
            await asyncio.gather(releasing, return_exceptions=True)
            assert await held.release() is True  # the same outcome, whoever waited for it
            assert await redis_client.exists("rep:{k}") == 0


async def _answered(locks: LockManager) -> bool:
    return locks._runtimes.here().transport.link.connection.in_flight == 0


async def _free(client, key: str) -> bool:
    return await client.exists(key) == 0
