"""The fingerprint of release 0.1.0, kept for one release to compare its records.

0.1.0 stored `fp` without a version, computed over method, route, concrete
path, query and a body canonical only when it is JSON (no scheme or host, a
multipart body as raw bytes). A byte-identical retry of a request 0.1.0
answered must be replayed here, not refused as a mismatch; and the records
this release writes for 0.1.0 replicas to read must carry the fingerprint
as 0.1.0 computes it. Remove with the 0.1.0 record layout.
"""

from __future__ import annotations

import hashlib
import hmac
import json

from .._types import Scope
from ._fingerprint import canonical_target


def fingerprint_v1(secret: bytes, scope: Scope, route: str, body: bytes) -> str:
    """HMAC-SHA256 over method, route template, concrete path, query and 0.1.0's canonical body."""
    path, query = canonical_target(scope)   # unchanged since 0.1.0 (a test holds them together)
    pieces = (scope["method"].encode(), route.encode("utf-8", "surrogatepass"), path, query,
              _canonical_body(body, _content_type(scope)))
    mac = hmac.new(secret, digestmod=hashlib.sha256)
    for piece in pieces:
        mac.update(len(piece).to_bytes(8, "big"))
        mac.update(piece)
    return mac.hexdigest()


def _canonical_body(body: bytes, content_type: str) -> bytes:
    if body and ("json" in content_type or not content_type):
        try:
            doc = json.loads(body)
            return b"j" + json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()
        except (ValueError, RecursionError, UnicodeDecodeError):
            pass
    return b"b" + body


def _content_type(scope: Scope) -> str:
    headers: list[tuple[bytes, bytes]] = scope.get("headers", [])
    for key, value in headers:
        if key.lower() == b"content-type":
            return value.decode("latin-1").lower()
    return ""
