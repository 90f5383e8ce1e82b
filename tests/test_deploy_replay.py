"""The compose stack builds and runs its own commands, replayed without Docker.

The Dockerfile's COPY and RUN steps are replayed into a fresh virtualenv from
a clean `git archive` of this checkout (tracked files, with uncommitted edits,
nothing else lying around), kept in a cache keyed by what the image is made of
(tests/_deploy_image.py; ./scripts/test fills it before pytest). Then each compose
service's own command and healthcheck run from that virtualenv against local
processes, as `otel-lock stack` does: Redis, both replicas (OTLP to a real
receiver standing in for the collector), the load generator, and Prometheus
with the compose config (runbooks served). The collector, Jaeger and Grafana
have no local binaries here; their configs are checked in test_deploy_files.py.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest
import yaml

from otel_lock.cli._redis_server import free_port

from _deploy_image import PIP_TIMEOUT, archive, ensure_image
from _telemetry_helpers import OtlpReceiver

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
SERVICES = COMPOSE["services"]
DEADLINE = 60.0
# The image comes from the cache ./scripts/test fills before pytest (tests/_deploy_image.py); run
# alone on a changed tree, the fixture replays the Dockerfile itself, pip install included.
pytestmark = pytest.mark.timeout(PIP_TIMEOUT + 120)


@pytest.fixture(scope="module")
def image(tmp_path_factory):
    context = tmp_path_factory.mktemp("context")
    archive(context)
    return ensure_image(context), context


def local(argv: list[str], ports: dict[str, str]) -> list[str]:
    """A compose argv with service addresses mapped to local ones ("app1:8000" -> "127.0.0.1:<port>")."""
    out = []
    for arg in argv:
        for address, here in ports.items():
            arg = arg.replace(address, here)
        out.append(arg)
    return out


def start(argv: list[str], bin_dir: Path, env: dict[str, str], log: Path) -> subprocess.Popen:
    run_env = {**{k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}, **env,
               "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "PYTHONPATH": ""}
    with open(log, "wb") as out:
        return subprocess.Popen(argv, env=run_env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, cwd=log.parent)


def healthy(service: str, bin_dir: Path, ports: dict[str, str], process: subprocess.Popen, log: Path) -> None:
    """Run the service's own compose healthcheck (mapped to local ports) until it passes."""
    test = SERVICES[service]["healthcheck"]["test"]
    assert test[0] == "CMD"
    argv = local(test[1:], ports)
    if argv[0] == "python":
        argv[0] = str(bin_dir / "python")
    elif argv[0] == "wget":  # the image's busybox wget: the same GET, from Python
        argv = [str(bin_dir / "python"), "-c", f"import urllib.request; urllib.request.urlopen({argv[-1]!r}, timeout=2)"]
    deadline = time.monotonic() + DEADLINE
    while subprocess.run(argv, capture_output=True).returncode != 0:
        assert process.poll() is None, f"{service} exited: {log.read_text(errors='replace')[-3000:]}"
        assert time.monotonic() < deadline, f"{service} never healthy: {log.read_text(errors='replace')[-3000:]}"
        time.sleep(0.2)


def stop(process: subprocess.Popen) -> int:
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(5)
    return process.returncode


def test_the_image_carries_the_extras_its_services_run(image):
    bin_dir, _ = image
    installed = subprocess.run([str(bin_dir / "python"), "-c", "import uvicorn, httpx, yaml, "
                                "opentelemetry.sdk, opentelemetry.exporter.otlp.proto.http, prometheus_client; "
                                "from otel_lock.cli._files import check_prometheus_files, dashboards_dir; "
                                "print(check_prometheus_files()[0]); print(sorted(p.name for p in dashboards_dir().glob('*.json')))"],
                               capture_output=True, text=True, cwd="/")
    assert installed.returncode == 0, installed.stderr
    assert "/_data/deploy/prometheus/prometheus.yml" in installed.stdout  # the wheel's copy, not a checkout's
    assert "otel-lock-lock.json" in installed.stdout and "otel-lock-overview.json" in installed.stdout


@pytest.mark.skipif(shutil.which("prometheus") is None or shutil.which("redis-server") is None,
                    reason="needs redis-server and prometheus on PATH (Debian packages)")
def test_every_compose_service_command_runs_against_local_processes(image, tmp_path):
    bin_dir, context = image
    ports = {name: str(free_port()) for name in ("redis", "app1", "app2", "prometheus")}
    addresses = {f"{name}:{'6379' if name == 'redis' else '9090' if name == 'prometheus' else '8000'}":
                 f"127.0.0.1:{port}" for name, port in ports.items()}
    processes: dict[str, subprocess.Popen] = {}
    with OtlpReceiver() as collector:
        try:
            redis_argv = SERVICES["redis"]["command"] + ["--port", ports["redis"], "--bind", "127.0.0.1"]
            processes["redis"] = start(redis_argv, bin_dir, {}, tmp_path / "redis.log")
            healthy_redis = ["redis-cli", "-p", ports["redis"], "ping"]
            assert SERVICES["redis"]["healthcheck"]["test"][1:] == ["redis-cli", "ping"]
            _until(lambda: subprocess.run(healthy_redis, capture_output=True).stdout.strip() == b"PONG", "redis")

            for name in ("app1", "app2"):
                service = SERVICES[name]
                env = {k: local([str(v)], addresses)[0] for k, v in service["environment"].items()}
                env["OTEL_EXPORTER_OTLP_ENDPOINT"] = collector.endpoint  # the collector's stand-in
                argv = local(service["command"], addresses)
                argv[argv.index("--port") + 1] = ports[name]
                argv[argv.index("--host") + 1] = "127.0.0.1"
                processes[name] = start(argv, bin_dir, env, tmp_path / f"{name}.log")
            for name in ("app1", "app2"):
                healthy(name, bin_dir, {"127.0.0.1:8000": f"127.0.0.1:{ports[name]}"}, processes[name],
                        tmp_path / f"{name}.log")

            loadgen = local(SERVICES["loadgen"]["command"], {f"http://{k}": f"http://{v}" for k, v in addresses.items()})
            loadgen[0] = str(bin_dir / "python")
            processes["loadgen"] = start(loadgen, bin_dir, {}, tmp_path / "loadgen.log")

            # Both replicas push lock metrics, made by the load generator's requests.
            def pushed(replica: str) -> bool:
                return any(r.attributes and any(a.key == "service.instance.id" and a.value.string_value == replica
                                                for a in r.attributes) for r in collector.resources) and any(
                    m.name == "otel_lock.wait.duration" for m in collector.metrics)
            assert collector.wait_for(lambda: pushed("app1") and pushed("app2"), timeout=DEADLINE), \
                (tmp_path / "loadgen.log").read_text(errors="replace")[-2000:]

            prometheus = _compose_prometheus(context, tmp_path, addresses, ports["prometheus"])
            processes["prometheus"] = start(prometheus, bin_dir, {}, tmp_path / "prometheus.log")
            url = f"http://127.0.0.1:{ports['prometheus']}"
            healthy("prometheus", bin_dir, {"127.0.0.1:9090": f"127.0.0.1:{ports['prometheus']}"},
                    processes["prometheus"], tmp_path / "prometheus.log")
            with httpx.Client(base_url=url, timeout=5.0) as client:
                runbooks = client.get("/consoles/otel-lock-runbooks.html")
                assert runbooks.status_code == 200 and 'id="lease-lost"' in runbooks.text
                rules = client.get("/api/v1/rules").json()["data"]["groups"]
                assert {r["name"] for g in rules for r in g["rules"]} >= {"OtelLockLeaseLost",
                                                                           "OtelLockReplicaMetricsMissing"}
                _until(lambda: _target_info(client) == {"app1", "app2"}, "target_info of both replicas")
            assert stop(processes.pop("loadgen")) == 0, (tmp_path / "loadgen.log").read_text(errors="replace")
        finally:
            for process in reversed(list(processes.values())):
                stop(process)


def _compose_prometheus(context: Path, tmp_path: Path, addresses: dict[str, str], port: str) -> list[str]:
    """The compose prometheus command with its mounts and service names mapped to this machine."""
    service = SERVICES["prometheus"]
    mounts = {container: context / host.removeprefix("./")
              for host, container, *_ in (volume.split(":") for volume in service["volumes"])}
    config = yaml.safe_load((mounts["/etc/prometheus/prometheus.yml"]).read_text())
    config["rule_files"] = [str(mounts["/etc/prometheus/rules"] / Path(f).name) for f in config["rule_files"]]
    config["global"]["scrape_interval"] = "1s"
    text = json.dumps(config)
    for address, here in addresses.items():
        text = text.replace(f'"{address}"', f'"{here}"')
    (tmp_path / "prometheus.yml").write_text(text)
    argv = ["prometheus"]
    for arg in service["command"]:
        name, _, value = arg.partition("=")
        value = {"--config.file": str(tmp_path / "prometheus.yml"), "--storage.tsdb.path": str(tmp_path / "tsdb"),
                 "--web.external-url": f"http://127.0.0.1:{port}",
                 "--web.console.libraries": str(tmp_path / "no-libraries")}.get(name, value)
        if name == "--web.console.templates":
            value = str(mounts[value])
        argv.append(f"{name}={value}" if value else name)
    return argv + [f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"]


def _target_info(client: httpx.Client) -> set[str]:
    result = client.get("/api/v1/query", params={"query": 'target_info{job="otel-lock-replicas"}'}).json()
    return {series["metric"].get("service_instance_id") for series in result["data"]["result"]}


def _until(predicate, what: str) -> None:
    deadline = time.monotonic() + DEADLINE
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)
