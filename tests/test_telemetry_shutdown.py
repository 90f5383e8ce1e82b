"""Nothing lost at shutdown.

A real `otel-lock serve` process (uvicorn, which raises SIGTERM again after
its graceful shutdown) and plain `setup()` scripts get a real signal; a real
OTLP/HTTP receiver in the test decodes what reaches it. Export intervals are
an hour, so everything that arrives was sent by the shutdown.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import httpx
import pytest

from otel_lock.cli._redis_server import free_port

from _telemetry_helpers import OtlpReceiver

STOCK = "stock:{path.product_id}"
REQUESTS = 40
HOUR_MS = "3600000"


def quiet_env(receiver: OtlpReceiver | SilentCollector) -> dict[str, str]:
    """OTLP to the receiver, nothing exported on a timer during the test."""
    return {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint, "OTEL_METRICS_EXPORTER": "otlp",
            "OTEL_METRIC_EXPORT_INTERVAL": HOUR_MS, "OTEL_BSP_SCHEDULE_DELAY": HOUR_MS,
            "OTEL_SERVICE_NAME": "shutdown-test"}


def acquisitions(receiver: OtlpReceiver, name: str) -> int:
    """Acquired waits of lock `name` in the last export of otel_lock.wait.duration (cumulative)."""
    counts = [sum(p.count for p in m.histogram.data_points
                  if {a.key: a.value.string_value for a in p.attributes}.get("lock.name") == name
                  and {a.key: a.value.string_value for a in p.attributes}.get("lock.outcome") == "acquired")
              for m in receiver.metrics if m.name == "otel_lock.wait.duration"]
    return counts[-1] if counts else 0


def serve(redis_url: str, receiver: OtlpReceiver, namespace: str) -> tuple[subprocess.Popen, str]:
    """`otel-lock serve` on a free port, with SIGINT at its default (a shell's background job ignores it)."""
    port = free_port()
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}, **quiet_env(receiver)}
    process = subprocess.Popen(
        [sys.executable, "-m", "otel_lock.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
         "--redis-url", redis_url, "--namespace", namespace, "--job-interval", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    url = f"http://127.0.0.1:{port}"
    with httpx.Client(timeout=1.0) as client:
        for _ in range(600):  # bounded wait for uvicorn to answer (the process exiting fails it at once)
            assert process.poll() is None, process.communicate()[0]
            try:
                if client.get(url + "/healthz").status_code == 200:
                    return process, url
            except httpx.TransportError:
                pass
            time.sleep(0.05)
    process.kill()
    raise AssertionError(f"otel-lock serve did not answer: {process.communicate()[0]}")


# SIGTERM: uvicorn raises it again after its graceful shutdown, the process dies of it (after
# the flush). SIGINT: uvicorn.run() swallows the KeyboardInterrupt, serve returns 0 (after the flush).
@pytest.mark.parametrize("signum, status", [(signal.SIGTERM, -signal.SIGTERM), (signal.SIGINT, 0)],
                         ids=["SIGTERM", "SIGINT"])
def test_serve_flushes_spans_and_metrics_on_a_signal(redis_url, signum, status):
    with OtlpReceiver() as receiver:
        process, url = serve(redis_url, receiver, f"shutdown-{signum}")
        try:
            with httpx.Client(base_url=url, timeout=10.0) as client:
                assert client.put("/api/stock/p1", json={"stock": 1000}).status_code == 200
                for _ in range(REQUESTS - 1):
                    assert client.post("/api/stock/p1/deduct").status_code == 200
            # (new series are announced at 0 at once: no acquisition, no span left before the signal)
            assert acquisitions(receiver, STOCK) == 0 and not receiver.spans, "exported before the signal"
            process.send_signal(signum)
            output = process.communicate(timeout=30)[0]
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
        assert process.returncode == status, output
        assert acquisitions(receiver, STOCK) == REQUESTS
        names = [span.name for span in receiver.spans]
        assert names.count(f"lock acquire {STOCK}") == REQUESTS
        assert names.count(f"lock hold {STOCK}") == REQUESTS
        assert names.count("POST /api/stock/{product_id}/deduct") == REQUESTS - 1


SCRIPT = textwrap.dedent("""
    import asyncio, signal, sys, time
    from otel_lock import LockManager, telemetry

    if sys.argv[2] == "own-handler":
        signal.signal(signal.SIGTERM, lambda *_: print("own handler ran", flush=True) or sys.exit(3))
    installed = telemetry.setup("script", flush_on_signal=sys.argv[2] != "no-signals")

    async def work():
        locks = LockManager.from_url(sys.argv[1], namespace="shutdown-script")
        tracer = installed.tracer_provider.get_tracer("script")
        for i in range(10):
            with tracer.start_as_current_span("job"):
                async with locks.lock(f"report-{i}", name="report"):
                    pass
        await locks.aclose()
    asyncio.run(work())
    print("ready", flush=True)
    while True:
        time.sleep(1)
""")


def run_script(redis_url: str, receiver: OtlpReceiver, mode: str) -> tuple[int, str]:
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}, **quiet_env(receiver)}
    process = subprocess.Popen([sys.executable, "-c", SCRIPT, redis_url, mode], stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, env=env)
    try:
        assert process.stdout.readline() == "ready\n"
        assert acquisitions(receiver, "report") == 0 and not receiver.spans  # (series at 0 only, if any)
        process.send_signal(signal.SIGTERM)
        output = process.communicate(timeout=30)[0]
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    return process.returncode, output


def test_setup_flushes_before_a_sigterm_kills_the_process(redis_url):
    with OtlpReceiver() as receiver:
        status, output = run_script(redis_url, receiver, "default")
        assert status == -signal.SIGTERM, output  # still dies of the signal, as supervisors expect
        assert acquisitions(receiver, "report") == 10
        assert [span.name for span in receiver.spans].count("lock acquire report") == 10


def test_a_handler_the_app_installed_first_still_decides_and_the_exit_flushes(redis_url):
    with OtlpReceiver() as receiver:
        status, output = run_script(redis_url, receiver, "own-handler")
        assert status == 3 and "own handler ran" in output, output
        assert acquisitions(receiver, "report") == 10


def test_without_flush_on_signal_sigterm_keeps_its_default_action(redis_url):
    with OtlpReceiver() as receiver:
        status, output = run_script(redis_url, receiver, "no-signals")
        assert status == -signal.SIGTERM, output
        assert acquisitions(receiver, "report") == 0  # what every deploy lost before `flush_on_signal` existed


class SilentCollector:
    """A TCP listener that accepts every connection and never answers (a collector hung or black-holed)."""

    def __init__(self) -> None:
        import socket
        import threading

        self._socket = socket.socket()
        self._socket.bind(("127.0.0.1", 0))
        self._socket.listen(64)
        self.endpoint = f"http://127.0.0.1:{self._socket.getsockname()[1]}"
        self.accepted: list = []
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while True:
            try:
                connection, _ = self._socket.accept()
            except OSError:
                return
            self.accepted.append(connection)  # kept open, never read from, never answered

    def close(self) -> None:
        import socket

        try:
            self._socket.shutdown(socket.SHUT_RDWR)  # wakes the accept() of its thread
        except OSError:
            pass
        self._socket.close()
        self._thread.join(10)
        for connection in self.accepted:
            connection.close()


def test_shutdown_honours_its_timeout_and_names_what_it_could_not_deliver(monkeypatch, caplog):
    """Regression test: with a collector that does not answer, `shutdown(timeout=3)` took 29 s and returned True
    with nothing delivered."""
    import logging

    from otel_lock import telemetry
    from otel_lock.telemetry._instruments import get_telemetry

    collector = SilentCollector()
    for name, value in quiet_env(collector).items():
        monkeypatch.setenv(name, value)
    telemetry._reset_for_tests()
    try:
        installed = telemetry.setup("silent", prometheus=False, flush_on_signal=False)
        with installed.tracer_provider.get_tracer("test").start_as_current_span("job"):
            get_telemetry().errors.add(1, {"lock.name": "k", "lock.operation": "acquire",
                                           "error.type": "redis_unavailable"})
        began = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="otel_lock.telemetry"):
            delivered = installed.shutdown(timeout=3)
        took = time.monotonic() - began
    finally:
        telemetry._reset_for_tests()
        collector.close()
    assert delivered is False
    assert collector.accepted, "the exports did reach the listener"
    assert took < 20, f"shutdown(timeout=3) took {took:.1f} s"  # generous: the bound is 3 s; it was 29 s
    [warning] = [r.getMessage() for r in caplog.records if "could not deliver" in r.getMessage()]
    assert "spans" in warning and "metrics" in warning, warning


def test_a_failed_last_export_is_reported(monkeypatch, caplog):
    """A collector that refuses (nothing listens): the last spans and metrics fail at once, and say so."""
    import logging

    from otel_lock import telemetry
    from otel_lock.telemetry._instruments import get_telemetry

    nobody = SilentCollector()
    nobody.close()  # its port, with nothing listening any more
    for name, value in quiet_env(nobody).items():
        monkeypatch.setenv(name, value)
    telemetry._reset_for_tests()
    try:
        installed = telemetry.setup("refused", prometheus=False, flush_on_signal=False)
        with installed.tracer_provider.get_tracer("test").start_as_current_span("job"):
            get_telemetry().errors.add(1, {"lock.name": "k", "lock.operation": "acquire",
                                           "error.type": "redis_unavailable"})
        with caplog.at_level(logging.WARNING, logger="otel_lock.telemetry"):
            delivered = installed.shutdown(timeout=5)
    finally:
        telemetry._reset_for_tests()
    assert delivered is False
    [warning] = [r.getMessage() for r in caplog.records if "could not deliver" in r.getMessage()]
    assert "1 spans" in warning and "points" in warning, warning
