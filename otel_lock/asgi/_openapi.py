"""OpenAPI for protected FastAPI routes: the Idempotency-Key header and the answers we can give.

Written into each route's `openapi_extra` (and into FastAPI's per-inclusion
copies of it) when the middleware prepares the app, and FastAPI's cached
schema is dropped, so `app.openapi()` is right from start-up on. FastAPI
merges `openapi_extra` last: our 422 adds a problem+json body next to its
own validation error instead of replacing it.
"""

from __future__ import annotations

from typing import Any

from ._annotations import Idempotent
from ._routing import RoutePlan

HEADER = "Idempotency-Key"
MAX_KEY = 255
_DONE = "__otel_lock_documented__"
PROBLEM_SCHEMA = {
    "type": "object",
    "title": "Problem",
    "description": "RFC 9457 problem details",
    "properties": {
        "type": {"type": "string", "description": "the case, e.g. lock-timeout"},
        "title": {"type": "string"},
        "status": {"type": "integer"},
        "detail": {"type": "string"},
    },
    "required": ["type", "title", "status", "detail"],
}
_LOCKED = {
    "400": "A value the lock key needs is missing or ill-formed",
    "408": "The request body did not arrive within the body-read timeout",
    "409": "The resource is busy (the lock was not acquired within the wait)",
    "413": "The request body is larger than max_body",
    "503": "The lock service is unavailable, or the lock was lost",
}
_IDEMPOTENT = {
    "400": "The Idempotency-Key header is missing or ill-formed",
    "408": "The request body did not arrive within the body-read timeout",
    "409": "A request with this Idempotency-Key is in flight, or its outcome is unknown",
    "413": "The request body is larger than max_body",
    "422": "Validation Error, or this Idempotency-Key was used with a different request",
    "503": "The idempotency store is unavailable",
}


def document(plans: list[RoutePlan], app: Any) -> None:
    for route_plan in plans:
        if not hasattr(route_plan.route, "openapi_extra"):
            continue  # a Starlette route: not in FastAPI's schema
        locked = any(a.locked is not None for a in route_plan.methods.values())
        idem = next((a.idempotent for a in route_plan.methods.values() if a.idempotent is not None), None)
        for target in [route_plan.route, *route_plan.contexts]:
            if not getattr(target, _DONE, False):
                target.openapi_extra = _extra(target, locked, idem)
                setattr(target, _DONE, True)
    if app is not None and getattr(app, "openapi_schema", None) is not None:
        app.openapi_schema = None   # built before we were ready: build it again on the next call


def _extra(route: Any, locked: bool, idem: Idempotent | None) -> dict[str, Any]:
    # A new dict: FastAPI's inclusions share the original route's openapi_extra.
    extra = dict(route.openapi_extra or {})
    answers: dict[str, str] = {}
    if locked:
        answers.update(_LOCKED)
    if idem is not None:
        for status, text in _IDEMPOTENT.items():
            answers[status] = f"{answers[status]}; or: {text[0].lower()}{text[1:]}" if status in answers else text
        if not _declares_header(route, extra):
            extra["parameters"] = [*extra.get("parameters", []), {
                "name": HEADER, "in": "header", "required": bool(idem.required),
                "description": "Unique key for this operation (a Structured Field string, 1-255 printable ASCII "
                               "characters); a retry with the same key and request replays the stored response.",
                "schema": {"type": "string", "minLength": 1, "maxLength": MAX_KEY},
            }]
    responses = {status: dict(answer) for status, answer in (extra.get("responses") or {}).items()}
    for status, text in answers.items():
        entry = responses.setdefault(status, {})
        entry.setdefault("description", text)
        content = dict(entry.get("content") or {})
        content.setdefault("application/problem+json", {"schema": PROBLEM_SCHEMA})
        entry["content"] = content
    extra["responses"] = responses
    return extra


def _declares_header(route: Any, extra: dict[str, Any]) -> bool:
    if any(p.get("in") == "header" and str(p.get("name", "")).lower() == HEADER.lower()
           for p in extra.get("parameters", [])):
        return True
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
