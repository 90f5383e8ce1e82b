"""RedLockManager over three real redis-servers on loopback, with masters killed for real (by pid)."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import httpx
import pytest
import redis
import redis.asyncio as aioredis
from fastapi import FastAPI, Request
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

import otel_lock
from otel_lock import (HeldLock, LockError, LockLost, LockMiddleware, LockTimeout, RedisUnavailable, RedLockManager,
                       idempotent, locked)
from otel_lock.cli._redis_server import RedisServer, stop_servers

from _proc_helpers import TcpProxy, assert_one_holder_at_a_time, run_holders, until

BOUND = 20.0  # turns a hang into a failure; not a timing


@pytest.fixture
def masters():
    servers = [RedisServer().start() for _ in range(3)]
    yield servers
    stop_servers(servers)


def urls(servers) -> list[str]:
    return [s.url for s in servers]


def kill(server: RedisServer) -> None:
    """SIGKILL by pid: a crash, no goodbye to the clients."""
    assert server.process is not None
    os.kill(server.process.pid, signal.SIGKILL)
    server.process.wait(5)
    server.process = None


def lock_keys(server: RedisServer, pattern: str = "*") -> list[bytes]:
    """Every lock hash on one master (fence keys and the namespace's data model are bookkeeping, not a hold)."""
    with redis.Redis(port=server.port) as client:
        return sorted(k for k in client.keys(pattern) if not k.endswith((b":fence", b":model")))


def fence(server: RedisServer, key: str) -> int:
    with redis.Redis(port=server.port) as client:
        return int(client.get(f"otel-lock:{{{key}}}:fence") or 0)


# -- the API --------------------------------------------------------------------


def test_exported_from_the_package():
    assert "RedLockManager" in otel_lock.__all__
    assert otel_lock.RedLockManager is RedLockManager


async def test_the_hold_has_the_core_shape_and_every_master_holds_it(masters):
    async with RedLockManager.from_urls(urls(masters), lease=2.0) as locks:
        async with locks.lock("stock:1") as held:
            assert isinstance(held, HeldLock)
            assert held.key == "otel-lock:{stock:1}" and held.name == "stock" and held.depth == 1
            assert isinstance(held.lost, asyncio.Event) and not held.lost.is_set()
            for server in masters:
                with redis.Redis(port=server.port) as client:
                    fields = client.hgetall(held.key)
                assert fields[b"owner"].decode() == held.owner
                assert int(fields[b"token"]) == held.token  # every master stores the hold's final token
            assert await locks.try_lock("stock:2") is not None  # another key is independent
        assert all(lock_keys(s, "otel-lock:{stock:1}") == [] for s in masters)  # released everywhere


async def test_try_lock_and_acquire_and_release(masters):
    async with RedLockManager.from_urls(urls(masters), lease=2.0) as locks:
        held = await locks.acquire("job:1")
        other = asyncio.create_task(locks.try_lock("job:1"))  # another task: another caller
        assert await other is None
        with pytest.raises(LockTimeout):
            await asyncio.create_task(locks.acquire("job:1", wait=0.05))
        assert await held.release() is True
        assert await held.release() is True  # idempotent
        again = await locks.try_lock("job:1")
        assert again is not None and again.token > held.token
        assert await again.release() is True


async def test_reentry_belongs_to_the_task(masters):
    async with RedLockManager.from_urls(urls(masters), lease=2.0) as locks:
        async with locks.lock("report:7") as outer:
            async with locks.lock("report:7") as inner:
                assert inner.depth == 2 and inner.token == outer.token and inner.owner == outer.owner
            assert lock_keys(masters[0], outer.key) == [outer.key.encode()]  # the inner release kept the lock
            child = asyncio.create_task(locks.try_lock("report:7"))
            assert await child is None  # a spawned task is another caller
        assert lock_keys(masters[0], outer.key) == []


async def test_sharing_with_children_is_explicit_and_the_release_waits_for_them(masters):
    child_in, child_go, body_done, late_go = asyncio.Event(), asyncio.Event(), asyncio.Event(), asyncio.Event()
    leases = []
    async with RedLockManager.from_urls(urls(masters), lease=2.0) as locks:
        async def child():
            async with locks.lock("report:8", wait=0) as held:
                child_in.set()
                await child_go.wait()
                return held.depth, held.token

        async def late_child():
            await late_go.wait()
            async with locks.lock("report:8", wait=0):
                pass

        async def parent():
            async with locks.lock("report:8", share_with_children=True) as outer:
                leases.append(outer._lease)
                task, late_task = asyncio.create_task(child()), asyncio.create_task(late_child())
                await child_in.wait()
                body_done.set()
            return outer, await task, late_task

        running = asyncio.create_task(parent())
        await body_done.wait()
        while not leases[0].closing:  # the outer release has begun and waits for the child
            await asyncio.sleep(0)
        assert not running.done(), "the parent's release did not wait for its child"
        assert lock_keys(masters[0], "otel-lock:{report:8}") != []
        late_go.set()
        child_go.set()
        outer, (depth, token), late_task = await running
        assert (depth, token) == (2, outer.token)
        with pytest.raises(LockError, match="being released"):
            await late_task  # it came after the final release began: refused, never beside it
        assert lock_keys(masters[0], outer.key) == []


async def test_mutual_exclusion_across_tasks_and_tokens_increase(masters):
    inside, seen = 0, []
    async with RedLockManager.from_urls(urls(masters), lease=2.0, wait=BOUND) as locks:
        async def worker() -> None:
            nonlocal inside
            for _ in range(6):
                async with locks.lock("counter") as held:
                    inside += 1
                    assert inside == 1
                    seen.append(held.token)
                    await asyncio.sleep(0.001)
                    inside -= 1

        await asyncio.wait_for(asyncio.gather(*(worker() for _ in range(6))), BOUND)
    assert len(seen) == 36 and seen == sorted(seen) and len(set(seen)) == 36


async def test_mutual_exclusion_across_processes(masters):
    holds = await run_holders({"urls": urls(masters), "keys": ["shared"], "count": 8, "tasks": 2}, 3, BOUND)
    assert len(holds) == 3 * 2 * 8
    assert_one_holder_at_a_time(holds)


async def test_undoing_a_failed_round_never_undoes_a_later_grant(masters):
    """A reply that came too late is undone in the background; the round that then won must keep its quorum."""
    a, b, c = masters
    proxy = await TcpProxy("127.0.0.1", b.port).start()
    try:
        async with RedLockManager.from_urls([a.url, proxy.url, c.url], lease=2.0, master_timeout=0.1,
                                            wait=BOUND) as locks:
            async with locks.lock("warm-up"):
                pass
            with redis.Redis(port=c.port) as other:  # C is busy with somebody else for a moment
                other.hset("otel-lock:{job}", mapping={"owner": "somebody", "depth": 1, "token": 1})
                other.pexpire("otel-lock:{job}", 600)
            proxy.stall_replies()  # B runs the first round's ACQUIRE, its answer comes too late
            taking = asyncio.create_task(locks.acquire("job"))
            await until(lambda: _has(b, "otel-lock:{job}"), "the first round to reach B")
            first_round = _owner(b, "otel-lock:{job}")
            await until(lambda: _undo_pending(locks), "the first round to fail (A and B only, B silent)")
            proxy.forward()
            held = await asyncio.wait_for(taking, BOUND)
            # Each round has an owner of its own, so the undo of a lost round (by owner) can never
            # release a later round's grant on the same master.
            assert held.owner != first_round
            await until(lambda: _none_pending(locks), "the background undo of the first round")
            owners = [_owner(server, "otel-lock:{job}") for server in masters]
            assert owners.count(held.owner) >= 2, owners  # still held by a quorum: nobody else can enter
            assert await held.release() is True
    finally:
        await proxy.aclose()


async def _has(server: RedisServer, key: str) -> bool:
    with redis.Redis(port=server.port) as client:
        return bool(client.exists(key))


async def _none_pending(locks: RedLockManager) -> bool:
    return locks._runtimes.here().transport.cleanup.pending() == 0


async def _undo_pending(locks: RedLockManager) -> bool:
    return locks._runtimes.here().transport.cleanup.pending() > 0


def _owner(server: RedisServer, key: str) -> str | None:
    with redis.Redis(port=server.port) as client:
        owner = client.hget(key, "owner")
    return owner.decode() if owner else None


# -- masters failing --------------------------------------------------------------


async def test_one_master_killed_locks_are_still_granted(masters):
    async with RedLockManager.from_urls(urls(masters), lease=2.0) as locks:
        first = await locks.acquire("k")
        assert await first.release()
        kill(masters[2])
        second = await locks.acquire("k", wait=1.0)
        assert second.token > first.token
        assert await asyncio.create_task(locks.try_lock("k")) is None  # still exclusive on two masters
        assert await second.release() is True
        async with locks.lock("k") as third:
            assert third.token > second.token


async def test_two_masters_killed_fail_cleanly_and_leave_nothing_held(masters):
    async with RedLockManager.from_urls(urls(masters), lease=2.0) as locks:
        await (await locks.acquire("first-use")).release()  # the first-use checks passed while all were up
        kill(masters[1])
        kill(masters[2])
        for wait in (0, 0.3):
            with pytest.raises((LockTimeout, RedisUnavailable)):
                await asyncio.wait_for(locks.acquire("k", wait=wait), wait + 2 * locks.master_timeout + BOUND)
        with pytest.raises(RedisUnavailable):  # try_lock never waits for a majority that is down
            await locks.try_lock("other")
        assert lock_keys(masters[0]) == []  # the one master that granted was released in the same round
        assert locks._runtimes.here().transport.cleanup.pending() > 0  # the dead masters' releases are kept for later
        masters[1].start()
        masters[2].start()
        assert all(lock_keys(s) == [] for s in masters)
        deadline = time.monotonic() + BOUND
        while locks._runtimes.here().transport.cleanup.pending() and time.monotonic() < deadline:  # one probe per master finds them back
            await asyncio.sleep(0.05)
        assert locks._runtimes.here().transport.cleanup.pending() == 0
        async with locks.lock("k", wait=1.0) as held:  # and the lock works again
            assert held.token > 0


async def test_try_lock_with_a_majority_down_raises_redis_unavailable(masters):
    async with RedLockManager.from_urls(urls(masters), lease=2.0) as locks:
        kill(masters[0])
        kill(masters[1])
        with pytest.raises(RedisUnavailable):
            await locks.try_lock("k")
        assert lock_keys(masters[2]) == []


async def test_a_holder_whose_renewals_fail_is_told_lost_by_lease_minus_drift(masters):
    lease = 1.0
    drift = lease * 0.01 + 0.002
    async with RedLockManager.from_urls(urls(masters), lease=lease) as locks:
        loop = asyncio.get_running_loop()
        held = await locks.acquire("k")
        kill(masters[0])
        kill(masters[1])
        killed_at = loop.time()
        # every renewal Redis confirmed was sent before the kill, so the lease cannot be believed past this point
        await asyncio.sleep(killed_at + lease - drift - loop.time())
        assert held.lost.is_set()
        await asyncio.wait_for(held.lost.wait(), BOUND)
        assert await held.release() is False


async def test_cancel_on_lost_raises_lock_lost_out_of_async_with(masters):
    async with RedLockManager.from_urls(urls(masters), lease=1.0) as locks:
        with pytest.raises(LockLost):
            async with locks.lock("k", cancel_on_lost=True):
                kill(masters[1])
                kill(masters[2])
                await asyncio.sleep(BOUND)  # the work: cancelled by the loss
        masters[1].start()
        masters[2].start()
        with pytest.raises(LockLost):  # nested use of a lost hold is refused too
            async with locks.lock("j") as held:
                held._lease.ends.lose(held._lease, "test")
                async with locks.lock("j"):
                    pass


async def test_renewals_keep_the_quorum_across_a_master_restart(masters):
    async with RedLockManager.from_urls(urls(masters), lease=0.6) as locks:
        held = await locks.acquire("k")
        kill(masters[0])
        masters[0].start()  # back empty
        # renewals every 0.2 s re-take the empty master under the same owner and token
        deadline = time.monotonic() + BOUND
        while lock_keys(masters[0]) == [] and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        with redis.Redis(port=masters[0].port) as client:
            assert client.hget(held.key, "owner").decode() == held.owner
        assert fence(masters[0], "k") == held.token
        assert not held.lost.is_set()
        assert await held.release() is True


# -- fencing --------------------------------------------------------------------


async def test_token_is_the_maximum_and_still_increases_without_that_master(masters):
    """A master whose clock runs ahead mints the largest token; losing it must not let tokens go back."""
    ahead = int(time.time() * 1_000_000) + 60_000_000  # a minute ahead
    with redis.Redis(port=masters[2].port) as client:
        client.set("otel-lock:{k}:fence", ahead)
    async with RedLockManager.from_urls(urls(masters), lease=2.0) as locks:
        first = await locks.acquire("k")
        assert first.token == ahead + 1 == max(fence(s, "k") for s in masters)
        assert all(fence(s, "k") == first.token for s in masters)  # every granting master raised its fence
        assert await first.release()
        kill(masters[2])
        second = await locks.acquire("k")
        assert second.token > first.token
        assert await second.release()


# -- bad input ------------------------------------------------------------------


@pytest.mark.parametrize("call, message", [
    (lambda u: RedLockManager.from_urls(u[0]), "list of Redis URLs"),
    (lambda u: RedLockManager.from_urls(u[:2]), "at least 3"),
    (lambda u: RedLockManager.from_urls([u[0], u[0], u[1]]), "already given"),
    (lambda u: RedLockManager.from_urls(["http://x", u[0], u[1]]), "scheme"),
    (lambda u: RedLockManager.from_urls(u, lease=1.0, master_timeout=0.5), "master_timeout"),
    (lambda u: RedLockManager.from_urls(u, lease=-1), "lease"),
    (lambda u: RedLockManager.from_urls(u, lease=3, renew_interval=3), "renewal interval"),
    (lambda u: RedLockManager.from_urls(u, namespace="a{b}"), "namespace"),
    (lambda u: RedLockManager([redis.asyncio.Redis()] * 3), "same client"),
    # regression: the default port and two clients of one server were taken as different masters
    (lambda u: RedLockManager.from_urls(["redis://127.0.0.1", "redis://127.0.0.1:6379", u[1]]), "already given"),
    (lambda u: RedLockManager([redis.asyncio.Redis.from_url(u[0]), redis.asyncio.Redis.from_url(u[0] + "1"),
                               redis.asyncio.Redis.from_url(u[1])]), "name the master 127.0.0.1"),
])
def test_bad_options_raise_value_error_naming_the_problem(masters, call, message):
    with pytest.raises(ValueError, match=message):
        call(urls(masters))


@pytest.mark.parametrize("clients", [["a", "b", "c"], "sync"], ids=["strings", "sync-clients"])
def test_clients_that_are_not_redis_asyncio_are_refused_naming_the_type(masters, clients):
    """Regression: they were taken, and the first use failed on a raw AttributeError or TypeError."""
    if clients == "sync":
        clients = [redis.Redis(port=server.port) for server in masters]
    with pytest.raises(TypeError, match=r"redis\.asyncio\.Redis client per master, not (builtins\.str|redis\.client)"):
        RedLockManager(clients)


@pytest.mark.parametrize("kwargs, message", [
    ({"key": ""}, "non-empty"),
    ({"key": "a{b"}, "hash tag"),
    ({"key": "k", "wait": -1}, "wait"),
    ({"key": "k", "lease": 0.1}, "master_timeout"),
    ({"key": "k", "name": ""}, "name"),
])
async def test_bad_lock_arguments_raise_value_error(masters, kwargs, message):
    async with RedLockManager.from_urls(urls(masters), lease=2.0) as locks:
        with pytest.raises(ValueError, match=message):
            await locks.acquire(**kwargs)
        with pytest.raises(ValueError, match=message):
            async with locks.lock(**kwargs):
                pass


# -- telemetry ------------------------------------------------------------------


async def test_records_the_core_instruments(masters):
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    try:
        async with RedLockManager.from_urls(urls(masters), lease=0.6, meter_provider=provider) as locks:
            held = await locks.acquire("m:1")
            assert await asyncio.create_task(locks.try_lock("m:1")) is None
            with pytest.raises(LockTimeout):
                await asyncio.create_task(locks.acquire("m:1", wait=0.05))
            deadline = time.monotonic() + BOUND
            while not _points(reader, "otel_lock.renewals") and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            await held.release()
            kill(masters[0])
            kill(masters[1])
            with pytest.raises(RedisUnavailable):
                await locks.acquire("m:1", wait=0)
        waits = {(p["lock.outcome"], p.get("error.type")) for p in _points(reader, "otel_lock.wait.duration")}
        assert waits >= {("acquired", None), ("busy", None), ("timeout", "timeout"), ("error", "redis_unavailable")}
        assert {"lock.name": "m", "lock.release.outcome": "released"} in _points(reader, "otel_lock.hold.duration")
        assert {"lock.name": "m", "lock.renewal.outcome": "ok"} in _points(reader, "otel_lock.renewals")
    finally:
        provider.shutdown()


def _points(reader: InMemoryMetricReader, name: str) -> list[dict]:
    data = reader.get_metrics_data()
    return [dict(p.attributes) for r in (data.resource_metrics if data else []) for s in r.scope_metrics
            for m in s.metrics if m.name == name for p in m.data.data_points]


def test_lock_error_is_the_base():
    assert issubclass(LockTimeout, LockError) and issubclass(RedisUnavailable, LockError)


async def test_a_cancelled_waiter_leaves_nothing_on_any_master(masters):
    async with RedLockManager.from_urls(urls(masters), lease=2.0) as locks:
        held = await locks.acquire("k")
        waiter = asyncio.create_task(locks.acquire("k", wait=BOUND))
        await asyncio.sleep(0.05)  # let it run a few rounds
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert await held.release() is True
        assert all(lock_keys(s) == [] for s in masters)


async def test_masters_paused_past_the_wait_hold_nothing_past_the_lease(masters):
    """SIGSTOP two masters: the caller fails within its bound; what they apply late is gone by the lease."""
    lease = 1.0
    async with RedLockManager.from_urls(urls(masters), lease=lease) as locks:
        for server in masters[1:]:
            os.kill(server.process.pid, signal.SIGSTOP)
        try:
            with pytest.raises((LockTimeout, RedisUnavailable)):
                await asyncio.wait_for(locks.acquire("k", wait=0.2), BOUND)
            assert lock_keys(masters[0]) == []
        finally:
            for server in masters[1:]:
                os.kill(server.process.pid, signal.SIGCONT)
        deadline = time.monotonic() + lease + BOUND
        while any(lock_keys(s) for s in masters) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert all(lock_keys(s) == [] for s in masters)
        async with locks.lock("k", wait=1.0) as held:
            assert held.token > 0


async def test_a_holder_paused_past_its_lease_is_told_at_once_and_the_next_token_is_larger(masters):
    async with RedLockManager.from_urls(urls(masters), lease=0.5) as first, \
            RedLockManager.from_urls(urls(masters), lease=0.5) as second:
        held = await first.acquire("k")
        time.sleep(0.7)  # the fault: the holder's whole loop is blocked past its lease
        assert held.lost.is_set()  # told at its first look, before any renewal ran
        newer = await second.acquire("k", wait=1.0)
        assert newer.token > held.token
        assert await held.release() is False
        assert await newer.release() is True


async def test_the_middleware_takes_a_redlock_manager(masters):
    """@locked routes run under the quorum lock; @idempotent records live on the first master (503 without it)."""
    async with RedLockManager.from_urls(urls(masters), lease=2.0) as locks:
        app = FastAPI()
        app.add_middleware(LockMiddleware, manager=locks)
        inside, orders = asyncio.Event(), []

        @app.post("/stock/{pid}")
        @locked("stock:{path.pid}", wait=0)
        async def deduct(pid: int, request: Request):
            inside.set()
            await asyncio.sleep(0.2)  # the handler's work, while a second request arrives
            return {"token": request.state.lock.token}

        @app.post("/orders")
        @idempotent(shared_scope=True)
        async def order(request: Request):
            orders.append(1)
            return {"order": len(orders)}

        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
            first = asyncio.create_task(client.post("/stock/1"))
            await asyncio.wait_for(inside.wait(), BOUND)
            busy = await client.post("/stock/1")
            assert busy.status_code == 409 and busy.headers["content-type"] == "application/problem+json"
            assert (await first).status_code == 200
            replies = [await client.post("/orders", headers={"Idempotency-Key": "k1"}, json={}) for _ in range(2)]
            assert [r.json() for r in replies] == [{"order": 1}, {"order": 1}] and orders == [1]
            kill(masters[0])
            down = await client.post("/orders", headers={"Idempotency-Key": "k2"}, json={})
            assert down.status_code == 503 and "retry-after" in down.headers
            assert (await client.post("/stock/1")).status_code == 200  # the lock still has its quorum


# -- the first use with masters down ------------------------------------------------


async def test_first_use_with_one_master_down_is_granted_by_the_quorum_and_uses_it_once_back(masters, caplog):
    """Regression: a manager first used while one of three masters was down refused every acquisition."""
    kill(masters[2])
    async with RedLockManager.from_urls(urls(masters), lease=2.0) as locks:
        async with locks.lock("k", wait=1.0) as held:
            assert held.token > 0
            assert all(_owner(s, held.key) == held.owner for s in masters[:2])
            assert await asyncio.create_task(locks.try_lock("k")) is None  # still exclusive on two masters
        assert any("unreachable" in r.getMessage() and str(masters[2].port) in r.getMessage()
                   for r in caplog.records if r.levelname == "WARNING"), "the skipped master is named"
        assert len(locks.server_reports) == 2  # the masters that answered were checked
        masters[2].start()  # back (empty): the next grants are written there too
        async with locks.lock("k", wait=1.0) as again:
            assert again.token > held.token
            assert _owner(masters[2], again.key) == again.owner
        kill(masters[0])  # and it counts toward the quorum: 2 of 3 with the first one down
        async with locks.lock("k", wait=1.0) as third:
            assert third.token > again.token and _owner(masters[2], third.key) == third.owner


async def test_first_use_with_a_master_stopped_is_granted_by_the_quorum_even_without_socket_timeouts(masters):
    """A master that accepts connections and never answers (SIGSTOP) must not hold the first use for ever."""
    clients = [aioredis.Redis(port=s.port) for s in masters]  # the user's clients: no socket timeout
    os.kill(masters[1].process.pid, signal.SIGSTOP)
    try:
        async with RedLockManager(clients, lease=2.0) as locks:
            held = await asyncio.wait_for(locks.acquire("k", wait=1.0), BOUND)
            assert _owner(masters[0], held.key) == held.owner == _owner(masters[2], held.key)
            assert await held.release() is True
    finally:
        os.kill(masters[1].process.pid, signal.SIGCONT)
        for client in clients:
            await client.aclose()


async def test_first_use_with_a_majority_down_refuses_naming_the_quorum(masters):
    kill(masters[1])
    kill(masters[2])
    async with RedLockManager.from_urls(urls(masters), lease=2.0) as locks:
        for _ in range(2):  # not a one-off: every acquisition says so, until a quorum answers
            with pytest.raises(RedisUnavailable, match=r"1 of 3 masters.* quorum of 2"):
                await asyncio.wait_for(locks.acquire("k", wait=0), BOUND)
        assert lock_keys(masters[0]) == []
        masters[1].start()
        async with locks.lock("k", wait=1.0) as held:  # a quorum again: granted
            assert held.token > 0


# -- operators ------------------------------------------------------------------------


async def test_held_locks_lists_each_quorum_held_lock_once_page_by_page(masters):
    async with RedLockManager.from_urls(urls(masters), lease=30.0) as locks:
        held = [await locks.acquire(f"job:{i}") for i in range(5)]
        for server, owner in ((masters[0], "minority"), (masters[1], "late"), (masters[2], "late")):
            with redis.Redis(port=server.port) as client:  # one master alone; two of three, not the first
                client.hset("otel-lock:{by-hand:1}" if owner == "minority" else "otel-lock:{by-hand:2}",
                            mapping={"owner": owner, "depth": 1, "token": 7})
        expected = sorted([h.key for h in held] + ["otel-lock:{by-hand:2}"])
        infos = await locks.held_locks()
        assert [i.key for i in infos] == expected
        assert {i.key: i.owner for i in infos}["otel-lock:{job:0}"] == held[0].owner
        pages = [page async for page in locks._held_pages(page=2)]  # several SCAN batches on each master
        assert len(pages) > 1 and all(len(page) <= 2 for page in pages)
        assert sorted(i.key for page in pages for i in page) == expected  # each once, across masters
        kill(masters[0])
        assert [i.key for i in await locks.held_locks()] == expected  # the other two still make a quorum


async def test_held_locks_with_a_master_stopped_lists_what_the_quorum_holds(masters):
    """A master that never answers (SIGSTOP) and clients without a socket timeout: the listing still ends."""
    clients = [aioredis.Redis(port=s.port) for s in masters]
    try:
        async with RedLockManager(clients, lease=30.0) as locks:
            held = [await locks.acquire(f"job:{i}") for i in range(3)]
            os.kill(masters[0].process.pid, signal.SIGSTOP)
            try:
                infos = await asyncio.wait_for(locks.held_locks(), BOUND)
            finally:
                os.kill(masters[0].process.pid, signal.SIGCONT)
            assert [(i.key, i.owner) for i in infos] == [(h.key, h.owner) for h in held]
    finally:
        for client in clients:
            await client.aclose()


async def test_a_route_lease_under_the_quorums_minimum_fails_the_start_up_naming_it(masters):
    """Regression: `@locked(lease=0.5)` passed the decorator (any manager takes 0.5 s) and, behind a RedLock quorum
    whose minimum is 1 s, answered every request with a bare 500."""
    from _middleware_helpers import run_lifespan

    async with RedLockManager.from_urls(urls(masters)) as locks:
        app = FastAPI()

        @app.post("/jobs/{job_id}")
        @locked("job:{path.job_id}", lease=0.5)
        async def run_job(job_id: int):
            return {}

        app.add_middleware(LockMiddleware, manager=locks)
        messages = await run_lifespan(app)
    assert messages[0]["type"] == "lifespan.startup.failed"
    assert "/jobs/{job_id}" in messages[0]["message"] and "lease must be at least 1 s" in messages[0]["message"]
