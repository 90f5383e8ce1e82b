"""The telemetry set-ups the overhead benchmark compares, and a dummy OTLP/HTTP receiver.

off        no SDK: the OpenTelemetry API's no-op providers (what a library user gets by default)
prom       otel_lock.telemetry.setup(prometheus=True, otlp=False): /metrics, the lock's metrics on the
           prometheus-client fast path (children bound per label set); HTTP metrics through the SDK's
           Prometheus reader; no tracer SDK
otlp       setup() with OTEL_EXPORTER_OTLP_ENDPOINT and OTEL_METRICS_EXPORTER=otlp: traces and metrics over
           OTLP/HTTP to a local receiver (spans batched, metrics every second); the lock's metrics on the
           fast path, exported with the SDK's in one request
prom-workers  prom with PROMETHEUS_MULTIPROC_DIR (a fresh directory per process): the worker-process
           mode, where every record is also written to prometheus-client's per-pid files

For the demo endpoint each telemetry mode also runs without the ASGI
instrumentation (`prom-lock`, `otlp-lock`: the lock's telemetry alone), so
the overhead splits into the lock's part and the HTTP instrumentation's.
"""

from __future__ import annotations

import tempfile
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

MODES = ("off", "prom", "prom-workers", "otlp")
ENDPOINT_MODES = ("off", "prom-lock", "prom", "prom-workers", "otlp-lock", "otlp")
TARGETS = {"prom": 0.10, "otlp": 0.25}  # lock cycle p50 and client CPU overhead allowed over off
METRIC_EXPORT_MS = "1000"  # export often, so the window pays for it (the SDK default is 60 s)


def base_mode(mode: str) -> str:
    for suffix in ("-lock", "-workers", "-fw-lean", "-sampled", "-app"):
        mode = mode.removesuffix(suffix)
    return mode


def env_for(mode: str, receiver_port: int | None) -> dict:
    """Environment for a process in `mode` (the OTLP exporters read OTEL_* themselves)."""
    if mode == "prom-workers":  # a fresh directory, as a server start empties it
        return {"PROMETHEUS_MULTIPROC_DIR": tempfile.mkdtemp(prefix="otel-lock-bench-workers-")}
    if base_mode(mode) != "otlp":
        return {}
    sampled = {"OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0.1"}
    return {
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{receiver_port}",
        "OTEL_METRICS_EXPORTER": "otlp",
        "OTEL_METRIC_EXPORT_INTERVAL": METRIC_EXPORT_MS,
        "OTEL_BSP_SCHEDULE_DELAY": "500",
        **(sampled if mode.endswith("-sampled") else {}),
    }


class _LockOnly:
    """A TelemetrySetup whose instrument_app adds nothing: the lock's own telemetry alone."""

    def __init__(self, setup) -> None:
        self.setup = setup

    def instrument_app(self, app):
        return app


# FastAPI's native telemetry (FastAPI 0.165+ traces every request once an SDK is installed: a server
# span, and with operation spans one per dependency, the endpoint and the serialisation), per mode:
#   otlp-fw-lean     its operation spans off (the server span stays)
#   otlp-sampled     its operation spans off and one trace in ten sampled
#                    (OTEL_TRACES_SAMPLER=parentbased_traceidratio): the switches docs/observability.md names
#   *-lock           FastAPI's own telemetry off: the lock's telemetry alone
#   *-app            TelemetrySetup.instrument_app(app), as docs/observability.md wires an app: contrib's
#                    HTTP spans and metrics, and FastAPI's own step aside
FASTAPI_MODES = ("off", "prom-lock", "prom", "prom-app", "otlp-lock", "otlp", "otlp-fw-lean", "otlp-sampled",
                 "otlp-app")


def fastapi_telemetry(mode: str) -> dict:
    """FastAPI(telemetry=...) for `mode`."""
    if mode.endswith("-lock"):
        return {"tracing": False, "metrics": False, "logs": False}
    if mode in ("otlp-fw-lean", "otlp-sampled"):
        return {"operation_spans": False}
    return {}


def install(mode: str):
    """Install `mode` globally in this process; returns the TelemetrySetup (None for off)."""
    if mode == "off":
        return None
    from otel_lock import telemetry

    if base_mode(mode) == "prom":
        setup = telemetry.setup(service_name="otel-lock-bench", prometheus=True, otlp=False)
    elif base_mode(mode) == "otlp":
        setup = telemetry.setup(service_name="otel-lock-bench", otlp=True)
    else:
        raise ValueError(f"unknown telemetry mode {mode!r}")
    return _LockOnly(setup) if mode.endswith("-lock") else setup


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
