"""OTLP end to end: lock spans and metrics reach a receiver as OTLP/HTTP protobuf."""

from __future__ import annotations

import pytest

from otel_lock import telemetry

from _telemetry_helpers import OtlpReceiver


@pytest.fixture
def receiver(monkeypatch):
    with OtlpReceiver() as receiver:
        for name in ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT",
                     "OTEL_SERVICE_NAME", "OTEL_RESOURCE_ATTRIBUTES"):
            monkeypatch.delenv(name, raising=False)
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.endpoint)
        telemetry._reset_for_tests()
        yield receiver
        telemetry._reset_for_tests()


async def test_lock_spans_and_metrics_arrive_over_otlp(receiver, redis_client):
    from otel_lock import LockManager

    installed = telemetry.setup("shop", "replica-a", prometheus=False)
    assert installed.otlp, "OTEL_EXPORTER_OTLP_ENDPOINT alone turns OTLP on"
    locks = LockManager(redis_client, namespace="otlp-test",
                        tracer_provider=installed.tracer_provider, meter_provider=installed.meter_provider)
    try:
        # Acquire spans are children of the caller's span (a request, a job).
        with installed.tracer_provider.get_tracer("test").start_as_current_span("request"):
            async with locks.lock("stock:1", name="stock:{id}"):
                pass
    finally:
        await locks.aclose()
    assert installed.tracer_provider.force_flush()
    assert installed.meter_provider.force_flush()

    assert receiver.wait_for(lambda: receiver.spans and receiver.metrics)
    assert "lock acquire stock:{id}" in {span.name for span in receiver.spans}
    names = {metric.name for metric in receiver.metrics}
    assert {"otel_lock.wait.duration", "otel_lock.hold.duration", "otel_lock.active"} <= names
    wait = next(m for m in receiver.metrics if m.name == "otel_lock.wait.duration")
    assert wait.unit == "s"
    # The name's other outcomes exist at 0 from its first wait (series before their first event).
    def outcome(p) -> str:
        return {a.key: a.value.string_value for a in p.attributes}.get("lock.outcome", "")
    point = next(p for p in wait.histogram.data_points if outcome(p) == "acquired")
    attributes = {a.key: a.value.string_value for a in point.attributes}
    assert attributes["lock.name"] == "stock:{id}"
    assert point.count == 1
    # Exemplars travel by OTLP (the Prometheus reader drops them): the wait was
    # recorded inside the acquire span, so its exemplar carries that trace id.
    acquire = next(span for span in receiver.spans if span.name == "lock acquire stock:{id}")
    assert [exemplar.trace_id for exemplar in point.exemplars] == [acquire.trace_id]
    resource = {a.key: a.value.string_value for a in receiver.resources[0].attributes}
    assert resource["service.name"] == "shop"
    assert resource["service.instance.id"] == "replica-a"


def test_explicit_otlp_false_wins_over_the_environment(receiver):
    installed = telemetry.setup(otlp=False)
    assert not installed.otlp


def test_a_forked_child_keeps_exporting(receiver):
    """gunicorn --preload: setup() in the parent, the lock's metrics recorded in a forked worker still leave."""
    import os
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent("""
        import os, sys
        from otel_lock import telemetry
        from otel_lock.telemetry._instruments import get_telemetry

        telemetry.setup("forked", flush_on_signal=False)
        pid = os.fork()
        if pid == 0:
            get_telemetry().errors.add(1, {"lock.name": "from-child", "lock.operation": "acquire",
                                           "error.type": "redis_unavailable"})
            import time
            time.sleep(2)  # several export intervals of the child's own thread, then a hard exit (no hooks)
            os._exit(0)
        os.waitpid(pid, 0)
    """)
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("OTEL_")},
           "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint, "OTEL_METRIC_EXPORT_INTERVAL": "200"}
    subprocess.run([sys.executable, "-c", script], env=env, timeout=60, check=True)

    def names():
        return {a.value.string_value for m in receiver.metrics if m.name == "otel_lock.errors"
                for p in m.sum.data_points for a in p.attributes if a.key == "lock.name"}
    assert receiver.wait_for(lambda: "from-child" in names())


def _hold_points(metrics: list, name: str) -> dict[str, float]:
    return {a.value.string_value: p.as_double for m in metrics if m.name == name
            for p in m.gauge.data_points for a in p.attributes if a.key == "lock.name"}


async def test_an_ended_hold_is_pushed_at_zero_once_not_left_at_its_last_age(receiver, redis_client):
    """Regression test: the hold-age and lease points of a hold that ended were left out of later pushes, so the
    collector kept the last values and OtelLockHoldNearLease went pending for a lock nobody held."""
    from otel_lock import LockManager

    installed = telemetry.setup("shop", "replica-a", prometheus=False, flush_on_signal=False)
    locks = LockManager(redis_client, namespace="ghost", meter_provider=installed.meter_provider)

    def push() -> list:
        before = len(receiver.metrics)
        assert installed.meter_provider.force_flush()
        assert receiver.wait_for(lambda: len(receiver.metrics) > before)
        return receiver.metrics[before:]
    try:
        held = await locks.acquire("report:1", name="report", lease=20)
        holding = push()
        await held.release()
        ended = push()
        later = push()
    finally:
        await locks.aclose()
    assert _hold_points(holding, "otel_lock.hold.age")["report"] >= 0
    assert _hold_points(holding, "otel_lock.lease") == {"report": 20.0}
    # the push after the release says the hold is over: age 0 and lease 0 (no ratio to alert on)
    assert _hold_points(ended, "otel_lock.hold.age") == {"report": 0.0}
    assert _hold_points(ended, "otel_lock.lease") == {"report": 0.0}
    # and once delivered, the name is left out
    assert "report" not in _hold_points(later, "otel_lock.hold.age")


async def test_a_new_lock_names_series_at_zero_are_pushed_at_once_not_an_interval_later(receiver, monkeypatch,
                                                                                       redis_client):
    """The collector must have the 0 before the first event: born at the first push (60 s later by default),
    a series that already holds a lost lease is one increase() never sees."""
    monkeypatch.setenv("OTEL_METRIC_EXPORT_INTERVAL", "3600000")
    from otel_lock import LockManager

    installed = telemetry.setup("shop", "replica-a", prometheus=False, flush_on_signal=False)
    locks = LockManager(redis_client, namespace="soon", meter_provider=installed.meter_provider)

    def lost_at_zero() -> bool:
        return any(p.as_double == 0 and {a.key: a.value.string_value for a in p.attributes}
                   == {"lock.name": "fresh", "lock.renewal.outcome": "lost"}
                   for m in receiver.metrics if m.name == "otel_lock.renewals" for p in m.sum.data_points)
    try:
        async with locks.lock("fresh:1", name="fresh"):
            assert receiver.wait_for(lost_at_zero), "no push of the new name's series within 10 s (interval: 1 h)"
    finally:
        await locks.aclose()
