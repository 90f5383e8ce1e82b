"""`SyncLockManager.lock_all`: the blocking facade takes several keys as the async manager does."""

from __future__ import annotations

import threading
import time

import pytest
import redis

from otel_lock import LockBusy, LockLost, LockTimeout
from otel_lock.sync import SyncHeldLocks, SyncLockManager

NS = "s"


@pytest.fixture
def client(redis_url):
    with redis.Redis.from_url(redis_url) as c:
        yield c


@pytest.fixture
def sync_locks(redis_url):
    with SyncLockManager.from_url(redis_url, namespace=NS) as locks:
        yield locks


@pytest.fixture
def other(redis_url):
    with SyncLockManager.from_url(redis_url, namespace=NS) as locks:
        yield locks


def held(client) -> list[bytes]:
    return sorted(k for k in client.keys(f"{NS}:{{*}}") if b"}:" not in k)


def test_sync_lock_all_holds_every_key_and_releases_them(sync_locks, client):
    with sync_locks.lock_all(["account:7", "account:3"], wait=5.0) as locked:
        assert isinstance(locked, SyncHeldLocks)
        assert locked.keys == ("account:3", "account:7")
        assert held(client) == [b"s:{account:3}", b"s:{account:7}"]
        assert locked.tokens == {"account:3": locked.holds[0].token, "account:7": locked.holds[1].token}
        assert not locked.lost.is_set()
    assert held(client) == []


def test_sync_lock_all_is_all_or_nothing(sync_locks, other, client):
    with other.lock("b"):
        with pytest.raises(LockTimeout) as caught:
            sync_locks.acquire_all(["c", "b", "a"], wait=0.2)
        assert caught.value.key == "s:{b}"
        with pytest.raises(LockBusy):
            sync_locks.acquire_all(["a", "b"], wait=0)
        assert held(client) == [b"s:{b}"]


def test_sync_lock_all_re_enters_what_the_thread_holds(sync_locks, client):
    with sync_locks.lock("a") as outer:
        with sync_locks.lock_all(["b", "a"]) as locked:
            assert locked.holds[0].depth == 2 and locked.holds[0].token == outer.token
        assert held(client) == [b"s:{a}"]
        assert outer._hold.also_lost == []
    assert held(client) == []


def test_sync_opposite_orders_in_two_threads_never_time_out(sync_locks, other):
    errors: list[BaseException] = []

    def transfer(locks, keys):
        try:
            for _ in range(30):
                with locks.lock_all(keys, wait=10.0):
                    pass
        except BaseException as exc:  # noqa: BLE001  (reported below)
            errors.append(exc)

    threads = [threading.Thread(target=transfer, args=(sync_locks, ["x", "y"])),
               threading.Thread(target=transfer, args=(other, ["y", "x"]))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert errors == []


def test_sync_lock_all_tells_a_lost_lease(redis_url, client):
    with SyncLockManager.from_url(redis_url, namespace=NS, lease=0.3) as locks:
        with pytest.raises(LockLost):
            with locks.lock_all(["a", "b"], cancel_on_lost=True) as locked:
                client.hset("s:{b}", "owner", "thief")
                assert locked.lost.wait(10)
        assert held(client) == [b"s:{b}"]


@pytest.mark.parametrize("first", ["lock", "permit"])
def test_crossed_waits_of_two_threads_are_refused_to_the_second(sync_locks, other, client, first):
    """Thread A holds k1 (a lock, or the one permit of a semaphore) and waits for k2, which we hold;
    our wait for k1 closes the cycle and is refused; A then goes on."""
    from otel_lock import LockDeadlock

    a_holds = threading.Event()
    outcome: dict[str, object] = {}
    take_k1 = ((lambda locks: locks.lock("k1")) if first == "lock"
               else (lambda locks: locks.semaphore("k1", permits=1)))

    def a():
        with take_k1(sync_locks):
            a_holds.set()
            try:
                with sync_locks.lock("k2", wait=60.0) as then:
                    outcome["a"] = then.token
            except Exception as exc:  # noqa: BLE001  (the outcome under test)
                outcome["a"] = exc

    with other.lock("k2"):
        thread = threading.Thread(target=a, name="transfer-a")
        thread.start()
        assert a_holds.wait(20)
        give_up = time.monotonic() + 20
        # A is queued on k2 and has recorded what it waits for (it does so once it has waited a moment):
        # from then on the cycle is A's record plus ours, and the closer is us.
        while client.zcard("s:{k2}:q") != 1 or not client.keys("s:waits:*"):
            assert time.monotonic() < give_up and thread.is_alive()
            time.sleep(0.005)
        with pytest.raises(LockDeadlock) as caught:
            if first == "lock":
                other.acquire("k1", wait=60.0)
            else:
                other.acquire_permit("k1", permits=1, wait=60.0)
        assert [step[0] for step in caught.value.cycle] == ["s:{k1}" + ("" if first == "lock" else ":permits"),
                                                            "s:{k2}"]
        assert caught.value.cycle[0][2].startswith("transfer-a#")
    thread.join(20)
    assert isinstance(outcome["a"], int)


def test_the_blocking_facade_says_which_shapes_it_refuses(sync_locks, redis_url):
    """As the async manager: for a start-up check, without a round trip."""
    assert [sync_locks.unsupported_reason(m) for m in ("exclusive", "shared", "permit")] == [None, None, None]
    with SyncLockManager.from_url(redis_url, namespace=NS, wait_replicas=1) as replicated:
        assert replicated.unsupported_reason("exclusive") is None
        assert "wait_replicas" in (replicated.unsupported_reason("shared") or "")
    with pytest.raises(ValueError, match="mode must be one of exclusive, shared, permit"):
        sync_locks.unsupported_reason("reader")
