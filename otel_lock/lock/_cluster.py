"""`redis+cluster://` URLs and what the lock needs to know about a Redis Cluster.

A lock's four keys share the hash tag `{key}`, so they sit in one slot and
every script runs on one node. Scripts and renewals go through redis-py's
`RedisCluster`, which follows MOVED and ASK (and TRYAGAIN during a slot
migration) itself. Wake-ups use sharded pub/sub: a waiter's wake channel
must sit in the lock's slot (Redis refuses an SPUBLISH to another slot from
a script), so each manager has one channel per slot it waits in, tagged with
a short string that hashes to that slot.

    redis+cluster://[[username]:password@]host1[:6379][,host2[:port]...][/]

Any listed node is enough to find the rest; list several so that start-up
survives one being down.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.crc import REDIS_CLUSTER_HASH_SLOTS, key_slot
from redis.exceptions import MovedError, ResponseError

from ._url_hosts import UrlForm

SCHEME = "redis+cluster"
DEFAULT_PORT = 6379
_URL = UrlForm(SCHEME, "Redis Cluster", DEFAULT_PORT,
               f"{SCHEME}://[[user]:password@]host1[:{DEFAULT_PORT}][,host2[:port]...]")
# Options a cluster client takes that a plain one does not pass on, and the ones it refuses.
_UNSUPPORTED = ("db", "connection_class", "unix_socket_path", "path")  # ssl=True: TLS, as redis-py takes it


def is_cluster(client: Any) -> bool:
    return isinstance(client, RedisCluster)


def is_moved(error: BaseException) -> bool:
    """A Cluster node's MOVED answer (redis-py before 6 leaves it a plain ResponseError outside its cluster client)."""
    return isinstance(error, MovedError) or isinstance(error, ResponseError) and str(error).startswith("MOVED ")


def parse_url(url: str) -> tuple[list[tuple[str, int]], str | None, str | None]:
    """(nodes, username, password); a ValueError says what is wrong and shows the expected form."""
    parsed = _URL.parse(url)
    if parsed.path not in ("", "/"):
        raise _URL.error(url, "a cluster has no database number or path (database 0 only)")
    return list(parsed.hosts), parsed.username, parsed.password


def cluster_client(url: str, options: dict[str, Any]) -> RedisCluster:
    """A RedisCluster for the URL's nodes; `options` as for `LockManager.from_url`."""
    nodes, username, password = parse_url(url)
    for name in _UNSUPPORTED:
        if options.get(name):
            raise ValueError(f"option {name}={options[name]!r} is not supported with Redis Cluster")
    options.pop("db", None)
    if username is not None:
        options.setdefault("username", username)
    if password is not None:
        options.setdefault("password", password)
    # One retry of a command that failed on a connection (after re-reading the slot
    # map: a failover), so an outage surfaces within about two socket timeouts
    # instead of four. MOVED, ASK and TRYAGAIN are followed apart from this.
    options.setdefault("retry", Retry(NoBackoff(), 1))
    return RedisCluster(startup_nodes=[ClusterNode(host, port) for host, port in nodes], **options)


@lru_cache(maxsize=65536)
def slot_of(key: str) -> int:
    """The key's cluster slot (cached: every call of a lock asks it for the same few keys)."""
    return key_slot(key.encode())


@lru_cache(maxsize=1)
def _slot_tags() -> tuple[str, ...]:
    """For every slot, the shortest base-36 string found that hashes to it (about 0.1 s, once)."""
    tags: list[str | None] = [None] * REDIS_CLUSTER_HASH_SLOTS
    missing, n = REDIS_CLUSTER_HASH_SLOTS, 0
    while missing:
        tag = _base36(n)
        slot = key_slot(tag.encode())
        if tags[slot] is None:
            tags[slot] = tag
            missing -= 1
        n += 1
    return tuple(t for t in tags if t is not None)


def _base36(n: int) -> str:
    digits = "0123456789abcdefghijklmnopqrstuvwxyz"
    out = digits[n % 36]
    while n >= 36:
        n //= 36
        out = digits[n % 36] + out
    return out


def slot_tag(slot: int) -> str:
    """A hash tag that lands in `slot`: `{tag}` in a channel name puts the channel there."""
    return _slot_tags()[slot]
