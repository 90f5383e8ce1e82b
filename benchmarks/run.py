"""Run the benchmarks, print markdown tables, write benchmarks/results/*.json and docs/benchmarks.md.

    .venv/bin/python -m benchmarks.run             # everything, ~13 minutes on 2 cores
    .venv/bin/python -m benchmarks.run --quick     # shorter windows, < 2 minutes per suite; no verdicts,
                                                   # results in a temporary directory (no tracked file changes)
    .venv/bin/python -m benchmarks.run --only lock --profile
    .venv/bin/python -m benchmarks.run --only deployments    # single, Sentinel, Cluster, RedLock(3)
    .venv/bin/python -m benchmarks.run --only shapes         # shared, lock_all, permits, deadlock check
    .venv/bin/python -m benchmarks.run --only telemetry --short   # every mode, fewer rounds: < 2 minutes

Every suite starts its own redis-server on a free loopback port (never the
machine's 6379); the libraries of one table run against the same server in
the same run, one after the other.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from otel_lock.cli._redis_server import RedisServer

from . import _report
from ._adapters import RINGS, available
from ._harness import best_rounds
from ._harness import rotate as _rotate

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
DOCS = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"
LOCK_LIBS = ["otel-lock", "redis-py", "redis-py-1ms", "python-redis-lock", "pottery"]


def commit() -> str:
    """The checkout's commit, "-dirty" when tracked files differ from it ("?" outside git)."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], capture_output=True, text=True, cwd=ROOT).stdout.strip()

    head = git("rev-parse", "--short", "HEAD")
    return (head + ("-dirty" if git("status", "--porcelain", "--untracked-files=no") else "")) if head else "?"


def machine() -> dict:
    redis_version = subprocess.run(["redis-server", "--version"], capture_output=True, text=True).stdout.split()

    return {
        "nproc": os.cpu_count(),
        "python": platform.python_version(),
        "redis": next((w.split("=", 1)[1] for w in redis_version if w.startswith("v=")), "?"),
        "platform": platform.platform(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "commit": commit(),
        # the machine is shared: say how busy it was
        "loadavg_at_start": round(os.getloadavg()[0], 2),
    }


def lock_suite(url: str, quick: bool, profile_dir: Path | None) -> dict:
    from . import bench_lock as b

    libs = [lib for lib in LOCK_LIBS if available(lib)]
    out: dict = {"uncontended": [], "contended": [], "ring": [], "held": [], "many": [], "herd": [], "held_bytes": [],
                 "failures": []}

    def attempt(table: str, what: str, fn, *args, **kwargs) -> None:
        # one library failing must not cost the other rows of the run
        _say(what)
        try:
            out[table].append(fn(*args, **kwargs))
        except Exception as exc:  # noqa: BLE001 - reported in the tables
            _say(f"FAILED: {what}: {exc!r}")
            out["failures"].append({"what": what, "error": repr(exc)})

    # (a) and (b) are short and sensitive to whatever else the machine runs: several
    # rounds with the libraries interleaved; the best round per library is reported
    # (others' load only ever slows a round down), every round is listed
    rounds = 1 if quick else 3
    a_libs = libs + (["otel-lock-lease"] if available("otel-lock") else [])
    runs: dict = {"uncontended": [], "contended": []}
    for r in range(rounds):
        for lib in _rotate(a_libs, r):
            attempt("uncontended", f"(a) uncontended, round {r + 1}: {lib}", b.uncontended, lib, url,
                    0.6 if quick else 1.5)
        for lib in _rotate(libs, r):
            attempt("contended", f"(b) 8 workers in 8 processes, one key, round {r + 1}: {lib}", b.contended,
                    lib, url, 1.0 if quick else 2.0)
        for via in RINGS:
            # the machine's limit in the same run: a token passed around the same 8 processes
            attempt("ring", f"(b) a token around 8 processes by {via}, round {r + 1}", b.ring, url,
                    1.0 if quick else 2.0, via)
        for lib in _rotate(libs, r):
            # 8 tasks (threads for sync peers) in one process
            attempt("contended", f"(b) 8 workers in 1 process, one key, round {r + 1}: {lib}", b.contended,
                    lib, url, 1.0 if quick else 2.0, processes=1)
    runs["uncontended"], out["uncontended"] = out["uncontended"], best_rounds(out["uncontended"], "cycles_per_s", True)
    runs["contended"], out["contended"] = out["contended"], best_rounds(
        out["contended"], "handoffs_per_s", True, group=lambda r: (r["lib"], r["processes"]))
    runs["ring"], out["ring"] = out["ring"], best_rounds(out["ring"], "handoffs_per_s", True)
    out["rounds"] = runs
    _say("one held lock's keys and bytes in Redis")
    try:
        out["held_bytes"] = b.held_bytes(url)
    except Exception as exc:  # noqa: BLE001 - reported in the tables
        out["failures"].append({"what": "held bytes", "error": repr(exc)})
    counts = [500, 4000] if quick else [500, 2000, 8000, 16000]
    for lib in ("otel-lock", "redis-py"):
        _say(f"(c') {counts} locks held by one task: {lib}")
        try:
            out["many"] += b.many(lib, url, counts)
        except Exception as exc:  # noqa: BLE001 - reported in the tables
            out["failures"].append({"what": f"many: {lib}", "error": repr(exc)})
    held_plan = [("otel-lock", 10_000), ("redis-py", 1_000), ("python-redis-lock", 1_000)]
    for lib, n in held_plan:
        if available(lib):
            # quick: lease 3 s (a 1 s tick); full: lease 9 s, two ticks
            attempt("held", f"(c) {n} held locks: {lib}", b.held, lib, url, n, lease=3.0 if quick else 9.0,
                    ticks=1 if quick else 2)
    for r in range(1 if quick else 2):
        for waiters in (8, 64, 512):
            for lib in _rotate(libs, r):
                attempt("herd", f"(d) {waiters} waiters over 4 processes, round {r + 1}: {lib}", b.contended, lib,
                        url, 0.7 if quick else 2.0, workers=waiters, processes=4, count=True)
    runs["herd"], out["herd"] = out["herd"], best_rounds(
        out["herd"], "handoffs_per_s", True, group=lambda r: (r["lib"], r["workers"]))
    if profile_dir is not None and available("otel-lock"):
        try:
            out["profile"] = profile_lock(url, quick, profile_dir)
        except Exception as exc:  # noqa: BLE001 - the measurements above still count
            _say(f"FAILED: profile: {exc!r}")
            out["failures"].append({"what": "profile", "error": repr(exc)})
    return out


def profile_lock(url: str, quick: bool, profile_dir: Path) -> dict:
    """cProfile of otel-lock's worker processes, uncontended and 8-way contended; top functions by own time."""
    from . import bench_lock as b

    profile_dir.mkdir(parents=True, exist_ok=True)
    _say("profile: otel-lock uncontended")
    b.uncontended("otel-lock", url, 2.0 if quick else 4.0, profile=str(profile_dir / "uncontended.prof"))
    _say("profile: otel-lock 8 workers in 8 processes")
    for old in profile_dir.glob("contend-*.prof"):
        old.unlink()
    b.contended("otel-lock", url, 2.0 if quick else 4.0, profile_dir=str(profile_dir))
    eight = sorted(profile_dir.glob("contend-*.prof"))
    _say("profile: otel-lock 8 tasks in 1 process")
    single = profile_dir / "single"
    single.mkdir(exist_ok=True)
    b.contended("otel-lock", url, 2.0 if quick else 4.0, processes=1, profile_dir=str(single))
    cases = {
        "uncontended": [profile_dir / "uncontended.prof"],
        "contended, 8 processes (merged)": eight,
        "contended, 8 tasks in 1 process": sorted(single.glob("contend-*.prof")),
    }
    out = {}
    for case, paths in cases.items():
        out[case] = _report.top_functions(paths)
        out[f"{case} (otel_lock inclusive)"] = _report.top_functions(paths, n=10, cumulative_of="otel_lock/")
    return out


def middleware_suite(url: str, quick: bool, profile_dir: Path | None) -> dict:
    from . import bench_middleware

    if not available("otel-lock"):
        return {"rows": [], "skipped": "otel_lock not importable"}
    _say("middleware: bare / @locked / redis-py by hand, interleaved rounds")
    return bench_middleware.run(url, quick)


def telemetry_suite(url: str, quick: bool, profile_dir: Path | None, short: bool = False) -> dict:
    from . import bench_telemetry

    if not available("otel-lock"):
        return {"cycle": [], "endpoint": [], "skipped": "otel_lock not importable"}
    _say("telemetry: off / prom (fast path) / prom-workers / otlp, lock cycle then the demo endpoint")
    data = bench_telemetry.run(url, quick, short)
    if profile_dir is not None:
        _say("profile: lock cycle per telemetry mode")
        try:
            data["profile"] = bench_telemetry.profile(url, profile_dir)
        except Exception as exc:  # noqa: BLE001 - the measurements above still count
            _say(f"FAILED: profile: {exc!r}")
    return data


def deployments_suite(url: str, quick: bool, profile_dir: Path | None) -> dict:
    from . import bench_deployments

    if not available("otel-lock"):
        return {"rows": [], "skipped": "otel_lock not importable"}
    # `url` is the single Redis; Sentinel, Cluster and the RedLock masters are started in there
    return bench_deployments.run(url, "quick" if quick else "full")


def shapes_suite(url: str, quick: bool, profile_dir: Path | None) -> dict:
    from . import bench_shapes

    if not available("otel-lock"):
        return {"uncontended": [], "contended": [], "skipped": "otel_lock not importable"}
    # shared, lock_all, permits and the deadlock check beside the exclusive lock, one run
    return bench_shapes.run(url, quick, say=_say)


SUITES = {"lock": lock_suite, "middleware": middleware_suite, "telemetry": telemetry_suite,
          "deployments": deployments_suite, "shapes": shapes_suite}


def _say(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="short windows (each suite < 2 minutes)")
    parser.add_argument("--only", choices=sorted(SUITES), action="append", help="run only these suites")
    parser.add_argument("--profile", action="store_true", help="also cProfile otel-lock's hot paths")
    parser.add_argument("--no-docs", action="store_true", help="do not rewrite docs/benchmarks.md")
    parser.add_argument("--short", action="store_true",
                        help="with --only telemetry: fewer, shorter rounds (< 2 minutes), recorded like a full run")
    args = parser.parse_args(argv)
    if args.short and (args.quick or args.only != ["telemetry"]):
        parser.error("--short is for --only telemetry, without --quick")
    # A quick run's numbers are for a look, not a record: never rewrite tracked files.
    results = Path(tempfile.mkdtemp(prefix="otel-lock-bench-")) if args.quick else RESULTS
    write_docs = not (args.no_docs or args.quick)
    results.mkdir(exist_ok=True)
    for name in args.only or sorted(SUITES):
        facts = machine()
        started = time.monotonic()
        with RedisServer() as server:
            data = SUITES[name](server.url, args.quick, results / "profiles" if args.profile else None,
                                **({"short": True} if args.short else {}))
        data["machine"] = {**facts, "quick": args.quick, "seconds": round(time.monotonic() - started, 1),
                           "loadavg_at_end": round(os.getloadavg()[0], 2)}
        path = results / f"{name}{'-quick' if args.quick else ''}.json"
        path.write_text(json.dumps(data, indent=1, default=float) + "\n")
        markdown = _report.render(name, data)
        print(markdown)
        if write_docs:
            _report.update_docs(DOCS, name, markdown)
        _say(f"{name}: {data['machine']['seconds']} s, raw numbers in {path}")
    if write_docs:
        _report.update_docs(DOCS, "summary", _report.render_summary(RESULTS, args.quick))


if __name__ == "__main__":
    main()
