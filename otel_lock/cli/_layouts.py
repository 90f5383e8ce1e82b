"""What lives in a namespace, for `otel-lock doctor`: the data model that claims it, the record layouts in it.

Read only, never written: `<ns>:model` (the data model of the managers
using the namespace, `otel_lock/lock/_scripts.py`) and a SCAN for each
Idempotency-Key record layout there has been:

    current  <ns>:idem:{<principal>}:r:<scope>
    0.1.0    <ns>:{idem:<scope>}:idempotency

A rolling deploy or a rollback needs to know both: a manager refuses a
namespace of another data model, and a release that reads one layout only
answers none of the other's records.

Reading them can fail after the server checks passed (a user without rights
on `<ns>:*`, another type under `<ns>:model`): the report is still printed,
and the namespace part says what failed (`error`), a refusal.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..lock._scripts import SHARES_WITH

LAYOUTS = (("current", "{ns}:idem:{{*}}:r:*", "<ns>:idem:{<p>}:r:<h>"),
           ("0.1.0", "{ns}:{{idem:*}}:idempotency", "<ns>:{idem:<h>}:idempotency"))


@dataclass(frozen=True)
class NamespaceState:
    """`model`: the data model claiming the namespace (None: unclaimed), `model_ttl` its seconds left;
    `layouts`: the record layouts found, by name (current, 0.1.0); `error`: why it could not be read."""

    namespace: str
    model: int | None
    model_ttl: int | None
    layouts: tuple[str, ...]
    error: str = ""

    def as_dict(self) -> dict[str, Any]:
        state = {"namespace": self.namespace, "model": self.model, "model_ttl": self.model_ttl,
                 "record_layouts": list(self.layouts)}
        return {**state, "error": self.error} if self.error else state  # the key only when it failed

    def lines(self, ours: int) -> list[str]:
        if self.error:
            return [f"namespace {self.namespace!r}: could not be read: {self.error}"]
        if self.model is None:
            claim = "no data model claims it (unused, or only managers of 0.1.0, which claim none)"
        else:
            left = f", {self.model_ttl / 86400:.1f} days left" if self.model_ttl and self.model_ttl > 0 else ""
            claim = f"data model {self.model}{left}" + (" (this otel-lock's)" if self.model == ours else
                                                        " (shared with this otel-lock's)" if self.model in SHARES_WITH
                                                        else "")
        found = [f"{name} ({shape.replace('<ns>', self.namespace)})" for name, _, shape in LAYOUTS
                 if name in self.layouts]
        records = ", ".join(found) if found else "none"
        return [f"namespace {self.namespace!r}: {claim}", f"idempotency records: {records}"]


async def namespace_state(client: Any, namespace: str) -> NamespaceState:
    """Read `client` (redis-py; a Cluster client scans every master) for the namespace's model and layouts."""
    model = await client.get(f"{namespace}:model")
    ttl = await client.ttl(f"{namespace}:model") if model is not None else None
    escaped = _glob_escape(namespace)
    found = []
    for name, pattern, _ in LAYOUTS:
        keys = client.scan_iter(match=pattern.format(ns=escaped), count=1000)
        try:
            async for _key in keys:
                found.append(name)
                break
        finally:
            await keys.aclose()
    return NamespaceState(namespace, _int(model), ttl, tuple(found))


def unreadable(namespace: str, error: BaseException, user: str) -> NamespaceState:
    """The namespace state of a read that failed, its error worded with the fix."""
    from redis.exceptions import NoPermissionError

    detail = (str(error).strip().splitlines() or [type(error).__name__])[0]
    if isinstance(error, NoPermissionError) or "no permissions" in detail.lower():
        detail += f" (fix: ACL SETUSER {user} ~{namespace}:*, or the namespace this user has: --namespace)"
    elif detail.startswith("WRONGTYPE"):
        detail += (f" ({namespace}:model is not a string: another program uses the namespace; "
                   "fix: another --namespace, or remove that key)")
    return NamespaceState(namespace, None, None, (), detail)


def _int(value: Any) -> int | None:
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        return -1  # not a model this otel-lock knows how to read


def _glob_escape(text: str) -> str:
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)
