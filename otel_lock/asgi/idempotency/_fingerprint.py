"""What makes two requests "the same request": the fingerprint of an idempotent request (version 3).

A retry must repeat the method, the target (scheme, host, route, concrete
path and query), the payload, and every other input the handler reads: its
declared `Header()` and `Cookie()` parameters and the headers its lock key
names (`_fingerprint_inputs`). Anything that can change what the handler
does is in it, so a key reused for another tenant (`acme.example` and
`globex.example`), another account (`X-Account: A`, then `B`), another
query flag or another body is a 422, never a replay of an answer that
belongs to a different request. What a client cannot keep equal on a retry,
or the handler cannot tell apart, is left out: the order of JSON keys and
whitespace, the spelling of a JSON number (`7.0` is `7`, RFC 8785), and the
random boundary of a multipart body (read by python-multipart, as the
handler's form is: `_multipart`).

Version 2 (no inputs, JSON numbers as Python spells them) is in
`_fingerprint_v2`, built from the same pieces; `_versions` picks by record.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from typing import Any, Callable
from urllib.parse import parse_qsl

from .. import _canonical
from .._types import Scope
from ._multipart import multipart_parts


def fingerprint(secret: bytes, scope: Scope, route: str, body: bytes, inputs: bytes) -> str:
    """HMAC-SHA256 over method, scheme and host, route template, concrete path, query, canonical body and
    the handler's other inputs (`_fingerprint_inputs.Inputs.read`)."""
    path, query = canonical_target(scope)
    return digest(secret, (scope["method"].encode(), authority(scope), route.encode("utf-8", "surrogatepass"),
                           path, query, canonical_body(body, _header(scope, b"content-type")), inputs))


def digest(secret: bytes, pieces: tuple[bytes, ...]) -> str:
    mac = hmac.new(secret, digestmod=hashlib.sha256)
    for piece in pieces:
        mac.update(len(piece).to_bytes(8, "big"))  # length-prefixed: no piece can spill into the next
        mac.update(piece)
    return mac.hexdigest()


def canonical_json(document: Any) -> bytes:
    """RFC 8785 text: sorted keys, no whitespace, one spelling per number."""
    return _canonical.dumps(document).encode("utf-8", "surrogatepass")


def authority(scope: Scope) -> bytes:
    """`scheme://host` of the target URI, normalised (RFC 3986 6.2.2-6.2.3).

    The host is the request's Host header (HTTP/2's :authority, as servers
    pass it), else the server address; its case and a trailing dot do not
    make another host. The port is left out: replicas of one service reached
    on different ports (a balancer that passes the backend's port, replicas
    addressed one by one) serve one set of resources; tenants are told
    apart by their host names.
    """
    scheme = str(scope.get("scheme") or "http").lower()
    host = _header(scope, b"host").lower()
    if not host:
        server = scope.get("server")
        host = str(server[0]) if server else ""
    name = _without_port(host)
    name = name.rstrip(".") if not name.endswith("]") else name
    return f"{scheme}://{name}".encode("latin-1", "replace")


def _without_port(host: str) -> str:
    if host.startswith("["):  # an IPv6 literal: the port comes after the bracket
        return host.partition("]")[0] + "]"
    name, sep, port = host.rpartition(":")
    return name if sep and port.isdigit() else host


def canonical_target(scope: Scope) -> tuple[bytes, bytes]:
    """The concrete path and query as the app reads them.

    The path is the server's percent-decoded `path` (`/a/%41` and `/a/A` are
    one resource). The query is decoded the way Starlette's QueryParams does
    (`+` and `%20` are both a space) and sorted by name; the order of repeated
    names is kept, since `?tag=a&tag=b` gives the handler a different list than
    `?tag=b&tag=a`. Undecodable bytes stay distinct (surrogateescape), so two
    different raw queries never collapse into one fingerprint.
    """
    path = json.dumps(scope.get("path", ""), ensure_ascii=True).encode()
    raw_query = scope.get("query_string", b"").decode("latin-1")
    pairs = parse_qsl(raw_query, keep_blank_values=True, errors="surrogateescape")
    pairs.sort(key=lambda pair: pair[0])  # stable: repeated names keep their order
    query = json.dumps(pairs, ensure_ascii=True, separators=(",", ":")).encode()
    return path, query


def canonical_body(body: bytes, content_type: str, json_form: Callable[[bytes], bytes] | None = None,
                   multipart_form: Callable[[bytes, str], bytes | None] = multipart_parts) -> bytes:
    """Canonical JSON (RFC 8785, or `json_form`), multipart by its parts (`multipart_form`), else the raw bytes."""
    if not body:
        return b"b"
    media_type = content_type.lower()
    if media_type.startswith("multipart/"):
        parts = multipart_form(body, content_type)
        if parts is not None:
            return b"m" + parts
    elif "json" in media_type or not media_type:
        try:
            return b"j" + (json_form or _rfc8785)(body)
        except (ValueError, RecursionError, UnicodeDecodeError):
            pass
    return b"b" + body


def _rfc8785(body: bytes) -> bytes:
    return canonical_json(_canonical.loads(body))


def _header(scope: Scope, name: bytes) -> str:
    """The first value of a request header, as sent (a multipart boundary is case-sensitive)."""
    headers: list[tuple[bytes, bytes]] = scope.get("headers", [])
    for key, value in headers:
        if key.lower() == name:
            return value.decode("latin-1")
    return ""
