"""Every Redis URL checked once, before any command runs, as redis-py will read it.

redis-py's `parse_url` is the reference, but it lets through what then
fails deep inside a connection: a port that is not a number (a traceback),
a query option no connection takes (`?foo=bar`, a TypeError at the first
command, or silently ignored by the lean connection), a database path that
is not a number (silently database 0), and an empty host, which it takes as
localhost: what `redis://${REDIS_HOST}:6379/0` becomes when the variable is
unset. Each is refused here with one line (exit 2), the same for every
command.
"""

from __future__ import annotations

import inspect
from urllib.parse import unquote, urlsplit

__all__ = ["check_url"]

# Taken by the pool rather than the connection (redis.asyncio.BlockingConnectionPool).
_POOL_OPTIONS = frozenset({"max_connections", "timeout"})


def check_url(url: str) -> None:
    """Raise ValueError saying what is wrong with a redis://, rediss:// or unix:// URL."""
    from redis.asyncio.connection import parse_url

    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises for a port that is not a number from 0 to 65535
    except ValueError as exc:
        ipv6 = "; an IPv6 address goes in brackets, redis://[::1]:6379/0" if url.count(":") > 3 else ""
        raise ValueError(f"{exc} (expected redis://host:port/db{ipv6})") from None
    if parts.scheme == "unix":
        if not parts.path:
            raise ValueError("no socket path (expected unix:///path/to/redis.sock?db=0)")
    elif not parts.hostname:
        raise ValueError("no host (an unset variable in redis://${HOST}:port?): name it, "
                         "redis://127.0.0.1:6379/0 for this machine")
    elif parts.port == 0:
        raise ValueError("port 0 is not a port (expected 1-65535)")
    elif parts.path.strip("/") and not unquote(parts.path).strip("/").isdigit():
        raise ValueError(f"the database {parts.path.strip('/')!r} is not a number (expected redis://host:port/0)")
    try:
        options = parse_url(url)
    except ValueError as exc:
        raise ValueError(str(exc).rstrip(".")) from None
    unknown = sorted(set(options) - _accepted(options.get("connection_class")) - {"connection_class"})
    if unknown:
        raise ValueError(f"unknown option{'s' * (len(unknown) > 1)} {', '.join(unknown)} in the URL's query "
                         "(redis-py's connection options only, e.g. ?socket_timeout=5)")


def _accepted(connection_class: object) -> frozenset[str]:
    """The keyword arguments the URL's connection class takes (every __init__ up its MRO)."""
    from redis.asyncio.connection import Connection

    names = set(_POOL_OPTIONS)
    for cls in getattr(connection_class or Connection, "__mro__", ()):
        init = cls.__dict__.get("__init__")
        if init is not None:
            names.update(name for name, p in inspect.signature(init).parameters.items()
                         if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD) and name != "self")
    return frozenset(names)
