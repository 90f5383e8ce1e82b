"""The per-master Lua scripts of the RedLock quorum, and the parallel calls to the masters.

Each master keeps the core's layout for one lock, so `otel-lock locks`
pointed at any master shows it:

    S:{N}        hash    owner, depth (always 1), token (the hold's final token)
    S:{N}:fence  string  the largest token this master has seen for N;
                         expires `fence_ttl` after last use

A grant takes two round trips to the masters, both sent in parallel:

1. ACQUIRE on every master: owner-checked, mints a token from that master's
   `TIME` (or its last token + 1), as the core's `mint` does.
2. CONFIRM on the masters that granted: the hold's token is the maximum of
   their tokens, and each of them raises its fence to that maximum. A later
   grant needs a majority too, so it meets at least one master that had
   already raised its fence, and its own token is larger.

RENEW is CONFIRM with `take`: a master that restarted empty is taken again
(and its fence raised), so renewals repair the quorum instead of slowly
losing it.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Awaitable, Callable, Sequence

from redis.exceptions import RedisError

from ._calls import Calls
from ._connection import Connection
from ._scripts import Script, ScriptClient
from ..telemetry._instruments import suppressed

# KEYS: lock, fence. ARGV: owner, lease_ms, fence_ttl_ms.
# Returns {1, token} when granted (or already this owner's: a resent attempt), {0, pttl_ms} when busy;
# a busy reply marks the lock `wanted`, so that its release can tell the holder that others wait.
ACQUIRE = r"""
local holder = redis.call('HGET', KEYS[1], 'owner')
if holder == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return {1, tonumber(redis.call('HGET', KEYS[1], 'token'))}
end
if holder then
  redis.call('HSET', KEYS[1], 'wanted', 1)
  return {0, redis.call('PTTL', KEYS[1])}
end
local t = redis.call('TIME')
local token = tonumber(t[1]) * 1000000 + tonumber(t[2])
local last = tonumber(redis.call('GET', KEYS[2]) or '0')
if last >= token then token = last + 1 end
local text = string.format('%.0f', token)
redis.call('SET', KEYS[2], text, 'PX', ARGV[3])
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], 'owner', ARGV[1], 'depth', 1, 'token', text)
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return {1, token}
"""

# KEYS: lock, fence. ARGV: owner, lease_ms, fence_ttl_ms, final token, take ('1': take the lock if free).
# Returns 1 when the lock is this owner's (its lease reset, its fence at least the final token), else 0.
CONFIRM = r"""
local holder = redis.call('HGET', KEYS[1], 'owner')
if holder ~= ARGV[1] then
  if holder or ARGV[5] ~= '1' then return 0 end
  redis.call('HSET', KEYS[1], 'owner', ARGV[1], 'depth', 1)
end
redis.call('HSET', KEYS[1], 'token', ARGV[4])
local last = tonumber(redis.call('GET', KEYS[2]) or '0')
if last < tonumber(ARGV[4]) then
  redis.call('SET', KEYS[2], ARGV[4], 'PX', ARGV[3])
else
  redis.call('PEXPIRE', KEYS[2], ARGV[3])
end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return 1
"""

# KEYS: lock. ARGV: owner. Returns 0 when it was not this owner's, else 1 (deleted) or 2 (deleted, and
# someone had found it busy meanwhile).
RELEASE = r"""
if redis.call('HGET', KEYS[1], 'owner') ~= ARGV[1] then return 0 end
local wanted = redis.call('HGET', KEYS[1], 'wanted')
redis.call('DEL', KEYS[1])
if wanted then return 2 end
return 1
"""

# RENEW: CONFIRM with take, for many holds in one call (a batch of the watchdog).
# KEYS: lock1, fence1, lock2, fence2, ... ARGV: fence_ttl_ms, then owner, lease_ms, token per lock.
# Returns one 1 (this owner's: lease reset, fence at least the token; taken again if it was free) or 0 per lock.
RENEW = r"""
local out = {}
for i = 1, #KEYS / 2 do
  local lock, fence = KEYS[2 * i - 1], KEYS[2 * i]
  local owner, lease, token = ARGV[3 * i - 1], ARGV[3 * i], ARGV[3 * i + 1]
  local holder = redis.call('HGET', lock, 'owner')
  if holder and holder ~= owner then
    out[i] = 0
  else
    if not holder then redis.call('HSET', lock, 'owner', owner, 'depth', 1) end
    redis.call('HSET', lock, 'token', token)
    local last = tonumber(redis.call('GET', fence) or '0')
    if last < tonumber(token) then
      redis.call('SET', fence, token, 'PX', ARGV[1])
    else
      redis.call('PEXPIRE', fence, ARGV[1])
    end
    redis.call('PEXPIRE', lock, lease)
    out[i] = 1
  end
end
return out
"""

# FORCE_RELEASE: delete the lock whoever holds it (an operator's last resort). KEYS: lock. Returns 1 if held.
FORCE_RELEASE = r"""
return redis.call('DEL', KEYS[1])
"""

acquire = Script(ACQUIRE)
renew = Script(RENEW)
force_release = Script(FORCE_RELEASE)
confirm = Script(CONFIRM)
release = Script(RELEASE)


class Masters:
    """N independent masters, each call bounded by `timeout` seconds.

    `clients` are the redis-py clients (the listing, the Idempotency-Key
    records); `senders[i]` carries master i's scripts: the lean connection
    that speaks for its client (`_clients.speaking_for`), TLS included, or
    the client itself when it has a connection class of the caller's own.
    `calls[i]` times and classifies master i's calls (the breaker is fed per
    round by the transport, not per master).
    """

    def __init__(self, clients: Sequence[Any], timeout: float, calls: Sequence[Calls],
                 senders: Sequence[ScriptClient] | None = None) -> None:
        self.clients: list[Any] = list(clients)
        self.senders: list[ScriptClient] = list(self.clients if senders is None else senders)
        self.quorum: int = len(self.clients) // 2 + 1
        self.timeout: float = timeout
        self.calls: list[Calls] = list(calls)
        self._connects: dict[int, asyncio.Future[None]] = {}

    def _connect(self, index: int, connection: Connection) -> asyncio.Future[None]:
        """Master `index`'s connect (a TLS handshake too), shared by its callers.

        A caller gives up after `timeout` (a master_timeout shorter than a
        handshake to a distant server); the connect goes on for the next
        round, bounded by its own connect timeout.
        """
        connecting = self._connects.get(index)
        if connecting is None or connecting.done():
            connecting = self._connects[index] = asyncio.ensure_future(connection.connect())
            connecting.add_done_callback(_retrieve)
        return connecting

    def run(self, index: int) -> Callable[..., Awaitable[Any]]:
        """Send one command to master `index` (the server checks), on the connection its scripts use."""
        sender = self.senders[index]
        return sender.execute if isinstance(sender, Connection) else self.clients[index].execute_command

    def figures(self) -> tuple[int, int]:
        """(connections in use, replies awaited) over every master."""
        used = waiting = 0
        for client, sender in zip(self.clients, self.senders):
            if isinstance(sender, Connection):
                used, waiting = used + sender.connected, waiting + sender.in_flight
            else:
                used += len(getattr(client.connection_pool, "_in_use_connections", ()))
        return used, waiting

    async def call(self, script: Script, keys: Sequence[str], args: Sequence[object], operation: str, name: str,
                   only: Sequence[int] | None = None, record: bool = True) -> list[Any]:
        """One call per master (or per master in `only`), all at once; a failure is returned, not raised.

        `record=False`: the caller times the round itself (a batch of several lock names).
        """
        which = range(len(self.clients)) if only is None else only
        answers = await asyncio.gather(*(self._one(i, script, keys, args, operation, name, record) for i in which))
        return list(answers)

    async def _one(self, index: int, script: Script, keys: Sequence[str], args: Sequence[object], operation: str,
                   name: str, record: bool) -> Any:
        began = time.perf_counter()
        try:
            async with asyncio.timeout(self.timeout):
                sender = self.senders[index]
                if isinstance(sender, Connection) and not sender.connected:
                    await asyncio.shield(self._connect(index, sender))
                with suppressed():
                    answer = await script(sender, keys, args)
        except (RedisError, OSError) as exc:  # asyncio's TimeoutError is an OSError
            return self.calls[index].failed(exc, time.perf_counter() - began, operation, name, keys[0])
        if record:
            self.calls[index].telemetry.redis_duration.record(time.perf_counter() - began,
                                                              {"lock.name": name, "lock.operation": operation})
        return answer

    async def aclose(self) -> None:
        """Close the lean connections (the clients are the runtime's to close, when it owns them)."""
        connects, self._connects = list(self._connects.values()), {}
        for connecting in connects:
            connecting.cancel()
        await asyncio.gather(*connects, return_exceptions=True)
        await asyncio.gather(*(s.aclose() for s in self.senders if isinstance(s, Connection)),
                             return_exceptions=True)


def _retrieve(done: asyncio.Future[None]) -> None:
    """The connect's error reaches its callers; unawaited, it is not logged as never retrieved."""
    if not done.cancelled():
        done.exception()
