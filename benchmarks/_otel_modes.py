"""The three telemetry set-ups the overhead benchmark compares, and a dummy OTLP/HTTP receiver.

off         no SDK: the OpenTelemetry API's no-op providers (what a library user gets by default)
sdk-memory  the SDK with in-memory exporters: spans and metrics are recorded, nothing leaves the process
otlp-prom   otel_lock.telemetry.setup(otlp=True, prometheus=True): OTLP/HTTP to a local receiver
            (spans batched, metrics every second) plus the Prometheus reader behind /metrics
"""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

MODES = ("off", "sdk-memory", "otlp-prom")
METRIC_EXPORT_MS = "1000"  # export often, so the window pays for it (the SDK default is 60 s)


def env_for(mode: str, receiver_port: int | None) -> dict:
    """Environment for a process in `mode` (the OTLP exporters read OTEL_* themselves)."""
    if mode != "otlp-prom":
        return {}
    return {
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{receiver_port}",
        "OTEL_METRIC_EXPORT_INTERVAL": METRIC_EXPORT_MS,
        "OTEL_BSP_SCHEDULE_DELAY": "500",
    }


def install(mode: str):
    """Install `mode` globally in this process; returns the TelemetrySetup (None for off)."""
    if mode == "off":
        return None
    from otel_lock import telemetry

    if mode == "sdk-memory":
        from opentelemetry import metrics, trace
        from opentelemetry.sdk.metrics import MeterProvider
        from opentelemetry.sdk.metrics.export import InMemoryMetricReader
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

        tracer_provider = TracerProvider()
        # the batch processor, as in production: the cost of recording, not of a synchronous export
        tracer_provider.add_span_processor(BatchSpanProcessor(InMemorySpanExporter()))
        trace.set_tracer_provider(tracer_provider)
        metrics.set_meter_provider(MeterProvider(metric_readers=[InMemoryMetricReader()]))
        return telemetry.setup(service_name="otel-lock-bench")  # finds the SDK above and keeps it
    if mode == "otlp-prom":
        return telemetry.setup(service_name="otel-lock-bench", otlp=True, prometheus=True)
    raise ValueError(f"unknown telemetry mode {mode!r}")


class _Sink(BaseHTTPRequestHandler):
    def do_POST(self) -> None:  # noqa: N802 - http.server's naming
        length = int(self.headers.get("Content-Length") or 0)
        self.rfile.read(length)
        self.server.received[self.path] = self.server.received.get(self.path, 0) + 1
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


class Receiver:
    """Accepts OTLP/HTTP exports (POST /v1/traces, /v1/metrics) and counts them, answering 200."""

    def __init__(self) -> None:
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _Sink)
        self.server.received = {}
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def received(self) -> dict:
        return dict(self.server.received)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
