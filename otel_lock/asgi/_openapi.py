"""OpenAPI for protected routes: the Idempotency-Key header and every answer the middleware can give.

For FastAPI, written into each route's `openapi_extra` (and into FastAPI's
per-inclusion copies of it) when the middleware prepares the app, and
FastAPI's cached schema is dropped, so `app.openapi()` is right from
start-up on. FastAPI merges `openapi_extra` last, key by key: so a status
the route declares itself (`responses={409: ...}`) keeps its description,
and we only add the problem+json content and headers it lacks. For any
other framework, `protected_operation()` fills in one operation object of
an OpenAPI document written by hand (the demo shop does this).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

from ._annotations import Idempotent, Locked
from ._keys import PRINCIPAL
from ._problem import TYPE_BASE
from ._routing import RoutePlan
from .idempotency import KEY_PATTERN, MAX_KEY

HEADER = "Idempotency-Key"
_DONE = "__otel_lock_documented__"
PROBLEM_SCHEMA: dict[str, Any] = {
    "type": "object",
    "title": "Problem",
    "description": f"RFC 9457 problem details; `type` is a URI such as {TYPE_BASE}lock-timeout",
    "properties": {
        "type": {"type": "string", "format": "uri"},
        "title": {"type": "string"},
        "status": {"type": "integer"},
        "detail": {"type": "string"},
    },
    "required": ["type", "title", "status", "detail"],
}
RETRY_AFTER = {"description": "Seconds to wait before retrying", "schema": {"type": "integer", "minimum": 1}}
CHALLENGE = {"description": "The authentication challenge (RFC 9110 11.6.1)", "schema": {"type": "string"}}
# The header exactly as the middleware validates it (blanks around it are stripped by servers).
KEY_SCHEMA = {"type": "string", "pattern": KEY_PATTERN}


@dataclass(frozen=True)
class Answer:
    """One status the middleware may answer, and the headers it then sends."""

    description: str
    headers: tuple[str, ...] = ()


def document(plans: list[RoutePlan], app: Any) -> None:
    """Write the answers into every annotated FastAPI route; drop FastAPI's cached schema."""
    for route_plan in plans:
        if not hasattr(route_plan.route, "openapi_extra"):
            continue  # a Starlette route: not in FastAPI's schema
        rules = [a.locked for a in route_plan.methods.values() if a.locked is not None]
        idem = next((a.idempotent for a in route_plan.methods.values() if a.idempotent is not None), None)
        for target in [route_plan.route, *route_plan.contexts]:
            if not getattr(target, _DONE, False):
                # A new dict: FastAPI's inclusions share the original route's openapi_extra.
                extra = dict(target.openapi_extra or {})
                target.openapi_extra = _merge(extra, rules, idem, declared=_declared(target),
                                              header_declared=_declares_header(target))
                setattr(target, _DONE, True)
    if app is not None and getattr(app, "openapi_schema", None) is not None:
        app.openapi_schema = None   # built before we were ready: build it again on the next call


def protected_operation(operation: dict[str, Any], locked: Locked | None = None,
                        idempotent: Idempotent | None = None) -> dict[str, Any]:
    """An OpenAPI operation object with the middleware's header and answers added (own entries win)."""
    return _merge(dict(operation), [locked] if locked is not None else [], idempotent, declared=set(),
                  header_declared=False)


def answers(rules: Iterable[Locked], idem: Idempotent | None) -> dict[str, Answer]:
    """Every status the middleware can answer for a route with these annotations."""
    found: dict[str, list[Answer]] = {}

    def add(status: int | str, text: str, *headers: str) -> None:
        found.setdefault(str(status), []).append(Answer(text, headers))

    rules = list(rules)
    add(408, "The request body did not arrive within the body-read timeout")
    add(413, "The request body is larger than the middleware's limit")
    add(400, "Content-Length is not a number of bytes")
    add(500, "A mistake in the server's set-up (named in `detail`)")
    for rule in rules:
        add(400, "A value the lock key needs is missing or ill-formed")
        if rule.mode == "permit":
            add(rule.status, "Too many requests run at once: no permit came within the wait", "Retry-After")
        else:
            add(rule.status, "The resource is busy: its lock was not acquired within the wait", "Retry-After")
            add(409, "Waiting for the lock would close a cycle of requests waiting on each other (a deadlock)",
                "Retry-After")
        if rule.several:
            add(422, f"The request names more than {rule.max_keys} distinct lock keys")
        add(503, "The lock service is unavailable, or the lock was lost while the request ran", "Retry-After")
        if any(p.source == PRINCIPAL and not p.optional for p in rule.template.parts):
            add(401, "No caller was identified, and the lock is per caller", "WWW-Authenticate")
    if idem is not None:
        add(400, "The Idempotency-Key header is missing or ill-formed")
        add(idem.unauthenticated_status, "No caller was identified for this Idempotency-Key",
            *(("WWW-Authenticate",) if idem.unauthenticated_status == 401 else ()))
        add(409, "A request with this Idempotency-Key is in flight, or its outcome is unknown, or its "
                 "response was not stored", "Retry-After")
        add(422, "This Idempotency-Key was used with a different request")
        add(429, "This caller holds as many stored idempotent requests as it may", "Retry-After")
        add(503, "The idempotency store is unavailable", "Retry-After")
        add(507, "The idempotency store is full", "Retry-After")
    return {status: _joined(items) for status, items in sorted(found.items())}


def _joined(items: list[Answer]) -> Answer:
    texts = list(dict.fromkeys(a.description for a in items))
    text = texts[0] + "".join(f"; or: {t[0].lower()}{t[1:]}" for t in texts[1:])
    return Answer(text, tuple(dict.fromkeys(h for a in items for h in a.headers)))


def _merge(extra: dict[str, Any], rules: list[Locked], idem: Idempotent | None, *, declared: set[str],
           header_declared: bool) -> dict[str, Any]:
    if idem is not None and not header_declared and not any(
            p.get("in") == "header" and str(p.get("name", "")).lower() == HEADER.lower()
            for p in extra.get("parameters", [])):
        extra["parameters"] = [*extra.get("parameters", []), {
            "name": HEADER, "in": "header", "required": bool(idem.required),
            "description": f"Unique key of this operation: a Structured Field string (\"...\") of 1 to {MAX_KEY} "
                           "printable ASCII characters, or a bare token of letters, digits and -._~+/=:; a retry "
                           "with the same key and request replays the stored response",
            "schema": dict(KEY_SCHEMA),
        }]
    responses = {str(status): dict(entry) for status, entry in (extra.get("responses") or {}).items()}
    for status, answer in answers(rules, idem).items():
        entry = responses.setdefault(status, {})
        if status not in declared:
            entry.setdefault("description", answer.description)
        content = dict(entry.get("content") or {})
        content.setdefault("application/problem+json", {"schema": PROBLEM_SCHEMA})
        entry["content"] = content
        if answer.headers:
            headers = dict(entry.get("headers") or {})
            for name in answer.headers:
                headers.setdefault(name, dict(RETRY_AFTER if name == "Retry-After" else CHALLENGE))
            entry["headers"] = headers
    extra["responses"] = responses
    return extra


def _declared(route: Any) -> set[str]:
    """The statuses a FastAPI route documents itself: their descriptions are the route's."""
    declared = {str(status) for status in (getattr(route, "responses", None) or {})}
    declared |= {str(status) for status in ((getattr(route, "openapi_extra", None) or {}).get("responses") or {})}
    return declared


def _declares_header(route: Any) -> bool:
    """The route reads the header itself (a FastAPI `Header()` parameter, maybe in a dependency)."""
    stack, seen = [getattr(route, "dependant", None)], set()
    while stack:
        dependant = stack.pop()
        if dependant is None or id(dependant) in seen:
            continue
        seen.add(id(dependant))
        for field in dependant.header_params:
            if str(field.alias).lower() == HEADER.lower():
                return True
        stack.extend(dependant.dependencies)
    return False
