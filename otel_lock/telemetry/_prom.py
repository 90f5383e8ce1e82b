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
`otel_scope_*` labels. Counters and histograms carry ``_created`` (when the
series started: at start-up for the seeded ones, at the fork in a worker) for
the OpenMetrics exposition; the Prometheus text one leaves it out
(`WithoutCreated`). Exemplars are sampled only when traces are recorded
(`setup()` with OTLP): the last one of each bucket goes with each OTLP
export and stays on the OpenMetrics exposition of /metrics.

With ``PROMETHEUS_MULTIPROC_DIR`` set, each record is also written through
to this process's file (`_multiproc`), so one /metrics serves every worker.

Bounded by construction: a child is bound only for attributes the
instrument declares, and each attribute admits at most
`OTEL_LOCK_NAME_LIMIT` distinct values (`_bounds`); later ones are recorded
under `_overflow` and never cached, so neither the series nor the cache grow.
"""

from __future__ import annotations

import threading
import time
from bisect import bisect_left
from typing import TYPE_CHECKING, Callable, Iterable, Mapping

from opentelemetry import trace
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector
from prometheus_client.samples import Exemplar as PromExemplar
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

from .._fork import watch_fork
from . import _counts, _multiproc
from ._bounds import Limits
from ._names import OBSERVED, RECORDED, Spec, prom_label, prom_value

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.util.types import Attributes, AttributeValue

# The attribute items a record was called with, and the label set they map to.
_AttributeKey = tuple[tuple[str, "AttributeValue"], ...]
_LabelKey = tuple[tuple[str, str], ...]
# value, time, trace id, span id of the last sampled measurement of one bucket
Exemplar = tuple[float, int, int, int]


class _Child:
    """One label set's value: a counter total, or a histogram's per-bucket counts, sum, min and max."""

    __slots__ = ("labels", "attributes", "counts", "total", "low", "high", "exemplars", "latest", "started", "lock",
                 "shared")

    def __init__(self, labels: dict[str, str], attributes: dict[str, AttributeValue], buckets: int,
                 shared: _multiproc.SharedCounter | _multiproc.SharedHistogram | None = None) -> None:
        self.labels = labels
        self.attributes = attributes  # as recorded (OTLP keeps types and dotted names), values bounded
        self.counts = [0] * (buckets + 1)  # the last one is +Inf
        self.total = 0.0
        self.low = float("inf")
        self.high = float("-inf")
        self.exemplars: dict[int, Exemplar] = {}  # since the last OTLP export (which takes them)
        self.latest: dict[int, Exemplar] = {}  # the last one of each bucket, for /metrics
        self.started = time.time_ns()
        # Records may come from several threads (the sync wrapper, apps with threads);
        # an uncontended lock is cheaper than a lost update.
        self.lock = threading.Lock()
        self.shared = shared  # this process's file (PROMETHEUS_MULTIPROC_DIR), written under `lock`


class FastInstrument:
    """`record()`/`add()` like an OTel instrument; children cached by the attribute items."""

    __slots__ = ("spec", "exemplars", "_bounds", "_children", "_by_labels", "_histogram", "_binding", "_limits",
                 "_files")

    def __init__(self, spec: Spec, exemplars: bool = False,
                 files: Callable[[], _multiproc.Files | None] | None = None) -> None:
        self.spec = spec
        self.exemplars = exemplars and spec.kind == "histogram"
        self._bounds = tuple(spec.buckets)
        self._children: dict[_AttributeKey, _Child] = {}
        self._by_labels: dict[_LabelKey, _Child] = {}
        self._histogram = spec.kind == "histogram"
        self._binding = threading.Lock()  # two threads binding one new label set must share a child
        self._limits = Limits(spec.name, spec.labels)
        self._files = files

    def forked(self) -> None:
        """In a forked child: a new process, new series (its parent's values are its parent's)."""
        self._children, self._by_labels, self._binding = {}, {}, threading.Lock()

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
                if child.shared is not None:
                    child.shared.write(0, 0, child.total)
            return
        index = bisect_left(self._bounds, amount)  # first bound >= amount: buckets are `le`
        with child.lock:
            child.counts[index] += 1
            child.total += amount
            if amount < child.low:
                child.low = amount
            if amount > child.high:
                child.high = amount
            if child.shared is not None:
                child.shared.write(index, child.counts[index], child.total)
        if self.exemplars:
            span = trace.get_current_span(context).get_span_context()
            if span.trace_flags.sampled:  # the SDK's default, trace-based exemplar filter
                child.exemplars[index] = child.latest[index] = (amount, time.time_ns(), span.trace_id,
                                                                span.span_id)

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
                files = self._files() if self._files is not None else None
                shared = _multiproc.shared(files, self.spec, labels) if files is not None else None
                child = self._by_labels[canonical] = _Child(labels, kept, len(self._bounds), shared)
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
                counter.add_metric([child.labels.get(name, "") for name in names], total, created=child.started / 1e9)
            return counter
        histogram = HistogramMetricFamily(spec.prom, spec.description, labels=names)
        for child in children:
            values = [child.labels.get(name, "") for name in names]
            with child.lock:
                counts, total = list(child.counts), child.total
            latest = dict(child.latest)
            cumulative, buckets = 0, list[tuple[str, float] | tuple[str, float, PromExemplar]]()
            for index, (bound, count) in enumerate(zip(self._bounds + (float("inf"),), counts)):
                cumulative += count
                exemplar = latest.get(index)
                if exemplar is None:
                    buckets.append((floatToGoString(bound), cumulative))
                else:
                    buckets.append((floatToGoString(bound), cumulative, _prom_exemplar(exemplar)))
            histogram.add_metric(values, buckets, total)
            # HistogramMetricFamily.add_metric takes no `created`: the sample is added as it would add it.
            histogram.samples.append(Sample(spec.prom + "_created", dict(zip(names, values)), child.started / 1e9))
        return histogram

    def add_exemplars(self, metric: Metric) -> None:
        """Give the merged buckets of `metric` (every process's) this process's last exemplars."""
        if not self.exemplars:
            return
        by_labels = {tuple(sorted(child.labels.items())): dict(child.latest) for child in self.children()}
        index_of = {floatToGoString(bound): i for i, bound in enumerate(self._bounds + (float("inf"),))}
        for i, sample in enumerate(metric.samples):
            if not sample.name.endswith("_bucket"):
                continue
            labels = tuple(sorted((k, v) for k, v in sample.labels.items() if k != "le"))
            exemplar = by_labels.get(labels, {}).get(index_of.get(sample.labels.get("le", ""), -1))
            if exemplar is not None:
                metric.samples[i] = sample._replace(exemplar=_prom_exemplar(exemplar))


def _prom_exemplar(exemplar: Exemplar) -> PromExemplar:
    value, at, trace_id, span_id = exemplar
    return PromExemplar({"trace_id": f"{trace_id:032x}", "span_id": f"{span_id:016x}"}, value, at / 1e9)


class FastMetrics:
    """The recorded instruments of `_names.RECORDED`; on a registry (/metrics) when one is given.

    `shared`: the directory of `_multiproc.directory()` (``PROMETHEUS_MULTIPROC_DIR``): every
    record is written through to this process's files there, and the registry serves the
    files of every process (`_multiproc.serve`).
    """

    def __init__(self, registry: CollectorRegistry | None = None, *, exemplars: bool = False,
                 shared: str | None = None) -> None:
        self.registry = registry
        self._path = shared if registry is not None else None
        self._files = _multiproc.Files(self._path) if self._path is not None else None
        files = self.files if self._path is not None else None
        self.instruments = {spec.attr: FastInstrument(spec, exemplars, files) for spec in RECORDED}
        watch_fork(self._forked)
        if registry is not None and self._path is None:
            registry.register(_RecordedCollector(self))
            registry.register(GaugeCollector())

    def files(self) -> _multiproc.Files | None:
        """This process's files (None: one process, nothing written)."""
        return self._files

    def _forked(self) -> None:
        if self._path is not None:
            self._files = _multiproc.Files(self._path)
        for instrument in self.instruments.values():
            instrument.forked()

    def add_exemplars(self, metric: Metric) -> None:
        for instrument in self.instruments.values():
            if instrument.spec.prom == metric.name:
                instrument.add_exemplars(metric)


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

    def __init__(self, resource: Resource) -> None:
        self._resource = resource  # read at each scrape: a forked worker gets its own instance id

    def collect(self) -> Iterable[Metric]:
        labels = {prom_label(str(k)): prom_value(v) for k, v in sorted(self._resource.attributes.items())}
        family = GaugeMetricFamily("target_info", "Target metadata", labels=list(labels))
        family.add_metric(list(labels.values()), 1)
        yield family


class WithoutCreated(Collector):
    """A registry's families without their ``_created`` samples: the Prometheus text format of /metrics.

    prometheus-client would print them there as extra ``*_created`` gauges, one
    per series, which the text format has no meaning for; OpenMetrics has
    (`_setup.metrics_endpoint` serves the registry itself then).
    """

    def __init__(self, registry: CollectorRegistry) -> None:
        self._registry = registry

    def collect(self) -> Iterable[Metric]:
        for metric in self._registry.collect():
            created = metric.name + "_created"
            if any(sample.name == created for sample in metric.samples):
                copy = Metric(metric.name, metric.documentation, metric.type, metric.unit)  # never alter a collector's
                copy.samples = [sample for sample in metric.samples if sample.name != created]
                metric = copy
            yield metric
