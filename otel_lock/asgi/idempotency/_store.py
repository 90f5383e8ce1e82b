"""Where idempotency records live, and how much room they may take.

Records compete with everything else in their Redis for memory: one caller
storing sixty 900 KB answers once pushed a server with an evicting policy to
drop another user's completed record (her retry ran the handler again) and
a held lock. So the store is bounded, per principal and in total, in records
and bytes, and can live on a Redis of its own (`IdempotencyStore(client)`,
`IdempotencyStore.from_url(url)`), so records never compete with locks.

Keys (one hash tag per principal, so each of its scripts runs in one slot):

    <ns>:idem:{<p>}:r:<s>     the record (hash: d = JSON, n = bytes counted, e = expiry bucket)
    <ns>:idem:{<p>}:usage     what principal <p> holds: records, bytes, and both per expiry bucket
    <ns>:idem:{<p>}:buckets   the expiry buckets of its live records (zset)
    <ns>:idem:{total}:usage   the same, for every principal (the total caps)

Usage is kept per expiry bucket (a minute wide): a record that simply
expires is subtracted when its bucket has passed, without anyone having
to see it go. A record deleted early is subtracted at once. The counts
err on the safe side: a record evicted by Redis still counts until its
bucket passes. The keys start with `<ns>:idem:`, not `<ns>:{`, so the
operator's `otel-lock locks` listing never mistakes them for locks.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable

import redis.asyncio as aioredis

from ...lock._runtime import at_loop_shutdown
from ...lock._scripts import Script
from ._store_errors import RecordStoreUnavailable, translate, translated

log = logging.getLogger("otel_lock.idempotency")

MIB = 1024 * 1024
BUCKET_MS = 60_000
# Bytes a record costs beyond its JSON: its key, the hash encoding, the bucket fields.
RECORD_OVERHEAD = 256
# Defaults: a principal holds at most 10,000 records and 16 MiB; everyone together at most
# 1,000,000 records and 512 MiB, and never more than half the server's maxmemory.
MAX_RECORDS = 1_000_000
MAX_BYTES = 512 * MIB
MAX_RECORDS_PER_PRINCIPAL = 10_000
MAX_BYTES_PER_PRINCIPAL = 16 * MIB
MAXMEMORY_SHARE = 0.5
EVICTING = ("allkeys-", "volatile-")
Record = dict[str, Any]

# Shared by both scripts (their last ARGV is the bucket width W in ms). KEYS of a usage pair:
# the usage hash and its bucket zset. Bucket b holds the records expiring in ((b-1)*W, b*W];
# it is purged once b*W <= now.
_USAGE_LUA = """
local width = tonumber(ARGV[#ARGV])
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)

local function purge(usage, buckets)
  local old = redis.call('ZRANGEBYSCORE', buckets, '-inf', math.floor(now / width), 'LIMIT', 0, 100)
  for _, b in ipairs(old) do
    local f = redis.call('HMGET', usage, 'r:' .. b, 'b:' .. b)
    redis.call('HINCRBY', usage, 'records', -(tonumber(f[1]) or 0))
    redis.call('HINCRBY', usage, 'bytes', -(tonumber(f[2]) or 0))
    redis.call('HDEL', usage, 'r:' .. b, 'b:' .. b)
    redis.call('ZREM', buckets, b)
  end
end

local function change(usage, buckets, b, records, bytes)
  if records == 0 and bytes == 0 then return end
  redis.call('HINCRBY', usage, 'records', records)
  redis.call('HINCRBY', usage, 'bytes', bytes)
  redis.call('HINCRBY', usage, 'r:' .. b, records)
  redis.call('HINCRBY', usage, 'b:' .. b, bytes)
  redis.call('ZADD', buckets, b, b)
  local keep = (b + 1) * width - now
  if redis.call('PTTL', usage) < keep then
    redis.call('PEXPIRE', usage, keep)
    redis.call('PEXPIRE', buckets, keep)
  end
end

-- a contribution leaves only a bucket that still counts (not purged yet)
local function release(usage, buckets, b, records, bytes)
  if b > 0 and redis.call('ZSCORE', buckets, b) then change(usage, buckets, b, -records, -bytes) end
end

-- milliseconds until the oldest bucket is purged when adding would pass a cap (0 = unlimited),
-- keeping `headroom` bytes free (at most half the cap) for the answer still to come; else nil
local function over(usage, buckets, records, bytes, headroom, max_records, max_bytes)
  local f = redis.call('HMGET', usage, 'records', 'bytes')
  local r, n = tonumber(f[1]) or 0, tonumber(f[2]) or 0
  if (max_records > 0 and records > 0 and r + records > max_records)
      or (max_bytes > 0 and bytes > 0 and n + bytes + math.min(headroom, math.floor(max_bytes / 2)) > max_bytes) then
    local first = redis.call('ZRANGE', buckets, 0, 0)[1]
    return math.max((first and tonumber(first) * width or now + width) - now, 1000)
  end
  return nil
end
"""

# KEYS: total usage, total buckets.
# ARGV: added bucket, records, bytes; released bucket (0: none), records, bytes; max records, max bytes
#       (0: none); check (1/0: refuse a net growth past a cap); headroom bytes.
# Returns {0} when applied, {1, retry after ms} when a cap refused it (nothing changed).
TOTAL_LUA = _USAGE_LUA + """
purge(KEYS[1], KEYS[2])
local b, records, bytes = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local rb, rr, rn = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
if not (rb > 0 and redis.call('ZSCORE', KEYS[2], rb)) then rr, rn = 0, 0 end
if ARGV[9] == '1' then
  local wait = over(KEYS[1], KEYS[2], records - rr, bytes - rn, tonumber(ARGV[10]), tonumber(ARGV[7]),
                    tonumber(ARGV[8]))
  if wait then return {1, wait} end
end
change(KEYS[1], KEYS[2], b, records, bytes)
release(KEYS[1], KEYS[2], rb, rr, rn)
return {0}
"""

# KEYS: record, principal usage, principal buckets.
# ARGV: mode ('claim': only if absent; 'replace'; 'delete'), JSON, bytes, ttl ms, max records, max bytes
#       (0: none), check (1/0: refuse a growth past a cap), headroom bytes.
# Returns {0, bucket, old bytes, old bucket} when written (or deleted), {1, JSON} when a claim found
# a record, {2, retry after ms} when a cap refused it.
RECORD_LUA = _USAGE_LUA + """
local mode = ARGV[1]
purge(KEYS[2], KEYS[3])
if mode == 'claim' and redis.call('EXISTS', KEYS[1]) == 1 then
  return {1, redis.call('HGET', KEYS[1], 'd') or ''}
end
local old = redis.call('HMGET', KEYS[1], 'n', 'e')
local old_bytes, old_bucket = tonumber(old[1]) or 0, tonumber(old[2]) or 0
local existed = old[1] and 1 or 0
if mode == 'delete' then
  redis.call('DEL', KEYS[1])
  release(KEYS[2], KEYS[3], old_bucket, existed, old_bytes)
  return {0, 0, old_bytes, old_bucket}
end
local bytes = tonumber(ARGV[3])
local b = math.ceil((now + tonumber(ARGV[4])) / width)
if ARGV[7] == '1' then
  local wait = over(KEYS[2], KEYS[3], 1 - existed, bytes - old_bytes, tonumber(ARGV[8]), tonumber(ARGV[5]),
                    tonumber(ARGV[6]))
  if wait then return {2, wait} end
end
redis.call('HSET', KEYS[1], 'd', ARGV[2], 'n', bytes, 'e', b)
redis.call('PEXPIRE', KEYS[1], ARGV[4])
release(KEYS[2], KEYS[3], old_bucket, existed, old_bytes)
change(KEYS[2], KEYS[3], b, 1, bytes)
return {0, b, old_bytes, old_bucket}
"""

# Called by SHA with an EVAL fallback (`lock._scripts.Script`): a server without SCRIPT serves records too.
TOTAL = Script(TOTAL_LUA)
RECORD = Script(RECORD_LUA)


@dataclass(frozen=True)
class RecordId:
    """Which record: the principal's and the (principal, key) scope's hashes."""

    principal: str
    scope: str
    capped: bool = True      # per-principal caps apply (not to the one shared scope)


@dataclass(frozen=True)
class Written:
    """What a record costs, as counted: its bytes and its expiry bucket."""

    size: int
    bucket: int


@dataclass(frozen=True)
class Claim:
    """A claim's outcome: claimed (`written`), an existing `record`, or refused (`refused`, `retry_after`)."""

    written: Written | None = None
    record: Record | None = None
    refused: str = ""        # "principal" (429) or "total" (507)
    retry_after: float = 0.0


@dataclass(frozen=True)
class Caps:
    """The limits in force (0 = none)."""

    records: int
    bytes: int
    records_per_principal: int
    bytes_per_principal: int


_NO_CAPS = Caps(0, 0, 0, 0)


class IdempotencyStore:
    """Idempotency records in Redis, bounded per principal and in total (records and bytes).

    `IdempotencyStore()` keeps them next to the locks (the manager's Redis
    and namespace); `IdempotencyStore(client)` or `.from_url(url)` on a Redis
    of their own. A cap of None is no cap. The total byte cap is also held
    below half the store's `maxmemory`, when the server has one.
    """

    def __init__(self, redis: Any = None, *, namespace: str | None = None,
                 max_records: int | None = MAX_RECORDS, max_bytes: int | None = MAX_BYTES,
                 max_records_per_principal: int | None = MAX_RECORDS_PER_PRINCIPAL,
                 max_bytes_per_principal: int | None = MAX_BYTES_PER_PRINCIPAL) -> None:
        caps = {"max_records": max_records, "max_bytes": max_bytes,
                "max_records_per_principal": max_records_per_principal,
                "max_bytes_per_principal": max_bytes_per_principal}
        for name, value in caps.items():
            _check_cap(name, value)
        if namespace is not None and (not isinstance(namespace, str) or not namespace or "{" in namespace):
            raise ValueError(f"IdempotencyStore(namespace=...) must be a non-empty string without braces, "
                             f"got {namespace!r}")
        self._redis: Any = redis         # a redis.asyncio Redis or RedisCluster
        # from_url: a client per event loop (a redis-py client serves only the loop it connected on)
        self._make: Callable[[], Any] | None = None
        self._per_loop: dict[asyncio.AbstractEventLoop, Any] = {}
        self._closers: list[Any] = []  # close each loop's client when that loop shuts down
        self.namespace: str | None = namespace
        self.configured: Caps = Caps(max_records or 0, max_bytes or 0, max_records_per_principal or 0,
                                     max_bytes_per_principal or 0)
        self.caps: Caps = self.configured        # in force: held below half of maxmemory at first use
        self.shares_lock_redis: bool = redis is None
        self._owns_client = False
        self._probed = False
        self._bucket_ms = BUCKET_MS    # how finely expiries are counted (tests shorten it)

    @classmethod
    def from_url(cls, url: str, **options: Any) -> "IdempotencyStore":
        """A store on its own Redis (`redis://`, `rediss://`, `unix://`); close it with `aclose()`."""
        caps = {k: options.pop(k) for k in ("namespace", "max_records", "max_bytes", "max_records_per_principal",
                                            "max_bytes_per_principal") if k in options}
        store = cls(aioredis.Redis.from_url(url, **options), **caps)
        store._owns_client = True
        store._make = lambda: aioredis.Redis.from_url(url, **options)
        return store

    @property
    def redis(self) -> Any:
        """The client for the current event loop: the lock manager's (bound per request), or this store's own."""
        if self._make is None:
            return self._redis
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return self._redis
        client = self._per_loop.get(loop)
        if client is None:
            for gone in [other for other in self._per_loop if other.is_closed()]:
                del self._per_loop[gone]
            client = self._per_loop[loop] = self._redis if not self._per_loop and not self._used else self._make()
            self._used = True
            self._closers = [c for c in self._closers if c.ag_frame is not None]  # loops that ended: done
            self._closers.append(at_loop_shutdown(partial(self._forget_loop, loop, client)))
        return client

    async def _forget_loop(self, loop: asyncio.AbstractEventLoop, client: Any) -> None:
        if self._per_loop.get(loop) is client:
            del self._per_loop[loop]
        await client.aclose()

    _used = False

    def bind(self, redis: Any, namespace: str) -> None:
        """Fill in what was not given: the lock manager's Redis (its current client) and namespace."""
        if self.shares_lock_redis:
            self._redis = redis
        if self.namespace is None:
            self.namespace = namespace

    async def aclose(self) -> None:
        """Close the clients this store made for itself (from_url), on this loop; others close
        with their loop. A client you passed in is yours to close."""
        if not self._owns_client:
            return
        clients = list(self._per_loop.values()) or [self._redis]
        self._per_loop.clear()
        for client in clients:
            try:
                await client.aclose()
            except RuntimeError:
                pass  # made on an event loop that is closed now

    # -- keys ---------------------------------------------------------------------------

    def _keys(self, rid: RecordId) -> list[str]:
        base = f"{self.namespace}:idem:{{{rid.principal}}}"
        return [f"{base}:r:{rid.scope}", f"{base}:usage", f"{base}:buckets"]

    def _total_keys(self) -> list[str]:
        return [f"{self.namespace}:idem:{{total}}:usage", f"{self.namespace}:idem:{{total}}:buckets"]

    # -- records ------------------------------------------------------------------------

    async def load(self, rid: RecordId, also: tuple[Any, str] | None = None) -> Record | None:
        """The record, or None; with `also` (a client and the key of release 0.1.0's record, a
        JSON string), that record when this one is missing (one round trip on one client)."""
        key = self._keys(rid)[0]
        if also is None:
            return _parse(await translated(lambda: self.redis.hget(key, "d")))
        client, old_key = also
        if client is self.redis:
            async def both() -> list[Any]:
                pipe = self.redis.pipeline(transaction=False)
                pipe.hget(key, "d")
                pipe.get(old_key)
                return list(await pipe.execute())

            current, legacy = await translated(both)
        else:
            current = await translated(lambda: self.redis.hget(key, "d"))
            legacy = None if current is not None else await translated(lambda: client.get(old_key))
        return _parse(current if current is not None else legacy)

    async def claim(self, rid: RecordId, record: Record, ttl: float, answer_bound: int = 0) -> Claim:
        """Write `record` unless a record exists; refuse when a cap would be passed.

        `answer_bound`: the largest record the answer may need (its stored-response
        limit): a claim is refused while less room than that is left (at most half a
        cap), so the handler runs only if its answer can be stored.
        """
        await self._prepare()
        data = _dump(record)
        size = len(data) + RECORD_OVERHEAD
        answer = await self._run_record(rid, "claim", data, size, ttl, check=True, headroom=answer_bound)
        if answer[0] == 1:
            return Claim(record=_parse(answer[1]) or {})
        if answer[0] == 2:
            return Claim(refused="principal", retry_after=int(answer[1]) / 1000)
        written = Written(size, int(answer[1]))
        refused = await self._run_total(added=(written.bucket, 1, size), check=True, headroom=answer_bound)
        if refused is not None:
            await self._run_record(rid, "delete", "", 0, 0, check=False)   # the total never counted it
            return Claim(refused="total", retry_after=refused)
        return Claim(written=written)

    async def replace(self, rid: RecordId, record: Record, ttl: float, previous: Written | None,
                      fallback: Record | None = None) -> tuple[Written, bool]:
        """Overwrite the record (`previous`: what the total counted for it, if this request wrote it).

        With a `fallback`, a cap that the new record would pass makes it write
        the fallback (a small tombstone) instead: returns False then.
        """
        await self._prepare()
        data = _dump(record)
        size = len(data) + RECORD_OVERHEAD
        answer = await self._run_record(rid, "replace", data, size, ttl, check=fallback is not None)
        if answer[0] == 0:
            written = Written(size, int(answer[1]))
            counted = previous or Written(int(answer[2]), int(answer[3]))
            # The old record leaves the total (if its bucket still counts) and the new one enters.
            refused = await self._run_total(added=(written.bucket, 1, size), released=(counted.bucket, 1, counted.size),
                                            check=fallback is not None)
            if refused is None:
                return written, True
            previous = counted
        assert fallback is not None   # a write without a fallback is never checked, so never refused
        written, _ = await self.replace(rid, fallback, ttl, previous)
        return written, False

    async def forget(self, rid: RecordId, previous: Written | None) -> None:
        """Delete the record (an answer that is not stored): its key is free again."""
        await self._prepare()
        answer = await self._run_record(rid, "delete", "", 0, 0, check=False)
        counted = previous or Written(int(answer[2]), int(answer[3]))
        if counted.bucket:
            await self._run_total(released=(counted.bucket, 1, counted.size), check=False)

    # -- Redis --------------------------------------------------------------------------

    async def _run_total(self, *, added: tuple[int, int, int] = (0, 0, 0),
                         released: tuple[int, int, int] = (0, 0, 0), check: bool, headroom: int = 0) -> float | None:
        """Apply (bucket, records, bytes) changes to the total; seconds to wait if a cap refused them."""
        caps = self.caps
        if not (caps.records or caps.bytes):
            return None
        args = [*added, *released, caps.records, caps.bytes, int(check), headroom, self._bucket_ms]
        answer = await translated(lambda: TOTAL(self.redis, self._total_keys(), args))
        return int(answer[1]) / 1000 if answer[0] == 1 else None

    async def _run_record(self, rid: RecordId, mode: str, data: str, size: int, ttl: float, *,
                          check: bool, headroom: int = 0) -> list[Any]:
        caps = self.caps if rid.capped else _NO_CAPS
        args: list[str | int] = [mode, data, size, int(ttl * 1000), caps.records_per_principal,
                                 caps.bytes_per_principal, int(check), headroom, self._bucket_ms]
        return list(await translated(lambda: RECORD(self.redis, self._keys(rid), args)))

    async def _prepare(self) -> None:
        if not self._probed:
            await self._probe()

    async def _probe(self) -> None:
        """Once: hold the total byte cap below half of `maxmemory`; warn about an evicting policy."""
        try:
            info = await self.redis.info("memory")
        except Exception as error:  # unknown is an answer too: the configured caps stay
            if not isinstance(translate(error), RecordStoreUnavailable):
                self._probed = True  # refused for good (an ACL without INFO, a proxy): stop asking
            log.info("otel-lock: could not read the record store's memory settings: %s", error)
            return
        self._probed = True
        maxmemory, policy = _memory_settings(info)
        if maxmemory > 0:
            room = int(maxmemory * MAXMEMORY_SHARE)
            total = min(self.configured.bytes or room, room)
            self.caps = Caps(self.configured.records, total, self.configured.records_per_principal,
                             min(self.configured.bytes_per_principal or total, total))
        if policy.startswith(EVICTING):
            log.warning("otel-lock: the idempotency record store's Redis has maxmemory-policy %s: under memory "
                        "pressure it may evict completed records, and a retry whose record was evicted runs "
                        "the handler again; give the records a Redis with maxmemory-policy noeviction "
                        "(IdempotencyStore.from_url(...))", policy)


def _check_cap(name: str, value: Any) -> None:
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise ValueError(f"IdempotencyStore({name}=...) must be a positive whole number or None, got {value!r}")


def _memory_settings(info: Any) -> tuple[int, str]:
    """maxmemory and maxmemory_policy from INFO (a Cluster client answers per node: the smallest limit)."""
    if not isinstance(info, dict):
        return 0, ""
    if "maxmemory" not in info and info and all(isinstance(v, dict) for v in info.values()):
        nodes = [_memory_settings(v) for v in info.values()]
        limited = [m for m, _ in nodes if m > 0]
        return (min(limited) if limited else 0), next((p for _, p in nodes if p), "")
    try:
        maxmemory = int(info.get("maxmemory") or 0)
    except (TypeError, ValueError):
        maxmemory = 0
    return maxmemory, str(info.get("maxmemory_policy") or "")


def answer_bound(max_stored_response: int) -> int:
    """The bytes of the largest record an answer of up to `max_stored_response` bytes makes (base64, headers)."""
    return 4 * -(-max_stored_response // 3) + 1024 + RECORD_OVERHEAD


def _dump(record: Record) -> str:
    return json.dumps(record, separators=(",", ":"))


def _parse(raw: Any) -> Record | None:
    if raw is None or raw == b"" or raw == "":
        return None
    try:
        record = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return None
    return record if isinstance(record, dict) else None
