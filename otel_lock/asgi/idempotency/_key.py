"""The Idempotency-Key header: an sf-string (`"abc"`), or a bare token for compatibility.

One value, one key: a key is never accepted in two spellings that mean two
keys (a bare `abc` followed by a line feed was once accepted as a key of its
own, so a retry ran the handler again). `KEY_PATTERN` says the same as
`parse_key`, for the published OpenAPI (a test holds them together).
"""

from __future__ import annotations

import re

MAX_KEY = 255
HEADER = b"idempotency-key"
BARE_CHARS = r"A-Za-z0-9._~+/=:-"
_BARE = re.compile(f"[{BARE_CHARS}]+")
# What parse_key accepts, as one regular expression (ECMA-262 and Python alike): 1 to 255
# characters either as an sf-string (printable ASCII, `\"` and `\\` escaped) or as a bare
# token. parse_key also strips blanks around the value, which servers strip before it anyway.
KEY_PATTERN = r'^(?:"(?:[ !#-\[\]-~]|\\["\\]){1,%d}"|[%s]{1,%d})$' % (MAX_KEY, BARE_CHARS, MAX_KEY)


class IdempotencyKeyError(ValueError):
    """The Idempotency-Key header is not a valid key (-> 400)."""


def parse_key(headers: list[tuple[bytes, bytes]]) -> str | None:
    """The key, or None without the header; IdempotencyKeyError naming the rule it breaks."""
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
    # fullmatch: `$` would also match before a final line feed.
    if not _BARE.fullmatch(raw):
        raise IdempotencyKeyError(
            'Idempotency-Key must be a quoted string ("...") or a bare token of letters, digits and -._~+/=:')
    return raw
