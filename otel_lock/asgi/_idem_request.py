"""What identifies an idempotent request: its key header and its fingerprint.

The fingerprint says "the same request": a retry must repeat the method, the
route, the concrete resource (path and query) and the payload. Anything that
can change what the handler does is in it, so a key reused for another
account, another query flag or another body is a 422, never a replay of an
answer that belongs to a different request.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
from urllib.parse import parse_qsl

from ._types import Scope

MAX_KEY = 255
HEADER = b"idempotency-key"
_BARE = re.compile(r"^[A-Za-z0-9\-._~+/=:]+$")


class IdempotencyKeyError(ValueError):
    """The Idempotency-Key header is not a valid key (-> 400)."""


def parse_key(headers: list[tuple[bytes, bytes]]) -> str | None:
    """The key from an sf-string (`"abc"`), or a bare token (`abc`, accepted for compatibility)."""
    values = [value for name, value in headers if name.lower() == HEADER]
    if not values:
        return None
    if len(values) > 1:
        raise IdempotencyKeyError("Idempotency-Key was sent more than once")
    raw = values[0].decode("latin-1").strip(" \t")
    key = _sf_string(raw) if raw.startswith('"') else _bare(raw)
    if not 1 <= len(key) <= MAX_KEY:
        raise IdempotencyKeyError(f"Idempotency-Key must be 1 to {MAX_KEY} characters long")
    return key


def _sf_string(raw: str) -> str:
    """RFC 8941 sf-string: quoted printable ASCII with `\\"` and `\\\\` escapes, nothing after it."""
    out, i = [], 1
    while i < len(raw):
        ch = raw[i]
        if ch == "\\":
            if i + 1 >= len(raw) or raw[i + 1] not in '"\\':
                raise IdempotencyKeyError('Idempotency-Key: only \\" and \\\\ may be escaped')
            out.append(raw[i + 1])
            i += 2
        elif ch == '"':
            if i != len(raw) - 1:
                raise IdempotencyKeyError("Idempotency-Key must be a single quoted string (no parameters)")
            return "".join(out)
        elif not 0x20 <= ord(ch) <= 0x7E:
            raise IdempotencyKeyError("Idempotency-Key must be printable ASCII")
        else:
            out.append(ch)
            i += 1
    raise IdempotencyKeyError("Idempotency-Key has an unterminated quoted string")


def _bare(raw: str) -> str:
    if not _BARE.match(raw):
        raise IdempotencyKeyError(
            'Idempotency-Key must be a quoted string ("...") or a bare token of letters, digits and -._~+/=:')
    return raw


def canonical_body(body: bytes, content_type: str) -> bytes:
    """Canonical JSON (sorted keys, no whitespace) when the body is JSON, else the raw bytes."""
    if body and ("json" in content_type or not content_type):
        try:
            doc = json.loads(body)
            return b"j" + json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()
        except (ValueError, RecursionError, UnicodeDecodeError):
            pass
    return b"b" + body


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


def fingerprint(secret: bytes, scope: Scope, route: str, body: bytes) -> str:
    """HMAC-SHA256 over method, route template, concrete path, query and canonical body."""
    path, query = canonical_target(scope)
    content_type = _header(scope, b"content-type")
    mac = hmac.new(secret, digestmod=hashlib.sha256)
    for piece in (scope["method"].encode(), route.encode("utf-8", "surrogatepass"), path, query, canonical_body(body, content_type)):
        mac.update(len(piece).to_bytes(8, "big"))  # length-prefixed: no piece can spill into the next
        mac.update(piece)
    return mac.hexdigest()


def _header(scope: Scope, name: bytes) -> str:
    headers: list[tuple[bytes, bytes]] = scope.get("headers", [])
    for key, value in headers:
        if key.lower() == name:
            return value.decode("latin-1").lower()
    return ""
