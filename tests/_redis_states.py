"""Redis as it is really run, for the connection and error tests: states and a byte-exact proxy.

`ByteProxy` (the safety checker's `TcpProxy`) forwards a client's traffic
and can cut or hold the replies after exactly N more bytes (a reset or a
stall in the middle of a reply); it counts the request bytes it forwarded,
so a test can tell that nothing was sent. `loading_server()` starts a redis-server that is still loading a
large RDB for seconds; `admin()` is a plain redis-py client for set-up.
"""

from __future__ import annotations

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

from benchmarks.safety._proxy import TcpProxy
from otel_lock.cli._redis_server import RedisServer, free_port, stop_process


class ByteProxy(TcpProxy):
    """The checker's proxy in front of 127.0.0.1:port, used for its byte-exact cuts and holds of replies."""

    def __init__(self, port: int) -> None:
        super().__init__("127.0.0.1", port)


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
