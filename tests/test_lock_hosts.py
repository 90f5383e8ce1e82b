"""The lock in the hosts that run it: forked workers, every event loop, test clients, many locks per task.

A manager is made once, usually at import time, and then used from forked
children (gunicorn --preload, prefork pools, multiprocessing), from new
event loops (`asyncio.run` per job, TestClient, pytest-asyncio's loop per
test), and from several threads with their own loops. Each test drives one
of those hosts for real and checks Redis for who held what.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import redis

from otel_lock import LockManager

from _proc_helpers import TcpProxy

ROOT = Path(__file__).resolve().parents[1]
BOUND = 20.0  # turns a hang into a failure; not a timing


def _run_forked(redis_url: str, mode: str, tmp_path: Path) -> list[dict]:
    out = tmp_path / "holds.jsonl"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}  # the otel_lock under test, whatever the venv has installed
    subprocess.run([sys.executable, str(ROOT / "tests" / "_fork_holders.py"), redis_url, mode, str(out)],
                   cwd=ROOT, env=env, check=True, timeout=120)
    return [json.loads(line) for line in out.read_text().splitlines()]


@pytest.mark.parametrize("mode,processes", [("os-fork", 2), ("mp-fork", 2), ("used-before-fork", 3)])
def test_forked_workers_of_an_import_time_manager_are_separate_owners(redis_url, tmp_path, mode, processes):
    """Each child has its own identity: one holder at a time, owners and tokens never shared."""
    reports = _run_forked(redis_url, mode, tmp_path)
    assert len(reports) == processes, reports
    assert len({r["pid"] for r in reports}) == processes
    assert [r["overlaps"] for r in reports] == [0] * processes
    holds = [tuple(h) for r in reports for h in r["holds"]]
    assert len(holds) == 40 * processes
    assert len({owner for owner, _ in holds}) == len(holds), "an owner id was used twice"
    assert len({token for _, token in holds}) == len(holds), "a fencing token was handed out twice"
    owners_by_process = [{owner.split(":")[0] for owner, _ in r["holds"]} for r in reports]
    assert all(len(ids) == 1 for ids in owners_by_process)
    assert len(set.union(*owners_by_process)) == processes, "two processes share a manager identity"
    with redis.Redis.from_url(redis_url) as client:
        assert client.get("forked:inside") in (b"0", None)
        assert client.exists("forked:{k}") == 0


# -- several event loops ------------------------------------------------------------

_module_manager: LockManager | None = None


def _manager(redis_url: str) -> LockManager:
    """One manager for the whole module, made outside any loop: what an import-time manager is."""
    global _module_manager
    if _module_manager is None:
        _module_manager = LockManager.from_url(redis_url, namespace="loops", lease=5.0)
    return _module_manager


def _connected(redis_url: str) -> int:
    with redis.Redis.from_url(redis_url) as client:
        return int(client.info("clients")["connected_clients"]) - 1  # not this probe


def _settles(read, expected, bound: float = BOUND) -> bool:
    """Poll a server-side figure until it shows `expected` (the server sees a close a moment later)."""
    deadline = time.monotonic() + bound
    while read() != expected:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_asyncio_run_twice_with_one_manager(redis_url):
    before = _connected(redis_url)
    locks = LockManager.from_url(redis_url, namespace="runs", lease=5.0)

    async def job(n: int) -> int:
        async with locks.lock("job", wait=2) as held:
            assert await locks.redis.hget(held.key, "owner") == held.owner.encode()
            return held.token

    tokens = [asyncio.run(asyncio.wait_for(job(n), BOUND)) for n in range(3)]
    assert tokens == sorted(set(tokens))
    with redis.Redis.from_url(redis_url) as client:
        assert client.exists("runs:{job}") == 0  # nothing left held by a dead loop
    # every loop's connections were closed when its loop shut down
    assert _settles(lambda: _connected(redis_url), before)
    asyncio.run(locks.aclose())


def test_a_loop_that_ends_while_waiting_leaves_no_grant_behind(redis_url):
    """The waiter's loop shuts down mid-wait: the holder's release must not hand the lock to a ghost."""
    locks = LockManager.from_url(redis_url, namespace="ghost", lease=5.0)
    holder = LockManager.from_url(redis_url, namespace="ghost", lease=5.0)

    async def hold_then_wait() -> None:
        held = await holder.acquire("k")
        waiter = asyncio.create_task(locks.acquire("k", wait=30))
        while not await holder.redis.zcard("ghost:{k}:q"):
            await asyncio.sleep(0.005)
        waiter.cancel()  # what asyncio.run does with a task still running at the end
        await asyncio.gather(waiter, return_exceptions=True)
        await held.release()

    asyncio.run(asyncio.wait_for(hold_then_wait(), BOUND))

    async def take_again() -> bool:
        got = await locks.try_lock("k")
        if got is not None:
            await got.release()
        return got is not None

    assert asyncio.run(take_again())
    asyncio.run(locks.aclose())
    asyncio.run(holder.aclose())


async def test_pytest_asyncio_loop_one(redis_url):
    locks = _manager(redis_url)
    async with locks.lock("per-test", wait=2) as held:
        assert held.depth == 1


async def test_pytest_asyncio_loop_two(redis_url):
    """A new loop for this test (pytest-asyncio's function scope), the same manager as the test before."""
    locks = _manager(redis_url)
    async with locks.lock("per-test", wait=2) as held:
        async with locks.lock("per-test") as inner:
            assert inner.depth == 2 and inner.token == held.token


def test_uvloop(redis_url):
    uvloop = pytest.importorskip("uvloop")
    locks = LockManager.from_url(redis_url, namespace="uv", lease=5.0)

    async def job() -> None:
        async with locks.lock("k", wait=2):
            contender = asyncio.create_task(locks.acquire("k", wait=2))
            await asyncio.sleep(0.01)
            assert not contender.done()
        held = await contender
        await held.release()

    for _ in range(2):
        uvloop.run(asyncio.wait_for(job(), BOUND))
    uvloop.run(locks.aclose())


def test_two_loops_in_two_threads_at_once(redis_url):
    """One manager serving two running loops: one holder at a time across them, no reply crosses over."""
    locks = LockManager.from_url(redis_url, namespace="threads", lease=5.0)
    errors: list[BaseException] = []
    tokens: list[int] = []

    async def contend() -> None:
        for _ in range(30):
            async with locks.lock("k", wait=10) as held:
                if await locks.redis.incr("threads:inside") != 1:
                    raise AssertionError("two holders at once")
                tokens.append(held.token)
                await asyncio.sleep(0.001)
                await locks.redis.decr("threads:inside")

    def run() -> None:
        try:
            asyncio.run(asyncio.wait_for(contend(), 60))
        except BaseException as exc:  # reported to the test below
            errors.append(exc)

    threads = [threading.Thread(target=run) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(90)
    assert errors == []
    assert len(tokens) == 60 and len(set(tokens)) == 60
    asyncio.run(locks.aclose())


# -- test clients ---------------------------------------------------------------------


def _shop(locks: LockManager):
    from fastapi import FastAPI

    from otel_lock import LockMiddleware, locked

    app = FastAPI()
    app.add_middleware(LockMiddleware, manager=locks)

    @app.post("/stock/{product_id}/deduct")
    @locked("stock:{path.product_id}", wait=2.0)
    async def deduct(product_id: int) -> dict[str, int]:
        redis = locks.redis
        left = int(await redis.get(f"stock:{product_id}") or 0) - 1
        await redis.set(f"stock:{product_id}", left)
        return {"left": left}

    return app


def test_testclient_without_with_a_new_loop_per_request(redis_url):
    """FastAPI's testing tutorial: a module-level app and manager, `TestClient(app)` without `with`."""
    from fastapi.testclient import TestClient

    locks = LockManager.from_url(redis_url, namespace="tc", lease=5.0)
    client = TestClient(_shop(locks))
    with redis.Redis.from_url(redis_url) as r:
        r.set("stock:7", 10)
    answers = [client.post("/stock/7/deduct") for _ in range(4)]
    assert [a.status_code for a in answers] == [200] * 4
    assert [a.json()["left"] for a in answers] == [9, 8, 7, 6]
    with redis.Redis.from_url(redis_url) as r:
        assert r.exists("tc:{stock:7}") == 0


def test_two_with_testclient_blocks_one_after_the_other(redis_url):
    from fastapi.testclient import TestClient

    locks = LockManager.from_url(redis_url, namespace="tc2", lease=5.0)
    app = _shop(locks)
    with redis.Redis.from_url(redis_url) as r:
        r.set("stock:1", 5)
    for expected in (4, 3):
        with TestClient(app) as client:
            assert client.post("/stock/1/deduct").json() == {"left": expected}


# -- many locks in one task ---------------------------------------------------------------


async def test_thousands_of_locks_held_by_one_task(redis_url):
    """Each acquire and release touches only its own entry (no copy of everything held)."""
    async with LockManager.from_url(redis_url, namespace="many", lease=30.0) as locks:
        held = [await locks.acquire(f"k{i}") for i in range(3000)]
        again = await locks.acquire("k1500")  # still re-entered: the task's own hold
        assert again.depth == 2 and again.token == held[1500].token
        await again.release()
        for hold in reversed(held):
            assert await hold.release()
        assert await locks.held_locks() == []


# -- cancellation ----------------------------------------------------------------------------


async def test_a_cancelled_waiter_behind_a_stalled_reply_returns_well_before_the_socket_timeout(redis_server):
    """The clean-up after a cancelled acquire waits a moment, then goes on in the background."""
    proxy = await TcpProxy("127.0.0.1", redis_server.port).start()
    try:
        async with LockManager.from_url(proxy.url, socket_timeout=60.0, lease=5.0) as locks, \
                LockManager.from_url(redis_server.url, lease=5.0) as other:
            held = await other.acquire("k")
            waiting = asyncio.create_task(locks.acquire("k", wait=30))
            async with redis.asyncio.Redis.from_url(redis_server.url) as r:
                while not await r.zcard("otel-lock:{k}:q"):
                    await asyncio.sleep(0.005)
            proxy.stall_replies()
            waiting.cancel()
            # 60 s socket timeout: a clean-up that waited for the stalled reply would blow this bound
            await asyncio.wait_for(asyncio.gather(waiting, return_exceptions=True), BOUND)
            assert waiting.cancelled()
            proxy.forward()
            await held.release()
    finally:
        await proxy.aclose()


async def test_a_redis_py_option_name_gets_a_message_that_maps_it(redis_url):
    with pytest.raises(TypeError, match="lease="):
        LockManager.from_url(redis_url, timeout=3)
    with pytest.raises(TypeError, match="wait="):
        LockManager.from_url(redis_url, blocking_timeout=3)
    async with LockManager.from_url(redis_url) as locks:
        with pytest.raises(TypeError, match="wait="):
            await locks.acquire("k", blocking_timeout=1)
        with pytest.raises(TypeError, match="lease="):
            locks.lock("k", timeout=1)
