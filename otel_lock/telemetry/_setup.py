"""`setup()`: an OpenTelemetry SDK for apps that have none.

otel-lock records through the OpenTelemetry API only; this module is the
optional wiring that turns those calls into data: a Resource that tells the
replicas apart, OTLP push (traces and metrics, HTTP/protobuf or gRPC, configured by
the standard ``OTEL_*`` variables, each honoured or refused: `_env`) and Prometheus pull at ``/metrics``, with
the same metric names by either path.

One recording, one reader per destination: the lock's own metrics are
recorded straight into children bound per label set (`_prom`), which
/metrics exposes through a prometheus-client collector and the OTLP reader
adds to each export (`_otlp`); the SDK only carries the HTTP
instrumentation's metrics. A deployment that pushes OTLP to a collector
which serves Prometheus (docker-compose.yml) sets ``OTEL_METRICS_EXPORTER=otlp``.
/metrics then still answers (Prometheus' `up`) with `target_info`, the
replica's resource, so a replica whose pushed metrics stop arriving can be
told apart from one that is down.

Nothing is lost at shutdown: `TelemetrySetup.shutdown()` flushes and shuts
the providers down, and `setup()` makes SIGTERM and SIGINT do it before the
process exits (see `_signals`).

Apps that installed their own SDK keep it: `setup()` logs a warning and
returns their providers unchanged (the lock then records through that SDK).
Calling `setup()` twice returns the first result, so every worker or import
path may call it.

Exemplars come with recorded traces: the fast path samples them in the
request context (trace-based, as the SDK; ``OTEL_METRICS_EXEMPLAR_FILTER=always_off``
turns them off). OTLP carries them (the collector's ``prometheus`` exporter
exposes them as OpenMetrics), and so does ``/metrics`` when the scraper asks
for OpenMetrics; a Prometheus started with ``--enable-feature=exemplar-storage``
keeps them (deploy/ does this).

Worker processes: with ``PROMETHEUS_MULTIPROC_DIR`` set, /metrics serves the
sum of every worker (`_multiproc`), and a process forked after `setup()`
gets its own ``service.instance.id`` (`_instance`).
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Mapping

from opentelemetry import metrics, trace
from prometheus_client import REGISTRY, CollectorRegistry
from prometheus_client.exposition import choose_encoder

from .. import __version__
from . import _counts, _env, _multiproc, _signals
from ._instance import default_instance_id, follow_forks
from ._instruments import route_default_metrics
from ._prom import FastMetrics, TargetInfo, WithoutCreated
from ._redact import MODES, configure_redaction

if TYPE_CHECKING:
    from opentelemetry.sdk.metrics.export import MetricReader
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider as SdkTracerProvider
    from prometheus_client.registry import Collector
    from starlette.requests import Request
    from starlette.responses import Response
    from starlette.types import ASGIApp

    from ._otlp import OtlpPush

__all__ = ["TelemetrySetup", "setup", "metrics_endpoint", "default_instance_id"]

log = logging.getLogger("otel_lock.telemetry")

DEFAULT_SERVICE_NAME = "otel-lock"
# Routes whose own requests should not show up in HTTP metrics and traces.
DEFAULT_EXCLUDED_URLS = "/metrics,/healthz"
_OTLP_ENDPOINT_VARS = (
    "OTEL_EXPORTER_OTLP_ENDPOINT",
    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
    "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT",
)


@dataclass(frozen=True)
class TelemetrySetup:
    """What `setup()` installed (or found): providers, the /metrics registry, the resource.

    The providers are typed as the API's: with `installed=False` they are the
    app's own. When `installed` is true they are the SDK's (`shutdown()` etc.).
    """

    tracer_provider: trace.TracerProvider
    meter_provider: metrics.MeterProvider
    registry: CollectorRegistry | None
    resource: Resource | None = None
    installed: bool = True
    otlp: bool = False
    # The OTLP metrics export (the lock's fast path and the SDK's metrics), when on
    push: OtlpPush | None = field(default=None, repr=False)

    def instrument_app(self, app: ASGIApp, excluded_urls: str = DEFAULT_EXCLUDED_URLS) -> ASGIApp:
        """Wrap an ASGI app with HTTP server spans and duration per route, using these providers.

        Wrap the *outermost* app, e.g. ``app = telemetry.instrument_app(app)`` after
        every ``add_middleware``. See `_http` for the choice of instrumentation,
        route-named spans and what happens to raw URLs. A FastAPI app that
        traces natively (0.165+) is returned itself, instrumented at the top of
        its own middleware stack so that FastAPI does not trace each request a
        second time.
        """
        from ._http import instrument

        return instrument(app, excluded_urls, self.tracer_provider, self.meter_provider)

    def shutdown(self, timeout: float = 10.0) -> bool:
        """Flush what is buffered (spans, the last metrics) and shut the providers down; once, False on failure.

        Only what `setup()` installed: an app's own providers are the app's to
        shut down. Bounded by `timeout` seconds in all (a collector that does
        not answer costs at most that), so a SIGTERM grace period is kept.
        """
        return _shutdown(self, timeout) if self.installed else True


_lock = threading.Lock()
_current: TelemetrySetup | None = None
_retired: list[TelemetrySetup] = []


def setup(
    service_name: str = DEFAULT_SERVICE_NAME,
    service_instance_id: str | None = None,
    *,
    prometheus: bool | None = None,
    otlp: bool | None = None,
    resource_attributes: Mapping[str, Any] | None = None,
    redact: str | None = None,
    flush_on_signal: bool = True,
) -> TelemetrySetup:
    """Install tracer and meter providers globally, once per process.

    ``otlp=None`` enables OTLP (traces and metrics) when an
    ``OTEL_EXPORTER_OTLP_*ENDPOINT`` variable is set; ``True`` forces it (default
    endpoint http://localhost:4318). ``prometheus=None`` serves metrics at
    `metrics_endpoint` unless ``OTEL_METRICS_EXPORTER`` says otherwise: that
    standard variable (``otlp``, ``prometheus``, ``none``, comma-separated)
    picks the metric destinations when set, so a replica behind a collector
    runs one reader. ``redact`` (``off``, ``hash``, ``drop``; None: read
    ``OTEL_LOCK_REDACT``) keeps lock keys and owners out of spans.
    ``OTEL_SERVICE_NAME`` wins over the default service name, never over an
    explicit one. ``flush_on_signal`` (main thread only) makes SIGTERM and
    SIGINT flush and shut the providers down before the process exits.
    The other standard variables it reads (``OTEL_SDK_DISABLED``,
    ``OTEL_TRACES_EXPORTER``, the OTLP protocol, the temporality preference)
    are honoured or refused with a ValueError before anything is installed
    (`_env`).
    """
    global _current
    _check_arguments(service_name, service_instance_id, resource_attributes, redact)
    for flag, value in (("prometheus", prometheus), ("otlp", otlp), ("flush_on_signal", flush_on_signal)):
        if value is not None and not isinstance(value, bool):  # "false" would be read as true
            raise ValueError(f"{flag} must be True, False or None, not {value!r}")
    exporters = _metrics_exporters()
    with _lock:
        if _current is not None:
            return _current
        configure_redaction(redact)
        if _env.sdk_disabled():
            log.warning("otel_lock.telemetry.setup(): OTEL_SDK_DISABLED=true, nothing installed "
                        "(no spans, no metrics pushed or served by otel-lock)")
            _current = TelemetrySetup(trace.get_tracer_provider(), metrics.get_meter_provider(), None,
                                      installed=False)
            return _current
        existing = _existing_sdk()
        if existing is not None:
            log.warning(
                "otel_lock.telemetry.setup(): an OpenTelemetry SDK is already installed "
                "(%s); keeping it, nothing was changed", existing)
            _current = TelemetrySetup(
                trace.get_tracer_provider(), metrics.get_meter_provider(), None, installed=False)
            return _current
        if otlp is None:
            otlp = any(os.environ.get(name) for name in _OTLP_ENDPOINT_VARS)
        if prometheus is None:
            prometheus = exporters is None or "prometheus" in exporters
        otlp_metrics = bool(otlp) and (exporters is None or "otlp" in exporters)
        otlp_traces = bool(otlp) and _env.traces_exported()
        # Refused here, before anything is installed: a protocol or preference that would be ignored.
        protocols = {signal: _env.protocol(signal) for signal, on in (("TRACES", otlp_traces),
                                                                       ("METRICS", otlp_metrics)) if on}
        if otlp_metrics:
            _env.check_temporality()
        _current = _install(service_name, service_instance_id, prometheus, bool(otlp), otlp_metrics,
                            resource_attributes, protocols, traces=otlp_traces)
        if _current.installed:
            _signals.install(_current.shutdown, signals=flush_on_signal)
        return _current


def _check_arguments(service_name: object, service_instance_id: object, resource_attributes: object,
                     redact: object) -> None:
    if not isinstance(service_name, str) or not service_name.strip():
        raise ValueError(f"service_name must be a non-empty string, not {service_name!r}")
    if service_instance_id is not None and (not isinstance(service_instance_id, str) or not service_instance_id):
        raise ValueError(f"service_instance_id must be a non-empty string or None, not {service_instance_id!r}")
    if resource_attributes is not None and not isinstance(resource_attributes, Mapping):
        raise ValueError(f"resource_attributes must be a mapping, not {type(resource_attributes).__name__}")
    if redact is not None and (not isinstance(redact, str) or redact not in MODES):
        raise ValueError(f"redact must be one of {', '.join(MODES)}, not {redact!r}")


def _metrics_exporters() -> set[str] | None:
    value = os.environ.get("OTEL_METRICS_EXPORTER")
    if value is None or not value.strip():
        return None
    names = {part.strip().lower() for part in value.split(",") if part.strip()}
    unknown = names - {"otlp", "prometheus", "none"}
    if unknown:
        raise ValueError(f"OTEL_METRICS_EXPORTER={value!r}: otel-lock knows otlp, prometheus and none, "
                         f"not {', '.join(sorted(unknown))}")
    return names - {"none"}


def current() -> TelemetrySetup | None:
    """The result of the first `setup()` call in this process, if any."""
    return _current


async def metrics_endpoint(request: Request) -> Response:
    """Starlette endpoint: Prometheus exposition (text or OpenMetrics, as the scraper asks).

    Serves the registry `setup()` created (with OTLP-only metrics it holds
    `target_info` alone); without `setup()`, prometheus-client's default
    registry (where an app's own PrometheusMetricReader registers).
    """
    from starlette.responses import Response

    registry: Collector = REGISTRY
    encoder, content_type = choose_encoder(request.headers.get("accept", ""))
    if _current is not None and _current.registry is not None:
        # `_created` only where it means something: OpenMetrics (the text format unchanged).
        openmetrics = content_type.startswith("application/openmetrics-text")
        registry = _current.registry if openmetrics else WithoutCreated(_current.registry)
    return Response(encoder(registry), media_type=content_type)


# -- installation -----------------------------------------------------------


def _existing_sdk() -> str | None:
    """Name of an SDK provider the app installed itself, else None (API defaults)."""
    for provider in (trace.get_tracer_provider(), metrics.get_meter_provider()):
        if not _is_api_default(provider):
            return type(provider).__name__
    return None


def _is_api_default(provider: object) -> bool:
    # The API's proxy and no-op providers mean "nobody configured anything yet".
    return type(provider).__name__ in {
        "ProxyTracerProvider", "NoOpTracerProvider", "_ProxyMeterProvider", "NoOpMeterProvider"}


def _install(service_name: str, service_instance_id: str | None, prometheus: bool, otlp: bool,
             otlp_metrics: bool, resource_attributes: Mapping[str, Any] | None,
             protocols: Mapping[str, str] | None = None, traces: bool = True) -> TelemetrySetup:
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.trace import TracerProvider

    resource = _resource(service_name, service_instance_id, resource_attributes)
    follow_forks(resource)  # a forked worker (gunicorn --preload) gets its own service.instance.id
    # A registry of our own: a second app or test in the process cannot collide
    # with prometheus-client's global one. Always there, for `target_info`.
    registry = CollectorRegistry(auto_describe=True)
    shared = _multiproc.directory()  # PROMETHEUS_MULTIPROC_DIR: one /metrics for every worker process
    # Exemplars where traces are recorded: OTLP, and /metrics' OpenMetrics.
    fast = FastMetrics(registry if prometheus else None, exemplars=otlp and traces and _exemplars_on(), shared=shared)
    # With workers, the SDK's families are this process's share, copied to the shared files.
    sdk_registry = CollectorRegistry() if shared and prometheus else registry
    if shared is None:
        registry.register(TargetInfo(resource))
    readers: list[MetricReader] = []
    if prometheus:
        from opentelemetry.exporter.prometheus import PrometheusMetricReader

        # The SDK reader only carries the HTTP instrumentation's metrics; the
        # lock's are on the fast path, target_info comes from TargetInfo.
        readers.append(PrometheusMetricReader(disable_target_info=True, registry=sdk_registry))
    protocols = protocols or {}
    push = _otlp_push(fast, resource, protocols.get("METRICS", "http/protobuf")) if otlp_metrics else None
    if push is not None:
        readers.append(push.reader)
    # Without an exporter spans would be built and dropped: keep the API's no-op
    # tracer (incoming traceparent headers still propagate) and pay nothing.
    tracer_provider: SdkTracerProvider | None = None
    if otlp and traces:
        from ._shutdown import add_span_exporter

        # shutdown_on_exit=False: TelemetrySetup.shutdown() is the exit hook (`_signals`), once.
        tracer_provider = TracerProvider(resource=resource, shutdown_on_exit=False)
        add_span_exporter(tracer_provider, _env.span_exporter(protocols.get("TRACES", "http/protobuf")))
        trace.set_tracer_provider(tracer_provider)
    meter_provider = MeterProvider(resource=resource, metric_readers=readers, shutdown_on_exit=False)
    metrics.set_meter_provider(meter_provider)
    if shared is not None:
        # Only now: its thread collects the SDK's reader, which warns until a provider holds it.
        _multiproc.serve(registry, shared, fast if prometheus else None, lambda: resource.attributes,
                         sdk_registry if prometheus else None)
    route_default_metrics(fast, meter_provider)
    return TelemetrySetup(tracer_provider or trace.get_tracer_provider(), meter_provider, registry, resource,
                          installed=True, otlp=bool(otlp), push=push)


def _exemplars_on() -> bool:
    return os.environ.get("OTEL_METRICS_EXEMPLAR_FILTER", "trace_based").strip().lower() != "always_off"


def _otlp_push(fast: FastMetrics, resource: Resource, protocol: str = "http/protobuf") -> OtlpPush:
    from ._otlp import OtlpPush

    # The exporter reads OTEL_EXPORTER_OTLP_*, the push loop OTEL_METRIC_EXPORT_INTERVAL and _TIMEOUT.
    return OtlpPush(_env.metric_exporter(protocol), fast, resource)


_shutdown_lock = threading.Lock()
_shut_down: set[int] = set()


def _shutdown(installed: TelemetrySetup, timeout: float) -> bool:
    """The last spans and metrics within `timeout`, then the providers (see `_shutdown`); False names a loss."""
    from . import _shutdown as bounded

    # Not setup()'s _lock: a signal may arrive while the main thread holds it.
    with _shutdown_lock:
        if id(installed) in _shut_down:
            return True
        _shut_down.add(id(installed))
    try:
        return bounded.shutdown(installed, timeout)
    except Exception:  # a shutdown must never stop the process from exiting
        log.exception("otel-lock: shutting telemetry down failed")
        return False


def _resource(service_name: str, service_instance_id: str | None,
              resource_attributes: Mapping[str, Any] | None) -> Resource:
    from opentelemetry.sdk.resources import Resource

    attributes: dict[str, Any] = {"service.version": __version__}
    if service_name != DEFAULT_SERVICE_NAME or not os.environ.get("OTEL_SERVICE_NAME"):
        attributes["service.name"] = service_name
    attributes.update(resource_attributes or {})
    # OTEL_RESOURCE_ATTRIBUTES may carry an instance id (e.g. the pod name): keep it
    # unless the caller names one.
    if service_instance_id:
        attributes["service.instance.id"] = service_instance_id
    elif "service.instance.id" not in attributes:
        from opentelemetry.sdk.resources import OTELResourceDetector

        # Only OTEL_RESOURCE_ATTRIBUTES: Resource.create() alone would invent a random uuid.
        from_env = OTELResourceDetector().detect().attributes.get("service.instance.id")
        attributes["service.instance.id"] = from_env or default_instance_id()
    return Resource.create(attributes)


def _reset_for_tests() -> None:
    """Forget the installed providers (tests only: the API's set-once globals are reset too)."""
    global _current
    from opentelemetry.util._once import Once

    with _lock:
        _signals.restore()
        if _current is not None and _current.installed:
            _current.shutdown()
            # Kept alive: otel_lock.telemetry._instruments caches instruments by id(provider), and a
            # freed provider's id could be reused by the next test's provider (so could the setup's id).
            _retired.append(_current)
        _current = None
        route_default_metrics()
        configure_redaction()
        # The managers of earlier tests may live on (a FastAPI handler closing over one stays in
        # FastAPI's caches): they are not the next test's, whose fresh telemetry would seed their series.
        _counts.ALL_COUNTS.clear()
    trace._TRACER_PROVIDER_SET_ONCE = Once()
    trace._TRACER_PROVIDER = None
    metrics._internal._METER_PROVIDER_SET_ONCE = Once()
    metrics._internal._METER_PROVIDER = None
