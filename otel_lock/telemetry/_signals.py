"""SIGTERM and SIGINT flush the telemetry before the process exits.

The SDK flushes from an `atexit` hook, which a process killed by a signal's
default action never runs: uvicorn (>= 0.29) handles SIGTERM, shuts the app
down gracefully, then restores the handler it found and raises the signal
again, and with the default action in place that kills the process on the
spot, with the last batch of spans and the last metrics still in memory.

So `setup()` installs a handler in the main thread that stands in for the
default action: it runs `shutdown()` (on a thread of its own, bounded), puts
the default back and raises the signal again, so the process still dies of
it (the exit status supervisors expect). A handler someone else installed
before `setup()` (gunicorn's, an app's, Python's KeyboardInterrupt for
SIGINT) is called instead: that path unwinds normally and the `atexit` hook
flushes. An ignored signal stays ignored. Servers that install their own
handler later (uvicorn while it serves) hand the signal back to this one
when they are done.
"""

from __future__ import annotations

import atexit
import logging
import signal
import threading
from types import FrameType
from typing import Any, Callable

log = logging.getLogger("otel_lock.telemetry")

SIGNALS = (signal.SIGTERM, signal.SIGINT)
FLUSH_BOUND = 15.0  # seconds; TelemetrySetup.shutdown() bounds itself to 10 s
_previous: dict[int, Any] = {}
_at_exit: list[Callable[[], bool]] = []


def install(shutdown: Callable[[], bool], signals: bool = True) -> None:
    """Flush with `shutdown()` at exit, and (`signals`) before a SIGTERM or SIGINT would end the process."""
    atexit.register(shutdown)
    _at_exit.append(shutdown)
    if not signals:
        return
    if threading.current_thread() is not threading.main_thread():
        log.debug("otel-lock: setup() outside the main thread: telemetry is flushed at exit only")
        return
    for signum in SIGNALS:
        previous = signal.getsignal(signum)
        if previous is signal.SIG_IGN or signum in _previous:
            continue
        _previous[signum] = previous
        signal.signal(signum, _handler(shutdown, previous))


def _handler(shutdown: Callable[[], bool], previous: Any) -> Callable[[int, FrameType | None], None]:
    def on_signal(signum: int, frame: FrameType | None) -> None:
        if callable(previous):
            # Someone else's handler, or KeyboardInterrupt for SIGINT: it decides how
            # the process ends, and a normal exit runs the atexit hook.
            previous(signum, frame)
            return
        # The default action would end the process now: flush first. On a thread of its own,
        # bounded: the signal may have interrupted this thread inside a lock the flush needs
        # (a record's), and a SIGTERM must never hang the process.
        flusher = threading.Thread(target=shutdown, name="otel-lock flush on signal", daemon=True)
        flusher.start()
        flusher.join(FLUSH_BOUND)
        signal.signal(signum, signal.SIG_DFL)
        signal.raise_signal(signum)
    return on_signal


def restore() -> None:
    """Put back the handlers `install` replaced and drop its exit hook (tests reset `setup()`)."""
    if threading.current_thread() is threading.main_thread():
        for signum, previous in _previous.items():
            signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
    _previous.clear()
    for shutdown in _at_exit:
        atexit.unregister(shutdown)
    _at_exit.clear()
