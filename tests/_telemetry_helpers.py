"""A tiny OTLP/HTTP receiver for tests: decodes what the exporters push."""

from __future__ import annotations

import gzip
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest


class OtlpReceiver:
    """Listens on a free loopback port; `spans` and `metrics` fill as batches arrive."""

    def __init__(self) -> None:
        self.spans: list = []
        self.metrics: list = []
        self.resources: list = []
        self.received = threading.Condition()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                receiver._accept(self.path, body)
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args) -> None:  # keep test output clean
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"
        # shutdown() waits for serve_forever to look at its flag, every poll_interval (0.5 s by default)
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)

    def _accept(self, path: str, body: bytes) -> None:
        with self.received:
            if path == "/v1/traces":
                request = ExportTraceServiceRequest.FromString(body)
                for resource_spans in request.resource_spans:
                    self.resources.append(resource_spans.resource)
                    for scope_spans in resource_spans.scope_spans:
                        self.spans.extend(scope_spans.spans)
            elif path == "/v1/metrics":
                request = ExportMetricsServiceRequest.FromString(body)
                for resource_metrics in request.resource_metrics:
                    self.resources.append(resource_metrics.resource)
                    for scope_metrics in resource_metrics.scope_metrics:
                        self.metrics.extend(scope_metrics.metrics)
            self.received.notify_all()

    def wait_for(self, predicate, timeout: float = 10.0) -> bool:
        with self.received:
            return self.received.wait_for(predicate, timeout)

    def __enter__(self) -> "OtlpReceiver":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()
