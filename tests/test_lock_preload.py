"""gunicorn --preload with uvicorn workers: one import-time manager, forked into two workers, one holder at a time.

The pattern every example shows (a module-level `LockManager.from_url`)
behind the host that forks after import. Before this round both workers
acquired as the same owner and held the lock at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import redis

from otel_lock.cli._redis_server import free_port

from _proc_helpers import until

ROOT = Path(__file__).resolve().parents[1]
BUYERS = 40
ROUNDS = 10  # until both workers have served (which worker accepts a connection is the kernel's choice)


async def test_gunicorn_preload_uvicorn_workers_sell_exactly_the_stock(redis_url):
    pytest.importorskip("gunicorn")
    with redis.Redis.from_url(redis_url) as client:
        client.set("stock:7", BUYERS * ROUNDS)
    port = free_port()
    env = {**os.environ, "OTEL_LOCK_TEST_REDIS_URL": redis_url,
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    server = subprocess.Popen([sys.executable, "-m", "gunicorn", "--preload", "-k", "uvicorn.workers.UvicornWorker",
                               "-w", "2", "-b", f"127.0.0.1:{port}", "--chdir", str(ROOT / "tests"),
                               "--graceful-timeout", "5", "_preload_asgi_app:app"],
                              env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                              start_new_session=True)
    try:
        async def serving() -> bool:
            assert server.poll() is None, server.stderr.read()
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return True
            return False

        await until(serving, "gunicorn to listen")
        answers: list[httpx.Response] = []
        fresh = httpx.Limits(max_keepalive_connections=0)  # a new connection per request
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=60.0, limits=fresh) as client:
            for _ in range(ROUNDS):
                answers += await asyncio.gather(*(client.post("/stock/7/deduct") for _ in range(BUYERS)))
                if len({a.json()["pid"] for a in answers if a.status_code == 200}) == 2:
                    break
        assert [a.status_code for a in answers] == [200] * len(answers)
        sold = len(answers)
        left = sorted(a.json()["left"] for a in answers)
        assert left == list(range(BUYERS * ROUNDS - sold, BUYERS * ROUNDS))  # each unit sold once
        assert len({a.json()["pid"] for a in answers}) == 2  # both forked workers served under the lock
        with redis.Redis.from_url(redis_url) as client:
            assert int(client.get("stock:7")) == BUYERS * ROUNDS - sold
            assert client.get("overlaps") is None
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait(5)
        with contextlib.suppress(ProcessLookupError):  # a worker left behind by a failed run
            os.killpg(server.pid, signal.SIGKILL)
        server.stderr.close()
