"""A WSGI app whose module-level SyncLockManager is made and used at import: `gunicorn --preload`.

Each request takes the same lock and records in Redis what it saw, for
tests/test_sync.py: how many were inside at once, whether Redis named this
holder, which owner and which worker process.
"""

from __future__ import annotations

import os

import redis

from otel_lock.sync import SyncLockManager

URL = os.environ["OTEL_LOCK_TEST_REDIS_URL"]
locks = SyncLockManager.from_url(URL, namespace="wsgi")
with locks.lock("startup"):  # in the master, before it forks the workers
    pass
record = redis.Redis.from_url(URL)


def app(environ, start_response):
    with locks.lock("route", wait=30.0) as held:
        if record.incr("inside") != 1:
            record.incr("overlaps")
        if record.hget(held.key, "owner") != held.owner.encode():
            record.incr("wrong-owner")
        record.rpush("owners", held.owner)
        record.sadd("pids", os.getpid())
        record.decr("inside")
    start_response("200 OK", [("Content-Type", "text/plain")])
    return [held.owner.encode()]
