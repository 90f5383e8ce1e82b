"""Find the route of a request before the router runs.

LockMiddleware sits outside the router, so it asks each route the router's
own question, `route.matches(scope)`, and stops at the first FULL match,
descending into Mounts (routers with prefixes, mounted sub-apps) the way the
router would. The annotations of a route are looked up once and cached.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass
from typing import Any, Iterable

from starlette.routing import Host, Match, Mount, Route, compile_path

from ._annotations import Idempotent, Locked, annotations_of

IDEMPOTENCY_HEADER = "Idempotency-Key"
log = logging.getLogger("otel_lock.middleware")


@dataclass(frozen=True)
class RouteMatch:
    route: str                      # the template, e.g. /api/stock/{product_id}/deduct (http.route)
    path_params: dict[str, Any]
    locked: Locked | None
    idempotent: Idempotent | None


@dataclass(frozen=True)
class _Rule:
    methods: frozenset[str] | None  # None: any method
    path_format: str
    regex: Any
    convertors: dict
    annotations: dict[str, Any]


def parse_rules(rules: dict[str, Any] | None) -> list[_Rule]:
    """`{"POST /api/x/{id}": locked(...)}` (a list/tuple of annotations also works)."""
    parsed = []
    for spec, value in (rules or {}).items():
        method, _, path = spec.strip().rpartition(" ")
        if not path.startswith("/"):
            raise ValueError(f"rule {spec!r} must look like 'POST /path/{{param}}'")
        methods = frozenset(m.strip().upper() for m in method.split(",") if m.strip()) or None
        if methods and "*" in methods:
            methods = None
        if methods and "GET" in methods:
            methods = methods | {"HEAD"}
        annotations: dict[str, Any] = {}
        for annotation in value if isinstance(value, (list, tuple)) else [value]:
            if not isinstance(annotation, (Locked, Idempotent)):
                raise ValueError(f"rule {spec!r}: values must be locked(...) or idempotent(...), got {annotation!r}")
            if annotation.kind in annotations:
                raise ValueError(f"rule {spec!r} has two {annotation.kind} annotations")
            annotations[annotation.kind] = annotation
        regex, path_format, convertors = compile_path(path)
        parsed.append(_Rule(methods, path_format, regex, convertors, annotations))
    return parsed


def _format(template: str) -> str:
    """`/x/{id:int}` -> `/x/{id}`: rules and routes compare without convertors."""
    try:
        return compile_path(template)[1]
    except (AssertionError, ValueError, KeyError):
        return template


def _child_routes(route: Any) -> list | None:
    if isinstance(route, (Mount, Host)):
        return list(route.routes)
    return None


class RouteResolver:
    """Route lookup for one wrapped app: one walk per request, annotations cached per route."""

    def __init__(self, rules: dict[str, Any] | None = None) -> None:
        self.rules = parse_rules(rules)
        self._cache: dict[tuple[int, str, str], tuple[Any, dict[str, Any]]] = {}
        self._prepared: set[int] = set()

    def resolve(self, scope: dict, routes: Iterable[Any]) -> RouteMatch | None:
        routes = routes if isinstance(routes, list) else list(routes)
        found = _walk(routes, scope, "")
        if found is None:
            # No route: a 404 or 405 for a routed app; for a plain ASGI app the rules are the routes.
            return None if routes else self._rule_only(scope)
        route, template, child_scope = found
        annotations = self._annotations(route, template, scope["method"])
        if not annotations:
            return None
        return RouteMatch(template, dict(child_scope.get("path_params", {})),
                          annotations.get("locked"), annotations.get("idempotent"))

    def _annotations(self, route: Any, template: str, method: str) -> dict[str, Any]:
        key = (id(route), method, template)
        cached = self._cache.get(key)
        if cached is not None and cached[0] is route:
            return cached[1]
        annotations = annotations_of(getattr(route, "endpoint", None), method)
        path_format = _format(template)
        for rule in self.rules:
            if rule.path_format == path_format and (rule.methods is None or method in rule.methods):
                annotations = {**annotations, **rule.annotations}  # rules win over decorators
                break
        self._cache[key] = (route, annotations)
        return annotations

    def _rule_only(self, scope: dict) -> RouteMatch | None:
        """Apps without Starlette routes (plain ASGI): match the rules' own paths."""
        path = _route_path(scope)
        for rule in self.rules:
            if rule.methods is not None and scope["method"] not in rule.methods:
                continue
            m = rule.regex.match(path)
            if m:
                params = {k: rule.convertors[k].convert(v) for k, v in m.groupdict().items()}
                return RouteMatch(rule.path_format, params,
                                  rule.annotations.get("locked"), rule.annotations.get("idempotent"))
        return None

    def prepare_openapi(self, routes: Iterable[Any]) -> None:
        """Show `Idempotency-Key` on FastAPI operations that honour it (once per routes list).

        FastAPI builds the schema from each route's `openapi_extra`, lazily, on
        the first /openapi.json; this runs on the first request the middleware
        sees, so it is in place before that, whatever the decorator order.
        """
        if id(routes) in self._prepared:
            return
        self._prepared.add(id(routes))
        templates = set()
        for route, template in _all_routes(routes, ""):
            templates.add(_format(template))
            if not hasattr(route, "openapi_extra"):
                continue
            methods = sorted(getattr(route, "methods", None) or ["POST"])
            for method in methods:
                idem = self._annotations(route, template, method).get("idempotent")
                if idem is not None:
                    _add_header_parameter(route, idem)
                    break
        for rule in self.rules:
            if templates and rule.path_format not in templates:
                log.warning("otel-lock: rule for %s matches no route of the app (typo?)", rule.path_format)


def _route_path(scope: dict) -> str:
    """The path the routes see below a Mount (Starlette's own rule, which is private)."""
    path, root = scope["path"], scope.get("root_path", "")
    if not root or not path.startswith(root):
        return path
    if path == root:
        return ""
    return path[len(root):] if path[len(root)] == "/" else path


def _plain_match_classes() -> tuple[type, ...]:
    """Route classes whose matches() is their path regex plus a method check."""
    classes: list[type] = [Route, Mount]
    fastapi_routing = sys.modules.get("fastapi.routing")
    if fastapi_routing is not None and hasattr(fastapi_routing, "APIRoute"):
        classes.append(fastapi_routing.APIRoute)
    return tuple(classes)


def _walk(routes: Iterable[Any], scope: dict, prefix: str) -> tuple[Any, str, dict] | None:
    # A regex pre-check skips most routes without building a child scope;
    # matches() still decides for the ones that pass (as the router will).
    route_path = _route_path(scope)
    plain = _plain_match_classes() if "fastapi" not in scope else ()
    for route in routes:
        if type(route) in plain and not route.path_regex.match(route_path):
            continue
        if _is_included_router(route):
            match, child = route.matches(_probe(scope))
            if match is Match.FULL:
                return _walk_included(route, scope, prefix)
            continue
        match, child = route.matches(scope)
        if match is not Match.FULL:
            continue  # PARTIAL (wrong method) is the router's 405, never locked
        template = prefix + getattr(route, "path", "")
        children = _child_routes(route)
        if children is None:
            return route, template, {**scope, **child}
        # The router hands the request to this Mount whatever happens inside,
        # so a miss below is a miss overall: no second candidate.
        return _walk(children, {**scope, **child}, template)
    return None


def _is_included_router(route: Any) -> bool:
    # FastAPI >= 0.16x keeps `include_router(...)` as a lazy view with a prefix
    # instead of flattened copies of the routes; its `matches()` says FULL
    # but not which route, so ask its selector (duck-typed: private API).
    return hasattr(route, "_match") and hasattr(route, "effective_route_contexts") \
        and not isinstance(route, (Mount, Host))


def _probe(scope: dict) -> dict:
    """A copy FastAPI may scribble its routing notes on."""
    probe = dict(scope)
    if isinstance(probe.get("fastapi"), dict):
        probe["fastapi"] = dict(probe["fastapi"])
    return probe


def _walk_included(router: Any, scope: dict, prefix: str) -> tuple[Any, str, dict] | None:
    match, child, route, context = router._match(_probe(scope))
    if match is not Match.FULL or route is None:
        return None
    child_scope = {**scope, **child}
    child_scope.pop("fastapi", None)
    if context is None:  # a router included in the included router
        return _walk([route], child_scope, prefix)
    starlette_route = getattr(context, "starlette_route", None)
    children = _child_routes(starlette_route)
    if children is not None:  # a Mount inside an included router: its path carries the prefix
        return _walk(children, child_scope, prefix + getattr(starlette_route, "path", ""))
    path = getattr(context, "path", "") or getattr(starlette_route, "path", "") or getattr(route, "path", "")
    return route, prefix + path, child_scope


def _all_routes(routes: Iterable[Any], prefix: str):
    for route in routes:
        if _is_included_router(route):
            for context in route.effective_route_contexts():
                yield context, prefix + (getattr(context, "path", "") or "")
            continue
        template = prefix + getattr(route, "path", "")
        children = _child_routes(route)
        if children is None:
            yield route, template
        else:
            yield from _all_routes(children, template)


def _add_header_parameter(route: Any, idem: Idempotent) -> None:
    extra = dict(route.openapi_extra or {})
    params = list(extra.get("parameters", []))
    if any(p.get("in") == "header" and str(p.get("name", "")).lower() == "idempotency-key" for p in params):
        return
    params.append({
        "name": IDEMPOTENCY_HEADER, "in": "header", "required": idem.required,
        "description": "Unique key for this operation (Structured Field string, 1-255 printable ASCII "
                       "characters); a retry with the same key and payload replays the stored response.",
        "schema": {"type": "string", "minLength": 1, "maxLength": 257},
    })
    extra["parameters"] = params
    # A new dict: include_router shares one openapi_extra between copies of a route.
    route.openapi_extra = extra
    original = getattr(route, "original_route", None)  # FastAPI's per-inclusion view of an APIRoute
    if original is not None and hasattr(original, "openapi_extra"):
        _add_header_parameter(original, idem)


def find_routes(app: Any, scope: dict) -> Any:
    """The routes list of the wrapped app: walk `.app` down to a router, else the scope's app."""
    node, seen = app, 0
    while node is not None and seen < 32:
        routes = getattr(node, "routes", None)
        if isinstance(routes, list):
            return routes
        node = getattr(node, "app", None)
        seen += 1
    outer = scope.get("app")
    routes = getattr(outer, "routes", None)
    return routes if isinstance(routes, list) else []
