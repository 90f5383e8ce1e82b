"""What the handler answered, and whether that answer is stored for retries.

An answer is stored only if it is final. One that asks the client to come
back (any `Retry-After`, 408, 409, 425, 429, 502, 503, 504) or that rejects
the caller's credentials (401, 403) says nothing about the operation, so
storing it would turn a temporary "not now" into a permanent one: the key is
freed instead and the retry runs the handler. A handler that raised, or an
other 5xx, leaves the effects unknown (see docs/idempotency.md).
"""

from __future__ import annotations

from dataclasses import dataclass

from ._types import Message

# Replayed as stored; everything else (Set-Cookie, Authorization, hop-by-hop,
# Content-Length, which is recomputed) is dropped.
STORED_HEADERS = frozenset({
    "content-type", "content-encoding", "content-language", "content-location", "location", "etag",
    "last-modified", "link", "cache-control", "expires", "vary",
})
RETRY_STATUSES = frozenset({408, 409, 425, 429, 502, 503, 504})
AUTH_STATUSES = frozenset({401, 403})

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

    max_body: int
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
        self.messages += 1
        self.size += len(chunk)
        if self.chunks is not None and self.size <= self.max_body and self.messages == 1:
            self.chunks.append(chunk)
        else:
            self.chunks = None  # streamed or too large: a tombstone, not a replay

    def verdict(self) -> str:
        return verdict(self.status, self.retry_after)
