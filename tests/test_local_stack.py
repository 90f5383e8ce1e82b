"""`otel-lock stack`: starts Redis, replicas and Prometheus, prints the URLs, stops all on Ctrl-C."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys

import httpx
import pytest

from otel_lock.cli._local_stack import main

needs_prometheus = pytest.mark.skipif(shutil.which("prometheus") is None,
                                      reason="prometheus binary not on PATH (Debian: apt-get install prometheus)")


@pytest.mark.parametrize("argv, problem", [
    (["--replicas", "0"], "--replicas"),
    (["--prometheus-port", "70000"], "--prometheus-port"),
    (["--replicas", "two"], "invalid int"),
])
def test_bad_arguments_exit_2_naming_the_problem(argv, problem, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    assert problem in capsys.readouterr().err


@needs_prometheus
def test_stack_runs_and_stops_everything_on_ctrl_c():
    process = subprocess.Popen(
        [sys.executable, "-m", "otel_lock.cli", "stack", "--prometheus-port", "0", "--job-interval", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    try:
        for line in process.stdout:  # blocks until the stack prints; ends if it dies
            lines.append(line)
            if line.startswith("Ctrl-C"):
                break
        output = "".join(lines)
        urls = re.findall(r"^(?:replica|prometheus)\s+(http://\S+)", output, flags=re.M)
        assert len(urls) == 3, output
        [runbooks] = re.findall(r"^runbooks\s+(http://\S+)", output, flags=re.M)
        with httpx.Client(timeout=5.0) as client:
            for url in urls[:2]:
                assert client.get(url + "/healthz").status_code == 200
            assert client.get(urls[2] + "/-/ready").status_code == 200
            # the page every alert's runbook_url opens, served by this Prometheus
            page = client.get(runbooks)
            assert page.status_code == 200 and 'id="lease-lost"' in page.text and 'id="target-down"' in page.text
        os.kill(process.pid, signal.SIGINT)
        assert process.wait(30) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        process.stdout.close()
    with httpx.Client(timeout=1.0) as client:
        for url in urls:
            with pytest.raises(httpx.TransportError):
                client.get(url + "/healthz")


def test_render_rules_to_writes_rules_with_this_deployments_links(tmp_path, capsys):
    code = main(["--render-rules-to", str(tmp_path), "--runbook-base", "https://wiki.example.com/otel-lock",
                 "--grafana-url", "https://grafana.example.com/"])
    assert code == 0
    [path] = tmp_path.glob("*.yml")
    text = path.read_text()
    assert "https://wiki.example.com/otel-lock#lease-lost" in text
    assert '"https://grafana.example.com/d/otel-lock-lock/' in text
    assert "github.com" not in text and "localhost:3000" not in text


def test_render_rules_to_refuses_a_relative_base(tmp_path, capsys):
    assert main(["--render-rules-to", str(tmp_path), "--runbook-base", "docs/observability.md"]) == 1
    assert "absolute" in capsys.readouterr().out


def test_the_stack_runs_its_replicas_with_keys_hashed_in_spans():
    from otel_lock.cli._local_stack import LocalStack

    assert LocalStack().replica_env["OTEL_LOCK_REDACT"] == "hash"
    assert LocalStack(replica_env={"OTEL_LOCK_REDACT": "drop"}).replica_env["OTEL_LOCK_REDACT"] == "drop"
