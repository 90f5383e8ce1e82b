"""Every Lua script of otel-lock, with the Redis data model they share.

One lock named N in namespace S uses these keys, all under the Redis
Cluster hash tag `{N}` so that a script can touch them together on any
topology (data model 2):

    S:{N}        hash   owner, depth, token, ctx (holder's traceparent),
                        waiter (id of the waiter it was handed to; emptied
                        when that waiter claims it by a request of its own)
    S:{N}:fence  string the last token minted from the clock, raised to the
                        last token when the lock key goes after a hand-over;
                        expires `fence_ttl` after its last write
    S:{N}:q      zset   waiting callers in arrival order (score: Redis time,
                        us); a member is the waiter's whole entry, a JSON
                        array its client made: [id, wait budget ms (0:
                        none), lease_ms, owner, ctx, wake channel, sharded
                        (1: SPUBLISH), and for a shape's waiter its mode]
    S:{N}:w      hash   only for waiters of model 1 (0.2.0 and earlier,
                        read for one release): id -> JSON [deadline_us,
                        lease_ms, owner, ctx, wake channel, sharded, mode]

Fencing tokens are seeded from Redis `TIME` in microseconds and bumped past
the fence, so they increase strictly per key even after the fence key has
expired, without leaving a permanent key behind per lock name. A hand-over
gives the next waiter the last token + 1, without reading the clock or the
fence: a chain of hand-overs cannot outrun the microsecond clock (each one
is a script run of several microseconds), and the fence is written when the
lock key goes (a release that finds nobody waiting, after a hand-over).

A waiter that already holds locks records what it waits for, so that a
wait that would close a cycle of holders waiting on each other is refused
(`_deadlock.py`), one key per lock it holds:

    S:waits:<owner>  string JSON [lock key waited for, waiter (its queue
                        member), holder (task@pid/manager), queued (1: in
                        that lock's queue), how it waits (x exclusive, s
                        shared, p a permit; absent: x)]; expires with the
                        wait, deleted when it ends

Shared holds and permits (`_shapes.py`) add keys of their own under the
same hash tag and scripts of their own; they queue in the same queue, their
entries carrying their mode.

The namespace itself carries the version of this layout (MODEL), so that
two otel-lock versions with layouts that cannot read each other never
share a namespace untold (a rolling deploy across a data-model change):

    S:model      string the data model of the managers using S; expires a
                        week after the last manager started using it

Model 1 queued a waiter's id with its entry in `S:{N}:w`, and minted every
grant's token from the clock and the fence (17 Redis commands per
contended hand-over; model 2: 12). These scripts read both kinds of queue
member, and so do 0.2.0's (model 1), so managers of 0.2.0 and of model 2
share a namespace (SHARES_WITH); 0.1.0's cannot read model 2's members.

A release with waiters hands the lock to the first live waiter (FIFO) with
that waiter's *full* lease and publishes `<waiter id> <token> <lock key>` on
its manager's channel only. A waiter whose manager is gone has no subscriber
(PUBLISH answers 0) and is skipped in the same call, so dead waiters cost
nothing. The waiter times its lease from the send time of its own queued
request, which Redis ran before the hand-over: no Redis clock is involved.
"""

from __future__ import annotations

import hashlib
from typing import Any, Awaitable, Protocol, Sequence

from redis.exceptions import NoPermissionError, NoScriptError, ResponseError

_COMMON = r"""
local function now_us()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000000 + tonumber(t[2])
end

-- `last`: the newest token of this fence when the caller knows it (an exclusive holder's own: nothing
-- else mints on the fence while it holds), which saves reading the fence
local function next_token(fence, now, last)
  local token = now
  last = tonumber(last or redis.call('GET', fence) or '0')
  if last >= token then token = last + 1 end
  return token
end

-- a token that the fence records at once (a shape's grant: the fence is the shape's only record of it)
local function mint(fence, fence_ttl_ms, now, last)
  local token = next_token(fence, now, last)
  redis.call('SET', fence, string.format('%.0f', token), 'PX', fence_ttl_ms)
  return token
end

-- A queue member is the waiter's entry itself (model 2): a JSON array its client made, [id, wait budget ms
-- (0: none), lease_ms, owner, ctx, wake channel, sharded (1: SPUBLISH), and for a shape's waiter its mode];
-- its deadline is its score (the arrival, Redis time in us) plus the budget. Managers of model 1 (0.2.0 and
-- earlier) queue the waiter's id instead, with its entry in the waiters hash: both are read, for one release.
local function is_record(member) return string.byte(member, 1) == 91 end

local function waiter_id(member)
  if is_record(member) then return cjson.decode(member)[1] end
  return member
end

local function unqueue(queue, waiters, member)
  redis.call('ZREM', queue, member)
  if not is_record(member) then redis.call('HDEL', waiters, member) end
end

-- a member's id and entry {deadline_us (0: none), lease_ms, owner, ctx, channel, sharded, mode}, nil for a
-- model 1 entry gone from the hash; `drop`: the member left the queue, delete a model 1 entry from the hash
local function entry(waiters, member, score, drop)
  if is_record(member) then
    local r = cjson.decode(member)
    local deadline = 0
    if r[2] > 0 then deadline = tonumber(score) + r[2] * 1000 end
    return r[1], {deadline, r[3], r[4], r[5], r[6], r[7], r[8]}
  end
  local info = redis.call('HGET', waiters, member)
  if not info then return member, nil end
  if drop then redis.call('HDEL', waiters, member) end
  return member, cjson.decode(info)
end

-- Hand the lock on to the first live waiter. `last`: the token of the exclusive hold being passed on (none
-- for a shared one, a `0`). A waiter of model 2 gets the next token, `last` + 1, without a look at the
-- clock or the fence, which learns the last token when the lock key goes. A waiter of model 1 is dated
-- and minted as model 1 did.
local function hand_over(lock, fence, queue, waiters, fence_ttl_ms, last)
  if tonumber(last or '0') <= 0 then last = nil end
  local now = nil
  while true do
    local head = redis.call('ZPOPMIN', queue)
    if #head == 0 then
      if last then redis.call('SET', fence, last, 'PX', fence_ttl_ms) end
      redis.call('DEL', lock)
      return 0
    end
    local id, w = entry(waiters, head[1], head[2], true)
    local token = nil
    if w and last and is_record(head[1]) then
      token = string.format('%.0f', tonumber(last) + 1)
    elseif w then
      now = now or now_us()
      if w[1] == 0 or w[1] > now then token = string.format('%.0f', mint(fence, fence_ttl_ms, now, last)) end
    end
    if token then
      last = token
      -- every field is overwritten, so the previous holder's hash needs no DEL
      redis.call('HSET', lock, 'owner', w[3], 'depth', 1, 'token', token, 'ctx', w[4], 'waiter', id)
      redis.call('PEXPIRE', lock, w[2])
      -- 0 receivers: the waiter's manager is gone; skip it now, not after its lease.
      -- w[6] == 1: a Redis Cluster waiter, subscribed to a shard channel in this slot.
      local publish = 'PUBLISH'
      if w[6] == 1 then publish = 'SPUBLISH' end
      if redis.call(publish, w[5], id .. ' ' .. token .. ' ' .. lock) > 0 then
        return 1
      end
    end
  end
end

-- a waiter joins the queue (once: a request sent again keeps its place). The queue (and a model 1
-- entry's hash) outlive the longest wait by a minute; their expiry is pushed 30 s further each time it
-- runs short, not at every arrival. `mode`: a shape's waiter's, for a model 1 entry (a record has its own)
local function queue_entry(queue, waiters, member, now, budget, lease, owner, ctx, channel, sharded, mode)
  if redis.call('ZADD', queue, 'NX', now, member) == 1 then
    local deadline, keep_ms = 0, 3600000
    if budget > 0 then deadline, keep_ms = now + budget * 1000, budget + 60000 end
    local record = is_record(member)
    if not record then
      redis.call('HSET', waiters, member, cjson.encode({deadline, lease, owner, ctx, channel, sharded, mode}))
    end
    if redis.call('PTTL', queue) < keep_ms then
      redis.call('PEXPIRE', queue, keep_ms + 30000)
      if not record then redis.call('PEXPIRE', waiters, keep_ms + 30000) end
    end
  end
end
"""

# ACQUIRE: take the lock, claim a hand-over, re-enter it, or join its queue.
# KEYS: lock, fence, queue, waiters
# ARGV: owner, waiter (its queue member: model 2, the waiter's entry as a JSON array; model 1 and a call
#       that does not queue, its id; '-': re-entry of a hold the caller has),
#       lease_ms, reenter ('1': same owner may nest),
#       queue_ms (-1: do not queue; 0: queue without deadline; n: queue for n ms),
#       ctx (traceparent), fence_ttl_ms, wake channel, sharded ('1': the
#       channel is a Redis Cluster shard channel in the lock's slot)
# Returns {1, token, depth} when held, {0, pttl_ms, holder_ctx} when busy.
ACQUIRE = _COMMON + r"""
local lock, fence, queue, waiters = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local owner, waiter, lease = ARGV[1], ARGV[2], ARGV[3]
local held = redis.call('HMGET', lock, 'owner', 'waiter', 'depth', 'token', 'ctx')
local holder = held[1]
if holder == owner then
  local depth
  if held[2] and held[2] == waiter_id(waiter) then
    -- handed to this waiter (its wake-up not read yet): claimed, with a lease from this request
    redis.call('HDEL', lock, 'waiter')
    depth = 1
  elseif ARGV[4] == '1' then
    depth = redis.call('HINCRBY', lock, 'depth', 1)
  else
    -- a fresh owner is unique to one attempt: this is that attempt sent again
    -- (a client retry after a lost reply), and the lock is already its own
    depth = tonumber(held[3])
  end
  if redis.call('PTTL', lock) < tonumber(lease) then redis.call('PEXPIRE', lock, lease) end
  if ARGV[5] ~= '-1' then unqueue(queue, waiters, waiter) end
  return {1, tonumber(held[4]), depth}
end
if waiter == '-' then
  -- a re-entry whose outer hold is gone: never take the lock afresh under the old owner
  return {0, redis.call('PTTL', lock), ''}
end
if not holder then
  -- the fence learns this token when the lock key goes (RELEASE): a held lock is one key
  local token = next_token(fence, now_us())
  redis.call('DEL', lock)
  redis.call('HSET', lock, 'owner', owner, 'depth', 1, 'token', string.format('%.0f', token), 'ctx', ARGV[6])
  redis.call('PEXPIRE', lock, lease)
  if ARGV[5] ~= '-1' then unqueue(queue, waiters, waiter) end
  return {1, token, 1}
end
if ARGV[5] ~= '-1' then
  queue_entry(queue, waiters, waiter, now_us(), tonumber(ARGV[5]), tonumber(lease), owner, ARGV[6], ARGV[8],
              tonumber(ARGV[9] or '0'))
end
return {0, redis.call('PTTL', lock), held[5] or ''}
"""

# RELEASE: owner-checked; the last release hands the lock to the next live waiter.
# KEYS: lock, fence, queue, waiters
# ARGV: owner, fence_ttl_ms, all ('1': the caller's last hold of a private
#       owner, so release whatever depth Redis counted: a re-entry whose reply
#       was lost may have counted one more)
# Returns -1 when the caller is not the owner (nothing touched), else the
# depth left (0: released, and handed over if anyone waited).
RELEASE = _COMMON + r"""
local held = redis.call('HMGET', KEYS[1], 'owner', 'token')
if held[1] ~= ARGV[1] then return -1 end
local depth = 0
if ARGV[3] ~= '1' then depth = redis.call('HINCRBY', KEYS[1], 'depth', -1) end
if depth > 0 then return depth end
hand_over(KEYS[1], KEYS[2], KEYS[3], KEYS[4], ARGV[2], held[2])
return 0
"""

# RENEW: extend many leases in one call.
# KEYS: lock keys
# ARGV: owner and lease_ms for each key, in order (2 per key)
# Returns one 1 (renewed) or 0 (no longer ours) per key.
RENEW = r"""
local out = {}
for i = 1, #KEYS do
  if redis.call('HGET', KEYS[i], 'owner') == ARGV[2 * i - 1] then
    redis.call('PEXPIRE', KEYS[i], ARGV[2 * i])
    out[i] = 1
  else
    out[i] = 0
  end
end
return out
"""

# FORCE_RELEASE: release whoever holds the lock (operator command), then hand over.
# KEYS: lock, fence, queue, waiters
# ARGV: fence_ttl_ms
# Returns 1 if a lock was held, else 0.
FORCE_RELEASE = _COMMON + r"""
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
hand_over(KEYS[1], KEYS[2], KEYS[3], KEYS[4], ARGV[1], redis.call('HGET', KEYS[1], 'token'))
return 1
"""


# WAIT_FOR: a waiter that holds locks is about to wait for one more. Walk lock -> its holders -> the
# lock each waits for -> ... ; reaching an owner of the caller's is a cycle: refuse. Otherwise record that
# the caller's owners wait for the lock. Atomic on one Redis: of two waiters closing one cycle at the same
# moment, the first records its wait and the second finds the cycle.
# What blocks a wait depends on how it waits (the record's 5th element; a record without it, exclusive):
#   x  an exclusive wait: the lock's owner, or every shared holder; one of them stuck is enough
#   s  a shared wait: the exclusive owner; on a key held shared, every shared holder (one stuck is enough)
#      when an exclusive waiter is queued ahead of it (it goes first, once they have all left), else none
#   p  a permit wait: every permit holder when none is free; stuck only if all of them are
# Only a cycle through the caller's own holds is refused (one of others it merely waits behind is not);
# a walk longer than 64 holders is no cycle (never a false refusal).
# KEYS: none (the walk reads the keys it finds: one Redis or a Sentinel master only, never a Cluster)
# ARGV: namespace, lock key waited for, waiter (its queue member when queued), ttl_ms, holder (task label), queued ('1': the waiter
#       is in the lock's queue), how it waits (x, s, p), then the owner of each lock the caller holds
# Returns {0} when recorded, or {1, key, owner, holder, key, owner, holder, ...}: the cycle, from the
# lock waited for to the caller's own.
WAIT_FOR = r"""
local ns, want, me = ARGV[1], ARGV[2], ARGV[5]
local mine = {}
for i = 8, #ARGV do mine[ARGV[i]] = true end
local t = redis.call('TIME')
local now_ms = math.floor((tonumber(t[1]) * 1000000 + tonumber(t[2])) / 1000)
local steps, walking = 0, {}

-- is an exclusive waiter queued ahead of `waiter` (anywhere in the queue when it is not queued)? Looks
-- at the 64 first only (beyond them: no, never a false refusal)
local function exclusive_ahead(key, waiter)
  local queue = key .. ':q'
  local mine = redis.call('ZSCORE', queue, waiter)
  local ahead
  if mine then ahead = redis.call('ZRANGEBYSCORE', queue, '-inf', '(' .. mine, 'LIMIT', 0, 64)
  else ahead = redis.call('ZRANGE', queue, 0, 63) end
  for i = 1, #ahead do
    -- a waiter's entry: the member itself (model 2, mode 8th), or in the waiters hash (model 1, mode 7th)
    local mode
    if string.byte(ahead[i], 1) == 91 then
      mode = cjson.decode(ahead[i])[8] or 'x'
    else
      local info = redis.call('HGET', key .. ':w', ahead[i])
      if info then mode = cjson.decode(info)[7] or 'x' end
    end
    if mode == 'x' then return true end
  end
  return false
end

-- who keeps a wait of kind `how` by `waiter` for `key` from ending, and whether all of them must be stuck
local function holders(key, how, waiter)
  if how == 'p' then
    local held = redis.call('ZRANGEBYSCORE', key, '(' .. now_ms, '+inf')
    if #held < tonumber(redis.call('HGET', key .. ':t', '#limit') or '0') then return {}, true end
    return held, true
  end
  local owner = redis.call('HGET', key, 'owner')
  if not owner then return {}, false end
  if owner ~= '(shared)' then return {owner}, false end
  if how == 's' and not exclusive_ahead(key, waiter) then return {}, false end
  return redis.call('ZRANGEBYSCORE', key .. ':sh', '(' .. now_ms, '+inf'), false
end

-- Is the holder `owner` of `key` stuck? nil: no; a table: yes, by way of the caller (the path to it);
-- true: yes if the holders on the walk already are (they are assumed stuck: a cycle of others, or one
-- that a permit's other holder closes through the caller)
local stuck
local function through(key, owner)
  if mine[owner] then return {key, owner, me} end
  if walking[owner] then return true end
  steps = steps + 1
  if steps > 64 then return nil end
  local edge = redis.call('GET', ns .. ':waits:' .. owner)
  if not edge then return nil end
  local e = cjson.decode(edge)
  -- a wait that ended without its record being deleted yet (granted, left): no edge
  if e[4] == 1 and not redis.call('ZSCORE', e[1] .. ':q', e[2]) then return nil end
  walking[owner] = true
  local rest = stuck(e[1], e[5] or 'x', e[2])
  walking[owner] = nil
  if type(rest) ~= 'table' then return rest end
  local path = {key, owner, e[3]}
  for i = 1, #rest do path[#path + 1] = rest[i] end
  return path
end

stuck = function(key, how, waiter)
  local held, all = holders(key, how, waiter)
  local found = nil
  for i = 1, #held do
    local r = through(key, held[i])
    if all and not r then return nil end
    if type(r) == 'table' then
      if not all then return r end
      if type(found) ~= 'table' then found = r end
    elseif r and not found then
      found = true
    end
  end
  return found
end

local cycle = stuck(want, ARGV[7], ARGV[3])
if type(cycle) == 'table' then
  table.insert(cycle, 1, 1)
  return cycle
end
local edge = cjson.encode({want, ARGV[3], me, tonumber(ARGV[6]), ARGV[7]})
for i = 8, #ARGV do redis.call('SET', ns .. ':waits:' .. ARGV[i], edge, 'PX', ARGV[4]) end
return {0}
"""

# WAIT_OVER: the wait ended: delete its records, unless a later wait of the same owner replaced them.
# KEYS: S:waits:<owner> of each owner it recorded (one per call on a Cluster)
# ARGV: waiter (as WAIT_FOR named it)
# Returns 0.
WAIT_OVER = r"""
for i = 1, #KEYS do
  local edge = redis.call('GET', KEYS[i])
  if edge and cjson.decode(edge)[2] == ARGV[1] then redis.call('DEL', KEYS[i]) end
end
return 0
"""


# MODEL_CHECK: claim the namespace for this data model, or say which one holds it.
# KEYS: S:model. ARGV: model, ttl_s, then the other models this one shares a namespace with (it reads
# what they write, and they read what it writes)
# Returns the model the namespace holds: ours or one we share with (now claimed for another ttl_s), or
# another one (not claimed).
MODEL_CHECK = r"""
local held = redis.call('GET', KEYS[1])
if held and held ~= ARGV[1] then
  local shared = false
  for i = 3, #ARGV do if held == ARGV[i] then shared = true end end
  if not shared then return held end
end
redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[2])
return ARGV[1]
"""

# Every command the Lua scripts here, in `_shapes.py` and in `_redlock_scripts.py` call, besides PUBLISH
# (SPUBLISH on a Cluster) to the wake channels; tests/test_server_checks.py keeps it in step with them.
# The server checks ask the ACL about each; a refusal's fix names them.
SCRIPT_COMMANDS = ("DEL", "EXISTS", "GET", "HDEL", "HGET", "HINCRBY", "HMGET", "HSET", "PEXPIRE", "PEXPIREAT",
                   "PEXPIRETIME", "PTTL", "SET", "TIME", "ZADD", "ZCARD", "ZPOPMIN", "ZRANGE", "ZRANGEBYSCORE", "ZREM",
                   "ZREMRANGEBYSCORE", "ZSCORE")

MODEL = 2          # the layout above; bumped (and said in CHANGELOG.md) whenever it changes
SHARES_WITH = (1,)  # models whose managers may run beside this one in a namespace: each reads what the other writes
MODEL_TTL = 7 * 24 * 3600


class ScriptClient(Protocol):
    """What a script needs of a client: redis-py's or the lean connection."""

    def evalsha(self, sha: str, numkeys: int, /, *args: Any) -> Awaitable[Any]: ...

    def eval(self, source: str, numkeys: int, /, *args: Any) -> Awaitable[Any]: ...

    def script_load(self, source: str, /) -> Awaitable[Any]: ...


class Script:
    """A script called by SHA, loaded again when Redis has forgotten it (restart, SCRIPT FLUSH).

    SCRIPT LOAD keeps it for good (Redis 7.4 evicts scripts that came by
    EVAL). A flush that lands between the load and the call is answered by
    EVAL, which loads and runs in one command: no caller ever sees NOSCRIPT,
    however often the scripts are flushed. A server without SCRIPT (renamed
    away, or refused by the ACL: some managed services and proxies) gets the
    script by EVAL too, so EVALSHA and EVAL are all the lock needs.
    """

    def __init__(self, source: str) -> None:
        self.source: str = source
        self.sha: str = hashlib.sha1(source.encode()).hexdigest()

    async def __call__(self, client: ScriptClient, keys: Sequence[str], args: Sequence[object]) -> Any:
        try:
            return await client.evalsha(self.sha, len(keys), *keys, *args)
        except NoScriptError:
            pass
        if await load(client, self):
            try:
                return await client.evalsha(self.sha, len(keys), *keys, *args)
            except NoScriptError:  # flushed again since the load
                pass
        return await client.eval(self.source, len(keys), *keys, *args)


async def load(client: ScriptClient, script: Script) -> bool:
    """SCRIPT LOAD; False when the server refuses SCRIPT (renamed, not allowed): send the script by EVAL then.

    Connection errors propagate; so does any error EVAL will meet as well
    (OOM, a busy script): the caller's EVAL says it.
    """
    try:
        await client.script_load(script.source)
    except ResponseError as exc:
        if not script_refused(exc):
            raise
        return False
    return True


def script_refused(error: BaseException) -> bool:
    """Is this the answer of a server that does not let this user run SCRIPT (renamed away, or the ACL)?"""
    text = str(error)
    return isinstance(error, NoPermissionError) or "NOPERM" in text or "unknown command" in text.lower()


def eval_instead(command: tuple[Any, ...], script: Script) -> tuple[Any, ...]:
    """An `("EVALSHA", sha, numkeys, ...)` command of a batch as EVAL of `script` (SCRIPT LOAD refused)."""
    return ("EVAL", script.source, *command[2:])


acquire = Script(ACQUIRE)
release = Script(RELEASE)
renew = Script(RENEW)
force_release = Script(FORCE_RELEASE)
model_check = Script(MODEL_CHECK)
wait_for = Script(WAIT_FOR)
wait_over = Script(WAIT_OVER)
