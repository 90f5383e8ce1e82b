"""Every redis://, rediss:// or unix:// URL checked once, before any command runs, as redis-py will read it.

redis-py's `parse_url` is the reference, but it lets through what then
fails deep inside a connection, or means something else than written:

- a port that is not a number (a traceback), a database path that is not a
  number (silently database 0), an empty host (taken as localhost: what
  `redis://${REDIS_HOST}:6379/0` becomes when the variable is unset);
- a query option no connection takes (`?foo=bar`: a TypeError at the first
  command, or silently ignored by the lean connection);
- a value redis-py keeps and only trips on later (`?ssl_cert_reqs=bogus`,
  an error at the first acquire), reads as something else (`true` for any
  unknown word, `?ssl_check_hostname=maybe`; `?decode_responses=false`,
  which redis-py passes on as a non-empty text, so true) or takes without a
  meaning (`?socket_timeout=-1`, `?health_check_interval=-1`).

`LockManager.from_url`, `RedLockManager.from_urls` and every CLI command
refuse each with a ValueError naming the option and what it accepts.
"""

from __future__ import annotations

import codecs
import inspect
import math
import re
import ssl
from typing import Any, Callable
from urllib.parse import parse_qs, unquote, urlsplit

__all__ = ["check_url", "shown", "url_checked"]

# Taken by the pool rather than the connection (redis.asyncio.BlockingConnectionPool).
_POOL_OPTIONS = frozenset({"max_connections", "timeout"})
_TRUE_STRINGS = ("1", "T", "TRUE", "Y", "YES", "ON")
_CERT_REQS = ("none", "optional", "required")
_SECRET_QUERY = re.compile(r"((?:^|&)(?:ssl_)?password=)[^&]*")


def url_checked(url: str) -> str:
    """`url`, or a ValueError naming it (without its passwords) and what is wrong with it."""
    try:
        check_url(url)
    except ValueError as exc:
        raise ValueError(f"bad Redis URL {shown(url)!r}: {exc}") from None
    return url


def shown(url: str) -> str:
    """A Redis URL fit for messages and logs: no password, in its user part or its query."""
    head, sep, tail = url.rpartition("@")
    url = f"{head.split('://')[0]}://***@{tail}" if sep else url
    base, mark, query = url.partition("?")
    return base + mark + _SECRET_QUERY.sub(r"\1***", query)


def check_url(url: str) -> None:
    """Raise ValueError saying what is wrong with a redis://, rediss:// or unix:// URL."""
    from redis.asyncio.connection import parse_url

    parts = _check_place(url)
    query = parse_qs(parts.query)
    for name, values in query.items():
        _check_parses(name, values[0])
    options = parse_url(url)
    params = _parameters(options.get("connection_class"))
    unknown = sorted(set(options) - set(params) - _POOL_OPTIONS - {"connection_class"})
    if unknown:
        raise ValueError(f"unknown option{'s' * (len(unknown) > 1)} {', '.join(unknown)} in the URL's query "
                         "(redis-py's connection options only, e.g. ?socket_timeout=5)")
    for name, values in query.items():
        _check_value(name, values[0], options[name], params.get(name))  # type: ignore[literal-required]


def _check_place(url: str) -> Any:
    """The host, port and database path: what redis-py would take as localhost, a traceback or database 0."""
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
    return parts


def _parameters(connection_class: object) -> dict[str, inspect.Parameter]:
    """The keyword arguments the URL's connection class takes (every __init__ up its MRO)."""
    from redis.asyncio.connection import Connection

    found: dict[str, inspect.Parameter] = {}
    for cls in getattr(connection_class or Connection, "__mro__", ()):
        init = cls.__dict__.get("__init__")
        if init is not None:
            for name, p in inspect.signature(init).parameters.items():
                if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD) and name != "self":
                    found.setdefault(name, p)
    return found


def _check_parses(name: str, raw: str) -> None:
    """redis-py's own parser of the option (float, int, ...) takes the text, or the error says what would."""
    from redis.asyncio.connection import URL_QUERY_ARGUMENT_PARSERS

    parser = URL_QUERY_ARGUMENT_PARSERS.get(name)
    try:
        if parser is not None:
            parser(raw)
    except (TypeError, ValueError):
        kind = {float: "a number", int: "a whole number"}.get(parser, "a value redis-py can read")  # type: ignore[call-overload]
        raise ValueError(f"{name}={raw!r} in the URL's query: expected {_EXPECTED.get(name, kind)}") from None


def _check_value(name: str, raw: str, value: Any, param: inspect.Parameter | None) -> None:
    """One query option: redis-py's reading of `raw` must be what the text says, and usable."""
    from redis.asyncio.connection import URL_QUERY_ARGUMENT_PARSERS, to_bool

    parser = URL_QUERY_ARGUMENT_PARSERS.get(name)
    if parser is to_bool:
        _check_bool(name, raw)
    elif parser is None and param is not None and not _takes_text(param):
        raise ValueError(f"{name} cannot be set in the URL's query: redis-py would pass it on as the text "
                         f"{raw!r}, not as {_kind(param)}; give it as a keyword, {name}=...")
    check = _VALUES.get(name)
    if check is not None and not check(value):
        raise ValueError(f"{name}={raw!r} in the URL's query: expected {_EXPECTED[name]}")


def _check_bool(name: str, raw: str) -> None:
    """redis-py's to_bool takes any word it does not know as true (`maybe`, `ture`): only the ones it knows."""
    from redis.asyncio.connection import FALSE_STRINGS

    if raw.upper() not in (*_TRUE_STRINGS, *FALSE_STRINGS):
        raise ValueError(f"{name}={raw!r} in the URL's query is not true or false "
                         "(expected true, false, yes, no, 1 or 0)")


def _takes_text(param: inspect.Parameter) -> bool:
    """Whether a connection argument may be a str, as it stays when redis-py has no parser for it."""
    annotation = param.annotation
    if annotation is inspect.Parameter.empty:
        return isinstance(param.default, str) or param.default is None
    return re.search(r"\bstr\b", annotation if isinstance(annotation, str) else str(annotation)) is not None


def _kind(param: inspect.Parameter) -> str:
    annotation = param.annotation
    if isinstance(annotation, type):
        return f"a {annotation.__name__}"
    return f"a {annotation}" if annotation is not inspect.Parameter.empty else "the value it needs"


def _positive_seconds(value: Any) -> bool:
    return isinstance(value, float) and math.isfinite(value) and value > 0


def _tls_version(value: Any) -> bool:
    try:
        ssl.TLSVersion(value)
    except ValueError:
        return False
    return True


def _cert_reqs(value: Any) -> bool:
    """As redis-py's RedisSSLContext reads it (it raises only at the first connect)."""
    from redis.asyncio.connection import RedisSSLContext
    from redis.exceptions import RedisError

    try:
        RedisSSLContext(cert_reqs=value)
    except RedisError:
        return False
    return True


def _codec(lookup: Callable[[str], object]) -> Callable[[Any], bool]:
    def known(value: Any) -> bool:
        try:
            lookup(value)
        except LookupError:
            return False
        return True
    return known


_VALUES: dict[str, Callable[[Any], bool]] = {
    "socket_timeout": _positive_seconds,
    "socket_connect_timeout": _positive_seconds,
    "timeout": _positive_seconds,
    "health_check_interval": lambda v: v >= 0,
    "socket_read_size": lambda v: v > 0,
    "max_connections": lambda v: v > 0,
    "db": lambda v: v >= 0,
    "protocol": lambda v: v in (2, 3),
    "ssl_min_version": _tls_version,
    "ssl_cert_reqs": _cert_reqs,
    "encoding": _codec(codecs.lookup),
    "encoding_errors": _codec(codecs.lookup_error),
}
_EXPECTED = {
    "socket_timeout": "a number of seconds above 0",
    "socket_connect_timeout": "a number of seconds above 0",
    "timeout": "a number of seconds above 0",
    "health_check_interval": "a whole number of seconds, 0 or more (0: no health check)",
    "socket_read_size": "a number of bytes above 0",
    "max_connections": "a number above 0",
    "db": "a database number, 0 or more",
    "protocol": "2 or 3",
    "ssl_min_version": "an ssl.TLSVersion value, e.g. " + str(int(ssl.TLSVersion.TLSv1_2)) + " for TLS 1.2",
    "ssl_cert_reqs": ", ".join(_CERT_REQS[:-1]) + " or " + _CERT_REQS[-1],
    "encoding": "a Python codec name, e.g. utf-8",
    "encoding_errors": "a Python codec error handler, e.g. strict",
}
