"""The /metrics fast path: lock metrics recorded straight into prometheus-client.

The OpenTelemetry SDK has no bound instruments: every record hashes its
attribute set again, per reader (about 5 us with one reader). A lock cycle
records two or three times, so the SDK alone cost a quarter of the cycle.
Here each distinct attribute dict maps once to a prometheus-client child
(bound per label set), and a record is a dict lookup plus `observe()`.

Same family names as the SDK's Prometheus reader (see `_names`), without its
`otel_scope_*` labels, and without exemplars (they travel by OTLP).
"""

from __future__ import annotations

from typing import Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from . import _counts
from ._names import OBSERVED, RECORDED, Spec, prom_label, prom_value


class FastInstrument:
    """`record()`/`add()` like an OTel instrument; children cached by the attribute items."""

    __slots__ = ("_metric", "_labels", "_children", "_histogram")

    def __init__(self, metric, spec: Spec) -> None:
        self._metric = metric
        self._labels = spec.labels
        self._children: dict = {}
        self._histogram = spec.kind == "histogram"

    def record(self, amount: float, attributes=None, context=None) -> None:
        # The core builds its attribute dicts in a fixed order per call site, so
        # the items tuple is a stable, cheap cache key.
        key = tuple(attributes.items()) if attributes else ()
        child = self._children.get(key)
        if child is None:
            child = self._bind(key, attributes or {})
        if self._histogram:
            child.observe(amount)
        else:
            child.inc(amount)

    add = record

    def _bind(self, key: tuple, attributes) -> object:
        values = [prom_value(attributes.get(label)) for label in self._labels]
        child = self._children[key] = self._metric.labels(*values)
        return child


class FastMetrics:
    """The recorded families of `_names.RECORDED` plus a collector for the observed gauges."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.instruments: dict[str, FastInstrument] = {}
        for spec in RECORDED:
            labels = [prom_label(label) for label in spec.labels]
            if spec.kind == "histogram":
                metric = Histogram(spec.prom, spec.description, labels, registry=registry, buckets=spec.buckets)
            else:
                metric = Counter(spec.prom, spec.description, labels, registry=registry)
            self.instruments[spec.attr] = FastInstrument(metric, spec)
        registry.register(GaugeCollector())


class GaugeCollector(Collector):
    """Held, waiting, oldest hold age and lease, Redis connections: summed over managers at scrape time.

    Only managers on the global meter provider (`meter_provider=None`): one
    made with an explicit provider reports through that provider.
    """

    def collect(self) -> Iterable[GaugeMetricFamily]:
        counts = [c for c in list(_counts.ALL_COUNTS) if c.meter_provider is None]
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

    def describe(self) -> Iterable[GaugeMetricFamily]:
        return [_family(which, []) for which in OBSERVED]


def _family(which: str, labels: list[str]) -> GaugeMetricFamily:
    spec = OBSERVED[which]
    return GaugeMetricFamily(spec.prom, spec.description, labels=labels)
