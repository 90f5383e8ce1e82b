"""The compose stack, collector, Prometheus and Grafana files agree with each other and the repo.

No Docker engine is needed: these checks read the files the way compose,
the collector and Grafana would, and fail when a reference dangles.
"""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
SERVICES = COMPOSE["services"]
COLLECTOR = yaml.safe_load((ROOT / "deploy" / "otel-collector" / "config.yaml").read_text())
PROMETHEUS = yaml.safe_load((ROOT / "deploy" / "prometheus" / "prometheus.yml").read_text())
GRAFANA = ROOT / "deploy" / "grafana" / "provisioning"
DASHBOARD_FILES = sorted((ROOT / "dashboards").glob("*.json"))


def _mounts(service: str) -> dict[str, Path]:
    """container path -> host path of a service's bind mounts."""
    mounts = {}
    for volume in SERVICES[service].get("volumes", []):
        host, container = volume.split(":")[:2]
        mounts[container] = (ROOT / host).resolve()
    return mounts


def _host_path(service: str, container_path: str) -> Path:
    for container, host in sorted(_mounts(service).items(), key=lambda item: -len(item[0])):
        if container_path == container or container_path.startswith(container.rstrip("/") + "/"):
            return host / container_path[len(container):].lstrip("/")
    raise AssertionError(f"{service}: {container_path} is not inside any mounted volume")


# -- compose ------------------------------------------------------------------


def test_compose_has_the_whole_topology():
    assert {"redis", "app1", "app2", "loadgen", "otel-collector", "prometheus", "grafana", "jaeger"} <= set(SERVICES)
    replicas = [name for name, service in SERVICES.items() if service.get("command", [])[:2] == ["otel-lock", "serve"]]
    assert len(replicas) >= 2


@pytest.mark.parametrize("name", sorted(SERVICES))
def test_compose_images_are_pinned(name):
    image = SERVICES[name].get("image")
    assert image or "build" in SERVICES[name], f"{name} has neither image nor build"
    if image:
        reference, _, digest = image.partition("@")
        repository, _, tag = reference.rpartition(":")
        assert repository and tag and "/" not in tag, f"{name}: image {image!r} has no tag"
        assert tag != "latest" and re.search(r"\d", tag), f"{name}: image {image!r} is not pinned to a version"
        assert not digest or re.fullmatch(r"sha256:[0-9a-f]{64}", digest), f"{name}: malformed digest in {image!r}"


# Images whose only process is the service itself (no shell, no HTTP client): no healthcheck can run inside.
NO_HEALTHCHECK = {"otel-collector": "contrib image has no shell or client; :13133 answers outside probes",
                  "loadgen": "a client: it serves nothing to check"}


@pytest.mark.parametrize("name", sorted(SERVICES))
def test_every_service_that_can_check_itself_has_a_healthcheck(name):
    if name in NO_HEALTHCHECK:
        assert "healthcheck" not in SERVICES[name]
        return
    check = SERVICES[name].get("healthcheck")
    assert check and check["test"][0] in ("CMD", "CMD-SHELL"), f"{name} has no healthcheck"


def test_services_wait_for_what_they_need_to_be_healthy():
    for name, service in SERVICES.items():
        for dependency, condition in (service.get("depends_on") or {}).items():
            wanted = "service_healthy" if "healthcheck" in SERVICES[dependency] else "service_started"
            assert condition["condition"] == wanted, f"{name} -> {dependency}: {condition}"


def test_the_image_installs_the_extras_its_services_run():
    text = (ROOT / "deploy" / "Dockerfile").read_text()
    assert re.search(r'pip install "?\.\[cli\]"?', text), "otel-lock serve and the load loop need the [cli] extra"
    for service in SERVICES.values():
        if service.get("image") == SERVICES["app1"]["image"]:
            assert service["command"][0] in ("otel-lock", "python")


@pytest.mark.parametrize("name", sorted(SERVICES))
def test_compose_bind_mounts_exist(name):
    for container, host in _mounts(name).items():
        assert host.exists(), f"{name}: {host} (mounted at {container}) does not exist"


def test_compose_build_context_and_dockerfile_exist():
    builds = [service["build"] for service in SERVICES.values() if "build" in service]
    assert builds
    for build in builds:
        context = ROOT / build["context"]
        assert (context / build.get("dockerfile", "Dockerfile")).exists()


def test_the_loadgen_runs_a_module_of_the_package():
    command = SERVICES["loadgen"]["command"]
    assert command[:2] == ["python", "-m"]
    assert importlib.util.find_spec(command[2]) is not None
    assert SERVICES["loadgen"]["image"] == SERVICES["app1"]["image"]


def test_replicas_push_otlp_to_the_collector():
    for name in ("app1", "app2"):
        endpoint = SERVICES[name]["environment"]["OTEL_EXPORTER_OTLP_ENDPOINT"]
        assert endpoint == "http://otel-collector:4318"
        # one metrics reader per replica (the collector serves Prometheus), keys hashed in spans
        assert SERVICES[name]["environment"]["OTEL_METRICS_EXPORTER"] == "otlp"
        assert SERVICES[name]["environment"]["OTEL_LOCK_REDACT"] == "hash"
    assert COLLECTOR["receivers"]["otlp"]["protocols"]["http"]["endpoint"].endswith(":4318")


def test_dockerfile_copies_existing_paths_and_pins_its_base():
    text = (ROOT / "deploy" / "Dockerfile").read_text()
    base = re.search(r"^FROM (\S+)", text, flags=re.M).group(1)
    assert ":" in base and not base.endswith(":latest")
    for sources in re.findall(r"^COPY (.+) \S+$", text, flags=re.M):
        for source in sources.split():
            assert (ROOT / source).exists(), f"Dockerfile copies missing {source}"


# -- collector ------------------------------------------------------------------


@pytest.mark.parametrize("pipeline", sorted(COLLECTOR["service"]["pipelines"]))
def test_collector_pipelines_name_defined_components(pipeline):
    spec = COLLECTOR["service"]["pipelines"][pipeline]
    for kind in ("receivers", "processors", "exporters"):
        for component in spec.get(kind, []):
            assert component in COLLECTOR.get(kind, {}), f"{pipeline}: {kind[:-1]} {component} is not defined"
    assert spec["receivers"] and spec["exporters"]


def test_collector_uses_what_it_defines_and_sends_to_compose_services():
    pipelines = COLLECTOR["service"]["pipelines"].values()
    for kind in ("receivers", "processors", "exporters"):
        used = {component for spec in pipelines for component in spec.get(kind, [])}
        assert set(COLLECTOR[kind]) == used, f"unused {kind}: {set(COLLECTOR[kind]) - used}"
    assert set(COLLECTOR["service"]["extensions"]) <= set(COLLECTOR["extensions"])
    for exporter in COLLECTOR["exporters"].values():
        endpoint = exporter.get("endpoint", "")
        host = endpoint.split("://")[-1].split(":")[0]
        assert host in SERVICES or host == "0.0.0.0", f"exporter endpoint {endpoint} is not a compose service"
    assert COLLECTOR["exporters"]["prometheus"]["enable_open_metrics"] is True  # exemplars
    assert _host_path("otel-collector", SERVICES["otel-collector"]["command"][0].split("=", 1)[1]).exists()


def test_collector_image_is_contrib():
    assert SERVICES["otel-collector"]["image"].startswith("otel/opentelemetry-collector-contrib:")


# -- prometheus ------------------------------------------------------------------


def test_prometheus_rule_files_exist_through_the_mount():
    for rule_file in PROMETHEUS["rule_files"]:
        assert _host_path("prometheus", rule_file).exists(), rule_file


def test_prometheus_scrapes_replicas_and_collector():
    targets = {target for job in PROMETHEUS["scrape_configs"]
               for config in job["static_configs"] for target in config["targets"]}
    own = [reader["pull"]["exporter"]["prometheus"]["port"]
           for reader in COLLECTOR["service"]["telemetry"]["metrics"]["readers"]]
    collector_ports = {COLLECTOR["exporters"]["prometheus"]["endpoint"].rsplit(":", 1)[1], *map(str, own)}
    assert {f"otel-collector:{port}" for port in collector_ports} <= targets
    replica_ports = {service["command"][service["command"].index("--port") + 1]
                     for service in SERVICES.values() if service.get("command", [])[:2] == ["otel-lock", "serve"]}
    replicas = {f"{name}:{port}" for name in ("app1", "app2") for port in replica_ports}
    assert replicas <= targets
    for target in targets:
        assert target.split(":")[0] in SERVICES, f"{target} is not a compose service"


def test_prometheus_command_loads_config_and_keeps_exemplars():
    command = SERVICES["prometheus"]["command"]
    assert "--enable-feature=exemplar-storage" in command
    config = next(arg.split("=", 1)[1] for arg in command if arg.startswith("--config.file="))
    assert _host_path("prometheus", config) == (ROOT / "deploy" / "prometheus" / "prometheus.yml").resolve()


def test_prometheus_serves_the_runbooks_its_alerts_link_to():
    command = SERVICES["prometheus"]["command"]
    consoles = next(arg.split("=", 1)[1] for arg in command if arg.startswith("--web.console.templates="))
    assert (_host_path("prometheus", consoles) / "otel-lock-runbooks.html").is_file()
    external = next(arg.split("=", 1)[1] for arg in command if arg.startswith("--web.external-url="))
    assert external.rstrip("/").endswith(":" + SERVICES["prometheus"]["ports"][0].split(":")[0])


def test_committed_runbooks_page_matches_the_docs():
    result = subprocess.run([sys.executable, str(ROOT / "deploy" / "runbooks.py"), "--check"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


def test_no_link_points_at_a_repository_that_does_not_exist():
    """Regression test: the runbook links pointed at github.com/otel-lock/otel-lock, which does not exist."""
    owned = [ROOT / "docker-compose.yml", ROOT / "docs" / "observability.md", *ROOT.glob("deploy/**/*.*"),
             *ROOT.glob("dashboards/*"), *ROOT.glob("otel_lock/telemetry/*.py"), ROOT / "otel_lock/cli/_local_stack.py"]
    for path in owned:
        if path.is_file():
            assert "github.com/otel-lock" not in path.read_text(errors="replace"), path


def test_the_collector_forgets_a_silent_replica_soon():
    expiration = COLLECTOR["exporters"]["prometheus"]["metric_expiration"]
    interval_ms = int(SERVICES["app1"]["environment"]["OTEL_METRIC_EXPORT_INTERVAL"])
    assert expiration.endswith("m") and int(expiration[:-1]) * 60_000 >= 4 * interval_ms


# -- grafana -------------------------------------------------------------------------


def _datasources() -> list[dict]:
    return [source for path in (GRAFANA / "datasources").glob("*.yml")
            for source in yaml.safe_load(path.read_text())["datasources"]]


def _walk_datasource_uids(node) -> set[str]:
    uids = set()
    if isinstance(node, dict):
        if isinstance(node.get("datasource"), dict) and "uid" in node["datasource"]:
            uids.add(node["datasource"]["uid"])
        for value in node.values():
            uids |= _walk_datasource_uids(value)
    elif isinstance(node, list):
        for value in node:
            uids |= _walk_datasource_uids(value)
    return uids


def test_grafana_datasources_have_fixed_uids_and_exemplar_links():
    sources = {source["uid"]: source for source in _datasources()}
    assert {"prometheus", "jaeger"} <= set(sources)
    for source in sources.values():
        host = source["url"].split("://")[1].split(":")[0]
        assert host in SERVICES
    links = sources["prometheus"]["jsonData"]["exemplarTraceIdDestinations"]
    assert all(link["datasourceUid"] in sources for link in links)


def test_grafana_dashboard_provider_points_at_the_mounted_dashboards():
    providers = [provider for path in (GRAFANA / "dashboards").glob("*.yml")
                 for provider in yaml.safe_load(path.read_text())["providers"]]
    for provider in providers:
        assert _host_path("grafana", provider["options"]["path"]) == (ROOT / "dashboards").resolve()
    assert _host_path("grafana", "/etc/grafana/provisioning") == GRAFANA.resolve()
    home = SERVICES["grafana"]["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert _host_path("grafana", home).exists()
    assert SERVICES["grafana"]["environment"]["GF_AUTH_ANONYMOUS_ENABLED"] == "true"


@pytest.mark.parametrize("path", DASHBOARD_FILES, ids=lambda path: path.name)
def test_dashboard_is_portable(path):
    text = path.read_text()
    board = json.loads(text)
    assert board["id"] is None
    assert re.fullmatch(r"otel-lock-[a-z-]+", board["uid"])
    assert "__inputs" not in board and "${DS_" not in text
    # The datasource is a variable: the dashboard imports into any Grafana.
    assert _walk_datasource_uids(board) == {"${datasource}"}
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    for name in ("job", "instance"):
        assert variables[name]["includeAll"] and variables[name]["allValue"] == ".*"
    exprs = [target["expr"] for panel in board["panels"] for target in panel.get("targets", [])]
    assert exprs
    for expr in exprs:
        unquoted = re.sub(r'"[^"]*"', '""', expr)  # label matchers may hold regex classes like [45]
        for window in re.findall(r"\[([^\]]+)\]", unquoted):
            assert window in ("$__rate_interval", "$__range"), f"hard-coded range [{window}] in {expr}"
    assert any("$__rate_interval" in expr for expr in exprs)
    for expr in exprs:  # every metric selector is narrowed to the chosen services and replicas
        for selector in re.findall(r"\b(?:otel_lock|http_server)_\w+(\{[^}]*\})?", expr):
            assert 'job=~"$job"' in selector and 'instance=~"$instance"' in selector, expr


def test_dashboard_uids_are_unique():
    uids = [json.loads(path.read_text())["uid"] for path in DASHBOARD_FILES]
    assert len(uids) == len(set(uids)) == 2


def test_committed_dashboards_match_the_generator():
    result = subprocess.run([sys.executable, str(ROOT / "dashboards" / "generate.py"), "--check"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("path", DASHBOARD_FILES, ids=lambda path: path.name)
def test_every_panel_is_explained_in_the_docs(path):
    docs = (ROOT / "docs" / "observability.md").read_text()
    for panel in json.loads(path.read_text())["panels"]:
        if panel["type"] != "row":
            title = panel["title"].split(" (")[0]
            assert f"**{title}**" in docs or f"**{panel['title']}**" in docs, f"{panel['title']!r} is not in the docs"
