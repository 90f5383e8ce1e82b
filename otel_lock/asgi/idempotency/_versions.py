"""Which fingerprint a stored record carries, and whether a request matches it.

A record says how its `fp` was computed (`fpv`): none is release 0.1.0's
algorithm (`_fingerprint_v1`), 2 is scheme and host and a multipart body by
its parts (`_fingerprint_v2`), 3 is this one's (`_fingerprint`: also the
handler's declared headers and cookies and its lock key's headers, JSON
numbers in one spelling). A request is compared with a record by the
record's own algorithm, so a retry across an upgrade or a rollback is the
same request on both sides. A version this release does not know (a newer
release's record) cannot be compared: the gate neither replays it nor runs
the handler again (409 outcome unknown), and says so in its log.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .._types import Scope
from ._fingerprint import fingerprint
from ._fingerprint_inputs import Inputs
from ._fingerprint_v1 import fingerprint_v1
from ._fingerprint_v2 import fingerprint_v2

FINGERPRINT_VERSION = 3


class UnknownRecordVersion(Exception):
    """A record of a fingerprint version this release cannot compute."""


@dataclass(frozen=True)
class Fingerprints:
    """One request's fingerprint by each algorithm a record in the store may carry."""

    current: str
    v2: str
    v1: str

    @classmethod
    def of(cls, secret: bytes, scope: Scope, route: str, body: bytes, inputs: Inputs = Inputs()) -> "Fingerprints":
        return cls(fingerprint(secret, scope, route, body, inputs.read(scope)),
                   fingerprint_v2(secret, scope, route, body), fingerprint_v1(secret, scope, route, body))

    def matches(self, record: dict[str, Any]) -> bool:
        """Whether `record` was written for this request; UnknownRecordVersion if it cannot say."""
        version = record.get("fpv")
        if version is None:
            return record.get("fp") == self.v1
        if version == 2:
            return record.get("fp") == self.v2
        if version == FINGERPRINT_VERSION:
            return record.get("fp") == self.current
        raise UnknownRecordVersion(f"fingerprint version {version!r}")

    def stamp(self, record: dict[str, Any]) -> dict[str, Any]:
        """`record` as this release stores it: its own fingerprint, with its version."""
        return {**record, "fp": self.current, "fpv": FINGERPRINT_VERSION}

    def as_v1(self, record: dict[str, Any]) -> dict[str, Any]:
        """`record` as release 0.1.0 reads it: 0.1.0's fingerprint, no version."""
        old = {k: v for k, v in record.items() if k != "fpv"}
        old["fp"] = self.v1
        return old
