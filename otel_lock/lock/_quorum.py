"""The RedLock quorum: one lock over N independent Redis masters, held by a majority of them.

A grant needs N//2+1 masters. Every master gets its ACQUIRE at once, each
bounded by `master_timeout`; then the masters that granted CONFIRM the
largest token among them (`_redlock_scripts.py`). The hold is valid for
`lease - elapsed - drift`, counted on the monotonic clock from the send
time of those requests. A failed round (no quorum, or no validity left) is
released on every master at once and retried after a jittered pause, until
`wait`. There is no queue and no pub/sub: waiters poll, at most every
`poll_cap` and never past the holder's remaining TTL; a manager that just
released a key others were polling for lets them go first.

One transport per process and event loop, like `_script_transport.ScriptTransport`:
the manager core above it is the same for every topology.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from dataclasses import dataclass, field
from typing import Any, AsyncGenerator, Callable

from redis.exceptions import AuthenticationError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from . import _redlock_scripts as scripts
from ._attempt import Acquisition, Reply, validity
from ._background import Background
from ._breaker import Breaker
from ._calls import batch_outcomes, record_batch
from ._errors import LockError, LockTimeout, RedisMisconfigured, RedisUnavailable
from ._held import Lease, LockInfo
from ._listing import describe, key_pages
from ._redlock_cleanup import Cleanup
from ._redlock_scripts import Masters
from ._scripts import SHARES_WITH, model_check
from ._server_checks import ServerReport, check_server
from ._transport import RedisClient, Send, Transport

log = logging.getLogger("otel_lock")

@dataclass
class Round:
    """What one acquire round found: the token if granted, else why not."""

    token: int = 0
    answered: int = 0                             # masters that answered (granted or busy)
    silent: list[int] = field(default_factory=list)  # masters that did not answer the ACQUIRE
    ttl: float = 0.0                              # smallest TTL seen on a busy master, seconds
    error: LockError | None = None


@dataclass
class _Unreachable:
    """A master that did not answer its server checks (skipped while a quorum did)."""

    error: BaseException


def lock_keys(redis_key: str) -> tuple[str, str]:
    return redis_key, redis_key + ":fence"


class QuorumTransport(Transport):
    """Locks held by a majority of `masters`, for one event loop."""

    def __init__(self, masters: Masters, breaker: Breaker, fence_ttl_ms: int, poll_cap: float,
                 next_owner: Callable[[], str], background: Background) -> None:
        self.masters = masters
        self.quorum = masters.quorum
        self.breaker = breaker
        self.fence_ttl_ms = fence_ttl_ms
        self.poll_cap = poll_cap
        self.next_owner = next_owner
        self._background = background
        self.cleanup = Cleanup(masters)
        # key -> loop time until which a new caller of this manager lets the pollers go first
        self._yield_until: dict[str, float] = {}

    @property
    def records(self) -> RedisClient:
        """The first master's client: the middleware's Idempotency-Key records need one store."""
        client: RedisClient = self.masters.clients[0]
        return client

    # -- taking ----------------------------------------------------------------

    async def take(self, request: Acquisition) -> Reply | None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + request.wait
        await self._let_others_first(request.keys[0], deadline)
        while True:
            # An owner per round: a failed round is undone by owner (in the background on a
            # master that did not answer), which must never release a later round's grant.
            owner = self.next_owner()
            sent_at = loop.time()
            found = await self._round(request, owner)
            request.attempts += 1
            self.breaker.record(found.answered >= self.quorum or not isinstance(found.error, RedisUnavailable))
            if found.token:
                return Reply(found.token, 1, sent_at, owner=owner)
            request.contended = request.contended or found.answered >= self.quorum
            if found.answered < self.quorum:
                assert found.error is not None
                raise found.error  # a majority is unreachable: fail fast, like one Redis
            now = loop.time()
            if request.wait == 0:
                return None
            if now >= deadline:
                raise LockTimeout(f"lock {request.keys[0]} not acquired within {request.wait} s",
                                  key=request.keys[0], waited=request.wait)
            pause = min(self.poll_cap, 0.005 * 2 ** min(request.attempts, 10))
            pause = random.uniform(pause / 2, pause)
            if found.ttl > 0:
                pause = min(pause, found.ttl + 0.001)
            await asyncio.sleep(min(pause, deadline - now))

    async def _let_others_first(self, redis_key: str, deadline: float) -> None:
        """This manager just released the key while others polled for it: give them one poll's head start.

        Without it, the releasing process takes the lock straight back (no queue
        holds its place for the waiters), and the waiters starve.
        """
        until = self._yield_until.get(redis_key)
        if until is None:
            return
        now = asyncio.get_running_loop().time()
        if until <= now:
            del self._yield_until[redis_key]
            return
        await asyncio.sleep(random.uniform(0.5, 1.0) * (min(until, deadline) - now))

    async def _round(self, request: Acquisition, owner: str) -> Round:
        """One acquire round on all masters; on failure every master is released before it returns."""
        loop = asyncio.get_running_loop()
        found = Round()
        sent_at = loop.time()
        keys = lock_keys(request.keys[0])
        work = asyncio.ensure_future(self._grant(keys, owner, request.lease_ms, request.name, found))
        try:
            granted = await asyncio.shield(work)
        except asyncio.CancelledError:
            # a late grant must not outlive the cancelled caller
            work.add_done_callback(lambda _: self.background(self._release_all(keys, owner, request)))
            raise
        if granted and sent_at + validity(request.lease_ms) - loop.time() > 0:
            return found
        found.token = 0
        # the masters that answered are released before the caller hears of the failure; the silent
        # ones (whose grant may still land) are asked in the background, so a dead master costs one
        # master_timeout per round, not two
        for index in found.silent:
            self.cleanup.add(index, keys[0], owner, request.name, request.lease_ms / 1000)
        answered = [i for i in range(len(self.masters.clients)) if i not in found.silent]
        cleanup = self.background(self._release_all(keys, owner, request, answered))
        await asyncio.shield(cleanup)  # a cancelled caller still releases everywhere
        return found

    async def _grant(self, keys: tuple[str, str], owner: str, lease_ms: int, name: str, found: Round) -> bool:
        """ACQUIRE everywhere, then CONFIRM the maximum token on the masters that granted."""
        answers = await self.masters.call(scripts.acquire, keys, [owner, lease_ms, self.fence_ttl_ms], "acquire",
                                          name)
        granted, ttls = [], []
        for i, answer in enumerate(answers):
            if isinstance(answer, LockError):
                found.error = answer
                found.silent.append(i)
                continue
            found.answered += 1
            if answer[0] == 1:
                granted.append((i, int(answer[1])))
            else:
                ttls.append(max(int(answer[1]), 0) / 1000)
        if ttls:  # the next poll comes no later than the first holder's key runs out
            found.ttl = min(ttls)
        if len(granted) < self.quorum:
            return False
        token = max(t for _, t in granted)
        confirmed = await self.masters.call(scripts.confirm, keys,
                                            [owner, lease_ms, self.fence_ttl_ms, str(token), "0"], "acquire", name,
                                            only=[i for i, _ in granted])
        if sum(1 for c in confirmed if c == 1) < self.quorum:
            return False
        found.token = token
        return True

    async def reenter(self, lease: Lease) -> int | None:
        """Nested holds are counted locally: the quorum's hold is one per owner."""
        return lease.depth

    # -- releasing ---------------------------------------------------------------

    async def release(self, lease: Lease, *, whole: bool) -> int:
        """0 when a quorum released it, -1 when it was no longer held by a quorum; RedisUnavailable if unknown."""
        keys = lock_keys(lease.key)
        answers = await self.masters.call(scripts.release, keys, [lease.owner], "release", lease.name)
        failed = [i for i, a in enumerate(answers) if isinstance(a, LockError)]
        for index in failed:
            self.cleanup.add(index, keys[0], lease.owner, lease.name, lease.lease_seconds)
        if any(a == 2 for a in answers):  # somebody polled for it meanwhile
            self._yield_until[keys[0]] = asyncio.get_running_loop().time() + self.poll_cap
            if len(self._yield_until) > 10_000:
                self._yield_until.clear()  # a bound, not a cache
        if sum(1 for a in answers if a in (1, 2)) >= self.quorum:
            return 0
        if len(answers) - len(failed) < self.quorum:
            raise RedisUnavailable(f"release of {keys[0]} reached only {len(answers) - len(failed)} of "
                                   f"{len(answers)} masters; the rest expire after the lease", key=keys[0])
        return -1

    def send_release(self, lease: Lease, *, whole: bool,
                     on_orphan: Callable[[Any], None] | None = None) -> asyncio.Future[Any] | None:
        """A quorum release is several calls: always `release()`."""
        return None

    def release_when_back(self, lease: Lease) -> None:
        """The masters that did not answer are already in the clean-up's hands."""

    def lost(self, lease: Lease) -> None:
        """A lost hold is released wherever it is still held, so it stops blocking the others."""
        self.background(self._release_all(lock_keys(lease.key), lease.owner, None, name=lease.name,
                                          lease=lease.lease_seconds))

    async def _release_all(self, keys: tuple[str, str], owner: str, request: Acquisition | None,
                           only: list[int] | None = None, *, name: str = "", lease: float = 0.0) -> None:
        if request is not None:
            name, lease = request.name, request.lease_ms / 1000
        which = list(range(len(self.masters.clients))) if only is None else only
        if not which:
            return
        answers = await self.masters.call(scripts.release, keys, [owner], "release", name, only=which)
        for index, answer in zip(which, answers):
            if isinstance(answer, LockError):
                self.cleanup.add(index, keys[0], owner, name, lease)

    # -- the watchdog's batch --------------------------------------------------------

    async def renew(self, leases: list[Lease]) -> list[bool | BaseException]:
        """One RENEW per master for the whole batch; a hold counts as renewed when a quorum confirmed it.

        A master that restarted empty is taken again, so renewals repair the
        quorum instead of slowly losing it. Lost: too many masters hold it for
        someone else to ever make a quorum again; else an error (retried).
        """
        keys = [k for lease in leases for k in lock_keys(lease.key)]
        args: list[Any] = [self.fence_ttl_ms]
        for lease in leases:
            args += [lease.owner, lease.renew_ms, str(lease.token)]
        began = time.perf_counter()
        answers = await self.masters.call(scripts.renew, keys, args, "renew", leases[0].name, record=False)
        out: list[bool | BaseException] = []
        for i, lease in enumerate(leases):
            ours = sum(1 for a in answers if not isinstance(a, LockError) and a[i] == 1)
            others = sum(1 for a in answers if not isinstance(a, LockError) and a[i] == 0)
            if ours >= self.quorum:
                out.append(True)
            elif others > len(answers) - self.quorum:
                out.append(False)
            else:
                out.append(RedisUnavailable(f"renewal of {lease.key} confirmed by {ours} of {len(answers)} masters",
                                            key=lease.key))
        record_batch(self.masters.calls[0].telemetry, batch_outcomes([l.name for l in leases], out),
                     time.perf_counter() - began)
        return out

    async def check_model(self, key: str, model: int, ttl: int, lock_key: str, name: str) -> int | None:
        """Claim the namespace on every master that answers; another model on any of them is refused."""
        answers = await self.masters.call(model_check, (key,), [model, ttl, *SHARES_WITH], "acquire", name)
        answered = [int(a) for a in answers if not isinstance(a, LockError)]
        if len(answered) < self.quorum:
            failed = [a for a in answers if isinstance(a, LockError)]
            raise self._no_quorum(len(answered), f"data model check of {key}", lock_key,
                                  next((a for a in failed if isinstance(a, RedisMisconfigured)), failed[0]))
        others = [a for a in answered if a != model]
        return others[0] if others else None

    async def servers(self) -> list[tuple[str, Send]]:
        """(address, send one command) for every master: the server watch's targets."""
        return [(calls.where, self.masters.run(i)) for i, calls in enumerate(self.masters.calls)]

    async def server_reports(self, namespace: str, require_noeviction: bool) -> list[ServerReport]:
        """The server checks of every master that answers; a minority down is skipped with a warning.

        A master down at the first use must not refuse locks a quorum can
        grant (as a Cluster master's keys fail on their own): it is used
        again as soon as it answers, and checked at the next process's first use.
        """
        found = await asyncio.gather(*(self._report(i, namespace, require_noeviction)
                                       for i in range(len(self.masters.clients))), return_exceptions=True)
        for outcome in found:
            if isinstance(outcome, BaseException):
                raise outcome  # a refusal (ACL, credentials...) is an answer, not an absence
        reports = [r for r in found if isinstance(r, ServerReport)]
        if len(reports) < self.quorum:
            skipped = next(r for r in found if isinstance(r, _Unreachable))
            raise self._no_quorum(len(reports), "server checks", None, skipped.error)
        return reports

    async def _report(self, index: int, namespace: str, require_noeviction: bool) -> ServerReport | _Unreachable:
        calls = self.masters.calls[index]
        try:
            # a stopped master must not hold the first use for ever (a client may have no socket timeout)
            async with asyncio.timeout(max(2.0, 10 * self.masters.timeout)):
                return await check_server(self.masters.run(index), namespace=namespace,
                                          cluster=False, require_noeviction=require_noeviction, address=calls.where)
        except AuthenticationError:
            raise
        except (OSError, RedisConnectionError, RedisTimeoutError) as exc:
            log.warning("otel-lock: server checks skipped for RedLock master %s, unreachable: %s (a quorum of the "
                        "others grants locks; it is used again once it answers)", calls.where, exc)
            return _Unreachable(exc)

    def _no_quorum(self, answered: int, what: str, key: str | None, cause: BaseException) -> LockError:
        """RedisUnavailable; RedisMisconfigured when a master refused this client (no retry fixes that)."""
        count = len(self.masters.clients)
        detail = str(cause).strip().splitlines()[0] if str(cause).strip() else type(cause).__name__
        message = (f"only {answered} of {count} masters answered ({what}): RedLock needs a quorum of {self.quorum} "
                   f"to grant any lock; {detail}")
        if isinstance(cause, RedisMisconfigured):  # a certificate, a password, an ACL
            return RedisMisconfigured(message, key=key)
        return RedisUnavailable(message, key=key)

    def poll_instead(self, why: str | None) -> None:
        """RedLock waiters always poll."""

    # -- operators ---------------------------------------------------------------------

    async def force_release(self, redis_key: str, name: str) -> tuple[bool, str]:
        """(released on any master, "": owners differ per round and master)."""
        answers = await self.masters.call(scripts.force_release, (redis_key,), [], "release", name)
        return any(a == 1 for a in answers), ""

    async def held_pages(self, pattern: str, page: int) -> AsyncGenerator[list[LockInfo], None]:
        """Locks whose owner holds them on a quorum of the masters that answer, a SCAN batch at a time.

        Each master is scanned in turn; a page of its keys is looked up on
        every master at once (one pipeline each). A key is listed by the
        first answering master that has it, with the smallest TTL of the
        quorum, so a lock held everywhere is listed once.
        """
        clients = self.masters.clients
        bound = max(2.0, 10 * self.masters.timeout)  # a stopped master must not stop the listing for ever
        down: set[int] = set()

        async def look(i: int, keys: list[str]) -> dict[str, LockInfo]:
            if i in down:
                raise RedisUnavailable(f"master {self.masters.calls[i].where} did not answer the listing")
            async with asyncio.timeout(bound):
                return await describe(clients[i], keys)

        for index, client in enumerate(clients):
            if index in down:
                continue
            pages = key_pages(client, pattern, page)
            try:
                while True:
                    async with asyncio.timeout(bound):
                        keys = await anext(pages, None)
                    if keys is None:
                        break
                    views = await asyncio.gather(*(look(i, keys) for i in range(len(clients))),
                                                 return_exceptions=True)
                    down |= {i for i, view in enumerate(views) if isinstance(view, BaseException)}
                    held = [info for key in keys
                            if (info := self._quorum_view(key, index, views, down)) is not None]
                    if held:
                        yield held
            except (OSError, RedisError, LockError):
                down.add(index)  # its keys are still found on the others, if a quorum holds them
            finally:
                await pages.aclose()

    def _quorum_view(self, key: str, index: int, views: list[Any], down: set[int]) -> LockInfo | None:
        """The lock `key` as a quorum holds it, if master `index` is the first answering one that has it."""
        infos = [(i, view[key]) for i, view in enumerate(views)
                 if i not in down and not isinstance(view, BaseException) and key in view]
        if not infos or infos[0][0] != index:
            return None  # listed from an earlier master (or not held anywhere that answers)
        by_owner: dict[str, list[LockInfo]] = {}
        for _, info in infos:
            by_owner.setdefault(info.owner, []).append(info)
        owner_infos = max(by_owner.values(), key=len)
        return min(owner_infos, key=lambda info: info.ttl) if len(owner_infos) >= self.quorum else None

    def figures(self) -> tuple[int, int]:
        return self.masters.figures()

    async def aclose(self) -> None:
        self.cleanup.aclose()
        await self.masters.aclose()
