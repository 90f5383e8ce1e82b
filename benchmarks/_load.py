"""A lean HTTP/1.1 load generator: N keep-alive connections, each sending its next request when the last answer arrived.

Raw asyncio streams instead of httpx, because on 2 CPUs a heavy client would
measure itself; every variant is driven by the same generator.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import signal
import socket
import subprocess
import sys
import time
from collections import Counter

from ._harness import ROOT


def request_bytes(method: str, path: str, body: bytes = b"") -> bytes:
    kind = b"Content-Type: application/json\r\n" if body else b""
    return (f"{method} {path} HTTP/1.1\r\nHost: bench\r\n".encode() + kind
            + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)


async def _exchange(reader, writer, request: bytes) -> bytes:
    writer.write(request)
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line[:15].lower() == b"content-length:":
            length = int(line[15:])
    if length:
        await reader.readexactly(length)
    return head


async def call(port: int, method: str, path: str, body: bytes = b"") -> int:
    """One request on a fresh connection; returns the status."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        head = await _exchange(reader, writer, request_bytes(method, path, body))
        return int(head[9:12])
    finally:
        writer.close()


async def _scraper(port: int, path: str, stop: float, every: float, count: list) -> None:
    # a Prometheus-like pull on its own connection while the load runs
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        while time.monotonic() < stop:
            await _exchange(reader, writer, request_bytes("GET", path))
            count[0] += 1
            await asyncio.sleep(every)
    finally:
        writer.close()


async def _connection(port: int, path_for, stop_warmup: float, stop: float, out: list, statuses: Counter,
                      total: list, method: str = "POST", body: bytes = b"") -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    clock = time.perf_counter
    try:
        while (now := time.monotonic()) < stop:
            request = request_bytes(method, path_for(), body)
            t0 = clock()
            head = await _exchange(reader, writer, request)
            elapsed = clock() - t0
            total[0] += 1
            if now >= stop_warmup:
                out.append(elapsed)
                statuses[int(head[9:12])] += 1
    finally:
        writer.close()


async def drive(port: int, concurrency: int, duration: float, contended: bool = False, warmup: float = 0.5,
                path_for=None, body: bytes = b"", scrape: str | None = None) -> dict:
    """Latencies and statuses of `concurrency` connections for `duration` seconds after a warm-up.

    Paths are /items/1 (contended) or /items/<n> unless `path_for` is given; `scrape` GETs that
    path once a second on another connection, like a Prometheus server would.
    """
    ids = itertools.count()
    if path_for is None:
        path_for = (lambda: "/items/1") if contended else (lambda: f"/items/{next(ids)}")
    begin = time.monotonic()
    stop_warmup, stop = begin + warmup, begin + warmup + duration
    latencies: list[float] = []
    statuses: Counter = Counter()
    total, scrapes = [0], [0]  # warm-up included: Redis and CPU counters cover the whole drive
    jobs = [_connection(port, path_for, stop_warmup, stop, latencies, statuses, total, "POST", body)
            for _ in range(concurrency)]
    if scrape:
        jobs.append(_scraper(port, scrape, stop, 1.0, scrapes))
    await asyncio.gather(*jobs)
    return {"latencies": latencies, "statuses": dict(statuses), "window": duration, "total": total[0],
            "scrapes": scrapes[0]}


def ping_rtt(port: int, n: int = 2000) -> list[float]:
    """One Redis round trip on a raw socket (PING -> +PONG): the unit the middleware's overhead is stated in."""
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        out = []
        for _ in range(n):
            t0 = time.perf_counter()
            sock.sendall(b"PING\r\n")
            sock.recv(16)
            out.append(time.perf_counter() - t0)
    return out


async def redis_py_ping(url: str, n: int = 2000) -> list[float]:
    """The same round trip through redis-py's asyncio client, as a handler would make it."""
    import redis.asyncio as aioredis

    client = aioredis.Redis.from_url(url)
    out = []
    try:
        for _ in range(n):
            t0 = time.perf_counter()
            await client.ping()
            out.append(time.perf_counter() - t0)
    finally:
        await client.aclose()
    return out


class Server:
    """`python -m benchmarks._apps VARIANT PORT URL` in a subprocess, stopped by pid."""

    def __init__(self, variant: str, url: str, env: dict | None = None) -> None:
        from otel_lock.cli._redis_server import free_port

        self.port = free_port()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "benchmarks._apps", variant, str(self.port), url],
            cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
        )
        self._await_healthy()

    def _await_healthy(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"app exited with {self.proc.returncode}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as sock:
                    sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: bench\r\nConnection: close\r\n\r\n")
                    if sock.recv(32).startswith(b"HTTP/1.1 200"):
                        return
            except OSError:
                pass
            time.sleep(0.05)  # start-up poll of a subprocess, not a test synchronisation
        self.stop()
        raise RuntimeError(f"app did not answer /healthz on port {self.port} within {timeout}s")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait()

    def __enter__(self) -> "Server":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
