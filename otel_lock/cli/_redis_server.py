"""A throwaway redis-server on a free loopback port, for tests and the demo.

Started from PATH with no persistence and stopped by pid, so nothing is left
behind and the machine's own Redis on 6379 is never touched.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

__all__ = ["RedisServer", "RedisServerNotFound", "free_port", "redact_url", "stop_process"]


class RedisServerNotFound(RuntimeError):
    """No redis-server binary on PATH."""


def free_port() -> int:
    """A loopback port free right now (the kernel's pick)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _ping(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(16).startswith(b"+PONG")
    except OSError:
        return False


def stop_process(process: subprocess.Popen[Any], grace: float = 5.0) -> None:
    """SIGTERM by pid, then SIGKILL if it is still there after `grace` seconds."""
    if process.poll() is not None:
        return
    os.kill(process.pid, signal.SIGTERM)
    try:
        process.wait(grace)
    except subprocess.TimeoutExpired:
        os.kill(process.pid, signal.SIGKILL)
        process.wait(5)


@dataclass
class RedisServer:
    """One redis-server process; `start()` waits until it answers PING."""

    port: int = field(default_factory=free_port)
    extra_args: tuple[str, ...] = ()
    process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> "RedisServer":
        binary = shutil.which("redis-server")
        if binary is None:
            raise RedisServerNotFound(
                "redis-server is not on PATH: install it (Debian: apt-get install redis-server) "
                "or pass a Redis URL (REDIS_URL=redis://host:port/0)"
            )
        self._dir = tempfile.mkdtemp(prefix="otel-lock-redis-")
        args = [
            binary, "--port", str(self.port), "--bind", "127.0.0.1",
            "--save", "", "--appendonly", "no", "--dir", self._dir,
            "--protected-mode", "no", *self.extra_args,
        ]
        self.process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while not _ping(self.port):
            if self.process.poll() is not None:
                raise RuntimeError(f"redis-server exited with code {self.process.returncode} on port {self.port}")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"redis-server did not answer PING on port {self.port} within {timeout}s")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        """Stop by pid: SIGTERM, then SIGKILL if it lingers."""
        if self.process is None:
            return
        stop_process(self.process)
        self.process = None
        shutil.rmtree(getattr(self, "_dir", ""), ignore_errors=True)

    def restart(self) -> "RedisServer":
        """Stop and start on the same port (an empty Redis, like a crash without persistence)."""
        self.stop()
        return self.start()

    def __enter__(self) -> "RedisServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def redact_url(url: str) -> str:
    """A Redis URL fit for logs: never its password."""
    head, sep, tail = url.rpartition("@")
    return f"{head.split('://')[0]}://***@{tail}" if sep else url
