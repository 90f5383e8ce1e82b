"""Start worker processes, release them at one instant, collect their JSON, and snapshot Redis around the window."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import redis

ROOT = Path(__file__).resolve().parent.parent
READY_TIMEOUT = 120.0


class WorkerFailed(RuntimeError):
    pass


def redis_stats(url: str) -> dict:
    """Commands (INFO commandstats, scripts' inner commands included) and CPU of the server."""
    client = redis.Redis.from_url(url)
    try:
        stats = client.info("commandstats")
        cpu = client.info("cpu")
    finally:
        client.close()
    calls = {k.removeprefix("cmdstat_"): v["calls"] for k, v in stats.items()}
    return {
        "calls": calls,
        "cpu": cpu["used_cpu_user"] + cpu["used_cpu_sys"],
    }


def stats_delta(before: dict, after: dict) -> dict:
    names = set(before["calls"]) | set(after["calls"])
    calls = {n: after["calls"].get(n, 0) - before["calls"].get(n, 0) for n in names}
    # our own INFO calls are not the lock's work
    calls = {n: c for n, c in calls.items() if c and not n.startswith("info")}
    return {"calls": dict(sorted(calls.items())), "total": sum(calls.values()), "cpu": after["cpu"] - before["cpu"]}


def flush(url: str) -> None:
    client = redis.Redis.from_url(url)
    try:
        client.flushall()
        client.config_resetstat()
    finally:
        client.close()


def run_workers(specs: list[dict], duration: float, url: str, settle: float = 0.3,
                env: dict | None = None) -> tuple[list[dict], dict, float]:
    """Run one process per spec for `duration` seconds; returns (results, Redis delta, measured window)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "benchmarks._worker", json.dumps(spec)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT, env=env,
        )
        for spec in specs
    ]
    # a hung worker must not hang the suite: kill everything after a generous bound
    reaper = threading.Timer(2 * READY_TIMEOUT + duration, lambda: [p.kill() for p in procs if p.poll() is None])
    reaper.daemon = True
    reaper.start()
    try:
        for proc in procs:
            _expect(proc, "ready")
        start = time.monotonic() + settle
        stop = start + duration
        line = json.dumps({"start": start, "stop": stop}) + "\n"
        for proc in procs:
            proc.stdin.write(line)
            proc.stdin.flush()
        time.sleep(max(0.0, start - time.monotonic()))
        before = redis_stats(url)
        time.sleep(max(0.0, stop - time.monotonic()))
        after = redis_stats(url)
        results = [_expect(proc, "result") for proc in procs]
        for proc in procs:
            proc.wait(30)
        return results, stats_delta(before, after), duration
    finally:
        reaper.cancel()
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def _expect(proc: subprocess.Popen, field: str) -> dict:
    # readline blocks; a dead worker gives EOF, a hung one is killed by the reaper (EOF too)
    line = proc.stdout.readline()
    if not line:
        proc.wait(5)
        raise WorkerFailed(f"worker {proc.pid} exited with {proc.returncode} before sending {field!r}")
    msg = json.loads(line)
    if field not in msg:
        raise WorkerFailed(f"worker {proc.pid} sent {msg!r}, expected {field!r}")
    return msg[field] if field == "result" else msg


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    k = min(len(values) - 1, max(0, round(q / 100 * (len(values) - 1))))
    return values[k]
