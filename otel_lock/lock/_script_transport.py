"""The lock on one Redis, a Sentinel master or a Cluster: the scripts of `_scripts.py` over one link.

One transport per process and event loop (`_runtime.py`). It takes a lock
(an `Attempt`: queue, wake-up, claim), re-enters, releases, renews a batch
of leases, and answers the operator calls; the manager core above it does
the rest (holds, re-entry bookkeeping, loss, telemetry) the same way for
every topology.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from typing import Any, AsyncGenerator, Callable, Coroutine, cast

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from . import _scripts
from ._attempt import Acquisition, Attempt, Reply, cancelling
from ._background import Background
from ._calls import Calls, batch_outcomes, record_batch
from ._errors import LockError, RedisUnavailable
from ._held import Lease, LockInfo
from ._listing import held_pages
from ._options import default_name
from ._server_checks import ServerReport, check_server
from ._shapes import EXCLUSIVE, SHARED, SHARED_OWNER, Shape, force_release_shared, renew_members, shape_of_key
from ._topology import Link, ReplicatedLink
from ._transport import RedisClient, Send, Transport

log = logging.getLogger("otel_lock")
RELEASE_RETRY = 0.25


def lock_keys(redis_key: str) -> tuple[str, str, str, str]:
    """The four keys of one lock (`_scripts.py` has the data model)."""
    return redis_key, redis_key + ":fence", redis_key + ":q", redis_key + ":w"


class ScriptTransport(Transport):
    """Locks on one Redis (or Sentinel, or Cluster) for one event loop."""

    def __init__(self, link: Link, calls: Calls, channel: str, fence_ttl_ms: int, poll_cap: float,
                 pending: Counter[str], background: Background) -> None:
        self.link = link
        self.calls = calls
        self.fence_ttl_ms = fence_ttl_ms
        self.poll_cap = poll_cap
        self.pending = pending
        self._background = background
        self.acquire_script = link.acquire_script
        # with wait_replicas, a hand-over is confirmed by an ACQUIRE that WAITs
        self.trust_grants = link.trusts_grants
        self.waiting = link.waiting(channel, self._pass_on)
        self.polling = False  # no pub/sub rights: waiters poll (one warning)

    @property
    def records(self) -> RedisClient:
        """This loop's redis-py client (idempotency records, operator calls)."""
        return cast(RedisClient, self.link.redis)

    def call(self, script: _scripts.Script, keys: tuple[str, ...], args: list[Any], operation: str,
             name: str) -> Coroutine[Any, Any, Any]:
        return self.calls(self.link.call(script, keys, args), operation, name, keys[0])

    def refused_channels(self, error: BaseException) -> bool:
        """A subscribe refused for lack of channel rights: poll from now on (said once, with the rule to add)."""
        if "NOPERM" not in str(error):
            return False
        self.poll_instead(str(self.calls.error(error, "subscribe", None)))
        return True

    def poll_instead(self, why: str | None) -> None:
        """No wake-ups can reach this manager: waiters poll (without a queue place), with one warning.

        `why=None`: the server check has warned already.
        """
        if not self.polling:
            self.polling = True
            if why is not None:
                log.warning("otel-lock: waiters poll instead of being woken on release (slower hand-overs, no FIFO): "
                            "%s", why)

    # -- taking, re-entering, releasing --------------------------------------

    def acquire_for(self, shape: Shape) -> _scripts.Script:
        """The ACQUIRE of `shape` on this link (the exclusive one WAITs for replicas with wait_replicas)."""
        return self.acquire_script if shape is EXCLUSIVE else shape.acquire

    def take(self, request: Acquisition) -> Coroutine[Any, Any, Reply | None]:
        """The lock within `request.wait` (LockTimeout), or at once (None when busy) with wait=0.

        The attempt's own coroutine, not one around it: one level less to resume on every acquisition.
        """
        if request.shape is not EXCLUSIVE and isinstance(self.link, ReplicatedLink):
            raise LockError(f"{request.shape.mode} holds are not offered with wait_replicas (each grant would "
                            "need its own WAIT): use a manager without wait_replicas for "
                            f"{request.keys[0]}", key=request.keys[0])
        request.keys = request.shape.keys(request.keys[0])
        attempt = Attempt(self, request)
        return attempt.run() if request.wait > 0 else attempt.try_once()

    async def reenter(self, lease: Lease) -> int | None:
        """One more level in Redis (counted there for holders that share an explicit owner); None: lost.

        A shared hold nests locally: its lease in Redis is one, however deep.
        """
        if lease.shape is not EXCLUSIVE:
            return None if lease.lost.is_set() else lease.depth
        keys = lock_keys(lease.key)
        args = [lease.owner, "-", lease.renew_ms, "1", "-1", "", self.fence_ttl_ms, ""]
        call = asyncio.ensure_future(self.call(self.acquire_script, keys, args, "acquire", lease.name))
        try:
            answer = await asyncio.shield(call)
        except asyncio.CancelledError:
            call.add_done_callback(lambda done: self._undo_reentry(done, lease))
            raise
        return int(answer[2]) if answer[0] == 1 else None

    def _undo_reentry(self, call: asyncio.Future[Any], lease: Lease) -> None:
        if not call.cancelled() and call.exception() is None and call.result()[0] == 1:
            self.background(self.release(lease, whole=False))

    async def release(self, lease: Lease, *, whole: bool) -> int:
        """-1 when the lock was no longer this owner's, else the depth left in Redis (0: released)."""
        shape = lease.shape
        answer = await self.call(shape.release, shape.keys(lease.lock_base), [lease.owner, self.fence_ttl_ms,
                                                                              "1" if whole else "0"],
                                 "release", lease.name)
        return int(answer)

    def send_release(self, lease: Lease, *, whole: bool,
                     on_orphan: Callable[[Any], None] | None = None) -> asyncio.Future[Any] | None:
        """RELEASE on the wire now (the lean connection), its raw reply's future; None: use `release()`."""
        shape = lease.shape
        return self.link.send_now(shape.release, shape.keys(lease.lock_base),
                                  [lease.owner, self.fence_ttl_ms, "1" if whole else "0"], on_orphan)

    def release_answer(self, lease: Lease, seconds: float, reply: Any) -> int | LockError:
        """The RELEASE reply of `send_release` (or the error that ended it): the depth left, or the error."""
        if isinstance(reply, BaseException):
            return self.calls.failed(reply, seconds, "release", lease.name, lease.key)
        self.calls.ok(seconds, "release", lease.name)
        return int(reply)

    def release_when_back(self, lease: Lease) -> None:
        """A release that Redis did not answer: retried until it does (the next caller gets in then)."""
        self.background(self._release_when_back(lease))

    async def _release_when_back(self, lease: Lease) -> None:
        loop = asyncio.get_running_loop()
        give_up = loop.time() + lease.lease_seconds
        while loop.time() < give_up:
            await asyncio.sleep(RELEASE_RETRY)
            try:
                await self.release(lease, whole=True)
                return
            except RedisUnavailable:
                if cancelling():  # aclose() stopped it, whatever redis-py made of the CancelledError
                    return

    def lost(self, lease: Lease) -> None:
        """Nothing to do on one Redis: the lock is no longer this owner's there, or Redis cannot be reached."""

    def _pass_on(self, waiter_id: str, redis_key: str) -> None:
        """A hand-over to a waiter this manager no longer has: pass it on now, not after its lease."""
        shape, base = shape_of_key(redis_key)
        name = default_name(base.partition("{")[2].rpartition("}")[0])
        self.background(self.call(shape.leave, shape.leave_keys(shape.keys(base)), [waiter_id, self.fence_ttl_ms],
                                  "leave", name))

    # -- the watchdog's batch --------------------------------------------------

    async def renew(self, leases: list[Lease]) -> list[bool | BaseException]:
        """Renew every lease (owner-checked) in one round trip per node: True, False (lost) or the error.

        Exclusive leases go by RENEW, shared and permit leases by RENEW_MEMBERS, in the same batch.
        """
        keys = [lease.key for lease in leases]
        groups: list[list[int]] = []
        calls: list[tuple[Any, ...]] = []
        scripts: list[_scripts.Script] = []
        plain = [i for i, lease in enumerate(leases) if lease.shape is EXCLUSIVE]
        members = [i for i, lease in enumerate(leases) if lease.shape is not EXCLUSIVE]
        for indexes, script in ((plain, _scripts.renew), (members, renew_members)):
            for group in self.link.groups([keys[i] for i in indexes]) if indexes else ():
                chosen = [indexes[n] for n in group]
                groups.append(chosen)
                scripts.append(script)
                if script is _scripts.renew:
                    call_keys: list[str] = [keys[i] for i in chosen]
                else:
                    call_keys = [k for i in chosen for k in leases[i].shape.renew_keys(keys[i])]
                calls.append(("EVALSHA", script.sha, len(call_keys), *call_keys,
                              *(a for i in chosen for a in (leases[i].owner, leases[i].renew_ms))))
        began = time.perf_counter()
        try:
            results = await self.link.batch(calls)
            if any(isinstance(r, NoScriptError) for r in results):
                for script in set(scripts):
                    if not await _scripts.load(self.link.client, script):
                        calls = [_scripts.eval_instead(call, script) if used is script else call
                                 for call, used in zip(calls, scripts)]
                results = await self.link.batch(calls)
        except (RedisError, OSError) as exc:
            results = [exc] * len(calls)
        out: list[bool | BaseException] = [False] * len(leases)
        for chosen, answers in zip(groups, results):
            for n, i in enumerate(chosen):
                if isinstance(answers, BaseException):
                    out[i] = self.calls.error(answers, f"renew of {keys[i]}", keys[i])
                else:
                    out[i] = bool(answers[n])
        record_batch(self.calls.telemetry, batch_outcomes([l.name for l in leases], out), time.perf_counter() - began)
        return out

    async def check_model(self, key: str, model: int, ttl: int, lock_key: str, name: str) -> int | None:
        """Claim the namespace for `model` (at the first acquire of `lock_key`); None when ours, else the holder."""
        held = await self.calls(self.link.call(_scripts.model_check, (key,), [model, ttl, *_scripts.SHARES_WITH]), "acquire", name, lock_key)
        return None if int(held) == model else int(held)

    async def servers(self) -> list[tuple[str, Send]]:
        """(address, send one command) for the server, or every Cluster master: the server checks' targets."""
        return await self.link.servers(self.calls.where)

    async def server_reports(self, namespace: str, require_noeviction: bool) -> list[ServerReport]:
        """The server checks (`_server_checks.py`) of the server, or of every Cluster master."""
        cluster = self.link.sharded
        reports = []
        for address, send in await self.servers():
            try:
                reports.append(await check_server(send, namespace=namespace, cluster=cluster,
                                                  require_noeviction=require_noeviction, address=address,
                                                  subscribe=self.link.subscribe_probe(address)))
            except (OSError, RedisConnectionError, RedisTimeoutError) as exc:
                if not cluster:
                    raise
                # A master that is down (or failing over) must not fail the locks of every other slot:
                # its keys fail on their own, and the next check (a restart, a failover) covers it.
                log.warning("otel-lock: server checks skipped for Cluster master %s, unreachable: %s", address,
                            exc)
        return reports

    # -- operators -------------------------------------------------------------

    async def force_release(self, redis_key: str, name: str) -> tuple[bool, str]:
        """(released, the owner it had)."""
        owner = _text(await self.link.redis.hget(redis_key, "owner"))
        if owner == SHARED_OWNER:
            released = await self.call(force_release_shared, SHARED.keys(redis_key), [self.fence_ttl_ms], "release",
                                       name)
            return bool(released), owner
        released = await self.call(_scripts.force_release, lock_keys(redis_key), [self.fence_ttl_ms], "release", name)
        return bool(released), owner

    def held_pages(self, pattern: str, page: int) -> AsyncGenerator[list[LockInfo], None]:
        """The locks held, one SCAN batch at a time (`_listing.py`)."""
        return held_pages(self.link.redis, pattern, page)

    def figures(self) -> tuple[int, int]:
        return self.link.figures()

    async def aclose(self) -> None:
        await self.waiting.aclose()
        await self.link.aclose()


def _text(value: bytes | str | None) -> str:
    return value.decode() if isinstance(value, bytes) else (value or "")
