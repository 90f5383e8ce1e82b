"""The /metrics fast path: lock metrics recorded straight into prometheus-client.

The OpenTelemetry SDK has no bound instruments: every record hashes its
attribute set again, per reader (about 5 us with one reader). A lock cycle
records two or three times, so the SDK alone cost a quarter of the cycle.
Here each distinct attribute dict maps once to a child bound to its label
set, and a record is a dict lookup, a bisect and two additions under an
uncontended lock (under 1 us); a prometheus-client collector turns the
children into families at scrape time.

Same family names and label sets as the SDK's Prometheus reader (see
`_names`; a label appears only where an attribute was given), without its
`otel_scope_*` labels, and without exemplars (they travel by OTLP).
"""

from __future__ import annotations

import threading
from bisect import bisect_left
from typing import TYPE_CHECKING, Iterable, Mapping

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from . import _counts
from ._names import OBSERVED, RECORDED, Spec, prom_label, prom_value

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.util.types import Attributes, AttributeValue
    from prometheus_client.metrics_core import Metric

# The attribute items a record was called with, and the label set they map to.
_AttributeKey = tuple[tuple[str, "AttributeValue"], ...]
_LabelKey = tuple[tuple[str, str], ...]


class _Child:
    """One label set's value: a counter total, or a histogram's per-bucket counts and sum."""

    __slots__ = ("labels", "counts", "total", "lock")

    def __init__(self, labels: dict[str, str], buckets: int) -> None:
        self.labels = labels
        self.counts = [0] * (buckets + 1)  # the last one is +Inf
        self.total = 0.0
        # Records may come from several threads (the sync wrapper, apps with threads);
        # an uncontended lock is cheaper than a lost update.
        self.lock = threading.Lock()


class FastInstrument:
    """`record()`/`add()` like an OTel instrument; children cached by the attribute items."""

    __slots__ = ("spec", "_bounds", "_children", "_by_labels", "_histogram", "_binding")

    def __init__(self, spec: Spec) -> None:
        self.spec = spec
        self._bounds = tuple(spec.buckets)
        self._children: dict[_AttributeKey, _Child] = {}
        self._by_labels: dict[_LabelKey, _Child] = {}
        self._histogram = spec.kind == "histogram"
        self._binding = threading.Lock()  # two threads binding one new label set must share a child

    def record(self, amount: float, attributes: Attributes = None, context: Context | None = None) -> None:
        # The core builds its attribute dicts in a fixed order per call site, so
        # the items tuple is a stable, cheap cache key.
        key = tuple(attributes.items()) if attributes else ()
        child = self._children.get(key)
        if child is None:
            child = self._bind(key, attributes or {})
        if self._histogram:
            index = bisect_left(self._bounds, amount)  # first bound >= amount: buckets are `le`
            with child.lock:
                child.counts[index] += 1
                child.total += amount
        else:
            with child.lock:
                child.total += amount

    add = record

    def _bind(self, key: _AttributeKey, attributes: Mapping[str, AttributeValue]) -> _Child:
        # Like the SDK's reader: one label per attribute given, none for one absent.
        labels = {prom_label(k): prom_value(v) for k, v in attributes.items() if v is not None}
        canonical = tuple(sorted(labels.items()))
        with self._binding:
            child = self._by_labels.get(canonical)
            if child is None:
                child = self._by_labels[canonical] = _Child(labels, len(self._bounds))
            self._children[key] = child
        return child

    def family(self) -> Metric:
        """The Prometheus family: label names are those used by any child ("" where one has none)."""
        spec = self.spec
        children = list(self._by_labels.values())
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


class FastMetrics(Collector):
    """The recorded families of `_names.RECORDED`, exposed from their bound children."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.instruments = {spec.attr: FastInstrument(spec) for spec in RECORDED}
        registry.register(self)
        registry.register(GaugeCollector())

    def collect(self) -> Iterable[Metric]:
        return [instrument.family() for instrument in self.instruments.values()]

    def describe(self) -> Iterable[Metric]:
        return self.collect()


class GaugeCollector(Collector):
    """Held, waiting, oldest hold age and lease, Redis connections, circuits: read over managers at scrape time.

    Only managers on the global provider `setup()` installed (named or
    not): one made with another provider reports through that provider.
    """

    def collect(self) -> Iterable[GaugeMetricFamily]:
        from ._instruments import routed

        counts = [c for c in list(_counts.ALL_COUNTS) if routed(c.meter_provider)]
        for which in ("active", "pending"):
            family = _family(which, ["lock_name"])
            for name, value in _counts.totals(counts, which).items():
                family.add_metric([name], value)
            yield family
        age, lease = _family("hold_age", ["lock_name"]), _family("lease", ["lock_name"])
        for name, (seconds, lease_seconds) in _counts.oldest(counts).items():
            age.add_metric([name], seconds)
            lease.add_metric([name], lease_seconds)
        yield age
        yield lease
        used = _family("connections", ["db_client_connection_state", "db_client_connection_pool_name"])
        pending = _family("connection_pending", ["db_client_connection_pool_name"])
        for pool, (in_use, waiting) in _counts.connections(counts).items():
            used.add_metric(["used", pool], in_use)
            pending.add_metric([pool], waiting)
        yield used
        yield pending
        circuit = _family("circuit_state", ["db_client_connection_pool_name"])
        for pool, state in _counts.circuits(counts).items():
            circuit.add_metric([pool], state)
        yield circuit

    def describe(self) -> Iterable[GaugeMetricFamily]:
        return [_family(which, []) for which in OBSERVED]


def _family(which: str, labels: list[str]) -> GaugeMetricFamily:
    spec = OBSERVED[which]
    return GaugeMetricFamily(spec.prom, spec.description, labels=labels)
