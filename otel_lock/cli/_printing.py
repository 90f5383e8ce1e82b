"""`otel-lock locks` output, written a page at a time as the locks are read.

Nothing is kept from one page to the next but the table's column widths, so
the listing starts at once and its memory does not grow with the namespace.
The JSON form is still the one documented array: `[`, one object per line,
`]`. A listing cut short by a Redis error is left unterminated, so that a
script reads it as the failure it is (exit status 1), never as a shorter list.

A key without expiry (the stuck lock an operator looks for) has TTL `none`
(JSON null); a depth or token that is not a whole number in Redis is `?`
(JSON null).
"""

from __future__ import annotations

import json
import math
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .. import LockInfo

HEADER = ("KEY", "OWNER", "DEPTH", "TTL", "TOKEN")


class TextRows:
    """A table whose columns are as wide as the widest cell so far (they only grow)."""

    def __init__(self, namespace: str) -> None:
        self.namespace = namespace
        self.widths = [len(title) for title in HEADER]
        self.rows = 0

    def write(self, page: list[LockInfo]) -> None:
        cells = [(i.key, i.owner, _cell(_number(i.depth)), "none" if math.isinf(i.ttl) else f"{i.ttl:.1f}s",
                  _cell(_number(i.token))) for i in page]
        self.widths = [max([width, *(len(row[col]) for row in cells)]) for col, width in enumerate(self.widths)]
        lines = [] if self.rows else [self._line(HEADER)]
        lines += [self._line(row) for row in cells]
        self.rows += len(cells)
        sys.stdout.write("".join(lines))
        sys.stdout.flush()

    def _line(self, row: tuple[str, ...]) -> str:
        return "  ".join(cell.ljust(width) for cell, width in zip(row, self.widths)).rstrip() + "\n"

    def cut(self) -> None:
        """A Redis error ended the listing: what was printed stays (the error follows on stderr)."""

    def end(self) -> None:
        if not self.rows:
            print(f"no locks held in namespace {self.namespace!r}")


class JsonRows:
    """The documented JSON array, one object per line, written as the pages come."""

    def __init__(self, namespace: str) -> None:
        self.namespace = namespace
        self.rows = 0

    def write(self, page: list[LockInfo]) -> None:
        from . import _lock_name

        out = []
        for info in page:
            row = {"key": info.key, "name": _lock_name(info.key, self.namespace), "owner": info.owner,
                   "depth": _number(info.depth), "ttl": None if math.isinf(info.ttl) else info.ttl,
                   "token": _number(info.token)}
            out.append(("[\n  " if not self.rows else ",\n  ") + json.dumps(row))
            self.rows += 1
        sys.stdout.write("".join(out))
        sys.stdout.flush()

    def cut(self) -> None:
        if self.rows:
            sys.stdout.write("\n")  # unterminated on purpose: not a valid array
            sys.stdout.flush()

    def end(self) -> None:
        print("\n]" if self.rows else "[]")


def _number(value: int) -> int | None:
    """None for the listing's UNKNOWN (-1): not a whole number in Redis."""
    return value if value >= 0 else None


def _cell(value: int | None) -> str:
    return "?" if value is None else str(value)
