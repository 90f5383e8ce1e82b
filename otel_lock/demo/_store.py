"""The shop's data in Redis: stock with a fenced write, orders, job runs.

Stock is deliberately a plain read-modify-write (HGET, compute in Python,
write back): without a lock two buyers read the same count and both sell the
last item. The write carries the lock's fencing token and is refused if a
newer holder already wrote, which is how a resource protects itself from a
holder whose lease ran out while it was paused (GC, SIGSTOP, slow network).

Valid on a Redis Cluster as well as on one Redis (or a Sentinel master):
every script and transaction touches one key, or keys of one hash tag. A
user's keys share the tag `{user:<id>}`, so they sit in one slot and a
transaction over several of them stays valid; products and users spread over
the slots (a shop-wide tag would put all the data on one node).
"""

from __future__ import annotations

import json
import re
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster

# KEYS[1] product hash (fields: stock, fence)
# ARGV[1] new stock; ARGV[2] fencing token as decimal digits ('' = unfenced);
# ARGV[3] '1' = the product must already exist (a deduct), '0' = create/reset.
# Returns 1 written, 0 refused (a newer token already wrote), -1 no such product.
# Tokens are compared as digit strings (length, then lexically) so they may
# exceed the 2^53 that a Lua number holds exactly.
FENCED_SET = """
if ARGV[3] == '1' and redis.call('EXISTS', KEYS[1]) == 0 then return -1 end
local token = ARGV[2]
if token == '' then
  redis.call('HSET', KEYS[1], 'stock', ARGV[1])
  return 1
end
local fence = redis.call('HGET', KEYS[1], 'fence') or '0'
if #token < #fence or (#token == #fence and token < fence) then return 0 end
redis.call('HSET', KEYS[1], 'stock', ARGV[1], 'fence', token)
return 1
"""

# The lighter alternative to a lock for a single counter: check and decrement
# in one script, which Redis runs atomically (nothing else runs in between).
# KEYS[1] product hash (field: stock); ARGV[1] quantity (a positive integer).
# Returns {1, stock left} sold, {0, stock} not enough stock, {-1, 0} no such product.
# It ignores the fence: do not mix it with the locked read-modify-write on one
# product (that write would overwrite a decrement made between its read and write).
ATOMIC_DEDUCT = """
local stock = redis.call('HGET', KEYS[1], 'stock')
if not stock then return {-1, 0} end
stock = tonumber(stock)
local quantity = tonumber(ARGV[1])
if stock < quantity then return {0, stock} end
return {1, redis.call('HINCRBY', KEYS[1], 'stock', -quantity)}
"""

# KEYS[1] the job's run list; ARGV[1] one run (JSON); ARGV[2] how many runs to keep.
RECORD_RUN = """
redis.call('RPUSH', KEYS[1], ARGV[1])
redis.call('LTRIM', KEYS[1], -tonumber(ARGV[2]), -1)
"""

ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$"   # published in the shop's OpenAPI too
_ID = re.compile(ID_PATTERN[1:-1])
MAX_RUNS = 1000


def valid_id(value: str) -> bool:
    """Product and user ids: short, and safe in a Redis key as they are."""
    return _ID.fullmatch(value) is not None


class Store:
    def __init__(self, redis: aioredis.Redis | RedisCluster, namespace: str) -> None:
        self.redis = redis
        self.prefix = f"{namespace}:demo"
        self._set = redis.register_script(FENCED_SET)
        self._deduct = redis.register_script(ATOMIC_DEDUCT)
        self._record = redis.register_script(RECORD_RUN)

    def _product(self, product_id: str) -> str:
        return f"{self.prefix}:stock:{product_id}"

    def _orders(self, user: str) -> str:
        # Ids are letters, digits, '_' and '-' (valid_id): never a brace that would move the tag.
        return f"{self.prefix}:{{user:{user}}}:orders"

    async def get_stock(self, product_id: str) -> int | None:
        value = await self.redis.hget(self._product(product_id), "stock")
        return None if value is None else int(value)

    async def put_stock(self, product_id: str, stock: int, token: int | None) -> bool:
        """Create or reset a product; False if a newer lock holder already wrote."""
        written: int = await self._set(keys=[self._product(product_id)], args=[stock, _digits(token), "0"])
        return written == 1

    async def write_stock(self, product_id: str, stock: int, token: int | None) -> int:
        """1 written, 0 refused by the fence, -1 unknown product."""
        return int(await self._set(keys=[self._product(product_id)], args=[stock, _digits(token), "1"]))

    async def deduct_atomic(self, product_id: str, quantity: int) -> tuple[int, int]:
        """(1, left) sold, (0, stock) not enough, (-1, 0) unknown product: one round trip, no lock."""
        outcome, stock = await self._deduct(keys=[self._product(product_id)], args=[quantity])
        return int(outcome), int(stock)

    async def add_order(self, user: str, order: dict[str, Any]) -> None:
        """The order is one RPUSH (atomic by itself); then the shop-wide count.

        The count lives in another slot than the user's orders on a Cluster, so it
        cannot join their transaction: it is a separate statistic, which a crash
        between the two calls leaves one short (never an order lost or doubled).
        """
        await self.redis.rpush(self._orders(user), json.dumps(order))
        await self.redis.incr(f"{self.prefix}:orders-created")

    async def orders(self, user: str) -> list[dict[str, Any]]:
        return [json.loads(raw) for raw in await self.redis.lrange(self._orders(user), 0, -1)]

    async def record_run(self, tick: int, replica: str) -> None:
        # A script, not MULTI: redis-py's cluster client takes no transaction before 6.0.
        await self._record(keys=[f"{self.prefix}:jobs"], args=[json.dumps({"tick": tick, "replica": replica}),
                                                               MAX_RUNS])

    async def runs(self) -> list[dict[str, Any]]:
        return [json.loads(raw) for raw in await self.redis.lrange(f"{self.prefix}:jobs", 0, -1)]


def _digits(token: int | None) -> str:
    return "" if token is None else str(int(token))
