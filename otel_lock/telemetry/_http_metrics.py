"""HTTP server metrics without client-chosen values: what `instrument_app` lets the ASGI instrumentation record.

opentelemetry-instrumentation-asgi puts the raw Host header on every HTTP
metric (`http.server_name`, `http.host`) and the server's address
(`net.host.*`): a client that sends random Hosts mints a series per request
until the SDK's cardinality limit, after which every request, real 503s
included, lands in one overflow series without route or status. So the
instrumentation gets a meter provider of its own (`BoundedMeterProvider`,
over whatever provider the app uses) whose instruments keep an allow-list:

- method, scheme and protocol version (known values only, else ``_OTHER``),
  status code, the route template
  (`http.target` / `http.route`, set from the matched route, never the raw
  path), `error.type`; each also capped per instrument (`_bounds`);
- nothing derived from Host, client address, user agent or headers.

The request and response size histograms are not recorded: no panel or
alert reads them, and they were two thirds of the HTTP series.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

from opentelemetry import metrics
from opentelemetry.metrics import NoOpHistogram

from ._bounds import Limits
from ._names import prom_value

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.metrics import CallbackT, Counter, Histogram, ObservableCounter, ObservableGauge
    from opentelemetry.metrics import ObservableUpDownCounter, UpDownCounter
    from opentelemetry.util.types import Attributes

OTHER = "_OTHER"
_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "DELETE", "CONNECT", "OPTIONS", "TRACE", "PATCH"})
# attribute -> the values it may take (None: any value the server itself chose, within the limit)
ALLOWED: dict[str, frozenset[str] | None] = {
    "http.method": _METHODS, "http.request.method": _METHODS,
    "http.scheme": frozenset({"http", "https"}), "url.scheme": frozenset({"http", "https"}),
    "http.flavor": frozenset({"1.0", "1.1", "2", "2.0", "3"}),
    "network.protocol.version": frozenset({"1.0", "1.1", "2", "2.0", "3"}),
    "http.status_code": None, "http.response.status_code": None,
    "http.target": None, "http.route": None, "error.type": None,
}
# Read by no panel or rule: not recorded (their cost per request bought nothing).
DROPPED = frozenset({"http.server.request.size", "http.server.response.size",
                     "http.server.request.body.size", "http.server.response.body.size"})


def allowed(attributes: Attributes, limits: Limits) -> dict[str, Any]:
    """The attributes an HTTP metric may carry: allow-listed names, known values, bounded."""
    kept: dict[str, Any] = {}
    for name, value in (attributes or {}).items():
        if name not in ALLOWED or value is None:
            continue
        known = ALLOWED[name]
        text = prom_value(value)
        if known is not None and text not in known:
            kept[name] = OTHER  # as the HTTP conventions fold unknown methods
            continue
        admitted = limits.admit(name, text)
        kept[name] = value if admitted is text else admitted
    return kept


class _Histogram(metrics.Histogram):
    def __init__(self, name: str, sink: Histogram) -> None:  # pylint: disable=super-init-not-called
        self._sink = sink
        self._limits = Limits(name, ALLOWED)

    def record(self, amount: int | float, attributes: Attributes = None, context: Context | None = None) -> None:
        self._sink.record(amount, allowed(attributes, self._limits), context)


class _UpDownCounter(metrics.UpDownCounter):
    def __init__(self, name: str, sink: UpDownCounter) -> None:  # pylint: disable=super-init-not-called
        self._sink = sink
        self._limits = Limits(name, ALLOWED)

    def add(self, amount: int | float, attributes: Attributes = None, context: Context | None = None) -> None:
        self._sink.add(amount, allowed(attributes, self._limits), context)


class _Counter(metrics.Counter):
    def __init__(self, name: str, sink: Counter) -> None:  # pylint: disable=super-init-not-called
        self._sink = sink
        self._limits = Limits(name, ALLOWED)

    def add(self, amount: int | float, attributes: Attributes = None, context: Context | None = None) -> None:
        self._sink.add(amount, allowed(attributes, self._limits), context)


class BoundedMeter(metrics.Meter):
    """A meter whose instruments record through `allowed`; observable ones pass through (none is used)."""

    def __init__(self, meter: metrics.Meter) -> None:
        super().__init__(meter.name, meter.version, meter.schema_url)
        self._meter = meter

    def create_counter(self, name: str, unit: str = "", description: str = "") -> Counter:
        return _Counter(name, self._meter.create_counter(name, unit, description))

    def create_up_down_counter(self, name: str, unit: str = "", description: str = "") -> UpDownCounter:
        return _UpDownCounter(name, self._meter.create_up_down_counter(name, unit, description))

    def create_histogram(self, name: str, unit: str = "", description: str = "", *,
                         explicit_bucket_boundaries_advisory: Sequence[float] | None = None) -> Histogram:
        if name in DROPPED:
            return NoOpHistogram(name, unit, description)
        return _Histogram(name, self._meter.create_histogram(
            name, unit, description, explicit_bucket_boundaries_advisory=explicit_bucket_boundaries_advisory))

    def create_observable_counter(self, name: str, callbacks: Sequence[CallbackT] | None = None, unit: str = "",
                                  description: str = "") -> ObservableCounter:
        return self._meter.create_observable_counter(name, callbacks, unit, description)

    def create_observable_gauge(self, name: str, callbacks: Sequence[CallbackT] | None = None, unit: str = "",
                                description: str = "") -> ObservableGauge:
        return self._meter.create_observable_gauge(name, callbacks, unit, description)

    def create_observable_up_down_counter(self, name: str, callbacks: Sequence[CallbackT] | None = None,
                                          unit: str = "", description: str = "") -> ObservableUpDownCounter:
        return self._meter.create_observable_up_down_counter(name, callbacks, unit, description)


class BoundedMeterProvider(metrics.MeterProvider):
    """Meters of `provider` (None: the global one, resolved at each call) behind `BoundedMeter`."""

    def __init__(self, provider: metrics.MeterProvider | None) -> None:
        self._provider = provider

    def get_meter(self, name: str, version: str | None = None, schema_url: str | None = None,
                  attributes: Attributes | None = None) -> metrics.Meter:
        provider = self._provider if self._provider is not None else metrics.get_meter_provider()
        return BoundedMeter(provider.get_meter(name, version, schema_url, attributes))
