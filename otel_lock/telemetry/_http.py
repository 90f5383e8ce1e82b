"""HTTP server spans named by route, with raw URLs kept out under the redaction switch.

Which instrumentation: opentelemetry-instrumentation-asgi (contrib), not
Starlette 1.10's experimental `starlette.middleware.opentelemetry`.

- Starlette's names spans by route (`scope["route"]`) and uses the stable
  HTTP conventions, but records no metrics at all (its meter_provider
  argument is unused in 1.10), is marked experimental (telemetry may change
  in a minor release), and always records the raw `url.path` and
  `url.query`.
- Contrib records `http.server.duration` per route template (the dashboards'
  request panels and the endpoint benchmark use it), `http.server.active_requests`
  (both without the Host header it would add: `_http_metrics`), honours `excluded_urls` and header-capture settings, and is what most apps
  already run. Its weakness is the span: named `{method} {raw path}` at
  start, with the raw path and query in `http.target` / `http.url`.

So contrib stays, and `_RouteSpan` (inside it, where its server span is
current) fixes the span once the router has matched: name `{method} {route}`
(or just `{method}` when nothing matched, so scanners cannot mint names),
`http.route` set; and when `OTEL_LOCK_REDACT` is on, `http.target` and
`http.url` are overwritten with the route template (query dropped; empty
when unmatched). Span processors' `on_start` still see the raw values;
exporters see the final ones.

A FastAPI app of a release that traces natively (0.165+: a server span, a
duration metric and operation spans per request once an SDK is installed)
would otherwise record every request twice, once outside it by contrib and
once inside by FastAPI. FastAPI steps aside when contrib's middleware is the
top of its own middleware stack (where contrib's own FastAPI instrumentation
puts it), so for such an app contrib goes there, around its error handler
(an unhandled exception is still a recorded 500), and the app itself is
returned. FastAPI's operation spans go with its server span; an app that
wants them keeps FastAPI's native telemetry and does not call
`instrument_app` (docs/observability.md, "FastAPI's own telemetry").
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping

from opentelemetry import metrics, trace

from ._redact import redaction_mode

if TYPE_CHECKING:
    from starlette.types import ASGIApp, Message, Receive, Scope, Send

_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "DELETE", "CONNECT", "OPTIONS", "TRACE", "PATCH"})


def instrument(app: ASGIApp, excluded_urls: str, tracer_provider: trace.TracerProvider | None,
               meter_provider: metrics.MeterProvider | None) -> ASGIApp:
    from opentelemetry.instrumentation.asgi import OpenTelemetryMiddleware

    from ._http_metrics import BoundedMeterProvider

    def wrap(inner: ASGIApp) -> ASGIApp:
        # No span per ASGI receive/send message: they double the middleware's
        # cost (measured in docs/benchmarks.md) and say nothing about locks.
        # Its metrics keep no client-chosen value (Host): see `_http_metrics`.
        middleware: ASGIApp = OpenTelemetryMiddleware(
            _RouteSpan(inner), excluded_urls=excluded_urls, exclude_spans=["receive", "send"],
            tracer_provider=tracer_provider, meter_provider=BoundedMeterProvider(meter_provider),
        )
        return middleware

    if not _traces_natively(app):
        return wrap(app)
    build = app.build_middleware_stack  # type: ignore[attr-defined]
    app.build_middleware_stack = lambda: wrap(build())  # type: ignore[attr-defined]
    return app


def _traces_natively(app: ASGIApp) -> bool:
    """A FastAPI app of a release with native telemetry, whose middleware stack is not built yet."""
    if not any(cls.__module__ == "fastapi.applications" and cls.__name__ == "FastAPI" for cls in type(app).__mro__):
        return False
    import importlib.util

    return (importlib.util.find_spec("fastapi.telemetry") is not None
            and getattr(app, "middleware_stack", True) is None)


def route_template(scope: Mapping[str, Any]) -> str | None:
    """The matched route's template with the mount prefix, as Starlette and the contrib metrics see it."""
    path_format = getattr(scope.get("route"), "path_format", None)
    if not isinstance(path_format, str):
        return None
    return scope.get("root_path", "").rstrip("/") + path_format or "/"


class _RouteSpan:
    """Renames the current server span by route when the response starts (or the app fails)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        span = trace.get_current_span()
        if scope["type"] != "http" or not span.is_recording():
            await self.app(scope, receive, send)
            return
        named = False

        async def send_named(message: Message) -> None:
            nonlocal named
            if not named and message["type"] == "http.response.start":
                named = True
                _name(span, scope)
            await send(message)

        try:
            await self.app(scope, receive, send_named)
        finally:
            if not named:
                _name(span, scope)


def _name(span: trace.Span, scope: Scope) -> None:
    method = str(scope.get("method", "")).upper()
    method = method if method in _METHODS else "HTTP"
    route = route_template(scope)
    span.update_name(f"{method} {route}" if route else method)
    if route:
        span.set_attribute("http.route", route)
    if redaction_mode() != "off":
        span.set_attribute("http.target", route or "")
        span.set_attribute("http.url", _url_without_path(scope) + (route or ""))


def _url_without_path(scope: Scope) -> str:
    scheme = scope.get("scheme", "http")
    server = scope.get("server")
    if not server:
        return ""
    host, port = server[0], server[1]
    default = (scheme == "http" and port == 80) or (scheme == "https" and port == 443)
    return f"{scheme}://{host}" + ("" if default or port is None else f":{port}")
