"""The blocking wrapper, driven from plain threads."""

from __future__ import annotations

import threading

import pytest
import redis

from otel_lock import LockTimeout
from otel_lock.sync import SyncLockManager


@pytest.fixture
def sync_locks(redis_url):
    with SyncLockManager.from_url(redis_url, namespace="s") as locks:
        yield locks


def test_sync_lock_holds_and_releases(sync_locks, redis_url):
    client = redis.Redis.from_url(redis_url)
    with sync_locks.lock("job:cleanup") as held:
        assert client.hget(held.key, "owner") == held.owner.encode()
        assert held.depth == 1 and held.token > 0
    assert client.exists("s:{job:cleanup}") == 0
    client.close()


def test_sync_reentrancy_is_per_thread(sync_locks):
    with sync_locks.lock("k") as outer:
        with sync_locks.lock("k") as inner:
            assert inner.depth == 2 and inner.token == outer.token
        result = []
        thread = threading.Thread(target=lambda: result.append(sync_locks.try_lock("k")))
        thread.start()
        thread.join()
        assert result == [None]


def test_sync_threads_exclude_each_other(sync_locks, redis_url):
    client = redis.Redis.from_url(redis_url)
    client.set("counter", 0)

    def work():
        for _ in range(25):
            with sync_locks.lock("counter", wait=30):
                value = int(client.get("counter"))
                threading.Event().wait(0.0005)  # widen the race window
                client.set("counter", value + 1)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert int(client.get("counter")) == 100
    client.close()


def test_sync_timeout_and_try_lock(sync_locks, redis_url):
    with SyncLockManager.from_url(redis_url, namespace="s") as other:
        with sync_locks.lock("k"):
            assert other.try_lock("k") is None
            with pytest.raises(LockTimeout):
                other.acquire("k", wait=0.1)
        held = other.try_lock("k")
        assert held is not None and held.release() is True


def test_sync_lost_lease_is_visible(redis_url):
    client = redis.Redis.from_url(redis_url)
    with SyncLockManager.from_url(redis_url, namespace="s", lease=0.3) as locks:
        held = locks.acquire("k")
        client.hset(held.key, "owner", "thief")
        assert held.lost.wait(10)
        assert held.release() is False
    client.close()


def test_sync_bad_input_raises_value_error(sync_locks):
    with pytest.raises(ValueError, match="non-empty"):
        sync_locks.acquire("")
    with pytest.raises(ValueError, match="unknown Redis URL scheme"):
        SyncLockManager.from_url("mysql://localhost")
