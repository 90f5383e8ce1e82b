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

import re
from functools import lru_cache
from typing import Any
from urllib.parse import unquote, urlsplit

from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.crc import REDIS_CLUSTER_HASH_SLOTS, key_slot

SCHEME = "redis+cluster"
DEFAULT_PORT = 6379
_HOST = re.compile(r"^(?:\[(?P<v6>[0-9A-Fa-f:.]+)\]|(?P<name>[^\s:\[\]/@,]+))(?::(?P<port>[0-9]+))?$")
_FORM = f"{SCHEME}://[[user]:password@]host1[:{DEFAULT_PORT}][,host2[:port]...]"
# Options a cluster client takes that a plain one does not pass on, and the ones it refuses.
_UNSUPPORTED = ("db", "ssl", "connection_class", "unix_socket_path", "path")


def is_cluster(client: Any) -> bool:
    return isinstance(client, RedisCluster)


def parse_url(url: str) -> tuple[list[tuple[str, int]], str | None, str | None]:
    """(nodes, username, password); a ValueError says what is wrong and shows the expected form."""
    def bad(problem: str) -> ValueError:
        shown = re.sub(r"//[^@/]*@", "//***@", url)
        return ValueError(f"bad Redis Cluster URL {shown!r}: {problem}; expected {_FORM}")

    parts = urlsplit(url)
    if parts.scheme != SCHEME:
        raise bad(f"the scheme must be {SCHEME}://")
    if parts.query or parts.fragment:
        raise bad("query strings and fragments are not accepted (pass options as keyword arguments)")
    if parts.path not in ("", "/"):
        raise bad("a cluster has no database number or path (database 0 only)")
    userinfo, at, hostlist = parts.netloc.rpartition("@")
    username = password = None
    if at:
        user, colon, secret = userinfo.partition(":")
        username = unquote(user) or None
        password = unquote(secret) if colon else None
        if password is None and username is not None:
            raise bad("give the password as ':password@' (or 'user:password@')")
    nodes = []
    for item in hostlist.split(","):
        match = _HOST.match(item.strip())
        if not match:
            raise bad(f"{item!r} is not a host[:port]")
        port = int(match["port"] or DEFAULT_PORT)
        if not 0 < port < 65536:
            raise bad(f"port {port} is out of range")
        nodes.append((match["v6"] or match["name"], port))
    return nodes, username, password


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


def slot_of(key: str) -> int:
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
