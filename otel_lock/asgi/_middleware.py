"""LockMiddleware: at start-up, wrap each annotated route; per request, cost nothing elsewhere.

Pure ASGI. It does not route: when the app starts (lifespan startup, or the
first request for servers and test clients without lifespan) it walks the
app's routes once (`_routing.plan`), replaces the `handle` of each route
that carries `@locked`/`@idempotent` or a rule with a `RouteHandle`, fixes
the OpenAPI schema, and checks the annotations. The router's one match then
leads straight into `_flow.Flow` for protected routes; other routes and
other requests never touch this code. A plain ASGI app without Starlette
routes gets its rules matched here instead.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from ..lock import LockManager
from ._annotations import MIB
from ._flow import Flow
from ._guard import PROTECTED, ROUTE_STATE
from .idempotency import IdempotencyGate, IdempotencyStore, Principal
from ._keys import resolve_secret
from ._openapi import document
from ._problem import send_problem
from ._routing import (Problem, RoutePlan, RuleMatcher, Rules, _Rule, effective_context, find_routes, parse_rules,
                       plan)
from ._typed import TypedFields
from ._types import ASGIApp, Message, Receive, Scope, Send

log = logging.getLogger("otel_lock.middleware")


class LockMiddleware:
    """Takes each annotated route's lock before the app runs; see docs/middleware.md."""

    def __init__(self, app: ASGIApp, manager: LockManager, rules: Rules | None = None,
                 hash_secret: str | bytes | None = None, max_body: int = MIB,
                 principal: Principal | None = None,
                 body_timeout: float = 5.0, send_timeout: float = 10.0, enabled: bool = True,
                 idempotency_store: IdempotencyStore | None = None) -> None:
        if manager is None:
            raise ValueError("LockMiddleware needs manager=LockManager(...)")
        if not isinstance(max_body, int) or max_body < 0:
            raise ValueError(f"max_body must be a non-negative number of bytes, got {max_body!r}")
        for what, value in (("body_timeout", body_timeout), ("send_timeout", send_timeout)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"{what} must be a positive number of seconds, got {value!r}")
        self.app: ASGIApp = app
        self.manager: LockManager = manager
        self.rules: list[_Rule] = parse_rules(rules)
        if hash_secret is None:
            hash_secret = getattr(manager, "hash_secret", None)
        self.secret: bytes = resolve_secret(hash_secret, getattr(manager, "namespace", "otel-lock"))
        self.max_body: int = max_body
        self.body_timeout: float = float(body_timeout)
        self.send_timeout: float = float(send_timeout)
        # principal: whose Idempotency-Keys these are, for @idempotent routes that don't say.
        # idempotency_store: where @idempotent records live and their caps (default: next to the locks).
        self.gate: IdempotencyGate = IdempotencyGate(manager, self.secret, principal, idempotency_store)
        # enabled=False: a deliberate switch (demos, load tests) that runs annotated
        # handlers without their locks instead of refusing them; logged at start-up.
        self.enabled: bool = bool(enabled)
        self.plain: RuleMatcher | None = None
        self.prepared: bool = False
        self._typed: dict[int, tuple[Any, TypedFields]] = {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self.app(scope, receive, self._startup_checked(scope, send))
            return
        if not self.prepared:
            self.prepare(scope.get("app"))
        if scope["type"] != "http" or self.plain is None or not self.enabled:
            await self.app(scope, receive, send)
            return
        match = self.plain.resolve(scope)
        if match is None:
            await self.app(scope, receive, send)
            return
        scope["path_params"] = {**scope.get("path_params", {}), **match.path_params}
        # What a router would set: HTTP instrumentations read the route template from it.
        scope.setdefault("route", _RouteTemplate(match.route))
        await Flow(self, match, match.route, None, self.app, scope, receive, send).run()

    def prepare(self, outer_app: Any = None, startup: bool = False) -> list[Problem]:
        """Walk the routes once: wrap annotated ones, document them, report mistakes (logged)."""
        self.prepared = True
        routes = find_routes(self.app)
        if routes is None and isinstance(getattr(outer_app, "routes", None), list):
            routes = outer_app.routes   # a middleware in between that hides its `.app`
        if routes is None:
            self.plain = RuleMatcher(self.rules)
            return []
        plans, problems = plan(routes, self.rules)
        if startup:
            # Settings the idempotency gate needs (a principal): at start-up they fail the start;
            # on first use the gate answers for itself.
            problems += self._gate_problems(plans)
        for route_plan in plans:
            _install(route_plan.route, RouteHandle(self, route_plan, _original_handle(route_plan.route)))
        for problem in problems:
            log.error("otel-lock: %s", problem)
            if problem.target is not None:
                _install(problem.target, _Refuse(problem, _original_handle(problem.target)))
        document(plans, outer_app)
        if not self.enabled:
            log.warning("otel-lock: LockMiddleware(enabled=False): %d annotated routes run WITHOUT their locks "
                        "and idempotency", len(plans))
        _warn_about_cors(self.app)
        return problems

    def _gate_problems(self, plans: list[RoutePlan]) -> list[Problem]:
        found: list[Problem] = []
        for route_plan in plans:
            for annotated in route_plan.methods.values():
                if annotated.idempotent is not None:
                    try:
                        self.gate.check(annotated.idempotent, route_plan.template)
                    except ValueError as error:
                        found.append(Problem(route_plan.template, str(error)))
                        break
        return found

    def _startup_checked(self, scope: Scope, send: Send) -> Send:
        """Prepare once the app's own startup is done; a mistake fails the startup, naming it."""
        async def checked(message: Message) -> None:
            if message["type"] == "lifespan.startup.complete" and not self.prepared:
                problems = self.prepare(scope.get("app"), startup=True)
                if problems:
                    text = "otel-lock: " + "; ".join(str(p) for p in problems)
                    await send({"type": "lifespan.startup.failed", "message": text})
                    return
            await send(message)

        return checked

    def typed_fields(self, route: Any) -> TypedFields | None:
        """FastAPI's declared fields of a route or inclusion (cached per dependant)."""
        dependant = getattr(route, "dependant", None)
        if dependant is None:
            return None
        cached = self._typed.get(id(dependant))
        if cached is None or cached[0] is not dependant:
            cached = (dependant, TypedFields(dependant, bool(getattr(route, "_embed_body_fields", False))))
            self._typed[id(dependant)] = cached
        return cached[1]


class RouteHandle:
    """Replaces an annotated route's `handle`: the router has matched, the handler has not run yet."""

    def __init__(self, mw: LockMiddleware, route_plan: RoutePlan, original: ASGIApp) -> None:
        self.mw, self.plan, self.original = mw, route_plan, original
        first = route_plan.contexts[0] if route_plan.contexts else None
        own = getattr(first, "path", "") if first is not None else ""
        self.prefix = route_plan.template[: len(route_plan.template) - len(own)] if own else ""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        annotated = self.plan.methods.get(scope.get("method", "")) if scope["type"] == "http" else None
        if annotated is None:
            await self.original(scope, receive, send)   # websocket, 405, or an unannotated method
            return
        if not self.mw.enabled:
            token = ROUTE_STATE.set(PROTECTED)
            try:
                await self.original(scope, receive, send)
            finally:
                ROUTE_STATE.reset(token)
            return
        route = self.plan.route
        context = effective_context(scope, route) if self.plan.contexts else None
        template = self.prefix + context.path if context is not None else self.plan.template
        typed = self.mw.typed_fields(context if context is not None else route)
        # Starlette >= 1.7 sets it itself; older ones do not, and HTTP instrumentations
        # read the route template from it (also for the middleware's own answers).
        scope.setdefault("route", _RouteTemplate(template))
        await Flow(self.mw, annotated, template, typed, self.original, scope, receive, send).run()


class _Refuse:
    """A route with an annotation mistake found on first use: refuse, naming the mistake."""

    def __init__(self, problem: Problem, original: ASGIApp) -> None:
        self.problem, self.original = problem, original

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            await send_problem(send, 500, "lock-annotation-invalid", f"otel-lock: {self.problem}")
        elif scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1011, "reason": "otel-lock: annotation error"})
        else:
            await self.original(scope, receive, send)


def _original_handle(route: Any) -> ASGIApp:
    current = route.__dict__.get("handle")
    if isinstance(current, (RouteHandle, _Refuse)):
        return current.original   # a route shared with an earlier app: wrap its real handle again
    handle: ASGIApp = route.handle
    return handle


def _install(route: Any, handle: ASGIApp) -> None:
    route.handle = handle


def _warn_about_cors(app: Any) -> None:
    node, seen = app, 0
    while node is not None and seen < 32:
        if type(node).__name__ == "CORSMiddleware":
            log.warning("otel-lock: LockMiddleware wraps %s.%s: add LockMiddleware before CORSMiddleware "
                        "(app.add_middleware(LockMiddleware, ...) first, CORS last, so CORS is outermost); "
                        "answers given in front of the router would otherwise lack CORS headers",
                        type(node).__module__, type(node).__name__)
            return
        node = getattr(node, "app", None)
        seen += 1


@dataclass(frozen=True)
class _RouteTemplate:
    path_format: str
