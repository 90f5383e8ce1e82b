"""A multipart body by its parts, as python-multipart (Starlette's form parser) reads it: fingerprint version 3.

The boundary is random per request, so a retry's body differs from the
first try's in bytes while the handler gets the same form. Each part is its
headers (names lower-cased; Content-Disposition and Content-Type as type
plus sorted parameters, so `name="f"` and `name=f` agree) and its content,
length-prefixed, in order. A body the parser refuses (a preamble, a
header line without a colon), one it has not seen end (no close
delimiter), and one it reads more leniently than the RFC 2046 framing (an
epilogue or a part after the close delimiter, a line inside a part that
starts with the boundary) is None: the caller fingerprints the raw bytes,
so only a byte-identical retry replays. So is every multipart body where
python-multipart is not installed (it is not a dependency of ours; an app
that reads forms has it, as Starlette requires it for `request.form()`).
"""

from __future__ import annotations

import json
from typing import Any, Callable, cast

from ._mime import canonical_header, params

MAX_BOUNDARY = 70   # RFC 2046 5.1.1


def multipart_parts(body: bytes, content_type: str) -> bytes | None:
    """The canonical parts of a multipart body; None unless python-multipart parses it to its end."""
    try:
        from python_multipart.exceptions import MultipartParseError
        from python_multipart.multipart import MultipartParser
    except ImportError:
        return None
    boundary = next((v for k, v in params(content_type) if k == "boundary"), None)
    if not boundary or len(boundary) > MAX_BOUNDARY:
        return None
    reader = _Reader()
    try:
        parser = MultipartParser(boundary.encode("latin-1"), cast(Any, reader.callbacks()))
        parser.write(body)
        parser.finalize()
    except (MultipartParseError, UnicodeEncodeError, ValueError):
        return None
    if not reader.ended or reader.broken or not _framed(body, boundary.encode("latin-1"), reader.parts):
        return None
    return b"".join(len(piece).to_bytes(8, "big") + piece for piece in reader.pieces)


class _Reader:
    """The parser's callbacks: collect each part's headers and content."""

    def __init__(self) -> None:
        self.pieces: list[bytes] = []
        self.headers: list[str] = []
        self.field, self.value, self.content = bytearray(), bytearray(), bytearray()
        self.ended = self.broken = False
        self.parts = 0

    def callbacks(self) -> dict[str, Callable[..., None]]:
        return {"on_part_begin": self._part_begin, "on_header_field": self._collect(self.field),
                "on_header_value": self._collect(self.value), "on_header_end": self._header_end,
                "on_part_data": self._collect(self.content), "on_part_end": self._part_end,
                "on_end": self._end}

    @staticmethod
    def _collect(into: bytearray) -> Callable[[bytes, int, int], None]:
        def add(data: bytes, start: int, end: int) -> None:
            into.extend(data[start:end])
        return add

    def _part_begin(self) -> None:
        self.headers.clear()
        self.content.clear()

    def _header_end(self) -> None:
        name = bytes(self.field).decode("latin-1")
        if not name or name != name.strip():
            self.broken = True
        self.headers.append(canonical_header(name, bytes(self.value).decode("latin-1")))
        self.field.clear()
        self.value.clear()

    def _part_end(self) -> None:
        self.pieces += [json.dumps(sorted(self.headers), ensure_ascii=True).encode(), bytes(self.content)]
        self.parts += 1

    def _end(self) -> None:
        self.ended = True


def _framed(body: bytes, boundary: bytes, parts: int) -> bool:
    """One delimiter per part, and the close delimiter once, last (an optional CRLF after it).

    The body starts with the first delimiter (python-multipart refuses a
    preamble); every other delimiter follows a CRLF, as RFC 2046 frames it.
    """
    close = b"--" + boundary + b"--"
    end = len(body) - (2 if body.endswith(b"\r\n") else 0)
    return body.find(close) == end - len(close) and body.count(b"\r\n--" + boundary) == parts
