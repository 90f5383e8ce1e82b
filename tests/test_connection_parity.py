"""The lean connection against redis-py: one list of cases, the same outcome from both.

Each case runs once on the lean `Connection` and once on a redis-py
`redis.asyncio.Redis` with the same settings (RESP2, which the lean
connection speaks, and no retries: a retry is a client's policy, not the
connection's). The outcome is "ok" (with the value for ECHO, so the bytes
that reached Redis are compared too) or the exception class. After every
case, concurrent ECHOs on the same lean connection must each get their own
reply: nothing a case did may shift a reply to another caller.

Where the two cannot be equal, the case says so and what is compared instead:

- An unauthenticated script call with many arguments: redis-py sends it and
  gets "Protocol error: unauthenticated multibulk length" (and Redis hangs
  up on it); the lean connection's handshake asks first and gets NOAUTH.
  Both are RedisMisconfigured ("put the password in the URL").
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import gc
import os
import threading
import warnings
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

import pytest
import redis as sync_redis
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import DataError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from _redis_states import ByteProxy, add_acl_users, admin, loading_server, still_loading
from otel_lock.cli._redis_server import RedisServer, free_port
from otel_lock.lock._connection import Connection, pack
from otel_lock.lock._errors import error_type

TIMEOUT = 2.0


class Color(enum.IntEnum):
    RED = 1


@dataclass
class World:
    """The servers a case may use; `port` is where the clients of this run connect."""

    server: RedisServer
    proxy: ByteProxy
    port: int
    options: dict[str, Any] = field(default_factory=dict)


class Lean:
    kind = "lean"

    def __init__(self, port: int, *, db: int = 0, username: str | None = None, password: str | None = None,
                 timeout: float = TIMEOUT) -> None:
        self.connection = Connection(port=port, db=db, username=username, password=password, timeout=timeout,
                                     connect_timeout=timeout)

    def run(self, *args: Any) -> Awaitable[Any]:
        return self.connection.execute(*args)

    async def aclose(self) -> None:
        await self.connection.aclose()


class RedisPy:
    kind = "redis-py"

    def __init__(self, port: int, *, db: int = 0, username: str | None = None, password: str | None = None,
                 timeout: float = TIMEOUT) -> None:
        self.client = aioredis.Redis(port=port, db=db, username=username, password=password, protocol=2,
                                     socket_timeout=timeout, socket_connect_timeout=timeout,
                                     retry=Retry(NoBackoff(), 0))

    def run(self, *args: Any) -> Awaitable[Any]:
        return self.client.execute_command(*args)

    async def aclose(self) -> None:
        await self.client.aclose()


Client = Lean | RedisPy


@dataclass
class Outcome:
    kind: str                 # "ok", "cancelled" or the exception's class name
    error: BaseException | None = None
    value: Any = None

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Outcome) and (self.kind, self.value) == (other.kind, other.value)

    def __repr__(self) -> str:
        return f"{self.kind}({self.error})" if self.error is not None else f"{self.kind}({self.value!r:.60})"


async def outcome(call: Awaitable[Any], keep_value: bool = False) -> Outcome:
    try:
        value = await call
    except asyncio.CancelledError:
        return Outcome("cancelled")
    except Exception as exc:
        return Outcome(type(exc).__name__, exc)
    return Outcome("ok", value=value if keep_value else None)


# -- the cases -------------------------------------------------------------------

Case = Callable[[World, Callable[..., Client]], Awaitable[tuple[Outcome, Client]]]
CASES: dict[str, Case] = {}


def case(name: str) -> Callable[[Case], Case]:
    def register(fn: Case) -> Case:
        CASES[name] = fn
        return fn
    return register


def echo_case(name: str, *args: Any) -> None:
    async def run(world: World, make: Callable[..., Client]) -> tuple[Outcome, Client]:
        client = make(world.port)
        return await outcome(client.run("ECHO", *args), keep_value=True), client
    CASES[name] = run


SURROGATE = os.fsdecode(b"\xff")  # '\udcff': what os.fsdecode, sys.argv or a lax JSON decoder can hand over
for _name, _value in {
    "str": "héllo ✓ ключ", "empty-str": "", "bytes": b"\x00\xff\r\n", "int": 42, "negative-int": -7,
    "big-int": 2 ** 70, "float": 0.1 + 0.2, "float-exp": 1e300, "float-inf": float("inf"), "float-neg-zero": -0.0,
    "bool": True, "none": None, "memoryview": memoryview(b"mv"), "bytearray": bytearray(b"ba"),
    "nested-list": [1, [2]], "dict": {"a": 1}, "object": object(), "int-enum": Color.RED,
    "lone-surrogate": SURROGATE, "surrogate-in-text": "key:" + SURROGATE + ":1",
}.items():
    echo_case(f"arg-{_name}", _value)
echo_case("simply-large-3MiB", b"x" * (3 << 20))


@case("surrogate-in-a-script-key")
async def _surrogate_key(world: World, make: Callable[..., Client]) -> tuple[Outcome, Client]:
    client = make(world.port)
    return await outcome(client.run("EVALSHA", "0" * 40, 4, SURROGATE, "b", "c", "d", "owner", 1, 2)), client


@case("surrogate-as-command-name")
async def _surrogate_name(world: World, make: Callable[..., Client]) -> tuple[Outcome, Client]:
    client = make(world.port)
    return await outcome(client.run(SURROGATE)), client


@case("command-name-with-a-space")
async def _spaced_name(world: World, make: Callable[..., Client]) -> tuple[Outcome, Client]:
    client = make(world.port)
    return await outcome(client.run("ECHO spaced"), keep_value=True), client


@case("past-proto-max-bulk-len")
async def _past_bulk_limit(world: World, make: Callable[..., Client]) -> tuple[Outcome, Client]:
    with admin(world.server.port) as a:
        a.config_set("proto-max-bulk-len", "1mb")
    client = make(world.port)
    try:
        result = await outcome(client.run("ECHO", b"x" * (2 << 20)))
    finally:
        with admin(world.server.port) as a:
            a.config_set("proto-max-bulk-len", "512mb")
    # Redis answers "invalid bulk length" and hangs up; a write still under way may see the reset first.
    if result.kind == "ConnectionError":
        result = Outcome("ResponseError", result.error)
    return result, client


# Error replies of every class redis-py's parser knows, and some it does not.
for _reply in ["ERR plain", "WRONGTYPE wrong kind", "NOSCRIPT gone", "LOADING loading", "READONLY replica",
               "NOAUTH Authentication required.", "NOPERM no rights", "OOM command not allowed", "WRONGPASS bad",
               "EXECABORT aborted", "TRYAGAIN later", "CLUSTERDOWN down", "MASTERDOWN down", "CROSSSLOT slots",
               "MOVED 1 127.0.0.1:1", "ASK 1 127.0.0.1:1", "ERR max number of clients reached",
               "ERR invalid password", "MISCONF no disk", "BUSY script", "NOREPLICAS few", "ERR DB index is out of range",
               "ERR"]:
    async def _error_reply(world: World, make: Callable[..., Client], reply: str = _reply) -> tuple[Outcome, Client]:
        client = make(world.port)
        return await outcome(client.run("EVAL", "return redis.error_reply(ARGV[1])", 0, reply)), client
    CASES[f"error-reply-{_reply.split()[0]}-{_reply.split()[-1]}"] = _error_reply


@case("wrongtype")
async def _wrongtype(world: World, make: Callable[..., Client]) -> tuple[Outcome, Client]:
    with admin(world.server.port) as a:
        a.set("string", "v")
    client = make(world.port)
    return await outcome(client.run("HGET", "string", "f")), client


@case("unknown-command")
async def _unknown(world: World, make: Callable[..., Client]) -> tuple[Outcome, Client]:
    client = make(world.port)
    return await outcome(client.run("NOSUCHCOMMAND", "x")), client


@case("noscript-after-script-flush")
async def _noscript(world: World, make: Callable[..., Client]) -> tuple[Outcome, Client]:
    client = make(world.port)
    sha = await client.run("SCRIPT", "LOAD", "return 1")
    await client.run("SCRIPT", "FLUSH")
    return await outcome(client.run("EVALSHA", sha, 0)), client


@case("refused")
async def _refused(world: World, make: Callable[..., Client]) -> tuple[Outcome, Client]:
    client = make(free_port())
    return await outcome(client.run("PING")), make(world.port)


@case("reset-while-the-command-is-in-flight")
async def _reset(world: World, make: Callable[..., Client]) -> tuple[Outcome, Client]:
    client = make(world.proxy.port)
    await client.run("PING")
    world.proxy.cut_replies_after(0)
    return await outcome(client.run("ECHO", "x" * 100)), client


@case("reset-in-the-middle-of-a-reply")
async def _reset_mid_reply(world: World, make: Callable[..., Client]) -> tuple[Outcome, Client]:
    client = make(world.proxy.port)
    await client.run("PING")
    world.proxy.cut_replies_after(7)  # "$1000\r\n" and no more
    return await outcome(client.run("ECHO", "x" * 1000)), client


@case("no-reply-within-the-timeout")
async def _timeout(world: World, make: Callable[..., Client]) -> tuple[Outcome, Client]:
    client = make(world.proxy.port, timeout=0.3)
    await client.run("PING")
    world.proxy.hold_replies_after(3)
    result = await outcome(client.run("ECHO", "x" * 1000))
    world.proxy.release()
    return result, client


@case("a-frozen-server")
async def _frozen(world: World, make: Callable[..., Client]) -> tuple[Outcome, Client]:
    client = make(world.port, timeout=0.3)
    await client.run("PING")
    freezer = asyncio.create_task(asyncio.to_thread(admin(world.server.port).execute_command, "DEBUG", "SLEEP", "1"))
    try:
        await _until_async(lambda: _frozen_now(world.server.port))
        return await outcome(client.run("GET", "k")), client
    finally:
        await freezer


@case("cancelled-in-the-middle-of-a-reply")
async def _cancelled(world: World, make: Callable[..., Client]) -> tuple[Outcome, Client]:
    client = make(world.proxy.port)
    await client.run("PING")
    world.proxy.hold_replies_after(10)
    before = world.proxy.replied
    call = asyncio.ensure_future(client.run("ECHO", "x" * 5000))
    await _until_async(lambda: world.proxy.replied >= before + 10)  # part of the reply is in
    call.cancel()
    result = await outcome(call)
    world.proxy.release()  # the rest of it arrives now, for a caller who is gone
    return result, client


@case("maxclients")
async def _maxclients(world: World, make: Callable[..., Client]) -> tuple[Outcome, Client]:
    probe = make(world.port)
    await probe.run("PING")
    with admin(world.server.port) as a:
        connected = a.info("clients")["connected_clients"]
        a.config_set("maxclients", str(connected))
        try:
            result = await outcome(make(world.port).run("GET", "k"))
        finally:
            a.config_set("maxclients", "10000")
    # The server sends its refusal and hangs up: a client reads the refusal (MaxClientsReachedError) or
    # finds the socket closed first (ConnectionError), as the race goes on a busy machine; both clients
    # go either way. Either is the same outcome: refused, a connection error, never a reply.
    if result.kind in ("MaxClientsReachedError", "ConnectionError"):
        result = Outcome("refused: a ConnectionError", result.error)
    return result, probe


@case("noauth")
async def _noauth(world: World, make: Callable[..., Client]) -> tuple[Outcome, Client]:
    with admin(world.server.port) as a:
        a.config_set("requirepass", "secret")
    try:
        return await outcome(make(world.port).run("GET", "k")), make(world.port)
    finally:
        with admin(world.server.port, password="secret") as a:
            a.config_set("requirepass", "")


@case("noauth-on-a-long-script-call")
async def _noauth_long(world: World, make: Callable[..., Client]) -> tuple[Outcome, Client]:
    with admin(world.server.port) as a:
        a.config_set("requirepass", "secret")
    try:
        result = await outcome(make(world.port).run("EVALSHA", "0" * 40, 4, "a", "b", "c", "d", *range(9)))
    finally:
        with admin(world.server.port, password="secret") as a:
            a.config_set("requirepass", "")
    # the one case that cannot be equal (module docstring): compare what the lock makes of it
    assert result.error is not None
    return Outcome(error_type(result.error)), make(world.port)


@case("wrongpass")
async def _wrongpass(world: World, make: Callable[..., Client]) -> tuple[Outcome, Client]:
    return await outcome(make(world.port, username="full", password="nope").run("GET", "k")), make(world.port)


@case("acl-user-disabled")
async def _disabled(world: World, make: Callable[..., Client]) -> tuple[Outcome, Client]:
    return await outcome(make(world.port, username="disabled", password="pw").run("GET", "k")), make(world.port)


@case("password-to-a-passwordless-server")
async def _needless_password(world: World, make: Callable[..., Client]) -> tuple[Outcome, Client]:
    return await outcome(make(world.port, password="secret").run("GET", "k")), make(world.port)


@case("noperm-key")
async def _noperm_key(world: World, make: Callable[..., Client]) -> tuple[Outcome, Client]:
    client = make(world.port, username="nokeys", password="pw")
    return await outcome(client.run("HGET", "otel-lock:{k}", "owner")), client


@case("noperm-command")
async def _noperm_command(world: World, make: Callable[..., Client]) -> tuple[Outcome, Client]:
    client = make(world.port, username="noevalsha", password="pw")
    return await outcome(client.run("EVALSHA", "0" * 40, 0)), client


@case("noperm-channel")
async def _noperm_channel(world: World, make: Callable[..., Client]) -> tuple[Outcome, Client]:
    client = make(world.port, username="nochannels", password="pw")
    return await outcome(client.run("PUBLISH", "otel-lock:wake:x", "m")), client


@case("noperm-inside-a-script")
async def _noperm_script(world: World, make: Callable[..., Client]) -> tuple[Outcome, Client]:
    client = make(world.port, username="nohset", password="pw")
    return await outcome(client.run("EVAL", "return redis.call('HSET', KEYS[1], 'a', 1)", 1, "k")), client


@case("select-99")
async def _select(world: World, make: Callable[..., Client]) -> tuple[Outcome, Client]:
    return await outcome(make(world.port, db=99).run("GET", "k")), make(world.port)


@case("oom-under-noeviction")
async def _oom(world: World, make: Callable[..., Client]) -> tuple[Outcome, Client]:
    client = make(world.port)
    await client.run("PING")
    with admin(world.server.port) as a:
        a.config_set("maxmemory-policy", "noeviction")
        a.config_set("maxmemory", "1")
        try:
            return await outcome(client.run("EVAL", "return redis.call('SET', KEYS[1], 'v')", 1, "k")), client
        finally:
            a.config_set("maxmemory", "0")


@case("readonly-replica")
async def _readonly(world: World, make: Callable[..., Client]) -> tuple[Outcome, Client]:
    with RedisServer(extra_args=("--replicaof", "127.0.0.1", str(world.server.port))) as replica:
        client = make(replica.port)
        result = await outcome(client.run("EVAL", "return redis.call('SET', KEYS[1], 'v')", 1, "k"))
        await client.aclose()
    return result, make(world.port)


@case("loading")
async def _loading(world: World, make: Callable[..., Client]) -> tuple[Outcome, Client]:
    with loading_server(keys=3000) as port:
        client = make(port)
        result = await outcome(client.run("GET", "k"))
        if isinstance(client, Lean):  # the same connection answers in order once the data is in
            await _until_async(lambda: not still_loading(port), timeout=60)
            assert await _echoes(client.run), "replies no longer match their requests after LOADING"
    return result, make(world.port)


# -- the test ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def parity_server():
    with RedisServer(extra_args=("--enable-debug-command", "yes")) as server:
        add_acl_users(server.port)
        yield server


@pytest.fixture
async def world(parity_server):
    with admin(parity_server.port) as a:
        a.flushall()
        a.script_flush()
    proxy = await ByteProxy(parity_server.port).start()
    yield World(parity_server, proxy, parity_server.port)
    await proxy.aclose()


@pytest.mark.parametrize("name", list(CASES))
async def test_the_lean_connection_answers_as_redis_py(world, name):
    made: list[Client] = []

    def maker(cls: type[Lean] | type[RedisPy]) -> Callable[..., Client]:
        def make(port: int, **options: Any) -> Client:
            client = cls(port, **options)
            made.append(client)
            return client
        return make

    try:
        lean, lean_client = await CASES[name](world, maker(Lean))
        world.proxy.release()
        reference, _ = await CASES[name](world, maker(RedisPy))
        world.proxy.release()
        assert lean == reference, f"{name}: lean {lean!r}, redis-py {reference!r}"
        # the same lean connection afterwards: every caller still gets its own reply
        assert await _echoes(lean_client.run), f"{name}: replies no longer match their requests"
    finally:
        for client in made:
            await client.aclose()


async def _echoes(run: Callable[..., Awaitable[Any]], count: int = 20) -> bool:
    """Concurrent ECHOs, each with its own payload: True when each got its own back."""
    payloads = [f"probe-{i}-" + "y" * (i * 37) for i in range(count)]
    answers = await asyncio.gather(*(run("ECHO", p) for p in payloads))
    return answers == [p.encode() for p in payloads]


async def _until_async(predicate: Callable[[], Any], timeout: float = 10.0) -> None:
    """Poll `predicate` (a plain function, run in a thread when it talks to Redis) until it holds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not await asyncio.to_thread(predicate):
        assert loop.time() < deadline, "condition not reached"
        await asyncio.sleep(0.005)


def _frozen_now(port: int) -> bool:
    """True while the server cannot answer (DEBUG SLEEP)."""
    try:
        with admin(port, socket_timeout=0.05) as a:
            a.ping()
    except sync_redis.TimeoutError:
        return True
    return False


# -- bad input fails before a byte is sent, and alone ----------------------------------


BAD_ARGUMENTS = [SURROGATE, "k:" + SURROGATE, True, None, [1], {"a": 1}, object()]


async def test_bad_input_fails_before_a_byte_is_sent_and_never_shifts_another_callers_reply(world):
    """Regression: the reply slot was queued before packing failed, so every later reply went to the previous caller."""
    connection = Connection(port=world.proxy.port)
    try:
        await connection.execute("PING")
        for bad in BAD_ARGUMENTS:
            sent = world.proxy.sent
            with pytest.raises((UnicodeEncodeError, DataError)):
                await connection.execute("EVALSHA", "0" * 40, 1, bad)
            with pytest.raises((UnicodeEncodeError, DataError)):
                await connection.execute_many([("ECHO", "fine"), ("ECHO", bad)])
            assert connection.in_flight == 0
            await connection.execute("ECHO", "marker")
            assert world.proxy.sent - sent == len(pack(("ECHO", "marker"))), "bytes of a refused command were sent"
        # many callers at once, bad ones among them, on the one socket
        calls = [connection.execute("ECHO", f"good-{i}") if i % 3 else connection.execute("ECHO", BAD_ARGUMENTS[i % 7])
                 for i in range(60)]
        answers = await asyncio.gather(*calls, return_exceptions=True)
        for i, answer in enumerate(answers):
            if i % 3:
                assert answer == f"good-{i}".encode(), f"caller {i} got {answer!r}"
            else:
                assert isinstance(answer, (UnicodeEncodeError, DataError))
        assert await _echoes(connection.execute)
    finally:
        await connection.aclose()


async def test_a_command_the_server_refuses_for_its_size_fails_alone(world):
    """A 2 MiB argument past proto-max-bulk-len: Redis hangs up on the socket it came on, so it gets its own."""
    connection = Connection(port=world.proxy.port)
    with admin(world.server.port) as a:
        a.config_set("proto-max-bulk-len", "1mb")
    try:
        await connection.execute("PING")
        accepted = world.proxy.accepted
        calls = [connection.execute("ECHO", f"small-{i}") for i in range(30)]
        calls.insert(15, connection.execute("ECHO", b"x" * (2 << 20)))
        answers = await asyncio.gather(*calls, return_exceptions=True)
        refused = answers.pop(15)
        assert isinstance(refused, (ResponseError, RedisConnectionError)), refused
        assert answers == [f"small-{i}".encode() for i in range(30)]
        assert world.proxy.accepted == accepted + 1, "the big command did not get a connection of its own"
        assert connection.connected and await _echoes(connection.execute)
        big = b"y" * (3 << 20)  # large but allowed: the same answer as any other
        a.config_set("proto-max-bulk-len", "512mb")
        assert await connection.execute("ECHO", big) == big
    finally:
        with admin(world.server.port) as a:
            a.config_set("proto-max-bulk-len", "512mb")
        await connection.aclose()


# -- event loops: the one that opened the socket, or RuntimeError at once ------------------


def test_a_connection_used_after_its_loop_closed_raises_at_once_as_redis_py_does(parity_server):
    lean = Connection(port=parity_server.port)
    reference = RedisPy(parity_server.port)
    asyncio.run(lean.execute("PING"))
    asyncio.run(reference.run("PING"))
    for run in (lean.execute, reference.run):
        with pytest.raises(RuntimeError):
            asyncio.run(run("ECHO", "from a new loop"))
    with pytest.raises(RuntimeError, match="closed event loop"):
        asyncio.run(lean.execute_many([("ECHO", "again")]))
    asyncio.run(lean.aclose())  # what can be closed is; a new loop may open it afresh
    assert asyncio.run(_echo_and_close(lean)) == b"fresh"
    with warnings.catch_warnings():
        # Both sockets belong to a loop that was closed under them: nothing can close
        # them any more but the garbage collector (the app's mistake, not theirs).
        warnings.simplefilter("ignore", ResourceWarning)
        del lean, reference, run
        gc.collect()


async def _echo_and_close(connection: Connection) -> Any:
    try:
        return await connection.execute("ECHO", "fresh")
    finally:
        await connection.aclose()


def test_a_call_from_another_running_loop_raises_at_once_and_disturbs_no_caller(parity_server):
    """redis-py has no rule here (it may even answer, through another loop's transport); the lean connection refuses."""
    home = asyncio.new_event_loop()
    thread = threading.Thread(target=home.run_forever, daemon=True)
    thread.start()
    lean = Connection(port=parity_server.port)
    try:
        asyncio.run_coroutine_threadsafe(lean.execute("PING"), home).result(10)
        # while the home loop keeps many calls in flight on the same socket
        busy = asyncio.run_coroutine_threadsafe(_echoes(lean.execute, count=200), home)
        with pytest.raises(RuntimeError, match="opened on another event loop"):
            asyncio.run(lean.execute("ECHO", "x"))
        with pytest.raises(RuntimeError, match="opened on another event loop"):
            asyncio.run(lean.execute_many([("ECHO", "x")]))
        assert busy.result(10), "a reply went to the wrong caller"
        assert asyncio.run_coroutine_threadsafe(_echoes(lean.execute), home).result(10)
    finally:
        asyncio.run_coroutine_threadsafe(lean.aclose(), home).result(10)
        home.call_soon_threadsafe(home.stop)
        thread.join(10)
        home.close()


# -- the same through the lock -------------------------------------------------------------


async def test_an_unencodable_key_fails_alone_and_every_other_lock_call_gets_its_own_answer(world):
    """Regression test, through the lock: beside a key that cannot be encoded, try_lock("busy") returned a
    hold while another manager held "busy"."""
    from otel_lock import LockManager

    url = f"redis://127.0.0.1:{world.server.port}/0"
    other, locks = LockManager.from_url(url), LockManager.from_url(url)
    try:
        busy = await other.acquire("busy")
        for round_ in range(5):
            answers = await asyncio.gather(locks.try_lock(f"bad:{SURROGATE}"), locks.try_lock("busy"),
                                           locks.try_lock(f"free:{round_}"), locks.try_lock("busy", owner=SURROGATE),
                                           return_exceptions=True)
            assert isinstance(answers[0], UnicodeEncodeError) and isinstance(answers[3], UnicodeEncodeError)
            assert answers[1] is None, f"a hold of a lock another manager holds: {answers[1]}"
            free = answers[2]
            with admin(world.server.port) as a:
                assert a.hget(free.key, "owner").decode() == free.owner
            await free.release()
        with pytest.raises(UnicodeEncodeError):
            await locks.acquire(f"bad:{SURROGATE}", wait=2.0)  # a waiter too: at once, nothing left queued
        with admin(world.server.port) as a:
            assert a.keys("otel-lock:{bad*") == []
        assert await busy.release()
    finally:
        await other.aclose()
        await locks.aclose()


async def test_an_error_reply_redis_py_cannot_parse_fails_only_its_caller(world):
    """A script's malformed redirect: redis-py's parser raises ValueError; on a shared socket that must stay one reply."""
    connection = Connection(port=world.port)
    try:
        calls = [connection.execute("ECHO", f"e{i}") for i in range(10)]
        calls.insert(5, connection.execute("EVAL", "return redis.error_reply('MOVED nonsense')", 0))
        answers = await asyncio.gather(*calls, return_exceptions=True)
        assert isinstance(answers.pop(5), ResponseError)
        assert answers == [f"e{i}".encode() for i in range(10)]
    finally:
        await connection.aclose()


# -- one reply timer per socket ------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def _through_proxy(world, timeout: float):
    """A lean connection to Redis through the world's proxy, answered once; the proxy let go at the end."""
    connection = Connection(port=world.proxy.port, timeout=timeout, connect_timeout=TIMEOUT)
    try:
        assert await connection.execute("PING") == b"PONG"
        yield connection
    finally:
        world.proxy.release()
        await connection.aclose()


async def test_a_late_reply_drops_the_socket_only_while_its_caller_still_awaits_it(world):
    """One watch timer per socket checks every reply's deadline: a given-up caller's late reply is let be."""
    async with _through_proxy(world, 0.3) as connection:
        world.proxy.hold_replies_after(0)
        given_up = connection.send_now("ECHO", "late")
        given_up.cancel()
        await asyncio.sleep(0.6)  # its deadline has passed twice over: it alone must not drop the socket
        assert connection.connected
        world.proxy.release()
        assert await connection.execute("ECHO", "next") == b"next"  # and replies stay in their turn
        world.proxy.hold_replies_after(0)
        stuck = [connection.send_now("ECHO", str(i)) for i in range(3)]
        answers = await asyncio.gather(*stuck, return_exceptions=True)
        assert [type(a) for a in answers] == [RedisTimeoutError] * 3, answers
        assert all("did not answer within 0.3 s" in str(a) for a in answers)
        world.proxy.release()
        assert await connection.execute("ECHO", "again") == b"again"  # a new socket


async def test_the_watch_follows_the_oldest_reply_still_awaited(world):
    """A reply answered in time moves the watch to the next one, whose own deadline drops the socket."""
    async with _through_proxy(world, 0.4) as connection:
        loop = asyncio.get_running_loop()
        first = connection.send_now("ECHO", "in time")
        assert await first == b"in time"
        await asyncio.sleep(0.2)  # the next command goes later, so its deadline is later than the first's
        world.proxy.hold_replies_after(0)
        sent = loop.time()
        with pytest.raises(RedisTimeoutError):
            await connection.send_now("ECHO", "stuck")
        assert loop.time() - sent >= 0.4  # dropped at its own deadline, not at the first one's


async def test_a_stuck_batch_fails_with_the_timeout_in_every_place(world):
    """`execute_many` (renewals, the server checks) is watched by the same timer as single commands."""
    async with _through_proxy(world, 0.3) as connection:
        world.proxy.hold_replies_after(0)
        answers = await connection.execute_many([("ECHO", "a"), ("ECHO", "b")])
        assert [type(a) for a in answers] == [RedisTimeoutError] * 2, answers
        world.proxy.release()
        assert await connection.execute_many([("ECHO", "c")]) == [b"c"]  # on a new socket


@pytest.mark.parametrize("answer", [b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n", b"\x00\xff\xfe garbage\r\n"],
                         ids=["http", "binary"])
async def test_a_server_that_does_not_speak_redis_fails_each_call_as_redis_py_does(answer, caplog):
    """Regression: hiredis' ProtocolError escaped `data_received`, so asyncio logged a traceback, and the callers
    got "connection lost". Now every caller gets redis-py's InvalidResponse, and no connect is tried again."""
    handlers: list[asyncio.Future[Any]] = []

    async def speak(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        handlers.append(asyncio.current_task())  # type: ignore[arg-type]
        try:
            await reader.read(1024)
            writer.write(answer)
            await writer.drain()
            await reader.read()  # until the client hangs up
        finally:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()

    server = await asyncio.start_server(speak, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    connection = Connection(port=port, timeout=TIMEOUT, connect_timeout=TIMEOUT)
    reference = RedisPy(port)
    try:
        async with asyncio.timeout(20):
            lean = await outcome(connection.execute("GET", "k"))
            again = await outcome(connection.execute("GET", "k"))
            expected = await outcome(reference.run("GET", "k"))
    finally:
        await connection.aclose()
        await reference.aclose()
        server.close()
        await server.wait_closed()
        await asyncio.gather(*handlers, return_exceptions=True)
    assert lean == again == expected == Outcome("InvalidResponse"), (lean, again, expected)
    assert f"127.0.0.1:{port} a Redis server?" in str(lean.error)
    assert "data_received() call failed" not in caplog.text
