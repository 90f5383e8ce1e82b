"""`otel-lock doctor`: the server checks of otel_lock/lock/_server_checks.py, for an operator.

One report per server the lock would use: the server a redis://, rediss:// or
unix:// URL names, the master a redis+sentinel:// URL's Sentinels name now, or
every master of a redis+cluster:// URL. Exit status 0 when every server may
serve the lock (warnings allowed), 1 when one refuses or cannot be reached.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from typing import Any, TextIO

from ..lock._server_checks import Check, ServerReport, check_server
from ._redis_server import redact_url

__all__ = ["run_doctor"]

SOCKET_TIMEOUT = 2.0
# redis-py's Cluster client reads the slot map and the command table before anything else
_CLUSTER_RIGHTS = " (a Cluster client's user needs +cluster|slots and +command)"
_MARKS = {"ok": "ok", "note": "note", "warning": "WARNING", "refusal": "REFUSED"}


def run_doctor(args: argparse.Namespace, out: TextIO = sys.stdout) -> int:
    from . import _describe_redis_error

    from redis.exceptions import RedisClusterException, RedisError

    from ..lock import LockError

    try:
        reports = asyncio.run(_reports(args.redis_url, args.namespace, args.require_noeviction))
    except RedisClusterException as exc:
        # redis-py says "Cluster mode is not enabled" for any failure to read the slot map: say what it was
        cause = _redis_cause(exc)
        print(f"otel-lock doctor: cannot read the slot map of the Cluster at {redact_url(args.redis_url)}: "
              f"{_first_line(cause)}" + (_CLUSTER_RIGHTS if "permission" in str(cause) else ""), file=sys.stderr)
        return 1
    except (RedisError, LockError, OSError) as exc:
        print(f"otel-lock doctor: {_describe_redis_error(exc, args.redis_url)}", file=sys.stderr)
        return 1
    ok = all(r.ok for r in reports)
    if args.json:
        print(json.dumps({"url": redact_url(args.redis_url), "namespace": args.namespace, "ok": ok,
                          "servers": [r.as_dict() for r in reports]}, indent=2), file=out)
    else:
        _print(reports, args, out)
    return 0 if ok else 1


async def _reports(url: str, namespace: str, require_noeviction: bool) -> list[ServerReport]:
    scheme = url.split("://", 1)[0]
    if scheme == "redis+cluster":
        return await _cluster_reports(url, namespace, require_noeviction)
    if scheme == "redis+sentinel":
        from ..lock._sentinel import master_client

        client: Any = master_client(url, SOCKET_TIMEOUT, {"socket_timeout": SOCKET_TIMEOUT})
        try:
            host, port = await client.connection_pool.get_master_address()
            return [await _check(client, namespace, require_noeviction, f"{host}:{port} (the Sentinels' master)")]
        finally:
            await client.aclose()
    import redis.asyncio as aioredis

    plain = aioredis.Redis.from_url(url, socket_timeout=SOCKET_TIMEOUT, socket_connect_timeout=SOCKET_TIMEOUT)
    try:
        kwargs = plain.connection_pool.connection_kwargs
        where = kwargs.get("path") or f"{kwargs.get('host', '127.0.0.1')}:{kwargs.get('port', 6379)}"
        return [await _check(plain, namespace, require_noeviction, str(where))]
    finally:
        await plain.aclose()


async def _cluster_reports(url: str, namespace: str, require_noeviction: bool) -> list[ServerReport]:
    """Every master of the Cluster, each on a client of its own."""
    import redis.asyncio as aioredis

    from ..lock._cluster import cluster_client, parse_url

    _, username, password = parse_url(url)
    cluster = cluster_client(url, {"socket_timeout": SOCKET_TIMEOUT, "socket_connect_timeout": SOCKET_TIMEOUT})
    try:
        await cluster.initialize()
        masters = sorted((str(n.host), int(n.port)) for n in cluster.get_primaries())
    finally:
        await cluster.aclose()
    reports = []
    for host, port in masters:
        async with aioredis.Redis(host=host, port=port, username=username, password=password,
                                  socket_timeout=SOCKET_TIMEOUT, socket_connect_timeout=SOCKET_TIMEOUT) as node:
            reports.append(await _check(node, namespace, require_noeviction, f"{host}:{port} (Cluster master)",
                                        cluster=True))
    return reports


async def _check(client: Any, namespace: str, require_noeviction: bool, where: str,
                 cluster: bool | None = None) -> ServerReport:
    async def subscribe(channel: str) -> None:
        # on a connection of its own, left at once; SSUBSCRIBE on a Cluster node
        pubsub = client.pubsub()
        try:
            if cluster:
                await pubsub.execute_command("SSUBSCRIBE", channel)
                await pubsub.parse_response(block=True, timeout=SOCKET_TIMEOUT)
            else:
                await pubsub.subscribe(channel)
                await pubsub.get_message(timeout=SOCKET_TIMEOUT)
        finally:
            await pubsub.aclose()

    return await check_server(client.execute_command, namespace=namespace, cluster=cluster,
                              require_noeviction=require_noeviction, subscribe=subscribe, address=where)


def _redis_cause(exc: BaseException) -> BaseException:
    """The first Redis error under `exc` (its cause or context), else `exc` itself."""
    from redis.exceptions import RedisError

    seen, current = set(), exc.__cause__ or exc.__context__
    while current is not None and id(current) not in seen:
        if isinstance(current, RedisError):
            return current
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return exc


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def _print(reports: list[ServerReport], args: argparse.Namespace, out: TextIO) -> None:
    print(f"otel-lock doctor: {redact_url(args.redis_url)}, namespace {args.namespace!r}", file=out)
    for report in reports:
        name = {"valkey": "Valkey", "redis": "Redis"}.get(report.server or "", report.server or "server ?")
        who = f"user {report.user}" if report.user else "user ? (ACL WHOAMI refused)"
        print(f"\n{report.address}: {name} {report.version or '?'}, {who}", file=out)
        for check in report.checks:
            _print_check(check, out)
    refusals = sum(len(r.refusals) for r in reports)
    warnings = sum(len(r.warnings) for r in reports)
    counts = f"{refusals} refusal{'s' * (refusals != 1)}, {warnings} warning{'s' * (warnings != 1)}"
    verdict = "REFUSED: the lock manager would not start here" if refusals else "usable by otel-lock"
    print(f"\nverdict: {verdict} ({counts})", file=out)


def _print_check(check: Check, out: TextIO) -> None:
    print(f"  {_MARKS[check.verdict]:8} {check.name:12} {check.detail}", file=out)
    if check.fix and check.verdict in ("warning", "refusal", "note"):
        print(f"  {'':8} {'':12} fix: {check.fix}", file=out)
