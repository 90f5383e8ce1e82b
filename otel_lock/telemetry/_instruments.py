"""Tracer, meter and instruments of otel-lock, created once per provider.

Everything goes through the OpenTelemetry API: with no SDK configured the
calls hit no-op implementations, and hot paths check `span.is_recording()`
before computing attributes. Tests pass their own providers.

Where metrics go: a `Telemetry` on the global meter provider (the usual
case) records into whatever `route_default_metrics()` chose. `setup()` routes
them to the fast path (`_prom`): children bound per label set, read by
/metrics and by the OTLP reader alike. Without `setup()` they go to the
global SDK provider like any instrumentation, through `_Bounded`, which
holds the same per-instrument limits (`_bounds`).
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
from . import _counts, _logs
from ._counts import ALL_COUNTS, LockCounts
from ._bounds import Limits, ValueLimit, configured_limit
from ._names import (ERROR_SEEDS, HOLD_BUCKETS, NAME_SEEDS, OBSERVED, POOL_SEED, RECORDED, WAIT_BUCKETS, Spec,
                     prom_value)
from ._redact import redact

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.util.types import Attributes, AttributeValue

    from ._prom import FastMetrics

__all__ = ["HOLD_BUCKETS", "LockCounts", "Telemetry", "WAIT_BUCKETS", "current_traceparent", "get_telemetry",
           "redact", "route_default_metrics", "routed", "suppressed"]

SCOPE = "otel_lock"
_propagator = TraceContextTextMapPropagator()
_logs.install()  # trace and span ids on the library's warnings


class HistogramSink(Protocol):
    """Where a duration goes: an OTel `Histogram`, a fast-path instrument, or both."""

    def record(self, amount: float, attributes: Attributes = None, context: Context | None = None) -> None: ...


class CounterSink(Protocol):
    """Where a count goes: an OTel `Counter`, a fast-path instrument, or both."""

    def add(self, amount: float, attributes: Attributes = None, context: Context | None = None) -> None: ...


class _Bounded:
    """An SDK instrument behind the limits of `_bounds`: only declared attributes, values past the limit folded.

    Attribute sets seen before are cached (a tuple hash and a dict lookup per
    record); folded ones are not, so the cache stays bounded too.
    """

    __slots__ = ("_sink", "_limits", "_known")

    def __init__(self, sink: Any, spec: Spec) -> None:
        self._sink = sink  # Any: an OTel Histogram or Counter, as the spec says (see `_names`)
        self._limits = Limits(spec.name, spec.labels)
        self._known: dict[tuple[tuple[str, Any], ...], Attributes] = {}

    def _safe(self, attributes: Attributes) -> Attributes:
        key = tuple(attributes.items()) if attributes else ()
        safe = self._known.get(key)
        if safe is not None:
            return safe
        kept: dict[str, Any] = {}
        folded = False
        for name, value in (attributes or {}).items():
            if value is None:
                continue
            text = prom_value(value)
            admitted = self._limits.admit(name, text)
            if admitted is not None:
                folded |= admitted is not text
                kept[name] = value if admitted is text else admitted
        if not folded:
            self._known[key] = kept
        return kept

    def record(self, amount: float, attributes: Attributes = None, context: Context | None = None) -> None:
        self._sink.record(amount, self._safe(attributes), context)

    def add(self, amount: float, attributes: Attributes = None, context: Context | None = None) -> None:
        self._sink.add(amount, self._safe(attributes), context)


class _Route:
    """Where the global-provider Telemetry records: the fast path of `setup()`."""

    def __init__(self, fast: FastMetrics, global_provider: metrics.MeterProvider | None = None) -> None:
        self.fast = fast
        self.global_provider = global_provider

    def instrument(self, attr: str) -> Any:
        return self.fast.instruments[attr]


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
    gauges: _Managers
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
        # Span names carry lock.name too: the same bound as every instrument's.
        self._span_names = ValueLimit("span names of otel_lock")
        # Held and waiting counts are read from the managers when a reader
        # collects, so taking a lock pays nothing for them.
        self.gauges = _Managers(self)
        self._named: set[str] = set()  # lock names seeded, up to the name limit (past it, they fold)
        self._own = _sdk_instruments(meter_provider, self)
        self._bind()

    def _bind(self) -> None:
        route = _route if routed(self._meter_provider) else None
        for spec in RECORDED:
            setattr(self, spec.attr, route.instrument(spec.attr) if route else self._own[spec.attr])
        # Routed elsewhere (`setup()` after the managers were made): their series start at 0 there too.
        for counts in list(ALL_COUNTS):
            if counts.seeds is self:
                counts.seed_again()

    # -- series at 0 before their first event (`_names.NAME_SEEDS`) ----------

    def seed_manager(self) -> None:
        """A manager started: its Redis error series exist at 0."""
        _new_series([_zero(self.errors, "errors", attributes) for attributes in ERROR_SEEDS])

    def seed_name(self, name: str) -> None:
        """A manager saw lock `name` for the first time: its outcome series exist at 0."""
        seeded = [_zero(getattr(self, attr), attr, {"lock.name": name, **attributes})
                  for attr, attributes in NAME_SEEDS]
        if name not in self._named and len(self._named) < _NAME_LIMIT:
            self._named.add(name)
            _new_series(seeded)

    def seed_pool(self, pool: str) -> None:
        """A manager's circuit breaker exists: its openings count from 0."""
        _new_series([_zero(self.circuit_opened, POOL_SEED, {"db.client.connection.pool.name": pool})])

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
            f"lock acquire {self._span_names.admit(name)}", kind=SpanKind.INTERNAL,
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
        return self.tracer.start_span(f"lock hold {self._span_names.admit(name)}", kind=SpanKind.INTERNAL,
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


_KINDS = {spec.attr: spec.kind for spec in RECORDED}
_NAME_LIMIT = configured_limit()
# A seeded fast-path series: (instrument attr, its attributes as bound, when its child was bound).
Seeded = tuple[str, dict[str, Any], int]
# Told of the series just seeded on the fast path: the OTLP push announces them at 0 at once, not an
# interval later (`_otlp`), so the collector has the 0 before the first event.
NEW_SERIES: list[Callable[[list[Seeded]], None]] = []


def _new_series(seeded: list[Seeded | None]) -> None:
    found = [one for one in seeded if one is not None]
    if found:
        for hook in list(NEW_SERIES):
            hook(found)


def _zero(sink: Any, attr: str, attributes: dict[str, Any]) -> Seeded | None:
    """Create the series of `attributes` at 0: an empty child on the fast path, a counter's add(0) on the SDK.

    An SDK histogram has no way to hold a point without a measurement: left out.
    """
    bind = getattr(sink, "_bind", None)
    if bind is not None:
        child = bind(tuple(attributes.items()), attributes)
        return attr, child.attributes, child.started
    if _KINDS[attr] != "histogram":
        sink.add(0, attributes)
    return None


class _Managers:
    """`Telemetry.gauges`: every manager's counts (`ALL_COUNTS`); adding one seeds its series from this telemetry."""

    def __init__(self, telemetry: Telemetry) -> None:
        self._telemetry = telemetry

    def add(self, counts: LockCounts) -> None:
        ALL_COUNTS.add(counts)
        counts.seed_with(self._telemetry)

    def __iter__(self) -> Iterator[LockCounts]:
        return iter(list(ALL_COUNTS))

    def __len__(self) -> int:
        return len(ALL_COUNTS)


def _sdk_instruments(meter_provider: metrics.MeterProvider | None, owner: Telemetry) -> dict[str, Any]:
    """The OTel instruments of `_names` on one meter (observed ones read `ALL_COUNTS` at collection)."""
    meter = metrics.get_meter(SCOPE, __version__, meter_provider=meter_provider)
    made: dict[str, Any] = {}
    for spec in RECORDED:
        if spec.kind == "histogram":
            sink: Any = meter.create_histogram(spec.name, unit=spec.unit, description=spec.description,
                                               explicit_bucket_boundaries_advisory=spec.buckets)
        else:
            sink = meter.create_counter(spec.name, unit=spec.unit, description=spec.description)
        made[spec.attr] = _Bounded(sink, spec)
    mine = _same_provider(owner)
    for which, gauge in OBSERVED.items():
        create = (meter.create_observable_gauge if gauge.kind == "gauge"
                  else meter.create_observable_up_down_counter)
        made[which] = create(gauge.name, callbacks=[_observe(which, mine)], unit=gauge.unit,
                             description=gauge.description)
    return made


def _same_provider(owner: Telemetry) -> Callable[[LockCounts], bool]:
    ref = weakref.ref(owner)

    def mine(counts: LockCounts) -> bool:
        telemetry = ref()
        # Routed away (fast path / OTLP-only provider): these copies stay silent,
        # or /metrics would show every family twice.
        if telemetry is None or routed(telemetry._meter_provider) or routed(counts.meter_provider):
            return False
        # A manager made before the app installed its SDK (the API's proxy) and one
        # made after end up on the same meter, where only the first callback is kept.
        return _resolve(counts.meter_provider) is _resolve(telemetry._meter_provider)
    return mine


def _observe(which: str, mine: Callable[[LockCounts], bool]) -> Callable[[CallbackOptions], Iterable[Observation]]:
    limits = Limits(OBSERVED[which].name, OBSERVED[which].labels)

    def observe(options: CallbackOptions) -> Iterable[Observation]:
        counts = [c for c in list(ALL_COUNTS) if mine(c)]
        return [Observation(value, attributes) for attributes, value in _counts.observe(which, counts, limits)]
    return observe


def _resolve(meter_provider: metrics.MeterProvider | None) -> metrics.MeterProvider:
    return meter_provider if meter_provider is not None else metrics.get_meter_provider()


def route_default_metrics(fast: FastMetrics | None = None, global_provider: metrics.MeterProvider | None = None) -> None:
    """Send the global-provider Telemetry's metrics to the fast path `fast` (None: back to the global SDK provider).

    Called by `setup()`, which names the global provider it installed
    (`global_provider`: managers given it explicitly are routed too).
    Telemetry objects already handed out are rebound in place: managers keep
    working across the switch.
    """
    global _route
    with _cache_lock:
        _route = _Route(fast, global_provider) if fast is not None else None
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
