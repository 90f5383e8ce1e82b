"""`otel-lock doctor`, run as the real command against real servers: one Redis (plain, over a
unix socket, over TLS), a Sentinel set and a Redis Cluster."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import redis

from otel_lock.cli._redis_server import RedisServer, free_port
from otel_lock.lock._scripts import MODEL, SHARES_WITH

CHECKS = ("version", "eviction", "memory", "persistence", "replication", "scripts", "keys", "channels",
          "round trip")


def doctor(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "otel_lock.cli", "doctor", *args], capture_output=True,
                          text=True, timeout=timeout)


@pytest.fixture
def server():
    with RedisServer() as s:
        yield s


def test_a_default_server_is_fine(server):
    result = doctor("--redis-url", server.url)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    for name in CHECKS:
        assert any(line.split()[1:2] == name.split()[:1] for line in lines if line.startswith("  ")), name
    assert "REFUSED" not in result.stdout and "WARNING" not in result.stdout
    assert lines[-1].startswith("verdict: usable by otel-lock (0 refusals, 0 warnings)")


def test_an_evicting_policy_warns_and_is_refused_on_request(server):
    redis.Redis(port=server.port).config_set("maxmemory-policy", "volatile-lru")
    redis.Redis(port=server.port).config_set("maxmemory", 64 << 20)
    result = doctor("--redis-url", server.url)
    assert result.returncode == 0
    assert "WARNING  eviction     maxmemory-policy volatile-lru" in result.stdout
    assert "fix: CONFIG SET maxmemory-policy noeviction" in result.stdout
    strict = doctor("--redis-url", server.url, "--require-noeviction")
    assert strict.returncode == 1 and "REFUSED  eviction" in strict.stdout
    assert "verdict: REFUSED" in strict.stdout


def test_a_refused_user_exits_1_with_the_rule_and_never_the_password(server):
    admin = redis.Redis(port=server.port)
    admin.execute_command("ACL", "SETUSER", "app", "on", ">s3cret-pw", "~*", "&*", "+@all", "-evalsha")
    result = doctor("--redis-url", f"redis://app:s3cret-pw@127.0.0.1:{server.port}/0", "--namespace", "shop")
    assert result.returncode == 1
    assert "fix: ACL SETUSER app +evalsha" in result.stdout and "user app" in result.stdout
    assert "s3cret-pw" not in result.stdout + result.stderr


def test_json_says_the_same(server):
    redis.Redis(port=server.port).execute_command("ACL", "SETUSER", "app", "on", ">pw", "~*", "+@all")
    result = doctor("--redis-url", f"redis://app:pw@127.0.0.1:{server.port}/0", "--json")
    assert result.returncode == 0
    data = json.loads(result.stdout)
    assert data["ok"] is True and data["url"] == f"redis://***@127.0.0.1:{server.port}/0"
    (report,) = data["servers"]
    checks = {c["name"]: c for c in report["checks"]}
    assert set(checks) == set(CHECKS)
    assert checks["channels"]["state"] == "missing" and checks["channels"]["fix"] == "ACL SETUSER app &otel-lock:wake:*"
    assert report["user"] == "app" and report["maxmemory_policy"] == "noeviction"


@pytest.mark.parametrize("args", [("--redis-url", "http://127.0.0.1:1/"), ("--namespace", "a b"),
                                  ("--redis-url", "redis+sentinel://127.0.0.1:1"), ("--bogus",)])
def test_bad_arguments_exit_2(args):
    result = doctor(*args)
    assert result.returncode == 2 and result.stdout == ""


def test_an_unreachable_redis_is_one_line_and_exit_1():
    result = doctor("--redis-url", f"redis://:pw@127.0.0.1:{free_port()}/0")
    assert result.returncode == 1 and result.stdout == ""
    assert result.stderr.count("\n") == 1 and "unreachable" in result.stderr and "pw" not in result.stderr


def test_a_unix_socket(tmp_path):
    socket_path = tmp_path / "redis.sock"
    with RedisServer(extra_args=("--unixsocket", str(socket_path), "--unixsocketperm", "700")):
        result = doctor("--redis-url", f"unix://{socket_path}")
    assert result.returncode == 0, result.stderr
    assert f"{socket_path}: " in result.stdout


def _certificate(folder: Path) -> tuple[Path, Path]:
    key, cert = folder / "key.pem", folder / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True, timeout=60)
    return key, cert


@pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl is not on PATH")
def test_tls(tmp_path):
    key, cert = _certificate(tmp_path)
    tls_port = free_port()
    server = RedisServer(extra_args=("--tls-port", str(tls_port), "--tls-cert-file", str(cert),
                                     "--tls-key-file", str(key), "--tls-ca-cert-file", str(cert),
                                     "--tls-auth-clients", "no"))
    try:
        server.start()
    except RuntimeError as exc:
        if "tls" not in str(exc).lower():
            raise
        pytest.skip(f"this server is built without TLS (Debian's redis-server has it): {exc}")
    try:
        result = doctor("--redis-url", f"rediss://127.0.0.1:{tls_port}/0?ssl_ca_certs={cert}")
    finally:
        server.stop()
    assert result.returncode == 0, result.stderr
    assert f"127.0.0.1:{tls_port}: Redis" in result.stdout


def test_sentinel_checks_the_master_the_sentinels_name():
    from _deployments import deployment_url

    with deployment_url("sentinel") as url:
        result = doctor("--redis-url", url)
    assert result.returncode == 0, result.stderr
    assert "(the Sentinels' master)" in result.stdout and "ok       replication  master, 1 replica" in result.stdout


def test_cluster_checks_every_master():
    import asyncio

    from benchmarks._cluster_set import ClusterSet

    cluster = ClusterSet(masters=3)
    asyncio.run(cluster.__aenter__())
    try:
        ports = cluster.ports
        redis.Redis(port=ports[1]).config_set("maxmemory-policy", "allkeys-lru")
        redis.Redis(port=ports[1]).config_set("maxmemory", 64 << 20)
        result = doctor("--redis-url", cluster.url, "--json")
    finally:
        asyncio.run(cluster.__aexit__())
    assert result.returncode == 0, result.stderr
    reports = json.loads(result.stdout)["servers"]
    assert sorted(int(r["address"].split()[0].split(":")[1]) for r in reports) == sorted(ports)
    assert all(r["cluster"] for r in reports)
    policies = {int(r["address"].split()[0].split(":")[1]): r["maxmemory_policy"] for r in reports}
    assert policies[ports[1]] == "allkeys-lru" and list(policies.values()).count("noeviction") == 2
    for report in reports:
        channels = {c["name"]: c for c in report["checks"]}["channels"]
        assert channels["state"] == "ok" and "SPUBLISH and SSUBSCRIBE" in channels["detail"], channels


def test_cluster_with_an_app_user_probes_each_master_in_its_own_slots():
    """No ACL DRYRUN: the probe's keys and shard channel must hash to each master's slots (else MOVED)."""
    import asyncio

    from benchmarks._cluster_set import ClusterSet

    cluster = ClusterSet(masters=3)
    asyncio.run(cluster.__aenter__())
    try:
        for port in cluster.ports:
            redis.Redis(port=port).execute_command(
                "ACL", "SETUSER", "app", "on", ">pw", "~shop:*", "&shop:wake:*", "+@read", "+@write", "+time",
                "+evalsha", "+script|load", "+spublish", "+ssubscribe", "+ping", "+cluster|nodes")
        url = cluster.url.replace("redis+cluster://", "redis+cluster://app:pw@")
        refused = doctor("--redis-url", url, "--namespace", "shop")  # redis-py needs the slot map first
        for port in cluster.ports:
            redis.Redis(port=port).execute_command("ACL", "SETUSER", "app", "+cluster|slots", "+command")
        result = doctor("--redis-url", url, "--namespace", "shop", "--json")
    finally:
        asyncio.run(cluster.__aexit__())
    assert refused.returncode == 1 and refused.stdout == ""
    assert refused.stderr.count("\n") == 1 and "needs +cluster|slots and +command" in refused.stderr, refused.stderr
    assert result.returncode == 0, result.stdout + result.stderr
    reports = json.loads(result.stdout)["servers"]
    assert len(reports) == 3
    for report in reports:
        checks = {c["name"]: c for c in report["checks"]}
        for name in ("scripts", "keys", "channels"):
            assert checks[name]["state"] == "ok", checks[name]
        assert "trying the commands" in checks["scripts"]["detail"]


# -- doctor and the manager: one check, one answer -------------------------------------------


def _acquire(url: str, namespace: str = "otel-lock") -> BaseException | None:
    """Take and release one lock with a LockManager; the exception it raised, if any."""
    import asyncio

    from otel_lock import LockManager

    async def take() -> None:
        async with LockManager.from_url(url, namespace=namespace) as locks:
            async with locks.lock("k"):
                pass
    try:
        asyncio.run(take())
    except Exception as exc:  # noqa: BLE001 - returned for the test to read
        return exc
    return None


def test_a_server_without_script_is_usable_and_the_manager_agrees():
    """Regression: doctor said usable here (0 refusals) and the manager refused every acquisition."""
    with RedisServer(extra_args=("--rename-command", "SCRIPT", "")) as s:
        result = doctor("--redis-url", s.url)
        refused = _acquire(s.url)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "note     scripts      SCRIPT LOAD is not available (unknown command 'SCRIPT')" in result.stdout
    assert "by EVAL" in result.stdout and "verdict: usable by otel-lock" in result.stdout
    assert refused is None


def test_a_server_without_script_and_eval_is_refused_by_both_for_one_reason():
    from otel_lock import RedisMisconfigured

    with RedisServer(extra_args=("--rename-command", "SCRIPT", "", "--rename-command", "EVAL", "")) as s:
        result = doctor("--redis-url", s.url, "--json")
        refused = _acquire(s.url)
    assert result.returncode == 1
    (report,) = json.loads(result.stdout)["servers"]
    scripts = {c["name"]: c for c in report["checks"]}["scripts"]
    assert scripts["verdict"] == "refusal" and scripts["fix"] == "ACL SETUSER default +eval"
    assert isinstance(refused, RedisMisconfigured) and scripts["detail"] in str(refused)


def test_doctor_names_the_data_model_and_the_record_layouts_of_the_namespace(server):
    admin = redis.Redis(port=server.port)
    assert _acquire(server.url, "shop") is None  # a manager claimed the namespace
    admin.hset("shop:idem:{user-1}:r:abc", "d", "{}")  # a record of today's layout
    admin.set("shop:{idem:xyz}:idempotency", "{}")  # ... and one of 0.1.0's
    result = doctor("--redis-url", server.url, "--namespace", "shop")
    assert result.returncode == 0, result.stdout
    assert f"namespace 'shop': data model {MODEL}, 7.0 days left (this otel-lock's)" in result.stdout
    assert ("idempotency records: current (shop:idem:{<p>}:r:<h>), 0.1.0 (shop:{idem:<h>}:idempotency)"
            in result.stdout)
    data = json.loads(doctor("--redis-url", server.url, "--namespace", "shop", "--json").stdout)
    assert data["namespace_state"] == {"namespace": "shop", "model": MODEL, "model_ttl": data["namespace_state"][
        "model_ttl"], "record_layouts": ["current", "0.1.0"]}
    assert admin.get("shop:model") == str(MODEL).encode()
    admin.set("shop:model", SHARES_WITH[0])  # the other release's managers claimed it since: they read each other's
    shared = doctor("--redis-url", server.url, "--namespace", "shop")
    assert shared.returncode == 0 and f"data model {SHARES_WITH[0]} (shared with this otel-lock's)" in shared.stdout
    empty = doctor("--redis-url", server.url, "--namespace", "other")
    assert "namespace 'other': no data model claims it" in empty.stdout and "idempotency records: none" in empty.stdout
    assert admin.exists("other:model") == 0  # doctor reads, never claims


def test_a_namespace_of_another_data_model_is_refused_by_both_for_one_reason(server):
    from otel_lock import RedisMisconfigured

    redis.Redis(port=server.port).set("shop:model", max(MODEL, *SHARES_WITH) + 1)
    result = doctor("--redis-url", server.url, "--namespace", "shop")
    refused = _acquire(server.url, "shop")
    assert result.returncode == 1 and "verdict: REFUSED" in result.stdout
    assert isinstance(refused, RedisMisconfigured)
    assert f"REFUSED  data model   {refused}" in result.stdout


def test_a_database_the_server_lacks_is_named_not_taken_for_acl_refusals(server):
    """Every probe failed with 'DB index is out of range' and each was reported as a missing ACL right first."""
    result = doctor("--redis-url", f"redis://127.0.0.1:{server.port}/16")
    assert result.returncode == 1 and result.stdout == ""
    assert "ACL SETUSER" not in result.stderr and "may not run" not in result.stderr
    assert result.stderr.strip().splitlines() == [
        f"otel-lock doctor: Redis at redis://127.0.0.1:{server.port}/16 answered with an error: DB index is out of range"]
