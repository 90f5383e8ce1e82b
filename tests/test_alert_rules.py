"""Alert rules: promtool check config / check rules / test rules, and the shape of every alert."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from otel_lock.cli._local_stack import render_prometheus_config

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
    assert page == "docs/observability.md" and anchor


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
