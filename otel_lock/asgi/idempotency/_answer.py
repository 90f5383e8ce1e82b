"""What the handler answered, whether a retry gets it back, and the replay itself.

An answer is stored only if it is final. One that asks the client to come
back (any `Retry-After`, 408, 409, 425, 429, 502, 503, 504) or that rejects
the caller's credentials (401, 403) says nothing about the operation, so
storing it would turn a temporary "not now" into a permanent one: the key is
freed instead and the retry runs the handler. A handler that raised, or an
other 5xx, leaves the effects unknown (see docs/idempotency.md).

A replay is framed the way RFC 9110 frames the status: no content and no
Content-Length on 1xx, 204 and 304 (8.6, 15.3.5, 15.4.5), an empty 205, and
a HEAD without content; only allow-listed headers are ever sent back.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass
from typing import Any

from .._types import Message

# Replayed as stored; everything else (Set-Cookie, Authorization, hop-by-hop,
# Content-Length, which is recomputed) is dropped.
STORED_HEADERS = frozenset({
    "content-type", "content-encoding", "content-language", "content-location", "location", "etag",
    "last-modified", "link", "cache-control", "expires", "vary",
})
RETRY_STATUSES = frozenset({408, 409, 425, 429, 502, 503, 504})
AUTH_STATUSES = frozenset({401, 403})
_NO_CONTENT = frozenset({204, 304})

# Verdicts of a finished answer.
STORE, FREE, UNKNOWN = "store", "free", "unknown"


def verdict(status: int, retry_after: bool) -> str:
    """STORE a final answer, FREE the key after a temporary one, UNKNOWN after a server failure."""
    if retry_after or status in RETRY_STATUSES or status in AUTH_STATUSES:
        return FREE
    return UNKNOWN if status >= 500 else STORE


@dataclass
class Capture:
    """What the handler sent, kept only while it stays replayable."""

    max_stored_response: int
    status: int = 0
    headers: list[list[str]] | None = None
    retry_after: bool = False
    chunks: list[bytes] | None = None
    size: int = 0
    messages: int = 0
    finished: bool = False     # the final body message went out
    stored: bool = False       # ... and was stored for replay

    def start(self, message: Message) -> None:
        self.status = message["status"]
        self.headers = []
        for raw_name, raw_value in message.get("headers", []):
            name = raw_name.decode("latin-1").lower()
            self.retry_after = self.retry_after or name == "retry-after"
            if name in STORED_HEADERS:
                self.headers.append([raw_name.decode("latin-1"), raw_value.decode("latin-1")])
        self.chunks = []

    def body(self, message: Message) -> None:
        chunk = message.get("body", b"")
        if not chunk and self.messages:
            return  # an empty closing message (Quart ends every body so) is no second chunk
        self.messages += 1
        self.size += len(chunk)
        if self.chunks is not None and self.size <= self.max_stored_response and self.messages == 1:
            self.chunks.append(chunk)
        else:
            self.chunks = None  # streamed or too large: a tombstone, not a replay

    def verdict(self) -> str:
        return verdict(self.status, self.retry_after)

    def answer(self) -> dict[str, Any]:
        """The stored form of a replayable answer (status, allow-listed headers, base64 body)."""
        return {"status": self.status, "headers": self.headers or [],
                "body": base64.b64encode(b"".join(self.chunks or [])).decode()}


def replay_messages(record: dict[str, Any], method: str) -> tuple[Message, Message]:
    """The `http.response.start` and body messages that replay a stored answer."""
    status = int(record["status"])
    body = base64.b64decode(record.get("body", ""))
    headers = [(str(k).encode("latin-1"), str(v).encode("latin-1")) for k, v in record.get("headers", [])
               if str(k).lower() in STORED_HEADERS]
    if status < 200 or status in _NO_CONTENT:
        body = b""                      # and no Content-Length at all
    elif status == 205:
        body = b""
        headers.append((b"content-length", b"0"))
    elif method == "HEAD":
        body = b""                      # the length of a GET's content is not stored
    else:
        headers.append((b"content-length", str(len(body)).encode()))
    headers.append((b"idempotent-replayed", b"true"))
    return ({"type": "http.response.start", "status": status, "headers": headers},
            {"type": "http.response.body", "body": body, "more_body": False})
