"""Telemetry of a fleet of worker processes: one /metrics port serves the sum, each process pushes as itself.

Real hosts (gunicorn -w 4 with and without --preload, uvicorn --workers 4)
serve tests/_telemetry_workers_app.py; the test sends a known number of
locked requests (the truth), scrapes the one port several times, and
receives the OTLP pushes. Before this, a scrape showed whichever worker
answered (80 acquisitions read as 6 to 80, counters went backwards), and
with --preload every worker pushed under the master's service.instance.id.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import httpx
import pytest
from prometheus_client.openmetrics.parser import text_string_to_metric_families as openmetrics_families
from prometheus_client.parser import text_string_to_metric_families

from otel_lock import telemetry
from otel_lock.cli._redis_server import free_port

from _proc_helpers import until
from _telemetry_helpers import OtlpReceiver

ROOT = Path(__file__).resolve().parents[1]
WAIT_COUNT = "otel_lock_wait_duration_seconds_count"
HOSTS = {
    "gunicorn": ["-m", "gunicorn", "-k", "uvicorn.workers.UvicornWorker", "-w", "4", "--chdir", "{tests}",
                 "-b", "127.0.0.1:{port}", "--graceful-timeout", "5", "_telemetry_workers_app:app"],
    "gunicorn --preload": ["-m", "gunicorn", "--preload", "-k", "uvicorn.workers.UvicornWorker", "-w", "4",
                           "--chdir", "{tests}", "-b", "127.0.0.1:{port}", "--graceful-timeout", "5",
                           "_telemetry_workers_app:app"],
    "uvicorn --workers": ["-m", "uvicorn", "--workers", "4", "--app-dir", "{tests}", "--host", "127.0.0.1",
                          "--port", "{port}", "--log-level", "warning", "_telemetry_workers_app:app"],
}


class _Receiver(OtlpReceiver):
    """Also keeps the last acquired-wait count of the lock `work`, per pushing process and attribute set."""

    def __init__(self) -> None:
        super().__init__()
        self.points: dict[tuple[str, tuple], int] = {}

    def waits(self) -> dict[str, int]:
        """Per service.instance.id: its acquisitions, over every attribute set."""
        out: dict[str, int] = {}
        for (instance, _), count in self.points.items():
            out[instance] = out.get(instance, 0) + count
        return out

    def _accept(self, path: str, body: bytes) -> None:
        if path == "/v1/metrics":
            from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest

            for resource_metrics in ExportMetricsServiceRequest.FromString(body).resource_metrics:
                resource = {a.key: a.value.string_value for a in resource_metrics.resource.attributes}
                for scope in resource_metrics.scope_metrics:
                    for metric in scope.metrics:
                        if metric.name != "otel_lock.wait.duration":
                            continue
                        for point in metric.histogram.data_points:
                            attributes = {a.key: getattr(a.value, a.value.WhichOneof("value"))
                                          for a in point.attributes}
                            if attributes["lock.name"] == "work" and attributes["lock.outcome"] == "acquired":
                                key = (resource["service.instance.id"], tuple(sorted(attributes.items())))
                                with self.received:  # cumulative: the latest is the largest
                                    self.points[key] = max(self.points.get(key, 0), point.count)
        super()._accept(path, body)


@contextlib.contextmanager
def _serving(host: str, redis_url: str, multiproc_dir: Path, otlp: str):
    port = free_port()
    args = [part.format(tests=ROOT / "tests", port=port) for part in HOSTS[host]]
    env = {**{k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "PROMETHEUS_"))},
           "OTEL_LOCK_TEST_REDIS_URL": redis_url, "PROMETHEUS_MULTIPROC_DIR": str(multiproc_dir),
           "OTEL_EXPORTER_OTLP_ENDPOINT": otlp, "OTEL_METRIC_EXPORT_INTERVAL": "200",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    server = subprocess.Popen([sys.executable, *args], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                              text=True, start_new_session=True)
    try:
        yield server, f"http://127.0.0.1:{port}"
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait(5)
        with contextlib.suppress(ProcessLookupError):  # a worker left behind
            os.killpg(server.pid, signal.SIGKILL)
        server.said = server.stderr.read()  # type: ignore[attr-defined]  # what the host and workers logged
        server.stderr.close()


def _samples(text: str, name: str) -> list:
    return [s for family in text_string_to_metric_families(text) for s in family.samples if s.name == name]


def _acquired(text: str) -> float:
    return sum(s.value for s in _samples(text, WAIT_COUNT)
               if s.labels.get("lock_name") == "work" and s.labels.get("lock_outcome") == "acquired")


def _served(text: str) -> float:
    return sum(s.value for s in _samples(text, "http_server_duration_milliseconds_count")
               if s.labels.get("http_target") == "/take")


def _counters(text: str) -> dict[tuple, float]:
    """Every counter, histogram count and bucket (the lock's and HTTP's), by name and labels."""
    out = {}
    for family in text_string_to_metric_families(text):
        if family.type in ("counter", "histogram"):
            for s in family.samples:
                out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


async def _get_past_a_leaving_worker(client: httpx.AsyncClient, path: str, tries: int = 5) -> httpx.Response:
    """GET `path`, again on a transport error: a worker shutting down may reset a connection it accepted.

    uvicorn's graceful shutdown closes the connections whose request it has not read yet; the
    client's next connection goes to a worker still listening.
    """
    for _ in range(tries - 1):
        with contextlib.suppress(httpx.TransportError):
            return await client.get(path)
    return await client.get(path)


@pytest.mark.parametrize("host", list(HOSTS))
async def test_one_port_serves_the_sum_of_every_worker(host, redis_url, tmp_path):
    if host.startswith("gunicorn"):
        pytest.importorskip("gunicorn")
    (multiproc := tmp_path / "prometheus").mkdir()
    fresh = httpx.Limits(max_keepalive_connections=0)  # a new connection per request: any worker may answer
    with _Receiver() as receiver, _serving(host, redis_url, multiproc, receiver.endpoint) as (server, url):
        async with httpx.AsyncClient(base_url=url, timeout=30.0, limits=fresh) as client:
            async def serving() -> bool:
                assert server.poll() is None, server.stderr.read()
                with contextlib.suppress(httpx.TransportError):
                    return (await client.get("/metrics")).status_code == 200
                return False

            await until(serving, f"{host} to answer")
            truth, answers, before = 0, [], {}
            rounds = 0
            # At least 4 rounds, and until two workers have served (a loaded machine may hand one
            # worker every connection for a while); bounded.
            while rounds < 4 or (len({a["pid"] for a in answers}) < 2 and rounds < 40):
                rounds += 1
                batch = await asyncio.gather(*(client.post("/take") for _ in range(20)))
                assert [a.status_code for a in batch] == [200] * len(batch)
                answers += [a.json() for a in batch]
                truth += len(batch)
                for _ in range(3):  # several scrapes of the one port, whichever worker answers
                    text = (await client.get("/metrics")).text
                    assert _acquired(text) == truth
                    now = _counters(text)
                    assert {k: v for k, v in now.items() if v < before.get(k, 0)} == {}, "a counter went back"
                    before = now

            # The SDK's HTTP families reach the files with the gauges (each process within a second).
            async def http_counted() -> bool:
                return _served((await client.get("/metrics")).text) == truth

            await until(http_counted, "the HTTP request count of every worker")

            # Each process its own identity, and each pushes its own share: together, the truth.
            instances = {a["pid"]: a["instance"] for a in answers}
            assert len(set(instances.values())) == len(instances) >= 2, instances
            assert receiver.wait_for(lambda: set(instances.values()) <= set(receiver.waits())
                                     and sum(receiver.waits()[i] for i in instances.values()) == truth), \
                (receiver.waits(), instances)
            text = (await client.get("/metrics")).text
            alive = {s.labels["pid"]: s.labels["service_instance_id"] for s in _samples(text, "target_info")}
            assert {str(pid): instance for pid, instance in instances.items()}.items() <= alive.items()

            if host.startswith("gunicorn"):  # a worker exits: its counts stay, its live series go
                gone = next(iter(instances))
                os.kill(gone, signal.SIGTERM)

                async def replaced() -> bool:
                    text = (await _get_past_a_leaving_worker(client, "/metrics")).text
                    return str(gone) not in {s.labels["pid"] for s in _samples(text, "target_info")}

                await until(replaced, f"worker {gone} to leave /metrics")
                # Its series leave once it has exited (or in its exit hooks, its server closed): no retry.
                for _ in range(3):
                    assert _acquired((await client.get("/metrics")).text) == truth
    # Every worker's setup() started its files' thread after the SDK's reader had a provider.
    assert "Cannot call collect on a MetricReader" not in server.said, server.said[-3000:]


def _run(script: str, env: dict[str, str]) -> str:
    env = {**{k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "PROMETHEUS_"))}, **env}
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], env=env, timeout=60,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return done.stdout


FORK = """
    import os
    from otel_lock import telemetry

    installed = telemetry.setup("forked", {given}, otlp=False, flush_on_signal=False)
    ids = [installed.resource.attributes["service.instance.id"]]
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.write(write, installed.resource.attributes["service.instance.id"].encode())
        os._exit(0)
    os.waitpid(pid, 0)
    print(ids[0], os.read(read, 200).decode(), pid)
"""


def test_a_forked_worker_gets_its_own_instance_id():
    parent, child, _ = _run(FORK.format(given=None), {}).split()
    assert child != parent
    assert parent.split("-")[:-2] == child.split("-")[:-2]  # hostname-pid-random, chosen again


@pytest.mark.parametrize("where", ["argument", "OTEL_RESOURCE_ATTRIBUTES"])
def test_a_given_instance_id_gets_the_pid_of_a_forked_worker(where):
    given, env = ('"replica-a"', {}) if where == "argument" else ("None", {
        "OTEL_RESOURCE_ATTRIBUTES": "service.instance.id=replica-a"})
    parent, child, pid = _run(FORK.format(given=given), env).split()
    assert (parent, child) == ("replica-a", f"replica-a-{pid}")


def test_a_multiproc_dir_that_is_not_a_directory_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path / "missing"))
    telemetry._reset_for_tests()
    try:
        with pytest.raises(ValueError, match="PROMETHEUS_MULTIPROC_DIR"):
            telemetry.setup(otlp=False, flush_on_signal=False)
    finally:
        telemetry._reset_for_tests()


def test_the_worker_files_thread_starts_once_a_provider_holds_the_sdk_reader(tmp_path, monkeypatch, caplog):
    """Its first publish collects the SDK's Prometheus reader; before a provider held it, that warned.

    Every worker logged "Cannot call collect on a MetricReader until it is
    registered on a MeterProvider" at start-up when its thread ran first (41
    of 60 gunicorn starts). Here the provider's construction waits for a
    publish whenever the thread is already running, so the order is tested,
    not the luck of a race.
    """
    from opentelemetry.sdk import metrics as sdk_metrics

    from otel_lock.telemetry import _multiproc

    published, publishers = threading.Event(), [0]
    publish, start = _multiproc.Publisher.publish, _multiproc.Publisher._start

    def publishing(self: _multiproc.Publisher) -> None:
        publish(self)
        published.set()

    def starting(self: _multiproc.Publisher) -> None:
        publishers[0] += 1
        start(self)

    class Provider(sdk_metrics.MeterProvider):
        def __init__(self, *args, **kwargs) -> None:
            if publishers[0]:
                assert published.wait(10)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(_multiproc.Publisher, "publish", publishing)
    monkeypatch.setattr(_multiproc.Publisher, "_start", starting)
    monkeypatch.setattr(sdk_metrics, "MeterProvider", Provider)
    for name in [n for n in os.environ if n.startswith(("OTEL_", "PROMETHEUS_"))]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    telemetry._reset_for_tests()
    try:
        with caplog.at_level(logging.WARNING):
            telemetry.setup("ordered", otlp=False, flush_on_signal=False)
            assert published.wait(10)  # the thread ran, after the provider took the reader
        assert publishers[0] == 1
        assert [r.getMessage() for r in caplog.records if "MetricReader" in r.getMessage()] == []
    finally:
        telemetry._reset_for_tests()


@pytest.mark.parametrize("multiproc", [False, True], ids=["one process", "PROMETHEUS_MULTIPROC_DIR"])
async def test_wait_buckets_carry_exemplars_in_openmetrics(multiproc, redis_client, tmp_path, monkeypatch):
    """Before: exemplars travelled by OTLP only, the wait heatmap on /metrics could not reach the trace."""
    for name in [n for n in os.environ if n.startswith(("OTEL_", "PROMETHEUS_"))]:
        monkeypatch.delenv(name)
    if multiproc:
        monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    # Traces are recorded (OTLP on); the metrics are read at /metrics only.
    monkeypatch.setenv("OTEL_METRICS_EXPORTER", "prometheus")
    telemetry._reset_for_tests()
    with OtlpReceiver() as receiver:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.endpoint)
        await _scrape_exemplars(redis_client)


async def _scrape_exemplars(redis_client) -> None:
    from starlette.applications import Starlette
    from starlette.routing import Route

    from otel_lock import LockManager

    try:
        installed = telemetry.setup("exemplars", flush_on_signal=False)
        locks = LockManager(redis_client, namespace="exemplars")
        with installed.tracer_provider.get_tracer("test").start_as_current_span("request") as span:
            async with locks.lock("stock:1", name="stock"):
                pass
        await locks.aclose()
        app = Starlette(routes=[Route("/metrics", telemetry.metrics_endpoint)])
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            answer = await client.get("/metrics", headers={"Accept": "application/openmetrics-text"})
            plain = await client.get("/metrics")
        assert answer.headers["content-type"].startswith("application/openmetrics-text")
        exemplars = [s.exemplar for f in openmetrics_families(answer.text) for s in f.samples
                     if s.name == "otel_lock_wait_duration_seconds_bucket" and s.exemplar is not None]
        trace_id = f"{span.get_span_context().trace_id:032x}"
        assert [e.labels["trace_id"] for e in exemplars] == [trace_id]
        assert "trace_id" not in plain.text  # the classic text format has no exemplars
    finally:
        telemetry._reset_for_tests()


GAUGES = """
    import asyncio, os, sys, time
    from prometheus_client.exposition import generate_latest
    from prometheus_client.parser import text_string_to_metric_families
    from otel_lock import LockManager, telemetry

    installed = telemetry.setup("gauges", otlp=False, flush_on_signal=False)

    def scrape():
        text = generate_latest(installed.registry).decode()
        return {(s.name, s.labels.get("pid")): s.value for f in text_string_to_metric_families(text)
                for s in f.samples if s.labels.get("lock_name") == "g"}

    def until(check):
        deadline = time.monotonic() + 20
        while not check(scrape()):
            assert time.monotonic() < deadline, scrape()
            time.sleep(0.05)
        return scrape()

    async def hold(key, ready, leave):
        locks = LockManager.from_url(sys.argv[1], namespace="gauges")
        async with locks.lock(key, name="g"):
            os.write(ready, b"x")
            await asyncio.get_running_loop().run_in_executor(None, os.read, leave, 1)
        await locks.aclose()

    ready, child_ready = os.pipe()
    leave, child_leave = os.pipe()
    pid = os.fork()
    if pid == 0:
        asyncio.run(hold("child", child_ready, leave))
        os._exit(0)  # no exit hooks: the sweep at the next scrape must see it gone
    os.read(ready, 1)
    me = str(os.getpid())

    async def parent():
        locks = LockManager.from_url(sys.argv[1], namespace="gauges")
        async with locks.lock("parent", name="g"):
            both = await asyncio.to_thread(until, lambda s: s.get(("otel_lock_active", None)) == 2)
            ages = {pid for name, pid in both if name == "otel_lock_hold_age_seconds"}
            assert ages == {me, str(pid)}, both  # liveall: one hold age per process
            os.write(child_leave, b"x")
            os.waitpid(pid, 0)
            one = await asyncio.to_thread(until, lambda s: s.get(("otel_lock_active", None)) == 1)
            assert {pid for name, pid in one if name == "otel_lock_hold_age_seconds"} == {me}, one
        await locks.aclose()

    asyncio.run(parent())
    print("ok")
"""


def test_gauges_of_worker_processes_add_up_or_stay_per_process(redis_url, tmp_path):
    """Held locks add up over live processes (livesum); a hold's age stays with its process (liveall) and goes with it."""
    script = textwrap.dedent(GAUGES)
    env = {**{k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "PROMETHEUS_"))},
           "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", script, redis_url], env=env, timeout=90, capture_output=True,
                          text=True)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


async def test_target_info_names_the_processes_that_have_a_lock_manager(redis_client, tmp_path, monkeypatch):
    """A gunicorn master without a manager pushes no lock metrics: listed, it would page as a broken push."""
    from prometheus_client.exposition import generate_latest

    from otel_lock import LockManager

    for name in [n for n in os.environ if n.startswith(("OTEL_", "PROMETHEUS_"))]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    telemetry._reset_for_tests()
    try:
        installed = telemetry.setup("masters", otlp=False, flush_on_signal=False)

        def listed() -> dict[str, str]:
            text = generate_latest(installed.registry).decode()
            return {s.labels["pid"]: s.labels["service_instance_id"] for s in _samples(text, "target_info")}

        gc.collect()  # the managers of earlier tests in this process, closed but not yet collected
        assert listed() == {}
        locks = LockManager(redis_client, namespace="masters")
        assert listed() == {str(os.getpid()): installed.resource.attributes["service.instance.id"]}
        await locks.aclose()
    finally:
        telemetry._reset_for_tests()


def test_a_reused_pid_never_overwrites_the_counts_of_the_process_that_had_it(tmp_path):
    """A new worker with a dead worker's pid starts its own counts; the dead one's stay in the sum."""
    from prometheus_client import CollectorRegistry
    from prometheus_client.exposition import generate_latest

    from otel_lock.telemetry import _multiproc
    from otel_lock.telemetry._prom import FastMetrics

    def errors(fast: FastMetrics, times: int) -> None:
        for _ in range(times):
            fast.instruments["errors"].add(1, {"lock.name": "a", "lock.operation": "acquire", "error.type": "x"})

    errors(FastMetrics(CollectorRegistry(), shared=str(tmp_path)), 5)  # the first process with this pid
    registry = CollectorRegistry()
    later = FastMetrics(registry, shared=str(tmp_path))  # the next one with the same pid
    _multiproc.serve(registry, str(tmp_path), later, dict)
    errors(later, 2)
    text = generate_latest(registry).decode()
    assert [s.value for s in _samples(text, "otel_lock_errors_total")] == [7.0]


def test_a_process_whose_directory_was_emptied_keeps_recording(tmp_path):
    """The directory emptied under a live process (a newer start's `rm -rf DIR && mkdir -p DIR`): its next
    new file made LockManager() and the lock's records raise FileNotFoundError; it is written in a new one."""
    from prometheus_client import CollectorRegistry
    from prometheus_client.exposition import generate_latest

    from otel_lock.telemetry import _multiproc
    from otel_lock.telemetry._prom import FastMetrics

    path = tmp_path / _multiproc.SUBDIR
    path.mkdir()
    registry = CollectorRegistry()
    fast = FastMetrics(registry, shared=str(path))  # setup() ran; no file opened yet (a --preload worker)
    shutil.rmtree(path)
    fast.instruments["errors"].add(1, {"lock.name": "a", "lock.operation": "acquire", "error.type": "x"})
    _multiproc.serve(registry, str(path), fast, dict)
    text = generate_latest(registry).decode()
    assert [s.value for s in _samples(text, "otel_lock_errors_total")] == [1.0]


def test_a_scrape_while_a_worker_creates_its_file_answers(tmp_path):
    """A worker's new file is empty for a moment (created, not yet sized): a scrape then answered 500."""
    from prometheus_client import CollectorRegistry
    from prometheus_client.exposition import generate_latest

    from otel_lock.telemetry import _multiproc
    from otel_lock.telemetry._prom import FastMetrics

    registry = CollectorRegistry()
    fast = FastMetrics(registry, shared=str(tmp_path))
    _multiproc.serve(registry, str(tmp_path), fast, dict)
    fast.instruments["errors"].add(1, {"lock.name": "a", "lock.operation": "acquire", "error.type": "x"})
    for kind in ("counter", "histogram", "gauge_livesum"):  # another worker, between open and truncate
        (tmp_path / f"{kind}_{os.getpid() + 100_000}.db").touch()
    text = generate_latest(registry).decode()
    assert [s.value for s in _samples(text, "otel_lock_errors_total")] == [1.0]


def test_a_scrape_while_another_worker_sweeps_the_same_dead_worker_answers(tmp_path, monkeypatch):
    """A stopped uvicorn worker leaves its live gauges to the next scrape (it ends by SIGTERM, no exit hooks).

    Two workers scraping at once both removed them, and the second to remove a file answered 500.
    """
    from prometheus_client import CollectorRegistry
    from prometheus_client.exposition import generate_latest
    from prometheus_client.mmap_dict import MmapedDict, mmap_key

    from otel_lock.telemetry import _multiproc
    from otel_lock.telemetry._prom import FastMetrics

    registry = CollectorRegistry()
    fast = FastMetrics(registry, shared=str(tmp_path))
    _multiproc.serve(registry, str(tmp_path), fast, dict)
    fast.instruments["errors"].add(1, {"lock.name": "a", "lock.operation": "acquire", "error.type": "x"})
    gone = int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True, check=True).stdout)  # exited and reaped
    for kind in ("gauge_livesum", "gauge_liveall"):  # what it wrote while it lived
        file = MmapedDict(str(tmp_path / f"{kind}_{gone}.db"))
        file.write_value(mmap_key("target_info", "target_info", [], [], "Target metadata"), 1.0, 0.0)
        file.close()
    remove = os.remove

    def removed_by_another_worker_first(name):
        remove(name)  # the other worker's sweep, between this one's listing and its removal
        remove(name)

    monkeypatch.setattr(os, "remove", removed_by_another_worker_first)
    text = generate_latest(registry).decode()
    assert [s.value for s in _samples(text, "otel_lock_errors_total")] == [1.0]
    assert str(gone) not in {s.labels.get("pid") for s in _samples(text, "target_info")}
    assert sorted(tmp_path.glob(f"*_{gone}.db")) == []


def test_every_observed_gauge_has_a_chosen_multiprocess_mode():
    """Regression: a gauge added without a mode (server_verdict) broke every worker's gauge files."""
    from otel_lock.telemetry._multiproc import GAUGE_MODES
    from otel_lock.telemetry._names import OBSERVED

    assert set(GAUGE_MODES) == set(OBSERVED)
    assert set(GAUGE_MODES.values()) <= {"livesum", "liveall", "livemax", "livemin", "max", "min", "sum", "all"}
