"""The fast path: lock metrics recorded straight into children bound per label set.

The OpenTelemetry SDK has no bound instruments: every record hashes its
attribute set again, per reader (about 5 us with one reader). A lock cycle
records four times, so the SDK alone cost a quarter of the cycle. Here each
distinct attribute dict maps once to a child bound to its label set, and a
record is a dict lookup, a bisect and a few additions under an uncontended
lock (under 1 us). The children are read by whoever exports them: a
prometheus-client collector at scrape time (/metrics, `FastMetrics`), and
the OTLP reader of `setup()` at each export (`_otlp`). One recording, any
number of destinations.

Same family names and label sets as the SDK's Prometheus reader (see
`_names`; a label appears only where an attribute was given), without its
`otel_scope_*` labels. Exemplars are sampled only when OTLP is on (they
travel by OTLP; /metrics carries none).

Bounded by construction: a child is bound only for attributes the
instrument declares, and each attribute admits at most
`OTEL_LOCK_NAME_LIMIT` distinct values (`_bounds`); later ones are recorded
under `_overflow` and never cached, so neither the series nor the cache grow.
"""

from __future__ import annotations

import threading
import time
from bisect import bisect_left
from typing import TYPE_CHECKING, Any, Iterable, Mapping

from opentelemetry import trace
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from . import _counts
from ._bounds import Limits
from ._names import OBSERVED, RECORDED, Spec, prom_label, prom_value

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.util.types import Attributes, AttributeValue
    from prometheus_client.metrics_core import Metric

# The attribute items a record was called with, and the label set they map to.
_AttributeKey = tuple[tuple[str, "AttributeValue"], ...]
_LabelKey = tuple[tuple[str, str], ...]
# value, time, trace id, span id of the last sampled measurement of one bucket
Exemplar = tuple[float, int, int, int]


class _Child:
    """One label set's value: a counter total, or a histogram's per-bucket counts, sum, min and max."""

    __slots__ = ("labels", "attributes", "counts", "total", "low", "high", "exemplars", "started", "lock")

    def __init__(self, labels: dict[str, str], attributes: dict[str, AttributeValue], buckets: int) -> None:
        self.labels = labels
        self.attributes = attributes  # as recorded (OTLP keeps types and dotted names), values bounded
        self.counts = [0] * (buckets + 1)  # the last one is +Inf
        self.total = 0.0
        self.low = float("inf")
        self.high = float("-inf")
        self.exemplars: dict[int, Exemplar] = {}
        self.started = time.time_ns()
        # Records may come from several threads (the sync wrapper, apps with threads);
        # an uncontended lock is cheaper than a lost update.
        self.lock = threading.Lock()


class FastInstrument:
    """`record()`/`add()` like an OTel instrument; children cached by the attribute items."""

    __slots__ = ("spec", "exemplars", "_bounds", "_children", "_by_labels", "_histogram", "_binding", "_limits")

    def __init__(self, spec: Spec, exemplars: bool = False) -> None:
        self.spec = spec
        self.exemplars = exemplars and spec.kind == "histogram"
        self._bounds = tuple(spec.buckets)
        self._children: dict[_AttributeKey, _Child] = {}
        self._by_labels: dict[_LabelKey, _Child] = {}
        self._histogram = spec.kind == "histogram"
        self._binding = threading.Lock()  # two threads binding one new label set must share a child
        self._limits = Limits(spec.name, spec.labels)

    def record(self, amount: float, attributes: Attributes = None, context: Context | None = None) -> None:
        # The core builds its attribute dicts in a fixed order per call site, so
        # the items tuple is a stable, cheap cache key.
        key = tuple(attributes.items()) if attributes else ()
        child = self._children.get(key)
        if child is None:
            child = self._bind(key, attributes or {})
        if not self._histogram:
            with child.lock:
                child.total += amount
            return
        index = bisect_left(self._bounds, amount)  # first bound >= amount: buckets are `le`
        with child.lock:
            child.counts[index] += 1
            child.total += amount
            if amount < child.low:
                child.low = amount
            if amount > child.high:
                child.high = amount
        if self.exemplars:
            span = trace.get_current_span(context).get_span_context()
            if span.trace_flags.sampled:  # the SDK's default, trace-based exemplar filter
                child.exemplars[index] = (amount, time.time_ns(), span.trace_id, span.span_id)

    add = record

    def _bind(self, key: _AttributeKey, attributes: Mapping[str, AttributeValue]) -> _Child:
        # Like the SDK's reader: one label per attribute given, none for one absent.
        kept: dict[str, AttributeValue] = {}
        folded = False
        for name, value in attributes.items():
            if value is None:
                continue
            text = prom_value(value)
            admitted = self._limits.admit(name, text)
            if admitted is None:  # not an attribute of this instrument: never a label
                continue
            folded |= admitted is not text
            kept[name] = value if admitted is text else admitted
        labels = {prom_label(name): prom_value(value) for name, value in kept.items()}
        canonical = tuple(sorted(labels.items()))
        with self._binding:
            child = self._by_labels.get(canonical)
            if child is None:
                child = self._by_labels[canonical] = _Child(labels, kept, len(self._bounds))
            if not folded:  # an overflowing key is bound again each time: the cache stays bounded
                self._children[key] = child
        return child

    def children(self) -> list[_Child]:
        return list(self._by_labels.values())

    def family(self) -> Metric:
        """The Prometheus family: label names are those used by any child ("" where one has none)."""
        spec = self.spec
        children = self.children()
        names = sorted({name for child in children for name in child.labels})
        if not self._histogram:
            counter = CounterMetricFamily(spec.prom, spec.description, labels=names)
            for child in children:
                with child.lock:
                    total = child.total
                counter.add_metric([child.labels.get(name, "") for name in names], total)
            return counter
        histogram = HistogramMetricFamily(spec.prom, spec.description, labels=names)
        for child in children:
            values = [child.labels.get(name, "") for name in names]
            with child.lock:
                counts, total = list(child.counts), child.total
            cumulative, buckets = 0, []
            for bound, count in zip(self._bounds + (float("inf"),), counts):
                cumulative += count
                buckets.append((floatToGoString(bound), cumulative))
            histogram.add_metric(values, buckets, total)
        return histogram


class FastMetrics:
    """The recorded instruments of `_names.RECORDED`; on a registry (/metrics) when one is given."""

    def __init__(self, registry: CollectorRegistry | None = None, *, exemplars: bool = False) -> None:
        self.registry = registry
        self.instruments = {spec.attr: FastInstrument(spec, exemplars) for spec in RECORDED}
        if registry is not None:
            registry.register(_RecordedCollector(self))
            registry.register(GaugeCollector())


class _RecordedCollector(Collector):
    def __init__(self, fast: FastMetrics) -> None:
        self.fast = fast

    def collect(self) -> Iterable[Metric]:
        return [instrument.family() for instrument in self.fast.instruments.values()]

    def describe(self) -> Iterable[Metric]:
        return self.collect()


class GaugeCollector(Collector):
    """Held, waiting, oldest hold age and lease, Redis connections, circuits: read over managers at scrape time.

    Only managers on the global provider `setup()` installed (named or
    not): one made with another provider reports through that provider.
    """

    def __init__(self) -> None:
        self._limits = {which: Limits(spec.name, spec.labels) for which, spec in OBSERVED.items()}

    def collect(self) -> Iterable[GaugeMetricFamily]:
        from ._instruments import routed

        counts = [c for c in list(_counts.ALL_COUNTS) if routed(c.meter_provider)]
        for which, spec in OBSERVED.items():
            family = GaugeMetricFamily(spec.prom, spec.description, labels=[prom_label(n) for n in spec.labels])
            for attributes, value in _counts.observe(which, counts, self._limits[which]):
                family.add_metric([str(attributes.get(name, "")) for name in spec.labels], value)
            yield family

    def describe(self) -> Iterable[GaugeMetricFamily]:
        return [GaugeMetricFamily(spec.prom, spec.description, labels=[]) for spec in OBSERVED.values()]


class TargetInfo(Collector):
    """`target_info`: the replica's resource on its own /metrics, whatever its metrics exporter.

    Prometheus scrapes every replica for `up`; with `target_info` it also
    learns which `service.instance.id` answers at each address, so a rule can
    tell a replica whose lock metrics stop arriving through a collector
    (OtelLockTelemetryMissing) from one that is simply down.
    """

    def __init__(self, attributes: Mapping[str, Any]) -> None:
        self._labels = {prom_label(str(k)): prom_value(v) for k, v in sorted(attributes.items())}

    def collect(self) -> Iterable[Metric]:
        family = GaugeMetricFamily("target_info", "Target metadata", labels=list(self._labels))
        family.add_metric(list(self._labels.values()), 1)
        yield family
