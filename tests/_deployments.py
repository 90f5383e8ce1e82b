"""Redis deployments for tests that run the demo shop on each: one Redis, Sentinel, Cluster.

`deployment_url(kind)` is a sync context manager (module-wide fixtures and
CLI tests are sync): the Sentinel and Cluster sets start and stop on their
own short event loops. Nothing is killed here; the failover tests are elsewhere.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Iterator

from benchmarks._cluster_set import ClusterSet
from benchmarks._sentinel_set import SentinelSet
from otel_lock.cli._redis_server import RedisServer

KINDS = ("single", "sentinel", "cluster")


@contextlib.contextmanager
def deployment_url(kind: str) -> Iterator[str]:
    """The URL of a fresh deployment: a redis-server; a master, its replica and three sentinels; three Cluster masters."""
    if kind == "single":
        with RedisServer() as server:
            yield server.url
        return
    # No replication proxy: it would live on the start-up event loop, which ends before the tests run.
    servers = SentinelSet(proxy=False) if kind == "sentinel" else ClusterSet(masters=3)
    asyncio.run(servers.__aenter__())
    try:
        yield servers.url
    finally:
        asyncio.run(servers.__aexit__())
