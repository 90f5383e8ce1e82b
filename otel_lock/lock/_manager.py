"""LockManager: locks on one Redis, a Sentinel-managed master, or a Redis Cluster.

The manager core (`_core.py`) is shared with RedLockManager; this module
only says how to reach the servers: which client each event loop gets, and
the transport of `_script_transport.py` over the link of `_topology.py`.
"""

from __future__ import annotations

import os
from typing import Any, Callable
from urllib.parse import urlsplit

import redis.asyncio as aioredis
from opentelemetry import trace
from opentelemetry.metrics import MeterProvider
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError

from ._background import Background
from ._breaker import Breaker
from ._calls import Calls
from ._clients import check_async, settings_of, twin
from ._cluster import SCHEME as CLUSTER_SCHEME
from ._cluster import cluster_client
from ._core import Core, Topology
from ._options import ManagerOptions, check_seconds, refuse_theirs
from ._replicas import check_replicas
from ._script_transport import ScriptTransport
from ._sentinel import SCHEME as SENTINEL_SCHEME
from ._sentinel import master_client
from ._topology import link_for
from ._transport import Transport
from ._url_check import url_checked
from ..telemetry._instruments import LockCounts, Telemetry

_MANAGER_OPTIONS = ("namespace", "lease", "wait", "cancel_on_lost", "fence_ttl", "poll_cap", "renew_interval",
                    "tracer_provider", "meter_provider", "wait_replicas", "wait_replicas_timeout",
                    "breaker_failures", "breaker_cooldown", "require_noeviction")


class OneRedis(Topology):
    """One Redis (or a Sentinel master, or a Cluster): a client per loop, the given one on the first."""

    def __init__(self, given: Any, make: Callable[[], Any] | None, owns_given: bool, options: ManagerOptions,
                 telemetry: Telemetry, breaker: Breaker, counts: LockCounts, wait_replicas: int,
                 wait_replicas_timeout: float) -> None:
        self.given, self.make, self.owns_given = given, make, owns_given
        self.options, self.telemetry, self.breaker, self.counts = options, telemetry, breaker, counts
        self.wait_replicas, self.wait_timeout_ms = wait_replicas, int(wait_replicas_timeout * 1000)
        self._home_pid = os.getpid()
        self._home_free = True
        self._spare: Any = None

    def shapes_refused(self) -> str | None:
        return ("its grants are confirmed by WAIT (wait_replicas), and each shared or permit grant would need "
                "its own" if self.wait_replicas else None)

    def own(self, make: Callable[[], Any]) -> None:
        """The given client was built for this manager (from_url): it closes it, and builds the next ones."""
        self.make, self.owns_given = make, True

    def client_for_loop(self) -> tuple[Any, bool]:
        """(client, whether the runtime closes it): the given client on its first loop, else a twin."""
        if self._home_free and os.getpid() == self._home_pid and self.given is not None:
            self._home_free = False
            return self.given, self.owns_given
        client = self.make() if self.make is not None else None
        if client is None:
            raise RuntimeError(
                f"this LockManager was given a {type(self.given).__name__} that cannot be used from another event "
                "loop or process, and none can be built from its settings: create the manager with "
                "LockManager.from_url(...), which serves every loop and process")
        return client, True

    def open(self, identity: str, next_owner: Callable[[], str], index: int,
             background: Background) -> tuple[Transport, Any, bool]:
        client, owns = self.client_for_loop()
        link = link_for(client, self.wait_replicas, self.wait_timeout_ms)
        channel = f"{self.options.namespace}:wake:{identity}" + (f"-{index}" if index else "")
        calls = Calls(self.telemetry, self.breaker, link.client, partial=link.sharded)
        transport = ScriptTransport(link, calls, channel,
                                    self.options.fence_ttl_ms, self.options.poll_cap, self.counts.pending, background)
        return transport, client, owns

    def where(self) -> str:
        client = self.given if self.given is not None else self.spare()
        return settings_of(client).address()

    async def close_spare(self) -> None:
        spare, self._spare = self._spare, None
        if spare is not None and spare is not self.given:
            await spare.aclose()
        if self.owns_given and self._home_free and self.given is not None:
            await self.given.aclose()  # made by from_url and never handed to a runtime

    def spare(self) -> Any:
        """A client for calls made outside any event loop (the manager's `redis` there)."""
        if self.given is not None and os.getpid() == self._home_pid:
            return self.given
        if self._spare is None:
            self._spare = self.make() if self.make is not None else self.given
        return self._spare


class LockManager(Core):
    """Hands out locks from one Redis; one subscriber and one watchdog per manager and event loop."""

    def __init__(self, redis: aioredis.Redis | RedisCluster, *, namespace: str = "otel-lock", lease: float = 30.0,
                 wait: float = 5.0, cancel_on_lost: bool = False, fence_ttl: float = 3600.0,
                 poll_cap: float = 0.5, renew_interval: float | None = None,
                 tracer_provider: trace.TracerProvider | None = None,
                 meter_provider: MeterProvider | None = None, wait_replicas: int = 0,
                 wait_replicas_timeout: float = 0.5, breaker_failures: int = 5,
                 breaker_cooldown: float = 1.0, require_noeviction: bool = False) -> None:
        options = ManagerOptions.checked(namespace, lease, renew_interval, wait, cancel_on_lost, fence_ttl, poll_cap,
                                         require_noeviction)
        check_async(redis, (aioredis.Redis, RedisCluster),
                    "LockManager takes a redis.asyncio.Redis or redis.asyncio.RedisCluster client",
                    "LockManager.from_url(url)")
        if isinstance(redis, RedisCluster) and wait_replicas:
            raise ValueError("wait_replicas is not supported with Redis Cluster (it needs WAIT on the "
                             "connection that ran the script; see docs/lock.md)")
        replicas, replicas_timeout = check_replicas(redis, wait_replicas, wait_replicas_timeout)
        self.wait_replicas: int = replicas
        self.wait_replicas_timeout: float = replicas_timeout
        super().__init__(options, tracer_provider, meter_provider, breaker_failures, breaker_cooldown)
        self._topology = self._one = OneRedis(redis, lambda: twin(redis), False, options, self.telemetry,
                                              self._breaker, self._counts, replicas, replicas_timeout)
        self._ends.counts_depth = self._topology.counts_depth

    @classmethod
    def from_url(cls, url: str, **options: Any) -> LockManager:
        """A manager with its own clients (one per event loop); Redis options (socket_timeout, ...) go to redis-py.

        The client's pool blocks when all `max_connections` (default 64) are
        busy, for at most `pool_timeout` seconds (default 5), so a burst
        queues instead of failing; past that the caller gets RedisUnavailable.
        """
        scheme = urlsplit(url).scheme if isinstance(url, str) else None
        if scheme not in ("redis", "rediss", "unix", SENTINEL_SCHEME, CLUSTER_SCHEME):
            raise ValueError(f"unknown Redis URL scheme in {url!r}: use redis://, rediss://, unix://, "
                             f"{SENTINEL_SCHEME}:// or {CLUSTER_SCHEME}://")
        if scheme not in (SENTINEL_SCHEME, CLUSTER_SCHEME):  # those parse their own URLs, which take no query
            url_checked(url)
        refuse_theirs(options, "LockManager.from_url()")
        mine = {k: options.pop(k) for k in _MANAGER_OPTIONS if k in options}
        make = client_factory(url, scheme, options)
        manager = cls(make(), **mine)
        manager._one.own(make)  # its clients are its own: one per event loop, built from the URL
        return manager

    def _topology_client(self) -> Any:
        return self._one.spare()

    async def _close_clients(self) -> None:
        await self._one.close_spare()


def client_factory(url: str, scheme: str, options: dict[str, Any]) -> Callable[[], Any]:
    """Build a new client for `url` each call (one per event loop and process)."""
    options.setdefault("socket_timeout", 2.0)
    options.setdefault("socket_connect_timeout", options["socket_timeout"])
    options.setdefault("max_connections", 64)
    pool_timeout = check_seconds("pool_timeout", options.pop("pool_timeout", 5.0), allow_zero=False)
    if scheme == CLUSTER_SCHEME:  # its own retry: see _cluster.cluster_client
        cluster_client(url, dict(options))  # check the URL and options now, not at the first call
        return lambda: cluster_client(url, dict(options))
    # One immediate retry of a refused/reset connection (a pooled connection
    # that died with a Redis restart); a timeout is not retried, so an outage
    # surfaces within the socket timeout.
    retry = options.pop("retry", None)

    def make() -> Any:
        opts = dict(options, retry=retry or Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,)))
        if scheme == SENTINEL_SCHEME:
            return master_client(url, pool_timeout, opts)
        return aioredis.Redis.from_pool(aioredis.BlockingConnectionPool.from_url(url, timeout=pool_timeout, **opts))
    return make
