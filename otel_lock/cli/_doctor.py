"""`otel-lock doctor`: the manager's own server checks, for an operator.

It builds the `LockManager` the URL names and runs its `check_servers()`:
the checks of otel_lock/lock/_server_checks.py on the connections, and by the
path, that the manager's first use takes, so doctor and the manager agree on
every server. One report per server the lock would use: the server a
redis://, rediss:// or unix:// URL names, the master a redis+sentinel://
URL's Sentinels name now, or every master of a redis+cluster:// URL. Then
what lives in the namespace (`_layouts.py`): the data model claiming it
(another one than this otel-lock's is a refusal, as for the manager) and
the Idempotency-Key record layouts found. Exit status 0 when the manager
would serve (warnings allowed), 1 when it would refuse or Redis cannot be
reached.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from dataclasses import replace
from typing import TextIO

from ..lock._core import model_refusal
from ..lock._scripts import MODEL, SHARES_WITH
from ..lock._server_checks import Check, ServerReport
from ._layouts import NamespaceState, namespace_state, unreadable
from ._redis_server import redact_url

__all__ = ["run_doctor"]

SOCKET_TIMEOUT = 2.0
# redis-py's Cluster client reads the slot map and the command table before anything else
_CLUSTER_RIGHTS = " (a Cluster client's user needs +cluster|slots and +command)"
_MARKS = {"ok": "ok", "note": "note", "warning": "WARNING", "refusal": "REFUSED"}
_ROLES = {"redis+sentinel": "(the Sentinels' master)", "redis+cluster": "(Cluster master)"}


def run_doctor(args: argparse.Namespace, out: TextIO = sys.stdout) -> int:
    from . import _describe_redis_error

    from redis.exceptions import RedisClusterException, RedisError

    from ..lock import LockError

    try:
        reports, state, refusal = asyncio.run(_reports(args.redis_url, args.namespace, args.require_noeviction))
    except RedisClusterException as exc:
        # redis-py says "Cluster mode is not enabled" for any failure to read the slot map: say what it was
        cause = _redis_cause(exc)
        print(f"otel-lock doctor: cannot read the slot map of the Cluster at {redact_url(args.redis_url)}: "
              f"{_first_line(cause)}" + (_CLUSTER_RIGHTS if "permission" in str(cause) else ""), file=sys.stderr)
        return 1
    except (RedisError, LockError, OSError) as exc:
        rights = _CLUSTER_RIGHTS if args.redis_url.startswith("redis+cluster") and _no_permission(exc) else ""
        print(f"otel-lock doctor: {_describe_redis_error(exc, args.redis_url)}{rights}", file=sys.stderr)
        return 1
    ok = all(r.ok for r in reports) and not refusal and not state.error
    if args.json:
        print(json.dumps({"url": redact_url(args.redis_url), "namespace": args.namespace, "ok": ok,
                          "model": MODEL, "namespace_state": state.as_dict(), "model_refusal": refusal or None,
                          "servers": [r.as_dict() for r in reports]}, indent=2), file=out)
    else:
        _print(reports, state, refusal, args, out)
    return 0 if ok else 1


async def _reports(url: str, namespace: str,
                   require_noeviction: bool) -> tuple[list[ServerReport], NamespaceState, str]:
    """The manager's own checks (`check_servers()`, as at its first use), what lives in the namespace, and
    the manager's refusal of a namespace another data model claims ("" when it is free or ours)."""
    from redis.exceptions import ResponseError

    from ..lock import LockManager
    from ..lock._errors import user_name

    scheme = url.split("://", 1)[0]
    locks = LockManager.from_url(url, namespace=namespace, require_noeviction=require_noeviction,
                                 socket_timeout=SOCKET_TIMEOUT, socket_connect_timeout=SOCKET_TIMEOUT)
    async with locks:
        reports = [replace(r, address=f"{r.address} {_ROLES[scheme]}") if scheme in _ROLES else r
                   for r in await locks.check_servers()]
        try:
            state = await namespace_state(locks.redis, namespace)
        except ResponseError as exc:  # NOPERM, WRONGTYPE: the servers' report still stands
            state = unreadable(namespace, exc, user_name(locks.redis))
        refusal = "" if state.model in (None, MODEL, *SHARES_WITH) else model_refusal(namespace, locks._topology.where(), state.model)
    return reports, state, refusal


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


def _print(reports: list[ServerReport], state: NamespaceState, refusal: str, args: argparse.Namespace,
           out: TextIO) -> None:
    print(f"otel-lock doctor: {redact_url(args.redis_url)}, namespace {args.namespace!r}", file=out)
    for report in reports:
        name = {"valkey": "Valkey", "redis": "Redis"}.get(report.server or "", report.server or "server ?")
        who = f"user {report.user}" if report.user else "user ? (ACL WHOAMI refused)"
        print(f"\n{report.address}: {name} {report.version or '?'}, {who}", file=out)
        for check in report.checks:
            _print_check(check, out)
    print("", file=out)
    for line in state.lines(MODEL):
        print(line, file=out)
    if refusal:
        print(f"  {_MARKS['refusal']:8} {'data model':12} {refusal}", file=out)
    refusals = sum(len(r.refusals) for r in reports) + bool(refusal) + bool(state.error)
    warnings = sum(len(r.warnings) for r in reports)
    counts = f"{refusals} refusal{'s' * (refusals != 1)}, {warnings} warning{'s' * (warnings != 1)}"
    verdict = "REFUSED: the lock manager would not start here" if refusals else "usable by otel-lock"
    print(f"\nverdict: {verdict} ({counts})", file=out)


def _print_check(check: Check, out: TextIO) -> None:
    print(f"  {_MARKS[check.verdict]:8} {check.name:12} {check.detail}", file=out)
    if check.fix and check.verdict in ("warning", "refusal", "note"):
        print(f"  {'':8} {'':12} fix: {check.fix}", file=out)


def _no_permission(error: BaseException | None) -> bool:
    """Did the user lack an ACL right (the error itself, or what it was raised from)?"""
    from redis.exceptions import NoPermissionError

    while error is not None:
        if isinstance(error, NoPermissionError) or "no permissions" in str(error):
            return True
        error = error.__cause__
    return False
