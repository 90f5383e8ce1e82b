"""The blocking facade's permits and shared holds: the same shapes from plain threads."""

from __future__ import annotations

import threading

import pytest
import redis

from otel_lock import LockError, LockTimeout
from otel_lock.sync import SyncLockManager


@pytest.fixture
def sync_locks(redis_url):
    with SyncLockManager.from_url(redis_url, namespace="ts", wait=5.0) as locks:
        yield locks


@pytest.fixture
def client(redis_url):
    with redis.Redis.from_url(redis_url) as c:
        yield c


def test_sync_semaphore_lets_in_permits_threads_and_no_more(sync_locks, client):
    inside = threading.Barrier(3, timeout=10)  # both holders and this test
    release = threading.Event()
    failures: list[BaseException] = []

    def hold() -> None:
        try:
            with sync_locks.semaphore("export", permits=2) as held:
                assert held.permits == 2 and held.mode == "permit"
                inside.wait()
                release.wait(10)
        except BaseException as exc:  # told to the test below
            failures.append(exc)

    threads = [threading.Thread(target=hold) for _ in range(2)]
    for thread in threads:
        thread.start()
    try:
        inside.wait()
        inside_now = client.zcard("ts:{export}:permits")
        with pytest.raises(LockTimeout):
            sync_locks.acquire_permit("export", permits=2, wait=0)
    finally:
        release.set()
        for thread in threads:
            thread.join(10)
    assert inside_now == 2 and not failures


def test_sync_semaphore_in_one_thread_takes_a_permit_per_call(sync_locks):
    with sync_locks.semaphore("export", permits=2) as one, sync_locks.semaphore("export", permits=2) as two:
        assert one.owner != two.owner
        with pytest.raises(LockTimeout):
            sync_locks.acquire_permit("export", permits=2, wait=0)
    with sync_locks.semaphore("export", permits=2):
        pass


def test_sync_shared_holds_nest_and_refuse_an_exclusive_inside(sync_locks, redis_url):
    with SyncLockManager.from_url(redis_url, namespace="ts") as other:
        with sync_locks.lock("cat", shared=True) as outer:
            assert outer.mode == "shared"
            with sync_locks.lock("cat", shared=True) as inner:
                assert inner.depth == 2
            reader = other.try_lock("cat", shared=True)
            assert reader is not None and reader.release() is True
            assert other.try_lock("cat") is None
            with pytest.raises(LockError, match="held shared by this thread"):
                sync_locks.acquire("cat")
