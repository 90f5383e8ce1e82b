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
BUYERS = 60


async def test_gunicorn_preload_uvicorn_workers_sell_exactly_the_stock(redis_url):
    pytest.importorskip("gunicorn")
    with redis.Redis.from_url(redis_url) as client:
        client.set("stock:7", BUYERS)
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
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=60.0) as client:
            answers = await asyncio.gather(*(client.post("/stock/7/deduct") for _ in range(BUYERS)))
        assert [a.status_code for a in answers] == [200] * BUYERS
        assert sorted(a.json()["left"] for a in answers) == list(range(BUYERS))  # each unit sold once
        with redis.Redis.from_url(redis_url) as client:
            assert client.get("stock:7") == b"0"
            assert client.get("overlaps") is None
            assert len(client.smembers("pids")) == 2  # both forked workers served under the lock
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
