"""What LockMiddleware costs per request, against no lock and a hand-written redis-py Lock.

Each variant is a real uvicorn process (one worker, h11, asyncio loop) on a
loopback port, driven over keep-alive connections by benchmarks._load from
this process. Distinct keys (every request its own id) at concurrency 1 (pure
latency), 16 and 64 (throughput), then one shared key (contended) at 16; as a
Starlette app and as a FastAPI app (typed path parameter), each against the
same app taking redis-py's Lock by hand. The
best round (lowest p50) per variant and case is reported, with every round's p50.
"""

from __future__ import annotations

import asyncio
import os

from ._harness import flush, percentile, redis_stats, stats_delta
from ._load import Server, drive, ping_rtt, redis_py_ping

VARIANTS = ("bare", "two-pings", "locked", "redis-py", "locked-via-redis-py", "fastapi-locked", "fastapi-redis-py",
            "fastapi-otel-lock-by-hand")
PLAN = [  # (case, concurrency, contended)
    ("distinct keys, c=1", 1, False),
    ("distinct keys, c=16", 16, False),
    ("distinct keys, c=64", 64, False),
    ("one key, c=16", 16, True),
]
# Cases a variant is not measured in: the bare ones have no lock to contend for; the diagnostic rows
# and the pings are shown at c=1 and c=16 only.
SKIP = {("bare", "one key, c=16"), ("two-pings", "one key, c=16"), ("two-pings", "distinct keys, c=64"),
        ("locked-via-redis-py", "distinct keys, c=64"), ("fastapi-otel-lock-by-hand", "distinct keys, c=64"),
        ("fastapi-otel-lock-by-hand", "one key, c=16")}


def _cpu_seconds(pid: int) -> float:
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _measure(server: Server, url: str, variant: str, case: str, concurrency: int, contended: bool,
             duration: float) -> dict:
    before, cpu0 = redis_stats(url), _cpu_seconds(server.proc.pid)
    res = asyncio.run(drive(server.port, concurrency, duration, contended))
    delta, cpu = stats_delta(before, redis_stats(url)), _cpu_seconds(server.proc.pid) - cpu0
    lat, n = res["latencies"], max(1, res["total"])
    return {
        "variant": variant, "case": case, "concurrency": concurrency, "contended": contended,
        "requests": len(lat), "rps": len(lat) / res["window"],
        "p50_ms": percentile(lat, 50) * 1e3, "p99_ms": percentile(lat, 99) * 1e3,
        "statuses": res["statuses"],
        "redis_commands_per_request": delta["total"] / n,
        "app_cpu_ms_per_request": cpu / n * 1e3,
    }


def run(url: str, quick: bool) -> dict:
    """All servers up at once (idle ones cost nothing), then rounds with the variants interleaved."""
    duration, rounds = (0.7, 1) if quick else (2.5, 3)
    port = int(url.rsplit(":", 1)[1].split("/")[0])
    rtt = ping_rtt(port)
    rtt_py = asyncio.run(redis_py_ping(url))
    flush(url)
    servers = {}
    try:
        for variant in VARIANTS:
            servers[variant] = Server(variant, url)
        runs = []
        for r in range(rounds):
            for case, concurrency, contended in PLAN:
                order = VARIANTS[r % len(VARIANTS):] + VARIANTS[:r % len(VARIANTS)]
                for variant in order:
                    if (variant, case) in SKIP:
                        continue
                    runs.append(_measure(servers[variant], url, variant, case, concurrency, contended, duration))
    finally:
        for server in servers.values():
            server.stop()
    rows = []
    for variant in VARIANTS:
        for case, _c, _k in PLAN:
            mine = [r for r in runs if r["variant"] == variant and r["case"] == case]
            if mine:
                rows.append({**min(mine, key=lambda r: r["p50_ms"]),
                             "rounds_p50_ms": [round(r["p50_ms"], 3) for r in mine],
                             "rounds_rps": [round(r["rps"]) for r in mine]})
    return {
        "redis_rtt_ms": {"p50": percentile(rtt, 50) * 1e3, "p99": percentile(rtt, 99) * 1e3},
        "redis_py_ping_ms": {"p50": percentile(rtt_py, 50) * 1e3, "p99": percentile(rtt_py, 99) * 1e3},
        "rows": rows,
        "runs": runs,
    }
