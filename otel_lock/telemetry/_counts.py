"""What each lock manager holds, waits for and keeps open, read only when a reader collects.

The core updates plain counters and dicts on its event loop; readers (the
SDK's periodic exporter thread, a /metrics scrape) sum them at collection
time. Taking a lock therefore pays a dict update, never a metric record.
"""

from __future__ import annotations

import time
import weakref
from collections import Counter
from typing import TYPE_CHECKING, Callable, Iterable, Iterator, Protocol, TypeVar

from ._bounds import OVERFLOW, Limits, configured_limit

if TYPE_CHECKING:
    from opentelemetry.metrics import MeterProvider

_V = TypeVar("_V")

# Every manager's counts, whatever its meter provider; readers filter.
ALL_COUNTS: "weakref.WeakSet[LockCounts]" = weakref.WeakSet()


class Hold(Protocol):
    """What `hold_started` / `hold_ended` read of a hold (the core's `Lease`)."""

    @property
    def name(self) -> str: ...
    @property
    def acquired_at(self) -> float: ...
    @property
    def lease_seconds(self) -> float: ...


class Seeds(Protocol):
    """Where first sights go (`Telemetry`): series created at 0 before their first event (`_names`)."""

    def seed_manager(self) -> None: ...
    def seed_name(self, name: str) -> None: ...
    def seed_pool(self, pool: str) -> None: ...


class LockCounts:
    """One manager's held and waiting callers, current holds and Redis connections.

    `active` / `pending`: Counters by lock name, updated by the core.
    `hold_started(hold)` / `hold_ended(hold)`: `hold` has `.name`,
    `.acquired_at` (event-loop time, i.e. `time.monotonic()` seconds) and
    `.lease_seconds`; they feed `otel_lock.hold.age` and `otel_lock.lease`.
    `connections(used, pending)` or `watch_connections(fn)`: the Redis gauges.
    `watch_circuit(fn)`: the circuit breaker's state (0 closed, 1 open, 2 half-open).
    `seed_with(telemetry)`: its series start at 0 (the manager's when tied,
    a lock name's when first held or waited for, the pool's with its circuit).
    """

    def __init__(self, meter_provider: MeterProvider | None = None) -> None:
        self.meter_provider = meter_provider
        self.active: _Tally = _Tally()
        self.pending: _Tally = _Tally()
        self.permits_used: _Tally = _Tally()       # permits held now, by semaphore name
        self.permit_limits: dict[str, int] = {}    # the limit each semaphore name was last held with
        self._holds: dict[str, dict[int, Hold]] = {}
        self._connections: tuple[int, int] | None = None
        self._connection_source: Callable[[], tuple[int, int]] | None = None
        self._circuit_source: Callable[[], int] | None = None
        self.pool_name: str = "otel-lock"
        self.seeds: Seeds | None = None
        ALL_COUNTS.add(self)

    def seed_with(self, seeds: Seeds) -> None:
        """Tie this manager's first sights to `seeds` (its telemetry), and seed the manager's series now."""
        self.seeds = seeds
        self.active.on_new = self.pending.on_new = seeds.seed_name
        self.seed_again()

    def seed_again(self) -> None:
        """Seed every series this manager has seen (again: its telemetry was routed to a new destination)."""
        seeds = self.seeds
        if seeds is None:
            return
        seeds.seed_manager()
        try:
            names = set(self.active) | set(self.pending)
        except RuntimeError:  # changed by the loop thread meanwhile; its next first sight seeds it
            names = set()
        for name in names:
            seeds.seed_name(name)
        if self._circuit_source is not None:
            seeds.seed_pool(self.pool_name)

    def expect(self, name: str) -> None:
        """Lock `name` will be used (a route's, known at start-up): its series exist at 0 from now.

        A name first seen at its first hold is seeded then, and a scrape that
        comes after that hold's loss reads the series born at 1: `increase()`
        sees nothing. Names known in advance never have that gap.
        """
        if name not in self.active:
            self.active[name] += 0

    # -- holds ---------------------------------------------------------------

    def hold_started(self, hold: Hold) -> None:
        holds = self._holds.get(hold.name)
        if holds is None:  # not setdefault: it would make a dict on every acquisition
            holds = self._holds[hold.name] = {}
        holds[id(hold)] = hold

    def hold_ended(self, hold: Hold) -> None:
        holds = self._holds.get(hold.name)
        if holds is not None and holds.pop(id(hold), None) is not None and not holds:
            del self._holds[hold.name]

    def permit_taken(self, name: str, limit: int) -> None:
        self.permit_limits[name] = limit
        self.permits_used[name] += 1

    def permit_returned(self, name: str) -> None:
        self.permits_used[name] -= 1

    def oldest_holds(self) -> Iterator[tuple[str, float, float]]:
        """(lock name, age of its oldest hold, that hold's lease), ages against time.monotonic()."""
        now = time.monotonic()
        for name, holds in list(self._holds.items()):
            try:
                oldest = min(list(holds.values()), key=_acquired_at)
            except ValueError:  # emptied by the loop thread meanwhile
                continue
            yield name, max(0.0, now - oldest.acquired_at), float(oldest.lease_seconds)

    # -- Redis connections ---------------------------------------------------

    def connections(self, used: int, pending: int) -> None:
        """Push the connection figures: open connections in use, commands awaiting a reply."""
        self._connections = (int(used), int(pending))

    def watch_connections(self, source: Callable[[], tuple[int, int]], pool_name: str | None = None) -> None:
        """Pull instead: `source()` returns (used, pending) when a reader collects.

        It runs on the reader's thread (the OTLP exporter's, or the /metrics
        request's), so it must only read a few attributes: no I/O, no locks.
        """
        self._connection_source = source
        if pool_name:
            self.pool_name = pool_name

    def connection_figures(self) -> tuple[int, int] | None:
        if self._connection_source is not None:
            try:
                used, pending = self._connection_source()
                return int(used), int(pending)
            except Exception:  # a collection must never fail because of one manager
                return None
        return self._connections

    # -- server checks -------------------------------------------------------

    def watch_servers(self, source: Callable[[], dict[str, int]]) -> None:
        """`source()` returns {server address: 0 usable, 1 warnings, 2 refused} when a reader collects."""
        self._server_source = source

    def server_verdicts(self) -> dict[str, int]:
        source = getattr(self, "_server_source", None)
        try:
            return dict(source()) if source is not None else {}
        except Exception:  # a collection must never fail because of one manager
            return {}

    # -- circuit breaker -----------------------------------------------------

    def watch_circuit(self, source: Callable[[], int], pool_name: str | None = None) -> None:
        """`source()` returns the breaker's state when a reader collects (on the reader's thread)."""
        self._circuit_source = source
        if pool_name:
            self.pool_name = pool_name
        if self.seeds is not None:
            self.seeds.seed_pool(self.pool_name)

    def circuit_state(self) -> int | None:
        if self._circuit_source is None:
            return None
        try:
            return int(self._circuit_source())
        except Exception:  # a collection must never fail because of one manager
            return None


class _Tally(Counter[str]):
    """A count per lock name that forgets names at 0 once it knows more than the name limit.

    Zeros are kept below the limit (a series going to 0 is news); past it, a
    manager fed ids as names would otherwise keep one entry per id forever.
    Updated on the manager's event loop only. `on_new(name)` is told of a
    name it does not hold yet (its series are seeded at 0).
    """

    _limit = configured_limit()
    on_new: Callable[[str], None] | None = None

    def __setitem__(self, name: str, value: int) -> None:
        if value == 0 and len(self) > self._limit:
            self.pop(name, None)
            return
        if self.on_new is not None and name not in self:
            try:
                self.on_new(name)
            except Exception:  # seeding must never fail a lock call
                pass
        super().__setitem__(name, value)


def _acquired_at(hold: Hold) -> float:
    return hold.acquired_at


def totals(counts: Iterable[LockCounts], which: str) -> dict[str, int]:
    """Sum `active` or `pending` over managers, by lock name (zeros kept: a series going to 0 is news)."""
    total: Counter[str] = Counter()
    for one in counts:
        total.update(dict(getattr(one, which)))  # a copy: the loop thread keeps counting
    return dict(total)


def oldest(counts: Iterable[LockCounts]) -> dict[str, tuple[float, float]]:
    """Per lock name over managers: (age of the oldest hold, its lease)."""
    best: dict[str, tuple[float, float]] = {}
    for one in counts:
        for name, age, lease in one.oldest_holds():
            if name not in best or age > best[name][0]:
                best[name] = (age, lease)
    return best


def connections(counts: Iterable[LockCounts]) -> dict[str, tuple[int, int]]:
    """Per pool name: (connections in use, pending requests)."""
    out: dict[str, tuple[int, int]] = {}
    for one in counts:
        figures = one.connection_figures()
        if figures is not None:
            used, pending = out.get(one.pool_name, (0, 0))
            out[one.pool_name] = (used + figures[0], pending + figures[1])
    return out


# Several managers under one pool name: the worst circuit wins (open, then half-open, then closed).
_SEVERITY = {0: 0, 2: 1, 1: 2}


def circuits(counts: Iterable[LockCounts]) -> dict[str, int]:
    """Per pool name: the circuit state of its managers."""
    out: dict[str, int] = {}
    for one in counts:
        state = one.circuit_state()
        if state is not None and _SEVERITY.get(state, 0) >= _SEVERITY.get(out.get(one.pool_name, 0), 0):
            out[one.pool_name] = state
    return out


# -- what the readers observe, with each attribute bounded ---------------------

Observation = tuple[dict[str, str], float]


def observe(which: str, counts: Iterable[LockCounts], limits: Limits) -> list[Observation]:
    """The points of one observed gauge of `_names.OBSERVED`, names past the limit folded into one."""
    if which in ("active", "pending"):
        by_name = _fold(totals(counts, which), limits, "lock.name", lambda a, b: a + b)
        return [({"lock.name": name}, value) for name, value in by_name.items()]
    if which == "permits_used":
        by_name = _fold(totals(counts, which), limits, "lock.name", lambda a, b: a + b)
        return [({"lock.name": name}, value) for name, value in by_name.items()]
    if which == "permits_limit":
        best: dict[str, int] = {}
        for one in counts:
            for name, limit in list(one.permit_limits.items()):
                best[name] = max(best.get(name, 0), limit)
        return [({"lock.name": name}, value) for name, value in _fold(best, limits, "lock.name", max).items()]
    if which in ("hold_age", "lease"):
        index = 0 if which == "hold_age" else 1
        oldest_by_name = _fold(oldest(counts), limits, "lock.name", max)
        return [({"lock.name": name}, ages[index]) for name, ages in oldest_by_name.items()]
    if which == "server_verdict":
        return _server_points(counts, limits)
    if which == "circuit_state":
        worst = _fold(circuits(counts), limits, "db.client.connection.pool.name",
                      lambda a, b: a if _SEVERITY.get(a, 0) >= _SEVERITY.get(b, 0) else b)
        return [({"db.client.connection.pool.name": pool}, state) for pool, state in worst.items()]
    figures = _fold(connections(counts), limits, "db.client.connection.pool.name",
                    lambda a, b: (a[0] + b[0], a[1] + b[1]))
    if which == "connections":
        return [({"db.client.connection.state": "used", "db.client.connection.pool.name": pool}, used)
                for pool, (used, _) in figures.items()]
    return [({"db.client.connection.pool.name": pool}, pending) for pool, (_, pending) in figures.items()]


def _server_points(counts: Iterable[LockCounts], limits: Limits) -> list[Observation]:
    """Per (pool name, server): the worst verdict of the managers that use it."""
    worst: dict[tuple[str, str], int] = {}
    for one in counts:
        pool = limits.admit("db.client.connection.pool.name", one.pool_name) or OVERFLOW
        for address, verdict in one.server_verdicts().items():
            key = (pool, limits.admit("server.address", address) or OVERFLOW)
            worst[key] = max(worst.get(key, 0), verdict)
    return [({"db.client.connection.pool.name": pool, "server.address": address}, verdict)
            for (pool, address), verdict in worst.items()]


def _fold(values: dict[str, _V], limits: Limits, attribute: str, merge: Callable[[_V, _V], _V]) -> dict[str, _V]:
    out: dict[str, _V] = {}
    for key, value in values.items():
        key = limits.admit(attribute, key) or OVERFLOW
        out[key] = merge(out[key], value) if key in out else value
    return out
