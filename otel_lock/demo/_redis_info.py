"""Which Redis a replica talks to, for `/healthz`: one Redis, a Sentinel master, or a Cluster.

Replicas of one deployment must show the same `run_id`. A Cluster has no
single server to ask: `INFO` reaches one node (a random one), so the answer
would differ from call to call. On a Cluster every primary is asked, and
`run_id` is their run ids, sorted and joined: it changes when any primary
does (a restart, a failover), like a single server's.
"""

from __future__ import annotations

from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.sentinel import SentinelConnectionPool


async def redis_identity(redis: aioredis.Redis | RedisCluster) -> dict[str, Any]:
    """`mode` (standalone, sentinel or cluster), `run_id`, `run_ids` (one per primary) and `version`."""
    if isinstance(redis, RedisCluster):
        per_node = await redis.info("server", target_nodes=RedisCluster.PRIMARIES)
        infos = list(per_node.values())
        mode = "cluster"
    else:
        infos = [await redis.info("server")]
        mode = "sentinel" if isinstance(redis.connection_pool, SentinelConnectionPool) else "standalone"
    run_ids = sorted(str(info.get("run_id")) for info in infos)
    versions = sorted({str(info.get("redis_version")) for info in infos})
    return {"mode": mode, "run_id": ",".join(run_ids), "run_ids": run_ids, "version": ",".join(versions)}
