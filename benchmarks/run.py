"""Run the benchmarks, print markdown tables, write benchmarks/results/*.json and docs/benchmarks.md.

    .venv/bin/python -m benchmarks.run             # everything, ~10 minutes on 2 cores
    .venv/bin/python -m benchmarks.run --quick     # shorter windows, < 2 minutes per suite
    .venv/bin/python -m benchmarks.run --only lock --profile

Every suite starts its own redis-server on a free loopback port (never the
machine's 6379); the libraries of one table run against the same server in
the same run, one after the other.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

from otel_lock._redis_server import RedisServer

from . import _report
from ._adapters import available

RESULTS = Path(__file__).resolve().parent / "results"
DOCS = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"
LOCK_LIBS = ["otel-lock", "redis-py", "redis-py-1ms", "python-redis-lock", "pottery"]


def machine() -> dict:
    redis_version = subprocess.run(["redis-server", "--version"], capture_output=True, text=True).stdout.split()
    import os

    return {
        "nproc": os.cpu_count(),
        "python": platform.python_version(),
        "redis": next((w.split("=", 1)[1] for w in redis_version if w.startswith("v=")), "?"),
        "platform": platform.platform(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }


def lock_suite(url: str, quick: bool, profile_dir: Path | None) -> dict:
    from . import bench_lock as b

    libs = [lib for lib in LOCK_LIBS if available(lib)]
    out: dict = {"uncontended": [], "contended": [], "held": [], "herd": []}
    for lib in libs + (["otel-lock-lease"] if available("otel-lock") else []):
        _say(f"(a) uncontended: {lib}")
        out["uncontended"].append(b.uncontended(lib, url, 1.0 if quick else 3.0))
    for lib in libs:
        _say(f"(b) 8 workers, one key: {lib}")
        out["contended"].append(b.contended(lib, url, 2.0 if quick else 5.0))
    held_plan = [("otel-lock", 10_000), ("redis-py", 1_000), ("python-redis-lock", 1_000)]
    for lib, n in held_plan:
        if available(lib):
            _say(f"(c) {n} held locks: {lib}")
            out["held"].append(b.held(lib, url, n, lease=9.0, ticks=1 if quick else 2))
    for waiters in (8, 64, 512):
        for lib in libs:
            _say(f"(d) {waiters} waiters over 4 processes: {lib}")
            out["herd"].append(b.contended(lib, url, 1.0 if quick else 3.0, workers=waiters, processes=4, count=True))
    if profile_dir is not None and available("otel-lock"):
        out["profile"] = profile_lock(url, quick, profile_dir)
    return out


def profile_lock(url: str, quick: bool, profile_dir: Path) -> dict:
    """cProfile of otel-lock's worker processes, uncontended and 8-way contended; top functions by own time."""
    from . import bench_lock as b

    profile_dir.mkdir(parents=True, exist_ok=True)
    _say("profile: otel-lock uncontended")
    b.uncontended("otel-lock", url, 2.0 if quick else 4.0, profile=str(profile_dir / "uncontended.prof"))
    _say("profile: otel-lock 8 workers")
    b.contended("otel-lock", url, 2.0 if quick else 4.0, profile_dir=str(profile_dir))
    return {
        "uncontended": _report.top_functions([profile_dir / "uncontended.prof"]),
        "contended": _report.top_functions(sorted(profile_dir.glob("contend-*.prof"))),
    }


SUITES = {"lock": lock_suite}


def _say(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="short windows (each suite < 2 minutes)")
    parser.add_argument("--only", choices=sorted(SUITES), action="append", help="run only these suites")
    parser.add_argument("--profile", action="store_true", help="also cProfile otel-lock's hot paths")
    parser.add_argument("--no-docs", action="store_true", help="do not rewrite docs/benchmarks.md")
    args = parser.parse_args(argv)
    RESULTS.mkdir(exist_ok=True)
    facts = machine()
    for name in args.only or sorted(SUITES):
        started = time.monotonic()
        with RedisServer() as server:
            data = SUITES[name](server.url, args.quick,
                                RESULTS / "profiles" if args.profile else None)
        data["machine"] = {**facts, "quick": args.quick, "seconds": round(time.monotonic() - started, 1)}
        path = RESULTS / f"{name}{'-quick' if args.quick else ''}.json"
        path.write_text(json.dumps(data, indent=1, default=float) + "\n")
        markdown = _report.render(name, data)
        print(markdown)
        if not args.no_docs:
            _report.update_docs(DOCS, name, markdown)
        _say(f"{name}: {data['machine']['seconds']} s, raw numbers in {path.relative_to(RESULTS.parent.parent)}")


if __name__ == "__main__":
    main()
