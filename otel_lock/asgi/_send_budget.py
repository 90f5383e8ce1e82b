"""`send` with a budget: a protected request may spend at most `send_timeout` blocked on a client that does not read.

A client that never reads its response would otherwise keep the lock held
for as long as its connection lives (the lock is let go when the route's
app returns, after its last `send`). Nearly every `send` returns at once
(the server's buffer takes the response), so a timer per send, as
`asyncio.timeout` arms, was most of what the bound cost: about 5% of a
FastAPI route's throughput. Instead one watch per event loop looks at the
sends in progress a few times per `send_timeout` (at least once a second)
and cancels the task of a send that has used up its request's budget; that
send raises `SendTimeout` (an `OSError`: the client went away, as far as
the app is concerned). A send is cut off between its budget and a quarter
of `send_timeout` later (at most 1 s later).
"""

from __future__ import annotations

import asyncio
import weakref

from ._types import Message, Send

CHECKS_PER_BUDGET = 4
MAX_CHECK_INTERVAL = 1.0


class SendTimeout(OSError):
    """The client did not take the response within send_timeout: treated like a client that went away."""


class BoundedSend:
    """The request's `send`; the time spent blocked in it counts against `budget` (seconds)."""

    __slots__ = ("send", "left", "since", "task", "cancelling", "expired")

    def __init__(self, send: Send, budget: float) -> None:
        self.send, self.left = send, budget
        self.since = 0.0
        self.task: asyncio.Task[object] | None = None
        self.cancelling = 0
        self.expired = False

    async def __call__(self, message: Message) -> None:
        if self.left <= 0.0:   # used up by earlier sends
            raise SendTimeout("the client did not read the response within send_timeout")
        loop = asyncio.get_running_loop()
        watch = _watch_of(loop, self.left)
        task = self.task = asyncio.current_task()
        if task is not None:
            self.cancelling = task.cancelling()
        self.since = began = loop.time()
        watch.sending.add(self)
        if watch.timer is None:
            watch.arm()
        try:
            await self.send(message)
        except asyncio.CancelledError:
            if self.expired and task is not None and task.uncancel() <= self.cancelling:
                self.left = 0.0
                raise SendTimeout("the client did not read the response within send_timeout") from None
            raise
        finally:
            watch.sending.discard(self)
        self.left -= loop.time() - began


class _Watch:
    """The sends in progress on one loop, looked at every `interval` seconds while there are any."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.sending: set[BoundedSend] = set()
        self.interval = MAX_CHECK_INTERVAL
        self.timer: asyncio.TimerHandle | None = None

    def arm(self) -> None:
        self.timer = self.loop.call_later(self.interval, self._check)

    def _check(self) -> None:
        self.timer = None
        now = self.loop.time()
        for send in list(self.sending):
            if not send.expired and send.task is not None and now - send.since >= send.left:
                send.expired = True
                send.task.cancel()
        if self.sending:
            self.arm()


_WATCHES: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Watch] = weakref.WeakKeyDictionary()


def _watch_of(loop: asyncio.AbstractEventLoop, budget: float) -> _Watch:
    watch = _WATCHES.get(loop)
    if watch is None:
        watch = _WATCHES[loop] = _Watch(loop)
    # the shortest budget seen sets how often sends are looked at
    interval = min(MAX_CHECK_INTERVAL, max(budget, 0.001) / CHECKS_PER_BUDGET)
    if interval < watch.interval:
        watch.interval = interval
    return watch
