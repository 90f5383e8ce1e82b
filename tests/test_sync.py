"""The blocking facade, driven from plain threads, forked children and interrupted waits."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import multiprocessing
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
import traceback
import typing
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import pytest
import redis
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from otel_lock import LockError, LockLost, LockManager, LockTimeout, RedisMisconfigured, RedLockManager
from otel_lock import sync as sync_module
from otel_lock.cli._redis_server import RedisServer, free_port, stop_process, stop_servers
from otel_lock.sync import RunningLoopError, SyncHeldLock, SyncLockManager

ROOT = Path(__file__).resolve().parents[1]
BOUND = 30.0  # seconds any one step may take on a loaded machine before the test fails
# Every warning an error in the child too, but for opentelemetry-api 1.42's own use of
# importlib.metadata on Python 3.11 (the lowest-versions pass pins it; fixed in 1.43).
STRICT_WARNINGS = ("-W", "error", "-W", "ignore:SelectableGroups dict interface is deprecated:DeprecationWarning")

NS = "s"

# Python 3.12+ warns when a process with threads forks; forking one is the subject here.
forks = pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")


def until(predicate, what: str, timeout: float = BOUND) -> None:
    """Poll Redis (or other) state until `predicate()` holds; fail instead of hanging."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.005)


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
    """A second client (another manager, another owner), as another process would be."""
    with SyncLockManager.from_url(redis_url, namespace=NS) as locks:
        yield locks


def owner_of(client, key: str) -> str | None:
    owner = client.hget(f"{NS}:{{{key}}}", "owner")
    return None if owner is None else owner.decode()


def queued(client, key: str) -> int:
    return client.zcard(f"{NS}:{{{key}}}:q")


# -- the basics -----------------------------------------------------------------


def test_sync_lock_holds_and_releases(sync_locks, client):
    with sync_locks.lock("job:cleanup") as held:
        assert isinstance(held, SyncHeldLock)
        assert client.hget(held.key, "owner") == held.owner.encode()
        assert held.depth == 1 and held.token > 0 and held.name == "job"
    assert client.exists(f"{NS}:{{job:cleanup}}") == 0
    assert sync_locks.namespace == NS


def test_sync_reentrancy_is_per_thread(sync_locks):
    with sync_locks.lock("k") as outer:
        with sync_locks.lock("k") as inner:
            assert inner.depth == 2 and inner.token == outer.token and inner.owner == outer.owner
            again = sync_locks.try_lock("k")  # try_lock re-enters too
            assert again is not None and again.depth == 3
            assert again.release() is True
        result = []
        thread = threading.Thread(target=lambda: result.append(sync_locks.try_lock("k")))
        thread.start()
        thread.join()
        assert result == [None]


def test_only_the_last_release_of_a_thread_reaches_redis_in_any_order(sync_locks, client):
    outer = sync_locks.acquire("k")
    inner = sync_locks.acquire("k")
    assert outer.release() is True  # out of order, as threading.RLock allows
    assert owner_of(client, "k") == outer.owner
    assert outer.release() is True  # idempotent: the same hold is not counted twice
    assert owner_of(client, "k") == outer.owner
    assert inner.release() is True
    assert owner_of(client, "k") is None
    fresh = sync_locks.acquire("k")  # nothing of the old hold is left in this thread
    assert fresh.depth == 1 and fresh.token > outer.token
    fresh.release()


def test_sync_threads_exclude_each_other_and_each_re_enters_its_own(sync_locks, client):
    client.set("counter", 0)
    inside, errors = [], []

    def work():
        try:
            for _ in range(15):
                with sync_locks.lock("counter", wait=BOUND) as outer:
                    inside.append(1)
                    assert len(inside) == 1, "two threads inside at once"
                    with sync_locks.lock("counter") as inner:  # this thread's own re-entry
                        assert inner.depth == 2 and inner.token == outer.token
                        value = int(client.get("counter"))
                        client.set("counter", value + 1)
                    inside.pop()
        except BaseException as error:  # reported below, in the test's thread
            errors.append(error)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(BOUND * 2)
    assert errors == []
    assert int(client.get("counter")) == 60


def test_a_hold_released_from_another_thread_is_gone_from_its_own(sync_locks, client):
    got = []
    taken, released = threading.Event(), threading.Event()

    def holder():
        got.append(sync_locks.acquire("k"))
        taken.set()
        released.wait(BOUND)
        again = sync_locks.acquire("k", wait=BOUND)  # not a re-entry of the released hold
        got.append(again)
        again.release()

    thread = threading.Thread(target=holder)
    thread.start()
    assert taken.wait(BOUND)
    assert got[0].release() is True
    assert owner_of(client, "k") is None
    released.set()
    thread.join(BOUND)
    assert got[1].depth == 1 and got[1].token > got[0].token


def test_sync_timeout_and_try_lock(sync_locks, other):
    with sync_locks.lock("k"):
        assert other.try_lock("k") is None
        with pytest.raises(LockTimeout):
            other.acquire("k", wait=0.1)
    held = other.try_lock("k")
    assert held is not None and held.release() is True


def test_sync_lost_lease_is_visible_and_release_says_so(redis_url, client):
    with SyncLockManager.from_url(redis_url, namespace=NS, lease=0.3) as locks:
        held = locks.acquire("k")
        client.hset(held.key, "owner", "thief")
        assert held.lost.wait(BOUND)
        assert held.lost.is_set()
        assert held.release() is False


def test_a_nested_acquire_of_a_lost_lease_raises_lock_lost(redis_url, client):
    with SyncLockManager.from_url(redis_url, namespace=NS, lease=0.6) as locks:
        with locks.lock("k") as outer:
            client.hset(outer.key, "owner", "someone-else")  # taken over behind the holder's back
            assert outer.lost.wait(BOUND)  # the next renewal tells
            with pytest.raises(LockLost):
                locks.acquire("k")
            with pytest.raises(LockLost):
                locks.try_lock("k")
        assert owner_of(client, "k") == "someone-else"  # never released from under the new holder


@pytest.mark.parametrize("taken_over", ["deleted", "force-released"])
def test_a_nested_acquire_asks_redis_and_raises_lock_lost_for_a_lease_gone_there(redis_url, client, other,
                                                                                taken_over):
    """Regression: the facade re-entered a lease lost in Redis (taken and released by another client since)
    locally, at depth 2, where the async manager asks Redis and raises LockLost."""
    with SyncLockManager.from_url(redis_url, namespace=NS, lease=60) as locks:  # no renewal before the re-entry
        with locks.lock("k") as outer:
            if taken_over == "deleted":
                client.delete(outer.key)  # a FLUSH, a restart without persistence, an eviction
            else:
                assert other.force_release("k") is True  # an operator's `otel-lock unlock`
            with other.lock("k", wait=BOUND) as theirs:  # another client takes it and lets it go
                assert theirs.token > outer.token
            assert owner_of(client, "k") is None
            with pytest.raises(LockLost, match="re-entered"):
                with locks.lock("k"):
                    pytest.fail("re-entered a lease that Redis no longer has")
            assert outer.lost.is_set()  # the outer hold is told too, as in the async manager
            with pytest.raises(LockLost):
                locks.try_lock("k")
        assert owner_of(client, "k") is None  # nothing was taken afresh under the old hold
        with locks.lock("k") as fresh:  # the thread's map is clean: a fresh hold
            assert fresh.depth == 1 and fresh.token > outer.token


def test_a_nested_hold_is_counted_in_redis_as_the_async_managers_is(sync_locks, client):
    with sync_locks.lock("k") as outer:
        with sync_locks.lock("k") as inner:
            assert inner.depth == 2 and int(client.hget(outer.key, "depth")) == 2
        assert int(client.hget(outer.key, "depth")) == 1 and owner_of(client, "k") == outer.owner
    assert owner_of(client, "k") is None


@pytest.mark.parametrize("where", ["manager default", "per lock"])
def test_cancel_on_lost_raises_lock_lost_as_the_with_block_ends(redis_url, client, where):
    manager_default, per_lock = (True, None) if where == "manager default" else (False, True)
    with SyncLockManager.from_url(redis_url, namespace=NS, lease=0.6, cancel_on_lost=manager_default) as locks:
        with pytest.raises(LockLost) as raised:
            with locks.lock("k", cancel_on_lost=per_lock) as held:
                client.hset(held.key, "owner", "thief")
                assert held.lost.wait(BOUND)  # a thread cannot be cancelled: the block runs on
        assert raised.value.key == held.key
        with locks.lock("k2"):  # no loss, no error
            pass


def test_without_cancel_on_lost_a_lost_block_ends_quietly(redis_url, client):
    with SyncLockManager.from_url(redis_url, namespace=NS, lease=0.6) as locks:
        with locks.lock("k") as held:
            client.hset(held.key, "owner", "thief")
            assert held.lost.wait(BOUND)
        assert owner_of(client, "k") == "thief"


def test_sync_bad_input_raises_value_error(sync_locks):
    with pytest.raises(ValueError, match="non-empty"):
        sync_locks.acquire("")
    with pytest.raises(ValueError, match="unknown Redis URL scheme"):
        SyncLockManager.from_url("mysql://localhost")
    with pytest.raises(ValueError, match="lease"):
        SyncLockManager.from_url("redis://127.0.0.1:1", lease=-1)


@pytest.mark.parametrize("call", [
    lambda s, key: s.lock(key).__enter__(),
    lambda s, key: s.acquire(key),
    lambda s, key: s.try_lock(key),
    lambda s, key: s.semaphore(key, permits=2).__enter__(),
    lambda s, key: s.acquire_permit(key, permits=2),
    lambda s, key: s.force_release(key),
], ids=["lock", "acquire", "try_lock", "semaphore", "acquire_permit", "force_release"])
@pytest.mark.parametrize("key", [["job"], {"job": 1}, None, 7], ids=["list", "dict", "None", "int"])
def test_a_key_that_is_no_string_is_the_async_api_s_value_error(sync_locks, call, key):
    # An unhashable key used to reach the thread's holds first: a bare "TypeError: unhashable type".
    # (lock_all's keys are a TypeError that names them, in async code too.)
    with pytest.raises(ValueError, match="lock key must be a non-empty string"):
        call(sync_locks, key)


@pytest.mark.parametrize("call", [
    lambda s: s.acquire("k", cancel_on_lost="false"),
    lambda s: s.try_lock("k", cancel_on_lost=0),
    lambda s: s.acquire_permit("p", permits=2, cancel_on_lost="no"),
    lambda s: s.acquire_all(["k", "j"], cancel_on_lost="no"),
    lambda s: s.acquire("k", shared="yes"),
], ids=["acquire", "try_lock", "acquire_permit", "acquire_all", "shared"])
def test_a_flag_that_is_not_true_or_false_is_refused_even_when_nested(sync_locks, client, call):
    """Regression: the facade read `cancel_on_lost="false"` for its truth (true), and a nested call never looked."""
    with pytest.raises(TypeError, match="must be True or False"):
        call(sync_locks)
    assert client.keys("*") == []   # nothing taken
    with sync_locks.lock("k"):
        with pytest.raises(TypeError, match="must be True or False"):
            call(sync_locks)
    with pytest.raises(TypeError, match="cancel_on_lost must be True or False"):
        SyncLockManager.from_url("redis://127.0.0.1:1/0", cancel_on_lost="false")


def test_options_are_explicit_keywords(sync_locks, redis_url):
    with pytest.raises(TypeError, match="wiat"):
        sync_locks.lock("k", wiat=1.0)
    with pytest.raises(TypeError, match="wait"):
        sync_locks.try_lock("k", wait=1.0)
    with pytest.raises(TypeError, match="lease_seconds"):
        SyncLockManager.from_url(redis_url, lease_seconds=1.0)
    with pytest.raises(TypeError, match="from_url"):
        SyncLockManager(redis_url)
    with pytest.raises(TypeError, match="lock manager"):
        SyncLockManager(lambda: "not a manager")
    with pytest.raises(TypeError, match="repeat"):
        SyncLockManager.from_url(redis_url, socket_timeout=1.0, redis_options={"socket_timeout": 2.0})


def test_from_url_passes_manager_and_redis_options(redis_url, client):
    with SyncLockManager.from_url(redis_url, namespace="opts", lease=7.0) as locks:
        with locks.lock("k") as held:
            assert held.key == "opts:{k}"
            assert 0 < client.pttl(held.key) <= 7000
        with locks.lock("fixed", lease=0.5) as held:
            assert 0 < client.pttl(held.key) <= 500
    # Any other redis-py option goes through `redis_options`: here a password this server does not have.
    with SyncLockManager.from_url(redis_url, namespace="opts", redis_options={"password": "nope"}) as locks:
        with pytest.raises(LockError, match="(?i)auth|password"):
            locks.acquire("k")


def test_a_factory_gives_any_manager(redis_url, client):
    with SyncLockManager(lambda: LockManager.from_url(redis_url, namespace="f")) as locks:
        with locks.lock("k") as held:
            assert held.key == "f:{k}" and owner_of(client, "k") is None
            assert client.hget("f:{k}", "owner") == held.owner.encode()


# -- close, with, the process ---------------------------------------------------


def test_close_is_idempotent_and_later_calls_say_closed(redis_url):
    locks = SyncLockManager.from_url(redis_url, namespace=NS)
    held = locks.acquire("k")
    locks.close()
    locks.close()
    with pytest.raises(RuntimeError, match="closed"):
        locks.acquire("k")
    with pytest.raises(RuntimeError, match="closed"):
        locks.held_locks()
    assert held.release() is False  # the manager is gone: the lease expires by itself


def test_close_wakes_a_thread_that_waits(sync_locks, redis_url):
    locks = SyncLockManager.from_url(redis_url, namespace=NS)
    errors = []
    with sync_locks.lock("k"):
        def wait():
            try:
                locks.acquire("k", wait=BOUND)
            except BaseException as error:
                errors.append(error)

        thread = threading.Thread(target=wait)
        thread.start()
        with redis.Redis.from_url(redis_url) as client:
            until(lambda: queued(client, "k") == 1, "the waiter queued")
        locks.close()
        thread.join(BOUND)
    assert not thread.is_alive()
    assert len(errors) == 1 and isinstance(errors[0], RuntimeError) and "closed" in str(errors[0])


def test_the_loop_thread_does_not_keep_the_process_alive(redis_url):
    # A script that forgets close(), and even its release: it ends, cleanly, when its code ends.
    script = textwrap.dedent(f"""
        from otel_lock.sync import SyncLockManager
        locks = SyncLockManager.from_url({redis_url!r}, namespace={NS!r}, lease=5.0)
        held = locks.acquire("forgotten")
        print(held.owner, flush=True)
    """)
    result = subprocess.run([sys.executable, *STRICT_WARNINGS, "-c", script], capture_output=True, text=True,
                            timeout=BOUND, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    with redis.Redis.from_url(redis_url) as client:
        assert owner_of(client, "forgotten") == result.stdout.strip()
        assert client.pttl(f"{NS}:{{forgotten}}") <= 5000  # no renewal outlives the process


# -- refused inside a running event loop ----------------------------------------


@pytest.mark.parametrize("call", [
    lambda s: s.lock("k").__enter__(),
    lambda s: s.acquire("k", wait=BOUND),
    lambda s: s.try_lock("k"),
    lambda s: s.held_locks(),
    lambda s: s.force_release("k"),
], ids=["lock", "acquire", "try_lock", "held_locks", "force_release"])
def test_a_call_from_a_running_event_loop_is_refused_at_once(sync_locks, other, client, call):
    with other.lock("k") as held:  # busy: a blocking call would stall the loop for its whole wait
        async def inside_a_loop():
            with pytest.raises(RunningLoopError, match=r"use the async API instead: `.*LockManager"):
                call(sync_locks)

        asyncio.run(asyncio.wait_for(inside_a_loop(), BOUND))
        assert owner_of(client, "k") == held.owner and queued(client, "k") == 0
    assert issubclass(RunningLoopError, RuntimeError)


REFUSED = {  # every SyncLockManager call that refuses to block a running loop
    "lock": lambda s: s.lock("k"),
    "semaphore": lambda s: s.semaphore("p", permits=2),
    "lock_all": lambda s: s.lock_all(["k", "j"]),
    "acquire": lambda s: s.acquire("k"),
    "try_lock": lambda s: s.try_lock("k"),
    "acquire_permit": lambda s: s.acquire_permit("p", permits=2),
    "acquire_all": lambda s: s.acquire_all(["k", "j"]),
    "held_locks": lambda s: s.held_locks(),
    "force_release": lambda s: s.force_release("k"),
    "check_servers": lambda s: s.check_servers(),
}


def test_every_refusing_call_is_in_the_table_below():
    refusing = set(re.findall(r'_refuse_in_loop\("(\w+)"\)', inspect.getsource(sync_module)))
    assert refusing == set(REFUSED)


@pytest.mark.parametrize("name", REFUSED)
def test_a_refused_call_names_its_async_equivalent_as_it_is_called(sync_locks, name):
    async def inside_a_loop() -> str:
        with pytest.raises(RunningLoopError) as refused:
            REFUSED[name](sync_locks)
        return str(refused.value)

    message = asyncio.run(asyncio.wait_for(inside_a_loop(), BOUND))
    advice = re.findall(r"`(async with|await) locks\.(\w+)\(", message)
    assert [api for _, api in advice] == [name], message  # its own name, and no other advice
    how, api = advice[0]
    method = getattr(LockManager, api)
    if how == "await":  # a coroutine function: `await locks.lock(...)` would be a TypeError
        assert inspect.iscoroutinefunction(method), message
    else:  # returns an async context manager
        assert not inspect.iscoroutinefunction(method)
        assert hasattr(typing.get_type_hints(method)["return"], "__aenter__"), message


# -- interrupted waits ------------------------------------------------------------


class Interrupted(Exception):
    """What a SIGALRM-based timeout (or a soft time limit) raises in the waiting thread."""


def _raise_interrupted(signum, frame):
    raise Interrupted


@contextmanager
def handler(signum, function):
    previous = signal.signal(signum, function)
    try:
        yield
    finally:
        signal.signal(signum, previous)


def signal_when(predicate, what: str, signum: int, directed: bool) -> threading.Thread:
    """From a helper thread: once `predicate()` holds, signal the main thread, which is waiting.

    `directed`: pthread_kill to the main thread; else kill() to the process,
    as alarm() and Ctrl-C do (the helper blocks signals, like the facade's own
    loop thread, so the kernel gives it to the main thread).
    """
    def run():
        signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())
        until(predicate, what)
        if directed:
            signal.pthread_kill(threading.main_thread().ident, signum)
        else:
            os.kill(os.getpid(), signum)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


INTERRUPTS = [
    pytest.param(signal.SIGALRM, _raise_interrupted, Interrupted, True, id="SIGALRM-handler-raises"),
    pytest.param(signal.SIGUSR1, _raise_interrupted, Interrupted, False, id="soft-time-limit-to-the-process"),
    pytest.param(signal.SIGINT, signal.default_int_handler, KeyboardInterrupt, False, id="ctrl-c"),
]


def _points(reader: InMemoryMetricReader, name: str) -> list[tuple[dict, object]]:
    data = reader.get_metrics_data()
    return [(dict(p.attributes), getattr(p, "value", None)) for r in (data.resource_metrics if data else [])
            for s in r.scope_metrics for m in s.metrics if m.name == name for p in m.data.data_points]


@pytest.fixture
def watched(redis_url):
    """A facade whose manager's metrics can be read: what it waited for, held, renewed."""
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    with SyncLockManager.from_url(redis_url, namespace=NS, lease=0.6, meter_provider=provider) as locks:
        yield locks, reader
    provider.shutdown()


@pytest.mark.parametrize("form", ["acquire", "with lock"])
@pytest.mark.parametrize("signum, function, raised, directed", INTERRUPTS)
def test_an_interrupted_wait_is_cancelled_and_the_next_real_waiter_gets_the_lock(
        watched, other, redis_url, client, signum, function, raised, directed, form):
    locks, reader = watched
    holder = other.acquire("k")
    signal_when(lambda: queued(client, "k") == 1, "the waiter queued", signum, directed)
    with handler(signum, function), pytest.raises(raised):
        if form == "acquire":
            locks.acquire("k", wait=BOUND)
        else:
            with locks.lock("k", wait=BOUND):
                pytest.fail("the interrupted waiter ran its block")
    until(lambda: queued(client, "k") == 0, "the cancelled waiter left the queue")

    with SyncLockManager.from_url(redis_url, namespace=NS) as third:
        got = []
        waiter = threading.Thread(target=lambda: got.append(third.acquire("k", wait=BOUND)))
        waiter.start()
        until(lambda: queued(client, "k") == 1, "the next real waiter queued")
        assert holder.release() is True
        waiter.join(BOUND)
        assert owner_of(client, "k") == got[0].owner  # handed to the real waiter, not the interrupted one
        assert got[0].release() is True
    waits = [attrs["lock.outcome"] for attrs, _ in _points(reader, "otel_lock.wait.duration")]
    assert waits == ["cancelled"]
    # (the renewal outcomes exist, seeded at 0 before their first event)
    assert _points(reader, "otel_lock.hold.duration") == [] and [v for _, v in _points(reader, "otel_lock.renewals") if v] == []
    again = locks.acquire("k")  # this thread holds nothing it could re-enter
    assert again.depth == 1 and owner_of(client, "k") == again.owner
    again.release()


@pytest.mark.parametrize("signum, function, raised, directed", INTERRUPTS)
def test_a_lock_granted_while_the_waiter_is_interrupted_is_released(
        watched, other, client, signum, function, raised, directed):
    locks, reader = watched
    holder = other.acquire("k")

    def hand_over_then(signum_, frame):
        # The holder lets go while the interrupt is on its way: Redis hands the lock
        # to the waiting thread, which will never see it.
        assert holder.release() is True
        until(lambda: owner_of(client, "k") not in (None, holder.owner), "the lock was handed to the waiter")
        function(signum_, frame)

    signal_when(lambda: queued(client, "k") == 1, "the waiter queued", signum, directed)
    with handler(signum, hand_over_then), pytest.raises(raised):
        locks.acquire("k", wait=BOUND)
    until(lambda: owner_of(client, "k") is None, "the abandoned grant was released")
    # Cancelled before the grant reached the manager, or granted and then released: either way
    # nothing is held (so nothing renewed) and no thread of this process can re-enter it.
    outcomes = {a["lock.outcome"] for a, _ in _points(reader, "otel_lock.wait.duration")}
    assert len(outcomes) == 1 and outcomes <= {"acquired", "cancelled"}
    if outcomes == {"acquired"}:
        until(lambda: "released" in [a.get("lock.release.outcome") for a, _ in
                                     _points(reader, "otel_lock.hold.duration")], "the hold ended as released")
    assert sum(v for _, v in _points(reader, "otel_lock.active")) == 0
    mine = locks.acquire("k")  # not a re-entry of the abandoned hold: a fresh one
    assert mine.depth == 1 and owner_of(client, "k") == mine.owner
    mine.release()


def test_an_interrupted_release_still_completes_and_counts_once(sync_locks, client):
    outer = sync_locks.acquire("k")
    inner = sync_locks.acquire("k")
    assert inner.release() is True  # nested: one level less in Redis, the lock still held
    assert owner_of(client, "k") == outer.owner
    client.execute_command("CLIENT", "PAUSE", int(BOUND * 1000), "WRITE")  # the release will wait on Redis
    try:
        signal_when(lambda: client.info("clients")["blocked_clients"] == 1, "the release to wait on Redis",
                    signal.SIGALRM, True)
        with handler(signal.SIGALRM, _raise_interrupted), pytest.raises(Interrupted):
            outer.release()
    finally:
        client.execute_command("CLIENT", "UNPAUSE")
    until(lambda: owner_of(client, "k") is None, "the interrupted release to complete")
    assert outer.release() is True  # asked again: the same release, not a second count
    assert inner.release() is True
    fresh = sync_locks.acquire("k")
    assert fresh.depth == 1
    fresh.release()


def _scripts_run(client) -> int:
    stats = client.info("commandstats")
    return sum(stats.get(f"cmdstat_{name}", {}).get("calls", 0) for name in ("evalsha", "eval"))


def test_an_interrupted_re_entry_is_undone_in_redis_and_in_the_thread(redis_url, client):
    with SyncLockManager.from_url(redis_url, namespace=NS, lease=60) as locks:  # no renewal meanwhile
        assert locks.acquire("warm-up").release() is True  # every script loaded: one call each from here
        outer = locks.acquire("k")
        client.execute_command("CLIENT", "PAUSE", int(BOUND * 1000), "WRITE")  # the re-entry will wait on Redis
        try:
            signal_when(lambda: client.info("clients")["blocked_clients"] == 1, "the re-entry to wait on Redis",
                        signal.SIGALRM, True)
            with handler(signal.SIGALRM, _raise_interrupted), pytest.raises(Interrupted):
                locks.acquire("k")
            before = _scripts_run(client)
        finally:
            client.execute_command("CLIENT", "UNPAUSE")
        # the re-entry lands once Redis runs it, and is taken back (one level) as the async manager does
        until(lambda: _scripts_run(client) >= before + 2, "the abandoned re-entry to run and be taken back")
        assert int(client.hget(outer.key, "depth")) == 1
        inner = locks.acquire("k")  # the thread counts the outer hold alone: this is depth 2, not 3
        assert inner.depth == 2 and int(client.hget(outer.key, "depth")) == 2
        assert inner.release() is True and outer.release() is True
        assert owner_of(client, "k") is None  # nothing left held by the interrupted re-entry


# -- fork -----------------------------------------------------------------------


def _take_turns(locks: SyncLockManager, url: str, key: str, rounds: int, masters: list[str] | None = None) -> None:
    """Take and release `key` `rounds` times, checking in Redis that no one else holds it meanwhile.

    `masters`: a RedLock quorum, where a majority of them must name the holder.
    """
    with redis.Redis.from_url(url) as c:
        checks = [redis.Redis.from_url(m) for m in masters] if masters else [c]
        try:
            for _ in range(rounds):
                with locks.lock(key, wait=BOUND) as held:
                    assert c.incr("inside") == 1, "two holders at once"
                    named = sum(m.hget(held.key, "owner") == held.owner.encode() for m in checks)
                    assert named > len(checks) // 2, "Redis says someone else holds it"
                    c.rpush("owners", held.owner)
                    assert c.decr("inside") == 0
        finally:
            for m in checks if masters else []:
                m.close()


def _in_child(work) -> None:
    """Run `work()` in a forked child and leave with its verdict: never return into pytest."""
    code = 1
    try:
        work()
        code = 0
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stderr.flush()
        os._exit(code)


def _wait_for_exit(pid: int) -> int:
    status = []

    def exited():
        done, code = os.waitpid(pid, os.WNOHANG)
        if done:
            status.append(os.waitstatus_to_exitcode(code))
        return bool(done)

    try:
        until(exited, "the child to finish")
    finally:
        if not status:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
    return status[0]


@pytest.fixture
def quorum():
    servers = [RedisServer().start() for _ in range(3)]
    yield [s.url for s in servers]
    stop_servers(servers)


def _facade(kind: str, redis_url: str, quorum_urls: list[str] | None) -> SyncLockManager:
    if kind == "redlock":
        return SyncLockManager(lambda: RedLockManager.from_urls(quorum_urls, namespace=NS))
    return SyncLockManager.from_url(redis_url, namespace=NS)


@forks
@pytest.mark.parametrize("kind", ["single", "redlock"])
def test_a_manager_made_before_os_fork_works_in_the_child_and_the_parent(redis_url, client, kind, request):
    masters = request.getfixturevalue("quorum") if kind == "redlock" else None
    locks = _facade(kind, redis_url, masters)
    try:
        with locks.lock("turns"):  # used before the fork: loop thread and connections exist
            pass
        pid = os.fork()
        if pid == 0:
            _in_child(lambda: _take_turns(locks, redis_url, "turns", 20, masters))
        _take_turns(locks, redis_url, "turns", 20, masters)
        assert _wait_for_exit(pid) == 0
        owners = [o.decode() for o in client.lrange("owners", 0, -1)]
        assert len(owners) == 40 and len(set(owners)) == 40  # one owner per hold, never shared
        held = locks.try_lock("turns")  # the parent goes on working
        assert held is not None and held.release() is True
    finally:
        locks.close()


def _child_of_multiprocessing(locks: SyncLockManager, url: str) -> None:
    _take_turns(locks, url, "turns", 20)


@forks
def test_a_manager_made_before_a_multiprocessing_fork_works_in_the_children(sync_locks, redis_url, client):
    with sync_locks.lock("turns"):
        pass
    context = multiprocessing.get_context("fork")
    children = [context.Process(target=_child_of_multiprocessing, args=(sync_locks, redis_url)) for _ in range(2)]
    for child in children:
        child.start()
    _take_turns(sync_locks, redis_url, "turns", 20)
    for child in children:
        child.join(BOUND * 2)
        if child.exitcode is None:
            child.kill()
            child.join()
    assert [child.exitcode for child in children] == [0, 0]
    owners = client.lrange("owners", 0, -1)
    assert len(owners) == 60 and len(set(owners)) == 60


@forks
def test_a_hold_inherited_across_fork_stays_the_parents(sync_locks, redis_url, client):
    held = sync_locks.acquire("k")
    pid = os.fork()
    if pid == 0:
        def child():
            assert sync_locks.try_lock("k") is None  # the parent's hold is not this process's to re-enter
            assert held.release() is False  # ...nor to release
            assert owner_of(client_in_child, "k") == held.owner
            mine = sync_locks.acquire("k", wait=BOUND)  # waits for the parent, like any other client
            assert mine.depth == 1 and mine.owner != held.owner and mine.token > held.token
            client_in_child.set("child-owner", mine.owner)
            assert mine.release() is True
            sync_locks.close()
            sync_locks.close()

        client_in_child = redis.Redis.from_url(redis_url)
        _in_child(child)
    until(lambda: queued(client, "k") == 1, "the child waited for the parent's hold")
    assert owner_of(client, "k") == held.owner and not held.lost.is_set()
    assert held.release() is True
    assert _wait_for_exit(pid) == 0
    assert client.get("child-owner") not in (None, held.owner.encode())
    again = sync_locks.try_lock("k")  # the child's close() left the parent's facade alone
    assert again is not None and again.release() is True


@forks
def test_close_in_a_forked_child_leaves_the_parent_working(sync_locks, redis_url):
    with sync_locks.lock("k"):
        pass
    pid = os.fork()
    if pid == 0:
        _in_child(sync_locks.close)
    assert _wait_for_exit(pid) == 0
    with sync_locks.lock("k", wait=BOUND) as held:
        assert held.depth == 1
    assert sync_locks.held_locks() == []


def _get(url: str) -> int:
    with urllib.request.urlopen(url, timeout=BOUND) as response:
        response.read()
        return response.status


@forks
def test_gunicorn_preload_workers_share_a_module_level_facade_one_holder_at_a_time(redis_url, client):
    pytest.importorskip("gunicorn")
    port = free_port()
    env = {**os.environ, "OTEL_LOCK_TEST_REDIS_URL": redis_url,
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    server = subprocess.Popen([sys.executable, "-m", "gunicorn", "--preload", "-w", "2", "-b", f"127.0.0.1:{port}",
                               "--chdir", str(ROOT / "tests"), "--graceful-timeout", "5", "_sync_wsgi_app:app"],
                              env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                              start_new_session=True)
    try:
        def serving() -> bool:
            assert server.poll() is None, server.stderr.read()
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                    return True
            except OSError:
                return False

        until(serving, "gunicorn to listen")
        with ThreadPoolExecutor(8) as pool:
            statuses = list(pool.map(_get, [f"http://127.0.0.1:{port}/"] * 80))
        assert statuses == [200] * 80
        assert client.get("overlaps") is None and client.get("wrong-owner") is None
        owners = client.lrange("owners", 0, -1)
        assert len(owners) == 80 and len(set(owners)) == 80
        assert len(client.smembers("pids")) == 2  # both forked workers served under the lock
    finally:
        stop_process(server)
        with contextlib.suppress(ProcessLookupError):  # a worker left behind by a failed run
            os.killpg(server.pid, signal.SIGKILL)
        server.stderr.close()


# -- RedLock behind the facade ----------------------------------------------------


def test_a_redlock_quorum_behind_the_facade(quorum):
    with SyncLockManager(lambda: RedLockManager.from_urls(quorum, namespace=NS)) as locks, \
            SyncLockManager(lambda: RedLockManager.from_urls(quorum, namespace=NS)) as rival:
        with locks.lock("q", wait=BOUND) as outer:
            for url in quorum:
                with redis.Redis.from_url(url) as c:
                    assert c.hget(outer.key, "owner") == outer.owner.encode()
            with locks.lock("q") as inner:
                assert inner.depth == 2 and inner.token == outer.token
            assert rival.try_lock("q") is None
            with pytest.raises(LockTimeout):
                rival.acquire("q", wait=0.2)
        held = rival.acquire("q", wait=BOUND)
        assert held.token > outer.token
        assert held.release() is True
        for url in quorum:
            with redis.Redis.from_url(url) as c:
                assert c.exists(held.key) == 0


# -- the README's example runs ----------------------------------------------------------


def test_the_readme_scripts_and_cron_jobs_example_runs(redis_url):
    readme = (ROOT / "README.md").read_text()
    section = readme.split("### Scripts and cron jobs", 1)[1]
    example = section.split("```python\n", 1)[1].split("```", 1)[0]
    assert "redis://127.0.0.1:6379/0" in example
    script = example.replace("redis://127.0.0.1:6379/0", redis_url)

    def run() -> str:
        result = subprocess.run([sys.executable, *STRICT_WARNINGS, "-c", script], capture_output=True, text=True,
                                timeout=BOUND, cwd=ROOT)
        assert result.returncode == 0 and result.stderr == "", result.stderr
        return result.stdout

    assert run().startswith("running the report, fencing token ")
    with SyncLockManager.from_url(redis_url, namespace="shop") as replica, replica.lock("job:nightly-report"):
        assert run() == "another replica is running it\n"


def test_the_facade_reports_the_servers_and_the_data_model_like_the_manager(sync_locks, client, redis_url):
    reports = sync_locks.check_servers()
    assert reports and all(report.checks for report in reports)
    with sync_locks.lock("first-use"):
        pass
    health = sync_locks.health()
    assert health.ok and health.checked and health.namespace_model == health.model
    # A namespace another data model holds: the facade's manager refuses it, and health() says why.
    client.set("foreign:model", "999")
    with SyncLockManager.from_url(redis_url, namespace="foreign") as foreign:
        with pytest.raises(RedisMisconfigured, match="data model 999"):
            foreign.acquire("k", wait=0.5)
        health = foreign.health()
        assert not health.ok and health.namespace_model == 999 and "999" in health.problems[0]
    assert client.exists("foreign:{k}") == 0
