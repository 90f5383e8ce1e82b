"""The locks under test, behind one small interface, each with the same lease.

Every library gets the same lease `L` and the same `wait`. otel-lock renews its
lease (`lease=None`, manager lease `L`); python-redis-lock renews it too
(`auto_renewal=True`, its thread every 2/3 of `expire`); redis-py's `Lock` has
no renewal, so its holds are bounded by `L`, as its users write them. Only
otel-lock has a fencing token and a `lost` signal; for the peers those are
None and every overlap they show is untold and unfenced.

`url` is what the deployment gives (benchmarks/safety/_deployments.py): one
Redis URL (`redis://`, `redis+sentinel://`, `redis+cluster://`), or a list of
them for a RedLock quorum, which only otel-lock takes. `options` are the
fault's manager options (e.g. `wait_replicas`).

The shapes beyond the mutex (`--shape`) are otel-lock's only: `acquire_shared`,
`acquire_permit` and `acquire_all` beside `acquire`. `otel-lock-loose` is
otel-lock with each shape deliberately weakened (an exclusive request taken
shared, one permit more than the limit the checker judges by, only the
first of lock_all's keys taken): the control that shows the checker sees a
broken shape, as `unlocked` shows it sees no lock at all.
"""

from __future__ import annotations

import math

KEY = "safety"  # the contended key of one-key runs; a Cluster run spreads several (Deployment.keys)


class Held:
    """What a worker keeps of one acquisition; `parts`: (key, token, mode) per key it holds, when not one key."""

    __slots__ = ("token", "lost", "native", "parts")

    def __init__(self, native, token: int | None = None, lost=None, parts: list | None = None) -> None:
        self.native, self.token, self.lost, self.parts = native, token, lost, parts


class OtelLock:
    name = "otel-lock"
    sync = False

    def __init__(self, url: str | list[str], lease: float, **options) -> None:
        from otel_lock import LockManager, LockTimeout, RedLockManager

        self.timeout = LockTimeout
        if isinstance(url, list):
            self.manager = RedLockManager.from_urls(url, namespace="safety", lease=lease, **options)
        else:
            self.manager = LockManager.from_url(url, namespace="safety", lease=lease, **options)

    async def acquire(self, wait: float, key: str = KEY) -> Held | None:
        try:
            held = await self.manager.acquire(key, wait=wait, name="safety")
        except self.timeout:
            return None
        return Held(held, held.token, held.lost)

    async def acquire_shared(self, wait: float, key: str) -> Held | None:
        try:
            held = await self.manager.acquire(key, wait=wait, name="safety", shared=True)
        except self.timeout:
            return None
        return Held(held, held.token, held.lost)

    async def acquire_permit(self, wait: float, key: str, permits: int) -> Held | None:
        try:
            held = await self.manager.acquire_permit(key, permits=permits, wait=wait, name="safety")
        except self.timeout:
            return None
        return Held(held, held.token, held.lost)

    async def acquire_all(self, wait: float, keys: list[str]) -> Held | None:
        try:
            held = await self.manager.acquire_all(keys, wait=wait, name="safety")
        except self.timeout:
            return None
        return Held(held, None, held.lost, [(key, held.tokens[key], "exclusive") for key in held.keys])

    async def release(self, held: Held) -> bool:
        return await held.native.release()

    async def close(self) -> None:
        await self.manager.aclose()


class LooseOtelLock(OtelLock):
    """otel-lock with every shape weakened on purpose: the checker must find what this lets through."""

    name = "otel-lock-loose"

    async def acquire(self, wait: float, key: str = KEY) -> Held | None:
        return await self.acquire_shared(wait, key)  # asked exclusive, taken shared

    async def acquire_permit(self, wait: float, key: str, permits: int) -> Held | None:
        return await super().acquire_permit(wait, key, permits + 1)

    async def acquire_all(self, wait: float, keys: list[str]) -> Held | None:
        held = await OtelLock.acquire(self, wait, keys[0])  # the first key named, the others not at all
        if held is not None:
            held.parts = [(keys[0], held.token, "exclusive")] + [(key, None, "exclusive") for key in keys[1:]]
        return held


class RedisPy:
    """redis.asyncio Lock with its defaults (sleep=0.1 polling), timeout = the lease."""

    name = "redis-py Lock"
    sync = False

    def __init__(self, url: str, lease: float, **options) -> None:
        import redis.asyncio as aioredis

        self.client = aioredis.Redis.from_url(url, max_connections=1000)
        self.lease = lease

    async def acquire(self, wait: float, key: str = KEY) -> Held | None:
        lock = self.client.lock(key, timeout=self.lease, blocking_timeout=wait)
        return Held(lock) if await lock.acquire() else None

    async def release(self, held: Held) -> bool:
        from redis.exceptions import LockNotOwnedError

        try:
            await held.native.release()
        except LockNotOwnedError:
            return False
        return True

    async def close(self) -> None:
        await self.client.aclose()


class PythonRedisLock:
    """python-redis-lock (sync; one thread per task), auto_renewal on, expire = the lease in whole seconds."""

    name = "python-redis-lock"
    sync = True

    def __init__(self, url: str, lease: float, **options) -> None:
        import redis

        self.client = redis.Redis.from_url(url, max_connections=1000)
        self.expire = max(1, round(lease))

    def acquire(self, wait: float, key: str = KEY) -> Held | None:
        import redis_lock

        lock = redis_lock.Lock(self.client, key, expire=self.expire, auto_renewal=True)
        # its timeout is whole seconds and 0 means "forever"
        return Held(lock) if lock.acquire(timeout=max(1, math.ceil(wait))) else None

    def release(self, held: Held) -> bool:
        import redis_lock

        try:
            held.native.release()
        except redis_lock.NotAcquired:
            return False
        return True

    def close(self) -> None:
        self.client.close()


class Unlocked:
    """No lock at all: the control that shows the checker sees overlaps (`--libs unlocked`)."""

    name = "unlocked"
    sync = False

    def __init__(self, url: str | list[str], lease: float, **options) -> None:
        pass

    async def acquire(self, wait: float, key: str = KEY) -> Held:
        return Held(None)

    async def acquire_shared(self, wait: float, key: str) -> Held:
        return Held(None)

    async def acquire_permit(self, wait: float, key: str, permits: int) -> Held:
        return Held(None)

    async def acquire_all(self, wait: float, keys: list[str]) -> Held:
        return Held(None, parts=[(key, None, "exclusive") for key in keys])

    async def release(self, held: Held) -> bool:
        return True

    async def close(self) -> None:
        pass


LIBS = {"otel-lock": OtelLock, "redis-py": RedisPy, "python-redis-lock": PythonRedisLock, "unlocked": Unlocked,
        "otel-lock-loose": LooseOtelLock}
COMPARED = ["otel-lock", "redis-py", "python-redis-lock"]  # what --full runs on a single Redis
ANY_DEPLOYMENT = ["otel-lock", "unlocked", "otel-lock-loose"]  # the peers run on a single Redis only
SHAPED = ["otel-lock", "unlocked", "otel-lock-loose"]  # what runs the shapes beyond the mutex (--shape)
