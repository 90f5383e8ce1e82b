"""Issue 11: what `wait_replicas=1` (WAIT after acquire and renewal) costs, on a master and one replica.

    .venv/bin/python -m benchmarks.bench_sentinel            # ~30 s
    .venv/bin/python -m benchmarks.bench_sentinel --quick    # ~15 s

One master, one replica and three sentinels on loopback (benchmarks/_sentinel_set.py).
Four ways to reach the master, each with and without `wait_replicas=1`:
`redis://` to the master (the lean hiredis connection) and `redis+sentinel://`
(redis-py's Sentinel-managed client). Two measurements per way, in
interleaved rounds, best round shown:

- uncontended: one task, `try_lock` then `release` on one key, the time of
  `try_lock` (the acquire round trip, plus WAIT when asked) at p50 / p99;
- contended: 8 tasks in 2 managers on one key, hand-overs per second and
  wait p99 (with WAIT a hand-over is confirmed by an ACQUIRE + WAIT).

Results go to benchmarks/results/sentinel[-quick].json and are printed as a
markdown table for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path

from otel_lock import LockManager

from ._sentinel_set import SentinelSet

RESULTS = Path(__file__).resolve().parent / "results"


def _quantile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


async def _uncontended(url: str, n: int, **options) -> dict[str, float]:
    locks = LockManager.from_url(url, **options)
    times = []
    try:
        for i in range(n + 50):
            began = time.perf_counter()
            held = await locks.try_lock("bench:solo")
            took = time.perf_counter() - began
            assert held is not None
            await held.release()
            if i >= 50:  # warm-up: connections, script load
                times.append(took)
    finally:
        await locks.aclose()
    return {"acquire_p50_us": _quantile(times, 0.5) * 1e6, "acquire_p99_us": _quantile(times, 0.99) * 1e6,
            "acquire_mean_us": statistics.fmean(times) * 1e6}


async def _contended(url: str, seconds: float, **options) -> dict[str, float]:
    managers = [LockManager.from_url(url, **options) for _ in range(2)]
    waits: list[float] = []
    count = 0
    stop = time.monotonic() + seconds

    async def worker(locks: LockManager) -> None:
        nonlocal count
        while time.monotonic() < stop:
            began = time.perf_counter()
            async with locks.lock("bench:hot", wait=10):
                waits.append(time.perf_counter() - began)
                count += 1

    try:
        began = time.perf_counter()
        await asyncio.gather(*(worker(m) for m in managers for _ in range(4)))
        elapsed = time.perf_counter() - began
    finally:
        for locks in managers:
            await locks.aclose()
    return {"handoffs_per_s": count / elapsed, "wait_p99_ms": _quantile(waits, 0.99) * 1e3}


async def main(quick: bool) -> dict:
    rounds, n, seconds = (1, 500, 1.5) if quick else (3, 1000, 2.0)
    results: dict[str, dict[str, float]] = {}
    async with SentinelSet(proxy=False) as servers:
        ways = {
            "redis:// (lean)": f"redis://127.0.0.1:{servers.master.port}/0",
            "redis+sentinel:// (redis-py)": servers.url,
        }
        for _ in range(rounds):
            for way, url in ways.items():
                for wait in (0, 1):
                    name = f"{way}, wait_replicas={wait}"
                    options = {"wait_replicas": wait, "wait_replicas_timeout": 0.5}
                    row = {**await _uncontended(url, n, **options), **await _contended(url, seconds, **options)}
                    best = results.get(name)
                    if best is None or row["handoffs_per_s"] > best["handoffs_per_s"]:
                        results[name] = row
    return {"quick": quick, "rounds": rounds, "uncontended_acquires": n, "contended_seconds": seconds,
            "results": results}


def table(report: dict) -> str:
    lines = ["| way | acquire p50 | acquire p99 | hand-overs/s (8 tasks) | wait p99 |",
             "|---|---:|---:|---:|---:|"]
    for name, row in report["results"].items():
        lines.append(f"| {name} | {row['acquire_p50_us']:.0f} us | {row['acquire_p99_us']:.0f} us | "
                     f"{row['handoffs_per_s']:,.0f} | {row['wait_p99_ms']:.1f} ms |")
    return "\n".join(lines)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    report = asyncio.run(main(args.quick))
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"sentinel{'-quick' if args.quick else ''}.json").write_text(json.dumps(report, indent=2) + "\n")
    print(table(report))
