"""The lock is safe where it is contended. Each test is numbered after the section (7.1 to 7.8) it pins.

Real redis-server processes, agents in other processes (tests/_proc_helpers.py)
where a process must stall, die or be stopped.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
import redis as sync_redis
import redis.asyncio as aioredis

from otel_lock import LockError, LockLost, LockManager, LockTimeout, RedisUnavailable
from otel_lock.cli._redis_server import RedisServer, free_port
from otel_lock.sync import SyncLockManager

from _proc_helpers import DEADLINE, NS, TcpProxy, keys, queued, until
from _redis_states import still_loading

LOCK = keys("k")[0]


@pytest.fixture
async def locks(redis_url):
    manager = LockManager.from_url(redis_url, namespace=NS, wait=5.0)
    yield manager
    await manager.aclose()


async def _evalsha_calls(client) -> int:
    stat = (await client.info("commandstats")).get("cmdstat_evalsha", {})
    return stat.get("calls", 0) - stat.get("failed_calls", 0)


# -- 7.1: a hand-over gives the full lease --------------------------------------


@pytest.mark.parametrize("lease", [None, 5.0], ids=["renewed", "fixed"])
async def test_7_1_a_handed_over_holder_has_its_full_lease_through_a_loop_stall(agents, locks, redis_client, lease):
    b = await agents.start("b")
    held = await locks.acquire("k")
    await b.send("hold", id="b", key="k", wait=DEADLINE, **({} if lease is None else {"lease": lease}))
    await queued(redis_client, "k", 1)
    await held.release()
    await b.expect("acquired", "b")
    # The hand-over gives the holder its own full lease (the old design gave 0.5 s).
    assert await redis_client.pttl(LOCK) > 3000
    await b.send("block", id="stall", key="unblock")  # sync code blocks B's loop...
    await b.expect("blocking", "stall")
    with pytest.raises(LockTimeout):  # ...far past the old 0.5 s: nobody else gets in
        await locks.acquire("k", wait=1.5)
    await redis_client.lpush("unblock", "go")
    await b.send("release", id="b")
    await b.expect("exited", "b")
    assert not [e for e in b.pending_events() if e["ev"] == "lost"], "a stall shorter than the lease lost it"


# -- 7.2: re-entry belongs to one task ------------------------------------------


async def test_7_2_spawned_workers_do_not_share_their_parents_hold(locks):
    inside, peak, tokens = 0, 0, []

    async def worker():
        nonlocal inside, peak
        async with locks.lock("k", wait=10) as held:
            inside += 1
            peak = max(peak, inside)
            tokens.append(held.token)
            await asyncio.sleep(0)
            inside -= 1

    async with locks.lock("k") as parent:
        workers = [asyncio.create_task(worker()) for _ in range(2)]
        await asyncio.sleep(0)
        assert inside == 0, "a spawned task entered while its parent held the lock"
    await asyncio.gather(*workers)
    assert peak == 1
    assert len(set(tokens)) == 2 and min(tokens) > parent.token


async def test_7_2_task_group_children_inside_a_hold_do_not_run_under_it(locks, redis_client):
    """Regression test: a counter read 50 of 100, two workers having "taken" the parent's hold at once."""
    await redis_client.set("counter", 0)

    async def bump():
        async with locks.lock("k", wait=0.2):
            value = int(await redis_client.get("counter"))
            await asyncio.sleep(0.001)
            await redis_client.set("counter", value + 1)

    async with locks.lock("k"):
        with pytest.raises(ExceptionGroup) as raised:
            async with asyncio.TaskGroup() as group:
                for _ in range(2):
                    group.create_task(bump())
    assert raised.group_contains(LockTimeout)  # they waited like other callers: the parent held it
    assert int(await redis_client.get("counter")) == 0


@pytest.mark.parametrize("yields", [0, 1, 2, 3])
async def test_7_2_a_child_racing_its_parents_release_really_holds_it_or_waits(locks, redis_url, yields):
    rival = LockManager.from_url(redis_url, namespace=NS)
    try:
        async def child():
            for _ in range(yields):
                await asyncio.sleep(0)
            async with locks.lock("k", wait=5) as held:
                # while the child is inside, the lock is the child's in Redis
                assert await locks.redis.hget(held.key, "owner") == held.owner.encode()
                assert await rival.try_lock("k") is None
                return held.token

        async with locks.lock("k") as parent:
            task = asyncio.create_task(child())
        assert await task > parent.token
    finally:
        await rival.aclose()


async def test_7_2_sharing_with_children_is_explicit_and_the_release_waits_for_them(locks, redis_client):
    child_in, child_go, body_done = asyncio.Event(), asyncio.Event(), asyncio.Event()

    async def child():
        async with locks.lock("k", wait=0) as held:
            child_in.set()
            await child_go.wait()
            return held.depth, held.token

    async def parent():
        async with locks.lock("k", share_with_children=True) as outer:
            task = asyncio.create_task(child())
            await child_in.wait()
            body_done.set()
        return outer, await task

    running = asyncio.create_task(parent())
    await body_done.wait()
    for _ in range(10):
        await asyncio.sleep(0)
    assert not running.done(), "the parent's release did not wait for its child"
    assert await redis_client.hget(LOCK, "depth") == b"2"
    child_go.set()
    outer, (depth, token) = await running
    assert (depth, token) == (2, outer.token)
    assert await redis_client.exists(LOCK) == 0


async def test_7_2_a_child_cannot_re_enter_a_shared_hold_whose_release_began(locks, redis_client):
    a_in, a_go, b_go = asyncio.Event(), asyncio.Event(), asyncio.Event()
    leases = []

    async def child_a():
        async with locks.lock("k", wait=0):
            a_in.set()
            await a_go.wait()

    async def child_b():
        await b_go.wait()
        async with locks.lock("k", wait=0):
            pass

    async def parent():
        async with locks.lock("k", share_with_children=True) as outer:
            leases.append(outer._lease)
            tasks = asyncio.create_task(child_a()), asyncio.create_task(child_b())
            await a_in.wait()
        return tasks

    running = asyncio.create_task(parent())
    await a_in.wait()
    while not leases[0].closing:  # the outer release has begun and waits for child A
        await asyncio.sleep(0)
    b_go.set()
    a_go.set()
    task_a, task_b = await running
    await task_a
    with pytest.raises(LockError, match="being released"):
        await task_b  # it raised: it never ran beside a release it did not hold up
    assert await redis_client.exists(LOCK) == 0


# -- 7.3: a rejected notice is dropped; the deadline holds ----------------------


async def test_7_3_a_waiter_whose_grant_ran_out_unread_keeps_its_deadline_and_does_not_spin(
        agents, locks, redis_client):
    w = await agents.start("w")
    held = await locks.acquire("k")
    await w.send("hold", id="w", key="k", wait=3.0, lease=1.0)
    await queued(redis_client, "k", 1)
    await w.send("block", id="stall", key="unblock")  # its loop is blocked as the lock is handed over
    await w.expect("blocking", "stall")
    await held.release()

    async def grant_gone():
        return not await redis_client.exists(LOCK)
    await until(grant_gone, "the unread grant's 1 s lease to run out")
    mine = await locks.try_lock("k")
    assert mine is not None
    before = await _evalsha_calls(redis_client)
    await redis_client.lpush("unblock", "go")
    await w.expect("timeout", "w")  # not after we release: its own 3 s deadline
    polls = await _evalsha_calls(redis_client) - before
    assert polls < 50, f"the waiter sent {polls} scripts in its last seconds"
    assert await mine.release()


# -- 7.4: validity is counted from the request's send time ----------------------


async def test_7_4_a_fixed_lease_counts_from_the_send_not_from_the_late_reply(redis_server, redis_client):
    proxy = await TcpProxy("127.0.0.1", redis_server.port).start()
    locks = LockManager.from_url(proxy.url, namespace=NS, socket_timeout=10.0)
    try:
        assert await locks.try_lock("warm") is not None  # connected, scripts loaded
        loop = asyncio.get_running_loop()
        proxy.stall_replies()
        acquiring = asyncio.create_task(locks.acquire("k", lease=1.0))

        async def taken():
            return await redis_client.exists(LOCK)
        await until(taken, "the acquire to run in Redis")
        await asyncio.sleep(0.6)  # the reply is read late (a busy loop, a slow network)
        proxy.forward()
        held = await acquiring
        returned_at = loop.time()
        # Redis started the lease before the reply came back: so does the holder.
        assert held._lease.expires_at < returned_at + 1.0 - 0.5
        await asyncio.wait_for(held.lost.wait(), 5.0)

        async def expired():
            return not await redis_client.exists(LOCK)
        await until(expired, "the fixed lease to run out")
        assert await held.release() is False
    finally:
        await locks.aclose()
        await proxy.aclose()


async def test_7_4_a_reply_read_after_its_lease_ran_out_does_not_enter(redis_server, redis_client, redis_url):
    """The safety checker's token regression: a blocked waiter entered on a grant that had expired."""
    proxy = await TcpProxy("127.0.0.1", redis_server.port).start()
    locks = LockManager.from_url(proxy.url, namespace=NS, socket_timeout=10.0)
    rival = LockManager.from_url(redis_url, namespace=NS)
    try:
        warm = await locks.try_lock("warm")  # connected, scripts loaded
        assert warm is not None and await warm.release()
        proxy.stall_replies()
        acquiring = asyncio.create_task(locks.acquire("k", lease=0.5, wait=DEADLINE))

        async def taken():
            return await redis_client.exists(LOCK)

        async def expired():
            return not await redis_client.exists(LOCK)
        await until(taken, "the acquire to run in Redis")
        await until(expired, "its 0.5 s lease to run out, the reply still unread")
        mine = await rival.try_lock("k")
        assert mine is not None
        proxy.forward()
        done, _ = await asyncio.wait([acquiring], timeout=1.0)
        assert not done, "entered on a reply read after its lease had run out, beside the new holder"
        assert await mine.release()
        late = await acquiring
        assert late.token > mine.token
        await late.release()
    finally:
        await locks.aclose()
        await rival.aclose()
        await proxy.aclose()


# -- 7.5: dead waiters are skipped at once --------------------------------------


async def test_7_5_waiters_whose_manager_died_are_skipped_at_once(
        agents, redis_url, redis_client):
    holder = LockManager.from_url(redis_url, namespace=NS)
    live = LockManager.from_url(redis_url, namespace=NS, poll_cap=60.0)  # no fallback poll in the count
    try:
        held = await holder.acquire("k")
        doomed = await agents.start_many([f"d{i}" for i in range(5)])
        for i, agent in enumerate(doomed):
            for j in range(2):
                await agent.send("hold", id=f"d{i}{j}", key="k", wait=DEADLINE)
                await queued(redis_client, "k", 2 * i + j + 1)
        for agent in doomed:
            agent.signal(signal.SIGKILL)
            await agent.proc.wait()
        waiting = asyncio.create_task(live.acquire("k", wait=DEADLINE))
        await queued(redis_client, "k", 11)
        before = await _evalsha_calls(redis_client)
        await held.release()
        mine = await waiting
        # one release script: ten dead waiters (30 s leases each) cost nothing
        assert await _evalsha_calls(redis_client) - before == 1
        assert mine.token > held.token
        await mine.release()
    finally:
        await holder.aclose()
        await live.aclose()


# -- 7.6: a failed AUTH or SELECT closes its socket -----------------------------


async def test_7_6_wrong_password_leaks_no_connection(fresh_redis):
    async with aioredis.Redis.from_url(fresh_redis.url) as first:
        await first.config_set("requirepass", "right")
    admin = aioredis.Redis.from_url(fresh_redis.url, password="right")
    wrong = LockManager.from_url(f"redis://:wrong@127.0.0.1:{fresh_redis.port}/0", namespace=NS)
    bad_db = LockManager.from_url(f"redis://:right@127.0.0.1:{fresh_redis.port}/99", namespace=NS)
    try:
        before = (await admin.info("clients"))["connected_clients"]
        for manager in (wrong, bad_db):
            for _ in range(50):
                with pytest.raises(LockError):
                    await manager.try_lock("k")
        after = (await admin.info("clients"))["connected_clients"]
        assert after - before <= 2, f"{after - before} connections left behind by 100 failed attempts"
    finally:
        await wrong.aclose()
        await bad_db.aclose()
        await admin.aclose()


# -- 7.7: the sync wrapper --------------------------------------------------------


def test_7_7_sync_nested_acquire_of_a_lost_lease_raises_lock_lost(redis_url):
    admin = sync_redis.Redis.from_url(redis_url)
    with SyncLockManager.from_url(redis_url, namespace=NS, lease=0.6) as s:
        with s.lock("k") as outer:
            admin.delete(LOCK)  # evicted, force-released, or lost with a restart...
            admin.hset(LOCK, mapping={"owner": "someone-else", "depth": 1, "token": 1})  # ...and taken
            # nested holds of a thread are counted by the facade: the loss is known at the next renewal
            assert outer.lost.wait(20)
            with pytest.raises(LockLost):
                with s.lock("k"):
                    pass
            assert outer.lost.is_set()
            assert not outer.release()
    admin.close()


def test_7_7_sync_holds_leave_no_task_behind(redis_url):
    with SyncLockManager.from_url(redis_url, namespace=NS) as s:
        for _ in range(50):
            with s.lock("k"):
                with s.lock("k"):
                    pass

        async def count():
            return len(asyncio.all_tasks())
        assert s._run(count()) == 1 + 2  # this one, the watchdog and the server watch (`_server_watch.py`)
        with s.lock("k") as held:
            assert not held.lost.is_set()


# -- 7.8: LOADING and MASTERDOWN are "unavailable", not a 500 -------------------


def _start_redis(port: int, *args: str) -> subprocess.Popen:
    process = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", *args],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return process


def _loading_server(folder: Path, keys_count: int, delay_us: int) -> tuple[subprocess.Popen, int]:
    """A redis-server still loading its RDB (key-load-delay slows it down)."""
    port = free_port()
    seed = _start_redis(port, "--dir", str(folder))
    try:
        client = sync_redis.Redis(port=port, retry_on_error=[sync_redis.ConnectionError])
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                break
            except sync_redis.ConnectionError:
                assert time.monotonic() < deadline, "seed redis-server did not start"
                time.sleep(0.02)
        pipe = client.pipeline(transaction=False)
        for i in range(keys_count):
            pipe.set(f"filler:{i}", "x")
        pipe.execute()
        client.save()
        client.close()
    finally:
        seed.kill()
        seed.wait()
    # Events (and so replies) are served between small chunks of the file, each key slowed down.
    return _start_redis(port, "--dir", str(folder), "--key-load-delay", str(delay_us),
                        "--loading-process-events-interval-bytes", "1024"), port


async def test_7_8_a_loading_redis_is_unavailable(tmp_path):
    tmp = tmp_path
    process, port = _loading_server(Path(tempfile.mkdtemp(prefix="otel-lock-loading-", dir=tmp)), 5000, 1000)
    try:
        deadline = time.monotonic() + 10
        # A client per look, closed each time (still_loading), not one kept across the server's
        # start-up: CI once found a client socket left to the garbage collector during this test.
        while not still_loading(port):
            assert time.monotonic() < deadline, "redis-server never started loading"
            time.sleep(0.01)
        locks = LockManager.from_url(f"redis://127.0.0.1:{port}/0", namespace=NS)
        try:
            with pytest.raises(RedisUnavailable, match="LOADING"):
                await locks.try_lock("k")
        finally:
            await locks.aclose()
    finally:
        process.send_signal(signal.SIGKILL)
        process.wait()


async def test_7_8_a_replica_whose_master_is_down_is_unavailable():
    replica = RedisServer(extra_args=("--replicaof", "127.0.0.1", str(free_port()))).start()
    try:
        async with aioredis.Redis.from_url(replica.url) as admin:
            await admin.config_set("replica-serve-stale-data", "no")
        locks = LockManager.from_url(replica.url, namespace=NS)
        try:
            with pytest.raises(RedisUnavailable):
                await locks.try_lock("k")
        finally:
            await locks.aclose()
    finally:
        replica.stop()


# -- a burst queues for a pooled connection instead of failing ----


async def test_a_burst_beyond_the_pool_queues_instead_of_failing(redis_url):
    locks = LockManager.from_url(redis_url, namespace=NS, max_connections=2, pool_timeout=10.0)
    try:
        # 50 callers, 2 connections: redis-py's default pool would raise "Too many connections".
        answers = await asyncio.gather(*(locks.redis.blpop([f"nothing:{i}"], timeout=0.05) for i in range(50)))
        assert answers == [None] * 50
    finally:
        await locks.aclose()


async def test_a_pool_wait_past_pool_timeout_is_redis_unavailable_to_the_lock(redis_url, redis_client):
    locks = LockManager.from_url(redis_url, namespace=NS, max_connections=1, pool_timeout=0.1)
    try:
        busy = asyncio.create_task(locks.redis.blpop(["nothing"], timeout=2))

        async def blocked():
            return any(c.get("cmd") == "blpop" for c in await redis_client.client_list())
        await until(blocked, "the only pooled connection to be taken")
        with pytest.raises(RedisUnavailable):
            await locks.held_locks()  # SCAN goes through the pool
        busy.cancel()
        await asyncio.gather(busy, return_exceptions=True)
    finally:
        await locks.aclose()
