"""Telemetry overhead of otel-lock, in one run (issue 4).

    .venv/bin/python -m benchmarks.telemetry_overhead [--cycles 3000] [--requests 600] [--rounds 3]

Three modes, each in a fresh process (OpenTelemetry providers are set once
per process), against one throwaway redis-server:

- off:    no SDK; the API's no-op tracer and meter
- memory: SDK tracer (in-memory span exporter) and meter (in-memory reader)
- export: `otel_lock.telemetry.setup()` with OTLP (traces and metrics, to a
          local sink that answers 200) and the Prometheus reader

Two workloads per mode: an uncontended lock cycle (`async with
locks.lock(key)`) and the locked demo endpoint (POST /api/stock/{id}/deduct
through the ASGI stack, HTTP instrumentation included when telemetry is on).
Rounds interleave the modes so drift hits all of them; the median round is
reported. Times are per operation on this machine; compare the ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

MODES = ("off", "memory", "export")


# -- one worker process --------------------------------------------------------


def _providers(mode: str, sink: str):
    """(tracer_provider, meter_provider, instrument) for a mode; None = the global ones."""
    if mode == "off":
        return None, None, None
    if mode == "memory":
        from opentelemetry.sdk.metrics import MeterProvider
        from opentelemetry.sdk.metrics.export import InMemoryMetricReader
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import SimpleSpanProcessor
        from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

        tracer_provider = TracerProvider()
        tracer_provider.add_span_processor(SimpleSpanProcessor(InMemorySpanExporter()))
        meter_provider = MeterProvider(metric_readers=[InMemoryMetricReader()])
        return tracer_provider, meter_provider, None
    from otel_lock import telemetry

    os.environ["OTEL_EXPORTER_OTLP_ENDPOINT"] = sink
    os.environ.setdefault("OTEL_METRIC_EXPORT_INTERVAL", "1000")
    installed = telemetry.setup("bench", otlp=True, prometheus=True)
    return installed.tracer_provider, installed.meter_provider, installed.instrument_app


async def _lock_cycles(url: str, mode: str, cycles: int, providers) -> list[float]:
    from otel_lock import LockManager

    tracer_provider, meter_provider, _ = providers
    locks = LockManager.from_url(url, namespace=f"bench-telemetry-{mode}", tracer_provider=tracer_provider,
                                 meter_provider=meter_provider)
    durations = []
    try:
        for n in range(cycles + cycles // 10):
            start = time.perf_counter()
            async with locks.lock("bench:cycle", name="bench"):
                pass
            if n >= cycles // 10:  # the first tenth warms up connections and scripts
                durations.append(time.perf_counter() - start)
    finally:
        await locks.aclose()
    return durations


async def _endpoint(url: str, mode: str, requests: int, providers) -> list[float]:
    import httpx

    from otel_lock import LockManager
    from otel_lock.demo import DemoSettings, create_app

    tracer_provider, meter_provider, instrument = providers
    namespace = f"bench-endpoint-{mode}"
    locks = LockManager.from_url(url, namespace=namespace, tracer_provider=tracer_provider,
                                 meter_provider=meter_provider)
    app = create_app(DemoSettings(redis_url=url, namespace=namespace, replica_name="bench", job_interval=0),
                     locks)
    if instrument is not None:
        app = instrument(app)
    elif tracer_provider is not None:
        from opentelemetry.instrumentation.asgi import OpenTelemetryMiddleware

        app = OpenTelemetryMiddleware(app, tracer_provider=tracer_provider, meter_provider=meter_provider)
    durations = []
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://bench") as client:
        await client.put("/api/stock/1", json={"stock": 10 * requests})
        for n in range(requests + requests // 10):
            start = time.perf_counter()
            response = await client.post("/api/stock/1/deduct", json={"quantity": 1})
            if n >= requests // 10:
                durations.append(time.perf_counter() - start)
            if response.status_code != 200:
                raise RuntimeError(f"deduct answered {response.status_code}: {response.text}")
    await locks.aclose()
    return durations


def _worker(args) -> None:
    providers = _providers(args.mode, args.sink)
    cycles = asyncio.run(_lock_cycles(args.url, args.mode, args.cycles, providers))
    requests = asyncio.run(_endpoint(args.url, args.mode, args.requests, providers))
    print(json.dumps({"mode": args.mode, "cycle": _summary(cycles), "endpoint": _summary(requests)}))


def _summary(durations: list[float]) -> dict:
    ordered = sorted(durations)
    return {"median_us": statistics.median(ordered) * 1e6,
            "p99_us": ordered[int(len(ordered) * 0.99) - 1] * 1e6,
            "per_s": len(ordered) / sum(ordered)}


# -- the parent: redis, sink, rounds, table ---------------------------------------


class _Sink:
    """Answers every OTLP POST with 200 and drops it: export cost without a collector."""

    def __enter__(self) -> str:
        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cycles", type=int, default=3000)
    parser.add_argument("--requests", type=int, default=600)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--url", help=argparse.SUPPRESS)
    parser.add_argument("--sink", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        _worker(args)
        return 0
    if min(args.cycles, args.requests, args.rounds) < 1:
        parser.error("--cycles, --requests and --rounds must be at least 1")

    from otel_lock._redis_server import RedisServer

    results: dict[str, list[dict]] = {mode: [] for mode in MODES}
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    with RedisServer() as redis, _Sink() as sink:
        for _ in range(args.rounds):
            for mode in MODES:
                out = subprocess.run(
                    [sys.executable, "-m", "benchmarks.telemetry_overhead", "--worker", "--mode", mode,
                     "--url", redis.url, "--sink", sink, "--cycles", str(args.cycles),
                     "--requests", str(args.requests)],
                    capture_output=True, text=True, env=env, timeout=600)
                if out.returncode != 0:
                    print(f"the {mode} worker failed:\n{out.stderr[-3000:]}", file=sys.stderr)
                    return 1
                results[mode].append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(_table(results))
    return 0


def _table(results: dict[str, list[dict]]) -> str:
    def median(mode: str, workload: str, field: str) -> float:
        return statistics.median(run[workload][field] for run in results[mode])

    lines = ["| workload | telemetry | median | p99 | ops/s | overhead (median) |", "|---|---|---|---|---|---|"]
    for workload, label in (("cycle", "uncontended lock cycle"), ("endpoint", "locked demo endpoint")):
        base = median("off", workload, "median_us")
        for mode in MODES:
            value = median(mode, workload, "median_us")
            lines.append(f"| {label} | {mode} | {value:.0f} µs | {median(mode, workload, 'p99_us'):.0f} µs | "
                         f"{median(mode, workload, 'per_s'):.0f} | {100 * (value / base - 1):+.1f} % |")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
