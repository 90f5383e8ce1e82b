"""A lean pipelined Redis connection for the lock's hot path.

redis-py's asyncio client spends several times more CPU on a command than
the round trip itself costs (pool checkout, retry and observability layers,
a timeout context per read), and a lock hand-off is a chain of small single
commands, so that overhead *is* the throughput. This connection writes each
command at once and matches replies in order (Redis answers in order), so
concurrent lock calls share one socket without waiting for each other;
hiredis parses. It is used only when the manager's client is a plain
redis-py client (TCP or unix socket, RESP2, password auth); anything else
(TLS, RESP3, credential providers, Cluster) goes through redis-py itself.
"""

from __future__ import annotations

import asyncio
import collections
import socket
from typing import Any, Awaitable, Callable, cast

import hiredis
import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import (AuthenticationError, BusyLoadingError, ClusterDownError, MasterDownError, NoScriptError, ReadOnlyError,
                              ResponseError, TryAgainError)
from redis.exceptions import TimeoutError as RedisTimeoutError


_pack = hiredis.pack_command  # RESP encoding in C: half the time of a Python encoder


def _error(reply: hiredis.ReplyError) -> Exception:
    """The redis-py exception for an error reply, as redis-py's own parser would pick it."""
    message = str(reply)
    code = message.split(" ", 1)[0]
    if code == "NOSCRIPT":
        return NoScriptError(message)
    if code == "LOADING":
        return BusyLoadingError(message)  # a ConnectionError: Redis is not ready yet
    return _RESPONSE_ERRORS.get(code, ResponseError)(message)


# Error replies that mean "this server cannot serve right now", not "you asked wrong".
_RESPONSE_ERRORS: dict[str, type[Exception]] = {
    "MASTERDOWN": MasterDownError, "TRYAGAIN": TryAgainError, "READONLY": ReadOnlyError,
    "CLUSTERDOWN": ClusterDownError, "WRONGPASS": AuthenticationError, "NOAUTH": AuthenticationError,
}


def _is_push(reply: Any) -> bool:
    """A published message, as opposed to the reply to a command sent while subscribed (PING).

    An SUNSUBSCRIBE is one too: the lock never sends it, a cluster node does
    when the slot of a shard channel moves away.
    """
    return isinstance(reply, list) and bool(reply) and reply[0] in (b"message", b"pmessage", b"smessage",
                                                                     b"sunsubscribe")


class _Protocol(asyncio.Protocol):
    """Feeds bytes to hiredis; hands each reply to the oldest waiting future, or to `on_push`."""

    def __init__(self, on_push: Callable[[Any], None] | None, on_lost: Callable[[], None] | None) -> None:
        self.reader = hiredis.Reader()
        self.pending: collections.deque[asyncio.Future[Any]] = collections.deque()
        self.transport: asyncio.Transport | None = None
        self.on_push = on_push
        self.on_lost = on_lost
        self.closed = False
        self.stuck = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # a stream connection's transport
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)

    def data_received(self, data: bytes) -> None:
        reader = self.reader
        reader.feed(data)
        while (reply := reader.gets()) is not False:
            if self.on_push is not None and (not self.pending or _is_push(reply)):
                self.on_push(reply)
                continue
            future = self.pending.popleft()
            if future.done():
                continue  # its caller was cancelled; the reply is still this one's
            if isinstance(reply, hiredis.ReplyError):
                future.set_exception(_error(reply))
            else:
                future.set_result(reply)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        error = RedisConnectionError(f"connection to Redis lost: {exc or 'closed by the server'}")
        while self.pending:
            future = self.pending.popleft()
            if not future.done():
                future.set_exception(error)
        if self.on_lost is not None:
            self.on_lost()

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()


class Connection:
    """One socket; `execute()` is safe to call from many tasks at once."""

    def __init__(self, *, host: str = "127.0.0.1", port: int = 6379, path: str | None = None, db: int = 0,
                 username: str | None = None, password: str | None = None, timeout: float | None = 2.0,
                 connect_timeout: float | None = 2.0, on_push: Callable[[Any], None] | None = None,
                 on_lost: Callable[[], None] | None = None) -> None:
        self._host, self._port, self._path = host, port, path
        self._db, self._username, self._password = int(db or 0), username, password
        self._timeout, self._connect_timeout = timeout, connect_timeout
        self._on_push, self._on_lost = on_push, on_lost
        self._protocol: _Protocol | None = None
        self._connecting = asyncio.Lock()

    @classmethod
    def for_client(cls, client: Any, **extra: Any) -> "Connection | None":
        """The same server and credentials as a plain redis-py asyncio client, else None."""
        if type(client) is not aioredis.Redis:
            return None
        pool = client.connection_pool
        kw = pool.connection_kwargs
        if pool.connection_class not in (aioredis.Connection, aioredis.UnixDomainSocketConnection):
            return None
        if kw.get("credential_provider") or str(kw.get("protocol") or 2) != "2":
            return None
        timeout = kw.get("socket_timeout")
        return cls(host=kw.get("host", "127.0.0.1"), port=int(kw.get("port") or 6379), path=kw.get("path"),
                   db=kw.get("db") or 0, username=kw.get("username"), password=kw.get("password"),
                   timeout=timeout, connect_timeout=kw.get("socket_connect_timeout") or timeout, **extra)

    @property
    def in_flight(self) -> int:
        """Commands sent and not answered yet."""
        protocol = self._protocol
        return 0 if protocol is None else len(protocol.pending)

    @property
    def connected(self) -> bool:
        return self._protocol is not None and not self._protocol.closed

    async def connect(self) -> None:
        async with self._connecting:
            if self.connected:
                return
            loop = asyncio.get_running_loop()
            protocol = _Protocol(None, None)
            try:
                async with asyncio.timeout(self._connect_timeout):
                    if self._path:
                        await loop.create_unix_connection(lambda: protocol, self._path)
                    else:
                        await loop.create_connection(lambda: protocol, self._host, self._port)
                    if self._password:
                        auth = ("AUTH", self._username, self._password) if self._username else ("AUTH", self._password)
                        await self._send(protocol, auth)
                    if self._db:
                        await self._send(protocol, ("SELECT", self._db))
            except BaseException as exc:
                # A refused AUTH or SELECT (a rotated password, a wrong db) must
                # not leave its socket behind: one per attempt would exhaust maxclients.
                protocol.abort()
                if isinstance(exc, TimeoutError):
                    raise RedisTimeoutError(f"connecting to Redis timed out after {self._connect_timeout} s") from exc
                if isinstance(exc, OSError):
                    raise RedisConnectionError(f"cannot connect to Redis: {exc}") from exc
                raise
            protocol.on_push, protocol.on_lost = self._on_push, self._on_lost
            self._protocol = protocol

    async def execute(self, *args: Any) -> Any:
        if not self.connected:
            await self.connect()
        protocol = self._protocol
        assert protocol is not None  # connect() set it
        return await self._send(protocol, args)

    async def execute_many(self, commands: list[tuple[Any, ...]]) -> list[Any]:
        """Several commands in one write (one round trip); errors are returned in place."""
        if not self.connected:
            await self.connect()
        protocol = self._protocol
        assert protocol is not None and protocol.transport is not None  # connect() set them
        loop = asyncio.get_running_loop()
        futures: list[asyncio.Future[Any]] = [loop.create_future() for _ in commands]
        protocol.pending.extend(futures)
        protocol.transport.write(b"".join(_pack(c) for c in commands))
        results: list[Any] = await self._wait(protocol, asyncio.gather(*futures, return_exceptions=True))
        return results

    async def _send(self, protocol: _Protocol, args: tuple[Any, ...]) -> Any:
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        protocol.pending.append(future)
        assert protocol.transport is not None  # set by connection_made, before any command
        protocol.transport.write(_pack(args))
        return await self._wait(protocol, future)

    async def _wait(self, protocol: _Protocol, future: asyncio.Future[Any]) -> Any:
        if self._timeout is None:
            return await future
        # A reply that does not come in time means the socket is stuck: drop it,
        # so every caller on it fails now instead of waiting in line.
        handle = asyncio.get_running_loop().call_later(self._timeout, self._stuck, protocol, future)
        try:
            return await future
        except RedisConnectionError as exc:
            if protocol.stuck:
                raise RedisTimeoutError(f"Redis did not answer within {self._timeout} s") from exc
            raise
        finally:
            handle.cancel()

    @staticmethod
    def _stuck(protocol: _Protocol, future: asyncio.Future[Any]) -> None:
        if not future.done():
            protocol.stuck = True
            protocol.abort()

    # -- the subset of redis-py's client the lock uses --------------------------

    def evalsha(self, sha: str, numkeys: int, *args: Any) -> Awaitable[Any]:
        return self.execute("EVALSHA", sha, numkeys, *args)

    def script_load(self, source: str) -> Awaitable[Any]:
        return self.execute("SCRIPT", "LOAD", source)

    def drop(self) -> None:
        """Abort the socket as if the server had closed it: calls in flight fail and `on_lost` runs."""
        if self._protocol is not None:
            self._protocol.abort()

    async def aclose(self) -> None:
        protocol, self._protocol = self._protocol, None
        if protocol is not None and protocol.transport is not None:
            protocol.on_lost = None
            protocol.transport.close()
