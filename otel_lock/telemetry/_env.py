"""The standard OpenTelemetry variables `setup()` reads: each honoured, or refused at start-up with a message.

An ignored setting is worse than a refused one: `OTEL_EXPORTER_OTLP_PROTOCOL=grpc`
sent HTTP to the gRPC port, `OTEL_TRACES_EXPORTER=none` still exported spans,
`OTEL_SDK_DISABLED=true` still pushed the lock's metrics. Here:

- ``OTEL_SDK_DISABLED=true``: `setup()` installs nothing (`sdk_disabled`);
- ``OTEL_TRACES_EXPORTER``: ``otlp`` or ``none`` (`traces_exported`);
- ``OTEL_EXPORTER_OTLP_PROTOCOL`` and its per-signal variants: ``http/protobuf``
  or ``grpc`` (through opentelemetry-exporter-otlp-proto-grpc, when installed);
- ``OTEL_EXPORTER_OTLP_METRICS_TEMPORALITY_PREFERENCE``: ``cumulative``,
  ``delta`` or ``lowmemory``, for the lock's metrics too (`_otlp`).

A value otel-lock cannot honour is a ValueError (an ImportError for gRPC
without its package) naming the variable, raised by `setup()` before it
installs anything.
"""

from __future__ import annotations

import importlib.util
import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from opentelemetry.sdk.metrics.export import MetricExporter
    from opentelemetry.sdk.trace.export import SpanExporter

PROTOCOLS = ("http/protobuf", "grpc")
TEMPORALITIES = ("cumulative", "delta", "lowmemory")
GRPC_PACKAGE = "opentelemetry-exporter-otlp-proto-grpc"
_GRPC = "opentelemetry.exporter.otlp.proto.grpc"


def sdk_disabled() -> bool:
    """``OTEL_SDK_DISABLED=true`` (the spec's only value that disables; anything else leaves the SDK on)."""
    return os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true"


def traces_exported() -> bool:
    """``OTEL_TRACES_EXPORTER``: unset or ``otlp`` exports spans (with OTLP on), ``none`` does not."""
    value = os.environ.get("OTEL_TRACES_EXPORTER", "")
    names = {part.strip().lower() for part in value.split(",") if part.strip()} or {"otlp"}
    unknown = names - {"otlp", "none"}
    if unknown:
        raise ValueError(f"OTEL_TRACES_EXPORTER={value!r}: otel-lock's setup() knows otlp and none, "
                         f"not {', '.join(sorted(unknown))} (install your own SDK for other exporters)")
    return "otlp" in names


def protocol(signal: str) -> str:
    """The OTLP protocol of `signal` (``TRACES`` or ``METRICS``): its own variable, else the general one."""
    variable = f"OTEL_EXPORTER_OTLP_{signal}_PROTOCOL"
    if not os.environ.get(variable, "").strip():
        variable = "OTEL_EXPORTER_OTLP_PROTOCOL"
    value = os.environ.get(variable, "").strip().lower() or "http/protobuf"
    if value not in PROTOCOLS:
        raise ValueError(f"{variable}={value!r}: otel-lock's setup() sends http/protobuf or grpc "
                         "(the OpenTelemetry Python exporters have no http/json)")
    if value == "grpc" and not _installed(_GRPC):
        raise ImportError(f"{variable}=grpc needs the {GRPC_PACKAGE} package: pip install {GRPC_PACKAGE} "
                          "or 'otel-lock[telemetry-grpc]' (or set http/protobuf and the collector's HTTP port, "
                          "4318)")
    return value


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # blocked (sys.modules[name] = None) or a parent missing
        return False


def check_temporality() -> None:
    """Refuse a temporality preference the exporters would silently replace by cumulative."""
    value = os.environ.get("OTEL_EXPORTER_OTLP_METRICS_TEMPORALITY_PREFERENCE", "").strip().lower()
    if value and value not in TEMPORALITIES:
        raise ValueError(f"OTEL_EXPORTER_OTLP_METRICS_TEMPORALITY_PREFERENCE={value!r}: "
                         f"one of {', '.join(TEMPORALITIES)}")


def span_exporter(chosen: str) -> SpanExporter:
    if chosen == "grpc":  # an optional package: imported by name, only when chosen
        grpc: SpanExporter = importlib.import_module(f"{_GRPC}.trace_exporter").OTLPSpanExporter()
        return grpc
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter()


def metric_exporter(chosen: str) -> MetricExporter:
    if chosen == "grpc":
        grpc: MetricExporter = importlib.import_module(f"{_GRPC}.metric_exporter").OTLPMetricExporter()
        return grpc
    from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter

    return OTLPMetricExporter()
