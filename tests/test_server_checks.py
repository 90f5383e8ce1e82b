"""The server checks (otel_lock/lock/_server_checks.py) against real servers: Redis 7.0 (or the
server the run uses), Valkey 9, Redis 6.2, with memory limits, eviction policies, ACL users and
CONFIG renamed away. Each printed fix is applied to the server and checked again: the rule we
tell operators to add must be the one that works.
"""

from __future__ import annotations

import re

import pytest
import redis.asyncio as aioredis

from otel_lock import RedisMisconfigured
from otel_lock.cli._redis_server import RedisServer, RedisServerNotFound, find_server
from otel_lock.lock import _redlock_scripts, _scripts, _shapes
from otel_lock.lock._connection import Connection
from otel_lock.lock._server_checks import SCRIPT_COMMANDS, check_server

NS = "shop"
MINIMAL = ("~shop:*", "&shop:wake:*", "+@read", "+@write", "+time", "+evalsha", "+script|load", "+publish",
           "+subscribe", "+ping")


def _servers():
    """The servers every ACL case runs on: this run's redis-server, and Valkey 9 when it is installed."""
    names = ["default"]
    try:
        find_server("valkey-9")
        names.append("valkey-9")
    except RedisServerNotFound:
        pass
    return names


@pytest.fixture(scope="module", params=_servers())
def server(request):
    binary = None if request.param == "default" else find_server(request.param)
    with RedisServer(binary=binary) as s:
        yield s


@pytest.fixture
async def admin(server):
    client = aioredis.Redis(port=server.port)
    await client.flushall()
    await client.config_set("maxmemory", 0)
    await client.config_set("maxmemory-policy", "noeviction")
    yield client
    for user in await client.acl_users():
        if user not in (b"default", "default"):
            await client.acl_deluser(user)
    await client.aclose()


@pytest.fixture
async def user(server, admin):
    """`await user(*rules)`: a client logged in as a fresh ACL user with those rules."""
    clients = []

    async def make(*rules, name="app"):
        await admin.execute_command("ACL", "SETUSER", name, "reset", "on", ">pw", *rules)
        client = aioredis.Redis(port=server.port, username=name, password="pw")
        clients.append(client)
        return client
    yield make
    for client in clients:
        await client.aclose()


async def _apply(admin, fix: str, user_name: str = "app") -> None:
    """Run the fix the report printed (an ACL SETUSER rule) as an operator would."""
    parts = fix.replace("<user>", user_name).split()
    assert parts[:3] == ["ACL", "SETUSER", user_name], fix
    await admin.execute_command(*parts)


def _subscriber(server, **auth):
    async def subscribe(channel: str) -> None:
        client = aioredis.Redis(port=server.port, **auth)
        pubsub = client.pubsub()
        try:
            await pubsub.subscribe(channel)
            await pubsub.unsubscribe(channel)
        finally:
            await pubsub.aclose()
            await client.aclose()
    return subscribe


# -- the module keeps up with the scripts ------------------------------------------


def test_the_checked_commands_are_the_ones_the_scripts_run():
    sources = [s.source for m in (_scripts, _redlock_scripts, _shapes) for s in vars(m).values()
               if isinstance(s, _scripts.Script)]
    assert sources
    called = {c for source in sources for c in re.findall(r"redis\.p?call\(\s*['\"]([A-Za-z]+)['\"]", source)}
    assert {c.upper() for c in called} == set(SCRIPT_COMMANDS)
    # PUBLISH / SPUBLISH are called through a variable and checked as the wake channels' right
    assert any("'PUBLISH'" in s and "'SPUBLISH'" in s for s in sources)


# -- a plain server ---------------------------------------------------------------------


@pytest.mark.parametrize("via", ["redis-py", "lean connection"])
async def test_a_default_server_passes_every_check(server, admin, via):
    lean = Connection(port=server.port) if via == "lean connection" else None
    run = lean.execute if lean else admin.execute_command
    try:
        report = await check_server(run, namespace=NS)
    finally:
        if lean:
            await lean.aclose()
    assert report.ok and not report.warnings, report.checks
    assert report.server in ("redis", "valkey") and report.version
    assert report.user == "default" and report.role == "master" and report.cluster is False
    assert report.maxmemory == 0 and report.maxmemory_policy == "noeviction" and report.evicting is False
    assert report.aof is False and report.rdb_save == ""
    assert report.round_trip is not None and report.round_trip > 0
    for name in ("scripts", "keys", "channels"):
        assert report.check(name).state == "ok", report.check(name)
    assert report.can_subscribe
    assert report.as_dict()["ok"] is True


async def test_the_version_is_the_servers_own(server, admin):
    report = await check_server(admin.execute_command, namespace=NS)
    said = server.binary.version()  # "Redis server v=7.0.15 ..." / "Valkey server v=9.1.2 ..."
    assert said.lower().startswith(report.server)
    assert f"v={report.version} " in said
    assert report.check("version").verdict == "ok"


# -- memory and eviction --------------------------------------------------------------


@pytest.mark.parametrize("policy", ["allkeys-lru", "volatile-lru", "volatile-ttl", "allkeys-random"])
async def test_an_evicting_policy_warns_and_refuses_when_noeviction_is_required(admin, policy):
    await admin.config_set("maxmemory", 64 << 20)
    await admin.config_set("maxmemory-policy", policy)
    report = await check_server(admin.execute_command, namespace=NS)
    eviction = report.check("eviction")
    assert (eviction.state, eviction.verdict) == (policy, "warning")
    assert report.ok and report.evicting is True and report.maxmemory == 64 << 20
    assert "noeviction" in eviction.fix
    strict = await check_server(admin.execute_command, namespace=NS, require_noeviction=True)
    assert not strict.ok and strict.refusals == (strict.check("eviction"),)
    with pytest.raises(RedisMisconfigured, match=f"maxmemory-policy {policy}.*noeviction"):
        strict.raise_for_refusals()


async def test_noeviction_with_a_memory_limit_passes_even_when_required(admin):
    await admin.config_set("maxmemory", 64 << 20)
    report = await check_server(admin.execute_command, namespace=NS, require_noeviction=True)
    assert report.ok and report.check("eviction").state == "noeviction"
    assert report.check("memory").verdict == "ok" and report.used_memory


async def test_an_evicting_policy_without_a_memory_limit_is_a_note_unless_required(admin):
    await admin.config_set("maxmemory-policy", "allkeys-lru")
    report = await check_server(admin.execute_command, namespace=NS)
    assert report.check("eviction").verdict == "note" and report.ok
    assert not (await check_server(admin.execute_command, namespace=NS, require_noeviction=True)).ok


async def test_memory_near_its_limit_warns(admin):
    info = await admin.info("memory")
    await admin.config_set("maxmemory", int(info["used_memory"]) + 4096)
    report = await check_server(admin.execute_command, namespace=NS)
    assert report.check("memory").verdict == "warning", report.check("memory")


# -- ACL users ------------------------------------------------------------------------


async def test_a_user_without_channels_warns_once_and_the_printed_rule_fixes_it(admin, user):
    # Redis 7's default acl-pubsub-default is resetchannels: `~* +@all` gets no channel
    client = await user("~*", "+@all")
    report = await check_server(client.execute_command, namespace=NS)
    channels = report.check("channels")
    assert (channels.state, channels.verdict) == ("missing", "warning")
    assert report.warnings == (channels,) and report.ok and not report.can_subscribe
    assert channels.fix == "ACL SETUSER app &shop:wake:*"
    await _apply(admin, channels.fix)
    assert (await check_server(client.execute_command, namespace=NS)).check("channels").state == "ok"


@pytest.mark.parametrize("removed, rule", [(("-evalsha",), "+evalsha"), (("-script|load", "-eval"), "+script|load")])
async def test_a_user_that_may_not_run_the_scripts_is_refused_with_the_rule(admin, user, removed, rule):
    client = await user("~*", "&*", "+@all", *removed)
    report = await check_server(client.execute_command, namespace=NS)
    scripts = report.check("scripts")
    assert (scripts.state, scripts.verdict) == ("missing", "refusal") and not report.ok
    assert scripts.fix == f"ACL SETUSER app {rule}"
    with pytest.raises(RedisMisconfigured, match=re.escape(scripts.fix)):
        report.raise_for_refusals()
    await _apply(admin, scripts.fix)
    assert (await check_server(client.execute_command, namespace=NS)).ok


@pytest.mark.parametrize("keys", ["%R~shop:*", "~other:*"])
async def test_a_user_without_write_rights_on_the_namespace_is_refused(admin, user, keys):
    client = await user(keys, "&*", "+@all")
    report = await check_server(client.execute_command, namespace=NS)
    check = report.check("keys")
    assert (check.state, check.verdict) == ("missing", "refusal")
    assert check.fix == "ACL SETUSER app ~shop:*"
    await _apply(admin, check.fix)
    assert (await check_server(client.execute_command, namespace=NS)).check("keys").state == "ok"


async def test_a_minimal_user_without_admin_rights_is_checked_by_trying_the_commands(server, admin, user):
    """No ACL DRYRUN, no INFO, no CONFIG, no ACL WHOAMI: what a managed service's app user often is."""
    client = await user(*MINIMAL)
    await admin.set("shop:{otel-lock-check}", "a lock's key", px=60_000)  # a lock of that name is left alone
    report = await check_server(client.execute_command, namespace=NS,
                                subscribe=_subscriber(server, username="app", password="pw"))
    assert report.ok, report.refusals
    for name in ("scripts", "keys", "channels"):
        assert report.check(name).state == "ok", report.check(name)
    for name in ("version", "eviction", "memory", "persistence", "replication"):
        assert report.check(name).state == "unknown" and report.check(name).verdict == "note"
    assert report.user is None and report.server is None and report.evicting is None
    # nothing of the probe is left, and nobody's key was touched
    assert [k async for k in admin.scan_iter("shop:*")] == [b"shop:{otel-lock-check}"]
    assert await admin.get("shop:{otel-lock-check}") == b"a lock's key"
    # without a way to subscribe, that right is unknown, not assumed
    assert (await check_server(client.execute_command, namespace=NS)).check("channels").state == "unknown"


async def test_each_command_the_scripts_need_is_named_when_missing(admin, user):
    client = await user("~shop:*", "&shop:wake:*", "+@read", "+evalsha", "+script|load", "+publish", "+ping",
                        "-time", name="reader")
    report = await check_server(client.execute_command, namespace=NS)
    check = report.check("keys")
    assert check.verdict == "refusal"
    for command in ("del", "hset", "pexpire", "set", "zadd", "time"):
        assert f"+{command}" in check.fix.split(), check.fix
    assert "+get" not in check.fix.split()
    await _apply(admin, check.fix.replace("<user>", "reader"), "reader")
    assert (await check_server(client.execute_command, namespace=NS)).check("keys").state == "ok"


async def test_the_lean_connection_gets_the_same_answers(server, admin, user):
    await user("~*", "+@all")
    lean = Connection(port=server.port, username="app", password="pw")
    try:
        report = await check_server(lean.execute, namespace=NS)
    finally:
        await lean.aclose()
    assert report.check("channels").fix == "ACL SETUSER app &shop:wake:*"
    assert report.check("scripts").state == report.check("keys").state == "ok"


async def test_a_namespace_with_glob_characters_gets_an_escaped_rule(admin, user):
    client = await user("~other:*", "&*", "+@all")
    report = await check_server(client.execute_command, namespace="a*b")
    assert report.check("keys").fix == "ACL SETUSER app ~a\\*b:*"
    await _apply(admin, report.check("keys").fix)
    assert (await check_server(client.execute_command, namespace="a*b")).check("keys").state == "ok"


# -- what INFO and CONFIG do (not) publish ------------------------------------------------


@pytest.fixture(scope="module")
def no_config():
    """CONFIG renamed away, as managed services do; an evicting policy set at start."""
    with RedisServer(extra_args=("--rename-command", "CONFIG", "", "--maxmemory", "64mb",
                                 "--maxmemory-policy", "volatile-lru")) as s:
        yield s


async def test_without_config_the_policy_comes_from_info(no_config):
    async with aioredis.Redis(port=no_config.port) as client:
        report = await check_server(client.execute_command, namespace=NS)
    assert report.maxmemory_policy == "volatile-lru" and report.check("eviction").verdict == "warning"
    assert report.rdb_save is None and report.check("persistence").state == "no aof"
    assert report.ok


async def test_a_policy_nobody_publishes_is_unknown_and_refused_only_when_required(no_config):
    async with aioredis.Redis(port=no_config.port) as client:
        await client.execute_command("ACL", "SETUSER", "app", "on", ">pw", *MINIMAL)
    async with aioredis.Redis(port=no_config.port, username="app", password="pw") as client:
        report = await check_server(client.execute_command, namespace=NS)
        assert report.check("eviction").state == "unknown" and report.ok
        strict = await check_server(client.execute_command, namespace=NS, require_noeviction=True)
    assert strict.refusals == (strict.check("eviction"),)


# -- replication, versions, connection ------------------------------------------------------


async def test_a_replica_warns(server):
    with RedisServer(binary=server.binary, extra_args=("--replicaof", "127.0.0.1", str(server.port))) as replica:
        async with aioredis.Redis(port=replica.port) as client:
            report = await check_server(client.execute_command, namespace=NS)
    check = report.check("replication")
    assert (check.state, check.verdict) == ("replica", "warning") and "master" in check.fix


async def test_a_server_below_the_supported_minimum_is_refused_by_name():
    try:
        binary = find_server("redis-6.2")
    except RedisServerNotFound as exc:
        pytest.skip(str(exc))
    with RedisServer(binary=binary) as old:
        async with aioredis.Redis(port=old.port) as client:
            report = await check_server(client.execute_command, namespace=NS)
    check = report.check("version")
    assert (check.state, check.verdict) == ("6.2.5", "refusal")
    with pytest.raises(RedisMisconfigured, match=r"Redis 6\.2\.5 is older than the supported minimum \(Redis 7\.0\)"):
        report.raise_for_refusals()


async def test_no_server_no_report():
    from redis.exceptions import ConnectionError as RedisConnectionError

    from otel_lock.cli._redis_server import free_port

    async with aioredis.Redis(port=free_port(), socket_connect_timeout=1) as client:
        with pytest.raises(RedisConnectionError):
            await check_server(client.execute_command, namespace=NS)


# -- a server without SCRIPT (rename-command SCRIPT ""): the lock runs by EVALSHA and EVAL ----------------


@pytest.fixture(scope="module")
def no_script():
    """SCRIPT renamed away, as some managed services and proxies do: EVAL and EVALSHA still allowed."""
    with RedisServer(extra_args=("--rename-command", "SCRIPT", "")) as s:
        yield s


async def test_without_script_the_scripts_check_says_eval_and_the_server_is_usable(no_script):
    async with aioredis.Redis(port=no_script.port) as client:
        await client.flushall()
        report = await check_server(client.execute_command, namespace=NS)
        await client.execute_command("ACL", "SETUSER", "app", "reset", "on", ">pw", *MINIMAL, "+eval")
    async with aioredis.Redis(port=no_script.port, username="app", password="pw") as client:
        tried = await check_server(client.execute_command, namespace=NS)  # no ACL DRYRUN: the commands themselves
    for one in (report, tried):
        scripts = one.check("scripts")
        assert (scripts.state, scripts.verdict) == ("eval", "note"), scripts
        assert "unknown command 'SCRIPT'" in scripts.detail and "with args" not in scripts.detail
        assert one.ok and one.check("keys").state == "ok", one.checks


async def test_without_script_the_manager_takes_renews_and_hands_over_by_eval(no_script):
    """Regression: doctor said usable here and the manager refused every acquisition (SCRIPT LOAD failed)."""
    import asyncio

    from otel_lock import LockManager

    async with aioredis.Redis(port=no_script.port) as admin:
        await admin.flushall()
    async with LockManager.from_url(no_script.url, namespace=NS, lease=0.3) as locks, \
            LockManager.from_url(no_script.url, namespace=NS) as other:
        held = await locks.acquire("k")
        assert [r.check("scripts").state for r in locks.server_reports] == ["eval"]
        waiter = asyncio.ensure_future(other.acquire("k", wait=10))
        # premise: several renewals are due (lease 0.3 s, renewed every 0.1 s), the first one by EVAL
        await asyncio.sleep(0.9)
        assert not held.lost.is_set() and not waiter.done()
        await held.release()
        handed = await waiter  # the release's hand-over (RELEASE came by EVAL too)
        assert handed.token > held.token
        await handed.release()


async def test_without_script_and_eval_manager_and_check_refuse_with_one_reason():
    from otel_lock import LockManager

    with RedisServer(extra_args=("--rename-command", "SCRIPT", "", "--rename-command", "EVAL", "")) as s:
        async with aioredis.Redis(port=s.port) as client:
            report = await check_server(client.execute_command, namespace=NS)
        scripts = report.check("scripts")
        assert (scripts.state, scripts.verdict) == ("missing", "refusal") and scripts.fix.endswith("+eval")
        async with LockManager.from_url(s.url, namespace=NS) as locks:
            with pytest.raises(RedisMisconfigured) as refused:
                await locks.acquire("k")
    assert scripts.detail in str(refused.value)


# -- checked again when the server changes under a running manager ---------------------------------


def _verdicts(reader) -> dict[str, float]:
    data = reader.get_metrics_data()
    return {p.attributes["server.address"]: p.value
            for resource in (data.resource_metrics if data else []) for scope in resource.scope_metrics
            for metric in scope.metrics if metric.name == "otel_lock.server.verdict"
            for p in metric.data.data_points if p.attributes["db.client.connection.pool.name"] == NS}


async def test_a_restart_with_an_evicting_policy_is_checked_again(monkeypatch):
    """Regression: the checks ran once per process, so require_noeviction was never checked after a restart."""
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    from _proc_helpers import until

    from otel_lock import LockError, LockManager
    from otel_lock.lock import _server_watch

    monkeypatch.setattr(_server_watch, "FLOOR", 0.01)  # a tick every 0.1 s (half the lease)
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])

    async def refused() -> bool:
        try:
            await (await locks.acquire("k", wait=0.5)).release()
        except RedisMisconfigured:
            return True
        except LockError:  # still restarting
            return False
        return False

    with RedisServer() as s:
        async with LockManager.from_url(s.url, namespace=NS, lease=0.2, require_noeviction=True,
                                        meter_provider=provider) as locks:
            await (await locks.acquire("k")).release()
            where = locks.server_reports[0].address
            assert locks.health().ok and _verdicts(reader) == {where: 0}
            s.extra_args = ("--maxmemory", "64mb", "--maxmemory-policy", "allkeys-lru")
            s.restart()
            await until(refused, "the refusal of the restarted, evicting server")
            with pytest.raises(RedisMisconfigured, match="maxmemory-policy allkeys-lru.*noeviction"):
                await locks.acquire("k")
            health = locks.health()
            assert not health.ok and any("allkeys-lru" in p for p in health.problems)
            assert _verdicts(reader) == {where: 2}
            async with aioredis.Redis(port=s.port) as admin:
                await admin.config_set("maxmemory-policy", "noeviction")  # the fix the message names
            await until(lambda: _acquires(locks), "the lock back once the policy is fixed")
            assert locks.health().ok and _verdicts(reader) == {where: 0}
    provider.shutdown()


async def _acquires(locks) -> bool:
    from otel_lock import LockError

    try:
        await (await locks.acquire("k", wait=0.5)).release()
    except LockError:
        return False
    return True


async def test_check_servers_runs_the_first_use_checks_now(server, admin):
    """What `otel-lock doctor` prints: the checks of the first use, run now and kept, SUBSCRIBE tried too."""
    from otel_lock import LockManager

    async with LockManager.from_url(server.url, namespace=NS) as locks:
        reports = await locks.check_servers()
    assert reports == locks.server_reports and locks.health().checked
    (report,) = reports
    assert report.check("channels").state == "ok" and "SUBSCRIBE" in report.check("channels").detail


async def test_a_role_change_is_checked_again(monkeypatch):
    """A master turned replica under the manager (a failover's other half): checked again, warned, then cleared."""
    from _proc_helpers import until

    from otel_lock import LockManager
    from otel_lock.lock import _server_watch

    monkeypatch.setattr(_server_watch, "FLOOR", 0.01)  # a tick every 0.1 s (half the lease)

    async def warned() -> bool:
        return any("this server is a replica" in p for p in locks.health().problems)

    async def cleared() -> bool:
        return locks.server_reports[0].role == "master"

    with RedisServer() as s, RedisServer() as other:
        async with LockManager.from_url(s.url, namespace=NS, lease=0.2) as locks, \
                aioredis.Redis(port=s.port) as admin:
            await (await locks.acquire("k")).release()
            assert locks.health().problems == ()
            await admin.execute_command("REPLICAOF", "127.0.0.1", str(other.port))
            await until(warned, "the replication warning")
            assert locks.server_reports[0].check("replication").verdict == "warning"
            await admin.execute_command("REPLICAOF", "NO", "ONE")
            await until(cleared, "the master again")
            assert locks.health().ok and locks.health().problems == ()


def test_the_verdict_is_served_on_the_prometheus_fast_path(monkeypatch):
    from prometheus_client import generate_latest

    from otel_lock import telemetry
    from otel_lock.telemetry._counts import LockCounts

    for name in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT", "OTEL_METRICS_EXPORTER"):
        monkeypatch.delenv(name, raising=False)
    telemetry._reset_for_tests()
    try:
        installed = telemetry.setup("shop", "r1")
        counts = LockCounts()
        counts.watch_connections(lambda: (0, 0), pool_name=NS)
        counts.watch_servers(lambda: {"127.0.0.1:6379": 2, "127.0.0.1:6380": 0})
        text = generate_latest(installed.registry).decode()
    finally:
        telemetry._reset_for_tests()
    assert f'otel_lock_server_verdict{{db_client_connection_pool_name="{NS}",server_address="127.0.0.1:6379"}} 2.0' \
        in text
    assert f'otel_lock_server_verdict{{db_client_connection_pool_name="{NS}",server_address="127.0.0.1:6380"}} 0.0' \
        in text


@pytest.mark.failover
async def test_a_failover_to_an_evicting_replica_is_refused_when_noeviction_is_required(monkeypatch):
    """Regression: checked once per process, require_noeviction was never checked again after a failover."""
    from benchmarks._sentinel_set import SentinelSet

    from _proc_helpers import until

    from otel_lock import LockError, LockManager
    from otel_lock.lock import _server_watch

    monkeypatch.setattr(_server_watch, "FLOOR", 0.01)  # a tick every 0.5 s (half the lease)

    async def refused() -> bool:
        try:
            await (await locks.acquire("k", wait=0.5)).release()
        except RedisMisconfigured:
            return True
        except LockError:  # failing over
            return False
        return False

    async with SentinelSet() as sentinels:
        assert sentinels.replica is not None
        async with aioredis.Redis(port=sentinels.replica.port) as replica:
            await replica.config_set("maxmemory", 64 << 20)
            await replica.config_set("maxmemory-policy", "allkeys-lru")
        async with LockManager.from_url(sentinels.url, namespace=NS, lease=1.0, require_noeviction=True) as locks:
            await (await locks.acquire("k")).release()
            assert locks.health().ok
            sentinels.kill_master()
            await sentinels.failed_over()
            await until(refused, "the refusal of the evicting new master", timeout=30)
            health = locks.health()
            assert not health.ok and any("allkeys-lru" in p for p in health.problems)
            assert locks.server_reports[0].role == "master"
