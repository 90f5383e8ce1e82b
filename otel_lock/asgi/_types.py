"""Tiny ASGI type aliases and the one question both wrappers of `send` ask."""

from __future__ import annotations

from typing import Any, Awaitable, Callable, MutableMapping

# The shapes Starlette declares too, so its apps and middleware factories fit these.
Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


class ResponseEnd:
    """Tells, message by message, when the response is completely handed to the server.

    The end is the last body message, or the path sent by the `pathsend`
    extension, or the last trailers message when the start announced trailers.
    """

    __slots__ = ("trailers", "done")

    def __init__(self) -> None:
        self.trailers = False
        self.done = False

    def is_last(self, message: Message) -> bool:
        kind = message["type"]
        if kind == "http.response.start":
            self.trailers = bool(message.get("trailers", False))
            return False
        if kind in ("http.response.body", "http.response.zerocopysend"):
            last = not message.get("more_body", False) and not self.trailers
        elif kind == "http.response.pathsend":
            last = not self.trailers
        elif kind == "http.response.trailers":
            last = not message.get("more_trailers", False)
        else:
            return False
        if last and not self.done:
            self.done = True
            return True
        return False
