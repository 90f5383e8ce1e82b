"""Routing, all of it: which routes are protected, and the hook the router calls after its one match.

LockMiddleware does not route requests itself. At start-up `plan()` walks
the app's Starlette routes (Mounts, Hosts, FastAPI's included routers) and
returns one `RoutePlan` per route that carries an annotation or a rule;
the middleware then replaces that route's `handle` with a `RouteHandle`,
which the router calls after its one match and which hands the request to
`_request.ProtectedRequest`. Annotation mistakes found on the way (a
websocket route, an unknown path parameter, an annotation hidden by a
wrapper) are `Problem`s naming the route; a route with one is given a
`Refuse` handle. An app without Starlette routes (plain ASGI, Litestar,
Quart) gets its rules matched in front of it by `RuleMatcher`.
"""

from __future__ import annotations

import inspect
import re
import sys
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterator, Mapping, TypeAlias

from starlette.convertors import Convertor
from starlette.routing import BaseRoute, Host, Mount, Route, WebSocketRoute, compile_path

from ._annotations import ATTR, Idempotent, Locked, annotations_of
from ._guard import Mark, marked
from ._problem import send_problem
from ._request import ProtectedRequest, Protection
from ._types import ASGIApp, Receive, Scope, Send

if TYPE_CHECKING:
    from ._middleware import LockMiddleware

ALL_METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS")
# LockMiddleware(rules=...): `{"POST /api/x/{id}": locked(...)}`, or a list/tuple of annotations per route.
# (list[Locked] is spelled out: a list of one kind is not a list[Annotation] to a type checker.)
Annotation: TypeAlias = Locked | Idempotent
Rules = Mapping[str, Annotation | list[Locked] | list[Idempotent] | list[Annotation] | tuple[Annotation, ...]]


@dataclass(frozen=True)
class Annotated:
    locked: Locked | None
    idempotent: Idempotent | None


@dataclass(frozen=True)
class RouteMatch:
    """A plain ASGI app's request matched by a rule."""

    route: str
    path_params: dict[str, Any]
    rule: _Rule


@dataclass(frozen=True)
class Problem:
    route: str
    message: str
    target: Any = None                # the route object to refuse requests on, if any
    type_name: str = "lock-annotation-invalid"   # what the refused route answers (no lifespan)

    def __str__(self) -> str:
        return f"route {self.route}: {self.message}"


@dataclass
class RoutePlan:
    """What to do for one route object: its template and annotations per method."""

    route: Any                        # the object whose `handle` the router calls
    template: str
    methods: dict[str, Annotated] = field(default_factory=dict)
    contexts: list[Any] = field(default_factory=list)   # FastAPI inclusions of an APIRoute
    templates: dict[int, str] = field(default_factory=dict)   # id(context) -> its full template


@dataclass(frozen=True)
class _Rule:
    methods: frozenset[str] | None  # None: any method
    path_format: str
    regex: re.Pattern[str]
    convertors: dict[str, Convertor[Any]]
    annotations: dict[str, Any]


def parse_rules(rules: Rules | None) -> list[_Rule]:
    """`{"POST /api/x/{id}": locked(...)}` (a list/tuple of annotations also works)."""
    parsed: list[_Rule] = []
    for spec, value in (rules or {}).items():
        method, _, path = spec.strip().rpartition(" ")
        if not path.startswith("/"):
            raise ValueError(f"rule {spec!r} must look like 'POST /path/{{param}}'")
        methods: frozenset[str] | None = frozenset(m.strip().upper() for m in method.split(",") if m.strip()) or None
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


def path_format(template: str) -> str:
    """`/x/{id:int}` -> `/x/{id}`: rules and routes compare without convertors."""
    try:
        return compile_path(template)[1]
    except (AssertionError, ValueError, KeyError):
        return template


class RuleMatcher:
    """Rules for an app without Starlette routes.

    Where the app has a router we can ask (Litestar, Quart), the request is
    routed by it: whatever spelling it leads to a handler (`/deduct/`, `//`,
    `+7`, `%207` on Litestar) is matched to that handler's rule, with the
    path parameters typed as the handler gets them, so one resource is one
    key. A plain ASGI app has no router but the rules: their own paths are
    then the routes.
    """

    def __init__(self, rules: list[_Rule], router: ForeignRouter | None = None) -> None:
        self.rules: list[_Rule] = rules
        self.router: ForeignRouter | None = router

    def resolve(self, scope: Scope) -> RouteMatch | None:
        """The first rule matching the request's method and path (below root_path), or None.

        The path is what the client sent, percent-decoded by the server.
        """
        path = scope["path"]
        root = scope.get("root_path", "")
        if root and path.startswith(root):
            path = path[len(root):] or "/"
        if self.router is not None:
            routed = self.router.resolve(path, scope["method"], _host(scope))
            if routed is None:
                return None   # the framework answers (404, 405, a redirect): nothing runs
            template, params, routed_path = routed
            rule = self._rule(template, scope["method"])
            if rule is None:
                return None
            if routed_path != path:
                # The path as the framework reads it from here on (Litestar writes it into the scope itself):
                # a retry of `/charges` as `//charges/` is the same request to the idempotency fingerprint.
                scope["path"] = root + routed_path if root and scope["path"].startswith(root) else routed_path
            return RouteMatch(rule.path_format, params, rule)
        for rule in self.rules:
            if rule.methods is not None and scope["method"] not in rule.methods:
                continue
            m = rule.regex.match(path)
            if m:
                params = {k: rule.convertors[k].convert(v) for k, v in m.groupdict().items()}
                return RouteMatch(rule.path_format, params, rule)
        return None

    def _rule(self, template: str, method: str) -> _Rule | None:
        return next((r for r in self.rules if r.path_format == template
                     and (r.methods is None or method in r.methods)), None)

    def unmatched(self) -> list[Problem]:
        """Rules that name no route of the framework's router (a typo would otherwise protect nothing)."""
        if self.router is None:
            return []
        known = self.router.templates()
        return [Problem(r.path_format, f"a rule of LockMiddleware(rules=...) matches no route of the "
                                       f"{self.router.name} app (its routes: {', '.join(sorted(known)) or 'none'})")
                for r in self.rules if r.path_format not in known]


class ForeignRouter:
    """A Litestar or Quart app's own router, asked which route a path leads to (never to run it)."""

    name = "ASGI"

    def resolve(self, path: str, method: str, host: str) -> tuple[str, dict[str, Any], str] | None:
        """(the route's template as `/x/{name}`, its typed path parameters, the path as the framework
        reads it), or None (no route)."""
        raise NotImplementedError

    def templates(self) -> set[str]:
        raise NotImplementedError

    @staticmethod
    def of(app: Any) -> ForeignRouter | None:
        node, seen = app, 0
        while node is not None and seen < 32:
            router = getattr(node, "asgi_router", None)
            if callable(getattr(router, "handle_routing", None)):
                return _LitestarRouter(node)
            if callable(getattr(getattr(node, "url_map", None), "bind", None)):
                return _WerkzeugRouter(node)
            node = getattr(node, "app", None)
            seen += 1
        return None


class _LitestarRouter(ForeignRouter):
    name = "Litestar"

    def __init__(self, app: Any) -> None:
        self.app = app

    def resolve(self, path: str, method: str, host: str) -> tuple[str, dict[str, Any], str] | None:
        # Litestar's own normalisation (litestar.utils.path.normalize_path) before its router's look-up.
        normalized = re.sub("//+", "/", "/" + path.strip("/"))
        try:
            _, _, routed, params, template = self.app.asgi_router.handle_routing(path=normalized, method=method)
        except Exception:   # NotFound, MethodNotAllowed, a bad parameter: Litestar answers it, nothing runs
            return None
        return path_format(template), dict(params), str(routed)

    def templates(self) -> set[str]:
        return {path_format(str(route.path)) for route in self.app.routes}


class _WerkzeugRouter(ForeignRouter):
    """Quart (and any app with a Werkzeug `url_map`)."""

    name = "Quart"

    def __init__(self, app: Any) -> None:
        self.app = app

    def resolve(self, path: str, method: str, host: str) -> tuple[str, dict[str, Any], str] | None:
        try:
            rule, params = self.app.url_map.bind(host).match(path, method, return_rule=True)
        except Exception:   # NotFound, MethodNotAllowed, RequestRedirect: Quart answers it, nothing runs
            return None
        return _werkzeug_format(rule.rule), dict(params), path

    def templates(self) -> set[str]:
        return {_werkzeug_format(rule.rule) for rule in self.app.url_map.iter_rules()}


def _host(scope: Scope) -> str:
    """The Host header (a Werkzeug map may route by host), or the server's name."""
    for name, value in scope.get("headers") or ():
        if name == b"host":
            return str(value.decode("latin-1"))
    server = scope.get("server") or ("localhost", None)
    return str(server[0])


def _werkzeug_format(rule: str) -> str:
    """`/stock/<int:pid>/deduct` -> `/stock/{pid}/deduct`."""
    return re.sub(r"<(?:[^<>:]+:)?([^<>:]+)>", r"{\1}", rule)


def find_routes(app: Any) -> list[Any] | None:
    """The Starlette routes of the wrapped app: walk `.app` down to a router; None for other ASGI apps.

    Only Starlette routes count: Litestar's `.routes`, say, is a list of its
    own route objects, whose handlers LockMiddleware cannot wrap.
    """
    node, seen = app, 0
    while node is not None and seen < 32:
        routes = getattr(node, "routes", None)
        if is_starlette_routes(routes):
            assert isinstance(routes, list)
            return routes
        node = getattr(node, "app", None)
        seen += 1
    return None


def foreign_annotated(app: Any) -> list[Problem]:
    """Annotated handlers of an app whose routes LockMiddleware cannot hook (Litestar, Quart/Flask).

    Their decorators would never be read: a start-up error says to name the
    route in `rules=` instead (the guard would otherwise refuse every call).
    """
    found: list[Problem] = []
    node, seen = app, 0
    while node is not None and seen < 32:
        kind = type(node).__name__
        for route in getattr(node, "routes", None) or () if isinstance(getattr(node, "routes", None), list) else ():
            for handler in getattr(route, "route_handlers", None) or ():   # Litestar
                if annotations_of(getattr(handler, "fn", None)):
                    found.append(_foreign(str(getattr(route, "path", "?")), kind))
        views = getattr(node, "view_functions", None)                    # Quart (and Flask)
        if isinstance(views, dict):
            found += [_foreign(name, kind) for name, fn in views.items() if annotations_of(fn)]
        node = getattr(node, "app", None)
        seen += 1
    return found


def _foreign(route: str, framework: str) -> Problem:
    return Problem(route, f"@locked/@idempotent on a {framework} handler is not read: LockMiddleware hooks Starlette "
                          f"and FastAPI routes only; on {framework}, remove the decorator and name the route in "
                          f"LockMiddleware(rules={{\"POST /path/{{param}}\": locked(...)}}) (see docs/middleware.md, "
                          f"Supported frameworks)")


def is_starlette_routes(routes: Any) -> bool:
    return isinstance(routes, list) and all(isinstance(r, BaseRoute) for r in routes)


def plan(routes: list[Any], rules: list[_Rule]) -> tuple[list[RoutePlan], list[Problem]]:
    """Every annotated route of the app, and every annotation mistake found on the way."""
    plans: dict[int, RoutePlan] = {}
    problems: list[Problem] = []
    used_rules: set[int] = set()
    for route, template, params, context in _walk(routes, "", frozenset()):
        _visit(route, template, params, context, rules, plans, problems, used_rules)
    for i, rule in enumerate(rules):
        if i not in used_rules:
            problems.append(Problem(rule.path_format, "a rule of LockMiddleware(rules=...) matches no route of "
                                                      "the app (typo, or a method the route does not allow?)"))
    return list(plans.values()), problems


def _visit(route: Any, template: str, params: frozenset[str], context: Any, rules: list[_Rule],
           plans: dict[int, RoutePlan], problems: list[Problem], used_rules: set[int]) -> None:
    endpoint = getattr(context if context is not None else route, "endpoint", None)
    if endpoint is None:
        endpoint = getattr(route, "endpoint", None)
    if isinstance(route, WebSocketRoute) or type(route).__name__ == "APIWebSocketRoute":
        if annotations_of(endpoint):
            problems.append(Problem(template, "@locked/@idempotent cannot protect a websocket route "
                                              "(take the lock inside the handler with manager.lock(...))", route))
        return
    found = _annotated_methods(route, context, endpoint, template, rules, used_rules)
    if not found:
        hidden = _hidden_annotation(endpoint)
        if hidden is not None:
            problems.append(Problem(template, f"the handler is wrapped by {hidden}, which hides its "
                                              f"@locked/@idempotent annotation: decorate the wrapper with "
                                              f"functools.wraps, or put @locked right below @app.<method>", route))
        return
    problem = _unknown_path_parameter(found, template, params, route)
    if problem is not None:
        problems.append(problem)
        return
    existing = plans.get(id(route))
    if existing is None:
        existing = plans[id(route)] = RoutePlan(route, template, found)
    if context is not None:
        existing.contexts.append(context)
        existing.templates[id(context)] = template


def _annotated_methods(route: Any, context: Any, endpoint: Any, template: str, rules: list[_Rule],
                       used_rules: set[int]) -> dict[str, Annotated]:
    """Per method, the route's annotations: its decorators, a matching rule winning over them."""
    methods = getattr(context, "methods", None) or getattr(route, "methods", None)
    found: dict[str, Annotated] = {}
    fmt = path_format(template)
    for method in sorted(methods) if methods else list(ALL_METHODS):
        annotations = annotations_of(endpoint, method)
        for i, rule in enumerate(rules):
            if rule.path_format == fmt and (rule.methods is None or method in rule.methods):
                annotations = {**annotations, **rule.annotations}  # rules win over decorators
                used_rules.add(i)
                break
        if annotations:
            found[method] = Annotated(annotations.get("locked"), annotations.get("idempotent"))
    return found


def _unknown_path_parameter(found: dict[str, Annotated], template: str, params: frozenset[str],
                            route: Any) -> Problem | None:
    for annotated in found.values():
        if annotated.locked is None:
            continue
        for part in annotated.locked.template.parts:
            if part.source == "path" and part.field not in params:
                return Problem(template, f"lock key template {annotated.locked.template.template!r} names "
                                         f"{part.text}, but the route has no path parameter {part.field!r} "
                                         f"(it has: {', '.join(sorted(params)) or 'none'})", route)
    return None


def _hidden_annotation(endpoint: Any) -> str | None:
    """A wrapper without functools.wraps: an annotated function sits in its closure.

    Only a pass-through wrapper (`*args, **kwargs`) counts: a handler that
    merely calls another, annotated handler has it in its closure too, and
    that is a direct call, which the guard holds under its own lock.
    """
    stack, seen = [(endpoint, 0)], set()
    while stack:
        fn, depth = stack.pop()
        if id(fn) in seen or depth > 4 or not _passes_everything_on(fn):
            continue
        seen.add(id(fn))
        for cell in getattr(fn, "__closure__", None) or ():
            try:
                inner = cell.cell_contents
            except ValueError:
                continue
            if callable(inner) and getattr(inner, ATTR, None):
                return getattr(endpoint, "__qualname__", repr(endpoint))
            if callable(inner):
                stack.append((inner, depth + 1))
    return None


def _passes_everything_on(fn: Any) -> bool:
    code = getattr(fn, "__code__", None)
    return code is not None and bool(code.co_flags & inspect.CO_VARARGS) and bool(code.co_flags & inspect.CO_VARKEYWORDS)


def _walk(routes: list[Any], prefix: str, params: frozenset[str]) -> Iterator[tuple[Any, str, frozenset[str], Any]]:
    """(route, template, path parameter names, FastAPI inclusion context or None) of every leaf route."""
    for route in routes:
        if _is_included_router(route):
            for context in route.effective_route_contexts():
                yield from _walk_context(context, prefix, params)
            continue
        if isinstance(route, (Mount, Host)):
            child_params = params | frozenset(getattr(route, "param_convertors", {}) or {})
            child_prefix = prefix + (route.path if isinstance(route, Mount) else "")
            yield from _walk(list(getattr(route, "routes", None) or []), child_prefix, child_params)
            continue
        if isinstance(route, (Route, WebSocketRoute)) or hasattr(route, "endpoint"):
            own = frozenset(getattr(route, "param_convertors", {}) or {})
            yield route, prefix + getattr(route, "path", ""), params | own, None


def _walk_context(context: Any, prefix: str,
                  params: frozenset[str]) -> Iterator[tuple[Any, str, frozenset[str], Any]]:
    starlette_route = getattr(context, "starlette_route", None)
    if starlette_route is not None:
        # A plain Starlette route, Mount or websocket inside an included router: FastAPI
        # calls this prefixed copy's `handle`.
        yield from _walk([starlette_route], prefix, params)
        return
    original = getattr(context, "original_route", None)
    if original is None or not hasattr(context, "path_regex") or context.path_regex is None:
        return
    own = frozenset(getattr(context, "param_convertors", {}) or {})
    yield original, prefix + (getattr(context, "path", "") or ""), params | own, context


def _is_included_router(route: Any) -> bool:
    # FastAPI >= 0.16x keeps `include_router(...)` as a lazy view with a prefix
    # instead of flattened copies of the routes (duck-typed: private API).
    return hasattr(route, "effective_route_contexts") and not isinstance(route, (Mount, Host))


def effective_context(scope: Scope, route: Any) -> Any:
    """The FastAPI inclusion this request went through, if the route was included with a prefix."""
    routing = sys.modules.get("fastapi.routing")
    getter = getattr(routing, "_get_scope_effective_route_context", None)
    if getter is None:
        return None
    context = getter(scope)
    return context if context is not None and getattr(context, "original_route", None) is route else None


# -- the hooks installed on protected routes ------------------------------------------


@dataclass(frozen=True)
class Inclusion:
    """Another app's inclusion of a shared route, and the middleware that protects it there (both weakly)."""

    context: weakref.ref[Any]
    mw: weakref.ref[LockMiddleware]
    protections: dict[str, Protection]   # per method


class RouteHandle:
    """Replaces a protected route's `handle`: the router has matched, the handler has not run yet."""

    def __init__(self, mw: LockMiddleware, route_plan: RoutePlan, original: ASGIApp,
                 protections: dict[tuple[int, str], Protection]) -> None:
        self.mw, self.plan, self.original, self.protections = mw, route_plan, original, protections
        # A module-level APIRouter included in two apps shares its APIRoute objects (FastAPI's lazy
        # include_router), so one `handle` serves both apps' inclusions: the other app's stay its own
        # middleware's (they ran unmarked: a 500 for `def` and @idempotent handlers).
        self.elsewhere: dict[int, Inclusion] = _inclusions_before(route_plan.route, mw)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        method = scope.get("method", "") if scope["type"] == "http" else ""
        context = effective_context(scope, self.plan.route) if self.plan.contexts or self.elsewhere else None
        mw, protection = self._protection(context, method)
        if protection is None:
            await self.original(scope, receive, send)   # websocket, 405, or an unannotated method
            return
        # Starlette >= 1.7 sets it itself; older ones do not, and HTTP instrumentations
        # read the route template from it (also for the middleware's own answers).
        scope.setdefault("route", RouteTemplate(protection.route))
        if not mw.enabled:
            with marked(Mark.unlocked(protection.guards)):
                await self.original(scope, receive, send)
            return
        await ProtectedRequest(mw, protection, self.original, scope, receive, send).run()

    def _protection(self, context: Any, method: str) -> tuple[LockMiddleware, Protection | None]:
        """Whose protection this request gets: ours, or that of the app whose inclusion it came through."""
        protection = self.protections.get((id(context) if context is not None else 0, method))
        inclusion = self.elsewhere.get(id(context)) if protection is None and context is not None else None
        mw = inclusion.mw() if inclusion is not None and inclusion.context() is context else None
        if inclusion is None or mw is None:
            return self.mw, protection
        return mw, inclusion.protections.get(method)


def _inclusions_before(route: Any, mw: LockMiddleware) -> dict[int, Inclusion]:
    """The inclusions another middleware's handle on `route` protects (those still alive), by context id."""
    current = route.__dict__.get("handle")
    if not isinstance(current, RouteHandle) or current.mw is mw:
        return {}
    found = {key: inclusion for key, inclusion in current.elsewhere.items()
             if inclusion.context() is not None and inclusion.mw() is not None}
    for context in current.plan.contexts:
        methods = {m: p for (key, m), p in current.protections.items() if key == id(context)}
        found[id(context)] = Inclusion(weakref.ref(context), weakref.ref(current.mw), methods)
    return found


class Refuse:
    """A route with a mistake found on first use (no lifespan): refuse, naming the mistake."""

    def __init__(self, problem: Problem, original: ASGIApp) -> None:
        self.problem, self.original = problem, original

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            await send_problem(send, 500, self.problem.type_name, f"otel-lock: {self.problem}")
        elif scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1011, "reason": "otel-lock: annotation error"})
        else:
            await self.original(scope, receive, send)


def original_handle(route: Any) -> ASGIApp:
    current = route.__dict__.get("handle")
    if isinstance(current, (RouteHandle, Refuse)):
        return current.original   # a route shared with an earlier app: wrap its real handle again
    handle: ASGIApp = route.handle
    return handle


def install(route: Any, handle: ASGIApp) -> None:
    route.handle = handle


@dataclass(frozen=True)
class RouteTemplate:
    """What a router sets as `scope["route"]`, for HTTP instrumentations."""

    path_format: str
