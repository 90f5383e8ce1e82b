"""Trace and span ids on otel-lock's own warnings, so a log line leads to its trace.

A lost lease, an opened circuit or a failed Redis call is logged on the
library's loggers while a request or job span is usually current: the filter
puts that span's ids on the record as `trace_id` and `span_id` (hex, as in a
traceparent) and under the names OpenTelemetry's logging instrumentation
uses (`otelTraceID`, `otelSpanID`, `otelTraceSampled`), so a format string or
a JSON formatter can print them. Only for a span that is still current: a
recording one, or an unsampled one whose ids still name the trace. An ended
span left in a background task's context (the lease watchdog was started
under some old request) gives none rather than a wrong trace. Records that
already carry ids (the logging instrumentation's) are left alone.
"""

from __future__ import annotations

import logging

from opentelemetry import trace

# The library's loggers (a filter on a logger applies to the records it creates).
LOGGERS = ("otel_lock", "otel_lock.middleware", "otel_lock.idempotency", "otel_lock.telemetry")


class TraceIds(logging.Filter):
    """Adds the current span's ids to warnings and errors; never drops a record."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING or hasattr(record, "trace_id"):
            return True
        span = trace.get_current_span()
        context = span.get_span_context()
        if context.is_valid and (span.is_recording() or not context.trace_flags.sampled):
            record.trace_id = record.otelTraceID = format(context.trace_id, "032x")
            record.span_id = record.otelSpanID = format(context.span_id, "016x")
            record.otelTraceSampled = context.trace_flags.sampled
        return True


_filter = TraceIds()


def install() -> None:
    """Once per process (idempotent): the filter on every logger of the library."""
    for name in LOGGERS:
        logger = logging.getLogger(name)
        if _filter not in logger.filters:
            logger.addFilter(_filter)
