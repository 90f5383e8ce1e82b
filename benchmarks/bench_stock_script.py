"""A seckill under the product's lock vs one atomic Lua script, on 2 demo replicas.

    .venv/bin/python -m benchmarks.bench_stock_script           # ~1.5 minutes
    .venv/bin/python -m benchmarks.bench_stock_script --quick   # ~30 s, one round
    .venv/bin/python -m benchmarks.bench_stock_script --no-docs # do not rewrite docs/benchmarks.md

Two `otel-lock serve` replicas (uvicorn, one worker each) share a
redis-server started on a free loopback port. Buyers are keep-alive
connections (benchmarks._load), half on each replica, each sending its next
`POST /api/stock/{id}/deduct` (locked read-modify-write) or
`.../deduct-atomic` (one script) when the last answer arrived, all on one
product whose stock never runs out: the contended case a flash sale is.
Ways run in interleaved rounds; the best round (highest req/s) is shown.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from collections import Counter
from pathlib import Path

import httpx

from otel_lock.cli._redis_server import RedisServer
from otel_lock.cli._replicas import Replicas

from ._harness import percentile, redis_stats, stats_delta
from ._load import drive
from ._report import update_docs
from .run import machine

RESULTS = Path(__file__).resolve().parent / "results"
DOCS = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"
WAYS = (("lock", "deduct"), ("script", "deduct-atomic"))
CONCURRENCY = (16, 64)
STOCK = 1_000_000_000  # never sold out within a run: every answer is a sale


def _measure(ports: list[int], url: str, way: str, endpoint: str, product: str, concurrency: int,
             duration: float) -> dict:
    path = f"/api/stock/{product}/{endpoint}"
    before = redis_stats(url)

    async def both() -> list[dict]:
        share = concurrency // len(ports)
        return await asyncio.gather(*(drive(port, share, duration, path_for=lambda: path) for port in ports))

    results = asyncio.run(both())
    delta = stats_delta(before, redis_stats(url))
    latencies = [x for r in results for x in r["latencies"]]
    statuses = Counter()
    for r in results:
        statuses.update(r["statuses"])
    total = max(1, sum(r["total"] for r in results))
    return {
        "way": way, "endpoint": endpoint, "concurrency": concurrency, "requests": len(latencies),
        "rps": len(latencies) / duration, "p50_ms": percentile(latencies, 50) * 1e3,
        "p99_ms": percentile(latencies, 99) * 1e3, "statuses": dict(statuses),
        "redis_commands_per_request": delta["total"] / total,
    }


def run(url: str, quick: bool) -> dict:
    duration, rounds = (3.0, 1) if quick else (5.0, 2)
    runs = []
    with Replicas(url, count=2, namespace="bench-stock", job_interval=0) as replicas:
        ports = [r.port for r in replicas.replicas]
        with httpx.Client() as client:
            for way, _ in WAYS:
                client.put(f"{replicas.urls[0]}/api/stock/{way}", json={"stock": STOCK}).raise_for_status()
        for r in range(rounds):
            for concurrency in CONCURRENCY:
                for way, endpoint in (WAYS if r % 2 == 0 else WAYS[::-1]):
                    _say(f"round {r + 1}: {way} ({endpoint}), {concurrency} buyers")
                    runs.append(_measure(ports, url, way, endpoint, way, concurrency, duration))
    rows = []
    for concurrency in CONCURRENCY:
        for way, _ in WAYS:
            mine = [x for x in runs if x["way"] == way and x["concurrency"] == concurrency]
            best = max(mine, key=lambda x: x["rps"])
            rows.append({**best, "rounds_rps": [round(x["rps"]) for x in mine]})
    return {"rows": rows, "runs": runs, "duration_s": duration, "rounds": rounds}


def render(data: dict) -> str:
    m = data["machine"]
    lines = [
        f"Run {m['date']}: {m['nproc']} CPUs, Python {m['python']}, Redis {m['redis']}, {m['platform']}; "
        f"took {m['seconds']} s ({data['rounds']} round(s) of {data['duration_s']:g} s per case); "
        f"1-minute load average {m['loadavg_at_start']} at start, {m['loadavg_at_end']} at end "
        "(other work shares these CPUs).",
        "",
        "| buyers | way | req/s | p50 ms | p99 ms | Redis cmds/req | statuses | req/s of each round |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in data["rows"]:
        way = "lock (`@locked`, read-modify-write)" if row["way"] == "lock" else "atomic script (one `EVALSHA`)"
        statuses = ", ".join(f"{k}: {v}" for k, v in sorted(row["statuses"].items()))
        rounds = " / ".join(f"{x:,}" for x in row["rounds_rps"])
        lines.append(f"| {row['concurrency']} | {way} | {row['rps']:,.0f} | {row['p50_ms']:.2f} | "
                     f"{row['p99_ms']:.2f} | {row['redis_commands_per_request']:.1f} | {statuses} | {rounds} |")
    by = {(r["way"], r["concurrency"]): r for r in data["rows"]}
    ratios = [f"{c} buyers: {by[('script', c)]['rps'] / by[('lock', c)]['rps']:.1f}x the requests/s"
              for c in CONCURRENCY if ("script", c) in by and ("lock", c) in by]
    lines += ["", "Script vs lock: " + "; ".join(ratios) + "."]
    return "\n".join(lines) + "\n"


def _say(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_stock_script",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one short round (~30 s)")
    parser.add_argument("--no-docs", action="store_true", help="do not rewrite docs/benchmarks.md")
    args = parser.parse_args(argv)
    facts, started = machine(), time.monotonic()
    with RedisServer() as server:
        data = run(server.url, args.quick)

    data["machine"] = {**facts, "quick": args.quick, "seconds": round(time.monotonic() - started, 1),
                       "loadavg_at_end": round(os.getloadavg()[0], 2)}
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"stock-script{'-quick' if args.quick else ''}.json"
    path.write_text(json.dumps(data, indent=1) + "\n")
    markdown = render(data)
    print(markdown)
    if not args.no_docs:
        update_docs(DOCS, "stock-script", markdown)


if __name__ == "__main__":
    main()
