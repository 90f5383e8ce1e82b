"""`otel-lock doctor` when reading the namespace fails after the server checks ran: the report is printed,
and its namespace part says what failed."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import redis

from otel_lock.cli._redis_server import RedisServer


def doctor(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "otel_lock.cli", "doctor", *args], capture_output=True,
                          text=True, timeout=60)


@pytest.fixture
def server():
    with RedisServer() as s:
        yield s


def test_a_user_without_rights_on_the_namespace_still_gets_the_report(server):
    """The docs' minimal user for `shop`, run without --namespace: doctor printed nothing (--json 0 bytes)."""
    redis.Redis(port=server.port).execute_command(
        "ACL", "SETUSER", "app", "on", ">pw", "~shop:*", "&shop:wake:*", "+@read", "+@write", "+time", "+evalsha",
        "+script|load", "+publish", "+subscribe", "+ping")
    url = f"redis://app:pw@127.0.0.1:{server.port}/0"
    text = doctor("--redis-url", url)
    assert text.returncode == 1
    assert "namespace 'otel-lock': could not be read: " in text.stdout and "ACL SETUSER app ~otel-lock:*" in text.stdout
    assert "verdict: REFUSED" in text.stdout
    report = json.loads(doctor("--redis-url", url, "--json").stdout)
    assert report["ok"] is False and report["servers"]
    assert "no permissions" in report["namespace_state"]["error"].lower()


def test_a_model_key_of_another_type_is_named_in_the_report(server):
    redis.Redis(port=server.port).hset("otel-lock:model", "a", "b")
    text = doctor("--redis-url", server.url)
    assert text.returncode == 1 and "otel-lock:model is not a string" in text.stdout, text.stderr
    assert text.stdout.splitlines()[-1].startswith("verdict: REFUSED")
    report = json.loads(doctor("--redis-url", server.url, "--json").stdout)
    assert report["namespace_state"]["error"].startswith("WRONGTYPE")
