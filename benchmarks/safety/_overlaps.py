"""The checker's arithmetic: which holds overlapped, and was each overlap told or fenced.

Everything here is a pure function of the records the workers sent, so it is
unit-tested on hand-made intervals (tests/test_safety_checker.py). Holds of
different keys (a Cluster run spreads its keys over nodes) never overlap:
every count below is taken per key and summed (or the largest taken).

For two holds that intersect, the *stale* holder is the one that was granted
first: the smaller fencing token when both have one (the token is minted in
Redis, so it orders grants even when a reply was read late), else the one that
started first. The overlap begins when the newer holder starts. It is

- **told** when the stale holder's `held.lost` had fired at or before that
  moment (its code could have stopped in time), and
- **fenced** when the stale holder's token is smaller than the newer one's (a
  resource that checks the token rejects the stale writer).

An overlap that is neither is the one that corrupts data: `untold & unfenced`.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Hold:
    """One acquisition as a worker recorded it; times are time.monotonic() (one clock for all processes)."""

    proc: int
    task: int
    start: float
    end: float
    token: int | None = None
    lost_at: float | None = None  # when the holder's task saw `held.lost` fire
    release: bool | str | None = None  # what release() returned (str: the error it raised)
    marks: list[tuple[float, bool]] = field(default_factory=list)  # (t, lost set?) after each await of the body
    stall: float = 0.0  # seconds the body blocked its loop right after acquiring
    requested: float | None = None  # when its acquire was called
    key: str = ""  # which contended key (one per run, except where the deployment spreads them)

    @property
    def who(self) -> tuple[int, int]:
        return self.proc, self.task


@dataclass
class Overlap:
    stale: Hold
    newer: Hold

    @property
    def begin(self) -> float:
        return max(self.newer.start, self.stale.start)

    @property
    def end(self) -> float:
        return min(self.stale.end, self.newer.end)

    @property
    def length(self) -> float:
        return self.end - self.begin

    @property
    def told(self) -> bool:
        return self.stale.lost_at is not None and self.stale.lost_at <= self.begin

    @property
    def fenced(self) -> bool:
        return (self.stale.token is not None and self.newer.token is not None
                and self.stale.token < self.newer.token)

    @property
    def unsafe(self) -> bool:
        return not (self.told or self.fenced)


def _granted_first(a: Hold, b: Hold) -> tuple[Hold, Hold]:
    if a.token is not None and b.token is not None and a.token != b.token:
        return (a, b) if a.token < b.token else (b, a)
    return (a, b) if (a.start, a.end) <= (b.start, b.end) else (b, a)


def overlaps(holds: list[Hold]) -> list[Overlap]:
    """Every pair of holds whose [start, end] intervals intersect (touching ends do not)."""
    found = []
    active: list[Hold] = []
    for hold in sorted(holds, key=lambda h: h.start):
        active = [h for h in active if h.end > hold.start]
        for other in active:
            if other.who != hold.who and other.key == hold.key and hold.end > hold.start:
                found.append(Overlap(*_granted_first(other, hold)))
        active.append(hold)
    return found


def told_by_next_await(overlap: Overlap) -> bool:
    """Did the stale holder learn of the loss at its first await that ended after the overlap began?

    That is the promise for a holder whose loop stalled past its lease: it
    cannot be told while blocked, but it must be told as soon as it runs again.
    A release() that reports False counts as telling too (it is an await).
    """
    if overlap.told:
        return True
    after = [lost for t, lost in overlap.stale.marks if t >= overlap.begin]
    if after:
        return after[0]
    return overlap.stale.release is False


def _by_key(holds: list[Hold]) -> list[list[Hold]]:
    keys: dict[str, list[Hold]] = {}
    for hold in holds:
        keys.setdefault(hold.key, []).append(hold)
    return list(keys.values())


def token_regressions(holds: list[Hold]) -> int:
    """Holds, in order of start, whose token is not larger than an earlier, non-overlapping hold's of its key."""
    if len({h.key for h in holds}) > 1:
        return sum(token_regressions(group) for group in _by_key(holds))
    regressions = 0
    done_max = None  # the largest token of holds that ended before this one started
    ended = sorted((h for h in holds if h.token is not None), key=lambda h: h.end)
    i = 0
    for hold in sorted((h for h in holds if h.token is not None), key=lambda h: h.start):
        while i < len(ended) and ended[i].end <= hold.start:
            done_max = ended[i].token if done_max is None else max(done_max, ended[i].token)
            i += 1
        if done_max is not None and hold.token <= done_max:
            regressions += 1
    return regressions


def handoffs(holds: list[Hold]) -> int:
    """Acquisitions that moved a lock to another caller (the first one of each key counts)."""
    if len({h.key for h in holds}) > 1:
        return sum(handoffs(group) for group in _by_key(holds))
    count, last = 0, None
    for hold in sorted(holds, key=lambda h: h.start):
        if hold.who != last:
            count += 1
            last = hold.who
    return count


def max_idle(holds: list[Hold]) -> float:
    """The longest time the lock sat free while the caller that took it next was already waiting.

    Dead or stopped waiters, grants nobody reads and slow wake-ups all show here.
    """
    if len({h.key for h in holds}) > 1:
        return max(max_idle(group) for group in _by_key(holds))
    longest, busy_until = 0.0, None
    for hold in sorted(holds, key=lambda h: h.start):
        if busy_until is not None and hold.start > busy_until and hold.requested is not None \
                and hold.requested <= busy_until:
            longest = max(longest, hold.start - busy_until)
        busy_until = hold.end if busy_until is None else max(busy_until, hold.end)
    return longest


def paused(intervals: list[tuple[float, float]], begin: float, end: float) -> float:
    """Seconds of [begin, end] covered by the (possibly overlapping) intervals."""
    total, reach = 0.0, begin
    for a, b in sorted(intervals):
        a, b = max(a, reach), min(b, end)
        if b > a:
            total += b - a
            reach = b
    return total


def wait_overrun(requested: float, returned: float, wait: float, pauses: list[tuple[float, float]]) -> float:
    """How far an acquire outlasted its `wait`, not counting time its own process was stopped or blocked."""
    return max(0.0, returned - requested - wait - paused(pauses, requested, returned))


def summarise(holds: list[Hold]) -> dict:
    found = overlaps(holds)
    stale = {}
    for o in found:
        stale.setdefault(id(o.stale), []).append(o)
    return {
        "holds": len(holds),
        "handoffs": handoffs(holds),
        "overlaps": len(found),
        "told": sum(o.told for o in found),
        "fenced": sum(o.fenced for o in found),
        "unsafe": sum(o.unsafe for o in found),
        "stale_holders": len(stale),
        # a stale holder is told in time if its first overlap (the earliest begin) was
        "stale_told_next": sum(told_by_next_await(min(os, key=lambda o: o.begin)) for os in stale.values()),
        "max_overlap": max((o.length for o in found), default=0.0),
        # the longest a stale holder ran on, untold, after its first overlap began (a forgotten or
        # evicted lock is told at the holder's next renewal: at most the renewal interval plus a round trip)
        "max_told_after": max((min(os, key=lambda o: o.begin).stale.lost_at - min(o.begin for o in os)
                               for os in stale.values() if os[0].stale.lost_at is not None), default=0.0),
        "max_idle": max_idle(holds),
        "token_regressions": token_regressions(holds),
    }
