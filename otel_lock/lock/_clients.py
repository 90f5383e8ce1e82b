"""What the core needs to know of a redis-py client: its connection settings, and a twin for another loop.

A redis-py asyncio client belongs to the event loop (and the process) it
first connected on: used from another one it fails ("Event loop is
closed", a future attached to a different loop), or worse after a fork,
where parent and child would share its sockets. The core therefore keeps
one client per process and loop (`_runtime.py`): the one it was given on
the loop it was first used on, and a twin built from the same settings
everywhere else. The settings are read here, once, for every part that
opens its own connections (the lean connection, the Sentinel master
connection, the cluster's per-node connections and subscribers).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.sentinel import SentinelConnectionPool

from ._connection import Connection
from ._tls import Tls

# redis-py's own connection classes: what they do, the lean connection does too (a caller's own class: not)
_LEAN_CLASSES = (aioredis.Connection, aioredis.SSLConnection, aioredis.UnixDomainSocketConnection)
_SENTINEL_CLASSES = ("SentinelManagedConnection", "SentinelManagedSSLConnection")
_CLUSTER_ARGS = frozenset(inspect.signature(RedisCluster.__init__).parameters)


def check_async(client: object, kinds: tuple[type, ...], takes: str, builder: str) -> None:
    """A redis.asyncio client of `kinds`: anything else (a URL, a blocking client) would fail only at first use."""
    if isinstance(client, kinds):
        return
    hint = f"for a URL use {builder}" if isinstance(client, str) else f"use redis.asyncio, or {builder}"
    raise TypeError(f"{takes}, not {type(client).__module__}.{type(client).__qualname__}: {hint}")


@dataclass(frozen=True)
class Settings:
    """Where and how a client connects: what a lean connection needs to speak for it."""

    host: str = "127.0.0.1"
    port: int = 6379
    path: str | None = None
    db: int = 0
    username: str | None = None
    password: str | None = None
    timeout: float | None = 2.0
    connect_timeout: float | None = 2.0
    lean: bool = True  # redis-py's own connection class, RESP2: the lean connection can speak for it
    tls: Tls | None = field(default=None, compare=False)  # rediss:// (or ssl=True) and its ssl_* options
    credential_provider: Any = field(default=None, compare=False)  # asked for user and password on each connect

    def credentials(self) -> dict[str, Any]:
        """What a lean connection needs besides the address: db, credentials, timeouts, TLS."""
        return {"db": self.db, "username": self.username, "password": self.password, "timeout": self.timeout,
                "connect_timeout": self.connect_timeout, "tls": self.tls,
                "credential_provider": self.credential_provider}

    def address(self) -> str:
        """`host:port` (or the socket path), for messages and span attributes; never a password."""
        return self.path or f"{self.host}:{self.port}"


def settings_of(client: Any) -> Settings:
    """The settings of a plain, Sentinel-managed or cluster client."""
    if isinstance(client, RedisCluster):
        kw: dict[str, Any] = client.get_connection_kwargs()
        cls = kw.get("connection_class", aioredis.Connection)
        lean = cls in _LEAN_CLASSES and str(kw.get("protocol") or 2) == "2"
        nodes = client.get_nodes()
        node = client.get_default_node() or (nodes[0] if nodes else None)
        host, port = (node.host, int(node.port)) if node is not None else ("127.0.0.1", 6379)
        return _settings(kw, host, port, None, lean, Tls.of(cls, kw))
    pool = client.connection_pool
    kw = pool.connection_kwargs
    cls = pool.connection_class
    sentinel = isinstance(pool, SentinelConnectionPool)
    plain = cls in _LEAN_CLASSES or sentinel and cls.__name__ in _SENTINEL_CLASSES
    lean = plain and str(kw.get("protocol") or 2) == "2"
    return _settings(kw, kw.get("host", "127.0.0.1"), int(kw.get("port") or 6379), kw.get("path"), lean,
                     Tls.of(cls, kw))


def _settings(kw: dict[str, Any], host: str, port: int, path: str | None, lean: bool, tls: Tls | None) -> Settings:
    timeout = kw.get("socket_timeout")
    return Settings(host=str(host), port=port, path=path, db=int(kw.get("db") or 0), username=kw.get("username"),
                    password=kw.get("password"), timeout=timeout,
                    connect_timeout=kw.get("socket_connect_timeout") or timeout, lean=lean, tls=tls,
                    credential_provider=kw.get("credential_provider"))


def lean_connection(settings: Settings, **extra: Any) -> Connection:
    """A lean connection to the server and with the credentials of `settings`."""
    return Connection(host=settings.host, port=settings.port, path=settings.path, **settings.credentials(), **extra)


def speaking_for(client: Any) -> Connection | None:
    """A lean connection that speaks for a plain client (TCP, TLS or unix socket; RESP2), or None.

    None: a client with a connection class of the caller's own, RESP3, or a
    Sentinel pool; its calls go through redis-py itself.
    """
    if not is_plain(client):
        return None
    settings = settings_of(client)
    return lean_connection(settings) if settings.lean else None


def is_plain(client: Any) -> bool:
    """A plain `redis.asyncio.Redis` on one server (no Sentinel pool)."""
    return type(client) is aioredis.Redis and not isinstance(client.connection_pool, SentinelConnectionPool)


def twin(client: Any) -> Any:
    """A new client with the same settings as `client`, for another event loop or process; None if unknown.

    Plain and cluster clients can be rebuilt from their settings; a client
    on a Sentinel-managed pool cannot (its Sentinels' clients are bound to
    the first loop too): build such a manager with `from_url`.
    """
    if isinstance(client, RedisCluster):
        given: dict[str, Any] = client.get_connection_kwargs()
        # what RedisCluster takes back (it adds connection internals of its own: response_callbacks, ...)
        kw = {k: v for k, v in given.items() if k in _CLUSTER_ARGS and k not in ("host", "port")}
        if Tls.of(given.get("connection_class"), given) is not None:
            kw["ssl"] = True
        nodes = [ClusterNode(n.host, int(n.port)) for n in client.get_nodes()] or [ClusterNode("127.0.0.1", 6379)]
        return RedisCluster(startup_nodes=nodes, retry=client.retry, **kw)
    if type(client) is not aioredis.Redis or isinstance(client.connection_pool, SentinelConnectionPool):
        return None
    pool = client.connection_pool
    kwargs = {k: v for k, v in pool.connection_kwargs.items() if k != "himport_registry"}
    if isinstance(pool, aioredis.BlockingConnectionPool):
        kwargs["timeout"] = pool.timeout
    copy = type(pool)(connection_class=pool.connection_class, max_connections=pool.max_connections, **kwargs)
    return aioredis.Redis.from_pool(copy)
