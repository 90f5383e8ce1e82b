"""The fast path's recorded instruments as OTLP points, cumulative or delta.

``OTEL_EXPORTER_OTLP_METRICS_TEMPORALITY_PREFERENCE`` is read by the OTLP
exporter (`_preferred_temporality`); the SDK's own metrics follow it through
their reader, and the lock's follow it here, so one export never mixes the
two. Cumulative (the default): totals since each child was bound. Delta
(``delta``, or ``lowmemory`` for counters and histograms alike): the change
since the last *delivered* export, starting where that one ended; a failed
export's change is carried into the next, so nothing is lost or counted
twice. A delta histogram's min and max are those of its interval (read and
reset at each export: only OTLP reads them, /metrics has none).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable

from opentelemetry.sdk.metrics import Counter
from opentelemetry.sdk.metrics import Histogram as HistogramInstrument
from opentelemetry.sdk.metrics import Exemplar
from opentelemetry.sdk.metrics.export import (AggregationTemporality, Histogram, HistogramDataPoint, Metric,
                                              NumberDataPoint, Sum)

if TYPE_CHECKING:
    from ._prom import FastInstrument, _Child

CUMULATIVE = AggregationTemporality.CUMULATIVE
DELTA = AggregationTemporality.DELTA
_INF = float("inf")


class RecordedPoints:
    """Builds each export's points; `delivered()` after an export that reached the collector."""

    def __init__(self, exporter: Any) -> None:
        preferred = getattr(exporter, "_preferred_temporality", None) or {}
        self.sums = DELTA if preferred.get(Counter) is DELTA else CUMULATIVE
        self.histograms = DELTA if preferred.get(HistogramInstrument) is DELTA else CUMULATIVE
        # per child: (time, total, bucket counts) of the last delivered export, and of the one in flight
        self._base: dict[int, tuple[int, float, list[int]]] = {}
        self._next: dict[int, tuple[int, float, list[int]]] = {}
        self._range: dict[int, tuple[float, float]] = {}  # delta min/max not delivered yet

    def metric(self, instrument: FastInstrument, now: int) -> Metric | None:
        spec = instrument.spec
        children = instrument.children()
        if not children:
            return None
        if spec.kind != "histogram":
            sums = [self._sum(child, now) for child in children]
            return Metric(spec.name, spec.description, spec.unit, Sum(sums, self.sums, is_monotonic=True))
        points = [self._histogram(child, spec.buckets, now) for child in children]
        return Metric(spec.name, spec.description, spec.unit, Histogram(points, self.histograms))

    def delivered(self) -> None:
        self._base.update(self._next)
        self._next.clear()
        self._range.clear()

    def _sum(self, child: _Child, now: int) -> NumberDataPoint:
        with child.lock:
            total = child.total
        if self.sums is CUMULATIVE:
            return NumberDataPoint(child.attributes, child.started, now, total)
        start, before, _ = self._base.get(id(child), (child.started, 0.0, []))
        self._next[id(child)] = (now, total, [])
        return NumberDataPoint(child.attributes, start, now, total - before)

    def _histogram(self, child: _Child, bounds: Iterable[float], now: int) -> HistogramDataPoint:
        delta = self.histograms is DELTA
        with child.lock:
            counts, total, low, high = list(child.counts), child.total, child.low, child.high
            sampled, child.exemplars = child.exemplars, {}
            if delta:
                child.low, child.high = _INF, -_INF
        exemplars = [Exemplar({}, value, at, span_id, trace_id)
                     for _, (value, at, trace_id, span_id) in sorted(sampled.items())]
        if not delta:
            return HistogramDataPoint(child.attributes, child.started, now, sum(counts), total, counts,
                                      list(bounds), *_range(low, high), exemplars)
        start, before, before_counts = self._base.get(id(child), (child.started, 0.0, [0] * len(counts)))
        self._next[id(child)] = (now, total, counts)
        low0, high0 = self._range.get(id(child), (_INF, -_INF))
        low, high = min(low, low0), max(high, high0)
        self._range[id(child)] = (low, high)
        changed = [now_count - then for now_count, then in zip(counts, before_counts)]
        return HistogramDataPoint(child.attributes, start, now, sum(changed), total - before, changed,
                                  list(bounds), *_range(low, high), exemplars)


def _range(low: float, high: float) -> tuple[float, float]:
    """Min and max; 0 and 0 when nothing was recorded (a series seeded at 0), not infinities."""
    return (low, high) if low <= high else (0.0, 0.0)
