"""Release 0.1.0's record layout, read and written for one release so both versions agree.

0.1.0 keeps a record as a JSON string at `<ns>:{idem:<h>}:idempotency` on the
locks' Redis (`<ns>` the manager's namespace) and reads nothing else. So that
a request answered here and retried on a 0.1.0 replica (in a rolling deploy,
or after a rollback, for the records' whole ttl) is replayed and never run
twice, every record this release writes is written there too, in the form
0.1.0 reads (`Fingerprints.as_v1`), and a record found only there is honoured.

Every write happens under the request's in-flight lock (`<ns>:{idem:<h>}`,
the same lock in both releases), so no other writer interleaves. The copy
shares the lock's hash tag; the bounded record (`<ns>:idem:{<p>}:...`) may sit
in another Cluster slot, so the two are written one after the other, not
atomically: a process that dies between them leaves a `started` record on one
side, which both releases answer as outcome unknown (409), never a second run.

The copy is not counted in the store's caps (0.1.0 does not count it either)
and costs its bytes again on the locks' Redis. The next release stops writing it.
"""

from __future__ import annotations

import json
from typing import Any

from ._store import Record, _parse
from ._store_errors import translated

SUFFIX = ":idempotency"


class LegacyRecords:
    """0.1.0's records of one manager: its Redis client and namespace."""

    def __init__(self, redis: Any, namespace: str) -> None:
        self.redis = redis
        self.namespace = namespace

    def key(self, scope_id: str) -> str:
        return f"{self.namespace}:{{idem:{scope_id}}}{SUFFIX}"

    async def load(self, scope_id: str) -> Record | None:
        return _parse(await translated(lambda: self.redis.get(self.key(scope_id))))

    async def write(self, scope_id: str, record: Record, ttl: float) -> None:
        data = json.dumps(record, separators=(",", ":"))
        await translated(lambda: self.redis.set(self.key(scope_id), data, px=int(ttl * 1000)))

    async def delete(self, scope_id: str) -> None:
        await translated(lambda: self.redis.delete(self.key(scope_id)))
