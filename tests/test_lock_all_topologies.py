"""`lock_all` (and, where offered, deadlock detection) on Sentinel, Redis Cluster and a RedLock quorum.

Sentinel: the master's scripts, as on one Redis; Cluster: keys in different
slots (on different masters) are taken one by one in the canonical order;
RedLock: each key is a quorum hold of its own.
"""

from __future__ import annotations

import asyncio

import pytest

from benchmarks._cluster_set import ClusterSet
from benchmarks._sentinel_set import SentinelSet
from otel_lock import LockManager, LockTimeout, RedLockManager
from otel_lock.cli._redis_server import RedisServer, stop_servers

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def cluster():
    c = asyncio.run(ClusterSet(masters=3).__aenter__())
    try:
        yield c
    finally:
        asyncio.run(c.__aexit__())


@pytest.fixture
def masters():
    servers = [RedisServer().start() for _ in range(3)]
    yield servers
    stop_servers(servers)


async def opposite_orders(one, two, keys: list[str], rounds: int) -> list[dict[str, int]]:
    log: list[dict[str, int]] = []

    async def worker(manager, order):
        for _ in range(rounds):
            async with manager.lock_all(order, wait=20.0) as held:
                log.append(dict(held.tokens))
                await asyncio.sleep(0)

    await asyncio.gather(worker(one, keys), worker(two, list(reversed(keys))))
    return log


def assert_tokens_increase(log: list[dict[str, int]]) -> None:
    for key in log[0]:
        tokens = [entry[key] for entry in log]
        assert tokens == sorted(tokens) and len(set(tokens)) == len(tokens)


async def test_lock_all_over_several_cluster_masters_in_opposite_orders(cluster):
    per_master = await cluster.keys_per_master(1)
    keys = [k for ks in per_master.values() for k in ks]
    assert len(keys) == 3
    async with LockManager.from_url(cluster.url) as one, LockManager.from_url(cluster.url) as two:
        log = await opposite_orders(one, two, keys, 40)
        assert len(log) == 80
        assert_tokens_increase(log)
        async with two.lock(keys[1]):
            with pytest.raises(LockTimeout):
                await one.acquire_all(keys, wait=0.2)
            assert [h.key for h in await one.held_locks()] == [f"otel-lock:{{{keys[1]}}}"]


async def test_lock_all_on_a_redlock_quorum(masters):
    urls = [s.url for s in masters]
    async with RedLockManager.from_urls(urls) as one, RedLockManager.from_urls(urls) as two:
        log = await opposite_orders(one, two, ["acct:1", "acct:2"], 20)
        assert len(log) == 40
        assert_tokens_increase(log)
        async with two.lock("acct:2"):
            with pytest.raises(LockTimeout):
                await one.acquire_all(["acct:2", "acct:1"], wait=0.2)
            assert [h.key for h in await one.held_locks()] == ["otel-lock:{acct:2}"]


async def crossed(one, two, first: str, second: str, wait: float, **shape) -> tuple[object, object]:
    """Task A holds `first` and waits for `second`; task B holds `second` and then waits for `first`.

    Both waits overlap whichever starts first (each holds what the other asks for until its wait ends).
    `shape`: how A holds `first` (`shared=True`: B waits to hold it exclusively; `permits=1`: B waits for
    the permit).
    """
    def take_first(locks, **kw):
        if "permits" in shape:
            return locks.semaphore(first, permits=shape["permits"], **kw)
        return locks.lock(first, **(shape if "wait" not in kw else {}), **kw)

    a_holds, a_waits, b_holds = asyncio.Event(), asyncio.Event(), asyncio.Event()
    outcomes: dict[str, object] = {}

    async def a() -> None:
        async with take_first(one):
            a_holds.set()
            await b_holds.wait()
            try:
                a_waits.set()
                async with one.lock(second, wait=wait) as then:
                    outcomes["a"] = then.token
            except Exception as exc:  # noqa: BLE001  (the outcome under test)
                outcomes["a"] = exc

    async def b() -> None:
        async with two.lock(second):
            b_holds.set()
            await a_holds.wait()
            await a_waits.wait()
            try:
                async with take_first(two, wait=wait) as then:
                    outcomes["b"] = then.token
            except Exception as exc:  # noqa: BLE001
                outcomes["b"] = exc

    await asyncio.wait_for(asyncio.gather(a(), b()), 60)
    return outcomes["a"], outcomes["b"]


async def test_crossed_waits_on_cluster_masters_are_refused(cluster):
    from otel_lock import LockDeadlock

    per_master = await cluster.keys_per_master(1, prefix="dl")
    first, second = [ks[0] for ks in per_master.values()][:2]
    async with LockManager.from_url(cluster.url) as one, LockManager.from_url(cluster.url) as two:
        a, b = await crossed(one, two, first, second, wait=30.0)
        # the record-then-walk of a Cluster never misses the cycle; both may be refused, at least one is
        refusals = [o for o in (a, b) if isinstance(o, LockDeadlock)]
        assert refusals, (a, b)
        assert all(isinstance(o, (int, LockDeadlock)) for o in (a, b)), (a, b)
        assert {step[0] for step in refusals[0].cycle} == {f"otel-lock:{{{first}}}", f"otel-lock:{{{second}}}"}


@pytest.mark.parametrize("shape", [{"shared": True}, {"permits": 1}], ids=["shared hold", "permit"])
async def test_crossed_waits_through_a_shared_hold_or_a_permit_on_cluster_masters_are_refused(cluster, shape):
    """The Cluster's stepwise walk follows a shared lock's holders and a semaphore's, as the script does."""
    from otel_lock import LockDeadlock

    per_master = await cluster.keys_per_master(1, prefix="ds")
    first, second = [ks[0] for ks in per_master.values()][:2]
    async with LockManager.from_url(cluster.url) as one, LockManager.from_url(cluster.url) as two:
        a, b = await crossed(one, two, first, second, wait=30.0, **shape)
        refusals = [o for o in (a, b) if isinstance(o, LockDeadlock)]
        assert refusals, (a, b)
        assert all(isinstance(o, (int, LockDeadlock)) for o in (a, b)), (a, b)


async def test_a_shared_wait_behind_an_exclusive_waiter_on_cluster_masters_is_refused(cluster):
    """B holds `first` shared, C queues for it exclusively, A holds `second` and asks for `first` shared (it is
    not let in: C goes first), B asks for `second`: the stepwise walk sees A's shared wait blocked by B."""
    from redis.asyncio.cluster import ClusterNode, RedisCluster

    from otel_lock import LockDeadlock

    per_master = await cluster.keys_per_master(1, prefix="dq")
    first, second = [ks[0] for ks in per_master.values()][:2]
    outcomes: dict[str, object] = {}
    b_holds, a_holds, c_queued = asyncio.Event(), asyncio.Event(), asyncio.Event()
    async with LockManager.from_url(cluster.url) as one, LockManager.from_url(cluster.url) as two, \
            LockManager.from_url(cluster.url) as three, \
            RedisCluster(startup_nodes=[ClusterNode("127.0.0.1", cluster.ports[0])]) as client:

        async def waits(name: str, locks, key: str, **shape) -> None:
            try:
                async with locks.lock(key, wait=30.0, **shape) as then:
                    outcomes[name] = then.token
            except Exception as exc:  # noqa: BLE001  (the outcome under test)
                outcomes[name] = exc

        async def a() -> None:
            async with one.lock(second):
                a_holds.set()
                await c_queued.wait()
                await waits("a", one, first, shared=True)

        async def b() -> None:
            async with two.lock(first, shared=True):
                b_holds.set()
                await c_queued.wait()
                await waits("b", two, second)

        async def c() -> None:
            await b_holds.wait()
            await waits("c", three, first)

        async def queued() -> None:
            while await client.zcard(f"otel-lock:{{{first}}}:q") < 1:
                await asyncio.sleep(0.005)
            c_queued.set()

        await asyncio.wait_for(asyncio.gather(a(), b(), c(), queued()), 60)
    refusals = [o for o in (outcomes["a"], outcomes["b"]) if isinstance(o, LockDeadlock)]
    assert refusals, outcomes
    assert all(isinstance(o, (int, LockDeadlock)) for o in outcomes.values()), outcomes
    assert isinstance(outcomes["c"], int), outcomes


async def test_crossed_waits_on_redlock_are_not_detected_and_end_at_wait(masters):
    urls = [s.url for s in masters]
    async with RedLockManager.from_urls(urls) as one, RedLockManager.from_urls(urls) as two:
        a, b = await crossed(one, two, "k1", "k2", wait=1.0)
        assert isinstance(a, LockTimeout) or isinstance(b, LockTimeout), (a, b)


async def test_lock_all_and_deadlocks_through_sentinel():
    from otel_lock import LockDeadlock

    async with SentinelSet() as servers:
        async with LockManager.from_url(servers.url) as one, LockManager.from_url(servers.url) as two:
            log = await opposite_orders(one, two, ["acct:1", "acct:2"], 30)
            assert len(log) == 60
            assert_tokens_increase(log)
            a, b = await crossed(one, two, "k1", "k2", wait=30.0)
            # one script on the master: exactly one of the two is refused, the other gets its lock
            assert sorted(type(o).__name__ for o in (a, b)) == ["LockDeadlock", "int"], (a, b)
            refusal = a if isinstance(a, LockDeadlock) else b
            assert {step[0] for step in refusal.cycle} == {"otel-lock:{k1}", "otel-lock:{k2}"}
