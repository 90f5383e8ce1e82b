"""Bounded shutdown: the last spans and metrics within `timeout`, and what could not be delivered named.

The SDK's own calls do not bound a collector that accepts and never answers:
the BatchSpanProcessor's force_flush ignores its timeout and exports with
the exporter's (10 s, retried with backoff) and says True whatever happened,
its shutdown joins its worker for up to 30 s, and the OTLP/HTTP exporters
(1.45) ignore the timeout an export is given. `shutdown(timeout=3)` took 29 s
and returned True with nothing delivered. Here each exporter's own timeout
is clamped to what is left, spans and metrics go out side by side (one
silent collector must not starve the other), each step runs on a daemon
thread joined against one deadline, and what failed or was still in flight
is named in a warning and makes `shutdown()` return False.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from typing import TYPE_CHECKING, Any, Callable, Sequence, TypeVar, cast

from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

if TYPE_CHECKING:
    from opentelemetry.sdk.metrics import MeterProvider as SdkMeterProvider
    from opentelemetry.sdk.trace import ReadableSpan
    from opentelemetry.sdk.trace import TracerProvider as SdkTracerProvider

    from ._otlp import OtlpPush
    from ._setup import TelemetrySetup

log = logging.getLogger("otel_lock.telemetry")
_T = TypeVar("_T")


class SpanDelivery(SpanExporter):
    """The span exporter of `setup()`, counting the spans it could not deliver and those in flight."""

    def __init__(self, exporter: SpanExporter) -> None:
        self.exporter = exporter
        self.failed = 0
        self.in_flight = 0
        self._lock = threading.Lock()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        with self._lock:
            self.in_flight += len(spans)
        result = SpanExportResult.FAILURE
        try:
            result = self.exporter.export(spans)
        finally:
            with self._lock:
                self.in_flight -= len(spans)
                if result is not SpanExportResult.SUCCESS:
                    self.failed += len(spans)
        return result

    def shutdown(self) -> None:
        self.exporter.shutdown()

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        return self.exporter.force_flush(timeout_millis)


_spans: weakref.WeakKeyDictionary[Any, tuple[BatchSpanProcessor, SpanDelivery]] = weakref.WeakKeyDictionary()


def add_span_exporter(tracer_provider: SdkTracerProvider, exporter: SpanExporter) -> None:
    """Batch `exporter`'s spans on `tracer_provider`, through a `SpanDelivery` that shutdown reads."""
    delivery = SpanDelivery(exporter)
    processor = BatchSpanProcessor(delivery)
    tracer_provider.add_span_processor(processor)
    _spans[tracer_provider] = (processor, delivery)


def clamp_timeout(exporter: Any, seconds: float) -> None:
    """Lower an OTLP exporter's own timeout (the whole export, retries included) to `seconds`.

    Where it lives differs by version: on the exporter (1.42) or on its HTTP
    client (1.45); an exporter without either is left alone (the deadline's
    thread join still bounds the wait).
    """
    seconds = max(0.001, seconds)
    for owner in (exporter, getattr(exporter, "_client", None)):
        current = getattr(owner, "_timeout", None)
        if owner is not None and isinstance(current, (int, float)) and not isinstance(current, bool):
            owner._timeout = min(float(current), seconds)


class _Step(threading.Thread):
    """One shutdown step on a daemon thread: `done` once it returned, `result` its value."""

    def __init__(self, name: str, step: Callable[[], Any]) -> None:
        super().__init__(name=f"otel-lock shutdown: {name}", daemon=True)
        self._step = step
        self.result: Any = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.result = self._step()
        except BaseException as exc:  # reported by the caller; a shutdown never raises
            self.error = exc


def _left(deadline: float) -> float:
    return max(0.0, deadline - time.monotonic())


def shutdown(installed: TelemetrySetup, timeout: float) -> bool:
    """Flush spans and export the last metrics side by side, then shut the providers down, all by `timeout`."""
    deadline = time.monotonic() + max(0.0, timeout)
    lost: list[str] = []
    spans = _spans.get(installed.tracer_provider)  # None: no tracer SDK of setup()'s (no OTLP, or traces off)
    tracer = cast("SdkTracerProvider", installed.tracer_provider) if spans is not None else None
    failed_before = spans[1].failed if spans is not None else 0
    steps: list[tuple[str, _Step]] = []
    if spans is not None:
        processor, delivery = spans
        clamp_timeout(delivery.exporter, _left(deadline))
        steps.append(("spans", _Step("spans", processor.force_flush)))
    push = installed.push
    if push is not None:
        clamp_timeout(push.exporter, _left(deadline))

    def metrics() -> None:
        # Its OTLP reader's shutdown is the push's: a last export of the lock's metrics and the SDK's.
        cast("SdkMeterProvider", installed.meter_provider).shutdown(max(1, int(_left(deadline) * 1000)))
    steps.append(("metrics", _Step("metrics", metrics)))
    for _, step in steps:
        step.start()
    for name, step in steps:
        step.join(_left(deadline))
        if step.error is not None:
            log.error("otel-lock: shutting telemetry down failed (%s)", name, exc_info=step.error)
            lost.append(f"{name}: the shutdown failed ({step.error!r})")
    if spans is not None:
        lost += _spans_lost(spans, failed_before, steps[0][1].is_alive())
    if push is not None:
        lost += _metrics_lost(push, steps[-1][1].is_alive())
    if tracer is not None:
        if spans is not None:
            clamp_timeout(spans[1].exporter, _left(deadline))
        closing = _Step("tracer provider", tracer.shutdown)
        closing.start()
        closing.join(_left(deadline))
    if lost:
        log.warning("otel-lock: telemetry shutdown (timeout %s s) could not deliver: %s", timeout, "; ".join(lost))
    return not lost


def _spans_lost(spans: tuple[BatchSpanProcessor, SpanDelivery], failed_before: int, running: bool) -> list[str]:
    processor, delivery = spans
    failed = delivery.failed - failed_before
    queued = len(getattr(getattr(processor, "_batch_processor", None), "_queue", ()))
    lost = []
    if failed:
        lost.append(f"{failed} spans (their export failed)")
    if running and (delivery.in_flight or queued):
        lost.append(f"{delivery.in_flight + queued} spans (in flight or queued when the time was up)")
    elif running:
        lost.append("spans (their flush had not returned when the time was up)")
    return lost


def _metrics_lost(push: OtlpPush, running: bool) -> list[str]:
    if running:
        return ["the last metrics export (no answer when the time was up)"]
    if push.undelivered:
        return [f"the last metrics export ({push.undelivered} points: it failed)"]
    return []
