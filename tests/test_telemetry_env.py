"""Every standard OpenTelemetry variable `setup()` reads is honoured, or refused at start-up.

Before, `OTEL_EXPORTER_OTLP_PROTOCOL=grpc` sent HTTP to the gRPC port, `OTEL_TRACES_EXPORTER=none`
still exported spans, `OTEL_SDK_DISABLED=true` still pushed the lock's metrics. A real
OTLP/HTTP receiver (and a real gRPC one, where the gRPC exporter is installed) decodes what arrives.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest

from otel_lock import telemetry
from otel_lock.telemetry._instruments import get_telemetry, routed

from _telemetry_helpers import OtlpReceiver

HOUR_MS = "3600000"
needs_grpc = pytest.mark.skipif(importlib.util.find_spec("opentelemetry.exporter.otlp.proto.grpc") is None,
                                reason="opentelemetry-exporter-otlp-proto-grpc is not installed")


@pytest.fixture
def receiver(monkeypatch):
    for name in list(os.environ):
        if name.startswith("OTEL_"):
            monkeypatch.delenv(name)
    with OtlpReceiver() as receiver:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.endpoint)
        monkeypatch.setenv("OTEL_METRIC_EXPORT_INTERVAL", HOUR_MS)
        monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", HOUR_MS)
        telemetry._reset_for_tests()
        yield receiver
        telemetry._reset_for_tests()


def _record(installed) -> None:
    """One span and one lock measurement, as a request that failed to lock would leave."""
    with installed.tracer_provider.get_tracer("test").start_as_current_span("request"):
        get_telemetry().errors.add(1, {"lock.name": "k", "lock.operation": "acquire",
                                       "error.type": "redis_unavailable"})


def test_traces_exporter_none_exports_no_span_but_the_metrics(receiver, monkeypatch):
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "none")
    installed = telemetry.setup("shop", prometheus=False, flush_on_signal=False)
    assert type(installed.tracer_provider).__name__ == "ProxyTracerProvider"  # no span is even built
    _record(installed)
    assert installed.shutdown()
    assert "otel_lock.errors" in {metric.name for metric in receiver.metrics}
    assert receiver.spans == []


def test_metrics_exporter_none_pushes_no_metric_but_the_spans(receiver, monkeypatch):
    monkeypatch.setenv("OTEL_METRICS_EXPORTER", "none")
    installed = telemetry.setup("shop", flush_on_signal=False)
    assert installed.push is None
    _record(installed)
    assert installed.shutdown()
    assert [span.name for span in receiver.spans] == ["request"]
    assert receiver.metrics == []


def test_sdk_disabled_installs_nothing_and_nothing_leaves_the_process(receiver):
    """Not even the lock's fast path: a process that records and exits (its exit hook ran) sent nothing."""
    script = textwrap.dedent("""
        from otel_lock import telemetry
        from otel_lock.telemetry._instruments import get_telemetry, routed

        installed = telemetry.setup("disabled")
        assert not installed.installed and installed.push is None and not routed(None)
        get_telemetry().errors.add(1, {"lock.name": "k", "lock.operation": "acquire",
                                       "error.type": "redis_unavailable"})
        assert installed.shutdown()
        print("done", flush=True)
    """)
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("OTEL_")},
           "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint, "OTEL_METRIC_EXPORT_INTERVAL": "50",
           "OTEL_SDK_DISABLED": "true"}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "done" in out.stdout, out.stderr
    assert "OTEL_SDK_DISABLED=true, nothing installed" in out.stderr
    assert receiver.metrics == [] and receiver.spans == []


def test_sdk_disabled_false_leaves_the_sdk_on(receiver, monkeypatch):
    monkeypatch.setenv("OTEL_SDK_DISABLED", "false")
    installed = telemetry.setup("shop", prometheus=False, flush_on_signal=False)
    assert installed.installed and installed.push is not None and routed(None)


@pytest.mark.parametrize("variable, value, problem", [
    ("OTEL_EXPORTER_OTLP_PROTOCOL", "http/json", "http/protobuf or grpc"),
    ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "thrift", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"),
    ("OTEL_TRACES_EXPORTER", "zipkin", "otlp and none"),
    ("OTEL_EXPORTER_OTLP_METRICS_TEMPORALITY_PREFERENCE", "weekly", "cumulative, delta, lowmemory"),
])
def test_a_value_that_cannot_be_honoured_is_refused_before_anything_is_installed(receiver, monkeypatch, variable,
                                                                               value, problem):
    monkeypatch.setenv(variable, value)
    with pytest.raises(ValueError, match=problem):
        telemetry.setup("shop", flush_on_signal=False)
    assert telemetry.current() is None
    assert type(installed_tracer()).__name__ == "ProxyTracerProvider"


def installed_tracer():
    from opentelemetry import trace

    return trace.get_tracer_provider()


def test_grpc_without_its_package_is_refused_at_setup_with_the_package_named(receiver):
    script = textwrap.dedent("""
        import sys

        sys.modules["opentelemetry.exporter.otlp.proto.grpc"] = None  # as if it were not installed
        from otel_lock import telemetry
        try:
            telemetry.setup("grpc-less")
        except ImportError as exc:
            print(exc)
    """)
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("OTEL_")},
           "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4317", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60)
    assert "pip install opentelemetry-exporter-otlp-proto-grpc" in out.stdout, out.stdout + out.stderr


class GrpcReceiver:
    """A real OTLP/gRPC receiver on a free loopback port."""

    def __init__(self) -> None:
        from concurrent import futures

        import grpc
        from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2, metrics_service_pb2_grpc
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

        self.spans: list = []
        self.metrics: list = []
        receiver = self

        class Traces(trace_service_pb2_grpc.TraceServiceServicer):
            def Export(self, request, context):  # noqa: N802 (gRPC's naming)
                receiver.spans += [s for r in request.resource_spans for ss in r.scope_spans for s in ss.spans]
                return trace_service_pb2.ExportTraceServiceResponse()

        class Metrics(metrics_service_pb2_grpc.MetricsServiceServicer):
            def Export(self, request, context):  # noqa: N802
                receiver.metrics += [m for r in request.resource_metrics for sm in r.scope_metrics for m in sm.metrics]
                return metrics_service_pb2.ExportMetricsServiceResponse()

        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Traces(), self.server)
        metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(Metrics(), self.server)
        self.endpoint = f"http://127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"
        self.server.start()

    def stop(self) -> None:
        self.server.stop(None).wait(10)


@needs_grpc
async def test_grpc_protocol_sends_spans_and_the_lock_metrics_over_grpc(receiver, monkeypatch, redis_client):
    """The [telemetry-grpc] extra's exporter, to a real OTLP/gRPC receiver: a lock's span and metrics arrive."""
    from otel_lock import LockManager

    grpc_receiver = GrpcReceiver()
    try:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", grpc_receiver.endpoint)
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
        installed = telemetry.setup("shop", prometheus=False, flush_on_signal=False)
        assert installed.push.exporter.__module__.startswith("opentelemetry.exporter.otlp.proto.grpc")
        locks = LockManager(redis_client, namespace="grpc", tracer_provider=installed.tracer_provider,
                            meter_provider=installed.meter_provider)
        try:
            with installed.tracer_provider.get_tracer("test").start_as_current_span("request"):
                async with locks.lock("stock:1", name="stock"):
                    pass
        finally:
            await locks.aclose()
        assert installed.shutdown()
    finally:
        grpc_receiver.stop()
    assert "request" in {span.name for span in grpc_receiver.spans}
    acquired = [point.count for metric in grpc_receiver.metrics if metric.name == "otel_lock.wait.duration"
                for point in metric.histogram.data_points
                if {a.key: a.value for a in point.attributes}["lock.name"].string_value == "stock"
                and {a.key: a.value for a in point.attributes}["lock.outcome"].string_value == "acquired"]
    assert max(acquired) == 1, grpc_receiver.metrics  # cumulative: the last export has the acquisition
    assert receiver.metrics == [] and receiver.spans == []  # nothing went to an HTTP port


def test_delta_temporality_preference_is_honoured_by_the_lock_metrics(receiver, monkeypatch):
    """The lock's counters and histograms were cumulative whatever the preference."""
    from opentelemetry.proto.metrics.v1.metrics_pb2 import AggregationTemporality

    monkeypatch.setenv("OTEL_EXPORTER_OTLP_METRICS_TEMPORALITY_PREFERENCE", "delta")
    installed = telemetry.setup("shop", prometheus=False, flush_on_signal=False)
    instruments = get_telemetry()
    attributes = {"lock.name": "delta-k", "lock.outcome": "acquired", "lock.contended": False}

    def push() -> dict:
        before = len(receiver.metrics)
        assert installed.meter_provider.force_flush()
        assert receiver.wait_for(lambda: len(receiver.metrics) > before)
        return {metric.name: metric for metric in receiver.metrics[before:]}

    instruments.renewals.add(2, {"lock.name": "delta-k", "lock.renewal.outcome": "ok"})
    instruments.wait_duration.record(0.2, attributes)
    first = push()
    instruments.renewals.add(3, {"lock.name": "delta-k", "lock.renewal.outcome": "ok"})
    instruments.wait_duration.record(0.01, attributes)
    instruments.wait_duration.record(0.03, attributes)
    second = push()

    def renewed(metrics: dict) -> float:
        [point] = [p for p in metrics["otel_lock.renewals"].sum.data_points
                   if {a.key: a.value.string_value for a in p.attributes}.get("lock.name") == "delta-k"]
        return point.as_double

    def waits(metrics: dict):
        [point] = [p for p in metrics["otel_lock.wait.duration"].histogram.data_points
                   if {a.key: a.value.string_value for a in p.attributes}.get("lock.name") == "delta-k"]
        return point
    assert first["otel_lock.renewals"].sum.aggregation_temporality == AggregationTemporality.AGGREGATION_TEMPORALITY_DELTA
    assert (renewed(first), renewed(second)) == (2, 3)
    assert second["otel_lock.wait.duration"].histogram.aggregation_temporality == \
        AggregationTemporality.AGGREGATION_TEMPORALITY_DELTA
    later = waits(second)
    assert (waits(first).count, later.count) == (1, 2)
    assert (later.min, later.max) == (0.01, 0.03)  # of its interval, not of all time (0.2)
    assert later.start_time_unix_nano == waits(first).time_unix_nano
