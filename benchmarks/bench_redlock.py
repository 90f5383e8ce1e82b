"""RedLock(3) under contention: 8 worker processes on one key over three local masters.

    .venv/bin/python -m benchmarks.bench_redlock              # 5 s per library, 2 rounds
    .venv/bin/python -m benchmarks.bench_redlock --seconds 2 --rounds 1 --json /tmp/redlock.json

Rows: otel-lock's RedLockManager over three masters, pottery's Redlock over
the same three, and otel-lock's LockManager on one of them (the single-Redis
reference). Each worker loops: acquire (wait 10 s), a local increment,
release. The servers are started here on free loopback ports and stopped by
pid; nothing outlives the run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from .bench_lock import analyse

ROOT = Path(__file__).resolve().parent.parent
KEY = "bench:redlock"
LIBS = {
    "otel-lock-redlock": "otel-lock RedLockManager (3 masters)",
    "pottery-redlock": "pottery Redlock (3 masters)",
    "otel-lock-single": "otel-lock LockManager (1 Redis, reference)",
}


# -- worker side ---------------------------------------------------------------


def _wait_start() -> float:
    print("ready", flush=True)
    return float(sys.stdin.readline())


async def _otel_worker(lib: str, urls: list[str], wid: int) -> tuple[list, float, float]:
    from otel_lock import LockManager, RedLockManager

    locks = RedLockManager.from_urls(urls) if lib == "otel-lock-redlock" else LockManager.from_url(urls[0])
    async with locks:
        async with locks.lock("warm-up:" + str(wid)):
            pass
        start, end = _window(_wait_start())
        while time.monotonic() < start:
            await asyncio.sleep(0.001)
        records = []
        while (requested := time.monotonic()) < end:
            async with locks.lock(KEY, wait=10.0):
                entered = time.monotonic()
                left = time.monotonic()
            records.append((wid, requested, entered, left))
    return records, start, end


def _pottery_worker(urls: list[str], wid: int) -> tuple[list, float, float]:
    import redis
    from pottery import Redlock

    masters = {redis.Redis.from_url(url) for url in urls}
    start, end = _window(_wait_start())
    while time.monotonic() < start:
        time.sleep(0.001)
    records = []
    while (requested := time.monotonic()) < end:
        held = Redlock(key=KEY, masters=masters, auto_release_time=30.0)
        if not held.acquire(timeout=10.0):
            continue
        entered = time.monotonic()
        left = time.monotonic()
        held.release()
        records.append((wid, requested, entered, left))
    return records, start, end


def _window(start: float) -> tuple[float, float]:
    spec = json.loads(sys.argv[2])
    return start, start + spec["seconds"]


def worker() -> None:
    spec = json.loads(sys.argv[2])
    if spec["lib"] == "pottery-redlock":
        records, start, end = _pottery_worker(spec["urls"], spec["wid"])
    else:
        records, start, end = asyncio.run(_otel_worker(spec["lib"], spec["urls"], spec["wid"]))
    print(json.dumps({"records": [r for r in records if r[2] <= end]}), flush=True)


# -- parent side ---------------------------------------------------------------


def run(lib: str, urls: list[str], seconds: float, workers: int) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    procs = [subprocess.Popen([sys.executable, "-m", "benchmarks.bench_redlock", "--worker",
                               json.dumps({"lib": lib, "urls": urls, "wid": wid, "seconds": seconds})],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
             for wid in range(workers)]
    try:
        for proc in procs:
            assert proc.stdout is not None and proc.stdout.readline().strip() == "ready", f"{lib} worker failed"
        start = time.monotonic() + 0.2
        for proc in procs:
            assert proc.stdin is not None
            proc.stdin.write(f"{start}\n")
            proc.stdin.flush()
        outputs = [proc.communicate(timeout=seconds + 60)[0] for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    records = [tuple(r) for out in outputs for r in json.loads(out.splitlines()[-1])["records"]]
    return {"lib": LIBS[lib], **analyse(records, seconds)}


def table(rows: list[dict]) -> str:
    lines = ["| library | acquisitions/s | handoffs/s | wait p50 ms | wait p99 ms | busiest worker | overlaps |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['lib']} | {r['acquisitions_per_s']:,.0f} | {r['handoffs_per_s']:,.0f} | "
                     f"{r['wait_p50_ms']:.2f} | {r['wait_p99_ms']:.2f} | {r['busiest_share']:.0%} | {r['overlaps']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    from otel_lock.cli._redis_server import RedisServer

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=5.0, help="measured window per library and round")
    parser.add_argument("--rounds", type=int, default=2, help="rounds per library; the best by handoffs/s is kept")
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--json", help="write every round's rows here")
    args = parser.parse_args(argv)
    servers = [RedisServer().start() for _ in range(3)]
    every: list[dict] = []
    try:
        urls = [s.url for s in servers]
        for _ in range(args.rounds):
            for lib in LIBS:
                every.append(run(lib, urls, args.seconds, args.workers))
    finally:
        for server in servers:
            server.stop()
    best = [max((r for r in every if r["lib"] == name), key=lambda r: r["handoffs_per_s"]) for name in LIBS.values()]
    print(f"{args.workers} worker processes on one key, {args.seconds} s per round, best of {args.rounds} rounds")
    print(table(best))
    if args.json:
        Path(args.json).write_text(json.dumps(every, indent=1))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker()
    else:
        main()
