"""The fingerprint of version 2, kept to compare the records stored with `fpv: 2`.

Version 2 covered method, scheme and host, route template, concrete path,
query and the body (JSON with sorted keys as Python writes it, multipart by
its parts), not the handler's declared headers and cookies. A retry of a
request answered under version 2 must still be replayed after an upgrade,
so its records are compared by this algorithm until they expire. Remove one
release after version 3 (a record lives `ttl`, a day by default).

Its multipart splitter is its own and stays hand-written: version 2's digest
covers the preamble and epilogue bytes and refuses (as raw bytes) bodies
python-multipart accepts, so no parser's output gives the same digests.
Version 3 reads parts with python-multipart (`_multipart`).
"""

from __future__ import annotations

import json

from .._types import Scope
from ._fingerprint import _header, authority, canonical_body, canonical_target, digest
from ._mime import canonical_header, params


def fingerprint_v2(secret: bytes, scope: Scope, route: str, body: bytes) -> str:
    """HMAC-SHA256 over method, scheme and host, route template, concrete path, query and version 2's body."""
    path, query = canonical_target(scope)
    return digest(secret, (scope["method"].encode(), authority(scope), route.encode("utf-8", "surrogatepass"),
                           path, query, canonical_body(body, _header(scope, b"content-type"), _json_v2,
                                                       multipart_parts_v2)))


def _json_v2(body: bytes) -> bytes:
    doc = json.loads(body)
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def multipart_parts_v2(body: bytes, content_type: str) -> bytes | None:
    """The parts of a multipart body, without its boundary; None unless it is strictly well-formed.

    Each part is its headers (names lower-cased; Content-Disposition and
    Content-Type as type plus sorted parameters, so `name="f"` and `name=f`
    agree) and its content, length-prefixed, in order. Anything not
    well-formed (no boundary, a missing delimiter, a header line without a
    colon) is fingerprinted as raw bytes instead: then only a byte-identical
    retry replays, never a different upload.
    """
    boundary = next((v for k, v in params(content_type) if k == "boundary"), None)
    if not boundary or len(boundary) > 70:
        return None
    delimiter = b"--" + boundary.encode("latin-1")
    first = body.find(delimiter)
    if first < 0 or (first > 0 and body[first - 2:first] != b"\r\n"):
        return None
    preamble = body[:max(first - 2, 0)]
    sections = body[first + len(delimiter):].split(b"\r\n" + delimiter)
    out = [preamble]
    for i, section in enumerate(sections):
        if section.startswith(b"--"):       # the close delimiter: what follows is the epilogue
            if i != len(sections) - 1:
                return None
            out.append(b"epilogue" + section[2:])
            return b"".join(len(piece).to_bytes(8, "big") + piece for piece in out)
        part = _part(section)
        if part is None:
            return None
        out.extend(part)
    return None  # no close delimiter: a truncated body


def _part(section: bytes) -> list[bytes] | None:
    head, sep, content = section.partition(b"\r\n\r\n")
    if not sep or not head.startswith(b"\r\n") and head.strip(b" \t"):
        return None
    if not head.startswith(b"\r\n"):   # a part without headers: "--b\r\n\r\ncontent"
        head = b""
    headers = []
    for line in head[2:].split(b"\r\n") if head else []:
        name, colon, value = line.partition(b":")
        if not colon or not name or name != name.strip() or line[:1] in (b" ", b"\t"):
            return None
        headers.append(canonical_header(name.decode("latin-1"), value.decode("latin-1")))
    headers.sort()
    return [json.dumps(headers, ensure_ascii=True).encode(), content]
