"""Issue 4: what telemetry costs, off vs SDK with in-memory exporters vs OTLP + Prometheus, in one run.

(1) the uncontended otel-lock cycle of bench_lock (a), one worker process per mode;
(2) the demo shop's locked endpoint (POST /api/stock/{id}/deduct) under uvicorn, one server per mode,
    at concurrency 1 and 16, with /metrics scraped once a second in the otlp-prom mode.
Modes run in interleaved rounds; the best round (lowest p50) per mode is reported, with every round's p50.
"""

from __future__ import annotations

import asyncio
import json

from . import bench_lock
from ._harness import flush, percentile
from ._load import Server, call, drive
from ._otel_modes import MODES, Receiver, env_for

PRODUCTS = 64
CASES = [("one product, c=1", 1), ("64 products, c=16", 16)]


def _best(rows: list[dict], key: str) -> dict:
    return {**min(rows, key=lambda r: r[key]), "rounds": [round(r[key], 3) for r in rows]}


def lock_cycle(url: str, receiver: Receiver, rounds: int, duration: float) -> list[dict]:
    runs = []
    for r in range(rounds):
        for mode in MODES[r % 3:] + MODES[:r % 3]:
            row = bench_lock.uncontended("otel-lock", url, duration, telemetry=mode,
                                         env=env_for(mode, receiver.port))
            row.pop("redis_calls", None)
            runs.append({**row, "mode": mode})
    return [_best([x for x in runs if x["mode"] == mode], "p50_ms") for mode in MODES]


def endpoint(url: str, receiver: Receiver, rounds: int, duration: float) -> list[dict]:
    flush(url)
    servers = {}
    runs = []
    try:
        for mode in MODES:
            servers[mode] = Server("demo", url, env={"BENCH_TELEMETRY": mode, **env_for(mode, receiver.port)})
        stock = json.dumps({"stock": 10**9}).encode()
        for i in range(PRODUCTS):
            assert asyncio.run(call(servers["off"].port, "PUT", f"/api/stock/p{i}", stock)) == 200
        for r in range(rounds):
            for case, concurrency in CASES:
                for mode in MODES[r % 3:] + MODES[:r % 3]:
                    n = iter(range(10**9))
                    path_for = ((lambda: "/api/stock/p1/deduct") if concurrency == 1
                                else (lambda: f"/api/stock/p{next(n) % PRODUCTS}/deduct"))
                    res = asyncio.run(drive(servers[mode].port, concurrency, duration, path_for=path_for,
                                            scrape="/metrics" if mode == "otlp-prom" else None))
                    lat = res["latencies"]
                    runs.append({"mode": mode, "case": case, "concurrency": concurrency,
                                 "rps": len(lat) / res["window"], "p50_ms": percentile(lat, 50) * 1e3,
                                 "p99_ms": percentile(lat, 99) * 1e3, "statuses": res["statuses"],
                                 "scrapes": res["scrapes"]})
    finally:
        for server in servers.values():
            server.stop()
    return [_best([x for x in runs if x["mode"] == mode and x["case"] == case], "p50_ms")
            for case, _ in CASES for mode in MODES]


def profile(url: str, profile_dir) -> dict:
    """cProfile of the lock cycle with telemetry on: which OpenTelemetry calls the cycle pays for."""
    from ._report import top_functions

    receiver = Receiver()
    out = {}
    try:
        for mode in ("sdk-memory", "otlp-prom"):
            path = profile_dir / f"cycle-{mode}.prof"
            bench_lock.uncontended("otel-lock", url, 3.0, profile=str(path), telemetry=mode,
                                   env=env_for(mode, receiver.port))
            out[f"lock cycle, {mode} (opentelemetry inclusive)"] = top_functions([path], n=12,
                                                                                 cumulative_of="opentelemetry/")
    finally:
        receiver.close()
    return out


def run(url: str, quick: bool) -> dict:
    rounds, duration = (1, 0.7) if quick else (4, 2.0)
    receiver = Receiver()
    try:
        cycle = lock_cycle(url, receiver, rounds, duration)
        http = endpoint(url, receiver, rounds, duration)
        received = receiver.received
    finally:
        receiver.close()
    return {"cycle": cycle, "endpoint": http, "otlp_received": received}
