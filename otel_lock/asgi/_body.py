"""The request body, read before any lock; then the client as the app sees it.

`read_body` receives the whole body, bounded in size (`max_body`) and in
idle time (`body_idle_timeout`, restarted by every chunk that arrives), so a
client that never sends its body holds no lock. `Client` replays those bytes
to the app and, while the request waits for its lock, listens for the one
message a server can still send, `http.disconnect`: a client that hung up
stops the wait (`cancel_on_disconnect`), so it takes no lock and its
handler never runs.
"""

from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass
from types import TracebackType

from ._deadlines import Deadline, TimeBound
from ._types import Message, Receive, Scope

_DIGITS = re.compile(rb"[0-9]{1,18}")   # ASCII only: '²'.isdigit() is True, int('²') raises


@dataclass(frozen=True)
class BodyLimits:
    """Per route: `locked(max_body=, body_idle_timeout=)`, else the middleware's."""

    max_body: int
    idle_timeout: float


class BodyRefused(Exception):
    """The body cannot be taken: answered with this problem, before any lock."""

    def __init__(self, status: int, type_name: str, detail: str, close: bool = True) -> None:
        super().__init__(detail)
        self.status, self.type_name, self.detail, self.close = status, type_name, detail, close


class ClientGone(Exception):
    """The client disconnected before the handler was entered: nothing to lock, nothing to answer."""


async def read_body(scope: Scope, receive: Receive, limits: BodyLimits) -> bytes:
    """The whole body; raises BodyRefused (400, 408, 413) or ClientGone."""
    declared = _header(scope, b"content-length")
    if declared is not None:
        if not _DIGITS.fullmatch(declared):
            raise BodyRefused(400, "invalid-content-length", "Content-Length must be a number of bytes (ASCII digits)",
                              close=False)
        if int(declared) > limits.max_body:
            raise _too_large(limits)
    chunks: list[bytes] = []
    size = 0
    try:
        with TimeBound(limits.idle_timeout) as idle:
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    raise ClientGone()
                chunk = message.get("body", b"")
                size += len(chunk)
                if size > limits.max_body:
                    raise _too_large(limits)
                chunks.append(chunk)
                if not message.get("more_body", False):
                    return b"".join(chunks)
                idle.restart()   # idle time, not the whole body's
    except TimeoutError:
        raise BodyRefused(408, "request-body-timeout",
                          f"no part of the request body arrived for {limits.idle_timeout:g} s") from None


def _too_large(limits: BodyLimits) -> BodyRefused:
    return BodyRefused(413, "request-too-large", f"the request body exceeds {limits.max_body} bytes")


class Client:
    """The receive side the app gets: the buffered body once, then whatever the server sends."""

    def __init__(self, body: bytes, receive: Receive) -> None:
        self.body = body
        self._receive = receive
        self._replayed = False
        self._heard: Message | None = None   # what the server sent while we waited for the lock

    async def receive(self) -> Message:
        if not self._replayed:
            self._replayed = True
            return {"type": "http.request", "body": self.body, "more_body": False}
        if self._heard is not None:
            message, self._heard = self._heard, None
            return message
        return await self._receive()  # disconnects still reach the app

    def cancel_on_disconnect(self) -> DisconnectWatch:
        """`async with client.cancel_on_disconnect():` around a wait; raises ClientGone if the client left."""
        return DisconnectWatch(self)

    async def _listen(self, watch: DisconnectWatch) -> None:
        message = await self._receive()
        self._heard = message   # the app gets it next, whatever it is
        if message["type"] == "http.disconnect":
            watch.client_left()


LISTEN_AFTER = 0.1  # seconds: a wait that ends sooner (an uncontended lock, even on a saturated loop) starts no listener


class DisconnectWatch(Deadline):
    """Cancels the current task if the client disconnects while the body of the `async with` runs.

    The body has been read, so the server's next message can only be a
    disconnect. The cancellation is ours only while we wait: the moment the
    wait ends (a lock granted) the listener is stopped before anything else
    runs, and a disconnect heard later is replayed to the app. The listener
    (a task) starts only once the wait has lasted LISTEN_AFTER: most waits
    end sooner, and a disconnect that came before it starts is heard as it
    starts.
    """

    def __init__(self, client: Client) -> None:
        super().__init__(LISTEN_AFTER)   # reached: the listener starts (`fire`)
        self.client = client
        self.task: asyncio.Task[object] | None = None
        self.listener: asyncio.Task[None] | None = None
        self.waiting = False
        self.fired = False

    def client_left(self) -> None:
        if self.waiting and self.task is not None:
            self.fired = True
            self.task.cancel()

    async def __aenter__(self) -> None:
        heard = self.client._heard
        if heard is not None and heard["type"] == "http.disconnect":
            raise ClientGone()
        self.task = asyncio.current_task()
        self.waiting = True
        self.start()

    def fire(self) -> None:
        if self.waiting:
            self.listener = asyncio.ensure_future(self.client._listen(self))

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        self.waiting = False   # before any await: from here on a disconnect cancels nothing
        self.end()
        listener = self.listener
        if listener is not None and not listener.done():
            listener.cancel()
            await asyncio.gather(listener, return_exceptions=True)
        if self.fired and exc_type is not None and issubclass(exc_type, asyncio.CancelledError):
            assert self.task is not None
            if self.task.uncancel() == 0:
                raise ClientGone() from exc   # our cancellation, not the server's (shutdown): swallow it


def _header(scope: Scope, name: bytes) -> bytes | None:
    headers: list[tuple[bytes, bytes]] = scope.get("headers", [])
    for key, value in headers:
        if key.lower() == name:
            return value.strip()
    return None
