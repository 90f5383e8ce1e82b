"""One adapter per library, so every scenario drives each lock the same way.

`lock(key, wait)` returns the library's own context manager where it has one
that takes a wait bound (otel-lock, redis-py), so the timed path is exactly
what a user writes; the sync peers get a thin wrapper. A lock that is not
acquired within `wait` raises one of `adapter.timeouts`.

The quorum adapters (otel-lock's RedLockManager, pottery) take the URLs of
their masters separated by spaces, so every adapter is built from one string.
"""

from __future__ import annotations

import math
from contextlib import contextmanager

LEASE = 30.0  # fixed lease of the peers (seconds); otel-lock uses lease=None + watchdog
MAX_CONNECTIONS = 1000


# The rings of benchmarks/_ring.py by their `via`, as the tables name them.
RINGS = {
    "pubsub": "ring (SUBSCRIBE/PUBLISH, lean connection)",
    "lists": "ring (BLPOP/LPUSH, lean connection)",
    "lists-queued": "ring (BLPOP/LPUSH + one more round trip, lean connection)",
    "redis-py": "ring (SUBSCRIBE/PUBLISH, redis-py's client)",
    "redis-py-lists": "ring (BLPOP/LPUSH, redis-py's client)",
}


class NotAcquired(Exception):
    pass


class OtelLock:
    name = "otel-lock"
    sync = False

    def __init__(self, url: str, lease: float | None = None, **options) -> None:
        self.url, self.lease, self.options = url, lease, options

    async def open(self) -> None:
        from otel_lock import LockManager, LockTimeout

        self.timeouts = (LockTimeout,)
        self.manager = LockManager.from_url(self.url, namespace="bench", **self.options)

    def lock(self, key: str, wait: float):
        return self.manager.lock(key, wait=wait, lease=self.lease, name="bench")

    async def close(self) -> None:
        await self.manager.aclose()


class OtelRedLock(OtelLock):
    """otel-lock's RedLockManager over the space-separated master URLs (a quorum of them per lock)."""

    name = "otel-lock RedLockManager"

    async def open(self) -> None:
        from otel_lock import LockTimeout, RedLockManager

        self.timeouts = (LockTimeout,)
        self.manager = RedLockManager.from_urls(self.url.split(), namespace="bench", **self.options)


class OtelLockShared(OtelLock):
    """otel-lock's shared hold: `lock(key, shared=True)`."""

    name = "otel-lock `lock(key, shared=True)`"

    def lock(self, key: str, wait: float):
        return self.manager.lock(key, wait=wait, lease=self.lease, name="bench", shared=True)


class OtelLockPermit(OtelLock):
    """otel-lock's permits: `semaphore(key, permits=PERMITS)`."""

    name = "otel-lock `semaphore(key, permits=4)`"
    permits = 4

    def lock(self, key: str, wait: float):
        return self.manager.semaphore(key, permits=self.permits, wait=wait, lease=self.lease, name="bench")


class OtelLockAllTwo(OtelLock):
    """otel-lock's `lock_all` of two keys: the key given and one beside it."""

    name = "otel-lock `lock_all` of 2 keys"

    def lock(self, key: str, wait: float):
        return self.manager.lock_all([key, key + ":2"], wait=wait, lease=self.lease, name="bench")


class OtelLockFixedLease(OtelLock):
    name = "otel-lock (lease=30)"

    def __init__(self, url: str) -> None:
        super().__init__(url, lease=LEASE)


class RedisPy:
    """redis.asyncio.lock.Lock: SET NX PX, then a sleep(`sleep`) polling loop."""

    sync = False
    sleep = 0.1

    def __init__(self, url: str) -> None:
        self.url = url

    @property
    def name(self) -> str:
        return "redis-py asyncio Lock" + (" (sleep=0.1, default)" if self.sleep == 0.1 else f" (sleep={self.sleep})")

    async def open(self) -> None:
        import redis.asyncio as aioredis
        from redis.exceptions import LockError

        self.timeouts = (LockError,)
        # its default pool caps connections; 128 polling waiters per process need more
        self.client = aioredis.Redis.from_url(self.url, max_connections=MAX_CONNECTIONS)

    def lock(self, key: str, wait: float):
        return self.client.lock(key, timeout=LEASE, sleep=self.sleep, blocking_timeout=wait)

    async def close(self) -> None:
        await self.client.aclose()


class RedisPyFast(RedisPy):
    sleep = 0.001


class _SyncPeer:
    """A sync peer library over redis-py clients, one per space-separated URL (its waiters are threads)."""

    sync = True
    timeouts = (NotAcquired,)

    def __init__(self, url: str) -> None:
        self.url = url

    def open(self) -> None:
        import redis

        self.clients = [redis.Redis.from_url(url, max_connections=MAX_CONNECTIONS) for url in self.url.split()]
        self.client = self.clients[0]

    def close(self) -> None:
        for client in self.clients:
            client.close()


class PythonRedisLock(_SyncPeer):
    """python-redis-lock: SET NX, BLPOP on a signal list that release pushes to. Sync only."""

    name = "python-redis-lock"

    @contextmanager
    def lock(self, key: str, wait: float):
        import redis_lock

        held = redis_lock.Lock(self.client, key, expire=int(LEASE))
        # its timeout is whole seconds and 0 means "forever", so round up
        if not held.acquire(timeout=min(int(LEASE), max(1, math.ceil(wait)))):
            raise NotAcquired(key)
        try:
            yield held
        finally:
            held.release()


class Pottery(_SyncPeer):
    """pottery.Redlock: SET NX PX on every master given (one in the lock suite), retry after a random sleep
    up to 200 ms."""

    name = "pottery Redlock (1 master)"

    @contextmanager
    def lock(self, key: str, wait: float):
        from pottery import Redlock

        held = Redlock(key=key, masters=set(self.clients), auto_release_time=LEASE)
        if not held.acquire(timeout=wait):
            raise NotAcquired(key)
        try:
            yield held
        finally:
            held.release()


ADAPTERS = {
    "otel-lock": OtelLock,
    "otel-lock-lease": OtelLockFixedLease,
    "otel-lock-redlock": OtelRedLock,
    "otel-lock-shared": OtelLockShared,
    "otel-lock-permit": OtelLockPermit,
    "otel-lock-all2": OtelLockAllTwo,
    "redis-py": RedisPy,
    "redis-py-1ms": RedisPyFast,
    "python-redis-lock": PythonRedisLock,
    "pottery": Pottery,
}


def label(lib: str) -> str:
    cls = ADAPTERS[lib]
    return cls.name if isinstance(cls.name, str) else cls("").name


_MODULES = {"python-redis-lock": "redis_lock", "pottery": "pottery"}


def available(lib: str) -> bool:
    """Peers come with the `bench` extra; a missing one is skipped, not a crash in a worker."""
    import importlib.util

    if lib.startswith("otel-lock"):
        try:
            from otel_lock import LockManager  # noqa: F401
        except ImportError:
            return False
        return True
    module = _MODULES.get(lib)
    return module is None or importlib.util.find_spec(module) is not None
