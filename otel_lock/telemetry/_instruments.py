"""Tracer, meter and instruments of otel-lock, created once per provider.

Everything goes through the OpenTelemetry API: with no SDK configured the
calls hit no-op implementations, and hot paths check `span.is_recording()`
before computing attributes. Tests pass their own providers.
"""

from __future__ import annotations

import threading
import weakref
from collections import Counter
from contextlib import contextmanager
from typing import Iterable, Iterator

from opentelemetry import context as otel_context
from opentelemetry import metrics, trace
from opentelemetry.metrics import CallbackOptions, Observation
from opentelemetry.trace import INVALID_SPAN, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from .. import __version__

SCOPE = "otel_lock"
WAIT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
HOLD_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)

_propagator = TraceContextTextMapPropagator()


class Telemetry:
    """The instruments of one (tracer provider, meter provider) pair."""

    def __init__(self, tracer_provider=None, meter_provider=None) -> None:
        self.tracer = trace.get_tracer(SCOPE, __version__, tracer_provider=tracer_provider)
        meter = metrics.get_meter(SCOPE, __version__, meter_provider=meter_provider)
        self.wait_duration = meter.create_histogram(
            "otel_lock.wait.duration", unit="s",
            description="Time from asking for a lock to getting it or giving up.",
            explicit_bucket_boundaries_advisory=WAIT_BUCKETS,
        )
        self.hold_duration = meter.create_histogram(
            "otel_lock.hold.duration", unit="s",
            description="Time a lock was held, from acquire to release or loss.",
            explicit_bucket_boundaries_advisory=HOLD_BUCKETS,
        )
        self.errors = meter.create_counter(
            "otel_lock.errors", unit="{error}", description="Failed lock operations by operation and error type.")
        self.renewals = meter.create_counter(
            "otel_lock.renewals", unit="{renewal}", description="Lease renewals by outcome (ok, lost, error).")
        # Held and waiting counts are read from the managers when a reader
        # collects, so taking a lock pays nothing for them. The set is shared
        # by every Telemetry and filtered by provider at collection time: a
        # manager made before the app installed its SDK (instruments through
        # the API's proxy) and one made after end up on the same meter, where
        # only the first observable callback is kept.
        self.gauges = ALL_COUNTS
        self._meter_provider = meter_provider
        self.active = meter.create_observable_up_down_counter(
            "otel_lock.active", callbacks=[self._observe("active")], unit="{lock}",
            description="Locks held by this process right now.")
        self.pending = meter.create_observable_up_down_counter(
            "otel_lock.pending", callbacks=[self._observe("pending")], unit="{request}",
            description="Callers waiting for a lock in this process.")
        self.idempotency_requests = meter.create_counter(
            "otel_lock.idempotency.requests", unit="{request}",
            description="Requests carrying an Idempotency-Key by outcome.")

    def _observe(self, which: str):
        def observe(options: CallbackOptions) -> Iterable[Observation]:
            totals: Counter = Counter()
            mine = _resolve(self._meter_provider)
            for counts in list(self.gauges):
                if _resolve(counts.meter_provider) is mine:
                    totals.update(dict(getattr(counts, which)))  # a copy: the loop thread keeps counting
            return [Observation(value, {"lock.name": name}) for name, value in totals.items()]
        return observe

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

    def start_hold_span(self, name: str, attributes: dict) -> trace.Span:
        """`lock hold {name}`: from acquired to released, a child of the current span if it records."""
        if not trace.get_current_span().is_recording():
            return INVALID_SPAN
        return self.tracer.start_span(f"lock hold {name}", kind=SpanKind.INTERNAL, attributes=attributes,
                                      record_exception=False, set_status_on_exception=False)

    @staticmethod
    def redact(attributes: dict) -> dict:
        return attributes

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
    def set_error(span: trace.Span, description: str) -> None:
        if span.is_recording():
            span.set_status(Status(StatusCode.ERROR, description))


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


ALL_COUNTS: "weakref.WeakSet[LockCounts]" = weakref.WeakSet()


def _resolve(meter_provider):
    return meter_provider if meter_provider is not None else metrics.get_meter_provider()


class LockCounts:
    """One manager's held and waiting callers by lock name, read by the observable counters."""

    def __init__(self, meter_provider=None) -> None:
        self.meter_provider = meter_provider
        self.active: Counter = Counter()
        self.pending: Counter = Counter()

    def hold_started(self, hold) -> None:
        self.active[hold.name] += 1

    def hold_ended(self, hold) -> None:
        self.active[hold.name] -= 1


# Keyed by the providers themselves (kept alive here), not their id(): a freed
# provider's id may be reused by a new one.
_cache: dict[tuple[object, object], Telemetry] = {}
_cache_lock = threading.Lock()


def get_telemetry(tracer_provider=None, meter_provider=None) -> Telemetry:
    """Instruments are created once per provider pair, never per manager or middleware."""
    key = (tracer_provider, meter_provider)
    with _cache_lock:
        telemetry = _cache.get(key)
        if telemetry is None:
            telemetry = _cache[key] = Telemetry(tracer_provider, meter_provider)
        return telemetry
