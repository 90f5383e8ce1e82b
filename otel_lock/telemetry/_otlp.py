"""OTLP export of the fast path: the lock's metrics and the SDK's in one request per interval.

The lock records into the children of `_prom.FastInstrument` whatever the
destination. `OtlpPush` exports them every ``OTEL_METRIC_EXPORT_INTERVAL``
(the SDK's variable and default, 60 s) together with what the SDK holds
(the HTTP instrumentation's metrics, read through an `InMemoryMetricReader`
on the meter provider), through the OTLP exporter: a lock cycle pays
sub-microsecond records instead of four SDK measurements (docs/benchmarks.md
measures the OTLP overhead), and with /metrics on too each measurement is recorded once
for both. Its thread restarts in a forked child, and `shutdown()` exports a
last time before the exporter closes.

Sums and histograms follow the exporter's temporality preference
(``OTEL_EXPORTER_OTLP_METRICS_TEMPORALITY_PREFERENCE``, see `_temporality`);
held and waiting counts stay cumulative, as the SDK keeps up-down counters
under every preference. Histogram exemplars are the last sampled measurement
of each bucket since the previous export, as the SDK's aligned-bucket
reservoir keeps them.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
import weakref
from typing import TYPE_CHECKING, Any

from opentelemetry import context as otel_context
from opentelemetry.sdk.metrics.export import (AggregationTemporality, Gauge, Histogram, HistogramDataPoint,
                                              InMemoryMetricReader, Metric, MetricExporter, MetricsData,
                                              NumberDataPoint, ResourceMetrics, ScopeMetrics, Sum)
from opentelemetry.sdk.util.instrumentation import InstrumentationScope

from .. import __version__
from .._fork import watch_fork
from . import _counts
from ._bounds import Limits
from ._instruments import NEW_SERIES, Seeded
from ._names import OBSERVED, RECORDED
from ._temporality import RecordedPoints

if TYPE_CHECKING:
    from opentelemetry.sdk.resources import Resource

    from ._prom import FastMetrics

log = logging.getLogger("otel_lock.telemetry")
CUMULATIVE = AggregationTemporality.CUMULATIVE


def _millis(variable: str, default: float) -> float:
    try:
        value = float(os.environ.get(variable, default))
    except ValueError:
        log.warning("otel-lock: %s=%r is not a number of milliseconds; using %s", variable,
                    os.environ.get(variable), default)
        return default
    return value if value > 0 else default


class OtlpPush:
    """Every interval: collect the SDK's metrics and the lock's, export them in one batch."""

    def __init__(self, exporter: MetricExporter, fast: FastMetrics, resource: Resource) -> None:
        self.exporter = exporter
        # The SDK's side: read on demand, with the exporter's preferences.
        self.reader = _PullReader(self)
        self._fast = fast
        self._resource = resource
        self._scope = InstrumentationScope("otel_lock", __version__)
        self._started = time.time_ns()
        self._limits = {which: Limits(spec.name, spec.labels) for which, spec in OBSERVED.items()}
        self._interval = _millis("OTEL_METRIC_EXPORT_INTERVAL", 60_000) / 1000
        self._timeout = _millis("OTEL_METRIC_EXPORT_TIMEOUT", 30_000)
        self._export_lock = threading.Lock()  # the exporter is never called concurrently
        self._seeding = threading.Lock()
        self._recorded = RecordedPoints(exporter)  # cumulative or delta, as the exporter prefers
        self.undelivered = 0  # data points of the last export, if it failed (named by a shutdown)
        # Hold gauges (age, lease) per lock name in the last export that reached the collector: a
        # name whose hold ended gets a last point at 0, or the collector keeps its old value.
        self._shown: dict[str, set[tuple[tuple[str, Any], ...]]] = {which: set() for which in _ENDING}
        self._showing: dict[str, set[tuple[tuple[str, Any], ...]]] = {}
        self._stop = threading.Event()
        self._soon = threading.Event()  # new series were seeded: announce them now (`_instruments.NEW_SERIES`)
        self._seeded: list[Seeded] = []
        self._closed = False
        self._start_thread()
        watch_fork(self._restart_in_child)
        NEW_SERIES.append(self.soon)

    def _restart_in_child(self) -> None:
        """A forked child (gunicorn --preload) has no thread of its parent's: start its own."""
        if not self._closed:
            self._export_lock = threading.Lock()  # the parent's thread may have held it at the fork
            self._seeding = threading.Lock()
            self._start_thread()

    def _start_thread(self) -> None:
        self._thread = threading.Thread(target=self._run, name="otel-lock OTLP metrics", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        next_at = time.monotonic() + self._interval
        while not self._stop.is_set():
            early = self._soon.wait(max(0.0, next_at - time.monotonic()))
            if self._stop.is_set():
                return
            if early:
                self._soon.clear()
                self.announce()
                if self._stop.wait(_EARLY_GAP):  # a burst of new names: at most one announcement a second
                    return
                continue
            next_at = time.monotonic() + self._interval
            self.export()

    def soon(self, seeded: list[Seeded]) -> None:
        """A manager started or saw a new lock name: its series at 0 go out before the interval is up."""
        with self._seeding:
            self._seeded += seeded
        self._soon.set()

    def announce(self) -> bool:
        """Export only the series seeded since the last announcement, at 0 (cumulative: with delta, a 0 is no news).

        Only the new series, never the current values: what a replica counted
        still leaves at its interval (or at shutdown), as before.
        """
        with self._seeding:
            seeded, self._seeded = self._seeded, []
        if not seeded or self._recorded.sums is not CUMULATIVE:
            return True
        now = time.time_ns()
        grouped: dict[str, list[tuple[dict[str, Any], int]]] = {}
        for attr, attributes, started in seeded:
            grouped.setdefault(attr, []).append((attributes, started))
        metrics = []
        for attr, points in grouped.items():
            spec = _SPECS[attr]
            if spec.kind == "histogram":
                data: Sum | Histogram = Histogram(
                    [HistogramDataPoint(a, start, now, 0, 0.0, [0] * (len(spec.buckets) + 1), list(spec.buckets),
                                        0.0, 0.0, []) for a, start in points], CUMULATIVE)
            else:
                data = Sum([NumberDataPoint(a, start, now, 0.0) for a, start in points], CUMULATIVE, is_monotonic=True)
            metrics.append(Metric(spec.name, spec.description, spec.unit, data))
        scope = ScopeMetrics(self._scope, metrics, "")
        with self._export_lock:
            if self._closed:
                return False
            return self._send(MetricsData([ResourceMetrics(self._resource, [scope], "")]), self._timeout)

    def _send(self, data: MetricsData, timeout_millis: float) -> bool:
        # The exporter's own HTTP client must not be traced or measured by an instrumentation.
        token = otel_context.attach(otel_context.set_value(otel_context._SUPPRESS_INSTRUMENTATION_KEY, True))
        try:
            return bool(self.exporter.export(data, timeout_millis=timeout_millis).name == "SUCCESS")
        except Exception:  # an export must never break the thread or the shutdown
            log.exception("otel-lock: exporting metrics failed")
            return False
        finally:
            otel_context.detach(token)

    def export(self, timeout_millis: float | None = None) -> bool:
        """One batch now: the SDK's metrics and the lock's. False if nothing could be sent."""
        with self._export_lock:
            if self._closed:
                return False
            data = self._with_lock_metrics(self.reader.get_metrics_data())
            if not data.resource_metrics:
                return True
            ok = self._send(data, timeout_millis or self._timeout)
            self.undelivered = 0 if ok else _points(data)
            if ok:  # a failed export's ended holds are sent at 0 again, its deltas carried over
                self._shown.update(self._showing)
                self._recorded.delivered()
            return ok

    def shutdown(self, timeout_millis: float = 10_000) -> bool:
        """Stop the thread, export a last time within `timeout_millis`, close the exporter (once)."""
        if self._closed:
            return True
        from ._shutdown import clamp_timeout

        deadline = time.monotonic() + timeout_millis / 1000
        self._stop.set()
        self._soon.set()  # wakes the thread
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(max(0.0, deadline - time.monotonic()))
        # The exporter's own timeout (retries included) would outlast the deadline: clamp it.
        clamp_timeout(self.exporter, deadline - time.monotonic())
        ok = self.export(max(1.0, (deadline - time.monotonic()) * 1000))
        with contextlib.suppress(ValueError):
            NEW_SERIES.remove(self.soon)
        with self._export_lock:
            self._closed = True
            self.exporter.shutdown(timeout_millis=max(1.0, (deadline - time.monotonic()) * 1000))
        return ok

    def _with_lock_metrics(self, data: MetricsData | None) -> MetricsData:
        resources = list(data.resource_metrics) if data is not None else []
        lock = self.lock_metrics()
        if not lock:
            return MetricsData(resources)
        scope = ScopeMetrics(self._scope, lock, "")
        for i, resource in enumerate(resources):
            if resource.resource == self._resource:
                resources[i] = ResourceMetrics(resource.resource, [*resource.scope_metrics, scope],
                                               resource.schema_url)
                break
        else:
            resources.append(ResourceMetrics(self._resource, [scope], ""))
        return MetricsData(resources)

    def lock_metrics(self) -> list[Metric]:
        """Every recorded instrument with data, and the observed gauges of the routed managers."""
        now = time.time_ns()
        found = [self._recorded.metric(instrument, now) for instrument in self._fast.instruments.values()]
        found += self._observed(now)
        return [metric for metric in found if metric is not None]

    def _observed(self, now: int) -> list[Metric | None]:
        from ._instruments import routed

        counts = [c for c in list(_counts.ALL_COUNTS) if routed(c.meter_provider)]
        found: list[Metric | None] = []
        for which, spec in OBSERVED.items():
            observed = _counts.observe(which, counts, self._limits[which])
            points = [NumberDataPoint(attributes, self._started, now, value) for attributes, value in observed]
            if which in _ENDING:
                points += self._ended(which, observed, now)
            if not points:
                found.append(None)
                continue
            data: Gauge | Sum = (Gauge(points) if spec.kind == "gauge"
                                 else Sum(points, CUMULATIVE, is_monotonic=False))
            found.append(Metric(spec.name, spec.description, spec.unit, data))
        return found


    def _ended(self, which: str, observed: list[tuple[dict[str, str], float]], now: int) -> list[NumberDataPoint]:
        """A last point at 0 for each lock name whose hold ended since the last delivered export.

        Left out instead, the collector keeps the last age and lease for its
        `metric_expiration`, and OtelLockHoldNearLease goes pending for a lock
        nobody holds. (OTLP's FLAG_NO_RECORDED_VALUE would say "ended" more
        precisely, but the Python SDK's NumberDataPoint has no flags and its
        encoder writes them for exponential histograms only: docs/observability.md,
        #ended-holds.) Age 0 over lease 0 is no ratio at all: the alert reads nothing.
        """
        current = {tuple(sorted(attributes.items())) for attributes, _ in observed}
        self._showing[which] = current
        return [NumberDataPoint(dict(key), self._started, now, 0.0)
                for key in sorted(self._shown[which] - current)]


_EARLY_GAP = 1.0
_SPECS = {spec.attr: spec for spec in RECORDED}

# The gauges of a current hold, per lock name: a name leaves them when its last hold ends.
_ENDING = ("hold_age", "lease")


class _PullReader(InMemoryMetricReader):
    """The meter provider's reader for `OtlpPush`: its force_flush and shutdown are the push's own.

    So `meter_provider.force_flush()` / `.shutdown()` export the lock's metrics
    too, as they would with the SDK's periodic reader.
    """

    def __init__(self, push: OtlpPush) -> None:
        super().__init__(preferred_temporality=push.exporter._preferred_temporality,
                         preferred_aggregation=push.exporter._preferred_aggregation)
        self._push = weakref.ref(push)

    def force_flush(self, timeout_millis: float = 10_000) -> bool:
        push = self._push()
        return push.export(timeout_millis) if push is not None else True

    def shutdown(self, timeout_millis: float = 30_000, **kwargs: Any) -> None:
        push = self._push()
        if push is not None:
            push.shutdown(timeout_millis)


def _points(data: MetricsData) -> int:
    return sum(len(metric.data.data_points) for resource in data.resource_metrics
               for scope in resource.scope_metrics for metric in scope.metrics)
