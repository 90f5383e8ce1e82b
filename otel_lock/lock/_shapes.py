"""Shared holds and permits: the Lua of the two shapes beside the exclusive lock, and their keys.

Both keep their holders in a sorted set scored by lease expiry (Redis
`TIME`, ms), so a crashed holder's place is purged by the next script that
looks, and each holder has its own lease, renewed by the manager's batched
watchdog (RENEW_MEMBERS). Waiters queue in the same FIFO queue as the
exclusive lock (their entries, the queue members, carry their mode), and grants are published to the waiter's
manager channel as `<waiter id> <token> <key>`, like the exclusive
hand-over. Each grant mints its own fencing token from the shape's fence.

Shared (`lock(key, shared=True)`), lock named N in namespace S:

    S:{N}         hash   the exclusive lock's hash; while shared holders hold
                         it: owner = "(shared)", and a PTTL covering the
                         longest shared lease. Exclusive ACQUIRE (unchanged)
                         sees an owner that is not it, and queues.
    S:{N}:sh      zset   shared holders' owner ids, score: lease expiry (ms)
    S:{N}:sh:t    hash   owner -> fencing token; "u:<owner>" while a grant
                         is not claimed yet
    S:{N}:fence, S:{N}:q, S:{N}:w   as for the exclusive lock; a shared
                         waiter's entry has the mode "s"

The exclusive scripts of `_scripts.py` know nothing of the shapes: a plain
RELEASE hands the lock to the head waiter as an exclusive hold even when that
waiter asked to share it; the shared waiter then claims it with SHARED_ACQUIRE,
which turns the hold into a shared one and lets in every shared waiter right
behind it. So shared grants are always confirmed by one ACQUIRE, never trusted
from the notice alone.

Permits (`semaphore(key, permits=n)`):

    S:{N}:permits        zset   holders' owner ids, score: lease expiry (ms)
    S:{N}:permits:t      hash   owner -> fencing token; "u:<owner>" while a
                                grant is not claimed; "#limit" -> n
    S:{N}:permits:fence, S:{N}:permits:q, S:{N}:permits:w
                                fence, queue and waiters as for a lock (a
                                waiter's entry has the mode "p")

Holders' keys expire at the last holder's lease; the limit lives as long as
anybody holds a permit, and an ACQUIRE with another limit meanwhile answers
{-2, limit}.
"""

from __future__ import annotations

from dataclasses import dataclass

from . import _scripts
from ._scripts import Script

SHARED_OWNER = "(shared)"

_MEMBERS = _scripts._COMMON + r"""
local SHARED = '(shared)'

local function ms(now) return math.floor(now / 1000) end

-- the first live waiter of a queue (member, id, entry); dead ones (gone, past their deadline) are dropped
local function head(queue, waiters, now)
  while true do
    local h = redis.call('ZRANGE', queue, 0, 0, 'WITHSCORES')
    if #h == 0 then return nil, nil, nil end
    local id, w = entry(waiters, h[1], h[2], false)
    if w and (w[1] == 0 or w[1] > now) then return h[1], id, w end
    unqueue(queue, waiters, h[1])
  end
end

-- holders whose lease ran out (a crashed process) lose their place
local function purge(holders, tokens, now_ms)
  local gone = redis.call('ZRANGEBYSCORE', holders, '-inf', now_ms)
  for i = 1, #gone do redis.call('HDEL', tokens, gone[i], 'u:' .. gone[i]) end
  if #gone > 0 then redis.call('ZREMRANGEBYSCORE', holders, '-inf', now_ms) end
end

-- the holders' keys (and `also`, the shared lock's hash) live until the last lease; 0 when nobody holds
local function cover(holders, tokens, also)
  local last = redis.call('ZRANGE', holders, -1, -1, 'WITHSCORES')
  if #last == 0 then
    redis.call('DEL', holders, tokens)
    return 0
  end
  local at = tonumber(last[2])
  redis.call('PEXPIREAT', holders, at)
  redis.call('PEXPIREAT', tokens, at)
  if also then redis.call('PEXPIREAT', also, at) end
  return at
end

-- a place for a waiter (entry w, id) among the holders: published to its manager, or given back
-- at once when nobody listens there (0 receivers). `me`: the caller itself, told by its reply.
local function grant(holders, tokens, fence, fence_ttl, w, id, now, key, me)
  local token = string.format('%.0f', mint(fence, fence_ttl, now))
  redis.call('ZADD', holders, ms(now) + w[2], w[3])
  redis.call('HSET', tokens, w[3], token)
  if id == me then return token end
  redis.call('HSET', tokens, 'u:' .. w[3], id)
  local publish = 'PUBLISH'
  if w[6] == 1 then publish = 'SPUBLISH' end
  if redis.call(publish, w[5], id .. ' ' .. token .. ' ' .. key) > 0 then return token end
  redis.call('ZREM', holders, w[3])
  redis.call('HDEL', tokens, w[3], 'u:' .. w[3])
  return false
end

-- the caller's own new place among the holders (no grant notice, nothing to claim): the keys live
-- at least as long as its lease; the answer of an ACQUIRE that holds
local function joined(holders, tokens, also, token, lease, now_ms, queued, queue, waiters, waiter)
  if queued then unqueue(queue, waiters, waiter) end
  local at = now_ms + lease
  if redis.call('PEXPIRETIME', holders) < at then
    redis.call('PEXPIREAT', holders, at)
    redis.call('PEXPIREAT', tokens, at)
  end
  if also and redis.call('PEXPIRETIME', also) < at then redis.call('PEXPIREAT', also, at) end
  return {1, tonumber(token), 1}
end
"""

_PERMITS = _MEMBERS + r"""
-- KEYS: holders, fence, queue, waiters, tokens
-- free permits go to the head waiters, in order
local function fill(limit, fence_ttl, now, me)
  while redis.call('ZCARD', KEYS[1]) < limit do
    local member, id, w = head(KEYS[3], KEYS[4], now)
    if not member then return end
    unqueue(KEYS[3], KEYS[4], member)
    grant(KEYS[1], KEYS[5], KEYS[2], fence_ttl, w, id, now, KEYS[1], me)
  end
end

local function settle(fence_ttl, now)
  local limit = tonumber(redis.call('HGET', KEYS[5], '#limit') or '0')
  if limit > 0 then fill(limit, fence_ttl, now, nil) end
  if cover(KEYS[1], KEYS[5], nil) > 0 then redis.call('HSET', KEYS[5], '#limit', limit) end
end
"""

# PERMIT_ACQUIRE: take a permit, claim one handed over, or join the queue.
# KEYS: holders, fence, queue, waiters, tokens
# ARGV: as ACQUIRE (owner, waiter id, lease_ms, -, queue_ms, ctx, fence_ttl_ms,
#       wake channel, sharded), then the limit
# Returns {1, token, 1} when held, {0, ms until the first lease ends, ''} when
# all permits are taken, {-2, limit, ''} when the key has another limit.
PERMIT_ACQUIRE = _PERMITS + r"""
local owner, waiter, lease, limit = ARGV[1], ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[10])
local id = waiter_id(waiter)
local now = now_us()
local now_ms = ms(now)
purge(KEYS[1], KEYS[5], now_ms)
local set = tonumber(redis.call('HGET', KEYS[5], '#limit') or '0')
if set ~= 0 and set ~= limit then return {-2, set, ''} end
local function held()
  local score = redis.call('ZSCORE', KEYS[1], owner)
  if not score then return nil end
  if tonumber(score) < now_ms + lease then redis.call('ZADD', KEYS[1], now_ms + lease, owner) end
  redis.call('HDEL', KEYS[5], 'u:' .. owner)
  unqueue(KEYS[3], KEYS[4], waiter)
  cover(KEYS[1], KEYS[5], nil)
  redis.call('HSET', KEYS[5], '#limit', limit)
  return {1, tonumber(redis.call('HGET', KEYS[5], owner)), 1}
end
-- handed over and not claimed yet, or this request sent again
local mine = held()
if mine then return mine end
-- waiters first (a crashed holder's permit came back with its lease), then this caller
local me = nil
if ARGV[5] ~= '-1' then me = id end
fill(limit, ARGV[7], now, me)
mine = held()
if mine then return mine end
if redis.call('ZCARD', KEYS[1]) < limit then
  local token = grant(KEYS[1], KEYS[5], KEYS[2], ARGV[7], {0, lease, owner}, id, now, KEYS[1], id)
  if set == 0 then redis.call('HSET', KEYS[5], '#limit', limit) end
  return joined(KEYS[1], KEYS[5], nil, token, lease, now_ms, ARGV[5] ~= '-1', KEYS[3], KEYS[4], waiter)
end
if ARGV[5] ~= '-1' then
  queue_entry(KEYS[3], KEYS[4], waiter, now, tonumber(ARGV[5]), lease, owner, ARGV[6], ARGV[8],
              tonumber(ARGV[9] or '0'), 'p')
end
local first = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
if #first == 0 then return {0, -1, ''} end
return {0, tonumber(first[2]) - now_ms, ''}
"""

# PERMIT_RELEASE: owner-checked; the freed permit goes to the head waiter.
# KEYS: as PERMIT_ACQUIRE. ARGV: owner, fence_ttl_ms, (ignored: a permit does not nest in Redis)
# Returns 0 when released, -1 when the owner held no permit (its lease ran out).
PERMIT_RELEASE = _PERMITS + r"""
local now = now_us()
purge(KEYS[1], KEYS[5], ms(now))
local had = redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('HDEL', KEYS[5], ARGV[1], 'u:' .. ARGV[1])
settle(ARGV[2], now)
if had == 1 then return 0 end
return -1
"""

# PERMIT_LEAVE: a waiter gives up; a permit handed to it and not claimed yet is passed on.
# KEYS: as PERMIT_ACQUIRE. ARGV: waiter id (its owner), fence_ttl_ms
# Returns 1 when a permit was passed on, else 0.
PERMIT_LEAVE = _PERMITS + r"""
unqueue(KEYS[3], KEYS[4], ARGV[1])
local id = waiter_id(ARGV[1])
if not redis.call('HGET', KEYS[5], 'u:' .. id) then return 0 end
redis.call('ZREM', KEYS[1], id)
redis.call('HDEL', KEYS[5], id, 'u:' .. id)
local now = now_us()
purge(KEYS[1], KEYS[5], ms(now))
settle(ARGV[2], now)
return 1
"""

_SHARED = _MEMBERS + r"""
-- KEYS: lock, fence, queue, waiters, shared holders, tokens
-- Hand the lock on from its head waiters: with `shared` false (nobody holds it) the first live waiter,
-- alone if it is exclusive; then every consecutive shared waiter. Deletes the lock when nobody got it.
local function hand_on(shared, fence_ttl, me)
  local now = now_us()
  while true do
    local member, id, w = head(KEYS[3], KEYS[4], now)
    if not member then break end
    if w[7] ~= 's' then
      if shared then break end
      unqueue(KEYS[3], KEYS[4], member)
      local token = string.format('%.0f', mint(KEYS[2], fence_ttl, now))
      redis.call('HSET', KEYS[1], 'owner', w[3], 'depth', 1, 'token', token, 'ctx', w[4], 'waiter', id)
      redis.call('PEXPIRE', KEYS[1], w[2])
      local publish = 'PUBLISH'
      if w[6] == 1 then publish = 'SPUBLISH' end
      if redis.call(publish, w[5], id .. ' ' .. token .. ' ' .. KEYS[1]) > 0 then return end
    else
      unqueue(KEYS[3], KEYS[4], member)
      if not shared then
        redis.call('DEL', KEYS[1], KEYS[5], KEYS[6])
        redis.call('HSET', KEYS[1], 'owner', SHARED, 'depth', 1, 'token', 0, 'ctx', w[4])
        shared = true
      end
      grant(KEYS[5], KEYS[6], KEYS[2], fence_ttl, w, id, now, KEYS[1], me)
    end
  end
  if shared and cover(KEYS[5], KEYS[6], KEYS[1]) > 0 then return end
  redis.call('DEL', KEYS[1], KEYS[5], KEYS[6])
end

-- after a shared holder left (or its lease ran out; `purged`: the caller dropped the lapsed ones): hand on
-- if it was the last
local function settle(fence_ttl, purged)
  if not purged then purge(KEYS[5], KEYS[6], ms(now_us())) end
  if redis.call('ZCARD', KEYS[5]) > 0 then
    cover(KEYS[5], KEYS[6], KEYS[1])
  else
    redis.call('DEL', KEYS[1])
    hand_on(false, fence_ttl, nil)
  end
end
"""

# SHARED_ACQUIRE: hold the lock shared, claim a grant (shared, or exclusive-style from a plain
# RELEASE: turned shared here), or join the queue behind whoever waits.
# KEYS: lock, fence, queue, waiters, shared holders, tokens
# ARGV: as ACQUIRE (owner, waiter id, lease_ms, -, queue_ms, ctx, fence_ttl_ms, wake channel, sharded)
# Returns {1, token, 1} when held, {0, pttl_ms, holder_ctx} when busy.
SHARED_ACQUIRE = _SHARED + r"""
local owner, waiter, lease = ARGV[1], ARGV[2], tonumber(ARGV[3])
local id = waiter_id(waiter)
local now = now_us()
local now_ms = ms(now)
local function held()
  local score = redis.call('ZSCORE', KEYS[5], owner)
  if not score or redis.call('HGET', KEYS[1], 'owner') ~= SHARED then return nil end
  if tonumber(score) < now_ms + lease then redis.call('ZADD', KEYS[5], now_ms + lease, owner) end
  redis.call('HDEL', KEYS[6], 'u:' .. owner)
  unqueue(KEYS[3], KEYS[4], waiter)
  cover(KEYS[5], KEYS[6], KEYS[1])
  return {1, tonumber(redis.call('HGET', KEYS[6], owner)), 1}
end
local holder = redis.call('HGET', KEYS[1], 'owner')
if holder == owner and redis.call('HGET', KEYS[1], 'waiter') == id then
  -- handed over by a plain RELEASE as if exclusive: share it, and let the shared waiters behind in
  local token = redis.call('HGET', KEYS[1], 'token')
  -- a hand-over's token may be ahead of the fence (`hand_over`); the shared grants mint from the fence
  redis.call('SET', KEYS[2], token, 'PX', ARGV[7])
  redis.call('DEL', KEYS[1], KEYS[5], KEYS[6])
  redis.call('HSET', KEYS[1], 'owner', SHARED, 'depth', 1, 'token', 0, 'ctx', ARGV[6])
  redis.call('ZADD', KEYS[5], now_ms + lease, owner)
  redis.call('HSET', KEYS[6], owner, token)
  hand_on(true, ARGV[7], nil)
  return held()
end
if holder == SHARED then
  purge(KEYS[5], KEYS[6], now_ms)
  local mine = held()
  if mine then return mine end
  if redis.call('ZCARD', KEYS[5]) == 0 then
    -- every shared lease ran out: hand on in order (this caller among them, if it waits)
    redis.call('DEL', KEYS[1])
    hand_on(false, ARGV[7], id)
    mine = held()
    if mine then return mine end
    holder = redis.call('HGET', KEYS[1], 'owner')
  end
end
local queued = ARGV[5] ~= '-1'
if holder == SHARED then
  local first = head(KEYS[3], KEYS[4], now)
  if not first or first == waiter then
    -- nobody waits ahead (an exclusive waiter would): join the holders
    local token = grant(KEYS[5], KEYS[6], KEYS[2], ARGV[7], {0, lease, owner}, id, now, KEYS[1], id)
    redis.call('HSET', KEYS[1], 'ctx', ARGV[6])
    local mine = joined(KEYS[5], KEYS[6], KEYS[1], token, lease, now_ms, queued, KEYS[3], KEYS[4], waiter)
    -- from the head (the waiter ahead died queued): the shared waiters right behind come in with it
    if first then hand_on(true, ARGV[7], nil) end
    return mine
  end
end
if not holder then
  -- free (like an exclusive ACQUIRE, a free lock is taken whoever waits for a lapsed holder)
  redis.call('DEL', KEYS[5], KEYS[6])
  redis.call('HSET', KEYS[1], 'owner', SHARED, 'depth', 1, 'token', 0, 'ctx', ARGV[6])
  local token = grant(KEYS[5], KEYS[6], KEYS[2], ARGV[7], {0, lease, owner}, id, now, KEYS[1], id)
  redis.call('PEXPIRE', KEYS[1], lease)
  return joined(KEYS[5], KEYS[6], nil, token, lease, now_ms, queued, KEYS[3], KEYS[4], waiter)
end
if ARGV[5] ~= '-1' then
  queue_entry(KEYS[3], KEYS[4], waiter, now, tonumber(ARGV[5]), lease, owner, ARGV[6], ARGV[8],
              tonumber(ARGV[9] or '0'), 's')
end
return {0, redis.call('PTTL', KEYS[1]), redis.call('HGET', KEYS[1], 'ctx') or ''}
"""

# SHARED_RELEASE: owner-checked; the last shared holder hands the lock on.
# KEYS: as SHARED_ACQUIRE. ARGV: owner, fence_ttl_ms, (ignored: shared holds nest locally)
# Returns 0 when released, -1 when the owner held no shared lease (it ran out, or was forced).
SHARED_RELEASE = _SHARED + r"""
if redis.call('HGET', KEYS[1], 'owner') ~= SHARED then return -1 end
purge(KEYS[5], KEYS[6], ms(now_us()))
local had = redis.call('ZREM', KEYS[5], ARGV[1])
redis.call('HDEL', KEYS[6], ARGV[1], 'u:' .. ARGV[1])
settle(ARGV[2], true)
if had == 1 then return 0 end
return -1
"""

# SHARED_LEAVE: a shared waiter gives up; a grant to it not claimed yet (shared, or exclusive-style) is passed on.
# KEYS: as SHARED_ACQUIRE. ARGV: waiter id (its owner), fence_ttl_ms
# Returns 1 when a grant was passed on, else 0.
SHARED_LEAVE = _SHARED + r"""
unqueue(KEYS[3], KEYS[4], ARGV[1])
local id = waiter_id(ARGV[1])
if redis.call('HGET', KEYS[1], 'waiter') == id then
  redis.call('DEL', KEYS[1])
  hand_on(false, ARGV[2], nil)
  return 1
end
if redis.call('HGET', KEYS[1], 'owner') == SHARED and redis.call('HGET', KEYS[6], 'u:' .. id) then
  redis.call('ZREM', KEYS[5], id)
  redis.call('HDEL', KEYS[6], id, 'u:' .. id)
  settle(ARGV[2], false)
  return 1
end
return 0
"""

# EXCLUSIVE_LEAVE: an exclusive waiter gives up (timeout, cancellation, gone). A lock handed to it meanwhile
# and not claimed yet is passed on at once; on a key held shared, the shared waiters it kept out (they queue
# behind a waiting writer) are let in now, not at their fallback poll.
# KEYS: as SHARED_ACQUIRE. ARGV: waiter (its queue member, or its id), fence_ttl_ms.
# Returns 1 when a hand-over to this waiter was passed on, else 0.
EXCLUSIVE_LEAVE = _SHARED + r"""
unqueue(KEYS[3], KEYS[4], ARGV[1])
local handed = redis.call('HMGET', KEYS[1], 'waiter', 'token', 'owner')
if handed[1] == waiter_id(ARGV[1]) then
  hand_over(KEYS[1], KEYS[2], KEYS[3], KEYS[4], ARGV[2], handed[2])
  return 1
end
if handed[3] == SHARED then
  purge(KEYS[5], KEYS[6], ms(now_us()))
  local shared = redis.call('ZCARD', KEYS[5]) > 0
  if not shared then redis.call('DEL', KEYS[1]) end
  hand_on(shared, ARGV[2], nil)
end
return 0
"""

# RENEW_MEMBERS: extend many shared or permit leases in one call.
# KEYS: per lease: guard, holders, tokens (guard: the lock's hash for a shared lease, else the holders)
# ARGV: per lease: owner, lease_ms
# Returns one 1 (renewed) or 0 (no longer held) per lease.
RENEW_MEMBERS = r"""
local t = redis.call('TIME')
local now_ms = math.floor((tonumber(t[1]) * 1000000 + tonumber(t[2])) / 1000)
local out = {}
for i = 1, #KEYS / 3 do
  local guard, holders, tokens = KEYS[3 * i - 2], KEYS[3 * i - 1], KEYS[3 * i]
  local owner, lease = ARGV[2 * i - 1], tonumber(ARGV[2 * i])
  local score = redis.call('ZSCORE', holders, owner)
  local ok = score and tonumber(score) > now_ms
  if ok and guard ~= holders then ok = redis.call('HGET', guard, 'owner') == '(shared)' end
  if ok then
    local at = now_ms + lease
    if tonumber(score) < at then redis.call('ZADD', holders, at, owner) end
    if redis.call('PEXPIRETIME', holders) < at then
      redis.call('PEXPIREAT', holders, at)
      redis.call('PEXPIREAT', tokens, at)
    end
    if guard ~= holders and redis.call('PEXPIRETIME', guard) < at then redis.call('PEXPIREAT', guard, at) end
    out[i] = 1
  else
    out[i] = 0
  end
end
return out
"""

# FORCE_RELEASE_SHARED: an operator's release of a key held shared: every shared holder goes, the waiters get it.
# KEYS: as SHARED_ACQUIRE. ARGV: fence_ttl_ms. Returns the number of shared holders released.
FORCE_RELEASE_SHARED = _SHARED + r"""
if redis.call('HGET', KEYS[1], 'owner') ~= SHARED then return 0 end
local n = redis.call('ZCARD', KEYS[5])
redis.call('DEL', KEYS[1], KEYS[5], KEYS[6])
hand_on(false, ARGV[1], nil)
return n
"""


@dataclass(frozen=True)
class Shape:
    """What one kind of hold is made of in Redis: its mode (the `lock.mode` attribute), scripts and keys."""

    mode: str                 # exclusive | shared | permit
    acquire: Script
    release: Script
    leave: Script
    suffixes: tuple[str, ...]  # appended to the lock's key, in the scripts' KEYS order
    trust_grants: bool         # a grant notice is a hold (else it is confirmed by one ACQUIRE)
    leave_also: tuple[str, ...] = ()  # LEAVE's KEYS beyond the others' (an exclusive waiter's: the shared holders)

    def keys(self, redis_key: str) -> tuple[str, ...]:
        """The scripts' KEYS for the lock `S:{N}`: all under its hash tag."""
        return tuple(map(redis_key.__add__, self.suffixes))  # no generator frame: twice per hand-over

    def leave_keys(self, keys: tuple[str, ...]) -> tuple[str, ...]:
        """LEAVE's KEYS, from the others' (`keys()`)."""
        return keys + tuple(map(keys[0].__add__, self.leave_also)) if self.leave_also else keys

    def main_key(self, redis_key: str) -> str:
        """The key a hold is known by (`held.key`, grant notices): KEYS[1]."""
        return redis_key + self.suffixes[0]

    def renew_keys(self, main_key: str) -> tuple[str, str, str]:
        """RENEW_MEMBERS's (guard, holders, tokens) of a hold known by `main_key`."""
        if self.mode == "shared":
            return main_key, main_key + ":sh", main_key + ":sh:t"
        return main_key, main_key, main_key + ":t"


EXCLUSIVE = Shape("exclusive", _scripts.acquire, _scripts.release, Script(EXCLUSIVE_LEAVE),
                  ("", ":fence", ":q", ":w"), True, (":sh", ":sh:t"))
SHARED = Shape("shared", Script(SHARED_ACQUIRE), Script(SHARED_RELEASE), Script(SHARED_LEAVE),
               ("", ":fence", ":q", ":w", ":sh", ":sh:t"), False)
PERMIT = Shape("permit", Script(PERMIT_ACQUIRE), Script(PERMIT_RELEASE), Script(PERMIT_LEAVE),
               (":permits", ":permits:fence", ":permits:q", ":permits:w", ":permits:t"), True)
SHAPES = {shape.mode: shape for shape in (EXCLUSIVE, SHARED, PERMIT)}

renew_members = Script(RENEW_MEMBERS)
force_release_shared = Script(FORCE_RELEASE_SHARED)


def shape_of_key(main_key: str) -> tuple[Shape, str]:
    """(shape, lock key `S:{N}`) of a key grants are published with (an orphan grant's pass-on)."""
    if main_key.endswith("}:permits"):
        return PERMIT, main_key[: -len(":permits")]
    return EXCLUSIVE, main_key
