"""LockMiddleware: at start-up, hook each protected route; per request, cost nothing elsewhere.

Pure ASGI. When the app starts (lifespan startup, after the app's own
startup code, or the first request for servers and test clients without
lifespan) it finds its lock manager and walks the app's routes once
(`_routing.plan`): each route that carries `@locked`/`@idempotent` or a rule
gets a `RouteHandle`, the keys' bindings are checked, the OpenAPI schema is
completed. A mistake fails the start-up, naming the route and the fix. The
router's one match then leads into `_request.ProtectedRequest` for
protected routes; other routes and other requests never touch this code.
An app without Starlette routes (plain ASGI, Litestar, Quart) gets its rules
matched here instead, in front of it.
"""

from __future__ import annotations

import inspect
import logging
import warnings
import weakref
from typing import Any, Callable, TypeAlias

from ..lock import Locks
from ._after_auth import after_security, security_dependencies
from ._annotations import MIB, Idempotent, Locked, check_flags
from ._binding import RouteBinding, form_limits, json_without_content_type
from ._declared import Unbindable
from ._body import BodyLimits
from ._guard import DirectCalls, Hold, guard_functions, install_direct_calls, plain_function
from .idempotency import IdempotencyGate, IdempotencyStore, Principal
from .idempotency._principal import check_callable
from ._keys import PRINCIPAL, resolve_secret
from ._openapi import document
from ._request import Protection, ProtectedRequest
from ._shapes import missing_method
from ._routing import (Annotated, ForeignRouter, Problem, Refuse, RouteHandle, RoutePlan, RouteTemplate, RuleMatcher, Rules, _Rule,
                       find_routes, foreign_annotated, install, is_starlette_routes, original_handle, parse_rules, plan)
from ._types import ASGIApp, Message, Receive, Scope, Send

log = logging.getLogger("otel_lock.middleware")

STATE_NAME = "locks"   # app.state.locks, or the lifespan state's "locks"
# A manager, a zero-argument factory of one (called once, on the serving loop), or None: app.state.locks.
ManagerSource: TypeAlias = "Locks | Callable[[], Locks] | None"


class StartupFailed(RuntimeError):
    """LockMiddleware refused the app's start-up; the message names the route and the fix."""


class LockMiddleware:
    """Takes each annotated route's lock before the app runs; see docs/middleware.md."""

    def __init__(self, app: ASGIApp, manager: ManagerSource = None, rules: Rules | None = None,
                 hash_secret: str | bytes | None = None, max_body: int = MIB,
                 principal: Principal | None = None, body_idle_timeout: float = 5.0,
                 send_timeout: float = 10.0, enabled: bool = True, body_timeout: float | None = None,
                 idempotency_store: IdempotencyStore | None = None) -> None:
        body_idle_timeout = _checked_arguments(manager, principal, max_body, body_idle_timeout, send_timeout,
                                               body_timeout)
        self.app: ASGIApp = app
        self.source: ManagerSource = manager
        self.rules: list[_Rule] = parse_rules(rules)
        self.hash_secret = hash_secret
        self.max_body: int = max_body
        self.body_idle_timeout: float = float(body_idle_timeout)
        self.send_timeout: float = float(send_timeout)
        # principal: whose Idempotency-Keys these are, for @idempotent routes that don't say.
        self.principal = principal
        # idempotency_store: where @idempotent records live and their caps (default: next to the locks).
        if idempotency_store is not None and not isinstance(idempotency_store, IdempotencyStore):
            raise ValueError(f"idempotency_store must be an IdempotencyStore, got {idempotency_store!r}")
        self.idempotency_store = idempotency_store
        # enabled=False: a deliberate switch (demos, load tests) that runs annotated
        # handlers without their locks instead of refusing them; logged at start-up.
        check_flags(enabled=enabled)
        self.enabled: bool = enabled
        self.plain: RuleMatcher | None = None
        self.plain_protections: dict[int, Protection] = {}
        self.prepared: bool = False
        self._manager: Locks | None = manager if isinstance(manager, Locks) else None
        self._gate: IdempotencyGate | None = None
        self._secret: tuple[Locks, bytes] | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(scope, receive, send)
            return
        if not self.prepared:
            self.locks(scope)
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
        scope.setdefault("route", RouteTemplate(match.route))
        await ProtectedRequest(self, self.plain_protections[id(match.rule)], self.app, scope, receive, send).run()

    # -- the lock manager -------------------------------------------------------

    def locks(self, scope: Scope | None = None) -> Locks | None:
        """The manager: given, made by the factory (once), or the app's (`app.state.locks`, lifespan state)."""
        if self._manager is None:
            source = self.source
            if _is_factory(source) and callable(source):
                made = source()
                if not isinstance(made, Locks):
                    raise TypeError(f"LockMiddleware(manager=...): the factory returned {made!r}, not a lock manager")
                self._manager = made
            elif scope is not None:
                self._manager = _from_app(scope)
        return self._manager

    def current_locks(self) -> Locks | None:
        """The lock manager in use, once resolved (a factory's or app.state's is resolved at start-up)."""
        return self._manager

    def missing_manager(self) -> str:
        """What to do when no lock manager was found."""
        return ("LockMiddleware has no lock manager: pass manager=LockManager(...) (or a zero-argument factory "
                "of one), or set app.state.locks in the app's lifespan (or yield {\"locks\": manager} from it)")

    @property
    def gate(self) -> IdempotencyGate:
        """The Idempotency-Key gate of the resolved manager (made once per manager)."""
        manager = self._manager
        assert manager is not None, "a protected request resolves the manager first"
        if self._gate is None or self._gate.manager is not manager:
            self._gate = IdempotencyGate(manager, self.secret, self.principal, self.idempotency_store)
        return self._gate

    @property
    def secret(self) -> bytes:
        """The HMAC secret of `hash_parts` and idempotency scopes (from the manager's namespace by default)."""
        manager = self._manager
        if self._secret is None or self._secret[0] is not manager:
            explicit = self.hash_secret if self.hash_secret is not None else getattr(manager, "hash_secret", None)
            secret = resolve_secret(explicit, getattr(manager, "namespace", "otel-lock"))
            if manager is None:
                return secret
            self._secret = (manager, secret)
        return self._secret[1]

    # -- start-up ---------------------------------------------------------------

    async def _lifespan(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The app's lifespan, checked once its startup is done; a mistake fails the start-up.

        On a failure the app's own lifespan is shut down (its clean-up runs),
        the server is told `lifespan.startup.failed` with the message, and the
        call raises, as Starlette's own lifespan does: every server and test
        client then ends its start-up at once.
        """
        failure: str | None = None

        async def app_receive() -> Message:
            if failure is not None:
                return {"type": "lifespan.shutdown"}   # our refusal: the app cleans up now
            return await receive()

        async def app_send(message: Message) -> None:
            nonlocal failure
            if message["type"] == "lifespan.startup.complete":
                failure = self._start(scope)
                if failure is None:
                    await send(message)
                return
            if failure is not None and message["type"].startswith("lifespan.shutdown"):
                return   # the app's clean-up after our refusal; the server waits for the start-up answer
            await send(message)

        await self.app(scope, app_receive, app_send)
        if failure is not None:
            await send({"type": "lifespan.startup.failed", "message": failure})
            raise StartupFailed(failure)

    def _start(self, scope: Scope) -> str | None:
        """Find the manager and prepare; the start-up failure message, or None."""
        if not _is_factory(self.source) and not isinstance(self.source, Locks):
            self._manager = None   # app.state.locks: the one this lifespan set
        try:
            manager = self.locks(scope)
        except Exception as error:
            return f"otel-lock: LockMiddleware could not make its lock manager: {error!r}"
        if manager is None:
            return f"otel-lock: {self.missing_manager()}"
        problems = self.prepare(scope.get("app"), startup=True) if not self.prepared else []
        if problems:
            return "otel-lock: " + "; ".join(str(p) for p in problems)
        return None

    def prepare(self, outer_app: Any = None, startup: bool = False) -> list[Problem]:
        """Walk the routes once: hook protected ones, document them, report mistakes (logged)."""
        self.prepared = True
        routes = find_routes(self.app)
        if routes is None and is_starlette_routes(getattr(outer_app, "routes", None)):
            routes = outer_app.routes   # a middleware in between that hides its `.app`
        if routes is None:
            return self._prepare_plain()
        plans, problems = plan(routes, self.rules)
        names: set[str] = set()
        for route_plan in plans:
            protections, found = self._protections(route_plan)
            problems += found
            names.update(p.locked.lock_name for p in protections.values() if p.locked is not None)
            if not found:
                install(route_plan.route, RouteHandle(self, route_plan, original_handle(route_plan.route),
                                                      protections))
        _expect(self._manager, names)
        problems += self._lease_problems(plans)
        if startup and self._manager is not None:
            # Settings the idempotency gate needs (a principal): at start-up they fail the start;
            # on first use the gate answers for itself.
            problems += self._gate_problems(plans)
        for problem in problems:
            log.error("otel-lock: %s", problem)
            if problem.target is not None:
                install(problem.target, Refuse(problem, original_handle(problem.target)))
        document(plans, outer_app)
        if not self.enabled:
            log.warning("otel-lock: LockMiddleware(enabled=False): %d annotated routes run WITHOUT their locks "
                        "and idempotency", len(plans))
        _warn_about_cors(self.app)
        return problems

    def _prepare_plain(self) -> list[Problem]:
        """No Starlette routes: the rules' own paths are matched in front of the app."""
        self.plain = RuleMatcher(self.rules, ForeignRouter.of(self.app))
        problems: list[Problem] = foreign_annotated(self.app) + self.plain.unmatched()
        for rule in self.rules:
            annotated = Annotated(rule.annotations.get("locked"), rule.annotations.get("idempotent"))
            try:
                self.plain_protections[id(rule)] = self._protection(rule.path_format, annotated, None, None, None)
            except Unbindable as error:
                problems.append(Problem(rule.path_format, str(error)))
        for problem in problems:
            log.error("otel-lock: %s", problem)
        return problems

    def _protections(self, route_plan: RoutePlan) -> tuple[dict[tuple[int, str], Protection], list[Problem]]:
        """One Protection per (FastAPI inclusion, method) of a route; the binding mistakes found."""
        found: dict[tuple[int, str], Protection] = {}
        problems: list[Problem] = []
        targets = [(0, route_plan.route, route_plan.template)]
        targets += [(id(c), c, route_plan.templates.get(id(c), route_plan.template)) for c in route_plan.contexts]
        for key, target, template in targets:
            for method, annotated in route_plan.methods.items():
                try:
                    found[(key, method)] = self._protection(template, annotated, target, route_plan.route, method)
                except Unbindable as error:
                    kind = "lock-route-unsupported" if isinstance(error, _Unsupported) else "lock-annotation-invalid"
                    problems.append(Problem(template, str(error), route_plan.route, kind))
                    return found, problems
        return found, problems

    def _protection(self, template: str, annotated: Annotated, target: Any, route: Any,
                    method: str | None) -> Protection:
        locked = annotated.locked
        missing = missing_method(self._manager, locked) if locked is not None else None
        if missing is not None:
            raise _Unsupported(missing)
        endpoint = getattr(target, "endpoint", None) if target is not None else None
        guards = guard_functions(endpoint, method) if endpoint is not None else []
        binding = at_call = None
        if locked is not None:
            binding = RouteBinding(locked.template, getattr(target, "dependant", None),
                                   bool(getattr(target, "_embed_body_fields", False)),
                                   json_without_content_type(target if target is not None else route),
                                   form_limits(route))
            at_call = _key_at_call(route, locked, binding, guards, template)
        limits = BodyLimits(locked.max_body if locked is not None and locked.max_body is not None else self.max_body,
                            locked.body_idle_timeout if locked is not None and locked.body_idle_timeout is not None
                            else self.body_idle_timeout)
        hold = Hold(*_weakly(self), locked, binding, template) if locked is not None and binding is not None else None
        after_auth = locked is not None and not at_call and _after_auth(target, locked, template)
        principal = self._key_principal(locked, annotated.idempotent)
        for fn in guards:
            install_direct_calls(fn, DirectCalls(hold, annotated.idempotent is not None, self.enabled))
        return Protection(template, locked, annotated.idempotent, binding, limits,
                          frozenset(id(fn) for fn in guards), bool(at_call), hold, after_auth, principal,
                          route_class=locked is not None and _transforms_request(route))

    def _key_principal(self, locked: Locked | None, idem: Idempotent | None) -> Principal | None:
        """Where `{principal}` in the route's key comes from: the route's @idempotent principal, else ours."""
        part = next((p for p in locked.template.parts if p.source == PRINCIPAL), None) if locked else None
        if locked is None or part is None:
            return None
        source = idem.principal if idem is not None and idem.principal is not None else self.principal
        if source is None:
            raise Unbindable(f"{part.text} in {locked.template.template!r} needs to know the caller: pass "
                             f"principal=Depends(<a dependency returning the user's id>) (FastAPI) or "
                             f"principal=<callable(request)> (e.g. otel_lock.asgi.authenticated_user after "
                             f"Starlette's AuthenticationMiddleware) to LockMiddleware(...)")
        return source

    def _lease_problems(self, plans: list[RoutePlan]) -> list[Problem]:
        """Leases the manager refuses (a RedLock quorum's minimum is longer than what the decorator checked):
        said at start-up (or first use), not as a 500 on every request."""
        options = getattr(self._manager, "options", None)
        found: list[Problem] = []
        for route_plan in plans:
            for annotated in route_plan.methods.values():
                lease = annotated.locked.lease if annotated.locked is not None else None
                if lease is not None and options is not None:
                    try:
                        options.check_lease(lease)
                    except ValueError as error:
                        found.append(Problem(route_plan.template, f"@locked(lease={lease!r}): {error}",
                                             route_plan.route))
                        break
        return found

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


class _Unsupported(Unbindable):
    """A route the middleware cannot protect as written (its route class, its handler's kind)."""


def _key_at_call(route: Any, locked: Locked, binding: RouteBinding, guards: list[Any], template: str) -> bool:
    """A key from the body of a route whose class may change the request: checked at the handler's call.

    A FastAPI route class that overrides `get_route_handler` may only add
    headers or time the call (then the key read from the wire is the key of
    the handler's arguments), or hand the handler another body (the
    documented `GzipRequest` recipe). The middleware cannot tell which before
    the request, so it takes the wire's key as on any route and the guard
    compares it with the key of the handler's arguments, taking that one
    instead where they differ. That needs the key's values among the
    handler's arguments and a handler the guard can hold (a coroutine or a
    plain function, not a generator): otherwise the start-up fails here.
    """
    if not locked.template.needs_body or not _transforms_request(route):
        return False
    name = type(route).__name__
    if not guards or not all(inspect.iscoroutinefunction(fn) or plain_function(fn) for fn in guards):
        raise _Unsupported(f"the route class {name} may change the request before FastAPI reads it, so the key "
                           f"{locked.template.template!r} is checked against the handler's arguments, which a "
                           f"generator handler cannot be held around: return the response instead of yielding it, "
                           f"and write @locked right below @app.<method>")
    if (locked.several or locked.mode != "exclusive") and not all(inspect.iscoroutinefunction(fn) for fn in guards):
        raise _Unsupported(f"the route class {name} may change the request before FastAPI reads it, so the keys "
                           f"of {locked.annotation}({locked.template.template!r}) are taken at the handler's call, "
                           f"which a plain (def) handler only supports for one exclusive key: make it async def")
    problem = binding.call_problem()
    if problem is not None:
        raise _Unsupported(f"the route class {name} may change the request before FastAPI reads it, so the key "
                           f"{locked.template.template!r} is checked against the handler's arguments, but {problem}")
    return True


def _after_auth(target: Any, locked: Locked, template: str) -> bool:
    """Whether the lock is taken after the route's security dependencies (then our dependency is added)."""
    dependant = getattr(target, "dependant", None)
    security = security_dependencies(dependant) if dependant is not None else []
    wanted = bool(security) if locked.after_auth is None else locked.after_auth
    if not wanted:
        return False
    if not security:
        raise Unbindable(f"locked(after_auth=True) on a route without security dependencies: FastAPI has no "
                         f"authentication to run first (declare it with a fastapi.security scheme, a dependency "
                         f"on one, or Security(...)), or drop after_auth=True")
    after_security(dependant, template)
    return True


def _transforms_request(route: Any) -> bool:
    try:
        from fastapi.routing import APIRoute
    except ImportError:   # pragma: no cover - FastAPI routes only come with FastAPI
        return False
    return isinstance(route, APIRoute) and type(route).get_route_handler is not APIRoute.get_route_handler


def _is_factory(source: Any) -> bool:
    if source is None or isinstance(source, Locks) or not callable(source):
        return False
    try:
        inspect.signature(source).bind()
    except TypeError:
        return False
    except ValueError:
        return True   # no signature to read (a builtin): trust it
    return True


def _from_app(scope: Scope) -> Locks | None:
    app_state = getattr(scope.get("app"), "state", None)
    for candidate in (getattr(app_state, STATE_NAME, None), (scope.get("state") or {}).get(STATE_NAME)):
        if isinstance(candidate, Locks):
            return candidate
    return None


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


def _checked_arguments(manager: ManagerSource, principal: Principal | None, max_body: int, body_idle_timeout: float,
                       send_timeout: float, body_timeout: float | None) -> float:
    """LockMiddleware's arguments refused at construction, by name; returns the body idle timeout to use."""
    if not isinstance(max_body, int) or isinstance(max_body, bool) or max_body < 0:
        raise ValueError(f"max_body must be a non-negative number of bytes, got {max_body!r}")
    if body_timeout is not None:  # the former name, which timed the whole body rather than each pause
        if body_idle_timeout != 5.0:
            raise TypeError("LockMiddleware got both body_timeout= and body_idle_timeout=: give only "
                            "body_idle_timeout= (body_timeout= is its former name)")
        warnings.warn("LockMiddleware(body_timeout=) is deprecated: use body_idle_timeout= (the time a client "
                      "may pause between parts of the body)", DeprecationWarning, stacklevel=3)
        body_idle_timeout = body_timeout
    for what, value in (("body_idle_timeout", body_idle_timeout), ("send_timeout", send_timeout)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ValueError(f"{what} must be a positive number of seconds, got {value!r}")
    check_callable(principal, "LockMiddleware")
    if manager is not None and not isinstance(manager, Locks) and not _is_factory(manager):
        raise TypeError(f"LockMiddleware(manager=...) takes a lock manager (LockManager, RedLockManager), a "
                        f"zero-argument factory of one, or nothing (then app.state.locks); got {manager!r}")
    return body_idle_timeout


def _expect(manager: Locks | None, names: set[str]) -> None:
    """The routes' lock names have series at 0 from start-up (an otel-lock manager; others have no such series)."""
    expect = getattr(manager, "expect_lock_names", None)
    if expect is not None and names:
        expect(sorted(names))


def _weakly(middleware: LockMiddleware) -> tuple[Callable[[], Locks | None], Callable[[], bytes]]:
    """The manager and the secret of `middleware`, reached weakly from the handler it guards.

    A handler function outlives its app (module-level, and kept by FastAPI's
    caches): holding the middleware strongly kept every app's manager, its
    connections and its telemetry series alive. A handler called directly
    after its app is gone finds no manager, as one never served.
    """
    ref = weakref.ref(middleware)

    def locks() -> Locks | None:
        alive = ref()
        return alive.current_locks() if alive is not None else None

    def secret() -> bytes:
        alive = ref()
        if alive is None:
            raise RuntimeError("otel-lock: the LockMiddleware that guarded this handler is gone")
        return alive.secret

    return locks, secret
