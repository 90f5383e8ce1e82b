"""Deadlock detection: a waiter whose wait would close a cycle of holders waiting on each other is refused.

Only a waiter that already holds locks can close a cycle, so only such a
waiter does anything, and only once its first request found the lock busy
and it has waited CHECK_AFTER (10 ms) without being handed the lock; it
asks while it goes on waiting. An uncontended acquire, a short wait, and a
waiter that holds nothing cost nothing.

Identity: owner ids are per acquisition, so what links the locks one task
holds to what it waits for is the record the task writes when it starts to
wait: one key `S:waits:<owner>` per lock it holds (in this manager, under
its own owner id), naming the lock it waits for, its waiter id and the task
(`task-name@pid/manager-id`, for the message). The wait-for graph is then
lock -> its owner (the lock's hash) -> the lock that owner waits for (its
record) -> ..., and a walk that comes back to one of the waiter's own
owners is a cycle. Shared holds and permits are followed too: an exclusive
wait on a shared hold is stuck if any shared holder is (and so is a shared
wait queued behind an exclusive waiter, which goes first), a permit wait only
if every permit holder is (one that leaves frees it), and a holder met again
on the walk is assumed stuck (the greatest fixpoint: a knot), while only a
path back to the caller's own holds is refused. A record whose waiter has left that lock's queue (it got
the lock, gave up) is no edge, so a record that outlives its wait by a
round trip (it is deleted in the background) never makes a cycle; its
expiry (the wait's budget) covers a process that died.

One Redis, Sentinel: the walk and the record are one script (`WAIT_FOR`),
atomic, so of two waiters that close one cycle at the same moment exactly
one is refused. Redis Cluster: the locks of a cycle live in other slots, so
the walk runs here, one step per round trip, after the record is written:
a cycle is never missed, but two waiters that close it at the same moment
may both be refused, and a walk is read across moments (it is read twice
before it refuses). Not on RedLock (its transport has no queue and no single
server to walk): waits there end at `wait` as before.

The blocking facade (`otel_lock.sync`) takes each lock in a task of its
own; it names the calling thread's holds in `THREAD_HOLDS`, so a thread is
one holder, as a task is.

Holds with an explicit `owner=` (shared by cooperating holders) and the
holds a task inherits from its spawner (`share_with_children`) are left out:
they do not say which task will release them.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from contextvars import ContextVar
from functools import partial
from typing import Any, Callable

from . import _scripts
from ._errors import LockDeadlock
from ._held import _HELD, _Holds
from ._options import NO_DEADLINE_ABOVE

log = logging.getLogger("otel_lock")

CHECK_AFTER = 0.01  # seconds a queued waiter waits before it asks: a shorter wait was no deadlock
MAX_STEPS = 64      # a longer chain is not followed further (no refusal)
INFINITE_TTL_MS = 3_600_000  # the record of a wait without deadline (the queue keeps its place as long)


class Probe:
    """What a waiter that holds locks brings to its wait: the owners of its holds in this manager, and who it is."""

    __slots__ = ("_owners", "_who", "namespace", "owners", "recorded")

    def __init__(self, owners: Callable[[], list[str]], who: Callable[[], str], namespace: str) -> None:
        self._owners, self._who = owners, who
        self.namespace: str = namespace
        self.owners: list[str] = []
        self.recorded: bool = False

    def own_owners(self) -> list[str]:
        """The owner ids of the locks the waiter holds in this manager (its own, not shared by `owner=`)."""
        return self._owners()

    def holder(self) -> str:
        return self._who()

    def record_key(self, owner: str) -> str:
        return f"{self.namespace}:waits:{owner}"


# The blocking facade takes each lock in a task of its own: it names the holds of the calling thread here.
THREAD_HOLDS: ContextVar[tuple[Callable[[], list[str]], str] | None] = ContextVar("otel_lock_thread_holds",
                                                                                 default=None)


def probe_for(manager_id: str, namespace: str) -> Probe | None:
    """A probe if the current task (or the facade's thread) holds locks; else None, after one or two looks."""
    view = _HELD.get()
    if view is not None and view.holds.task is asyncio.current_task() and view.holds.by_key:
        holds = view.holds
        return Probe(partial(_task_owners, holds, manager_id), partial(_label, holds, manager_id), namespace)
    thread = THREAD_HOLDS.get()
    if thread is not None:
        owners, name = thread
        return Probe(owners, partial(str, f"{name}@{os.getpid()}/{manager_id}"), namespace)
    return None


def _task_owners(holds: _Holds, manager_id: str) -> list[str]:
    return [lease.owner for (manager, _), lease in list(holds.by_key.items())
            if manager == manager_id and not lease.ended and not lease.explicit_owner]


def _label(holds: _Holds, manager_id: str) -> str:
    task = holds.task
    return f"{task.get_name() if task is not None else 'task'}@{os.getpid()}/{manager_id}"


def ttl_ms(wait_left: float) -> int:
    return INFINITE_TTL_MS if wait_left > NO_DEADLINE_ABOVE else max(1, int(wait_left * 1000)) + 1000


def refusal(want: str, cycle: tuple[tuple[str, str, str], ...]) -> LockDeadlock:
    steps = "; ".join(f"{key} is held by {holder}" + (f", which waits for {cycle[i + 1][0]}" if i + 1 < len(cycle)
                                                      else ", the caller")
                      for i, (key, _, holder) in enumerate(cycle))
    return LockDeadlock(f"waiting for {want} would close a deadlock: {steps}", key=want, cycle=cycle)


def _cycle(flat: list[Any]) -> tuple[tuple[str, str, str], ...]:
    text = [v.decode() if isinstance(v, bytes) else str(v) for v in flat]
    return tuple((text[i], text[i + 1], text[i + 2]) for i in range(0, len(text) - 2, 3))


HOW = {"exclusive": "x", "shared": "s", "permit": "p"}  # how a wait waits, in its record (`WAIT_FOR`)


async def check(transport: Any, probe: Probe, want: str, waiter_id: str, wait_left: float, queued: bool,
                name: str, mode: str = "exclusive") -> None:
    """Refuse (LockDeadlock) or record the wait. A check that fails (Redis down, a refused command) is skipped,
    with a warning: the wait goes on without it, as it would have before."""
    probe.owners = probe.own_owners()
    if not probe.owners:
        return
    from ._topology import ClusterLink

    how = HOW[mode]
    try:
        if isinstance(transport.link, ClusterLink):
            cycle = await _walk_stepwise(transport, probe, want, waiter_id, wait_left, queued, how)
        else:
            args = [probe.namespace, want, waiter_id, ttl_ms(wait_left), probe.holder(), "1" if queued else "0",
                    how, *probe.owners]
            answer = await transport.calls(transport.link.call(_scripts.wait_for, (), args), "deadlock_check",
                                           name, want)
            probe.recorded = answer[0] == 0
            cycle = () if probe.recorded else _cycle(answer[1:])
    except Exception as error:  # noqa: BLE001  the wait goes on without the check; it rides out Redis errors itself
        log.warning("otel-lock: deadlock check of %s skipped, waiting without it: %s", want, error)
        return
    if cycle:
        raise refusal(want, cycle)


async def over(transport: Any, probe: Probe, waiter_id: str, name: str) -> None:
    """The wait ended: delete its records (unless a later wait of the same owner replaced them)."""
    from ._topology import ClusterLink

    keys = tuple(probe.record_key(owner) for owner in probe.owners)
    calls = ([transport.link.call(_scripts.wait_over, (key,), [waiter_id]) for key in keys]
             if isinstance(transport.link, ClusterLink) else [transport.link.call(_scripts.wait_over, keys,
                                                                                  [waiter_id])])
    try:
        await asyncio.gather(*calls)
    except Exception as error:  # they expire with the wait's budget anyway
        log.debug("otel-lock: the wait records of %s stay until they expire: %s", waiter_id, error)


async def _walk_stepwise(transport: Any, probe: Probe, want: str, waiter_id: str, wait_left: float,
                         queued: bool, how: str) -> tuple[tuple[str, str, str], ...]:
    """Redis Cluster: record first, then walk one step per round trip, and read a cycle twice before refusing."""
    redis = transport.link.redis
    await transport.link.prepare()
    record = json.dumps([want, waiter_id, probe.holder(), 1 if queued else 0, how])
    await asyncio.gather(*(redis.set(probe.record_key(owner), record, px=ttl_ms(wait_left))
                           for owner in probe.owners))
    probe.recorded = True
    first = await _Walk(redis, probe).cycle(want, how, waiter_id)
    if not first or await _Walk(redis, probe).cycle(want, how, waiter_id) != first:
        return ()
    return first


Path = tuple[tuple[str, str, str], ...]


class _Walk:
    """`WAIT_FOR`'s walk, one read per round trip (the keys of a cycle live in other slots of a Cluster).

    A holder is stuck (a path back to the caller), stuck if the holders already on the walk are
    (True: they are assumed stuck, as the script does), or not (None).
    """

    def __init__(self, redis: Any, probe: Probe) -> None:
        self.redis, self.probe = redis, probe
        self.mine = set(probe.owners)
        self.walking: set[str] = set()
        self.steps = 0
        self.now_ms: int | None = None

    async def cycle(self, want: str, how: str, waiter: str) -> Path:
        found = await self._stuck(want, how, waiter)
        return found if isinstance(found, tuple) else ()

    async def _holders(self, key: str, how: str, waiter: str) -> tuple[list[str], bool]:
        """Who keeps a wait of kind `how` by `waiter` for `key` from ending, and whether all of them must be stuck."""
        if how == "p":
            held = await self._live(key)
            limit = int(_text(await self.redis.hget(key + ":t", "#limit")) or 0)
            return ([] if len(held) < limit else held), True
        owner = _text(await self.redis.hget(key, "owner"))
        if not owner:
            return [], False
        if owner != "(shared)":
            return [owner], False
        if how == "s" and not await self._exclusive_ahead(key, waiter):
            return [], False
        return await self._live(key + ":sh"), False

    async def _exclusive_ahead(self, key: str, waiter: str) -> bool:
        """Is an exclusive waiter queued ahead of `waiter` (of the 64 first; anywhere when it is not queued)?"""
        mine = await self.redis.zscore(key + ":q", waiter)
        ahead = (await self.redis.zrangebyscore(key + ":q", "-inf", f"({mine}", start=0, num=MAX_STEPS)
                 if mine is not None else await self.redis.zrange(key + ":q", 0, MAX_STEPS - 1))
        members = [_text(member) for member in ahead]
        ids = [member for member in members if not member.startswith("[")]  # model 1: entries in the hash
        entries = dict(zip(ids, await self.redis.hmget(key + ":w", ids))) if ids else {}
        for member in members:
            if member.startswith("["):
                mode = _mode(json.loads(member)[1:])
            else:
                entry = entries.get(member)
                mode = _mode(json.loads(entry)) if entry is not None else ""
            if mode == "x":
                return True
        return False

    async def _live(self, holders: str) -> list[str]:
        if self.now_ms is None:
            seconds, micros = await self.redis.time()
            self.now_ms = seconds * 1000 + micros // 1000
        return [_text(m) for m in await self.redis.zrangebyscore(holders, f"({self.now_ms}", "+inf")]

    async def _stuck(self, key: str, how: str, waiter: str) -> Path | bool | None:
        held, every = await self._holders(key, how, waiter)
        found: Path | bool | None = None
        for owner in held:
            through = await self._through(key, owner)
            if every and not through:
                return None
            if isinstance(through, tuple):
                if not every:
                    return through
                if not isinstance(found, tuple):
                    found = through
            elif through and not found:
                found = True
        return found

    async def _through(self, key: str, owner: str) -> Path | bool | None:
        if owner in self.mine:
            return ((key, owner, self.probe.holder()),)
        if owner in self.walking:
            return True
        self.steps += 1
        if self.steps > MAX_STEPS:
            return None
        raw = await self.redis.get(self.probe.record_key(owner))
        if raw is None:
            return None
        record = json.loads(raw)
        waits_for, waiter, holder, in_queue = record[:4]
        if in_queue and await self.redis.zscore(waits_for + ":q", waiter) is None:
            return None
        self.walking.add(owner)
        rest = await self._stuck(waits_for, record[4] if len(record) > 4 else "x", waiter)
        self.walking.discard(owner)
        return ((key, owner, holder), *rest) if isinstance(rest, tuple) else rest


def _mode(entry: list[Any]) -> str:
    """How a queued waiter waits, from its entry (a record without its id): the 7th element (shared, permit), else x."""
    return str(entry[6]) if len(entry) > 6 else "x"


def _text(value: bytes | str | None) -> str:
    return value.decode() if isinstance(value, bytes) else (value or "")
