"""The lock on a real Redis Cluster: three masters made with `redis-cli --cluster create`.

Mutual exclusion on keys spread over every master, wake-ups through sharded
pub/sub on the slot's own node, renewals grouped by slot, a slot migrated
under load, and (marked `failover`) a master killed while a lock is held.
"""

from __future__ import annotations

import asyncio
import os
import signal

import pytest
import redis.asyncio as aioredis
from redis.asyncio.cluster import ClusterNode, RedisCluster

from benchmarks._cluster_set import ClusterSet
from otel_lock.cli._redis_server import RedisServer, stop_servers
from otel_lock import (LockError, LockLost, LockManager, LockTimeout, RedisMisconfigured, RedisUnavailable,
                       RedLockManager)
from otel_lock.lock._cluster import parse_url, slot_of
from otel_lock.sync import SyncLockManager

from _proc_helpers import assert_one_holder_at_a_time, link_of, run_holders, until

BOUND = 30.0  # turns a hang into a failure; not a timing


@pytest.fixture(scope="module")
def cluster():
    # Started on a loop of its own: the set keeps no connection between calls.
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


async def keys_on_every_master(cluster: ClusterSet, per_master: int = 2) -> list[str]:
    """Lock keys whose slots belong to each of the masters, `per_master` each."""
    return [k for keys in (await cluster.keys_per_master(per_master)).values() for k in keys]


async def command_calls(port: int, command: str) -> int:
    async with aioredis.Redis(port=port) as node:
        stats = await node.info("commandstats")
    return int(stats.get(f"cmdstat_{command}", {}).get("calls", 0))


# -- configuration -------------------------------------------------------------


@pytest.mark.parametrize("url, problem", [
    ("redis+cluster://", "is not a host"),
    ("redis+cluster://h:0", "out of range"),
    ("redis+cluster://h:1/0", "no database"),
    ("redis+cluster://h:1?ssl=1", "query strings"),
    ("redis+cluster://user@h:1", "password"),
])
def test_bad_cluster_urls_say_what_is_wrong(url, problem):
    with pytest.raises(ValueError, match=problem):
        parse_url(url)


def test_cluster_url_names_every_node_and_the_credentials():
    assert parse_url("redis+cluster://me:s%40cret@a:7000,b,[::1]:7002/") == (
        [("a", 7000), ("b", 6379), ("::1", 7002)], "me", "s@cret")


async def test_options_the_cluster_cannot_honour_are_refused(cluster):
    with pytest.raises(ValueError, match="wait_replicas is not supported"):
        LockManager(RedisCluster(startup_nodes=[ClusterNode("127.0.0.1", cluster.ports[0])]), wait_replicas=1)
    with pytest.raises(ValueError, match="unix_socket_path"):
        LockManager.from_url(cluster.url, unix_socket_path="/tmp/redis.sock")
    with pytest.raises(ValueError, match="unknown Redis URL scheme"):
        LockManager.from_url("cluster://127.0.0.1:1")


# -- mutual exclusion and keys ---------------------------------------------------------


async def test_a_cluster_node_behind_a_plain_url_is_refused_naming_the_cluster_url(flushed):
    """Regression: keys of the node's own slots were locked and the others failed as LockError "MOVED ...";
    as a RedLock master it silently never granted most keys."""
    per = await flushed.keys_per_master(1)
    node = min(per)
    other_key = next(keys[0] for port, keys in per.items() if port != node)
    plain = [LockManager.from_url(f"redis://127.0.0.1:{node}")]
    others = [RedisServer().start() for _ in range(2)]
    try:
        quorum = RedLockManager.from_urls([f"redis://127.0.0.1:{node}", *(s.url for s in others)])
        for locks in (*plain, quorum):
            async with locks:
                for key in (per[node][0], other_key):
                    with pytest.raises(RedisMisconfigured, match=rf"Cluster node.*redis\+cluster://127\.0\.0\.1:{node}"):
                        await asyncio.wait_for(locks.acquire(key, wait=0), BOUND)
    finally:
        stop_servers(others)


async def test_a_plain_redis_behind_a_cluster_url_is_misconfigured_naming_the_plain_url(redis_url):
    """Regression: it was RedisUnavailable (a 503 to retry, the breaker fed) for what no retry fixes."""
    port = int(redis_url.rsplit(":", 1)[1].split("/")[0])
    async with LockManager.from_url(f"redis+cluster://127.0.0.1:{port}") as locks:
        with pytest.raises(RedisMisconfigured, match="cluster support disabled.*not a Redis Cluster node.*redis://"):
            await asyncio.wait_for(locks.acquire("k", wait=0), BOUND)


async def test_every_lock_lives_in_one_slot_and_locks_spread_over_every_master(flushed):
    keys = await keys_on_every_master(flushed)
    async with LockManager.from_url(flushed.url, lease=5.0) as locks:
        held = [await locks.acquire(key) for key in keys]
        listed = await locks.held_locks()
        assert sorted(info.key for info in listed) == sorted(f"otel-lock:{{{k}}}" for k in keys)
        for key in keys:  # the lock, its fence and (while waited for) queue keys share the slot
            assert slot_of(f"otel-lock:{{{key}}}") == slot_of(f"otel-lock:{{{key}}}:fence") == slot_of(
                f"otel-lock:{{{key}}}:q")
        for hold in held:
            await hold.release()
    assert {await flushed.owner(k) for k in keys} == set(flushed.ports)


@pytest.mark.parametrize("protocol", [2, 3])
async def test_a_cluster_client_built_by_the_user_works_the_same(flushed, protocol):
    client = RedisCluster(startup_nodes=[ClusterNode("127.0.0.1", p) for p in flushed.ports], socket_timeout=2.0,
                          protocol=protocol)
    try:
        async with LockManager(client, lease=5.0, poll_cap=60.0) as a, LockManager(client, lease=5.0) as b:
            # RESP3 is not spoken by the lean connections: redis-py's cluster client carries the scripts
            assert (link_of(a).routed is None) == (protocol == 3)
            held = await a.acquire("built")
            assert await b.try_lock("built") is None
            waiter = asyncio.create_task(a.acquire("built", wait=BOUND))
            await until(lambda: queued_on_owner(flushed, "built"), "the waiter to queue")
            await held.release()
            second = await asyncio.wait_for(waiter, BOUND)
            assert second.token > held.token
            await second.release()
        assert await client.ping()  # a client the user built stays open: theirs to close
    finally:
        await client.aclose()


async def test_the_connection_gauges_count_the_lean_connection_of_every_master_used(flushed):
    keys = await keys_on_every_master(flushed, 1)
    async with LockManager.from_url(flushed.url) as locks:
        held = [await locks.acquire(key) for key in keys]
        used, pending = locks._connection_figures()  # what otel_lock.redis.connection.* report
        assert used == len(flushed.ports) and pending == 0
        for hold in held:
            await hold.release()


async def test_one_holder_at_a_time_across_processes_on_keys_over_every_master(flushed):
    keys = await keys_on_every_master(flushed)
    holds = await run_holders({"url": flushed.url, "keys": keys, "count": 4, "tasks": 2}, 3, BOUND * 2)
    assert len(holds) == 3 * 2 * 4 * len(keys)
    assert_one_holder_at_a_time(holds)


async def test_a_release_wakes_the_waiter_on_the_slots_own_node_only(flushed):
    key = (await keys_on_every_master(flushed, 1))[0]
    owner = await flushed.owner(key)
    before = {port: (await command_calls(port, "publish"), await command_calls(port, "spublish"))
              for port in flushed.ports}
    # Polling could not reach the lock before the waiter's deadline: only a wake-up can.
    async with LockManager.from_url(flushed.url, lease=60.0, poll_cap=60.0) as a, \
            LockManager.from_url(flushed.url, lease=60.0, poll_cap=60.0) as b:
        held = await a.acquire(key)
        waiter = asyncio.create_task(b.acquire(key, wait=10.0))
        await until(lambda: queued_on_owner(flushed, key), "the waiter to queue")
        await held.release()
        second = await asyncio.wait_for(waiter, BOUND)
        assert second.token > held.token
        await second.release()
    after = {port: (await command_calls(port, "publish"), await command_calls(port, "spublish"))
             for port in flushed.ports}
    for port in flushed.ports:
        assert after[port][0] == before[port][0]  # no broadcast PUBLISH anywhere
        grew = after[port][1] > before[port][1]
        assert grew == (port == owner), (port, owner, before, after)


async def queued_on_owner(cluster: ClusterSet, key: str) -> bool:
    async with aioredis.Redis(port=await cluster.owner(key)) as node:
        return bool(await node.zcard(f"otel-lock:{{{key}}}:q"))


async def test_renewals_keep_leases_on_every_slot(flushed):
    keys = [f"renewed:{i}" for i in range(40)]
    assert len({slot_of(k) for k in keys}) > 30
    async with LockManager.from_url(flushed.url, lease=0.6) as locks:
        held = [await locks.acquire(key) for key in keys]
        await asyncio.sleep(2.0)  # the subject: about three leases pass, renewed every lease/3
        assert not any(h.lost.is_set() for h in held)
        async with RedisCluster(startup_nodes=[ClusterNode("127.0.0.1", flushed.ports[0])]) as client:
            for key in keys:
                assert await client.pttl(f"otel-lock:{{{key}}}") > 0
        for hold in held:
            await hold.release()


def test_the_blocking_facade_runs_on_a_cluster(flushed):
    with SyncLockManager.from_url(flushed.url, lease=5.0) as locks:
        with locks.lock("sync:1") as outer:
            with locks.lock("sync:1") as inner:  # the same thread re-enters
                assert inner.depth == 2 and inner.token == outer.token
            assert locks.try_lock("sync:1") is not None  # (re-entry again, depth 2)
        assert [info.key for info in locks.held_locks()] == ["otel-lock:{sync:1}"]
        assert locks.force_release("sync:1") is True
        assert locks.held_locks() == []


# -- resharding and failover -------------------------------------------------------------


async def test_a_slot_migrated_under_load_never_gives_two_holders(flushed):
    key = "moving"
    slot = slot_of(key)
    source = await flushed.owner(key)
    target = next(p for p in flushed.ports if p != source)
    inside, tokens, errors = 0, [], []
    done = asyncio.Event()

    async with LockManager.from_url(flushed.url, lease=2.0, wait=BOUND) as a, \
            LockManager.from_url(flushed.url, lease=2.0, wait=BOUND) as b:
        async def worker(locks: LockManager) -> None:
            nonlocal inside
            while not done.is_set() or len(tokens) < 40:
                entered = False
                try:
                    async with locks.lock(key) as held:
                        inside += 1
                        entered = True
                        assert inside == 1, "two holders at once"
                        tokens.append(held.token)
                        await asyncio.sleep(0.002)
                        inside -= 1
                        entered = False
                except (LockTimeout, RedisUnavailable, LockError, LockLost) as exc:
                    errors.append(type(exc).__name__)  # reported, and the worker goes on
                    if entered:  # this worker's own hold ended by the error (another's count is its own)
                        inside -= 1
                if len(tokens) > 2000:
                    return

        workers = [asyncio.create_task(worker(m)) for m in (a, b, a, b)]
        await until(lambda: _at_least(tokens, 20), "load before the migration")
        await flushed.migrate_slot(slot, target)
        mark = len(tokens)
        await until(lambda: _at_least(tokens, mark + 20), "locks to be taken on the slot's new master")
        done.set()
        await asyncio.wait_for(asyncio.gather(*workers), BOUND)
    assert await flushed.owner(key) == target
    assert tokens == sorted(tokens) and len(set(tokens)) == len(tokens)


async def _at_least(items: list, n: int) -> bool:
    return len(items) >= n


async def test_a_slot_half_migrated_refuses_new_locks_as_unavailable_until_it_is_done(flushed):
    """A script's four keys must all be on one side: while they are not, Redis answers TRYAGAIN (or ASK)."""
    key = "asked"
    slot = slot_of(key)
    source = await flushed.owner(key)
    target = next(p for p in flushed.ports if p != source)
    source_id, target_id = await flushed.node_id(source), await flushed.node_id(target)
    async with LockManager.from_url(flushed.url, lease=5.0) as a, LockManager.from_url(flushed.url, lease=5.0) as b:
        async with a.lock("warm-up"):
            pass
        async with aioredis.Redis(port=source) as src, aioredis.Redis(port=target) as dst:
            await dst.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", source_id)
            await src.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", target_id)
            with pytest.raises(RedisUnavailable, match="TRYAGAIN"):
                await a.try_lock(key)  # redirected with ASK, then refused: a reported error, not a hold
            with pytest.raises(RedisUnavailable, match="TRYAGAIN"):
                await b.acquire(key, wait=0.2)
            for port in flushed.ports:
                async with aioredis.Redis(port=port) as node:
                    await node.execute_command("CLUSTER", "SETSLOT", slot, "NODE", target_id)
        held = await a.acquire(key)  # MOVED to the target, where it is made
        assert await b.try_lock(key) is None
        assert await flushed.owner(key) == target
        assert await held.release() is True


async def _fail_over(cluster: ClusterSet, owner: int, key: str) -> None:
    """Once the lock reached the replica: the master killed, its replica promoted."""
    await until(lambda: _on_replica(cluster, owner, key), "the lock to reach the master's replica")
    cluster.kill(owner)
    await cluster.failed_over(owner)


@pytest.mark.failover
async def test_a_killed_master_ends_in_told_holders_and_the_replica_takes_over():
    async with ClusterSet(masters=3, replicas=1) as cluster:
        key = "failing"
        owner = await cluster.owner(key)
        async with LockManager.from_url(cluster.url, lease=2.0, cancel_on_lost=False) as a, \
                LockManager.from_url(cluster.url, lease=2.0, wait=BOUND) as b:
            first = await a.acquire(key)
            await _fail_over(cluster, owner, key)
            second = await b.acquire(key)
            # The first holder's renewals went to a dead node: by the time anybody
            # else holds the lock, the first holder has been told.
            assert first.lost.is_set()
            assert second.token > first.token
            await second.release()
            assert await first.release() is False  # not ours any more, and nothing of B's touched
            # Wake-ups follow the slot to its new master.
            third = await a.acquire(key, wait=BOUND)
            waiter = asyncio.create_task(b.acquire(key, wait=BOUND))
            await until(lambda: queued_on_owner(cluster, key), "the waiter to queue on the new master")
            await third.release()
            fourth = await asyncio.wait_for(waiter, BOUND)
            assert fourth.token > third.token
            await fourth.release()


@pytest.mark.failover
async def test_a_waiter_subscribed_on_a_killed_master_subscribes_again_on_the_replica_that_took_over():
    """The waiter's manager read the slot map before the failover: its new subscription must not go to the dead node."""
    async with ClusterSet(masters=3, replicas=1) as cluster:
        key = "failing"
        owner = await cluster.owner(key)
        async with LockManager.from_url(cluster.url, lease=2.0, cancel_on_lost=False) as a, \
                LockManager.from_url(cluster.url, lease=2.0) as b:
            first = await a.acquire(key)
            waiter = asyncio.create_task(b.acquire(key, wait=BOUND))
            await until(lambda: queued_on_owner(cluster, key), "the waiter to queue on the master")
            await _fail_over(cluster, owner, key)
            # Subscribed again on the new master and queued there, the waiter takes the lock when A's lease ends.
            second = await asyncio.wait_for(waiter, BOUND)
            assert first.lost.is_set()
            assert second.token > first.token
            third = asyncio.create_task(b.acquire(key, wait=BOUND))  # B's subscription is made: it queues at once
            await until(lambda: queued_on_owner(cluster, key), "the next waiter to queue on the new master")
            await second.release()
            assert (await asyncio.wait_for(third, BOUND)).token > second.token


async def test_a_master_down_at_first_use_fails_only_its_own_keys(caplog):
    """The first-use server checks of a new manager skip a master that does not answer (logged)."""
    async with ClusterSet(masters=3) as cluster:
        # a key on the master that also holds the namespace's data-model key (see docs/lock.md, Cluster)
        alive = await cluster.owner("otel-lock:model")
        key = "healthy-0"
        for i in range(1000):
            key = f"healthy-{i}"
            if await cluster.owner(key) == alive:
                break
        dead = next(p for p in cluster.ports if p != alive)
        cluster.kill(dead)
        async with LockManager.from_url(cluster.url, lease=2.0) as locks:
            async with locks.lock(key) as held:
                assert held.token > 0
            assert {report.address for report in locks.server_reports} == {
                f"127.0.0.1:{p}" for p in cluster.ports if p != dead}
        assert f"server checks skipped for Cluster master 127.0.0.1:{dead}" in caplog.text


async def test_callers_queued_on_a_reconnect_to_a_stopped_master_share_its_one_attempt():
    """Regression: each caller queued behind a reconnect to a stopped (SIGSTOP) master, or behind a read of the
    slot map that asked it first, tried again in turn once the one before it had timed out, so the 40th waited
    40 connect timeouts, far past its `wait`."""
    async with ClusterSet(masters=3) as cluster:
        per = await cluster.keys_per_master(40)
        async with LockManager.from_url(cluster.url, socket_timeout=1.0, breaker_failures=0) as locks:
            async with locks.lock(per[min(per)][0]):  # the lean connections are open
                pass
            _, port = next(iter(link_of(locks).routed._nodes))  # the node the slot map is asked first
            node = next(n for n in cluster.nodes if n.port == port)
            assert node.process is not None
            os.kill(node.process.pid, signal.SIGSTOP)
            try:
                with pytest.raises(RedisUnavailable):  # no reply: the connection is dropped
                    await asyncio.wait_for(locks.acquire(per[port][0], wait=0), BOUND)
                outcomes = await asyncio.wait_for(asyncio.gather(
                    *(locks.acquire(key, wait=0) for key in per[port]), return_exceptions=True), BOUND)
            finally:
                os.kill(node.process.pid, signal.SIGCONT)
        assert all(isinstance(outcome, RedisUnavailable) for outcome in outcomes), outcomes


@pytest.mark.parametrize("fault", ["killed", "stopped"])
async def test_one_master_down_does_not_open_the_circuit_for_the_other_masters(fault):
    """Regression: the calls in flight to a dead or stopped master fail in a burst, with no answer between them,
    and opened the manager's one breaker: every slot's new locks were refused "circuit open"."""
    async with ClusterSet(masters=3) as cluster:
        per = await cluster.keys_per_master(10)
        dead = min(per)
        node = next(n for n in cluster.nodes if n.port == dead)
        healthy = [keys[0] for port, keys in per.items() if port != dead]
        # a cool-down far longer than this test: once open, the circuit would stay open
        async with LockManager.from_url(cluster.url, socket_timeout=1.0, breaker_cooldown=60.0) as locks:
            for keys in per.values():
                async with locks.lock(keys[0]):
                    pass
            if fault == "killed":
                cluster.kill(dead)
            else:
                assert node.process is not None
                os.kill(node.process.pid, signal.SIGSTOP)
            try:
                outcomes = await asyncio.wait_for(asyncio.gather(
                    *(locks.acquire(key, wait=0) for key in per[dead]), return_exceptions=True), BOUND)
                assert all(isinstance(outcome, RedisUnavailable) for outcome in outcomes), outcomes
                for key in healthy:
                    async with locks.lock(key, wait=1.0) as held:
                        assert held.token > 0
            finally:
                if node.process is not None:
                    os.kill(node.process.pid, signal.SIGCONT)


async def _on_replica(cluster: ClusterSet, master: int, key: str) -> bool:
    """The replica of `master` has the lock key (replication is asynchronous)."""
    async with aioredis.Redis(port=master) as node:
        replicas = (await node.execute_command("ROLE"))[2]
    for _host, port, _offset in replicas:
        async with aioredis.Redis(port=int(port)) as replica:
            await replica.execute_command("READONLY")
            if not await replica.exists(f"otel-lock:{{{key}}}"):
                return False
    return bool(replicas)


async def test_a_node_port_another_server_took_is_replaced_and_the_cluster_has_none_of_it(redis_server):
    """A free port can be taken before a node binds it: the set starts that node elsewhere."""
    cluster = ClusterSet(masters=3)
    cluster.nodes[0].port = redis_server.port  # answered by another process's redis-server
    async with cluster:
        assert redis_server.port not in cluster.ports
        async with aioredis.Redis(port=cluster.ports[0], decode_responses=True) as client:
            nodes = await client.execute_command("CLUSTER", "NODES")
        assert f":{redis_server.port}@" not in str(nodes) and len(str(nodes).splitlines()) == 3
    async with aioredis.Redis(port=redis_server.port) as other:
        assert await other.ping()  # the other server was left alone
