"""What each Redis state becomes for a lock user: the class, the message, the circuit breaker.

Every scenario is a real server set up that way (maxclients, maxmemory,
requirepass, ACL users, a replica, an RDB still loading), reached through
`LockManager.from_url(...)`. Transient states are RedisUnavailable and open
the breaker; misconfiguration is RedisMisconfigured, says what to fix (the
ACL rule it prints is applied and then works), and never opens the breaker.
Every message names the server (host:port, no password) and the operation.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import shutil
import tempfile
import time

import httpx
import pytest
import redis.asyncio as aioredis
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import (AuthenticationError, BusyLoadingError, ClusterDownError, ConnectionError, DataError,
                              MasterDownError, NoPermissionError, OutOfMemoryError, ReadOnlyError, ResponseError,
                              TimeoutError, TryAgainError)

from _redis_states import ByteProxy, add_acl_users, admin, loading_server
from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route

from otel_lock import LockError, LockManager, LockMiddleware, RedisMisconfigured, RedisUnavailable, idempotent, locked
from otel_lock.asgi._answers import redis_answer
from otel_lock.asgi.idempotency import IdempotencyStore, RecordStoreUnavailable
from otel_lock.asgi.idempotency._store_errors import translate
from otel_lock.cli._redis_server import RedisServer, free_port
from otel_lock.lock._errors import (LOCK_COMMANDS, MISCONFIGURED, UNAVAILABLE, error_type, is_unavailable,
                                    to_lock_error)

NS = "shop"
KEY = "shop:{k}"


@pytest.fixture
def server():
    """A private server: the tests change its limits, password and ACL."""
    with RedisServer() as s:
        add_acl_users(s.port, NS)
        yield s


def manager(port: int, userinfo: str = "", db: int = 0, **options) -> LockManager:
    return LockManager.from_url(f"redis://{userinfo}127.0.0.1:{port}/{db}", namespace=NS, breaker_failures=2,
                                breaker_cooldown=30.0, **options)


async def refused(call, cls: type[LockError], *words: str, port: int, secret: str = "") -> LockError:
    """`call()` raises `cls` whose message names the server, the operation and `words`, never `secret`."""
    with pytest.raises(cls) as info:
        await call()
    message = str(info.value)
    assert f"127.0.0.1:{port}" in message, message
    assert any(op in message for op in ("acquire of shop:{", "subscribe", "listing locks", "forced release")), message
    for word in words:
        assert word in message, f"{word!r} not in {message!r}"
    if secret:
        assert secret not in message
    return info.value


def circuit_open(error: BaseException) -> bool:
    return isinstance(error, RedisUnavailable) and "circuit open" in str(error)


async def attempts(locks: LockManager, count: int, key: str = "k") -> list[BaseException]:
    errors = []
    for _ in range(count):
        try:
            held = await locks.try_lock(key)
        except LockError as error:
            errors.append(error)
        else:
            raise AssertionError(f"took {held} on a server that should refuse")
    return errors


# -- transient: RedisUnavailable, and the breaker counts it -------------------------------


async def test_maxclients_is_unavailable_and_opens_the_circuit(server):
    """Regression: maxclients was a plain LockError (500) and counted as a healthy answer by the breaker."""
    a = admin(server.port)
    a.config_set("maxclients", str(a.info("clients")["connected_clients"]))
    locks = manager(server.port)
    try:
        await refused(lambda: locks.try_lock("k"), RedisUnavailable, "maxclients", port=server.port)
        errors = await attempts(locks, 3)
        assert circuit_open(errors[-1]), errors  # new acquisitions now fail at once, no new connection
        assert errors[-1].retry_after is not None
    finally:
        a.config_set("maxclients", "10000")
        a.close()
        await locks.aclose()


async def test_out_of_memory_under_noeviction_is_unavailable_and_opens_the_circuit(server):
    a = admin(server.port)
    a.config_set("maxmemory-policy", "noeviction")
    a.config_set("maxmemory", "1")
    locks = manager(server.port)
    try:
        error = await refused(lambda: locks.try_lock("k"), RedisUnavailable, "OOM", "maxmemory", port=server.port)
        assert error.key == KEY
        assert circuit_open((await attempts(locks, 3))[-1])
        a.config_set("maxmemory", "0")
    finally:
        a.config_set("maxmemory", "0")
        a.close()
        await locks.aclose()


async def test_a_replica_is_unavailable_and_says_so(server):
    with RedisServer(extra_args=("--replicaof", "127.0.0.1", str(server.port))) as replica:
        locks = manager(replica.port)
        try:
            await refused(lambda: locks.try_lock("k"), RedisUnavailable, "READONLY", "replica", port=replica.port)
            assert circuit_open((await attempts(locks, 3))[-1])
        finally:
            await locks.aclose()


async def test_a_loading_server_is_unavailable():
    with loading_server() as port:
        locks = manager(port)
        try:
            await refused(lambda: locks.try_lock("k"), RedisUnavailable, "LOADING", port=port)
        finally:
            await locks.aclose()


async def test_a_refused_connection_is_unavailable_and_names_the_server():
    port = free_port()
    locks = manager(port)
    try:
        await refused(lambda: locks.try_lock("k"), RedisUnavailable, port=port)
        async with asyncio.timeout(10):
            await refused(lambda: locks.acquire("k", wait=0.2), RedisUnavailable, port=port)
    finally:
        await locks.aclose()


async def test_a_reset_in_the_middle_of_a_reply_is_unavailable_and_names_the_server(server):
    proxy = await ByteProxy(server.port).start()
    locks = manager(proxy.port)
    try:
        warm = await locks.try_lock("warm")  # scripts loaded, the socket open
        await warm.release()
        proxy.cut_replies_after(3)
        await refused(lambda: locks.try_lock("k"), RedisUnavailable, "lost", port=proxy.port)
        assert await locks.try_lock("k") is not None  # a new socket: answers again
    finally:
        await locks.aclose()
        await proxy.aclose()


# -- misconfigured: RedisMisconfigured, the fix in the message, no outage ------------------


async def test_a_missing_password_says_to_put_it_in_the_url_and_never_opens_the_circuit(server):
    admin(server.port).config_set("requirepass", "s3cret-pw")
    locks = manager(server.port)
    try:
        await refused(lambda: locks.try_lock("k"), RedisMisconfigured, "requires a password", "redis://:PASSWORD@",
                      port=server.port)
        errors = await attempts(locks, 6)
        assert all(isinstance(e, RedisMisconfigured) for e in errors), errors  # never "circuit open"
        assert not any(circuit_open(e) for e in errors)
    finally:
        await locks.aclose()
        admin(server.port, password="s3cret-pw").config_set("requirepass", "")


async def test_a_wrong_password_or_a_disabled_user_is_misconfigured_and_the_password_is_never_shown(server):
    for userinfo, secret in (("full:not-the-pw@", "not-the-pw"), ("disabled:pw@", ""), ("nobody:pw2@", "pw2")):
        locks = manager(server.port, userinfo)
        try:
            await refused(lambda: locks.try_lock("k"), RedisMisconfigured, "password is wrong", port=server.port,
                          secret=secret)
        finally:
            await locks.aclose()


async def test_a_password_sent_to_a_passwordless_server_says_to_remove_it(server):
    locks = manager(server.port, ":needless-pw@")
    try:
        await refused(lambda: locks.try_lock("k"), RedisMisconfigured, "no password", "remove it from the URL",
                      port=server.port, secret="needless-pw")
    finally:
        await locks.aclose()


async def test_a_database_out_of_range_is_misconfigured(server):
    locks = manager(server.port, db=99)
    try:
        await refused(lambda: locks.try_lock("k"), RedisMisconfigured, "databases", port=server.port)
        assert not any(circuit_open(e) for e in await attempts(locks, 4))
        # the operator's calls (redis-py's pool) say the same
        await refused(locks.held_locks, RedisMisconfigured, "databases", port=server.port)
        await refused(lambda: locks.force_release("k"), RedisMisconfigured, "databases", port=server.port)
    finally:
        await locks.aclose()


@pytest.mark.parametrize("user, rule", [
    ("nokeys", "~shop:*"),
    ("noevalsha", "+evalsha"),
    ("nohset", LOCK_COMMANDS),  # refused inside a script, where Redis 7.0 does not name the command
])
async def test_missing_acl_rights_name_the_rule_and_the_rule_fixes_it(server, user, rule):
    locks = manager(server.port, f"{user}:pw@")
    try:
        error = await refused(lambda: locks.try_lock("k"), RedisMisconfigured, "ACL", port=server.port)
        # the rule, as the classification (in backticks) or the first-use server check ("fix: ...") writes it
        fix = re.search(rf"ACL SETUSER {user} ([^`)]+)", str(error))
        assert fix is not None, str(error)
        assert set(fix.group(1).split()) <= set(rule.split()), str(error)
        assert not any(circuit_open(e) for e in await attempts(locks, 4))
        admin(server.port).execute_command("ACL", "SETUSER", user, *fix.group(1).split())  # what the message says
        held = await locks.try_lock("k")
        assert held is not None
        await held.release()
    finally:
        await locks.aclose()


async def test_a_user_without_channel_rights_waits_by_polling_and_is_told_the_channel_rule(server, caplog):
    """No wake channel: waiters poll instead (one warning naming the rule to add), never a 503 for a config."""
    holder = manager(server.port)
    locks = manager(server.port, "nochannels:pw@")
    try:
        free = await locks.try_lock("free")
        assert free is not None
        await free.release()
        held = await holder.acquire("k")
        waiting = asyncio.ensure_future(locks.acquire("k", wait=10.0))
        while not any("&shop:wake:*" in r.getMessage() for r in caplog.records):
            await asyncio.sleep(0.01)  # the waiter met the refused SUBSCRIBE and polls
        assert not waiting.done()
        await held.release()
        mine = await waiting
        await mine.release()
        warnings = [r for r in caplog.records if "poll" in r.getMessage() and r.levelname == "WARNING"]
        assert len(warnings) == 1, warnings
    finally:
        await holder.aclose()
        await locks.aclose()


async def test_an_unauthenticated_script_call_through_redis_py_says_to_put_the_password_in_the_url(server):
    """Redis 7 answers a long unauthenticated command "Protocol error: unauthenticated multibulk length"."""

    class Client(aioredis.Redis):  # not the plain class: the lock sends its scripts through redis-py
        pass

    admin(server.port).config_set("requirepass", "s3cret-pw")
    client = Client(host="127.0.0.1", port=server.port, protocol=2, retry=Retry(NoBackoff(), 0))
    locks = LockManager(client, namespace=NS, breaker_failures=2)
    try:
        await refused(lambda: locks.try_lock("k"), RedisMisconfigured, "requires a password", port=server.port)
    finally:
        await locks.aclose()
        await client.aclose()
        admin(server.port, password="s3cret-pw").config_set("requirepass", "")


async def test_misconfiguration_is_counted_as_its_own_error_type(server):
    reader = InMemoryMetricReader()
    locks = manager(server.port, db=99, meter_provider=MeterProvider(metric_readers=[reader]))
    try:
        await attempts(locks, 2)
    finally:
        await locks.aclose()
    kinds = {dict(point.attributes).get("error.type")
             for resource in reader.get_metrics_data().resource_metrics for scope in resource.scope_metrics
             for metric in scope.metrics if metric.name == "otel_lock.errors" for point in metric.data.data_points
             if point.value > 0}  # the series seeded at 0 before their first event aside
    assert kinds == {MISCONFIGURED}


# -- SCRIPT FLUSH racing the reload ---------------------------------------------------------


async def test_queued_waiters_never_see_noscript_however_often_the_scripts_are_flushed(server):
    """Regression: a SCRIPT FLUSH between the reload and the call gave a queued waiter LockError NOSCRIPT."""
    locks = manager(server.port)
    flusher = aioredis.Redis(port=server.port)
    done = asyncio.Event()

    async def flush_forever() -> int:
        flushes = 0
        while not done.is_set():
            await flusher.script_flush()
            flushes += 1
        return flushes

    async def take_turn(i: int) -> int:
        async with locks.lock("k", wait=30.0) as held:
            await asyncio.sleep(0)
            return held.token

    try:
        flushing = asyncio.ensure_future(flush_forever())
        tokens = await asyncio.gather(*(take_turn(i) for i in range(40)))
        done.set()
        assert await flushing > 40
        assert len(set(tokens)) == 40
    finally:
        done.set()
        await locks.aclose()
        await flusher.aclose()


# -- the classification itself, on the errors redis-py and the lean connection raise ----------


ERROR_KINDS = [
    (ConnectionError("Error 111 connecting to 127.0.0.1:1. Connection refused."), UNAVAILABLE),
    (TimeoutError("Timeout reading from socket"), UNAVAILABLE),
    (OSError(104, "Connection reset by peer"), UNAVAILABLE),
    (BusyLoadingError("Redis is loading the dataset in memory"), UNAVAILABLE),
    (ReadOnlyError("You can't write against a read only replica."), UNAVAILABLE),
    (MasterDownError("Link with MASTER is down and replica-serve-stale-data is set to 'no'."), UNAVAILABLE),
    (TryAgainError("Multiple keys request during rehashing of slot"), UNAVAILABLE),
    (ClusterDownError("The cluster is down"), UNAVAILABLE),
    (ConnectionError("max number of clients reached"), UNAVAILABLE),
    (ResponseError("ERR max number of clients reached"), UNAVAILABLE),
    (OutOfMemoryError("command not allowed when used memory > 'maxmemory'."), UNAVAILABLE),
    (ResponseError("OOM command not allowed when used memory > 'maxmemory'."), UNAVAILABLE),
    (ResponseError("MISCONF Redis is configured to save RDB snapshots, but it's currently unable to persist"),
     UNAVAILABLE),
    (ResponseError("BUSY Redis is busy running a script."), UNAVAILABLE),
    (ResponseError("NOREPLICAS Not enough good replicas to write."), UNAVAILABLE),
    (AuthenticationError("Authentication required."), MISCONFIGURED),
    (ResponseError("NOAUTH Authentication required."), MISCONFIGURED),
    (ResponseError("Protocol error: unauthenticated multibulk length"), MISCONFIGURED),
    (ResponseError("ERR Protocol error: unauthenticated bulk length"), MISCONFIGURED),
    (AuthenticationError("invalid username-password pair or user is disabled."), MISCONFIGURED),
    (ResponseError("WRONGPASS invalid username-password pair or user is disabled."), MISCONFIGURED),
    (AuthenticationError("AUTH <password> called without any password configured for the default user. "
                         "Are you sure your configuration is correct?"), MISCONFIGURED),
    (NoPermissionError("this user has no permissions to run the 'evalsha' command"), MISCONFIGURED),
    (ResponseError("NOPERM User app has no permissions to access the 'shop:{k}' key"), MISCONFIGURED),
    (ResponseError("The user executing the script can't run this command or subcommand script: x"),
     MISCONFIGURED),
    (ResponseError("DB index is out of range"), MISCONFIGURED),
    (ResponseError("unknown command 'EVALSHA', with args beginning with:"), MISCONFIGURED),
    (ResponseError("WRONGTYPE Operation against a key holding the wrong kind of value"), "redis_error"),
    (ResponseError("Protocol error: invalid bulk length"), "redis_error"),
    (DataError("Invalid input of type: 'NoneType'."), "redis_error"),
]


@pytest.mark.parametrize("error, kind", ERROR_KINDS)
def test_error_types(error, kind):
    assert error_type(error) == kind
    assert is_unavailable(error) == (kind == UNAVAILABLE)
    wrapped = to_lock_error(error, "acquire of shop:{k}", key=KEY)
    assert type(wrapped) is {UNAVAILABLE: RedisUnavailable, MISCONFIGURED: RedisMisconfigured}.get(kind, LockError)
    assert wrapped.key == KEY and error_type(wrapped) == kind


def test_an_acl_refusal_names_the_user_and_the_exact_rule():
    error = to_lock_error(NoPermissionError("User app has no permissions to run the 'script|load' command"),
                          "acquire of shop:{k}", key=KEY)
    assert "ACL SETUSER app +script|load" in str(error)
    error = to_lock_error(NoPermissionError("this user has no permissions to access one of the channels used "
                                            "as arguments"), "subscribe", key=KEY)
    assert re.search(r"ACL SETUSER default &shop:wake:\*", str(error))


# -- one classifier, one answer: the lock and the idempotency record store agree -----


@pytest.mark.parametrize("error, kind", [(e, k) for e, k in ERROR_KINDS])
def test_the_record_store_classifies_each_error_as_the_lock_does(error, kind):
    translated = translate(error)
    assert isinstance(translated, RecordStoreUnavailable) == (kind == UNAVAILABLE), translated
    locked_answer = redis_answer(to_lock_error(error, "acquire of shop:{k}"), "the lock service", 1.0)
    stored_answer = redis_answer(translated, "the idempotency store", 1.0)
    assert stored_answer.status == locked_answer.status


@contextlib.contextmanager
def refusing_writes(state: str):
    """A redis-server that refuses writes: NOREPLICAS (min-replicas-to-write without replicas) or MISCONF
    (its last background save failed, stop-writes-on-bgsave-error)."""
    folder = tempfile.mkdtemp(prefix="otel-lock-misconf-")
    try:
        with RedisServer(extra_args=("--dir", folder, "--save", "3600 1")) as server:
            with admin(server.port) as client:
                if state == "NOREPLICAS":
                    client.config_set("min-replicas-to-write", 1)
                else:
                    shutil.rmtree(folder)   # the save's child cannot write its file: the save fails
                    client.bgsave()
                    deadline = time.monotonic() + 10
                    while client.info("persistence")["rdb_last_bgsave_status"] != "err":
                        assert time.monotonic() < deadline, "the background save never failed"
                        time.sleep(0.01)   # polling the server's own state, no other event to wait on
                with pytest.raises(ResponseError, match=state):
                    client.set("probe", "x")
            try:
                yield server
            finally:
                with admin(server.port) as client:
                    client.config_set("save", "")  # else SIGTERM's save fails and it refuses to exit for 5 s
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def one_route_app(manager, store=None):
    async def take(request):
        return JSONResponse({"ran": True}, status_code=201)

    async def charge(request):
        return JSONResponse({"ran": True}, status_code=201)

    app = Starlette(routes=[Route("/locked/{k}", locked("thing:{path.k}")(take), methods=["POST"]),
                            Route("/idempotent", idempotent(shared_scope=True)(charge), methods=["POST"])])
    app.add_middleware(LockMiddleware, manager=manager, idempotency_store=store)
    return app


@pytest.mark.parametrize("state", ["NOREPLICAS", "MISCONF"])
async def test_a_redis_refusing_writes_answers_the_same_from_a_locked_and_an_idempotent_route(redis_url, state):
    with refusing_writes(state) as server:
        # The lock meets the state on a locked route; the record store meets it on an idempotent route
        # (its in-flight lock on a healthy Redis).
        locks = LockManager.from_url(server.url, namespace=NS)
        healthy = LockManager.from_url(redis_url, namespace=NS)
        store = IdempotencyStore.from_url(server.url)
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=one_route_app(locks)),
                                         base_url="http://test") as client:
                from_lock = await client.post("/locked/1")
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=one_route_app(healthy, store)),
                                         base_url="http://test") as client:
                from_store = await client.post("/idempotent", headers={"idempotency-key": '"k1"'})
        finally:
            await locks.aclose()
            await healthy.aclose()
            await store.aclose()
    for answer in (from_lock, from_store):
        assert answer.status_code == 503, (answer.request.url, answer.request.headers, answer.text)
        assert answer.json()["type"].endswith("/redis-unavailable") and answer.headers["retry-after"]


def test_the_acl_rule_a_refusal_names_covers_every_command_of_every_script():
    """A refusal's fix (`ACL SETUSER ... LOCK_COMMANDS`) must let every script run, the shapes' included."""
    import re
    from pathlib import Path

    import otel_lock.lock

    sources = "".join(p.read_text() for p in Path(otel_lock.lock.__file__).parent.glob("*.py"))
    called = {c.lower() for c in re.findall(r"redis\.call\('([A-Z]+)'", sources)}
    called |= {c.lower() for c in re.findall(r"publish = '([A-Z]+)'", sources)}
    assert called - {rule[1:] for rule in LOCK_COMMANDS.split()} == set()
