"""A lean pipelined Redis connection for the lock's hot path.

redis-py's asyncio client spends several times more CPU on a command than
the round trip itself costs (pool checkout, retry and observability layers,
a timeout context per read), and a lock hand-off is a chain of small single
commands, so that overhead *is* the throughput. This connection writes each
command at once and matches replies in order (Redis answers in order), so
concurrent lock calls share one socket without waiting for each other;
hiredis parses. It speaks for the manager's client whenever that client uses
redis-py's own connection classes over RESP2: TCP, TLS (`_tls.py`: redis-py's
`ssl_*` options), unix sockets, a password or a credential provider (asked
again on every connect). A client with a connection class of its own, or
RESP3, goes through redis-py itself.

It behaves as redis-py does, call for call (tests/test_connection_parity.py
feeds both the same cases): arguments are encoded by redis-py's rules, error
replies become the exceptions redis-py's own parser picks. Three rules keep
every caller's reply its own on the shared socket:

- A command is encoded completely before its reply slot is queued or a byte
  is written, so bad input (a lone surrogate, a wrong type) fails alone.
- A command larger than the smallest limit a server may set on one request
  (1 MiB: `proto-max-bulk-len`, `client-query-buffer-limit`) is sent on a
  connection of its own, so a server that refuses it and hangs up fails only
  that command.
- A new socket asks the server first (AUTH / SELECT, or a PING), so a server
  that refuses the client (maxclients, a missing password) fails the
  connection, not the first callers' commands.

A connection serves the event loop that opened its socket; a call from any
other loop (or after that loop closed) raises RuntimeError at once.
"""

from __future__ import annotations

import asyncio
import collections
import copy
import socket
from typing import Any, Awaitable, Callable, Sequence, cast

import hiredis
from redis._parsers import BaseParser
from redis.exceptions import AuthenticationError, BusyLoadingError, DataError, InvalidResponse, ResponseError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from ._tls import Tls

_pack: Callable[[tuple[Any, ...]], bytes] = hiredis.pack_command  # RESP encoding in C: half the time of a Python encoder
ALONE_ABOVE = 1 << 20  # bytes; the smallest proto-max-bulk-len and client-query-buffer-limit


def pack(args: Sequence[Any]) -> bytes:
    """One command in RESP, with redis-py's encoding rules; raises before anything is queued or sent.

    As redis-py: str (UTF-8, strict), bytes, bytearray, memoryview, int and
    float are sent; a lone surrogate raises UnicodeEncodeError; bool, None
    and anything else raise DataError. A command name with spaces
    ("CONFIG GET") is split into its words.
    """
    head = args[0] if args else None
    if isinstance(head, str) and " " in head:
        args = (*head.encode().split(), *args[1:])
    elif isinstance(head, bytes) and b" " in head:
        args = (*head.split(), *args[1:])
    try:
        return _pack(args if type(args) is tuple else tuple(args))
    except TypeError:
        return _pack(tuple(_encodable(a) for a in args))


def _encodable(value: Any) -> Any:
    """An argument hiredis refused, as redis-py's encoder takes it (bytearray, int subclasses), or DataError."""
    if isinstance(value, (str, bytes, memoryview)):
        return value
    if isinstance(value, bytearray):
        return bytes(value)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return repr(value).encode()  # an IntEnum goes as redis-py sends it
    raise DataError(f"Invalid input of type: '{type(value).__name__}'. "
                    "Convert to a bytes, string, int or float first.")


def _reply_error(message: str) -> Exception:
    """The exception redis-py's own parser makes of an error reply (NOSCRIPT, LOADING, NOPERM, OOM, maxclients...).

    A reply it cannot parse (a script's `error_reply("MOVED nonsense")`) is a
    plain ResponseError for its caller, never a broken socket for everyone.
    """
    try:
        error: Exception = BaseParser.parse_error(message)  # type: ignore[no-untyped-call]
    except Exception:
        return ResponseError(message)
    return error


def _is_push(reply: Any) -> bool:
    """A published message, as opposed to the reply to a command sent while subscribed (PING).

    An SUNSUBSCRIBE is one too: the lock never sends it, a cluster node does
    when the slot of a shard channel moves away.
    """
    return isinstance(reply, list) and bool(reply) and reply[0] in (b"message", b"pmessage", b"smessage",
                                                                     b"sunsubscribe")


class _Protocol(asyncio.Protocol):
    """Feeds bytes to hiredis; hands each reply to the oldest waiting future, or to `on_push`."""

    def __init__(self, on_push: Callable[[Any], None] | None, on_lost: Callable[[], None] | None,
                 server: str = "Redis", tls: Tls | None = None) -> None:
        self.server = server
        self.tls = tls
        self.reader = hiredis.Reader(replyError=_reply_error)
        self.pending: collections.deque[asyncio.Future[Any]] = collections.deque()
        self.transport: asyncio.Transport | None = None
        self.on_push = on_push
        self.on_lost = on_lost
        self.closed = False
        self.stuck_after: float | None = None  # the timeout a reply missed, when that dropped the socket
        # reply futures -> who gets the reply (or the error) if their caller gave up on them first
        self.orphans: dict[asyncio.Future[Any], Callable[[Any], None]] = {}
        # reply futures -> the loop time by which their reply must be here, in the order they were sent
        self.deadlines: dict[asyncio.Future[Any], float] = {}
        self.watch: asyncio.TimerHandle | None = None  # one timer for all of them, at the oldest one's time
        self.refusal: Exception | None = None  # an error the server sent unasked, before hanging up

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # a stream connection's transport
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)

    def data_received(self, data: bytes) -> None:
        reader = self.reader
        reader.feed(data)
        try:
            while (reply := reader.gets()) is not False:
                if self.on_push is not None and (not self.pending or _is_push(reply)):
                    self.on_push(reply)
                    continue
                if not self.pending:
                    # Nothing asked: the server tells why it hangs up (maxclients, a protocol error).
                    if isinstance(reply, Exception):
                        self.refusal = reply
                    continue
                future = self.pending.popleft()
                orphan = self.orphans.pop(future, None) if self.orphans else None
                if self.deadlines:
                    self.deadlines.pop(future, None)
                if future.done():
                    # its caller was cancelled; the reply is still this one's, and its owner may want it
                    if orphan is not None:
                        orphan(reply)
                    continue
                if isinstance(reply, Exception):
                    future.set_exception(reply)
                else:
                    future.set_result(reply)
        except hiredis.ProtocolError as error:  # an HTTP server, a TLS port spoken to in plain text...
            self.refusal = InvalidResponse(f"{error} (is {self.server} a Redis server?)")
            if self.transport is not None:
                self.transport.abort()  # every caller on the socket gets the refusal (connection_lost)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.tls is not None and exc is not None and self.refusal is None:
            # TLS 1.3: the server refuses a client certificate after the client's handshake is done
            self.refusal = self.tls.refusal(exc, self.server)
        if self.watch is not None:
            self.watch.cancel()
            self.watch = None
        self.deadlines.clear()
        while self.pending:
            future = self.pending.popleft()
            if self.stuck_after is not None:  # dropped because a reply did not come in time
                error: Exception = RedisTimeoutError(f"Redis at {self.server} did not answer within "
                                                     f"{self.stuck_after} s")
            else:
                error = self.refusal or RedisConnectionError(
                    f"connection to {self.server} lost: {exc or 'closed by the server'}")
            orphan = self.orphans.pop(future, None) if self.orphans else None
            if not future.done():
                future.set_exception(error)
            elif orphan is not None:
                orphan(error)
        if self.on_lost is not None:
            self.on_lost()

    def expect(self, future: asyncio.Future[Any], loop: asyncio.AbstractEventLoop, timeout: float) -> None:
        """Drop the socket if `future`'s reply is not here within `timeout` s.

        Replies come in the order the commands went, and every command on a
        socket has the same timeout, so one timer per socket, set for the
        oldest reply still awaited, watches them all: a command costs a dict
        entry instead of a timer made and cancelled.
        """
        self.deadlines[future] = loop.time() + timeout
        if self.watch is None:
            self.watch = loop.call_later(timeout, self._check_deadlines, loop, timeout)

    def _check_deadlines(self, loop: asyncio.AbstractEventLoop, timeout: float) -> None:
        """The watch timer: drop a stuck socket, or set the timer again for the oldest reply still awaited.

        A reply whose caller gave up (its future cancelled) is let be late: its
        reply still comes in its turn, and the socket is not dropped for it.
        """
        self.watch = None
        now = loop.time()
        for future, deadline in self.deadlines.items():
            if deadline > now:
                self.watch = loop.call_at(deadline, self._check_deadlines, loop, timeout)
                return
            if not future.done():
                self.stuck_after = timeout
                self.abort()
                return

    def abort(self) -> None:
        if self.transport is not None:
            try:
                self.transport.abort()
            except RuntimeError:
                pass  # its event loop is closed: nothing can be delivered on it any more


class Connection:
    """One socket; `execute()` is safe to call from many tasks of one event loop at once."""

    def __init__(self, *, host: str = "127.0.0.1", port: int = 6379, path: str | None = None, db: int = 0,
                 username: str | None = None, password: str | None = None, timeout: float | None = 2.0,
                 connect_timeout: float | None = 2.0, on_push: Callable[[Any], None] | None = None,
                 on_lost: Callable[[], None] | None = None, tls: Tls | None = None,
                 credential_provider: Any = None) -> None:
        self._host, self._port, self._path = host, port, path
        self._db, self._username, self._password = int(db or 0), username, password
        self._tls, self._credential_provider = tls, credential_provider
        self._timeout, self._connect_timeout = timeout, connect_timeout
        self._on_push, self._on_lost = on_push, on_lost
        self._protocol: _Protocol | None = None
        self._loop: asyncio.AbstractEventLoop | None = None  # the loop of the open socket
        self._connecting = asyncio.Lock()
        self._failed: Exception | None = None  # the last connect attempt's error, until one succeeds

    @property
    def server(self) -> str:
        """host:port (or the unix socket's path): for messages, never with credentials."""
        return self._path or f"{self._host}:{self._port}"

    @property
    def username(self) -> str | None:
        """The ACL user it logs in as (None: the default user)."""
        return self._username

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.server} db={self._db}>"

    @property
    def in_flight(self) -> int:
        """Commands sent and not answered yet."""
        protocol = self._protocol
        return 0 if protocol is None else len(protocol.pending)

    @property
    def connected(self) -> bool:
        return self._protocol is not None and not self._protocol.closed

    def _check_loop(self) -> asyncio.AbstractEventLoop:
        """The running loop, if it is the one this connection's socket belongs to."""
        loop = asyncio.get_running_loop()
        if loop is not self._loop and self._loop is not None:
            state = "a closed" if self._loop.is_closed() else "another"
            raise RuntimeError(f"this Redis connection ({self.server}) was opened on {state} event loop: "
                               "a connection serves only the loop that opened it")
        return loop

    async def connect(self) -> None:
        loop = self._check_loop()
        failed = self._failed
        async with self._connecting:
            if self.connected:
                return
            if self._failed is not None and self._failed is not failed:
                # The attempt this caller queued behind has just failed: a frozen server costs the
                # queue one connect timeout, not one per caller in turn (the last waited N of them).
                raise self._failed
            try:
                await self._open(loop)
            except Exception as exc:
                self._failed = exc
                raise
            self._failed = None

    async def _open(self, loop: asyncio.AbstractEventLoop) -> None:
        """One connect attempt: the socket (TLS too) and the handshake, or an error that says why not."""
        protocol = _Protocol(None, None, self.server, self._tls)
        try:
            async with asyncio.timeout(self._connect_timeout):
                if self._path:
                    await loop.create_unix_connection(lambda: protocol, self._path)
                elif self._tls is not None:
                    # TCP, then TLS on it: a handshake cancelled half-way (aclose) leaves a socket
                    # this code can abort, where create_connection(ssl=...) could leave it to the GC
                    context = self._tls.context()
                    await loop.create_connection(lambda: protocol, self._host, self._port)
                    assert protocol.transport is not None  # connection_made set it
                    protocol.transport = cast(asyncio.Transport, await loop.start_tls(
                        protocol.transport, protocol, context, server_hostname=self._host))
                else:
                    await loop.create_connection(lambda: protocol, self._host, self._port)
                await self._handshake(protocol)
        except BaseException as exc:
            # A refused AUTH or SELECT (a rotated password, a wrong db) must
            # not leave its socket behind: one per attempt would exhaust maxclients.
            protocol.abort()
            if isinstance(exc, TimeoutError):
                raise RedisTimeoutError(f"connecting to Redis at {self.server} timed out after "
                                        f"{self._connect_timeout} s") from exc
            refusal = self._tls.refusal(exc, self.server) if self._tls is not None else None
            if refusal is None and self._tls is not None and type(exc) is RedisConnectionError and \
                    protocol.refusal is None:  # hung up without a word: a client certificate refused?
                refusal = await self._tls.diagnose(self._host, self._port, min(self._connect_timeout or 1.0, 1.0))
            if refusal is not None:  # a certificate or protocol problem: no retry will fix it
                raise refusal from exc
            if isinstance(exc, OSError):
                raise RedisConnectionError(f"cannot connect to Redis at {self.server}: {exc}") from exc
            raise
        protocol.on_push, protocol.on_lost = self._on_push, self._on_lost
        self._protocol, self._loop = protocol, loop

    async def _handshake(self, protocol: _Protocol) -> None:
        """AUTH and SELECT in one write, or a PING: a server that refuses this client says so now.

        AUTH is sent as redis-py sends it over RESP2 (the password alone when
        the URL names no user), so a password given to a server that has none
        is refused, as Redis means it to be. Without AUTH or SELECT a PING
        still makes the server answer, so maxclients and a missing password
        show here, not as the reply to a caller's script (an unauthenticated
        script call can even make Redis hang up on everyone queued behind
        it); any other refusal of the PING (ACL, LOADING) is left to the
        commands that follow.
        """
        commands: list[tuple[Any, ...]] = []
        username, password = self._username, self._password
        provider = self._credential_provider
        if provider is not None:  # asked on every connect: a rotated token is picked up by the next one
            ask = getattr(provider, "get_credentials_async", None)
            credentials = tuple(await ask() if ask is not None else provider.get_credentials())
            username, password = (None, credentials[0]) if len(credentials) == 1 else credentials[:2]
            self._username = username
        if password:
            commands.append(("AUTH", username, password) if username else ("AUTH", password))
        if self._db:
            commands.append(("SELECT", self._db))
        probe = not commands
        if probe:
            commands.append(("PING",))
        futures = self._queue(protocol, b"".join(pack(c) for c in commands), len(commands))
        replies = await asyncio.gather(*futures, return_exceptions=True)
        for reply in replies:
            if not isinstance(reply, Exception):
                continue
            if not probe or isinstance(reply, (AuthenticationError, InvalidResponse)) or (
                    isinstance(reply, RedisConnectionError) and not isinstance(reply, BusyLoadingError)):
                raise reply

    def send_now(self, *args: Any, on_orphan: Callable[[Any], None] | None = None) -> asyncio.Future[Any] | None:
        """Write one command at once and return its reply's future; None when that takes an await first.

        The hot path's way to call without a task or a shield: the command is
        on the wire when this returns; a caller cancelled while it awaits the
        future cancels only the future, and the reply (or the error that ends
        the socket) goes to `on_orphan` instead, so it can still be undone.
        None: not connected yet, or a command too large to share the socket;
        use `execute()`.
        """
        protocol = self._protocol
        if protocol is None or protocol.closed or protocol.transport is None:
            return None
        data = pack(args)  # bad input fails here: nothing queued, nothing sent
        if len(data) > ALONE_ABOVE:
            return None
        loop = self._check_loop()
        # one reply slot, then the bytes, nothing in between
        future: asyncio.Future[Any] = loop.create_future()
        protocol.pending.append(future)
        if on_orphan is not None:
            protocol.orphans[future] = on_orphan
        protocol.transport.write(data)
        self._expect(protocol, [future])
        return future

    async def execute(self, *args: Any) -> Any:
        future = self.send_now(*args)
        if future is not None:
            return await future
        data = pack(args)  # bad input fails here: nothing queued, nothing sent
        loop = self._check_loop()
        if len(data) > ALONE_ABOVE:
            return (await self._alone(data, 1))[0]
        protocol = self._protocol
        if protocol is None or protocol.closed:
            await self.connect()
            protocol = self._protocol
            assert protocol is not None  # connect() set it
        if protocol.transport is None:
            raise RedisConnectionError(f"connection to {protocol.server} lost")
        future = loop.create_future()
        protocol.pending.append(future)
        protocol.transport.write(data)
        self._expect(protocol, [future])
        return await future

    async def execute_many(self, commands: list[tuple[Any, ...]]) -> list[Any]:
        """Several commands in one write (one round trip); error replies are returned in place."""
        packed = [pack(c) for c in commands]  # all of them before any is queued
        self._check_loop()
        if any(len(p) > ALONE_ABOVE for p in packed):
            return await self._alone(b"".join(packed), len(packed))
        if not self.connected:
            await self.connect()
        protocol = self._protocol
        assert protocol is not None  # connect() set it
        futures = self._queue(protocol, b"".join(packed), len(packed))
        self._expect(protocol, futures)
        results: list[Any] = await asyncio.gather(*futures, return_exceptions=True)
        return results

    @staticmethod
    def _queue(protocol: _Protocol, data: bytes, count: int) -> list[asyncio.Future[Any]]:
        """Reply slots for `count` commands, then their bytes: nothing can fail in between."""
        if protocol.closed or protocol.transport is None:
            raise protocol.refusal or RedisConnectionError(f"connection to {protocol.server} lost")
        loop = asyncio.get_running_loop()
        futures: list[asyncio.Future[Any]] = [loop.create_future() for _ in range(count)]
        protocol.pending.extend(futures)
        protocol.transport.write(data)
        return futures

    async def _alone(self, data: bytes, count: int) -> list[Any]:
        """Commands too large to share the socket, on a connection of their own (closed after)."""
        solo = self._sibling()
        try:
            await solo.connect()
            protocol = solo._protocol
            assert protocol is not None  # connect() set it
            futures = self._queue(protocol, data, count)
            solo._expect(protocol, futures)
            results: list[Any] = await asyncio.gather(*futures, return_exceptions=True)
        finally:
            await solo.aclose()
        if count == 1 and isinstance(results[0], Exception):
            raise results[0]
        return results

    def _sibling(self) -> "Connection":
        """An unopened connection to the same server (a subclass's way of finding it included)."""
        solo = copy.copy(self)
        solo._protocol, solo._loop, solo._connecting = None, None, asyncio.Lock()
        solo._on_push = solo._on_lost = None
        return solo

    def _expect(self, protocol: _Protocol, futures: list[asyncio.Future[Any]]) -> None:
        """A reply that does not come in time means the socket is stuck: it is dropped, so every caller on it
        fails now (RedisTimeoutError) instead of waiting in line."""
        if self._timeout is not None:
            loop = asyncio.get_running_loop()
            for future in futures:
                protocol.expect(future, loop, self._timeout)

    # -- the subset of redis-py's client the lock uses --------------------------

    def evalsha(self, sha: str, numkeys: int, *args: Any) -> Awaitable[Any]:
        return self.execute("EVALSHA", sha, numkeys, *args)

    def eval(self, source: str, numkeys: int, *args: Any) -> Awaitable[Any]:
        return self.execute("EVAL", source, numkeys, *args)

    def script_load(self, source: str) -> Awaitable[Any]:
        return self.execute("SCRIPT", "LOAD", source)

    def drop(self) -> None:
        """Abort the socket as if the server had closed it: calls in flight fail and `on_lost` runs."""
        if self._protocol is not None:
            self._protocol.abort()

    async def aclose(self) -> None:
        protocol = self._protocol
        self._protocol, self._loop = None, None
        if not self._connecting.locked():
            self._connecting = asyncio.Lock()  # free of the loop it may have been bound to
        if protocol is not None and protocol.transport is not None:
            protocol.on_lost = None
            try:
                protocol.transport.close()
            except RuntimeError:
                pass  # opened on a loop that is closed now: nothing left to flush
