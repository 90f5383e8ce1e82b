"""Start N `otel-lock serve` processes on free loopback ports, stop them by pid.

Used by `otel-lock demo` and by tests that need real replicas (separate
processes, separate event loops, one Redis). Output goes to a log file per
replica, so a replica that fails to start is reported with its own words.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from ._redis_server import free_port


class ReplicaFailed(RuntimeError):
    """A replica exited or did not answer /healthz in time."""


@dataclass
class Replica:
    name: str
    port: int
    process: subprocess.Popen[bytes]
    log_path: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


@dataclass
class Replicas:
    """`with Replicas(redis_url, count=2) as replicas: replicas.urls`"""

    redis_url: str
    count: int = 2
    namespace: str = "otel-lock"
    job_interval: float = 0.0
    env: dict[str, str] = field(default_factory=dict)  # added to (not replacing) os.environ
    name_prefix: str = "replica"
    startup_timeout: float = 30.0
    replicas: list[Replica] = field(default_factory=list)

    @property
    def urls(self) -> list[str]:
        return [replica.url for replica in self.replicas]

    def start(self) -> "Replicas":
        self._dir = Path(tempfile.mkdtemp(prefix="otel-lock-replicas-"))
        try:
            # Spawn all first, then wait: the replicas import in parallel.
            for index in range(1, self.count + 1):
                self.replicas.append(self._spawn(f"{self.name_prefix}-{index}"))
            deadline = time.monotonic() + self.startup_timeout
            for index, replica in enumerate(self.replicas):
                for _ in range(3):
                    if _wait_healthy(replica, deadline):
                        break
                    # The free port was taken between our probe and uvicorn's bind: new port.
                    replica = self.replicas[index] = self._spawn(replica.name)
                else:
                    raise ReplicaFailed(f"{replica.name}: no free port after 3 attempts")
        except BaseException:
            self.stop()
            raise
        return self

    def _spawn(self, name: str) -> Replica:
        port = free_port()
        log_path = self._dir / f"{name}.log"
        args = [
            sys.executable, "-m", "otel_lock.cli", "serve",
            "--host", "127.0.0.1", "--port", str(port), "--redis-url", self.redis_url,
            "--namespace", self.namespace, "--replica-name", name, "--job-interval", str(self.job_interval),
        ]
        with open(log_path, "wb") as log:
            # A session of its own: a Ctrl-C in the terminal reaches the demo, which
            # then stops the replicas in order, instead of every process at once.
            process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                       env={**os.environ, **self.env}, start_new_session=True)
        return Replica(name, port, process, log_path)

    def stop(self) -> None:
        """SIGTERM each replica by pid (uvicorn shuts down gracefully), SIGKILL stragglers."""
        for replica in self.replicas:
            if replica.process.poll() is None:
                os.kill(replica.process.pid, signal.SIGTERM)
        for replica in self.replicas:
            try:
                replica.process.wait(10)
            except subprocess.TimeoutExpired:
                os.kill(replica.process.pid, signal.SIGKILL)
                replica.process.wait(5)
        self.replicas.clear()
        shutil.rmtree(getattr(self, "_dir", ""), ignore_errors=True)

    def __enter__(self) -> "Replicas":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _wait_healthy(replica: Replica, deadline: float) -> bool:
    """True once /healthz answers 200; False if the port was already in use."""
    with httpx.Client(timeout=1.0) as client:
        while True:
            if replica.process.poll() is not None:
                if "address already in use" in replica.log_tail().lower():
                    return False
                raise ReplicaFailed(f"{replica.name} exited with code {replica.process.returncode}:\n"
                                    f"{replica.log_tail()}")
            try:
                if client.get(replica.url + "/healthz").status_code == 200:
                    return True
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise ReplicaFailed(f"{replica.name} did not answer /healthz on port {replica.port} "
                                    f"in time:\n{replica.log_tail()}")
            time.sleep(0.05)
