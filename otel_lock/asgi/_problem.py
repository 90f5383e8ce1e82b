"""RFC 9457 `application/problem+json` answers sent straight over ASGI.

`type` is a short relative reference naming the case (`lock-timeout`,
`idempotency-key-mismatch`, ...), so clients and tests can branch on it.
"""

from __future__ import annotations

import json
import math
from http import HTTPStatus
from typing import Any

from ._types import Send

CONTENT_TYPE = b"application/problem+json"


def problem_body(status: int, type_: str, detail: str, title: str | None = None, **extra: Any) -> bytes:
    doc = {"type": type_, "title": title or HTTPStatus(status).phrase, "status": status, "detail": detail}
    doc.update(extra)
    return json.dumps(doc, separators=(",", ":")).encode()


def retry_after_value(seconds: float) -> bytes:
    """Delay-seconds must be a non-negative integer; round up so clients never come back early."""
    return str(max(1, math.ceil(seconds))).encode()


async def send_problem(
    send: Send, status: int, type_: str, detail: str, *,
    title: str | None = None, retry_after: float | None = None, headers: list[tuple[bytes, bytes]] | None = None,
) -> None:
    body = problem_body(status, type_, detail, title)
    raw = [(b"content-type", CONTENT_TYPE), (b"content-length", str(len(body)).encode())]
    if retry_after is not None:
        raw.append((b"retry-after", retry_after_value(retry_after)))
    raw.extend(headers or [])
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body, "more_body": False})
