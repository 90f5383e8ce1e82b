"""A `lock()` / `semaphore()` / `lock_all()` context object made once and entered many times.

Written like a `threading.RLock` (`JOB = locks.lock("job")` at module level,
then `with JOB:` in several threads, or nested), one context holds several
holds at once. Each exit must release the hold its own thread or task took:
a single slot released another's hold and left its own renewed for ever.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import redis

from otel_lock import LockManager
from otel_lock.sync import SyncLockManager

NS = "cr"
BOUND = 30.0  # seconds any one step may take on a loaded machine before the test fails


@pytest.fixture
def client(redis_url):
    with redis.Redis.from_url(redis_url) as c:
        yield c


@pytest.fixture
def sync_locks(redis_url):
    with SyncLockManager.from_url(redis_url, namespace=NS, lease=5.0) as locks:
        yield locks


@pytest.fixture
def sync_other(redis_url):
    with SyncLockManager.from_url(redis_url, namespace=NS) as locks:
        yield locks


@pytest.fixture
async def locks(redis_url):
    manager = LockManager.from_url(redis_url, namespace=NS, lease=5.0, wait=BOUND)
    yield manager
    await manager.aclose()


@pytest.fixture
async def other(redis_url):
    manager = LockManager.from_url(redis_url, namespace=NS, wait=0)
    yield manager
    await manager.aclose()


def owner_of(client, key: str) -> str | None:
    owner = client.hget(f"{NS}:{{{key}}}", "owner")
    return None if owner is None else owner.decode()


def permit_holders(client, key: str) -> set[str]:
    return {owner.decode() for owner in client.zrange(f"{NS}:{{{key}}}:permits", 0, -1)}


def still_held(client, *keys: str) -> list[str]:
    """Which of these locks Redis still holds."""
    return [key for key in keys if client.exists(f"{NS}:{{{key}}}")]


def run_threads(target, n: int) -> list[str]:
    """Run `target(i)` in n threads at once; the errors they raised."""
    errors: list[str] = []

    def guarded(i: int) -> None:
        try:
            target(i)
        except BaseException as error:  # noqa: BLE001: reported by the test
            errors.append(f"thread {i}: {type(error).__name__}: {error}")

    threads = [threading.Thread(target=guarded, args=(i,)) for i in range(n)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(BOUND)
        assert not thread.is_alive(), "a thread hung"
    return errors


# -- the blocking facade ----------------------------------------------------------


def test_threads_sharing_a_lock_context_exclude_each_other_and_may_nest_it(sync_locks, client):
    job = sync_locks.lock("job", wait=BOUND)
    inside = []

    def work(i: int) -> None:
        for _ in range(3):
            with job as outer:
                inside.append(i)
                assert len(inside) == 1, f"two threads inside at once: {inside}"
                with job as inner:  # the RLock habit: the same object, entered again
                    assert (inner.depth, inner.token) == (2, outer.token)
                time.sleep(0.005)
                assert owner_of(client, "job") == outer.owner
                inside.remove(i)

    assert run_threads(work, 4) == []
    assert still_held(client, "job") == []  # nothing left held (and renewed) by anyone


def test_a_lock_context_nests_in_one_thread_and_each_exit_releases_its_own_level(sync_locks, client):
    job = sync_locks.lock("job")
    with job as outer:
        with job as middle:
            with job as inner:
                assert (middle.depth, inner.depth) == (2, 3) and inner.token == outer.token
            assert owner_of(client, "job") == outer.owner
        assert owner_of(client, "job") == outer.owner  # the inner exits left the outer hold alone
    assert still_held(client, "job") == []


def test_threads_sharing_a_semaphore_context_each_return_their_own_permit(sync_locks, sync_other, client):
    export = sync_locks.semaphore("export", permits=2, wait=BOUND)
    owners: dict[str, str] = {}
    a_in, b_in, a_go, b_go = (threading.Event() for _ in range(4))

    def worker(name: str, entered: threading.Event, go: threading.Event) -> None:
        with export as held:
            owners[name] = held.owner
            entered.set()
            assert go.wait(BOUND)

    a = threading.Thread(target=worker, args=("A", a_in, a_go))
    b = threading.Thread(target=worker, args=("B", b_in, b_go))
    a.start()
    assert a_in.wait(BOUND)
    b.start()
    assert b_in.wait(BOUND)
    assert permit_holders(client, "export") == {owners["A"], owners["B"]}
    a_go.set()
    a.join(BOUND)
    assert permit_holders(client, "export") == {owners["B"]}  # A gave back A's permit, not B's
    b_go.set()
    b.join(BOUND)
    assert permit_holders(client, "export") == set()
    free = [sync_other.acquire_permit("export", permits=2, wait=0) for _ in range(2)]  # both permits are free
    for held in free:
        held.release()


def test_a_lock_all_context_nests_in_one_thread(sync_locks, client):
    both = sync_locks.lock_all(["a", "b"])
    with both as outer:
        with both as inner:
            assert inner.tokens == outer.tokens
        assert owner_of(client, "a") == outer.holds[0].owner and owner_of(client, "b") == outer.holds[1].owner
    assert still_held(client, "a", "b") == []


def test_a_lock_context_exited_in_another_thread_is_refused_and_releases_nothing(sync_locks, client):
    job = sync_locks.lock("job")
    with job as hold:
        refused: list[BaseException] = []

        def exit_here() -> None:
            try:
                job.__exit__(None, None, None)
            except BaseException as error:  # noqa: BLE001: looked at below
                refused.append(error)

        thread = threading.Thread(target=exit_here)
        thread.start()
        thread.join(BOUND)
        assert len(refused) == 1 and isinstance(refused[0], RuntimeError), refused
        assert "thread that is not inside it" in str(refused[0])
        assert owner_of(client, "job") == hold.owner
    assert still_held(client, "job") == []


# -- the async manager -------------------------------------------------------------


async def test_tasks_sharing_a_lock_context_exclude_each_other_and_may_nest_it(locks, redis_client):
    job = locks.lock("job")
    inside: list[int] = []

    async def work(i: int) -> None:
        for _ in range(3):
            async with job as outer:
                inside.append(i)
                assert len(inside) == 1, f"two tasks inside at once: {inside}"
                async with job as inner:
                    assert (inner.depth, inner.token) == (2, outer.token)
                await asyncio.sleep(0.005)
                assert await redis_client.hget(outer.key, "owner") == outer.owner.encode()
                inside.remove(i)

    async with asyncio.timeout(BOUND):
        await asyncio.gather(*(work(i) for i in range(4)))
    assert await redis_client.exists(f"{NS}:{{job}}") == 0  # nothing left held (and renewed) by anyone


async def test_a_lock_context_nests_in_one_task_and_each_exit_releases_its_own_level(locks, redis_client):
    job = locks.lock("job")
    async with job as outer:
        async with job as inner:
            assert (inner.depth, inner.token) == (2, outer.token)
        assert await redis_client.hget(outer.key, "owner") == outer.owner.encode()
    assert await redis_client.exists(outer.key) == 0


async def test_tasks_sharing_a_semaphore_context_each_return_their_own_permit(locks, other, redis_client):
    export = locks.semaphore("export", permits=2)
    permits = f"{NS}:{{export}}:permits"
    owners: dict[str, str] = {}
    entered = {name: asyncio.Event() for name in "AB"}
    go = {name: asyncio.Event() for name in "AB"}

    async def worker(name: str) -> None:
        async with export as held:
            owners[name] = held.owner
            entered[name].set()
            await go[name].wait()

    async def holders() -> set[str]:
        return {owner.decode() for owner in await redis_client.zrange(permits, 0, -1)}

    async with asyncio.timeout(BOUND):
        a = asyncio.create_task(worker("A"))
        await entered["A"].wait()
        b = asyncio.create_task(worker("B"))
        await entered["B"].wait()
        assert await holders() == {owners["A"], owners["B"]}
        go["A"].set()
        await a
        assert await holders() == {owners["B"]}  # A gave back A's permit, not B's
        go["B"].set()
        await b
        assert await holders() == set()
        free = [await other.acquire_permit("export", permits=2) for _ in range(2)]  # both permits are free
        for held in free:
            await held.release()


async def test_a_lock_context_exited_in_another_task_is_refused_and_releases_nothing(locks, redis_client):
    job = locks.lock("job")
    held = await job.__aenter__()
    with pytest.raises(RuntimeError, match="task that is not inside it"):
        await asyncio.create_task(job.__aexit__(None, None, None))
    assert await redis_client.hget(held.key, "owner") == held.owner.encode()
    await job.__aexit__(None, None, None)
    assert await redis_client.exists(held.key) == 0


async def test_tasks_sharing_a_lock_all_context_exclude_each_other_and_may_nest_it(locks, redis_client):
    both = locks.lock_all(["a", "b"])
    inside: list[int] = []

    async def work(i: int) -> None:
        for _ in range(3):
            async with both as outer:
                inside.append(i)
                assert len(inside) == 1, f"two tasks inside at once: {inside}"
                async with both:
                    pass
                for held in outer.holds:  # the inner exit let go of its own level only
                    assert await redis_client.hget(held.key, "owner") == held.owner.encode()
                inside.remove(i)

    async with asyncio.timeout(BOUND):
        await asyncio.gather(*(work(i) for i in range(3)))
    assert await redis_client.exists(f"{NS}:{{a}}", f"{NS}:{{b}}") == 0  # nothing left held by anyone


async def test_a_lock_all_context_exited_in_another_task_is_refused_and_releases_nothing(locks, redis_client):
    both = locks.lock_all(["a", "b"])
    held = await both.__aenter__()
    with pytest.raises(RuntimeError, match="task that is not inside it"):
        await asyncio.create_task(both.__aexit__(None, None, None))
    assert await redis_client.exists(f"{NS}:{{a}}", f"{NS}:{{b}}") == 2
    await both.__aexit__(None, None, None)
    assert await redis_client.exists(f"{NS}:{{a}}", f"{NS}:{{b}}") == 0
    assert held.holds
