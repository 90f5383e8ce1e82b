"""Alert rules: promtool check config / check rules / test rules, and the shape of every alert."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from otel_lock.cli._local_stack import (DEFAULT_GRAFANA_URL, DEFAULT_RUNBOOK_BASE, StackError,
                                        render_prometheus_config, render_rules)

ROOT = Path(__file__).resolve().parent.parent
PROMETHEUS = ROOT / "deploy" / "prometheus"
RULES = sorted((PROMETHEUS / "rules").glob("*.yml"))
RULE_TESTS = sorted((PROMETHEUS / "tests").glob("*.yml"))
DOCS = ROOT / "docs" / "observability.md"

needs_promtool = pytest.mark.skipif(shutil.which("promtool") is None,
                                    reason="promtool not on PATH (Debian: apt-get install prometheus)")


def _promtool(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(["promtool", *args], capture_output=True, text=True, timeout=60, cwd=cwd)


def _alerts() -> list[dict]:
    return [rule for path in RULES for group in yaml.safe_load(path.read_text())["groups"]
            for rule in group["rules"] if "alert" in rule]


def test_rule_files_exist():
    assert RULES and RULE_TESTS


@needs_promtool
def test_promtool_check_rules():
    result = _promtool("check", "rules", *map(str, RULES))
    assert result.returncode == 0, result.stdout + result.stderr


@needs_promtool
def test_promtool_test_rules():
    result = _promtool("test", "rules", *map(str, RULE_TESTS))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout + result.stderr


@needs_promtool
def test_promtool_check_config_of_the_compose_prometheus(tmp_path):
    """The compose file mounts deploy/prometheus/rules at /etc/prometheus/rules: check with that mapping."""
    config = yaml.safe_load((PROMETHEUS / "prometheus.yml").read_text())
    config["rule_files"] = [str(PROMETHEUS / "rules" / Path(path).name) for path in config["rule_files"]]
    path = tmp_path / "prometheus.yml"
    path.write_text(yaml.safe_dump(config))
    result = _promtool("check", "config", str(path))
    assert result.returncode == 0, result.stdout + result.stderr


@needs_promtool
def test_promtool_check_config_of_the_local_stack(tmp_path):
    config = render_prometheus_config(["127.0.0.1:8001", "127.0.0.1:8002"], [str(path) for path in RULES])
    path = tmp_path / "prometheus.yml"
    path.write_text(yaml.safe_dump(config))
    result = _promtool("check", "config", str(path))
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("alert", _alerts(), ids=lambda alert: alert["alert"])
def test_alert_has_for_severity_summary_description_and_runbook(alert):
    assert "for" in alert
    assert alert["labels"]["severity"] in {"info", "warning", "critical"}
    annotations = alert["annotations"]
    assert annotations["summary"] and annotations["description"]
    page, _, anchor = annotations["runbook_url"].partition("#")
    assert page == DEFAULT_RUNBOOK_BASE and anchor, "runbook links open the runbooks Prometheus serves itself"
    assert annotations["dashboard"].startswith(DEFAULT_GRAFANA_URL + "/d/otel-lock-")


@pytest.mark.parametrize("alert", _alerts(), ids=lambda alert: alert["alert"])
def test_label_values_in_links_are_url_encoded(alert):
    """Lock names hold braces, spaces and `&`; an unescaped one once cut the link in pagers."""
    for link in (alert["annotations"]["dashboard"], alert["annotations"]["runbook_url"]):
        for value in re.findall(r"\{\{([^}]*)\}\}", link):
            assert "$labels" not in value or value.strip().endswith("| urlquery"), link


@pytest.mark.parametrize("alert", _alerts(), ids=lambda alert: alert["alert"])
def test_runbook_anchor_exists_on_the_served_page(alert):
    anchor = alert["annotations"]["runbook_url"].partition("#")[2]
    page = (PROMETHEUS / "consoles" / "otel-lock-runbooks.html").read_text()
    assert f'id="{anchor}"' in page


def _rules() -> list[dict]:
    return [rule for path in RULES for group in yaml.safe_load(path.read_text())["groups"] for rule in group["rules"]]


@pytest.mark.parametrize("rule", _rules(), ids=lambda rule: rule.get("alert") or rule["record"])
def test_every_aggregation_keeps_the_service(rule):
    """A page must say which service: every `by (...)` keeps job; none drops it with `without`."""
    expr = rule["expr"]
    assert " without " not in expr and "without(" not in expr
    for labels in re.findall(r"\bby \(([^)]*)\)", expr):
        assert "job" in [label.strip() for label in labels.split(",")], f"by ({labels}) drops job: {expr}"
    bare = re.findall(r"\b(sum|max|min|count|avg)\s*\(", expr)
    grouped = re.findall(r"\b(sum|max|min|count|avg)\s+by\s*\(", expr)
    assert len(bare) == 0 or not grouped and "absent(" in expr, f"an aggregation without by (...): {expr}"


@pytest.mark.parametrize("rule", _rules(), ids=lambda rule: rule.get("alert") or rule["record"])
def test_busy_is_never_an_error(rule):
    """A try_lock miss (lock_outcome="busy") is an answer: no rule counts it as a timeout or error."""
    for selector in re.findall(r'lock_outcome=~?"([^"]*)"', rule["expr"]):
        assert "busy" not in selector.split("|"), rule["expr"]


def test_rules_render_with_another_runbook_base_and_grafana():
    text = RULES[0].read_text()
    out = render_rules(text, runbook_base="https://wiki.example.com/otel-lock/", grafana_url="https://grafana.example.com")
    alerts = [rule for group in yaml.safe_load(out)["groups"] for rule in group["rules"] if "alert" in rule]
    links = " ".join(a["annotations"]["runbook_url"] + a["annotations"]["dashboard"] for a in alerts)
    assert DEFAULT_RUNBOOK_BASE not in links and DEFAULT_GRAFANA_URL not in links
    assert all(a["annotations"]["runbook_url"].startswith("https://wiki.example.com/otel-lock#") for a in alerts)
    assert all(a["annotations"]["dashboard"].startswith("https://grafana.example.com/d/") for a in alerts)
    with pytest.raises(StackError, match="absolute"):
        render_rules(text, runbook_base="docs/observability.md")


@needs_promtool
def test_rendered_rules_still_pass_their_unit_tests_shape(tmp_path):
    path = tmp_path / "otel-lock.rules.yml"
    path.write_text(render_rules(RULES[0].read_text(), runbook_base="https://wiki.example.com/x"))
    result = _promtool("check", "rules", str(path))
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("alert", _alerts(), ids=lambda alert: alert["alert"])
def test_runbook_anchor_exists_in_the_docs(alert):
    anchor = alert["annotations"]["runbook_url"].partition("#")[2]
    text = DOCS.read_text()
    # An explicit <a id="..."> or a heading whose GitHub slug is the anchor.
    slugs = {re.sub(r"[^a-z0-9 -]", "", heading.lower()).strip().replace(" ", "-")
             for heading in re.findall(r"^#+ (.+)$", text, flags=re.M)}
    assert f'id="{anchor}"' in text or anchor in slugs, f"docs/observability.md has no #{anchor}"


@pytest.mark.parametrize("alert", _alerts(), ids=lambda alert: alert["alert"])
def test_alert_has_a_firing_and_a_silent_unit_test(alert):
    firing = silent = 0
    for path in RULE_TESTS:
        for case in yaml.safe_load(path.read_text())["tests"]:
            for check in case.get("alert_rule_test", []):
                if check["alertname"] == alert["alert"]:
                    if check.get("exp_alerts"):
                        firing += 1
                    else:
                        silent += 1
    assert firing and silent, f"{alert['alert']}: {firing} firing and {silent} silent unit tests"


def _generator():
    import importlib.util

    spec = importlib.util.spec_from_file_location("dashboards_generate", ROOT / "dashboards" / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@needs_promtool
def test_leases_lost_stat_counts_what_the_alert_counts(tmp_path):
    """The overview's "Leases lost" stat read 0 while OtelLockLeaseLost fired (a series born at 1)."""
    stat = _generator().leases_lost()
    [alert] = [rule["expr"] for rule in _alerts() if rule["alert"] == "OtelLockLeaseLost"]
    expr = stat.replace('$job', '.*').replace('$instance', '.*').replace('$__range', '10m')
    rules_copy = tmp_path / "rules.yml"
    rules_copy.write_text(RULES[0].read_text())
    case = {
        "rule_files": [str(rules_copy)],
        "evaluation_interval": "1m",
        "tests": [{
            "interval": "1m",
            "input_series": [
                # the first loss on replica r1 (its series at 0 from the lock's first hold), seen by
                # the watchdog, and its hold ending lost: one loss
                {"series": 'otel_lock_renewals_total{job="shop",instance="r1",lock_name="stock",'
                           'lock_renewal_outcome="lost"}', "values": "_x4 0 1x20"},
                {"series": 'otel_lock_hold_duration_seconds_count{job="shop",instance="r1",lock_name="stock",'
                           'lock_release_outcome="lost"}', "values": "_x6 1x20"},
                # a fixed lease that expired under its holder on r2: another
                {"series": 'otel_lock_renewals_total{job="shop",instance="r2",lock_name="report",'
                           'lock_renewal_outcome="lost"}', "values": "_x4 0 0 1x20"},
                {"series": 'otel_lock_hold_duration_seconds_count{job="shop",instance="r2",lock_name="report",'
                           'lock_release_outcome="expired"}', "values": "_x7 1x20"},
            ],
            "promql_expr_test": [
                {"expr": expr, "eval_time": "9m", "exp_samples": [{"labels": "{}", "value": 2}]},
                # and the alert fires for both at that moment
                {"expr": f"count({alert})", "eval_time": "9m", "exp_samples": [{"labels": "{}", "value": 2}]},
            ],
        }],
    }
    path = tmp_path / "stat.test.yml"
    path.write_text(yaml.safe_dump(case))
    result = _promtool("test", "rules", str(path))
    assert result.returncode == 0 and "SUCCESS" in result.stdout + result.stderr, result.stdout + result.stderr


@needs_promtool
def test_the_old_increase_only_stat_would_have_read_zero(tmp_path):
    """The regression the stat above fixes, shown on the same input: increase() misses series born at 1."""
    old = 'sum(increase(otel_lock_renewals_total{lock_renewal_outcome="lost"}[10m])) or vector(0)'
    case = {"rule_files": [], "evaluation_interval": "1m", "tests": [{
        "interval": "1m",
        "input_series": [{"series": 'otel_lock_renewals_total{job="shop",instance="r1",lock_name="stock",'
                                    'lock_renewal_outcome="lost"}', "values": "_x5 1x20"}],
        "promql_expr_test": [{"expr": old, "eval_time": "9m", "exp_samples": [{"labels": "{}", "value": 0}]}]}]}
    path = tmp_path / "old.test.yml"
    path.write_text(yaml.safe_dump(case))
    result = _promtool("test", "rules", str(path))
    assert result.returncode == 0, result.stdout + result.stderr


def _born_targets() -> list[tuple[str, str]]:
    """(panel title, expr) of every panel target that reads a counter's events (the born-at-1 pattern)."""
    found = []
    for build in _generator().DASHBOARDS.values():
        for panel in build()["panels"]:
            for target in panel.get("targets", []):
                if " unless " in target["expr"] and "offset $__rate_interval" in target["expr"]:
                    found.append((panel["title"], target["expr"]))
    return found


def _first_event_input(expr: str) -> str:
    """A series born at 1 that every matcher of the first selector in `expr` accepts."""
    name, matchers = re.search(r"\b((?:otel_lock|http_server)_\w+)\{([^}]*)\}", expr).groups()
    labels = {"job": "shop", "instance": "r1"}
    for label, op, value in re.findall(r'(\w+)(=~|!=|!~|=)"([^"]*)"', matchers):
        if label in ("job", "instance"):
            continue
        labels[label] = {"=": value, "=~": "503" if "[45]" in value else value.split("|")[0],
                         "!=": "acquired", "!~": "acquired"}[op]
    labels["lock_name"] = labels.get("lock_name", "stock").replace("$lock_name", "stock")
    return name + "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}"


def _panel_case(expr: str, values: str = "_x5 1x10") -> dict:
    expr = (expr.replace("$__rate_interval_ms", "60000").replace("$__rate_interval", "1m")
            .replace("$job", ".*").replace("$instance", ".*").replace("$lock_name", "stock"))
    return {"interval": "1m", "input_series": [{"series": _first_event_input(expr), "values": values}],
            "promql_expr_test": [{"expr": f"count(({expr}) > 0)", "eval_time": "5m",
                                  "exp_samples": [{"labels": "{}", "value": 1}]}]}


def test_the_event_panels_include_renewals_and_circuit_openings():
    titles = {title for title, _ in _born_targets()}
    assert {"Renewals by outcome (lost in red)", "Circuit breaker state and openings", "Releases by outcome",
            "Errors by operation and error.type", "Error responses by route and status"} <= titles


@needs_promtool
@pytest.mark.parametrize("title, expr", _born_targets(), ids=[f"{t} {i}" for i, (t, _) in enumerate(_born_targets())])
def test_a_panel_draws_a_replicas_first_event(tmp_path, title, expr):
    """Regression test: a counter series born at 1 (a replica's first lost lease, circuit opening, 503) was never
    drawn: rate() and increase() need an earlier sample."""
    path = tmp_path / "panel.test.yml"
    path.write_text(yaml.safe_dump({"rule_files": [], "evaluation_interval": "1m", "tests": [_panel_case(expr)]}))
    result = _promtool("test", "rules", str(path))
    assert result.returncode == 0 and "SUCCESS" in result.stdout + result.stderr, title + result.stdout + result.stderr


@needs_promtool
def test_the_old_rate_panels_missed_the_first_event(tmp_path):
    """The same input through the panels as they were (rate() of the counter): nothing drawn."""
    old = 'sum by (lock_renewal_outcome) (rate(otel_lock_renewals_total{job=~".*",instance=~".*"}[1m]))'
    case = _panel_case(old)
    case["input_series"][0]["series"] = ('otel_lock_renewals_total{job="shop",instance="r1",lock_name="stock",'
                                         'lock_renewal_outcome="lost"}')
    case["promql_expr_test"][0]["exp_samples"] = []
    path = tmp_path / "old.test.yml"
    path.write_text(yaml.safe_dump({"rule_files": [], "evaluation_interval": "1m", "tests": [case]}))
    result = _promtool("test", "rules", str(path))
    assert result.returncode == 0, result.stdout + result.stderr


# -- the rules against the library's own expositions -------------------------


def _exposed(registry, job: str = "shop", instance: str = "r1") -> dict[str, float]:
    """Every otel-lock sample of a real /metrics exposition, as a promtool series selector."""
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    found = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for sample in family.samples:
            if sample.name.startswith("otel_lock_"):
                labels = {"job": job, "instance": instance, **{k: v for k, v in sample.labels.items() if v}}
                found[sample.name + "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}"] = sample.value
    return found


def _timeline(phases: list[tuple[dict | None, int]]) -> list[dict]:
    """promtool input series, one sample a minute: each phase is a scrape result (None: the process is gone)."""
    names = sorted({name for snapshot, _ in phases if snapshot for name in snapshot})
    series = []
    for name in names:
        values: list[str] = []
        for snapshot, minutes in phases:
            for _ in range(minutes):
                if snapshot is not None and name in snapshot:
                    values.append(repr(snapshot[name]))
                else:  # gone from the scrape: Prometheus marks it stale once
                    values.append("stale" if values and values[-1] not in ("stale", "_") else "_")
        series.append({"series": name, "values": " ".join(values)})
    return series


def _run_case(tmp_path, series: list[dict], checks: list[dict]) -> subprocess.CompletedProcess:
    rules = tmp_path / "rules.yml"
    rules.write_text(RULES[0].read_text())
    path = tmp_path / "exposed.test.yml"
    path.write_text(yaml.safe_dump({"rule_files": [str(rules)], "evaluation_interval": "1m", "tests": [
        {"interval": "1m", "input_series": series, "promql_expr_test": checks}]}))
    return _promtool("test", "rules", str(path))


def _firing(alert: str, eval_time: str, **labels: str) -> dict:
    matchers = ",".join([f'alertname="{alert}"', 'alertstate="firing"'] + [f'{k}="{v}"' for k, v in labels.items()])
    return {"expr": f"count(ALERTS{{{matchers}}})", "eval_time": eval_time,
            "exp_samples": [{"labels": "{}", "value": 1}]}


def _silent(alert: str, eval_time: str) -> dict:
    return {"expr": f'ALERTS{{alertname="{alert}"}}', "eval_time": eval_time, "exp_samples": []}


@pytest.fixture
def installed():
    from otel_lock import telemetry

    telemetry._reset_for_tests()
    yield telemetry.setup("shop", "r1", otlp=False, flush_on_signal=False)
    telemetry._reset_for_tests()


@needs_promtool
async def test_a_restarted_replicas_first_lost_lease_pages_at_once_from_real_expositions(
        tmp_path, installed, redis_client):
    """Regression test: after a restart a replica's first lost lease paged 420 s late (its series born at 1, the old
    one's value). Scrapes of a real manager: started, holding `stock`, after losing it (its key taken)."""
    from otel_lock import LockManager

    locks = LockManager(redis_client, namespace="rules", meter_provider=installed.meter_provider)
    try:
        started = _exposed(installed.registry)
        held = await locks.acquire("stock:1", name="stock", lease=30)
        holding = _exposed(installed.registry)
        for key in await redis_client.keys("rules*"):
            await redis_client.delete(key)  # another owner's doing, as far as the holder can tell
        assert await held.release() is False
        lost = _exposed(installed.registry)
    finally:
        await locks.aclose()
    # The old process had lost a lease long ago; restart at 15m; the loss at 19m.
    phases = [(lost, 15), (None, 1), (started, 1), (holding, 2), (lost, 12)]
    checks = [_silent("OtelLockLeaseLost", "18m"), _firing("OtelLockLeaseLost", "19m", lock_name="stock", instance="r1")]
    result = _run_case(tmp_path, _timeline(phases), checks)
    assert result.returncode == 0, result.stdout + result.stderr

    # The same scrapes without the series at 0 (the library before): the loss does not page.
    born_at_1 = [({k: v for k, v in snapshot.items() if v} if snapshot else None, minutes)
                 for snapshot, minutes in phases]
    result = _run_case(tmp_path, _timeline(born_at_1), [_silent("OtelLockLeaseLost", "19m")])
    assert result.returncode == 0, result.stdout + result.stderr


@needs_promtool
async def test_a_replicas_first_redis_error_burst_and_circuit_opening_page_from_real_expositions(
        tmp_path, installed):
    """Regression test: with Redis down from the start, a replica's first burst of errors never paged, and a circuit
    that opened had no alert. Scrapes of a real manager pointed at a port nobody listens on."""
    from otel_lock import LockManager
    from otel_lock.cli._redis_server import free_port
    from otel_lock.lock import LockError

    locks = LockManager.from_url(f"redis://127.0.0.1:{free_port()}/0", namespace="down", socket_timeout=0.5,
                                 meter_provider=installed.meter_provider)
    try:
        started = _exposed(installed.registry)
        for _ in range(8):
            with pytest.raises(LockError):
                await locks.acquire("stock:1", name="stock", wait=0.1)
        burst = _exposed(installed.registry)
    finally:
        await locks.aclose()
    assert burst['otel_lock_circuit_opened_total{job="shop",instance="r1",db_client_connection_pool_name="down"}'] == 1
    phases = [(started, 3), (burst, 15)]
    checks = [_silent("OtelLockRedisErrors", "2m"),
              _firing("OtelLockRedisErrors", "5m", lock_operation="acquire", error_type="redis_unavailable"),
              _firing("OtelLockCircuitOpened", "3m", db_client_connection_pool_name="down"),
              _silent("OtelLockLeaseLost", "10m")]
    result = _run_case(tmp_path, _timeline(phases), checks)
    assert result.returncode == 0, result.stdout + result.stderr


# -- deadlocks and permit saturation, from the library's own expositions ------


@needs_promtool
async def test_a_replicas_first_deadlock_pages_from_real_expositions(tmp_path, installed, redis_client):
    """Two tasks take account:1 and account:2 in opposite orders: the second wait is refused (LockDeadlock).
    Scrapes of the real managers: the alert names the lock at the next evaluation, and no Redis-error alert."""
    import asyncio

    from _proc_helpers import queued, until
    from otel_lock import LockDeadlock, LockManager

    one = LockManager(redis_client, meter_provider=installed.meter_provider)
    two = LockManager(redis_client, meter_provider=installed.meter_provider)
    try:
        async with one.lock("account:1", name="account"):  # the name's first sight: its series at 0
            pass
        started = _exposed(installed.registry)

        async def transfer_one_to_two() -> None:
            async with one.lock("account:1", name="account"), one.lock("account:2", name="account", wait=30):
                pass

        async with two.lock("account:2", name="account"):
            first = asyncio.create_task(transfer_one_to_two())
            await queued(redis_client, "account:2", 1)  # holds account:1, waits for account:2
            # and has recorded that wait, so the second wait is the one that closes the cycle
            await until(lambda: redis_client.keys("otel-lock:waits:*"), "the first wait recorded")
            with pytest.raises(LockDeadlock):
                async with two.lock("account:1", name="account", wait=30):
                    pass
            refused = _exposed(installed.registry)
        async with asyncio.timeout(20):
            await first  # the cycle was broken: the first transfer went on
    finally:
        await one.aclose()
        await two.aclose()
    assert refused['otel_lock_errors_total{job="shop",instance="r1",error_type="deadlock",lock_name="account",'
                   'lock_operation="acquire"}'] == 1
    assert started['otel_lock_errors_total{job="shop",instance="r1",error_type="deadlock",lock_name="account",'
                   'lock_operation="acquire"}'] == 0  # the series at 0 from the name's first sight
    phases = [(started, 5), (refused, 15)]
    checks = [_silent("OtelLockDeadlocks", "4m"), _firing("OtelLockDeadlocks", "5m", lock_name="account"),
              _silent("OtelLockRedisErrors", "12m"), _silent("OtelLockDeadlocks", "16m")]
    result = _run_case(tmp_path, _timeline(phases), checks)
    assert result.returncode == 0, result.stdout + result.stderr


@needs_promtool
async def test_permits_saturated_pages_only_while_callers_wait_from_real_expositions(
        tmp_path, installed, redis_client):
    """A semaphore of 2 permits: both held and a caller queued for 5 minutes pages; both held alone does not."""
    import asyncio

    from _proc_helpers import until
    from otel_lock import LockManager

    locks = LockManager(redis_client, meter_provider=installed.meter_provider)
    try:
        first = await locks.acquire_permit("export:t1", permits=2, name="export")
        second = await locks.acquire_permit("export:t1", permits=2, name="export")
        waiter = asyncio.create_task(locks.acquire_permit("export:t1", permits=2, name="export", wait=30))

        async def counted() -> bool:
            return _exposed(installed.registry).get('otel_lock_pending{job="shop",instance="r1",lock_name="export"}',
                                                    0) >= 1
        await until(counted, "a caller queued for a permit")
        waiting = _exposed(installed.registry)
        await first.release()
        third = await asyncio.wait_for(waiter, 20)
        at_limit = _exposed(installed.registry)  # both permits held again, nobody waiting
        await second.release()
        await third.release()
    finally:
        await locks.aclose()
    assert waiting['otel_lock_permits_used{job="shop",instance="r1",lock_name="export"}'] == 2
    assert waiting['otel_lock_permits_limit{job="shop",instance="r1",lock_name="export"}'] == 2
    result = _run_case(tmp_path, _timeline([(at_limit, 20)]), [_silent("OtelLockPermitsSaturated", "15m")])
    assert result.returncode == 0, result.stdout + result.stderr
    # waiters from 2m: pending from then, firing once that has lasted 5 minutes
    checks = [_silent("OtelLockPermitsSaturated", "1m"), _firing("OtelLockPermitsSaturated", "8m", lock_name="export")]
    result = _run_case(tmp_path, _timeline([(at_limit, 2), (waiting, 10)]), checks)
    assert result.returncode == 0, result.stdout + result.stderr
