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

The shapes beyond the mutex (`python -m benchmarks.safety --shape ...`) give
each hold a `mode`. Two `shared` holds of a key may overlap, and so may two
`permit` holds: neither pair is an overlap here. A `permit` hold is instead
counted against the key's limit (`permit_peak`, `permit_over`; and
`permit_over_untold`, not counting holders told their lease was lost,
which a stall past the lease may let in as it lets an exclusive overlap in). An
`exclusive` hold overlaps nobody, shared or exclusive. A `lock_all` hold is
one Hold per key, all with the hold's start and end.
"""

from __future__ import annotations

from bisect import bisect_right
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
    mode: str = "exclusive"  # exclusive, shared (lock(shared=True)) or permit (semaphore())

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


TOGETHER = ("shared", "permit")  # modes whose holds of one key may overlap each other


def may_share(a: Hold, b: Hold) -> bool:
    """Two shared holds, or two permits, may hold a key at once; anything beside an exclusive hold may not."""
    return a.mode == b.mode and a.mode in TOGETHER


def overlaps(holds: list[Hold]) -> list[Overlap]:
    """Every pair of holds of one key whose [start, end] intervals intersect and that may not (touching ends do not)."""
    found = []
    active: list[Hold] = []
    for hold in sorted(holds, key=lambda h: h.start):
        active = [h for h in active if h.end > hold.start]
        for other in active:
            if other.who != hold.who and other.key == hold.key and hold.end > hold.start \
                    and not may_share(other, hold):
                found.append(Overlap(*_granted_first(other, hold)))
        active.append(hold)
    return found


def shared_together(holds: list[Hold]) -> int:
    """Pairs of shared holds of one key that did overlap: proof that readers were let in together."""
    count = 0
    for group in _by_key([h for h in holds if h.mode == "shared"]):
        active: list[Hold] = []
        for hold in sorted(group, key=lambda h: h.start):
            active = [h for h in active if h.end > hold.start]
            count += sum(other.who != hold.who for other in active)
            active.append(hold)
    return count


def peak_holders(holds: list[Hold]) -> int:
    """The most permit holds of one key at one instant (the largest over the keys); 0 without permits.

    A worker records a hold from acquire's return to release's call, inside
    the hold Redis granted, so this never exceeds what Redis let in.
    """
    peak = 0
    for group in _by_key([h for h in holds if h.mode == "permit"]):
        # at one instant an end is counted before a start: touching holds are not together
        events = sorted([(h.start, 1) for h in group] + [(h.end, -1) for h in group])
        now = 0
        for _, step in events:
            now += step
            peak = max(peak, now)
    return peak


def _stale(hold: Hold) -> bool:
    """A holder told its lease was lost (a stall past the lease): Redis may have let another in meanwhile."""
    return hold.lost_at is not None or hold.release is False


def over_limit(holds: list[Hold], permits: int, stale_count: bool = True) -> int:
    """Permit holds that began while `permits` others of their key already held (each one too many).

    `stale_count=False`: holders told their lease was lost do not count among
    the others (as an overlap with a stale holder is told, not unsafe).
    """
    over = 0
    for group in _by_key([h for h in holds if h.mode == "permit"]):
        active: list[Hold] = []
        for hold in sorted(group, key=lambda h: h.start):
            active = [h for h in active if h.end > hold.start]
            if sum(stale_count or not _stale(h) for h in active) >= permits:
                over += 1
            active.append(hold)
    return over


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


class _Ended:
    """Holds by end time, with the largest token of those ended by any instant."""

    def __init__(self, holds: list[Hold]) -> None:
        ended = sorted(holds, key=lambda h: h.end)
        self.ends = [h.end for h in ended]
        self.best: list[int] = []
        for h in ended:
            self.best.append(h.token if not self.best else max(self.best[-1], h.token))

    def max_by(self, t: float) -> int | None:
        n = bisect_right(self.ends, t)
        return self.best[n - 1] if n else None


def token_regressions(holds: list[Hold]) -> int:
    """Holds whose token is not larger than that of a hold of its key that ended before it was granted.

    "Before it was granted" is before it started, except between two holds
    that may hold the key together (two shared holds, two permits): one
    of those may have been granted first and read its reply late, after the
    other had come and gone, so there it is before it was *requested*.
    """
    if len({h.key for h in holds}) > 1:
        return sum(token_regressions(group) for group in _by_key(holds))
    fenced = [h for h in holds if h.token is not None]
    ended = {mode: _Ended([h for h in fenced if h.mode == mode]) for mode in {h.mode for h in fenced}}
    regressions = 0
    for hold in fenced:
        cuts = {mode: hold.start for mode in ended}
        if hold.mode in TOGETHER and hold.requested is not None:
            cuts[hold.mode] = min(hold.start, hold.requested)
        before = [t for t in (ended[mode].max_by(cut) for mode, cut in cuts.items()) if t is not None]
        if before and hold.token <= max(before):
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


def summarise(holds: list[Hold], permits: int | None = None) -> dict:
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
        "shared_together": shared_together(holds),
        "permit_peak": peak_holders(holds),
        "permit_over": over_limit(holds, permits) if permits else 0,
        "permit_over_untold": over_limit(holds, permits, stale_count=False) if permits else 0,
    }
