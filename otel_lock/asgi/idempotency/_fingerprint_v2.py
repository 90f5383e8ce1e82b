"""The fingerprint of version 2, kept to compare the records stored with `fpv: 2`.

Version 2 covered method, scheme and host, route template, concrete path,
query and the body (JSON with sorted keys as Python writes it, multipart by
its parts), not the handler's declared headers and cookies. A retry of a
request answered under version 2 must still be replayed after an upgrade,
so its records are compared by this algorithm until they expire. Remove one
release after version 3 (a record lives `ttl`, a day by default).
"""

from __future__ import annotations

import json

from .._types import Scope
from ._fingerprint import _header, authority, canonical_body, canonical_target, digest


def fingerprint_v2(secret: bytes, scope: Scope, route: str, body: bytes) -> str:
    """HMAC-SHA256 over method, scheme and host, route template, concrete path, query and version 2's body."""
    path, query = canonical_target(scope)
    return digest(secret, (scope["method"].encode(), authority(scope), route.encode("utf-8", "surrogatepass"),
                           path, query, canonical_body(body, _header(scope, b"content-type"), _json_v2)))


def _json_v2(body: bytes) -> bytes:
    doc = json.loads(body)
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()
