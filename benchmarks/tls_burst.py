"""A burst over TLS against the same burst over plain TCP, side by side in one run.

    .venv/bin/python -m benchmarks.tls_burst              # 3 rounds after a warm-up, about 30 s on 2 CPUs
    .venv/bin/python -m benchmarks.tls_burst --rounds 1

One redis-server on loopback with a plain port and a TLS port (a CA and a
server certificate made here with the `openssl` CLI, in a temporary
directory); stopped by pid at the end. A burst is 300 concurrent holds of
distinct keys (each holds until all 300 are held), then 30 tasks contending
for one key, on a fresh `LockManager.from_url` (its first connections and
handshakes included). Rows: `redis://` and `rediss://` (both on the lean
connection), and `rediss://` through redis-py's pool (a connection class of
the caller's own: the path every `rediss://` took before). Per row: the
burst's wall time (best round), acquisitions that failed, and the most
connections the server saw from the manager at once (CLIENT LIST).
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import redis.asyncio as aioredis

from otel_lock import LockManager
from otel_lock.cli._redis_server import RedisServer, free_port

HOLDS, CONTENDERS = 300, 30
ADMIN = "tls-burst-admin"  # the benchmark's own connection, not counted
EC = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]


def make_certificates(where: Path) -> None:
    """A CA, a server certificate for 127.0.0.1 signed by it, a client certificate, and an unrelated CA."""
    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=where, check=True, capture_output=True, timeout=30)

    for ca in ("ca", "other-ca"):
        openssl("req", "-x509", "-new", *EC, "-keyout", f"{ca}.key", "-out", f"{ca}.crt", "-days", "2",
                "-subj", f"/CN=otel-lock {ca}")
    (where / "server.ext").write_text("subjectAltName=IP:127.0.0.1\n")
    (where / "client.ext").write_text("extendedKeyUsage=clientAuth\n")
    for name in ("server", "client"):
        openssl("req", "-new", *EC, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN=otel-lock {name}")
        openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
                "-out", f"{name}.crt", "-days", "2", "-extfile", f"{name}.ext")


class _OwnTls(aioredis.SSLConnection):
    """A connection class of the caller's own: the manager leaves its connections to redis-py."""


async def _clients(admin: aioredis.Redis, port: int) -> int:
    """Connections to `port` on the server, the benchmark's own left out."""
    return sum(1 for c in await admin.client_list()
               if c.get("laddr", "").endswith(f":{port}") and c.get("name") != ADMIN)


async def burst(make: Callable[[], LockManager], admin: aioredis.Redis, port: int) -> dict[str, Any]:
    """One burst on a fresh manager: wall time, failed acquisitions, peak connections to `port`."""
    errors = 0
    peak = 0
    settled = 0  # holders that hold, or failed to
    all_settled, go = asyncio.Event(), asyncio.Event()

    async def count() -> None:
        nonlocal peak
        while True:
            peak = max(peak, await _clients(admin, port))
            await asyncio.sleep(0.01)

    def settle() -> None:
        nonlocal settled
        settled += 1
        if settled == HOLDS:
            all_settled.set()

    async def hold(i: int) -> None:
        nonlocal errors
        entered = False
        try:
            async with locks.lock(f"tls-burst:{i}", wait=30.0):
                entered = True
                settle()
                await go.wait()
        except Exception:
            errors += 1
            if not entered:
                settle()

    async def contend() -> None:
        nonlocal errors
        try:
            async with locks.lock("tls-burst:one", wait=30.0):
                await asyncio.sleep(0)
        except Exception:
            errors += 1

    for _ in range(500):  # the previous row's connections gone from the server's list first
        if not await _clients(admin, port):
            break
        await asyncio.sleep(0.01)
    locks = make()
    counter = asyncio.create_task(count())
    try:
        began = time.perf_counter()
        holders = [asyncio.create_task(hold(i)) for i in range(HOLDS)]
        await all_settled.wait()
        go.set()
        await asyncio.gather(*holders)
        await asyncio.gather(*(contend() for _ in range(CONTENDERS)))
        seconds = time.perf_counter() - began
    finally:
        counter.cancel()
        await asyncio.gather(counter, return_exceptions=True)
        await locks.aclose()
    return {"seconds": seconds, "errors": errors, "connections": peak}


async def main(rounds: int) -> None:
    with tempfile.TemporaryDirectory(prefix="otel-lock-tls-") as folder:
        certs = Path(folder)
        make_certificates(certs)
        tls_port = free_port()
        server = RedisServer(extra_args=(
            "--tls-port", str(tls_port), "--tls-cert-file", str(certs / "server.crt"),
            "--tls-key-file", str(certs / "server.key"), "--tls-ca-cert-file", str(certs / "ca.crt"),
            "--tls-auth-clients", "no"))
        server.start()
        ca = str(certs / "ca.crt")
        tls_url = f"rediss://127.0.0.1:{tls_port}/0"

        given: list[aioredis.Redis] = []  # clients handed to a manager: closed by their owner, here

        def redis_py_tls() -> LockManager:
            pool = aioredis.BlockingConnectionPool(connection_class=_OwnTls, host="127.0.0.1", port=tls_port,
                                                   ssl_ca_certs=ca, max_connections=64, timeout=5.0,
                                                   socket_timeout=2.0)
            given.append(aioredis.Redis.from_pool(pool))
            return LockManager(given[-1])

        rows: list[tuple[str, Callable[[], LockManager], int]] = [
            ("redis:// (lean)", lambda: LockManager.from_url(server.url), server.port),
            ("rediss:// (lean)", lambda: LockManager.from_url(tls_url, ssl_ca_certs=ca), tls_port),
            ("rediss:// via redis-py's pool", redis_py_tls, tls_port),
        ]
        results: dict[str, list[dict[str, Any]]] = {name: [] for name, _, _ in rows}
        try:
            async with aioredis.Redis(port=server.port, client_name=ADMIN) as admin:
                await burst(rows[0][1], admin, server.port)  # warm-up, not counted (imports, first scripts)
                for _ in range(rounds):
                    for name, make, port in rows:  # interleaved: the machine's state is shared fairly
                        await admin.flushall()
                        results[name].append(await burst(make, admin, port))
                        while given:
                            await given.pop().aclose()
        finally:
            server.stop()
    plain = min(r["seconds"] for r in results[rows[0][0]])
    print(f"{HOLDS} concurrent holds of distinct keys, then {CONTENDERS} tasks on one key; best of {rounds}")
    print(f"{'row':32} {'burst s':>8} {'x plain':>8} {'errors':>7} {'connections':>12}")
    for name, found in results.items():
        best = min(found, key=lambda r: r["seconds"])
        print(f"{name:32} {best['seconds']:8.3f} {best['seconds'] / plain:8.2f} "
              f"{max(r['errors'] for r in found):7d} {max(r['connections'] for r in found):12d}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    asyncio.run(main(parser.parse_args().rounds))
