"""`otel-lock stack`: the compose topology without Docker.

Starts a redis-server (or uses --redis-url), two demo replicas (`otel-lock
serve`), and the Debian/upstream `prometheus` binary with the compose
stack's scrape config and alert rules rendered for local ports; optionally a
load loop. Prints the URLs and stops everything by pid on Ctrl-C.

There is no collector here: Prometheus scrapes the replicas' /metrics
directly (same metric names, no exemplars). Alert links open the runbooks
this Prometheus serves itself (a console template, deploy/prometheus/consoles,
under its --web.external-url). Grafana is not started; point a
local Grafana at the printed Prometheus URL with the datasource uid
`prometheus` and import the dashboards whose folder it prints. The config,
rules and dashboards come from the installed package or a checkout
(`_files`); they are checked before anything starts.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

import httpx

from ._files import DataFilesMissing, check_prometheus_files, dashboards_dir, prometheus_dir
from ._redis_server import RedisServer, free_port, stop_process

if TYPE_CHECKING:
    from ._replicas import Replicas

DEPLOY = prometheus_dir()
REPLICA_JOB = "otel-lock-replicas"
# The link bases written in deploy/prometheus/rules/*.yml: the runbooks each Prometheus
# serves itself (a console template, under its --web.external-url), and a local Grafana.
RUNBOOKS_CONSOLE = "otel-lock-runbooks.html"
DEFAULT_RUNBOOK_BASE = "{{ $externalURL }}/consoles/" + RUNBOOKS_CONSOLE
DEFAULT_GRAFANA_URL = "http://localhost:3000"
# The demo replicas keep concrete lock keys and owners out of their spans.
REPLICA_ENV = {"OTEL_LOCK_REDACT": "hash"}


class StackError(RuntimeError):
    """A part of the local stack could not be found or did not start."""


def render_prometheus_config(targets: list[str], rule_files: list[str], *, scrape_interval: str = "5s",
                             evaluation_interval: str = "15s") -> dict[str, Any]:
    """deploy/prometheus/prometheus.yml with local targets and rules, minus the collector jobs.

    Without a collector the replicas' own otel_lock_* and http_* series are the
    only copy, so the replica job keeps them (no drop relabelling).
    """
    config: dict[str, Any] = _yaml().safe_load((DEPLOY / "prometheus.yml").read_text())
    config["global"]["scrape_interval"] = scrape_interval
    config["global"]["evaluation_interval"] = evaluation_interval
    config["rule_files"] = rule_files
    jobs = [job for job in config["scrape_configs"] if job["job_name"] == REPLICA_JOB]
    if not jobs:
        raise StackError(f"{DEPLOY / 'prometheus.yml'} has no {REPLICA_JOB!r} job")
    job = jobs[0]
    job["static_configs"] = [{"targets": targets}]
    job.pop("metric_relabel_configs", None)
    config["scrape_configs"] = [job]
    return config


def render_rules(text: str, *, runbook_base: str | None = None, grafana_url: str | None = None) -> str:
    """A rules file with its runbook and dashboard links pointed at this deployment.

    `runbook_base` replaces the runbooks page Prometheus serves (keep the
    `#anchor`s working: point it at a copy of docs/observability.md or of
    deploy/prometheus/consoles/otel-lock-runbooks.html); `grafana_url` the Grafana root.
    """
    for default, new in ((DEFAULT_RUNBOOK_BASE, runbook_base), (DEFAULT_GRAFANA_URL, grafana_url)):
        if new is not None:
            if not new.startswith(("http://", "https://")):
                raise StackError(f"link bases must be absolute http(s) URLs, not {new!r}")
            text = text.replace(f'"{default}', f'"{new.rstrip("/")}')
    return text


def _yaml() -> ModuleType:
    try:
        import yaml
    except ImportError:
        raise StackError("otel-lock stack needs the [cli] extra (module 'yaml' is not installed): "
                         "pip install 'otel-lock[cli]'") from None
    return yaml


class Prometheus:
    """A prometheus process on a loopback port with a rendered config, stopped by pid."""

    def __init__(self, targets: list[str], *, port: int | None = None, scrape_interval: str = "5s",
                 evaluation_interval: str = "15s", runbook_base: str | None = None,
                 grafana_url: str | None = None) -> None:
        binary = shutil.which("prometheus")
        if binary is None:
            raise StackError("prometheus is not on PATH: install it (Debian: apt-get install prometheus; "
                             "do not start its service) or download it from prometheus.io")
        try:
            check_prometheus_files()
        except DataFilesMissing as exc:
            raise StackError(str(exc)) from None
        self.binary: str = binary
        self.port = port or free_port()
        self.targets = targets
        self.scrape_interval = scrape_interval
        self.evaluation_interval = evaluation_interval
        self.links = {"runbook_base": runbook_base, "grafana_url": grafana_url}
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 30.0) -> "Prometheus":
        self._dir = Path(tempfile.mkdtemp(prefix="otel-lock-prometheus-"))
        rules = []
        for rule_file in sorted((DEPLOY / "rules").glob("*.yml")):
            copy = self._dir / rule_file.name
            copy.write_text(render_rules(rule_file.read_text(), **self.links))
            rules.append(str(copy))
        config = render_prometheus_config(self.targets, rules, scrape_interval=self.scrape_interval,
                                          evaluation_interval=self.evaluation_interval)
        config_path = self._dir / "prometheus.yml"
        config_path.write_text(_yaml().safe_dump(config, sort_keys=False))
        self.log_path = self._dir / "prometheus.log"
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                [self.binary, f"--config.file={config_path}", f"--storage.tsdb.path={self._dir / 'data'}",
                 f"--web.listen-address=127.0.0.1:{self.port}", f"--web.external-url={self.url}",
                 # The runbooks the alert links point at, served by this Prometheus (no libraries needed).
                 f"--web.console.templates={DEPLOY / 'consoles'}", f"--web.console.libraries={self._dir / 'none'}",
                 "--enable-feature=exemplar-storage", "--web.enable-lifecycle", "--log.level=warn"],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        self._wait_ready(timeout)
        return self

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        process = self.process
        assert process is not None  # start() has just started it
        with httpx.Client(timeout=1.0) as client:
            while True:
                if process.poll() is not None:
                    raise StackError(f"prometheus exited with code {process.returncode}:\n"
                                     f"{self.log_path.read_text(errors='replace')[-2000:]}")
                try:
                    if client.get(self.url + "/-/ready").status_code == 200:
                        return
                except httpx.TransportError:
                    pass
                if time.monotonic() > deadline:
                    self.stop()
                    raise StackError(f"prometheus did not become ready on port {self.port} in {timeout}s")
                time.sleep(0.1)

    def stop(self) -> None:
        if self.process is not None:
            stop_process(self.process, grace=10)
        self.process = None
        shutil.rmtree(getattr(self, "_dir", ""), ignore_errors=True)

    def __enter__(self) -> "Prometheus":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class LocalStack:
    """Redis + replicas + Prometheus; `extra_targets` are scraped in the replicas' job too."""

    def __init__(self, *, redis_url: str | None = None, replicas: int = 2, prometheus_port: int | None = None,
                 namespace: str = "otel-lock", job_interval: float = 5.0, scrape_interval: str = "5s",
                 evaluation_interval: str = "15s", extra_targets: list[str] | None = None,
                 runbook_base: str | None = None, grafana_url: str | None = None,
                 replica_env: dict[str, str] | None = None) -> None:
        self.redis_url = redis_url
        self.replica_count = replicas
        self.prometheus_port = prometheus_port
        self.namespace = namespace
        self.job_interval = job_interval
        self.scrape_interval = scrape_interval
        self.evaluation_interval = evaluation_interval
        self.extra_targets = extra_targets or []
        self.links = {"runbook_base": runbook_base, "grafana_url": grafana_url}
        self.replica_env = {**REPLICA_ENV, **(replica_env or {})}
        self.redis: RedisServer | None = None
        self.replicas: Replicas | None = None
        self.prometheus: Prometheus | None = None

    def start(self) -> "LocalStack":
        from ._replicas import Replicas

        Prometheus([])  # its binary and files are checked before anything starts
        try:
            if self.redis_url is None:
                self.redis = RedisServer().start()
                self.redis_url = self.redis.url
            self.replicas = Replicas(self.redis_url, count=self.replica_count, namespace=self.namespace,
                                     job_interval=self.job_interval, env=self.replica_env).start()
            targets = [url.removeprefix("http://") for url in self.replicas.urls] + self.extra_targets
            self.prometheus = Prometheus(targets, port=self.prometheus_port, scrape_interval=self.scrape_interval,
                                         evaluation_interval=self.evaluation_interval, **self.links).start()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Prometheus first (it only reads), then the replicas, then Redis."""
        for part in (self.prometheus, self.replicas, self.redis):
            if part is not None:
                part.stop()
        self.prometheus = self.replicas = self.redis = None

    def __enter__(self) -> "LocalStack":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="otel-lock stack",
        description="Run the compose topology without Docker: Redis, two demo replicas and Prometheus "
                    "(alert rules loaded), optionally a contended load. Ctrl-C stops everything.")
    parser.add_argument("--redis-url", default=os.environ.get("REDIS_URL"),
                        help="use this Redis instead of starting a redis-server (default: $REDIS_URL)")
    parser.add_argument("--replicas", type=int, default=2, help="demo replicas (default: %(default)s)")
    parser.add_argument("--prometheus-port", type=int, default=9090, help="(default: %(default)s, 0 = any free)")
    parser.add_argument("--namespace", default="otel-lock", help="lock key prefix (default: %(default)s)")
    parser.add_argument("--job-interval", type=float, default=5.0, help="background job period in seconds")
    parser.add_argument("--load", action="store_true", help="also run the contended load loop")
    parser.add_argument("--runbook-base", default=None,
                        help="absolute URL of your copy of the runbooks (docs/observability.md) for alert links "
                             "(default: the runbooks page this Prometheus serves, /consoles/" + RUNBOOKS_CONSOLE + ")")
    parser.add_argument("--grafana-url", default=None,
                        help=f"Grafana root for alert dashboard links (default: {DEFAULT_GRAFANA_URL})")
    parser.add_argument("--render-rules-to", metavar="DIR", default=None,
                        help="only write the alert rules with these links into DIR (for another Prometheus) and exit")
    args = parser.parse_args(argv)
    if not 1 <= args.replicas <= 16:
        parser.error(f"--replicas must be 1-16, got {args.replicas}")
    if not 0 <= args.prometheus_port < 65536:
        parser.error(f"--prometheus-port must be 0-65535, got {args.prometheus_port}")

    if args.render_rules_to is not None:
        return _render_rules_to(Path(args.render_rules_to), args.runbook_base, args.grafana_url)

    stack = LocalStack(redis_url=args.redis_url, replicas=args.replicas,
                       prometheus_port=args.prometheus_port or None, namespace=args.namespace,
                       job_interval=args.job_interval, runbook_base=args.runbook_base,
                       grafana_url=args.grafana_url)
    try:
        stack.start()
    except (StackError, RuntimeError) as exc:
        print(f"otel-lock stack: {exc}", file=sys.stderr)
        return 1
    try:
        replicas, prometheus = stack.replicas, stack.prometheus
        assert replicas is not None and prometheus is not None  # start() returned: both run
        print(f"redis       {stack.redis_url}")
        for url in replicas.urls:
            print(f"replica     {url}   (/metrics, /healthz, /api/stock/1001)")
        print(f"prometheus  {prometheus.url}   (alerts: {prometheus.url}/alerts)")
        print(f"runbooks    {prometheus.url}/consoles/{RUNBOOKS_CONSOLE}")
        print("grafana     not started: add a Prometheus datasource with uid `prometheus` pointing at the URL "
              f"above and import the dashboards in {dashboards_dir()}")
        asyncio.run(_run_until_signal(replicas.urls if args.load else None))
    finally:
        stack.stop()
    return 0


def _render_rules_to(directory: Path, runbook_base: str | None, grafana_url: str | None) -> int:
    try:
        directory.mkdir(parents=True, exist_ok=True)
        for rule_file in sorted((DEPLOY / "rules").glob("*.yml")):
            text = render_rules(rule_file.read_text(), runbook_base=runbook_base, grafana_url=grafana_url)
            (directory / rule_file.name).write_text(text)
            print(directory / rule_file.name)
    except (StackError, OSError) as exc:
        print(f"otel-lock stack: {exc}")
        return 1
    return 0


async def _run_until_signal(load_targets: list[str] | None) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    # Only now: a Ctrl-C before the handlers were in place ended the stack as "interrupted" (130).
    print("Ctrl-C stops everything.", flush=True)
    if load_targets is None:
        await stop.wait()
        return
    from ._load_loop import LoadLoop

    load = LoadLoop(load_targets)
    task = asyncio.create_task(load.run())
    await stop.wait()
    load.stop()
    await task
