"""RedLockManager: one lock over N independent Redis masters, held by a majority of them.

The manager core (`_core.py`) is shared with LockManager; the quorum rounds
are the transport of `_quorum.py`. Holds, `lost`, `cancel_on_lost` and
per-task re-entry behave as in `LockManager`; see docs/lock.md, "RedLock
quorum".
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable, Sequence
from urllib.parse import urlsplit

import redis.asyncio as aioredis
from redis.asyncio.sentinel import SentinelConnectionPool
from opentelemetry import trace
from opentelemetry.metrics import MeterProvider

from ._background import Background
from ._breaker import Breaker
from ._calls import Calls
from ._clients import check_async, settings_of, speaking_for, twin
from ._core import Core, Topology
from ._options import ManagerOptions, check_breaker, check_seconds, refuse_theirs
from ._quorum import QuorumTransport
from ._redlock_scripts import Masters
from ._transport import Transport
from ._url_check import url_checked
from ..telemetry._instruments import Telemetry

_OPTIONS = ("namespace", "lease", "wait", "cancel_on_lost", "fence_ttl", "poll_cap", "renew_interval",
            "master_timeout", "tracer_provider", "meter_provider", "breaker_failures", "breaker_cooldown",
            "require_noeviction")
MIN_MASTERS = 3


def _check_masters(given: object, name: str, kind: str, alternative: str) -> None:
    """A list (not one string) of at least MIN_MASTERS masters."""
    if isinstance(given, (str, bytes)) or not isinstance(given, Sequence):
        raise ValueError(f"{name} must be a list of {kind}, not {given!r}")
    if len(given) < MIN_MASTERS:
        raise ValueError(f"RedLock needs at least {MIN_MASTERS} independent masters, got {len(given)} {kind}: "
                         f"with fewer, one failure stops all locking (use {alternative} for one Redis)")


def _check_clients(clients: Sequence[Any]) -> None:
    """redis.asyncio clients of different masters: a master counted twice makes one Redis a quorum."""
    for client in clients:
        check_async(client, (aioredis.Redis,), "RedLockManager takes one redis.asyncio.Redis client per master",
                    "RedLockManager.from_urls(urls)")
    if len({id(c) for c in clients}) != len(clients):
        raise ValueError("the same client is given twice: each master must be a different Redis")
    seen: set[str] = set()
    for client in clients:
        if isinstance(client.connection_pool, SentinelConnectionPool):
            continue  # its master is whatever its Sentinels name
        where = settings_of(client).address()
        if where in seen:
            raise ValueError(f"two clients name the master {where}: each master must be a different Redis")
        seen.add(where)


class Quorum(Topology):
    """N masters: the given clients on their first loop, twins (or clients from the URLs) elsewhere."""

    owners = False
    shapes = False  # shared holds and permits: one exclusive owner per quorum round only
    counts_depth = False

    def __init__(self, clients: list[Any], urls: list[str] | None, url_options: dict[str, Any], owns: bool,
                 master_timeout: float, options: ManagerOptions, telemetry: Telemetry, breaker: Breaker) -> None:
        self.clients, self.urls, self.url_options, self.owns = clients, urls, url_options, owns
        self.master_timeout = master_timeout
        self.options, self.telemetry, self.breaker = options, telemetry, breaker
        self._home_pid = os.getpid()
        self._home_free = True

    def own(self, urls: list[str], url_options: dict[str, Any]) -> None:
        """The given clients were built for this manager (from_urls): it closes them, and builds the next ones."""
        self.urls, self.url_options, self.owns = urls, url_options, True

    def clients_for_loop(self) -> tuple[list[Any], bool]:
        if self._home_free and os.getpid() == self._home_pid:
            self._home_free = False
            return self.clients, self.owns
        if self.urls is not None:
            return [aioredis.Redis.from_url(url, **self.url_options) for url in self.urls], True
        twins = [twin(client) for client in self.clients]
        if any(t is None for t in twins):
            raise RuntimeError("this RedLockManager was given clients that cannot be used from another event loop "
                               "or process: create it with RedLockManager.from_urls([...]), which serves every one")
        return twins, True

    def open(self, identity: str, next_owner: Callable[[], str], index: int,
             background: Background) -> tuple[Transport, Any, bool]:
        clients, owns = self.clients_for_loop()
        calls = [Calls(self.telemetry, None, c) for c in clients]
        # every master's scripts on a lean connection (TLS included), unless its client has a class of its own
        senders = [speaking_for(c) or c for c in clients]
        masters = Masters(clients, self.master_timeout, calls, senders)
        transport = QuorumTransport(masters, self.breaker, self.options.fence_ttl_ms, self.options.poll_cap,
                                    next_owner, background)
        return transport, clients, owns

    def where(self) -> str:
        return ",".join(settings_of(c).address() for c in self.clients)


class RedLockManager(Core):
    """Hands out locks held by a majority of N independent Redis masters."""

    def __init__(self, clients: Sequence[aioredis.Redis], *, namespace: str = "otel-lock", lease: float = 30.0,
                 wait: float = 5.0, cancel_on_lost: bool = False, fence_ttl: float = 3600.0,
                 poll_cap: float = 0.05, renew_interval: float | None = None, master_timeout: float | None = None,
                 tracer_provider: trace.TracerProvider | None = None,
                 meter_provider: MeterProvider | None = None, breaker_failures: int = 5,
                 breaker_cooldown: float = 1.0, require_noeviction: bool = False) -> None:
        _check_masters(clients, "clients", "redis.asyncio clients", "LockManager")
        options = ManagerOptions.checked(namespace, lease, renew_interval, wait, cancel_on_lost, fence_ttl, poll_cap,
                                         require_noeviction)
        self.master_timeout: float = min(0.25, options.lease / 10) if master_timeout is None else check_seconds(
            "master_timeout", master_timeout, allow_zero=False)
        if self.master_timeout * 4 > options.lease:
            raise ValueError(f"master_timeout ({master_timeout} s) must be at most a quarter of the lease "
                             f"({options.lease} s): a round takes up to two of them and must leave validity")
        check_breaker(breaker_failures, breaker_cooldown)  # every option is named before the clients are
        _check_clients(clients)
        # a per-call lease must leave a round its validity too
        options = dataclasses.replace(
            options, min_lease=self.master_timeout * 4,
            min_lease_why=f" (4 x master_timeout {self.master_timeout:g} s: a round takes up to two of them and "
                          "must leave validity)")
        # The breaker is fed by acquire rounds: it opens when a majority of the masters is
        # unreachable round after round (docs/lock.md, "Circuit breaker").
        super().__init__(options, tracer_provider, meter_provider, breaker_failures, breaker_cooldown)
        self.quorum: int = len(clients) // 2 + 1
        self._topology = self._quorum = Quorum(list(clients), None, {}, False, self.master_timeout, options,
                                               self.telemetry, self._breaker)
        self._ends.counts_depth = self._topology.counts_depth

    @classmethod
    def from_urls(cls, urls: Sequence[str], **options: Any) -> RedLockManager:
        """A manager with one client per URL (and per event loop); redis-py options apply to every one."""
        _check_masters(urls, "urls", "Redis URLs", "LockManager.from_url")
        seen = set()
        for url in urls:
            parts = urlsplit(url) if isinstance(url, str) else None
            if parts is None or parts.scheme not in ("redis", "rediss", "unix"):
                raise ValueError(f"unknown Redis URL scheme in {url!r}: use redis://, rediss:// or unix://")
            url_checked(url)
            where = (parts.hostname, parts.port, parts.path) if parts.scheme == "unix" else (parts.hostname,
                                                                                            parts.port or 6379)
            if where in seen:
                raise ValueError(f"{url!r} names a master already given: each master must be a different Redis")
            seen.add(where)
        refuse_theirs(options, "RedLockManager.from_urls()")
        mine = {k: options.pop(k) for k in _OPTIONS if k in options}
        # each call is bounded by master_timeout anyway; the socket timeout only closes a dead connection
        options.setdefault("socket_timeout", 2.0)
        options.setdefault("socket_connect_timeout", options["socket_timeout"])
        manager = cls([aioredis.Redis.from_url(url, **options) for url in urls], **mine)
        manager._quorum.own(list(urls), options)  # its clients are its own: one set per event loop
        return manager

    def _topology_client(self) -> Any:
        return self._quorum.clients[0]
