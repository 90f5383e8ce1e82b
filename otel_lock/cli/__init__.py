"""The `otel-lock` command: demo, serve, locks, unlock, stack, doctor.

Heavy imports (uvicorn, the demo app, the lock core) happen inside each
subcommand, so `otel-lock --help` is instant and a bad argument is reported
(exit 2) before anything starts. `locks` and `unlock` need only the core;
serve, demo and stack need the `[cli]` extra, and say so when it is missing.

Exit status: 0 done, 1 failed (Redis unreachable or refusing, lock not held,
missing extra, demo verdict FAILED), 2 bad arguments, 3 `unlock` released the
lock but could not write its audit record, 130 interrupted.
Errors are one line on stderr, never a traceback.
"""

from __future__ import annotations

import argparse
import asyncio
import getpass
import json
import logging
import os
import socket
import sys
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, TypeVar
from urllib.parse import urlsplit

from .. import __version__
from .._extras import MissingExtra, requires
from ._redis_server import redact_url

if TYPE_CHECKING:
    from .. import LockInfo, LockManager

__all__ = ["AUDIT_STREAM_LEN", "DEFAULT_NAMESPACE", "build_parser", "main"]

DEFAULT_NAMESPACE = "otel-lock"
AUDIT_STREAM_LEN = 10_000


# -- argument types: each names what is wrong -------------------------------


def _redis_url(value: str) -> str:
    try:
        scheme = urlsplit(value).scheme
    except ValueError as exc:  # "Invalid IPv6 URL"
        raise argparse.ArgumentTypeError(f"bad Redis URL {redact_url(value)!r}: {exc}") from None
    if scheme not in ("redis", "rediss", "unix", "redis+sentinel", "redis+cluster"):
        raise argparse.ArgumentTypeError(
            f"not a Redis URL: {redact_url(value)!r} (expected redis://host:port/db, "
            "redis+sentinel://host:port[,host:port...]/service or redis+cluster://host:port[,host:port...])")
    # The core's own parsers, and redis-py's for one server: a bad URL is exit 2 here, for every command,
    # not a traceback at the first command nor an error in every replica.
    try:
        if scheme == "redis+sentinel":
            from ..lock._sentinel import parse_url as parse_sentinel_url
            parse_sentinel_url(value)
        elif scheme == "redis+cluster":
            from ..lock._cluster import parse_url as parse_cluster_url
            parse_cluster_url(value)
        else:
            from ..lock._url_check import url_checked
            url_checked(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return value


def _port(value: str) -> int:
    try:
        port = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {value!r}") from None
    if not 0 < port < 65536:
        raise argparse.ArgumentTypeError(f"port must be 1-65535, got {port}")
    return port


def _interval(value: str) -> float:
    try:
        number = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {value!r}") from None
    # Below 0.1 s a tick is shorter than a Redis hiccup; 0 switches the job off.
    if not (number == 0 or 0.1 <= number <= 86400):
        raise argparse.ArgumentTypeError(f"must be 0 (off) or 0.1-86400 seconds, got {value}")
    return number


def _positive_interval(value: str) -> float:
    number = _interval(value)
    if number == 0:
        raise argparse.ArgumentTypeError("must be 0.1-86400 seconds here")
    return number


def _count(value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {value!r}") from None
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {number}")
    return number


def _namespace(value: str) -> str:
    if not value or len(value) > 128 or any(c in value for c in "{}*? \n\r\t"):
        raise argparse.ArgumentTypeError(f"namespace must be 1-128 characters without braces, "
                                         f"wildcards or whitespace: {value!r}")
    return value


def _reason(value: str) -> str:
    if not value.strip():
        raise argparse.ArgumentTypeError("say why, for the audit record: --reason 'holder pod was deleted'")
    return _utf8(value, "the reason")


def _utf8(value: str, what: str) -> str:
    """Refuse what Redis could not be sent: bytes that are not UTF-8 arrive as lone surrogates."""
    try:
        value.encode()
    except UnicodeEncodeError:
        shown = value.encode(errors="surrogateescape").decode(errors="backslashreplace")
        raise argparse.ArgumentTypeError(f"{what} '{shown}' is not UTF-8 text (set the terminal to "
                                         "UTF-8, or write it in ASCII)") from None
    return value


def _lock_key(value: str) -> str:
    return _utf8(value, "the lock name")


def _add_redis(parser: argparse.ArgumentParser, default: str | None) -> None:
    parser.add_argument("--redis-url", type=_redis_url, default=os.environ.get("REDIS_URL", default),
                        help="Redis to use (default: $REDIS_URL" + (f", else {default})" if default else ")"))
    parser.add_argument("--namespace", type=_namespace, default=DEFAULT_NAMESPACE,
                        help=f"key prefix shared by all replicas (default: {DEFAULT_NAMESPACE})")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="otel-lock", description="Redis locks for Starlette/FastAPI replicas, observable with OpenTelemetry.")
    parser.add_argument("--version", action="version", version=f"otel-lock {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    demo = commands.add_parser(
        "demo", help="two replicas, a seckill, a multi-product checkout and a double-submit burst, and a summary",
        description="Start Redis (unless --redis-url/REDIS_URL is given) and two demo-shop replicas, "
                    "fire a seckill burst, a burst of multi-product checkouts and a double-submit burst, "
                    "print a summary. Exit status 1 if anything was oversold or an order was created twice.")
    demo.add_argument("--redis-url", type=_redis_url, default=os.environ.get("REDIS_URL"),
                      help="use this Redis (default: $REDIS_URL, else a redis-server from PATH on a free port)")
    demo.add_argument("--namespace", type=_namespace, default="otel-lock-demo", help="key prefix (default: %(default)s)")
    demo.add_argument("--replicas", type=_count, default=2, help="replica processes (default: %(default)s)")
    demo.add_argument("--buyers", type=_count, default=200,
                      help="concurrent buyers, and concurrent carts at checkout (default: %(default)s)")
    demo.add_argument("--items", type=_count, default=100,
                      help="items in stock, of each product at checkout (default: %(default)s)")
    demo.add_argument("--double-submits", type=_count, default=20,
                      help="concurrent copies of one order (default: %(default)s)")
    demo.add_argument("--job-interval", type=_positive_interval, default=0.5,
                      help="seconds between the replicas' job ticks (default: %(default)s)")

    serve = commands.add_parser(
        "serve", help="run the demo shop under uvicorn",
        description="Run the demo shop (one replica) under uvicorn.",
        epilog="environment: REDIS_URL (default for --redis-url); OTEL_LOCK_DEMO_DISABLE_LOCKS=1 turns every "
               "lock off, to show what they prevent; OTEL_LOCK_DEMO_WORK_MS=20 adds slow work inside the "
               "stock lock; OTEL_EXPORTER_OTLP_ENDPOINT enables OTLP export (Prometheus text is at /metrics).")
    serve.add_argument("--host", default="127.0.0.1", help="bind address (default: %(default)s)")
    serve.add_argument("--port", type=_port, default=8000, help="port (default: %(default)s)")
    _add_redis(serve, "redis://127.0.0.1:6379/0")
    serve.add_argument("--replica-name", default=None, help="name in job runs and telemetry (default: hostname-pid)")
    serve.add_argument("--job-interval", type=_interval, default=10.0,
                       help="seconds between background job ticks, 0 = off (default: %(default)s)")
    serve.add_argument("--log-level", default="warning",
                       choices=["critical", "error", "warning", "info", "debug"], help="(default: %(default)s)")

    locks = commands.add_parser("locks", help="list held locks: key, owner, depth, TTL, token",
                                description="List the locks held right now in a namespace, page by page as "
                                            "SCAN reads them (sorted within a page), in bounded memory.")
    _add_redis(locks, "redis://127.0.0.1:6379/0")
    locks.add_argument("--json", action="store_true",
                       help="print a JSON array of {key, name, owner, depth, ttl, token} (ttl in seconds, "
                            "null without expiry; depth or token null when not a whole number in Redis), "
                            "one object per line as the locks are read")

    unlock = commands.add_parser(
        "unlock", help="force-release a lock (audited)",
        description="Delete a lock whatever its owner, for an operator who knows the holder is gone. "
                    "Appended to the Redis stream <namespace>:audit; the result goes to stdout. "
                    "Exit status 1 if the lock was not held, 3 if it was released but the audit record "
                    "could not be written (stderr says why).")
    unlock.add_argument("key", metavar="KEY", type=_lock_key,
                        help="lock name (stock:1001) or Redis key as `locks` prints it")
    _add_redis(unlock, "redis://127.0.0.1:6379/0")
    unlock.add_argument("--reason", required=True, type=_reason, help="why, for the audit record (required)")

    doctor = commands.add_parser(
        "doctor", help="check a Redis for the lock: eviction, memory, persistence, ACL, version, replication",
        description="Check the server(s) a Redis URL names as a lock manager would at first use: eviction "
                    "policy, memory, persistence, ACL rights (scripts, keys, wake channels), version, "
                    "replication and a round trip; every master of a redis+cluster:// URL. Exit status 0 "
                    "when the lock may use it (warnings allowed), 1 when a check refuses it or it cannot "
                    "be reached.")
    _add_redis(doctor, "redis://127.0.0.1:6379/0")
    doctor.add_argument("--json", action="store_true", help="print the reports as JSON")
    doctor.add_argument("--require-noeviction", action="store_true",
                        help="refuse an evicting or unknown maxmemory-policy, as require_noeviction=True does")

    commands.add_parser("stack", help="run the compose topology without Docker: redis-server, two replicas, Debian prometheus (arguments are passed on)",
                        add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run `otel-lock ARGV...` and return the exit status (argparse exits 2 itself on bad arguments)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        if argv[:1] == ["stack"]:
            # Its own parser owns every argument after `stack`, --help included.
            with requires("cli", "otel-lock stack"):
                from ._local_stack import main as stack_main
            return stack_main(argv[1:]) or 0
        args = build_parser().parse_args(argv)
        logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s",
                            stream=sys.stderr)
        command: Callable[[argparse.Namespace], int] = _COMMANDS[args.command]
        return command(args)
    except MissingExtra as exc:
        print(f"otel-lock: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\notel-lock: interrupted", file=sys.stderr)
        return 130


# -- commands -------------------------------------------------------------


def _demo(args: argparse.Namespace) -> int:
    with requires("cli", "otel-lock demo"):
        from ._demo import DemoOptions, run_demo

    return run_demo(DemoOptions(redis_url=args.redis_url, replicas=args.replicas, buyers=args.buyers,
                                items=args.items, double_submits=args.double_submits, namespace=args.namespace,
                                job_interval=args.job_interval))


def _serve(args: argparse.Namespace) -> int:
    with requires("cli", "otel-lock serve"):
        import uvicorn

        from .. import telemetry
        from ..demo import DemoSettings, create_app

        name = args.replica_name or f"{socket.gethostname()}-{os.getpid()}"
        # The demo hashes lock keys and owners on spans (they carry user ids) unless told otherwise.
        setup = telemetry.setup(service_name="otel-lock-demo", service_instance_id=name,
                                redact=os.environ.get("OTEL_LOCK_REDACT", "hash"))
    settings = DemoSettings.from_env(redis_url=args.redis_url, namespace=args.namespace, replica_name=name,
                                     job_interval=args.job_interval)
    app = setup.instrument_app(create_app(settings))
    try:
        # On SIGTERM uvicorn shuts the app down, then raises the signal again: setup()'s
        # handler flushes the telemetry before the process dies of it (telemetry._signals).
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, access_log=False,
                    lifespan="on")
    finally:
        setup.shutdown()  # a normal return, Ctrl-C (KeyboardInterrupt) or a start-up failure: flush too
    return 0


_T = TypeVar("_T")


def _against_redis(command: str, args: argparse.Namespace, work: Callable[[LockManager], Awaitable[_T]]) -> _T:
    """Run `work(manager)` on a fresh manager; every Redis failure becomes _RedisFailed (one line)."""
    from redis.exceptions import RedisError

    from .. import LockError, LockManager

    async def run() -> _T:
        manager = LockManager.from_url(args.redis_url, namespace=args.namespace, socket_timeout=2.0)
        try:
            return await work(manager)
        finally:
            await manager.aclose()

    try:
        return asyncio.run(run())
    except (RedisError, LockError, OSError) as exc:
        why = _describe_redis_error(exc, args.redis_url).replace("<namespace>", args.namespace)
        raise _RedisFailed(f"otel-lock {command}: {why}") from exc


class _RedisFailed(Exception):
    """A Redis error already worded for the operator."""


def _describe_redis_error(exc: BaseException, url: str) -> str:
    """One line that says what went wrong with the Redis at `url` (its password never shown)."""
    from redis.exceptions import AuthenticationError, InvalidResponse, NoPermissionError, ResponseError
    from redis.exceptions import ConnectionError as RedisConnectionError
    from redis.exceptions import TimeoutError as RedisTimeoutError

    from .. import LockError

    where = redact_url(url)
    cause = _root_cause(exc)
    detail = (str(cause).strip().splitlines() or [type(cause).__name__])[0]
    if isinstance(cause, AuthenticationError):
        return f"Redis at {where} refused the credentials: {detail}"
    if isinstance(cause, NoPermissionError) and isinstance(exc, LockError) and "; " in str(exc):
        # the core's message names the ACL rule to grant
        return f"Redis at {where} refused the user: {detail}; {str(exc).split('; ', 1)[1]}"
    if isinstance(cause, InvalidResponse):
        return f"{where} does not speak the Redis protocol (is it an HTTP or other server?): {detail}"
    if isinstance(cause, ResponseError):
        return f"Redis at {where} answered with an error: {detail}"
    if isinstance(cause, (RedisConnectionError, RedisTimeoutError, OSError)):
        return f"Redis unreachable at {where}: {detail}"
    return f"Redis error at {where}: {type(cause).__name__}: {detail}"


def _root_cause(exc: BaseException) -> BaseException:
    """The Redis error under the core's own wrappers (RedisUnavailable ... from ConnectionError)."""
    from redis.exceptions import RedisError

    cause, seen = exc.__cause__, {id(exc)}
    while cause is not None and id(cause) not in seen:
        if isinstance(cause, (RedisError, OSError)):
            return cause
        seen.add(id(cause))
        cause = cause.__cause__
    return exc


def _locks(args: argparse.Namespace) -> int:
    """Print each SCAN batch as it comes: memory stays one page, whatever the namespace holds."""
    from ._printing import JsonRows, TextRows

    rows = JsonRows(args.namespace) if args.json else TextRows(args.namespace)

    async def stream(manager: LockManager) -> None:
        async for page in manager._held_pages():
            try:
                rows.write(page)
            except BrokenPipeError as exc:  # not a Redis error: the reader went away
                raise _ReaderGone from exc

    try:
        try:
            _against_redis("locks", args, stream)
        except _RedisFailed as exc:
            print(exc, file=sys.stderr)
            rows.cut()
            return 1
        rows.end()
        return 0
    except (_ReaderGone, BrokenPipeError):
        # `otel-lock locks | head`: the reader has what it wanted; nothing more to print, not even at exit
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


class _ReaderGone(Exception):
    """Whoever read the output closed it (`| head`)."""


def _lock_name(key: str, namespace: str) -> str:
    """Accept the Redis key as `locks` prints it (`ns:{name}`) as well as the bare name."""
    prefix = f"{namespace}:{{"
    if key.startswith(prefix) and key.endswith("}"):
        return key[len(prefix):-1]
    return key


def _unlock(args: argparse.Namespace) -> int:
    """Everything that can be checked is checked before the release: after it, only the audit write can fail."""
    from redis.exceptions import RedisError

    from ..lock._options import check_key

    name = _lock_name(args.key, args.namespace)
    try:
        check_key(name)  # the core rejects names it could never have locked
    except ValueError as exc:
        print(f"otel-lock unlock: {exc}", file=sys.stderr)
        return 2
    who = f"{_user()}@{socket.gethostname()}"
    stream = f"{args.namespace}:audit"

    async def force(manager: LockManager) -> tuple[bool, str]:
        released = await manager.force_release(name)
        try:
            # The audit record lives next to the locks, so every operator sees it.
            await manager.redis.xadd(stream, {
                "action": "unlock", "lock": name, "by": who, "pid": str(os.getpid()),
                "released": "1" if released else "0", "reason": args.reason, "at": f"{time.time():.3f}",
            }, maxlen=AUDIT_STREAM_LEN, approximate=True)
        except (RedisError, OSError) as exc:
            return released, _describe_redis_error(exc, args.redis_url)
        return released, ""

    try:
        released, unaudited = _against_redis("unlock", args, force)
    except _RedisFailed as exc:
        print(exc, file=sys.stderr)
        return 1
    what = f"lock {name!r} in namespace {args.namespace!r}"
    if not released:
        audited = f"attempt NOT audited: {unaudited}" if unaudited else "attempt audited"
        print(f"otel-lock unlock: {what} was not held; nothing released ({audited})", file=sys.stderr)
        return 1
    if unaudited:
        print(f"released {what} (forced by {who}, reason: {args.reason}; NOT audited)")
        print(f"otel-lock unlock: {what} WAS released, but its audit record could not be written to "
              f"{stream}: {unaudited}", file=sys.stderr)
        return 3
    print(f"released {what} (forced by {who}, reason: {args.reason}; audited in {stream})")
    return 0


def _user() -> str:
    """The operator's login name, or the uid where the system has none for it (a container)."""
    try:
        return getpass.getuser()
    except (OSError, KeyError):
        return f"uid{os.getuid()}"


def _doctor(args: argparse.Namespace) -> int:
    from ._doctor import run_doctor

    return run_doctor(args)


_COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "demo": _demo, "serve": _serve, "locks": _locks, "unlock": _unlock, "doctor": _doctor,
}
