"""Guards that stay awake: the data model and the server checks, asserted again while a manager runs.

A first use checks the server(s) and claims the namespace for this data
model (`_core.py`). Both go stale under a running manager: a Redis
restarted without persistence, a failover to a replica that missed the
claim, a FLUSHDB, or a week of uptime (the claim's TTL) forget the claim;
a restart or a failover can bring a server with another eviction policy or
other ACL rights. So each runtime (one per manager and event loop) runs one
small task that, every `period(lease)` seconds (half the manager's default
lease, between 2 and 15 s):

- reads each server's identity (`run_id` and `role`, one `INFO server
  replication`); when it changed (a restart, a failover, another master),
  or while the last verdict was a refusal, the server checks run again,
  and a refusal sends the next acquisition through the first-use check;
- claims the namespace again (MODEL_CHECK: another week for this model),
  or finds another model there; then the next acquisition goes through the
  first-use check again and is refused with RedisMisconfigured naming the
  fix. Claims from every running manager therefore outlive any TTL, and a
  claim lost to a FLUSH is made again within one lease.

A tick costs one INFO per server and one script call; the identity is read
first, so a server that refuses the claim (a replica: READONLY) is still
checked. A step that cannot reach Redis is skipped until the next tick: the
acquisitions report the outage themselves. The calls feed the circuit
breaker like any other call to Redis.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Callable, Protocol

from redis.exceptions import RedisError

from ._errors import LockError
from ._server_checks import ServerReport, server_identity
from ._transport import Send, Transport

if TYPE_CHECKING:
    from ._runtime import Runtime

log = logging.getLogger("otel_lock")

FLOOR, CEILING = 2.0, 15.0

Identity = tuple[tuple[str, str | None, str | None], ...]


def period(lease: float) -> float:
    """Seconds between two ticks: half the default lease, so a lost claim is made again within one lease."""
    return min(max(lease / 2, FLOOR), CEILING)


class Keeper(Protocol):
    """What the guard asks of the manager core (`_core.Core`)."""

    async def _claim_model(self, transport: Transport) -> int | None: ...  # the other model holding it, or None

    async def _run_checks(self, transport: Transport) -> tuple[ServerReport, ...]: ...  # run and keep them now

    def _refused(self) -> bool: ...  # did the last checks refuse a server?


async def stay_awake(runtime_ref: Callable[[], Runtime | None], keeper_ref: Callable[[], Keeper | None], every: float) -> None:
    """Forever, every `every` seconds: the servers' identity, then the model claim (see the module's docstring).

    The runtime and the manager are held weakly across the sleeps: a manager
    its user dropped without closing is collected as before, and its guard
    ends at the next tick instead of keeping it alive for the loop's life.
    """
    runtime = runtime_ref()
    if runtime is None:
        return
    try:
        seen = await identity(runtime.transport)
    except (RedisError, OSError, LockError):
        seen = ()  # unknown: the first identity read will run the checks again
    del runtime
    while True:
        await asyncio.sleep(every)
        runtime, keeper = runtime_ref(), keeper_ref()
        if runtime is None or keeper is None or runtime.closed:
            return
        seen = await _check_servers(runtime, keeper, seen)
        try:
            if await keeper._claim_model(runtime.transport) is not None:
                runtime.recheck()
        except (RedisError, OSError, LockError) as exc:  # a replica answers READONLY: the checks said why
            log.debug("otel-lock: server watch could not claim the namespace: %s", exc)
        del runtime, keeper


async def _check_servers(runtime: Runtime, keeper: Keeper, seen: Identity) -> Identity:
    """The server checks again if a server changed (or refused last time); the identity they saw."""
    try:
        now = await identity(runtime.transport)
        if now == seen and not keeper._refused():
            return seen
        if now != seen:
            log.info("otel-lock: the server changed (%s): checking it again", _changes(seen, now))
        reports = await keeper._run_checks(runtime.transport)
    except (RedisError, OSError, LockError) as exc:
        log.debug("otel-lock: server watch skipped a check: %s", exc)
        return seen
    if any(report.refusals for report in reports):
        runtime.recheck()
    return now


async def identity(transport: Transport) -> Identity:
    """(address, run_id, role) of every server the locks live on; ("unreachable", None) for one that is down."""
    out = []
    for address, run in await _targets(transport):
        try:
            run_id, role = await server_identity(run)
        except (RedisError, OSError, LockError):
            run_id, role = "unreachable", None
        out.append((address, run_id, role))
    return tuple(sorted(out))


async def _targets(transport: Transport) -> list[tuple[str, Send]]:
    return await transport.servers()


def _changes(before: Identity, after: Identity) -> str:
    was = {address: (run_id, role) for address, run_id, role in before}
    now = {address: (run_id, role) for address, run_id, role in after}
    said = []
    for address in sorted(set(was) | set(now)):
        if was.get(address) != now.get(address):
            old, new = was.get(address, (None, None)), now.get(address, (None, None))
            said.append(f"{address}: run_id {old[0]} -> {new[0]}, role {old[1]} -> {new[1]}")
    return "; ".join(said)
