"""Issue 3: what LockMiddleware costs per request, against no lock and a hand-written redis-py Lock.

Each variant is a real uvicorn process (one worker, h11, asyncio loop) on a
loopback port, driven over keep-alive connections by benchmarks._load from
this process. Distinct keys (every request its own id) at concurrency 1 (pure
latency) and 16 (throughput), then one shared key (contended) at 16.
"""

from __future__ import annotations

import asyncio
import os

from ._harness import flush, percentile, redis_stats, stats_delta
from ._load import Server, drive, ping_rtt, redis_py_ping

VARIANTS = ("bare", "locked", "redis-py")
PLAN = [  # (label, concurrency, contended)
    ("distinct keys, c=1", 1, False),
    ("distinct keys, c=16", 16, False),
    ("one key, c=16", 16, True),
]


def _cpu_seconds(pid: int) -> float:
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run(url: str, quick: bool) -> dict:
    duration = 1.5 if quick else 4.0
    port = int(url.rsplit(":", 1)[1].split("/")[0])
    rtt = ping_rtt(port)
    rtt_py = asyncio.run(redis_py_ping(url))
    out = {
        "redis_rtt_ms": {"p50": percentile(rtt, 50) * 1e3, "p99": percentile(rtt, 99) * 1e3},
        "redis_py_ping_ms": {"p50": percentile(rtt_py, 50) * 1e3, "p99": percentile(rtt_py, 99) * 1e3},
        "rows": [],
    }
    for variant in VARIANTS:
        flush(url)
        with Server(variant, url) as server:
            for label, concurrency, contended in PLAN:
                if contended and variant == "bare":
                    continue
                before, cpu0 = redis_stats(url), _cpu_seconds(server.proc.pid)
                res = asyncio.run(drive(server.port, concurrency, duration, contended))
                delta, cpu = stats_delta(before, redis_stats(url)), _cpu_seconds(server.proc.pid) - cpu0
                lat = res["latencies"]
                n = max(1, res["total"])
                out["rows"].append({
                    "variant": variant, "case": label, "concurrency": concurrency, "contended": contended,
                    "requests": len(lat), "rps": len(lat) / res["window"],
                    "p50_ms": percentile(lat, 50) * 1e3, "p99_ms": percentile(lat, 99) * 1e3,
                    "statuses": res["statuses"],
                    "redis_commands_per_request": delta["total"] / n,
                    "app_cpu_ms_per_request": cpu / n * 1e3,
                })
    return out
