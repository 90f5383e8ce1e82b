"""A start-up failure ends the start-up under every server and test client, promptly, with the message.

Regression tests: `with TestClient(app)` hung on an annotation mistake (the
middleware sent `lifespan.startup.failed` while the app's lifespan waited
on), and a CancelledError traceback followed the failure. Each host runs in
its own process, as users run it; the app's own lifespan clean-up must run too.
"""

from __future__ import annotations

import asyncio
import socket
import sys
import textwrap

import pytest

APP = """
import pathlib
from contextlib import asynccontextmanager

from fastapi import FastAPI

from otel_lock import LockManager, LockMiddleware, locked

MARKS = pathlib.Path(__file__).with_name("marks.txt")


@asynccontextmanager
async def lifespan(app):
    MARKS.write_text("started\\n")
    yield
    with MARKS.open("a") as marks:
        marks.write("stopped\\n")


app = FastAPI(lifespan=lifespan)
"""

MISTAKES = {
    # An annotation mistake: the template names a path parameter the route lacks.
    "typo": (APP + """
@app.post("/typo/{pid}")
@locked("stock:{path.product_id}")
async def typo(pid: int):
    return {}


app.add_middleware(LockMiddleware, manager=LockManager.from_url("redis://127.0.0.1:9/0"))
""", "route /typo/{pid}", "no path parameter 'product_id'"),
    # No manager anywhere: not given, and the lifespan sets no app.state.locks.
    "no-manager": (APP + """
@app.post("/stock/{pid}")
@locked("stock:{path.pid}")
async def deduct(pid: int):
    return {}


app.add_middleware(LockMiddleware)
""", "LockMiddleware has no lock manager", "app.state.locks"),
}

TEST_CLIENT = """
from fastapi.testclient import TestClient

import appmod

try:
    with TestClient(appmod.app):
        print("STARTED")
except Exception as error:
    print("RAISED", type(error).__name__, error)
"""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


HOSTS = {
    "uvicorn": lambda: ["-m", "uvicorn", "appmod:app", "--port", str(_free_port()), "--lifespan", "on"],
    "hypercorn": lambda: ["-m", "hypercorn", "appmod:app", "--bind", f"127.0.0.1:{_free_port()}"],
    "granian": lambda: ["-m", "granian", "--interface", "asgi", "appmod:app", "--port", str(_free_port())],
    "testclient": lambda: ["testclient.py"],
}


async def _run(tmp_path, args: list[str]) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(sys.executable, *args, cwd=tmp_path, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.STDOUT)
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), 60)   # a hang fails here, not in the next test
    except TimeoutError:
        proc.kill()
        await proc.wait()
        pytest.fail(f"{args[:2]} did not end its start-up: it hangs")
    return proc.returncode or 0, out.decode(errors="replace")


@pytest.mark.parametrize("mistake", sorted(MISTAKES))
@pytest.mark.parametrize("host", sorted(HOSTS))
async def test_a_start_up_failure_ends_the_start_up_with_its_message(tmp_path, host, mistake):
    if host == "granian":
        pytest.importorskip("granian")
    source, *words = MISTAKES[mistake]
    (tmp_path / "appmod.py").write_text(textwrap.dedent(source))
    (tmp_path / "testclient.py").write_text(TEST_CLIENT)
    code, output = await _run(tmp_path, HOSTS[host]())
    for word in words:
        assert word in output, output
    assert "CancelledError" not in output, output
    assert "STARTED" not in output
    if host == "uvicorn":
        assert code == 3 and "Application startup failed" in output   # uvicorn's own exit for a failed start
    if host == "granian":
        assert code != 0
    if host == "testclient":
        assert "RAISED StartupFailed" in output   # `with TestClient(app)` raises, naming the mistake
    # The app's own lifespan ran its clean-up after our refusal.
    assert (tmp_path / "marks.txt").read_text() == "started\nstopped\n"
