"""Redis as it is really run, for the connection and error tests: states and a byte-exact proxy.

`ByteProxy` forwards a client's traffic and can cut or hold the replies
after exactly N more bytes (a reset or a stall in the middle of a reply);
it counts the request bytes it forwarded, so a test can tell that nothing
was sent. `loading_server()` starts a redis-server that is still loading a
large RDB for seconds; `admin()` is a plain redis-py client for set-up.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Iterator

import redis as sync_redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from otel_lock.cli._redis_server import RedisServer, free_port, stop_process


class ByteProxy:
    """Loopback TCP proxy in front of 127.0.0.1:port; replies can be cut or held after N bytes."""

    def __init__(self, port: int) -> None:
        self.target = ("127.0.0.1", port)
        self.port = 0
        self.sent = 0        # request bytes forwarded to Redis, all connections together
        self.replied = 0     # reply bytes forwarded to clients
        self.accepted = 0    # connections so far
        self._budget: int | None = None  # reply bytes still let through before cutting or holding
        self._cut = False
        self._open = asyncio.Event()
        self._open.set()
        self._pairs: set[tuple[asyncio.StreamWriter, asyncio.StreamWriter]] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._server: asyncio.Server | None = None

    async def start(self) -> "ByteProxy":
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    def cut_replies_after(self, count: int) -> None:
        """Let `count` more reply bytes through, then reset every connection (new ones work again)."""
        self._budget, self._cut = count, True

    def hold_replies_after(self, count: int) -> None:
        """Let `count` more reply bytes through, then hold the rest until `release()`."""
        self._budget, self._cut = count, False
        self._open.clear()

    def release(self) -> None:
        self._budget = None
        self._open.set()

    async def _accept(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        self.accepted += 1
        try:
            up_r, up_w = await asyncio.open_connection(*self.target)
        except OSError:
            client_w.transport.abort()
            return
        pair = (client_w, up_w)
        self._pairs.add(pair)
        pipes = [asyncio.create_task(self._requests(client_r, up_w)), asyncio.create_task(self._replies(up_r, client_w))]
        self._tasks.update(pipes)
        try:
            await asyncio.wait(pipes, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in pipes:
                task.cancel()
            await asyncio.gather(*pipes, return_exceptions=True)
            self._tasks.difference_update(pipes)
            self._pairs.discard(pair)
            for writer in pair:
                writer.transport.abort()

    async def _requests(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError):
            while data := await reader.read(65536):
                self.sent += len(data)
                writer.write(data)
                await writer.drain()

    async def _replies(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError):
            while data := await reader.read(65536):
                while data:
                    budget = self._budget
                    if budget is None or budget > 0:
                        head = data if budget is None else data[:budget]
                        data = data[len(head):]
                        if budget is not None:
                            self._budget = budget - len(head)
                        self.replied += len(head)
                        writer.write(head)
                        await writer.drain()
                    elif self._cut:
                        self._budget = None
                        for pair in list(self._pairs):
                            for w in pair:
                                w.transport.abort()
                        return
                    else:
                        await self._open.wait()

    async def aclose(self) -> None:
        self.release()
        for pair in list(self._pairs):
            for writer in pair:
                writer.transport.abort()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


def admin(port: int, **options: object) -> sync_redis.Redis:
    """A plain client for set-up and checks; no retries (a timeout is an answer here)."""
    return sync_redis.Redis(port=port, protocol=2, retry=Retry(NoBackoff(), 0), **options)  # type: ignore[arg-type]


def _redis_server_binary() -> str:
    binary = shutil.which("redis-server")
    assert binary is not None, "redis-server is not on PATH"
    return binary


@contextlib.contextmanager
def loading_server(keys: int = 5000, delay_us: int = 1000) -> Iterator[int]:
    """The port of a redis-server that answers LOADING for seconds (each key's load slowed down)."""
    folder = Path(tempfile.mkdtemp(prefix="otel-lock-loading-"))
    try:
        with RedisServer(extra_args=("--dir", str(folder), "--dbfilename", "seed.rdb")) as seed:
            client = admin(seed.port)
            pipe = client.pipeline(transaction=False)
            for i in range(keys):
                pipe.set(f"filler:{i}", "x")
            pipe.execute()
            client.save()
            client.close()
        port = free_port()
        process = subprocess.Popen([_redis_server_binary(), "--port", str(port), "--bind", "127.0.0.1",
                                    "--save", "", "--dir", str(folder), "--dbfilename", "seed.rdb",
                                    "--key-load-delay", str(delay_us),
                                    "--loading-process-events-interval-bytes", "1024"],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 10
            while not _loading(port):
                assert process.poll() is None, "the loading redis-server exited"
                assert time.monotonic() < deadline, "redis-server never started loading"
                time.sleep(0.01)
            yield port
        finally:
            stop_process(process)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _loading(port: int) -> bool:
    try:
        with admin(port, socket_timeout=1) as probe:
            return bool(probe.info("persistence").get("loading") == 1)
    except sync_redis.BusyLoadingError:
        return True
    except sync_redis.ConnectionError:
        return False


def still_loading(port: int) -> bool:
    return _loading(port)


def add_acl_users(port: int, namespace: str = "otel-lock") -> None:
    """ACL users that each lack one right the lock needs (password "pw")."""
    with admin(port) as client:
        client.execute_command("ACL", "SETUSER", "full", "on", ">pw", "~*", "&*", "+@all")
        client.execute_command("ACL", "SETUSER", "nokeys", "on", ">pw", "~other:*", "&*", "+@all")
        client.execute_command("ACL", "SETUSER", "nochannels", "on", ">pw", "~*", "resetchannels", "+@all")
        client.execute_command("ACL", "SETUSER", "noevalsha", "on", ">pw", "~*", "&*", "+@all", "-evalsha")
        client.execute_command("ACL", "SETUSER", "nohset", "on", ">pw", "~*", "&*", "+@all", "-hset")
        client.execute_command("ACL", "SETUSER", "disabled", "off", ">pw", "~*", "&*", "+@all")
