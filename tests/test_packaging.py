"""The distribution as a user gets it: a light core, honest lower bounds, and a complete wheel.

The wheel tests build the wheel, install it into fresh venvs outside the
checkout (PyPI or pip's cache supplies the dependencies) and run the
installed `otel-lock` there: first with the core alone, then with `[cli]`.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tomllib
import urllib.request
import zipfile
from pathlib import Path

import pytest

import otel_lock

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
# What only an extra may bring in; `import otel_lock` must load none of it.
OPTIONAL_MODULES = ("opentelemetry.sdk", "opentelemetry.exporter", "opentelemetry.instrumentation",
                    "prometheus_client", "uvicorn", "httpx", "yaml", "fastapi", "grpc", "google.protobuf")
# Type checkers, the wheel builder and xdist (the behaviour job's workers) run on the newest releases
# only; nothing else goes unpinned.
UNPINNED_TOOLS = {"mypy", "pyright", "types-pyyaml", "hatchling", "pytest-xdist"}


def _name(requirement: str) -> str:
    return re.split(r"[\[<>=!~; ]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def _lower_bounds(*groups: str) -> dict[str, str]:
    bounds = {}
    requirements = list(PYPROJECT["project"]["dependencies"])
    for group in groups:
        requirements += PYPROJECT["project"]["optional-dependencies"][group]
    for requirement in requirements:
        name = _name(requirement)
        if name == "otel-lock":  # [cli] includes [telemetry], [test] both
            continue
        match = re.search(r">=\s*([^,;\s]+)", requirement)
        assert match, f"{requirement!r} has no lower bound"
        bounds[name] = match.group(1)
    return bounds


def _pins(file: str) -> dict[str, str]:
    pins = {}
    for line in (ROOT / "constraints" / file).read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line and not line.startswith("-c"):
            name, _, version = line.partition("==")
            pins[_name(name)] = version.strip()
    return pins


def _same_version(a: str, b: str) -> bool:
    """5.2 == 5.2.0: compare release numbers with trailing zeros dropped."""
    def norm(v: str) -> str:
        return re.sub(r"(\.0)+(?=$|[a-z])", "", v)
    return norm(a) == norm(b)


# -- bounds ------------------------------------------------------------------


def _mismatches(pins: dict[str, str], bounds: dict[str, str]) -> dict[str, tuple[str, str]]:
    return {name: (pin, bounds[name]) for name, pin in pins.items() if not _same_version(pin, bounds[name])}


def test_lowest_constraints_pin_every_lower_bound():
    bounds = _lower_bounds("telemetry", "telemetry-grpc", "cli", "test")
    pins = _pins("lowest.txt")
    # hiredis comes with redis[hiredis]: the oldest that extra of the lowest redis allows.
    assert pins.pop("hiredis") == "3.0.0"
    # The API is pinned by the [telemetry] SDK; lowest-core.txt holds the core's own bound.
    expected = set(bounds) - UNPINNED_TOOLS - {"opentelemetry-api"}
    assert set(pins) == expected, "constraints/lowest.txt and pyproject.toml name different packages"
    assert _mismatches(pins, bounds) == {}


def test_lowest_core_constraints_pin_the_core_bounds():
    pins = _pins("lowest-core.txt")
    assert pins.pop("hiredis") == "3.0.0"
    # Only for the tests' in-memory exporters: the SDK release that matches API 1.30.
    assert _same_version(pins.pop("opentelemetry-sdk"), _lower_bounds()["opentelemetry-api"])
    core = _lower_bounds()
    assert set(core) <= set(pins)
    assert _mismatches(pins, _lower_bounds("cli", "test")) == {}


def test_core_dependencies_are_only_redis_the_otel_api_and_starlette():
    assert sorted(_name(r) for r in PYPROJECT["project"]["dependencies"]) == [
        "opentelemetry-api", "redis", "starlette"]
    telemetry = {_name(r) for r in PYPROJECT["project"]["optional-dependencies"]["telemetry"]}
    assert "opentelemetry-exporter-otlp" not in telemetry  # the meta-package drags in gRPC
    assert "opentelemetry-exporter-otlp-proto-http" in telemetry


def test_importing_the_library_loads_no_optional_dependency():
    # redis-py itself imports an installed OpenTelemetry SDK (its own observability), so
    # what otel_lock adds is measured against redis, starlette and the API imported first.
    script = f"""
import sys
import redis, redis.asyncio, starlette.routing, opentelemetry.trace, opentelemetry.metrics
before = set(sys.modules)
import otel_lock, otel_lock.lock, otel_lock.asgi, otel_lock.telemetry, otel_lock.sync, otel_lock.cli
from otel_lock import LockManager, LockMiddleware, idempotent, locked
added = set(sys.modules) - before
print("\\n".join(sorted(m for m in added if m.startswith({OPTIONAL_MODULES!r}))))
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True)
    assert result.stdout.split() == []


# -- the wheel -----------------------------------------------------------------


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out),
                    str(ROOT)], check=True, capture_output=True, timeout=120)
    [built] = out.glob("otel_lock-*.whl")
    return built


def test_wheel_carries_data_files_py_typed_and_license(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    assert "otel_lock/py.typed" in names
    assert f"otel_lock-{otel_lock.__version__}.dist-info/licenses/LICENSE" in names
    assert "otel_lock/_data/deploy/prometheus/prometheus.yml" in names
    for rule in (ROOT / "deploy" / "prometheus" / "rules").glob("*.yml"):
        assert f"otel_lock/_data/deploy/prometheus/rules/{rule.name}" in names
    dashboards = sorted((ROOT / "dashboards").glob("*.json"))
    assert dashboards
    for dashboard in dashboards:  # a new dashboard needs its force-include line in pyproject.toml
        assert f"otel_lock/_data/dashboards/{dashboard.name}" in names
    metadata = zipfile.ZipFile(wheel).read(f"otel_lock-{otel_lock.__version__}.dist-info/METADATA").decode()
    assert "Classifier: Typing :: Typed" in metadata and "License-Expression: MIT" in metadata
    unconditional = [line for line in metadata.splitlines() if line.startswith("Requires-Dist:") and ";" not in line]
    assert sorted(_name(line.split(":", 1)[1].strip()) for line in unconditional) == [
        "opentelemetry-api", "redis", "starlette"]


class Venv:
    """A fresh venv outside the checkout, with the wheel installed (pip from the test's own venv)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.bin = path / "bin"
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True, timeout=120)
        # Nothing from the checkout or the test's venv: the wheel must stand on its own.
        self.env = {k: v for k, v in os.environ.items()
                    if k not in ("PYTHONPATH", "VIRTUAL_ENV", "REDIS_URL") and not k.startswith("OTEL_")}
        self.env["PATH"] = f"{self.bin}{os.pathsep}{os.environ.get('PATH', '')}"

    def install(self, requirement: str) -> None:
        result = subprocess.run([sys.executable, "-m", "pip", "--python", str(self.bin / "python"), "install",
                                 "-q", requirement], capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, f"pip install {requirement} failed:\n{result.stderr[-3000:]}"

    def run(self, *argv: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(self.bin / argv[0]), *argv[1:]], capture_output=True, text=True,
                              cwd=self.path, env=self.env, timeout=timeout)


@pytest.fixture(scope="module")
def core_venv(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Venv:
    venv = Venv(tmp_path_factory.mktemp("core-venv"))
    venv.install(str(wheel))
    return venv


def test_core_alone_imports_and_names_the_missing_extras(core_venv, redis_url):
    script = f"""
import sys, otel_lock
from otel_lock import LockManager, LockMiddleware, idempotent, locked
assert otel_lock.__file__.startswith({str(core_venv.path)!r}), otel_lock.__file__
print(",".join(sorted(m for m in sys.modules if m.startswith({OPTIONAL_MODULES!r}))))
try:
    from otel_lock.telemetry import setup
except ImportError as exc:
    print(exc)
"""
    result = core_venv.run("python", "-c", script)
    assert result.returncode == 0, result.stderr
    loaded, telemetry_error = result.stdout.splitlines()
    assert loaded == ""
    assert "pip install 'otel-lock[telemetry]'" in telemetry_error

    for command in (["demo"], ["serve"], ["stack", "--help"]):
        result = core_venv.run("otel-lock", *command)
        assert result.returncode == 1, result
        assert result.stderr.count("\n") == 1 and "pip install 'otel-lock[cli]'" in result.stderr, result.stderr
    # The operator commands need only the core.
    result = core_venv.run("otel-lock", "locks", "--json", "--redis-url", redis_url)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == []

    # Part of an extra is not the extra: prometheus-client alone (common in apps) still
    # leaves setup() without an SDK, and the error says so before anything runs.
    core_venv.install("prometheus-client")
    result = core_venv.run("python", "-c", "from otel_lock.telemetry import setup")
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1] == (
        "otel_lock._extras.MissingExtra: otel_lock.telemetry.setup needs the [telemetry] extra "
        "(module 'opentelemetry.sdk' is not installed): pip install 'otel-lock[telemetry]'")


@pytest.fixture(scope="module")
def cli_venv(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Venv:
    venv = Venv(tmp_path_factory.mktemp("cli-venv"))
    venv.install(f"{wheel}[cli]")
    return venv


def test_installed_wheel_runs_version_and_demo(cli_venv):
    result = cli_venv.run("otel-lock", "--version")
    assert (result.returncode, result.stdout.strip()) == (0, f"otel-lock {otel_lock.__version__}")
    result = cli_venv.run("otel-lock", "demo", "--buyers", "20", "--items", "10", "--double-submits", "4")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "verdict       OK" in result.stdout


@pytest.mark.skipif(shutil.which("prometheus") is None,
                    reason="prometheus binary not on PATH (Debian: apt-get install prometheus)")
def test_installed_wheel_runs_the_stack_from_its_packaged_files(cli_venv):
    stack = subprocess.Popen(
        [str(cli_venv.bin / "otel-lock"), "stack", "--replicas", "1", "--prometheus-port", "0",
         "--job-interval", "1"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=cli_venv.path, env=cli_venv.env)
    try:
        lines = []
        for line in stack.stdout:  # blocks until the stack prints; ends if it dies
            lines.append(line)
            if line.startswith("Ctrl-C stops everything"):
                break
        out = "".join(lines)
        assert "Ctrl-C stops everything" in out, out + stack.stderr.read()
        # Its dashboards and rules are the wheel's copies, not the checkout's.
        assert re.search(rf"import the dashboards in {re.escape(str(cli_venv.path))}\S*/otel_lock/_data/dashboards",
                         out), out
        prometheus = re.search(r"^prometheus +(http://\S+)", out, re.M).group(1)
        with urllib.request.urlopen(f"{prometheus}/api/v1/rules", timeout=10) as answer:
            groups = json.load(answer)["data"]["groups"]
        assert any(rule["name"].startswith("OtelLock") for group in groups for rule in group["rules"]), groups
        stack.send_signal(signal.SIGINT)
        assert stack.wait(60) == 0
        assert "Traceback" not in stack.stderr.read()
    finally:
        if stack.poll() is None:
            stack.kill()
            stack.wait()
        stack.stdout.close()
        stack.stderr.close()


def test_readme_tells_how_to_install_the_extras():
    assert "pip install 'otel-lock[telemetry,cli]'" in (ROOT / "README.md").read_text()
