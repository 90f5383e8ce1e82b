"""One timer per event loop for each kind of deadline that protected requests set by the thousand.

Every protected request bounds its body read (`body_idle_timeout`), each of
its sends (`send_timeout`) and starts a disconnect listener once its lock
wait lasts (`LISTEN_AFTER`). With an `asyncio.timeout` or a `call_later`
each, that is four timers made and cancelled per request (on uvloop, a libuv
handle each): 2% of the instructions of a `@locked` request, measured on
uvloop. These deadlines are almost never reached, and those of one kind
have one length, so they fall due about in the order they start. One timer
per loop and kind serves them all: it stays armed for the earliest pending
deadline when it was set, and a new deadline re-arms it only if it falls
due sooner. Starting and ending a deadline is a set insert and delete; when
the timer fires it looks at the (few) deadlines still pending.
"""

from __future__ import annotations

import asyncio
import math
import weakref
from types import TracebackType

_SLACK = 0.001   # seconds: a loop's timer may wake this much before the time it was set for

_clocks: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[float, Clock]] = weakref.WeakKeyDictionary()


class Deadline:
    """A deadline on the running loop's clock for deadlines of `length`: `fire()` runs when it is reached.

    Subclasses say what reaching it does, as a method: a callback stored on
    the deadline (a bound method of its owner) would make every request's
    deadline a reference cycle, left to the cyclic garbage collector.
    """

    __slots__ = ("clock", "when")

    def __init__(self, length: float) -> None:
        loop = asyncio.get_running_loop()
        clocks = _clocks.get(loop)
        if clocks is None:
            clocks = _clocks[loop] = {}
        clock = clocks.get(length)
        if clock is None:
            clock = clocks[length] = Clock(loop, length)
        self.clock: Clock = clock
        self.when = 0.0

    def start(self, seconds: float | None = None) -> None:
        """Due `seconds` from now (the clock's length if None); a pending one is moved."""
        self.clock.start(self, self.clock.length if seconds is None else seconds)

    def end(self) -> None:
        self.clock.pending.discard(self)

    def fire(self) -> None:
        raise NotImplementedError


class Clock:
    """The deadlines of one kind (named by their usual length) on one loop, and its one timer."""

    __slots__ = ("loop", "length", "pending", "armed")

    def __init__(self, loop: asyncio.AbstractEventLoop, length: float) -> None:
        # Neither the loop nor its timer handle is held (a proxy, no handle): `_clocks` holds loops
        # weakly, and a clock holding one would keep every loop that ever served a request (a test
        # client's, `asyncio.run`'s) alive, closed.
        self.loop: asyncio.AbstractEventLoop = weakref.proxy(loop)
        self.length = length
        self.pending: set[Deadline] = set()
        self.armed = math.inf   # when the timer fires; inf: no timer

    def start(self, deadline: Deadline, seconds: float) -> None:
        deadline.when = when = self.loop.time() + seconds
        self.pending.add(deadline)
        if when < self.armed:
            self._arm(when)

    def _arm(self, when: float) -> None:
        # A timer armed for later is not cancelled (that would need its handle): it fires, sees it
        # was replaced, and does nothing.
        self.armed = when
        self.loop.call_at(when, self._due, when)

    def _due(self, when: float) -> None:
        if when != self.armed:
            return
        self.armed = math.inf
        now = self.loop.time() + _SLACK
        due = [d for d in self.pending if d.when <= now]
        self.pending.difference_update(due)
        if self.pending:   # armed before any fires: one that raises leaves the clock running
            self._arm(min(d.when for d in self.pending))
        for d in due:
            d.fire()


class TimeBound(Deadline):
    """`with TimeBound(length):` as `async with asyncio.timeout(length):`, on a shared clock.

    Reaching the deadline cancels the task; the CancelledError becomes
    TimeoutError at the exit unless somebody else cancelled the task too, as
    `asyncio.timeout` decides it. `seconds` (default `length`) is this use's
    own time when it differs from its kind's usual one (a budget partly spent);
    one bound may be entered again, with other `seconds`, until it is reached.
    """

    __slots__ = ("seconds", "task", "cancelling", "expired")

    def __init__(self, length: float, seconds: float | None = None) -> None:
        super().__init__(length)
        self.seconds = length if seconds is None else seconds
        self.task: asyncio.Task[object] | None = None
        self.cancelling = 0
        self.expired = False

    def restart(self) -> None:
        """The whole time again from now (an idle timeout, after each piece of progress)."""
        if not self.expired:
            self.start(self.seconds)

    def elapsed(self) -> float:
        """Seconds since the bound was last entered (or restarted)."""
        return self.clock.loop.time() - (self.when - self.seconds)

    def fire(self) -> None:
        assert self.task is not None
        self.expired = True
        self.task.cancel()

    def __enter__(self) -> TimeBound:
        task = asyncio.current_task()
        if task is None:
            raise RuntimeError("TimeBound must be used inside a task")
        self.task, self.cancelling = task, task.cancelling()
        self.start(self.seconds)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.end()
        if self.expired:
            assert self.task is not None
            if self.task.uncancel() <= self.cancelling and exc_type is asyncio.CancelledError:
                raise TimeoutError from exc
