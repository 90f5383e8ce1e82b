"""Issue 27's measurements, side by side in one run: the shapes beyond the mutex against the exclusive lock.

    .venv/bin/python -m benchmarks.run --only shapes           # ~1 minute, rewrites docs/benchmarks.md
    .venv/bin/python -m benchmarks.run --only shapes --quick   # ~30 s, one round, no verdicts

- uncontended acquire + release, one worker process each: the exclusive lock,
  `lock(key, shared=True)`, `lock_all` of two keys, `semaphore(key,
  permits=4)`, with redis-py's Lock and python-redis-lock as reference rows;
- a contended acquire, 4 processes with one waiter each on one key, with
  and without the deadlock check engaged: otel-lock checks for a cycle only
  when the waiter holds another lock, so in the second row every waiter
  holds a key of its own through the run.

Rows are interleaved over rounds (the machine is shared: others' load only
slows a round down) and the best round of each row is kept.
"""

from __future__ import annotations

from . import bench_lock
from ._adapters import available
from ._harness import best_rounds, flush, rotate, run_workers

UNCONTENDED = ["otel-lock", "otel-lock-shared", "otel-lock-all2", "otel-lock-permit", "redis-py", "python-redis-lock"]
CONTENDED_PROCESSES = 4

# The targets: (what, numerator row, denominator row, bound on the ratio of p50 cycle times).
TARGETS = [
    ("uncontended shared acquire + release, p50 vs exclusive", "otel-lock-shared", "otel-lock", 1.2),
    ("uncontended `lock_all` of 2 keys, p50 vs one lock", "otel-lock-all2", "otel-lock", 2.2),
]
# A contended acquire with the check engaged: at most +10% per hand-over, in time (1 / hand-overs/s) and in CPU
# (client + Redis). On 2 shared, loaded CPUs hand-overs/s is bounded by CPU and swings between rounds; the CPU
# a hand-over costs is the steadier of the two.
DEADLOCK_CHECK = 1.10


def contended(url: str, duration: float, hold_other: bool) -> dict:
    """Waiters on one key in CONTENDED_PROCESSES processes; with `hold_other` each holds a key of its own meanwhile."""
    flush(url)
    specs = [{"mode": "contend", "lib": "otel-lock", "url": url, "key": bench_lock.KEY, "tasks": 1,
              "worker_base": i, "hold_other": hold_other} for i in range(CONTENDED_PROCESSES)]
    results, redis_delta, window = run_workers(specs, duration, url)
    records = [tuple(r) for res in results for r in res["records"]]
    row = {"lib": "otel-lock", "hold_other": hold_other, "processes": CONTENDED_PROCESSES,
           **bench_lock.analyse(records, window)}
    handoffs = max(1, row["handoffs"])
    row.update(redis_commands_per_handoff=redis_delta["total"] / handoffs,
               client_cpu_ms_per_handoff=sum(res["window"]["cpu"] for res in results) / handoffs * 1e3,
               redis_cpu_ms_per_handoff=redis_delta["cpu"] / handoffs * 1e3,
               redis_calls=redis_delta["calls"])
    return row


def run(url: str, quick: bool | str, say=print) -> dict:
    """One run; `quick`: one round of short windows, "smoke": shorter still (the test of this module)."""
    libs = [lib for lib in UNCONTENDED if available(lib)]
    out: dict = {"uncontended": [], "contended": [], "failures": []}

    def attempt(table: str, what: str, fn, *args) -> None:
        say(what)
        try:
            out[table].append(fn(*args))
        except Exception as exc:  # noqa: BLE001 - one failed row must not cost the others
            say(f"FAILED: {what}: {exc!r}")
            out["failures"].append({"what": what, "error": repr(exc)})

    rounds = 1 if quick else 2
    cycle, contend = {"smoke": (0.2, 0.3), True: (0.5, 0.7)}.get(quick, (1.0, 1.5))
    for r in range(rounds):
        for lib in rotate(libs, r):
            attempt("uncontended", f"shapes: uncontended, round {r + 1}: {lib}", bench_lock.uncontended, lib, url,
                    cycle)
        for hold_other in rotate([False, True], r):
            attempt("contended", f"shapes: {CONTENDED_PROCESSES} processes on one key, holding another lock: "
                    f"{hold_other}, round {r + 1}", contended, url, contend, hold_other)
    out["rounds"] = {"uncontended": out["uncontended"], "contended": out["contended"]}
    # uncontended: the best round by p50 (lower is better); contended: by hand-overs/s
    out["uncontended"] = best_rounds(out["uncontended"], "p50_ms", False)
    out["contended"] = best_rounds(out["contended"], "handoffs_per_s", True, group=lambda row: row["hold_other"])
    return out
