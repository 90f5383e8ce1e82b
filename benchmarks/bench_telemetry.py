"""What telemetry costs, off vs the /metrics fast path vs OTLP, in one run.

(1) the uncontended otel-lock cycle of bench_lock (a), one worker process per mode (off, prom,
    prom-workers, otlp);
    targets: p50 and client CPU per cycle at most +10% (prom) and +25% (otlp) over off;
(2) the demo shop's locked endpoint (POST /api/stock/{id}/deduct) under uvicorn, one server per mode,
    at concurrency 1 and 16, each telemetry mode with and without the ASGI instrumentation, so the
    overhead splits into the lock's part and the HTTP instrumentation's; /metrics is scraped once a
    second in the prom modes;
(3) a FastAPI app with its native telemetry (FastAPI 0.165+ traces every request once an SDK is installed)
    and a @locked route, at concurrency 16: off, the lock's telemetry alone, FastAPI's and the lock's
    together, and the switches that bring the framework's part down (no operation spans, sampling);
    targets: req/s with OTLP at least 0.85x of off, with /metrics 0.95x.
Modes run in interleaved rounds; the best round (lowest p50) per mode is reported, with every round's p50.
"""

from __future__ import annotations

import asyncio
import json

from . import bench_lock
from ._harness import flush, percentile
from ._load import Server, call, drive
from ._otel_modes import ENDPOINT_MODES, FASTAPI_MODES, MODES, Receiver, base_mode, env_for

PRODUCTS = 64
CASES = [("one product, c=1", 1), ("64 products, c=16", 16)]


def _rotate(modes: tuple, r: int) -> tuple:
    r %= len(modes)
    return modes[r:] + modes[:r]


def _best(rows: list[dict], key: str) -> dict:
    return {**min(rows, key=lambda r: r[key]), "rounds": [round(r[key], 3) for r in rows]}


def lock_cycle(url: str, receiver: Receiver, rounds: int, duration: float) -> list[dict]:
    runs = []
    for r in range(rounds):
        for mode in _rotate(MODES, r):
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
        for mode in ENDPOINT_MODES:
            servers[mode] = Server("demo", url, env={"BENCH_TELEMETRY": mode, **env_for(mode, receiver.port)})
        stock = json.dumps({"stock": 10**9}).encode()
        for i in range(PRODUCTS):
            assert asyncio.run(call(servers["off"].port, "PUT", f"/api/stock/p{i}", stock)) == 200
        for r in range(rounds):
            for case, concurrency in CASES:
                for mode in _rotate(ENDPOINT_MODES, r):
                    n = iter(range(10**9))
                    path_for = ((lambda: "/api/stock/p1/deduct") if concurrency == 1
                                else (lambda: f"/api/stock/p{next(n) % PRODUCTS}/deduct"))
                    res = asyncio.run(drive(servers[mode].port, concurrency, duration, path_for=path_for,
                                            scrape="/metrics" if base_mode(mode) == "prom" else None))
                    lat = res["latencies"]
                    runs.append({"mode": mode, "case": case, "concurrency": concurrency,
                                 "rps": len(lat) / res["window"], "p50_ms": percentile(lat, 50) * 1e3,
                                 "p99_ms": percentile(lat, 99) * 1e3, "statuses": res["statuses"],
                                 "scrapes": res["scrapes"]})
    finally:
        for server in servers.values():
            server.stop()
    return [_best([x for x in runs if x["mode"] == mode and x["case"] == case], "p50_ms")
            for case, _ in CASES for mode in ENDPOINT_MODES]


def fastapi(url: str, receiver: Receiver, rounds: int, duration: float, concurrency: int = 16) -> list[dict]:
    """req/s of a @locked FastAPI route per telemetry mode (one server each), best round of each."""
    flush(url)
    servers = {}
    runs = []
    try:
        for mode in FASTAPI_MODES:
            servers[mode] = Server("fastapi-telemetry", url,
                                   env={"BENCH_TELEMETRY": mode, **env_for(mode, receiver.port)})
        for r in range(rounds):
            for mode in _rotate(FASTAPI_MODES, r):
                res = asyncio.run(drive(servers[mode].port, concurrency, duration,
                                        scrape="/metrics" if base_mode(mode) == "prom" else None))
                lat = res["latencies"]
                runs.append({"mode": mode, "concurrency": concurrency, "rps": len(lat) / res["window"],
                             "p50_ms": percentile(lat, 50) * 1e3, "statuses": res["statuses"]})
    finally:
        for server in servers.values():
            server.stop()
    best = []
    for mode in FASTAPI_MODES:
        rows = [x for x in runs if x["mode"] == mode]
        best.append({**max(rows, key=lambda x: x["rps"]), "rounds": [round(x["rps"]) for x in rows]})
    return best


def profile(url: str, profile_dir) -> dict:
    """cProfile of the lock cycle with telemetry on: which OpenTelemetry calls the cycle pays for."""
    from ._report import top_functions

    receiver = Receiver()
    out = {}
    try:
        for mode in ("prom", "otlp"):
            path = profile_dir / f"cycle-{mode}.prof"
            bench_lock.uncontended("otel-lock", url, 3.0, profile=str(path), telemetry=mode,
                                   env=env_for(mode, receiver.port))
            out[f"lock cycle, {mode} (opentelemetry inclusive)"] = top_functions([path], n=12,
                                                                                 cumulative_of="opentelemetry/")
    finally:
        receiver.close()
    return out


# (rounds, seconds per window) of the lock cycle and of the endpoint. The cycle is short and the
# machine shared: twice the rounds (best one reported), shorter windows. `short`: every mode of the
# full run in under 2 minutes, recorded like it (the full run takes about 4).
PLANS = {"full": ((8, 1.5), (4, 2.0)), "short": ((3, 1.0), (2, 1.0)), "quick": ((1, 0.7), (1, 0.7))}


def run(url: str, quick: bool, short: bool = False) -> dict:
    plan = "quick" if quick else "short" if short else "full"
    (cycle_rounds, cycle_s), (rounds, duration) = PLANS[plan]
    receiver = Receiver()
    try:
        cycle = lock_cycle(url, receiver, cycle_rounds, cycle_s)
        http = endpoint(url, receiver, rounds, duration)
        framework = fastapi(url, receiver, rounds, duration)
        received = receiver.received
    finally:
        receiver.close()
    return {"cycle": cycle, "endpoint": http, "fastapi": framework, "otlp_received": received, "plan": plan}
