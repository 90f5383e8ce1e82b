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


def _urls(servers: str | list[str]) -> list[str]:
    return [servers] if isinstance(servers, str) else list(servers)


def redis_stats(servers: str | list[str]) -> dict:
    """Commands (INFO commandstats, scripts' inner commands included) and CPU, summed over the servers."""
    calls: dict = {}
    cpu = 0.0
    for url in _urls(servers):
        client = redis.Redis.from_url(url)
        try:
            stats = client.info("commandstats")
            used = client.info("cpu")
        finally:
            client.close()
        for k, v in stats.items():
            name = k.removeprefix("cmdstat_")
            calls[name] = calls.get(name, 0) + v["calls"]
        cpu += used["used_cpu_user"] + used["used_cpu_sys"]
    return {"calls": calls, "cpu": cpu}


def stats_delta(before: dict, after: dict) -> dict:
    names = set(before["calls"]) | set(after["calls"])
    calls = {n: after["calls"].get(n, 0) - before["calls"].get(n, 0) for n in names}
    # our own INFO calls are not the lock's work
    calls = {n: c for n, c in calls.items() if c and not n.startswith("info")}
    return {"calls": dict(sorted(calls.items())), "total": sum(calls.values()), "cpu": after["cpu"] - before["cpu"]}


def flush(servers: str | list[str]) -> None:
    """Empty every server (each master of a deployment) and reset its counters."""
    for url in _urls(servers):
        client = redis.Redis.from_url(url)
        try:
            client.flushall()
            client.config_resetstat()
        finally:
            client.close()


def run_workers(specs: list[dict], duration: float, url: str | list[str], settle: float = 0.3,
                env: dict | None = None) -> tuple[list[dict], dict, float]:
    """Run one process per spec for `duration` seconds; returns (results, Redis delta, measured window).

    `url`: the server(s) whose INFO counters are read around the window (every master of a deployment).
    """
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
            proc.stdin.close()
            proc.stdout.close()


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


def rotate(items: list, n: int) -> list:
    """`items` started at position n: rounds interleave libraries without always starting with the same one."""
    n %= len(items)
    return items[n:] + items[:n]


def best_rounds(rows: list[dict], key: str, higher: bool, group=lambda r: r["lib"]) -> list[dict]:
    """Per group, the row of its best round by `key`, with every round's value (first-seen order)."""
    groups: dict = {}
    for row in rows:
        groups.setdefault(group(row), []).append(row)
    out = []
    for members in groups.values():
        best = (max if higher else min)(members, key=lambda r: r[key])
        out.append({**best, "rounds": [round(r[key], 3) for r in members]})
    return out


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    k = min(len(values) - 1, max(0, round(q / 100 * (len(values) - 1))))
    return values[k]
