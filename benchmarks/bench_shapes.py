"""The shapes beyond the mutex against the exclusive lock, measured side by side in one run.

    .venv/bin/python -m benchmarks.run --only shapes           # ~1 minute, rewrites docs/benchmarks.md
    .venv/bin/python -m benchmarks.run --only shapes --quick   # ~30 s, one round, no verdicts

- uncontended acquire + release, one worker process each: the exclusive lock,
  `lock(key, shared=True)`, `lock_all` of two keys, `semaphore(key,
  permits=4)`, with redis-py's Lock and python-redis-lock as reference rows;
- a contended acquire, 4 processes with one waiter each on one key, with
  and without the deadlock check engaged: otel-lock checks for a cycle only
  when the waiter holds another lock, so in the second row every waiter
  holds a key of its own through the run. The two rows run at the same
  time, each on its own key, so that the machine's other load (it is shared)
  falls on both alike; then each alone once, for Redis's commands and CPU
  per hand-over, which a shared server cannot split.

Uncontended rows are interleaved over rounds (others' load only slows a
round down) and the best round of each is kept.
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
# A contended acquire with the check engaged: at most +10% per hand-over, in time (1 / hand-overs/s, the two rows
# side by side) and in CPU (client + Redis, each row alone). Run one after the other on 2 shared, loaded CPUs,
# hand-overs/s swung 2.4x between runs of the same row; side by side both see the same load.
DEADLOCK_CHECK = 1.10


def _row(results: list[dict], hold_other: bool, window: float) -> dict:
    records = [tuple(r) for res in results for r in res["records"]]
    row = {"lib": "otel-lock", "hold_other": hold_other, "processes": len(results),
           **bench_lock.analyse(records, window)}
    row["client_cpu_ms_per_handoff"] = sum(res["window"]["cpu"] for res in results) / max(1, row["handoffs"]) * 1e3
    return row


def _specs(url: str, key: str, hold_other: bool, base: int) -> list[dict]:
    return [{"mode": "contend", "lib": "otel-lock", "url": url, "key": key, "tasks": 1, "worker_base": base + i,
             "hold_other": hold_other} for i in range(CONTENDED_PROCESSES)]


def contended(url: str, duration: float, hold_other: bool) -> dict:
    """Waiters on one key in CONTENDED_PROCESSES processes; with `hold_other` each holds a key of its own meanwhile.

    Alone on the server, so Redis's commands and CPU per hand-over are this row's own.
    """
    flush(url)
    results, redis_delta, window = run_workers(_specs(url, bench_lock.KEY, hold_other, 0), duration, url)
    row = _row(results, hold_other, window)
    handoffs = max(1, row["handoffs"])
    row.update(redis_commands_per_handoff=redis_delta["total"] / handoffs,
               redis_cpu_ms_per_handoff=redis_delta["cpu"] / handoffs * 1e3, redis_calls=redis_delta["calls"])
    return row


def side_by_side(url: str, duration: float, swap: bool) -> list[dict]:
    """Both contended rows at once, each on a key of its own: whatever else loads the machine loads both alike.

    `swap`: which of the two keys each row contends for (alternated over rounds).
    """
    flush(url)
    keys = ["bench:one", "bench:two"][::-1 if swap else 1]
    specs = _specs(url, keys[0], False, 0) + _specs(url, keys[1], True, CONTENDED_PROCESSES)
    results, _, window = run_workers(specs, duration, url)
    return [_row(results[:CONTENDED_PROCESSES], False, window), _row(results[CONTENDED_PROCESSES:], True, window)]


def _summed(rows: list[dict]) -> dict:
    """One row of several rounds run side by side: hand-overs and acquisitions added up, waits at the median round."""
    ordered = sorted(rows, key=lambda r: r["wait_p50_ms"])
    middle = ordered[len(ordered) // 2]
    handoffs = sum(r["handoffs"] for r in rows)
    return {**middle, "handoffs": handoffs, "acquisitions": sum(r["acquisitions"] for r in rows),
            "handoffs_per_s": sum(r["handoffs_per_s"] for r in rows) / len(rows),
            "client_cpu_ms_per_handoff": sum(r["client_cpu_ms_per_handoff"] * r["handoffs"] for r in rows)
            / max(1, handoffs), "overlaps": sum(r["overlaps"] for r in rows),
            "rounds": [round(r["handoffs_per_s"]) for r in rows]}


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
    out["side_by_side"] = []
    for r in range(rounds):
        for lib in rotate(libs, r):
            attempt("uncontended", f"shapes: uncontended, round {r + 1}: {lib}", bench_lock.uncontended, lib, url,
                    cycle)
        say(f"shapes: {CONTENDED_PROCESSES} + {CONTENDED_PROCESSES} processes on two keys at once, round {r + 1}")
        try:
            out["side_by_side"] += side_by_side(url, contend, swap=r % 2 == 1)
        except Exception as exc:  # noqa: BLE001
            out["failures"].append({"what": f"side by side, round {r + 1}", "error": repr(exc)})
    for hold_other in (False, True):
        attempt("contended", f"shapes: {CONTENDED_PROCESSES} processes on one key alone, holding another lock: "
                f"{hold_other}", contended, url, contend, hold_other)
    out["rounds"] = {"uncontended": out["uncontended"], "side_by_side": out["side_by_side"]}
    # uncontended: the best round by p50 (lower is better); side by side: the sum over the rounds, which ran
    # under the same load
    out["uncontended"] = best_rounds(out["uncontended"], "p50_ms", False)
    out["side_by_side"] = [_summed([r for r in out["side_by_side"] if r["hold_other"] == hold_other])
                           for hold_other in (False, True) if any(r["hold_other"] == hold_other
                                                                  for r in out["side_by_side"])]
    return out
