"""Tracer, meter and instruments of otel-lock, created once per provider.

Everything goes through the OpenTelemetry API: with no SDK configured the
calls hit no-op implementations, and hot paths check `span.is_recording()`
before computing attributes. Tests pass their own providers.

Where metrics go: a `Telemetry` on the global meter provider (the usual
case) records into whatever `route_default_metrics()` chose. `setup()` routes
them to the prometheus-client fast path when /metrics is served, to an SDK
provider with only the OTLP reader when OTLP is on, or to both; without
`setup()` they go to the global SDK provider like any instrumentation.
"""

from __future__ import annotations

import threading
import weakref
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Mapping, Protocol

from opentelemetry import context as otel_context
from opentelemetry import metrics, trace
from opentelemetry.metrics import CallbackOptions, Observation
from opentelemetry.trace import INVALID_SPAN, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from .. import __version__
from . import _counts
from ._counts import ALL_COUNTS, LockCounts
from ._names import HOLD_BUCKETS, OBSERVED, RECORDED, WAIT_BUCKETS
from ._redact import redact

if TYPE_CHECKING:
    import weakref as _weakref

    from opentelemetry.context import Context
    from opentelemetry.util.types import Attributes, AttributeValue
    from prometheus_client import CollectorRegistry

    from ._prom import FastMetrics

__all__ = ["HOLD_BUCKETS", "LockCounts", "Telemetry", "WAIT_BUCKETS", "current_traceparent", "get_telemetry",
           "redact", "route_default_metrics", "routed", "suppressed"]

SCOPE = "otel_lock"
_propagator = TraceContextTextMapPropagator()


class HistogramSink(Protocol):
    """Where a duration goes: an OTel `Histogram`, a fast-path instrument, or both."""

    def record(self, amount: float, attributes: Attributes = None, context: Context | None = None) -> None: ...


class CounterSink(Protocol):
    """Where a count goes: an OTel `Counter`, a fast-path instrument, or both."""

    def add(self, amount: float, attributes: Attributes = None, context: Context | None = None) -> None: ...


class _Tee:
    """Record into several sinks (fast path and an OTLP-only SDK provider)."""

    __slots__ = ("_sinks",)

    def __init__(self, sinks: Iterable[Any]) -> None:
        # Any: one attribute's sinks are all histograms or all counters (see `_names`).
        self._sinks: tuple[Any, ...] = tuple(sinks)

    def record(self, amount: float, attributes: Attributes = None, context: Context | None = None) -> None:
        for sink in self._sinks:
            sink.record(amount, attributes, context)

    def add(self, amount: float, attributes: Attributes = None, context: Context | None = None) -> None:
        for sink in self._sinks:
            sink.add(amount, attributes, context)


class _Route:
    """Where the global-provider Telemetry records: fast path, an SDK provider, or both."""

    def __init__(self, fast: FastMetrics | None = None, meter_provider: metrics.MeterProvider | None = None,
                 global_provider: metrics.MeterProvider | None = None) -> None:
        self.fast = fast
        self.global_provider = global_provider
        self.sdk = _sdk_instruments(meter_provider, None, is_route=True) if meter_provider is not None else None

    def instrument(self, attr: str) -> Any:
        sinks = [s[attr] if isinstance(s, dict) else s.instruments[attr] for s in (self.sdk, self.fast) if s]
        return sinks[0] if len(sinks) == 1 else _Tee(sinks)


_route: _Route | None = None


def routed(meter_provider: metrics.MeterProvider | None) -> bool:
    """Does a manager made with this `meter_provider` record through the route of `setup()`?

    The global provider, named (`meter_provider=installed.meter_provider`) or
    not (None): otherwise the SDK's Prometheus reader would expose a second
    copy of the fast path's families on the same /metrics.
    """
    route = _route
    return route is not None and (meter_provider is None or meter_provider is route.global_provider)


class Telemetry:
    """The instruments of one (tracer provider, meter provider) pair."""

    tracer: trace.Tracer
    # Every manager's counts (`_counts.ALL_COUNTS`), read when a reader collects.
    gauges: _weakref.WeakSet[LockCounts]
    # Recorded instruments, one per `_names.RECORDED` entry; set (and re-set by
    # `route_default_metrics`) in `_bind`.
    wait_duration: HistogramSink
    hold_duration: HistogramSink
    redis_duration: HistogramSink
    errors: CounterSink
    renewals: CounterSink
    idempotency_requests: CounterSink
    circuit_opened: CounterSink
    fail_open: CounterSink
    periodic_runs: CounterSink

    def __init__(self, tracer_provider: trace.TracerProvider | None = None,
                 meter_provider: metrics.MeterProvider | None = None) -> None:
        self.tracer = trace.get_tracer(SCOPE, __version__, tracer_provider=tracer_provider)
        self._meter_provider = meter_provider
        # Held and waiting counts are read from the managers when a reader
        # collects, so taking a lock pays nothing for them.
        self.gauges = ALL_COUNTS
        self._own = _sdk_instruments(meter_provider, self)
        self._bind()

    def _bind(self) -> None:
        route = _route if routed(self._meter_provider) else None
        for spec in RECORDED:
            setattr(self, spec.attr, route.instrument(spec.attr) if route else self._own[spec.attr])

    # -- spans -------------------------------------------------------------

    @contextmanager
    def acquire_span(self, name: str) -> Iterator[trace.Span]:
        """`lock acquire {name}`: covers the wait; the caller sets outcome attributes.

        Only under a recording span (a request, a job): an acquire outside any
        trace would start a one-span trace per lock call, noise that costs more
        than the lock's own Python work. Metrics count every acquire either way.
        """
        if not trace.get_current_span().is_recording():
            yield INVALID_SPAN
            return
        with self.tracer.start_as_current_span(
            f"lock acquire {name}", kind=SpanKind.INTERNAL,
            record_exception=False, set_status_on_exception=False,
        ) as span:
            yield span

    def start_hold_span(self, name: str, attributes: Mapping[str, AttributeValue]) -> trace.Span:
        """`lock hold {name}`: from acquired to released, a child of the current span, not made current.

        Its own span, so hold time reaches the trace even when the framework
        ends the request span before the lock is released (ASGI
        instrumentations end it at the last body message). Non-recording
        outside a recording span, like the acquire span. The caller ends it,
        e.g. with `end_hold_span`.
        """
        if not trace.get_current_span().is_recording():
            return INVALID_SPAN
        return self.tracer.start_span(f"lock hold {name}", kind=SpanKind.INTERNAL,
                                      attributes=redact(attributes), record_exception=False,
                                      set_status_on_exception=False)

    @staticmethod
    def end_hold_span(span: trace.Span, outcome: str) -> None:
        """Set `lock.release.outcome`; lost, expired and error make the span an Error."""
        if not span.is_recording():
            return
        span.set_attribute("lock.release.outcome", outcome)
        if outcome in ("lost", "expired", "error"):
            span.set_status(Status(StatusCode.ERROR, f"lock {outcome}"))
        span.end()

    @staticmethod
    def redact(attributes: Mapping[str, AttributeValue]) -> Mapping[str, AttributeValue]:
        """Span attributes with `lock.key` / `lock.owner` hashed or dropped, per `configure_redaction`."""
        return redact(attributes)

    @staticmethod
    def link_holder(span: trace.Span, holder_context: str | None) -> None:
        """Link a waiter's span to the span that held the lock when it arrived."""
        if not holder_context or not span.is_recording():
            return
        ctx = _propagator.extract({"traceparent": holder_context})
        holder = trace.get_current_span(ctx).get_span_context()
        if holder.is_valid:
            span.add_link(holder, {"lock.link": "holder"})

    @staticmethod
    def set_error(span: trace.Span, error_type: str, server: str = "") -> None:
        """A failed acquire: `error.type` and, by the database conventions, the Redis server it asked."""
        if not span.is_recording():
            return
        span.set_status(Status(StatusCode.ERROR, error_type))
        attributes: dict[str, AttributeValue] = {"error.type": error_type, "db.system.name": "redis",
                                                 "db.system": "redis"}
        first = server.split(",", 1)[0]
        host, sep, port = first.rpartition(":")
        if sep and port.isdigit():
            attributes["server.address"], attributes["server.port"] = host, int(port)
        elif first:
            attributes["server.address"] = first
        span.set_attributes(attributes)


def _sdk_instruments(meter_provider: metrics.MeterProvider | None, owner: Telemetry | None,
                     is_route: bool = False) -> dict[str, Any]:
    """The OTel instruments of `_names` on one meter (observed ones read `ALL_COUNTS` at collection)."""
    meter = metrics.get_meter(SCOPE, __version__, meter_provider=meter_provider)
    made: dict[str, Any] = {}
    for spec in RECORDED:
        if spec.kind == "histogram":
            made[spec.attr] = meter.create_histogram(spec.name, unit=spec.unit, description=spec.description,
                                                     explicit_bucket_boundaries_advisory=spec.buckets)
        else:
            made[spec.attr] = meter.create_counter(spec.name, unit=spec.unit, description=spec.description)
    mine: Callable[[LockCounts], bool] = (
        (lambda c: routed(c.meter_provider)) if is_route else _same_provider(owner))
    for which, gauge in OBSERVED.items():
        create = (meter.create_observable_gauge if gauge.kind == "gauge"
                  else meter.create_observable_up_down_counter)
        made[which] = create(gauge.name, callbacks=[_observe(which, mine)], unit=gauge.unit,
                             description=gauge.description)
    return made


def _same_provider(owner: Telemetry | None) -> Callable[[LockCounts], bool]:
    ref = weakref.ref(owner) if owner is not None else None

    def mine(counts: LockCounts) -> bool:
        telemetry = ref() if ref is not None else None
        # Routed away (fast path / OTLP-only provider): these copies stay silent,
        # or /metrics would show every family twice.
        if telemetry is None or routed(telemetry._meter_provider) or routed(counts.meter_provider):
            return False
        # A manager made before the app installed its SDK (the API's proxy) and one
        # made after end up on the same meter, where only the first callback is kept.
        return _resolve(counts.meter_provider) is _resolve(telemetry._meter_provider)
    return mine


def _observe(which: str, mine: Callable[[LockCounts], bool]) -> Callable[[CallbackOptions], Iterable[Observation]]:
    def observe(options: CallbackOptions) -> Iterable[Observation]:
        counts = [c for c in list(ALL_COUNTS) if mine(c)]
        if which in ("active", "pending"):
            return [Observation(v, {"lock.name": n}) for n, v in _counts.totals(counts, which).items()]
        if which in ("hold_age", "lease"):
            index = 0 if which == "hold_age" else 1
            return [Observation(v[index], {"lock.name": n}) for n, v in _counts.oldest(counts).items()]
        if which == "circuit_state":
            return [Observation(state, {"db.client.connection.pool.name": p})
                    for p, state in _counts.circuits(counts).items()]
        figures = _counts.connections(counts)
        if which == "connections":
            return [Observation(used, {"db.client.connection.state": "used", "db.client.connection.pool.name": p})
                    for p, (used, _) in figures.items()]
        return [Observation(pending, {"db.client.connection.pool.name": p}) for p, (_, pending) in figures.items()]
    return observe


def _resolve(meter_provider: metrics.MeterProvider | None) -> metrics.MeterProvider:
    return meter_provider if meter_provider is not None else metrics.get_meter_provider()


def route_default_metrics(registry: CollectorRegistry | None = None, meter_provider: metrics.MeterProvider | None = None,
                          global_provider: metrics.MeterProvider | None = None) -> None:
    """Send the global-provider Telemetry's metrics to prometheus-client `registry` and/or `meter_provider`.

    Called by `setup()`, which names the global provider it installed
    (`global_provider`: managers given it explicitly are routed too);
    `route_default_metrics()` with no arguments restores the default (the
    global SDK provider). Telemetry objects already handed out are rebound in
    place: managers keep working across the switch.
    """
    global _route
    from ._prom import FastMetrics

    with _cache_lock:
        fast = FastMetrics(registry) if registry is not None else None
        _route = _Route(fast, meter_provider, global_provider) if (fast or meter_provider is not None) else None
        for telemetry in _cache.values():
            telemetry._bind()


def current_traceparent() -> str:
    """The W3C traceparent of the current span, stored with a held lock ('' if none)."""
    carrier: dict[str, str] = {}
    _propagator.inject(carrier)
    return carrier.get("traceparent", "")


@contextmanager
def suppressed() -> Iterator[None]:
    """Keep Redis instrumentations from making a span per lock poll or renewal."""
    token = otel_context.attach(otel_context.set_value(otel_context._SUPPRESS_INSTRUMENTATION_KEY, True))
    try:
        yield
    finally:
        otel_context.detach(token)


# Keyed by the providers themselves (kept alive here), not their id(): a freed
# provider's id may be reused by a new one.
_cache: dict[tuple[object, object], Telemetry] = {}
_cache_lock = threading.RLock()


def get_telemetry(tracer_provider: trace.TracerProvider | None = None,
                  meter_provider: metrics.MeterProvider | None = None) -> Telemetry:
    """Instruments are created once per provider pair, never per manager or middleware."""
    key = (tracer_provider, meter_provider)
    with _cache_lock:
        telemetry = _cache.get(key)
        if telemetry is None:
            telemetry = _cache[key] = Telemetry(tracer_provider, meter_provider)
        return telemetry
