"""RFC 9457 `application/problem+json` answers sent straight over ASGI.

`type` is an absolute URI, the same on every route (RFC 9457 3.1.1): a
`tag:` URI (RFC 4151) that names the case and points at nothing, so it can
neither resolve differently per request path (as a relative reference
would) nor lead a client to a page that does not exist. Branch on the whole
URI, or on its last segment (`lock-timeout`, `idempotency-key-mismatch`,
...); docs/middleware.md and docs/idempotency.md list them.
"""

from __future__ import annotations

import json
import math
from http import HTTPStatus
from typing import Any

from ._types import Send

CONTENT_TYPE = b"application/problem+json"
TYPE_BASE = "tag:otel-lock.github.io,2026:problem/"


def problem_type(name: str) -> str:
    """The `type` URI of a case name (`lock-timeout`); an absolute URI passes as it is."""
    return name if ":" in name else TYPE_BASE + name


def problem_body(status: int, type_name: str, detail: str, title: str | None = None, **extra: Any) -> bytes:
    doc = {"type": problem_type(type_name), "title": title or _phrase(status), "status": status, "detail": detail}
    doc.update(extra)
    return json.dumps(doc, separators=(",", ":")).encode()


def _phrase(status: int) -> str:
    try:
        return HTTPStatus(status).phrase
    except ValueError:   # a status without a registered phrase (`locked(status=499)`)
        return "Client Error" if status < 500 else "Server Error"


def retry_after_value(seconds: float) -> bytes:
    """Delay-seconds must be a non-negative integer; round up so clients never come back early."""
    return str(max(1, math.ceil(seconds))).encode()


async def send_problem(
    send: Send, status: int, type_name: str, detail: str, *,
    title: str | None = None, retry_after: float | None = None, headers: list[tuple[bytes, bytes]] | None = None,
) -> None:
    body = problem_body(status, type_name, detail, title)
    raw = [(b"content-type", CONTENT_TYPE), (b"content-length", str(len(body)).encode())]
    if retry_after is not None:
        raw.append((b"retry-after", retry_after_value(retry_after)))
    raw.extend(headers or [])
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body, "more_body": False})
