"""Markdown tables from the raw results, target checks, and the docs/benchmarks.md splice."""

from __future__ import annotations

import json
import math
import pstats
import re
from pathlib import Path

from ._adapters import RINGS, label

BLPOP_RING, QUEUED_RING = RINGS["lists"], RINGS["lists-queued"]


def _f(value, digits: int = 1) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    return f"{value:,}"


def _measured(value) -> str:
    """A target's measured value, two decimals; four when two would make it read as a round bound (1.4995, not 1.50)."""
    if not isinstance(value, float) or math.isnan(value):
        return _f(value)
    text = f"{value:,.2f}"
    return f"{value:,.4f}" if text.endswith("0") and abs(float(text.replace(",", "")) - value) > 1e-9 else text


def _table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def _row(rows: list[dict], lib: str, **match) -> dict | None:
    for row in rows:
        if row["lib"] == lib and all(row.get(k) == v for k, v in match.items()):
            return row
    return None


def _rounds(row: dict) -> str:
    return " / ".join(f"{v:,.0f}" for v in row.get("rounds", []))


_QUICK = False  # set by render(): a --quick run's windows are too short for verdicts


def _verdict(ok: bool | None) -> str:
    if _QUICK:
        return "(--quick: no verdict)"
    return "n/a" if ok is None else ("**met**" if ok else "**missed**")


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or not b:
        return None
    return a / b


RENDERERS = {}  # filled below: suite name -> render function


def render(name: str, data: dict, collect: list | None = None) -> str:
    global _QUICK
    _QUICK = bool(data.get("machine", {}).get("quick"))
    try:
        return RENDERERS[name](data, collect)
    finally:
        _QUICK = False


def render_summary(results: Path, quick: bool) -> str:
    """Every target of every suite, from the latest results/<suite>[-quick].json files."""
    rows = []
    for name in ("lock", "middleware", "telemetry", "shapes"):
        path = results / f"{name}{'-quick' if quick else ''}.json"
        if not path.exists():
            continue
        data = json.loads(path.read_text())
        found: list = []
        render(name, data, found)
        run = data["machine"]["date"] + (" (--short)" if data.get("plan") == "short" else "")
        rows += [[name, run, t, v, ok] for t, v, ok in found]
    out = ["| suite | run | target | measured | verdict |", "|---|---|---|---|---|"]
    out += [f"| {n} | {d} | {t} | {v} | {_verdict(ok)} |" for n, d, t, v, ok in rows]
    return "\n".join(out) + "\n"


def _machine(data: dict) -> list[str]:
    m = data["machine"]
    return [
        f"Run {m['date']}{' (--quick)' if m['quick'] else ''}"
        f"{', commit ' + m['commit'] if m.get('commit') else ''}: {m['nproc']} CPUs, Python {m['python']}, "
        f"Redis {m['redis']}, {m['platform']}; suite took {m['seconds']} s; 1-minute load average "
        f"{m.get('loadavg_at_start')} at start, {m.get('loadavg_at_end')} at end (other work shares these 2 CPUs).",
        "",
    ]


MIDDLEWARE_LABELS = {
    "bare": "bare endpoint (no middleware, no lock)",
    "two-pings": "bare + 2 Redis PINGs (redis-py) in the handler",
    "locked": "`@locked` + LockMiddleware",
    "redis-py": "redis-py `Lock` by hand in the handler",
    "locked-via-redis-py": "`@locked`, otel-lock calls through redis-py (diagnostic)",
    "fastapi-locked": "FastAPI: `@locked` + LockMiddleware",
    "fastapi-redis-py": "FastAPI: redis-py `Lock` by hand in the handler",
    "fastapi-otel-lock-by-hand": "FastAPI: otel-lock's lock by hand in the handler (diagnostic: no middleware)",
}


def render_middleware(data: dict, collect: list | None = None) -> str:
    out = _machine(data)
    rtt, rtt_py = data["redis_rtt_ms"]["p50"], data["redis_py_ping_ms"]["p50"]
    out += [f"One Redis round trip in this run (PING, p50): {rtt:.3f} ms on a raw socket, {rtt_py:.3f} ms through "
            "redis-py's asyncio client.", ""]
    rows = data["rows"]
    out.append(_table(
        ["endpoint", "case", "req/s", "p50 ms", "p99 ms", "Redis cmds/req", "app CPU ms/req", "statuses",
         "p50 of each round"],
        [[MIDDLEWARE_LABELS.get(r["variant"], r["variant"]), r["case"], _f(r["rps"], 0), _f(r["p50_ms"], 3),
          _f(r["p99_ms"], 2), _f(r["redis_commands_per_request"], 1), _f(r["app_cpu_ms_per_request"], 2),
          ", ".join(f"{k}: {v}" for k, v in sorted(r["statuses"].items())),
          " / ".join(f"{v:.2f}" for v in r["rounds_p50_ms"])] for r in rows]))

    def get(variant, case):
        return next((r for r in rows if r["variant"] == variant and r["case"] == case), None)

    bare, pings, ours, hand = (get(v, "distinct keys, c=1") for v in ("bare", "two-pings", "locked", "redis-py"))
    targets = []
    if bare and ours:
        overhead = ours["p50_ms"] - bare["p50_ms"]
        units = [("PING on a raw socket", 2 * rtt), ("PING through redis-py", 2 * rtt_py)]
        if pings:
            units.append(("measured in the server: two-pings p50 - bare p50", pings["p50_ms"] - bare["p50_ms"]))
        for what, two in units:
            bound = two + 0.5
            targets.append((f"p50 overhead over bare (c=1) <= 2 round trips ({what}) + 0.5 ms = {bound:.3f} ms",
                            overhead, overhead <= bound))
    if ours and hand:
        targets.append(("p50 not slower than the hand-written redis-py version (c=1), ratio", ours["p50_ms"] / hand["p50_ms"],
                        ours["p50_ms"] <= hand["p50_ms"]))
    # Against the lock written by hand, per framework
    for framework, mine, theirs in (("Starlette", "locked", "redis-py"), ("FastAPI", "fastapi-locked",
                                                                           "fastapi-redis-py")):
        for c in (16, 64):
            a, b = get(mine, f"distinct keys, c={c}"), get(theirs, f"distinct keys, c={c}")
            if a and b:
                targets.append((f"{framework}: req/s at least the hand-written redis-py version's (c={c}), ratio",
                                a["rps"] / b["rps"], a["rps"] >= b["rps"]))
                cpu = a["app_cpu_ms_per_request"] / b["app_cpu_ms_per_request"]
                targets.append((f"{framework}: app CPU per request at most the hand-written version's (c={c}), "
                                "ratio", cpu, cpu <= 1.0))
        a, b = get(mine, "distinct keys, c=1"), get(theirs, "distinct keys, c=1")
        if a and b and framework == "FastAPI":
            targets.append((f"{framework}: p50 within 1.2x of the hand-written version (c=1), ratio",
                            a["p50_ms"] / b["p50_ms"], a["p50_ms"] <= 1.2 * b["p50_ms"]))
    out += ["", "Targets (this run):", ""]
    shown = [[t, _f(v, 3), ok] for t, v, ok in targets]
    out.append(_table(["target", "measured", "verdict"], [[t, v, _verdict(ok)] for t, v, ok in shown]))
    if collect is not None:
        collect += shown
    return "\n".join(out) + "\n"


TELEMETRY_LABELS = {
    "off": "off (no SDK)",
    "prom": "/metrics (prometheus-client fast path)",
    "otlp": "OTLP/HTTP (fast path, one export)",
    "prom-lock": "/metrics, lock telemetry only (no ASGI instrumentation)",
    "prom-workers": "/metrics, worker-process mode (PROMETHEUS_MULTIPROC_DIR)",
    "otlp-lock": "OTLP, lock telemetry only (no ASGI instrumentation)",
    # results of earlier runs
    "sdk-memory": "SDK, in-memory exporters",
    "otlp-prom": "OTLP/HTTP + Prometheus reader",
}
TELEMETRY_TARGETS = {"prom": 0.10, "otlp": 0.25}  # = benchmarks._otel_modes.TARGETS
FASTAPI_LABELS = {
    "off": "off (no SDK)",
    "prom-lock": "/metrics, the lock's telemetry alone (FastAPI's off)",
    "prom": "/metrics, FastAPI's metrics and the lock's",
    "prom-app": "/metrics, `instrument_app` (contrib's HTTP metrics; FastAPI's step aside) and the lock's",
    "otlp-lock": "OTLP, the lock's telemetry alone (FastAPI's off)",
    "otlp": "OTLP, FastAPI's native tracing and metrics and the lock's",
    "otlp-fw-lean": "OTLP, FastAPI's native telemetry with its operation spans off, and the lock's",
    "otlp-sampled": "OTLP, the same with 1 trace in 10 sampled (parentbased_traceidratio 0.1)",
    "otlp-app": "OTLP, `instrument_app` (contrib's HTTP span and metrics; FastAPI's step aside) and the lock's",
}
FASTAPI_TARGETS = {"prom": 0.95, "otlp": 0.85, "prom-lock": 0.95, "otlp-lock": 0.95}  # req/s, share of off's


def _render_fastapi(rows: list[dict]) -> tuple[list[str], list]:
    """The FastAPI part of the telemetry suite: its table and its targets."""
    order = list(FASTAPI_LABELS)
    rows = sorted(rows, key=lambda r: order.index(r["mode"]) if r["mode"] in order else len(order))
    base = next((r for r in rows if r["mode"] == "off"), None)
    out = ["", f"A `@locked` FastAPI route under uvicorn with FastAPI's native telemetry (FastAPI 0.165+ traces "
           f"every request once an SDK is installed), c={rows[0]['concurrency']}, one server per mode; best round "
           f"by req/s:", ""]
    out.append(_table(
        ["telemetry", "req/s", "vs off", "p50 ms", "statuses", "req/s of each round"],
        [[FASTAPI_LABELS.get(r["mode"], r["mode"]), _f(r["rps"], 0),
          f"{r['rps'] / base['rps']:.2f}x" if base else "n/a", _f(r["p50_ms"], 2),
          ", ".join(f"{k}: {v}" for k, v in sorted(r["statuses"].items())),
          " / ".join(str(v) for v in r["rounds"])] for r in rows]))
    targets = []
    for r in rows:
        floor = FASTAPI_TARGETS.get(r["mode"])
        if base and floor is not None:
            ratio = r["rps"] / base["rps"]
            targets.append((f"FastAPI: req/s >= {floor:.2f}x of off ({FASTAPI_LABELS[r['mode']]})", ratio,
                            ratio >= floor))
    return out, targets


def render_telemetry(data: dict, collect: list | None = None) -> str:
    out = _machine(data)
    if data.get("plan") == "short":
        out += ["A shortened run (`--short`, to stay under 2 minutes on a shared machine): the lock cycle 3 rounds "
                "of 1 s, the endpoint 2 rounds of 1 s (a full run: 8 of 1.5 s and 4 of 2 s), so each best round "
                "is picked among fewer and the figures are noisier.", ""]
    cycle = data["cycle"]
    base = next((r for r in cycle if r["mode"] == "off"), None)
    out += ["Uncontended otel-lock acquire + release (one worker process per mode):", ""]
    out.append(_table(
        ["telemetry", "cycles/s", "p50 ms", "p99 ms", "client CPU µs/cycle", "p50 vs off", "p50 of each round"],
        [[TELEMETRY_LABELS[r["mode"]], _f(r["cycles_per_s"], 0), _f(r["p50_ms"], 3), _f(r["p99_ms"], 3),
          _f(r["client_cpu_per_cycle_us"], 0), f"{r['p50_ms'] / base['p50_ms'] - 1:+.1%}" if base else "n/a",
          " / ".join(f"{v:.3f}" for v in r["rounds"])] for r in cycle]))
    http = data["endpoint"]
    out += ["", "The demo's locked endpoint `POST /api/stock/{id}/deduct` under uvicorn (one server per mode; "
            "in the /metrics modes /metrics is scraped once a second during the run):", ""]

    def p50_of(mode, case):
        row = next((r for r in http if r["mode"] == mode and r["case"] == case), None)
        return row["p50_ms"] if row else None

    out.append(_table(
        ["telemetry", "case", "req/s", "p50 ms", "p99 ms", "p50 vs off", "statuses", "p50 of each round"],
        [[TELEMETRY_LABELS.get(r["mode"], r["mode"]), r["case"], _f(r["rps"], 0), _f(r["p50_ms"], 3),
          _f(r["p99_ms"], 2),
          f"{r['p50_ms'] / p50_of('off', r['case']) - 1:+.1%}" if p50_of("off", r["case"]) else "n/a",
          ", ".join(f"{k}: {v}" for k, v in sorted(r["statuses"].items())),
          " / ".join(f"{v:.2f}" for v in r["rounds"])] for r in http]))
    parts = []
    for mode in ("prom", "otlp"):
        for case in dict.fromkeys(r["case"] for r in http):
            off, lock, full = p50_of("off", case), p50_of(f"{mode}-lock", case), p50_of(mode, case)
            if off and lock and full:
                parts.append([TELEMETRY_LABELS[mode], case, f"{lock / off - 1:+.1%}", f"{(full - lock) / off:+.1%}",
                              f"{full / off - 1:+.1%}"])
    if parts:
        out += ["", "Endpoint p50 overhead over off, per part (the lock's telemetry; the ASGI "
                "instrumentation on top of it):", ""]
        out.append(_table(["telemetry", "case", "lock telemetry", "ASGI instrumentation", "total"], parts))
    targets = []
    if data.get("fastapi"):
        lines, targets = _render_fastapi(data["fastapi"])
        out += lines
    out += ["", f"OTLP requests the dummy receiver got during the run: {data.get('otlp_received')}", ""]
    for r in cycle:
        limit = TELEMETRY_TARGETS.get(r["mode"])
        if base and limit is not None:
            label = TELEMETRY_LABELS[r["mode"]]
            over = r["p50_ms"] / base["p50_ms"] - 1
            targets.append((f"lock cycle p50 overhead <= {limit:.0%} ({label})", over, over <= limit))
            over = r["client_cpu_per_cycle_us"] / base["client_cpu_per_cycle_us"] - 1
            targets.append((f"lock cycle client CPU overhead <= {limit:.0%} ({label})", over, over <= limit))
    shown = [[t, f"{v:.2f}x" if t.startswith("FastAPI") else f"{v:+.1%}", ok] for t, v, ok in targets]
    if data["machine"].get("quick"):
        out += ["(--quick: windows too short for verdicts; run without --quick to check the targets)", ""]
    else:
        out += ["Targets (this run):", ""]
        out.append(_table(["target", "measured", "verdict"], [[t, v, _verdict(ok)] for t, v, ok in shown]))
        if collect is not None:
            collect += shown
    for case, rows in data.get("profile", {}).items():
        out += ["", f"cProfile, {case} (share of the profiled time, calls included):", "",
                _table(["function", "inclusive share", "calls"],
                       [[r["function"], f"{r['share']:.1%}", r["calls"]] for r in rows])]
    return "\n".join(out) + "\n"


def render_lock(data: dict, collect: list | None = None) -> str:
    out = _machine(data)
    targets = []

    a = data["uncontended"]
    out += ["### (a) Uncontended acquire + release", "",
            "One worker process, one key, `async with lock(key)` / `with lock` around nothing, in a loop. "
            "Best of the interleaved rounds (cycles/s of every round in the last column).", ""]
    out.append(_table(
        ["library", "cycles/s", "p50 ms", "p99 ms", "Redis cmds/cycle", "client CPU µs/cycle", "rounds"],
        [[label(r["lib"]), _f(r["cycles_per_s"], 0), _f(r["p50_ms"], 3), _f(r["p99_ms"], 3),
          _f(r["redis_commands_per_cycle"], 1), _f(r["client_cpu_per_cycle_us"], 0), _rounds(r)] for r in a]))
    ours, peer = _row(a, "otel-lock"), _row(a, "redis-py")
    ratio = _ratio(ours and ours["p50_ms"], peer and peer["p50_ms"])
    targets.append(("uncontended p50 cycle time <= 1.0x redis-py asyncio Lock", ratio, ratio is not None and ratio <= 1.0))

    sizes = data.get("held_bytes") or []
    if sizes:
        out += ["", "One lock held, nobody waiting: the keys it keeps in Redis and their `MEMORY USAGE` "
                "(deterministic; otel-lock's namespace claim `<ns>:model` is one key per namespace, not counted).",
                ""]
        out.append(_table(["library", "keys", "bytes"], [[label(r["lib"]), r["keys"], r["bytes"]] for r in sizes]))
        ours, peer = _row(sizes, "otel-lock"), _row(sizes, "redis-py")
        ratio = _ratio(ours and ours["bytes"], peer and peer["bytes"])
        targets.append(("a held lock's bytes in Redis <= 1.5x redis-py asyncio Lock's", ratio,
                        ratio is not None and ratio <= 1.5))

    b = data["contended"]
    out += ["", "### (b) 8 workers contending for one key", "",
            "8 workers, either 8 processes with one waiter each or 8 tasks (threads for the sync peers) in one "
            "process, critical section = a local increment. Targets are judged on the 8-process rows. A handoff is an acquisition by a different worker than the previous one. "
            "Overlaps = hold intervals (system-wide monotonic clock) that overlapped: must be 0. "
            "Best round by handoffs/s (every round's handoffs/s in the last column).", ""]
    out.append(_table(
        ["library", "processes", "acquisitions/s", "handoffs/s", "wait p50 ms", "wait p99 ms", "busiest worker",
         "overlaps", "Redis cmds/handoff", "client CPU ms/handoff", "client sleeps/handoff", "rounds"],
        [[label(r["lib"]), r["processes"], _f(r["acquisitions_per_s"], 0), _f(r["handoffs_per_s"], 0), _f(r["wait_p50_ms"], 2),
          _f(r["wait_p99_ms"], 2), f"{r['busiest_share']:.0%}", r["overlaps"], _f(r["redis_commands_per_handoff"], 1),
          _f(r["client_cpu_ms_per_handoff"], 2), _f(r.get("client_sleeps_per_handoff"), 2), _rounds(r)]
         for r in sorted(b, key=lambda r: -r["processes"])]))
    for procs in (8, 1):
        ours = _row(b, "otel-lock", processes=procs)
        where = f"8 workers in {procs} process{'es' if procs > 1 else ''}"
        for peer_lib, factor in (("python-redis-lock", 1.5 if procs > 1 else 3.0), ("redis-py", 50)):
            peer = _row(b, peer_lib, processes=procs)
            ratio = _ratio(ours and ours["handoffs_per_s"], peer and peer["handoffs_per_s"])
            targets.append((f"handoffs/s >= {factor}x {label(peer_lib)} ({where})", ratio,
                            ratio is not None and ratio >= factor))
        targets.append((f"busiest worker <= 20% of acquisitions ({where})", ours and ours["busiest_share"],
                        ours is not None and ours["busiest_share"] <= 0.20))
        # to one decimal: the INFO reads that count them and the window's edges add about 0.01
        commands = ours and ours["redis_commands_per_handoff"]
        targets.append((f"Redis commands per contended handoff <= 12.0, to one decimal ({where})", commands,
                        commands is not None and round(commands, 1) <= 12.0))
    rings = data.get("ring", [])
    if rings:
        out += ["", "The machine's own limit for the same hand-over pattern, in the same run: one token passed "
                "around the same 8 processes through Redis (each process woken by SUBSCRIBE/PUBLISH, or by "
                "BLPOP/LPUSH, on the lock's own lean connection), best round by hops/s. The BLPOP ring with one "
                "more round trip per hop does what a queued lock adds to a hop (the reply to its next request "
                "to queue), with no lock logic.", ""]
        out.append(_table(["ring", "hand-overs/s", "Redis cmds/hand-over", "client CPU ms/hand-over",
                           "Redis CPU ms/hand-over", "client sleeps/hand-over", "rounds"],
                          [[r["lib"], _f(r["handoffs_per_s"], 0), _f(r["redis_commands_per_handoff"], 1),
                            _f(r["client_cpu_ms_per_handoff"], 3), _f(r["redis_cpu_ms_per_handoff"], 3),
                            _f(r.get("client_sleeps_per_handoff"), 2), _rounds(r)]
                           for r in rings]))
        ours = _row(b, "otel-lock", processes=8)
        plain = [r for r in rings if r["lib"] != QUEUED_RING]
        best = max(plain, key=lambda r: r["handoffs_per_s"])
        ratio = _ratio(ours and ours["handoffs_per_s"], best["handoffs_per_s"])
        targets.append(("8-process handoffs/s >= 0.9x the faster ring (the machine's limit)", ratio,
                        ratio is not None and ratio >= 0.9))
        blpop = [r for r in rings if r["lib"] == BLPOP_RING]
        if blpop:
            ratio = _ratio(ours and ours["handoffs_per_s"], blpop[0]["handoffs_per_s"])
            targets.append(("8-process handoffs/s >= 0.6x the BLPOP ring on a raw socket (lean connection)", ratio,
                            ratio is not None and ratio >= 0.6))
        queued = [r for r in rings if r["lib"] == QUEUED_RING]
        if blpop and queued:
            # what a queued lock's third round trip costs, apart from the lock's own work (reported, no target)
            targets.append(("the BLPOP ring with one more round trip per hop vs the BLPOP ring (reported, no target)",
                            _ratio(queued[0]["handoffs_per_s"], blpop[0]["handoffs_per_s"]), None))
        apps = [r for r in rings if "redis-py" in r["lib"]]
        if apps:
            ratio = _ratio(ours and ours["handoffs_per_s"], max(r["handoffs_per_s"] for r in apps))
            targets.append(("8-process handoffs/s >= 0.9x the faster ring an app writes with redis-py", ratio,
                            ratio is not None and ratio >= 0.9))
    every = data.get("rounds", {}).get("contended", b) + data.get("rounds", {}).get("herd", data["herd"])
    targets.append(("no overlapping holds (every library, every run of (b) and (d))", sum(r["overlaps"] for r in every),
                    all(r["overlaps"] == 0 for r in every)))

    c = data["held"]
    out += ["", "### (c) Held locks kept alive by renewal", "",
            "One process holds N locks. otel-lock: `lease=None`, one watchdog per manager. redis-py: one task per "
            "lock calling `extend()` (its only way). python-redis-lock: `auto_renewal=True`, one thread per lock "
            "(renews every expire*2/3). pottery: no automatic renewal, not measured. Lease 9 s (3 s with --quick). Round trips and "
            "commands are counted in the client; Redis commands include those run inside scripts.", ""]
    out.append(_table(
        ["library", "locks", "tick s", "round trips/tick", "client cmds/tick", "Redis cmds/tick",
         "client CPU ms/tick", "Redis CPU ms/tick", "lost"],
        [[label(r["lib"]), _f(r["locks"]), _f(r["interval_s"], 1), _f(r["round_trips_per_tick"], 1),
          _f(r["commands_per_tick"], 1), _f(r["redis_commands_per_tick"], 0), _f(r["client_cpu_ms_per_tick"], 1),
          _f(r["redis_cpu_ms_per_tick"], 1), r["lost"]] for r in c]))
    ours = _row(c, "otel-lock")
    targets.append(("<= 10 round trips per tick for 10,000 held locks", ours and ours["round_trips_per_tick"],
                    ours is not None and ours["round_trips_per_tick"] <= 10 and ours["lost"] == 0))

    many = data.get("many", [])
    if many:
        out += ["", "### (c') Many locks held by one task", "",
                "One task acquires N locks one after the other (uncontended keys), then releases them; cost per "
                "lock. It must not grow with the number already held.", ""]
        out.append(_table(["library", "held", "acquire µs/lock", "release µs/lock"],
                          [[label(r["lib"]), _f(r["held"]), _f(r["acquire_us"], 0), _f(r["release_us"], 0)]
                           for r in many]))
        per = [r["acquire_us"] + r["release_us"] for r in many if r["lib"] == "otel-lock"]
        ratio = (max(per) / min(per)) if per and min(per) else None
        targets.append(("per-lock acquire+release flat (max/min <= 1.5) from 500 to 16,000 held", ratio,
                        ratio is not None and ratio <= 1.5))

    d = data["herd"]
    out += ["", "### (d) No thundering herd: many waiters on one key", "",
            "Waiters spread over 4 processes (async: tasks; sync: threads); best of the rounds by handoffs/s "
            "(every round's handoffs/s in the last column). Redis cmds = INFO commandstats delta "
            "(includes commands run inside Lua scripts); client cmds / round trips = what the clients sent.", ""]
    out.append(_table(
        ["library", "waiters", "handoffs/s", "wait p99 ms", "busiest", "Redis cmds/handoff", "client cmds/handoff",
         "round trips/handoff", "Redis CPU ms/handoff", "overlaps", "rounds"],
        [[label(r["lib"]), r["workers"], _f(r["handoffs_per_s"], 0), _f(r["wait_p99_ms"], 1),
          f"{r['busiest_share']:.0%}", _f(r["redis_commands_per_handoff"], 1),
          _f(r.get("client_commands_per_handoff"), 1), _f(r.get("client_round_trips_per_handoff"), 1),
          _f(r["redis_cpu_ms_per_handoff"], 3), r["overlaps"], _rounds(r)]
         for r in sorted(d, key=lambda r: (r["lib"], r["workers"]))]))
    per = [r["redis_commands_per_handoff"] for r in d if r["lib"] == "otel-lock"]
    ratio = (max(per) / min(per)) if per and min(per) else None
    targets.append(("Redis commands per handoff flat (max/min <= 1.5) from 8 to 512 waiters", ratio,
                    ratio is not None and ratio <= 1.5))

    out += ["", "### Targets (ratios from this run)", ""]
    shown = [[t, _measured(v), ok] for t, v, ok in targets]
    out.append(_table(["target", "measured", "verdict"], [[t, v, _verdict(ok)] for t, v, ok in shown]))
    if collect is not None:
        collect += shown
    if data.get("failures"):
        out += ["", "Failed runs (no row above):", ""]
        out += [f"- {f['what']}: `{f['error']}`" for f in data["failures"]]
    if "profile" in data:
        out += ["", "### Where otel-lock's time goes (cProfile of the worker processes)", "",
                "Share of the profiled time (idle waiting in `epoll` included; cProfile inflates Python-heavy code). "
                "Own time shows where CPU burns; inclusive time of otel_lock's functions shows which of its paths "
                "pay for it.", ""]
        for case, rows in data["profile"].items():
            header = "inclusive share" if case.endswith("(otel_lock inclusive)") else "own time share"
            out += [f"{case}:", "", _table(["function", header, "calls"],
                                          [[r["function"], f"{r['share']:.1%}", r["calls"]] for r in rows]), ""]
    return "\n".join(out) + "\n"


def top_functions(paths: list[Path], n: int = 15, cumulative_of: str | None = None) -> list[dict]:
    """Top functions by own time, or (cumulative_of="otel_lock/") that package's functions by inclusive time."""
    stats = pstats.Stats(*[str(p) for p in paths])
    total = stats.total_tt or 1.0
    rows = []
    for (filename, line, func), (_cc, ncalls, tottime, cumtime, _callers) in stats.stats.items():
        short = re.sub(r".*/(site-packages|lib/python3\.\d+|work/main)/", "", filename)
        if cumulative_of is not None and not short.startswith(cumulative_of):
            continue
        spent = cumtime if cumulative_of is not None else tottime
        rows.append({"function": f"{short}:{line}:{func}", "share": spent / total, "calls": ncalls})
    return sorted(rows, key=lambda r: -r["share"])[:n]


def update_docs(path: Path, name: str, markdown: str) -> None:
    """Replace the block between this suite's markers (appended if missing)."""
    start, end = f"<!-- results:{name}:start -->", f"<!-- results:{name}:end -->"
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    block = f"{start}\n{markdown}{end}"
    if start in text and end in text:
        text = text[:text.index(start)] + block + text[text.index(end) + len(end):]
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def render_deployments(data: dict, collect: list | None = None) -> str:
    """One table, a row per deployment and lock, from benchmarks/bench_deployments.py."""
    out = _machine(data)
    loads = [r["load_1m_before"] for t in data["every_round"].values() for r in t]
    if loads:
        out[-2] += (f" Before each row: {min(loads)} to {max(loads)} (this run's own worker processes "
                    "count in it from the second row on).")
    keys = data.get("keys", [])
    out += [f"{data['processes']} worker processes (one waiter each) take {len(keys)} keys in turn "
            f"({', '.join(k['key'] for k in keys)}: slots {', '.join(str(k['slot']) for k in keys)}, "
            "one per Cluster master); critical section = a local increment; "
            f"{data['contended_s']:g} s per row and round, best of {data['rounds']} round(s) by hand-overs/s "
            "(every round in the last column). A hand-over is an acquisition of a key by another worker than "
            "the one before on that key; overlaps (two holders of one key at once, system-wide monotonic "
            "clock) must be 0. Redis cmds and Redis CPU are summed over every master of the deployment "
            "(`INFO commandstats`, commands inside scripts included). Uncontended: one worker process, "
            "acquire + release of one key in a loop.", ""]
    rows = data["rows"]
    base = next((r for r in rows if r["row"] == "single"), None)
    out.append(_table(
        ["deployment", "lock", "hand-overs/s", "vs single", "wait p50 ms", "wait p99 ms", "busiest worker",
         "overlaps", "Redis cmds/hand-over", "Redis CPU ms/hand-over", "client CPU ms/hand-over",
         "uncontended p50 ms", "uncontended p99 ms", "rounds"],
        [[r["where"], r["lock"], _f(r["handoffs_per_s"], 0),
          f"{r['handoffs_per_s'] / base['handoffs_per_s']:.2f}x" if base and base["handoffs_per_s"] else "n/a",
          _f(r["wait_p50_ms"], 2), _f(r["wait_p99_ms"], 1), f"{r['busiest_share']:.0%}", r["overlaps"],
          _f(r["redis_commands_per_handoff"], 1), _f(r["redis_cpu_ms_per_handoff"], 3),
          _f(r["client_cpu_ms_per_handoff"], 2), _f(r.get("cycle_p50_ms"), 3), _f(r.get("cycle_p99_ms"), 3),
          _rounds(r)] for r in rows]))
    every = data["every_round"]["contended"]
    out += ["", f"Overlapping holds over every round of every row: {sum(r['overlaps'] for r in every)}."]
    if data.get("failures"):
        out += ["", "Failed runs (no row above):", ""]
        out += [f"- {f['what']}: `{f['error']}`" for f in data["failures"]]
    return "\n".join(out) + "\n"


def render_shapes(data: dict, collect: list | None = None) -> str:
    """The shapes beyond the mutex beside the exclusive lock, from benchmarks/bench_shapes.py."""
    from .bench_shapes import CONTENDED_PROCESSES, DEADLOCK_CHECK, TARGETS

    out = _machine(data)
    out += ["**The machine is shared and was loaded during this run** (load averages above, on 2 CPUs): the "
            "absolute numbers are low and noisy; the ratios between rows of the same run are what the targets "
            "judge. Rows were interleaved over the rounds and the best round of each is kept.", ""]
    a = data["uncontended"]
    base = _row(a, "otel-lock")
    out += ["Uncontended acquire + release: one worker process, one key (`lock_all`: that key and one beside it), "
            "`async with` around nothing, in a loop; redis-py's Lock and python-redis-lock as reference rows. "
            "Best round by p50 (every round's p50 in the last column).", ""]
    out.append(_table(
        ["lock", "cycles/s", "p50 ms", "p99 ms", "p50 vs exclusive", "Redis cmds/cycle", "client CPU µs/cycle",
         "p50 of each round"],
        [[label(r["lib"]), _f(r["cycles_per_s"], 0), _f(r["p50_ms"], 3), _f(r["p99_ms"], 3),
          f"{r['p50_ms'] / base['p50_ms']:.2f}x" if base else "n/a", _f(r["redis_commands_per_cycle"], 1),
          _f(r["client_cpu_per_cycle_us"], 0), " / ".join(f"{v:.3f}" for v in r["rounds"])] for r in a]))
    def who(r: dict) -> str:
        return "holds another lock (deadlock check engaged)" if r["hold_other"] else "holds nothing else (no check)"

    both, c = data.get("side_by_side", []), data["contended"]
    out += ["", f"A contended acquire: {CONTENDED_PROCESSES} processes with one waiter each on one key, critical "
            "section = a local increment. otel-lock looks for a deadlock only when the waiter holds another lock: "
            "in the second row of each table every waiter holds a key of its own through the run, so every wait "
            "may run the check. First both rows at once, each on its own key, so that the machine's other load "
            "falls on both alike (hand-overs/s averaged over the rounds, each round's in the last column; waits "
            "of the median round):", ""]
    out.append(_table(
        ["waiter", "hand-overs/s", "wait p50 ms", "wait p99 ms", "overlaps", "client CPU ms/hand-over", "rounds"],
        [[who(r), _f(r["handoffs_per_s"], 0), _f(r["wait_p50_ms"], 2), _f(r["wait_p99_ms"], 2), r["overlaps"],
          _f(r["client_cpu_ms_per_handoff"], 2), " / ".join(f"{v:,}" for v in r.get("rounds", []))]
         for r in sorted(both, key=lambda r: r["hold_other"])]))
    out += ["", "Then each alone on the server, once, for what Redis does per hand-over:", ""]
    out.append(_table(
        ["waiter", "hand-overs/s", "Redis cmds/hand-over", "Redis CPU ms/hand-over", "client CPU ms/hand-over",
         "overlaps"],
        [[who(r), _f(r["handoffs_per_s"], 0), _f(r["redis_commands_per_handoff"], 1),
          _f(r.get("redis_cpu_ms_per_handoff"), 3), _f(r["client_cpu_ms_per_handoff"], 2), r["overlaps"]]
         for r in sorted(c, key=lambda r: r["hold_other"])]))
    targets = []
    for what, lib, against, bound in TARGETS:
        ours, other = _row(a, lib), _row(a, against)
        ratio = _ratio(ours and ours["p50_ms"], other and other["p50_ms"])
        targets.append((f"{what} <= {bound}x", ratio, ratio is not None and ratio <= bound))
    permit = _row(a, "otel-lock-permit")
    ratio = _ratio(permit and permit["p50_ms"], base and base["p50_ms"])
    targets.append(("uncontended `semaphore` acquire + release, p50 vs exclusive (reported, no target)", ratio, None))
    plain = next((r for r in both if not r["hold_other"]), None)
    checked = next((r for r in both if r["hold_other"]), None)
    ratio = _ratio(plain and plain["handoffs_per_s"], checked and checked["handoffs_per_s"])
    targets.append((f"contended acquire with the deadlock check: time per hand-over vs without, side by side "
                    f"<= {DEADLOCK_CHECK}x", ratio, ratio is not None and ratio <= DEADLOCK_CHECK))

    def cpu(row: dict | None) -> float | None:
        return None if row is None else row["client_cpu_ms_per_handoff"] + row.get("redis_cpu_ms_per_handoff", 0.0)

    ratio = _ratio(cpu(next((r for r in c if r["hold_other"]), None)),
                   cpu(next((r for r in c if not r["hold_other"]), None)))
    targets.append((f"contended acquire with the deadlock check: CPU (client + Redis) per hand-over vs without, "
                    f"each alone <= {DEADLOCK_CHECK}x", ratio, ratio is not None and ratio <= DEADLOCK_CHECK))
    out += ["", "Targets (this run):", ""]
    shown = [[t, _f(v, 2), ok] for t, v, ok in targets]
    out.append(_table(["target", "measured", "verdict"], [[t, v, _verdict(ok)] for t, v, ok in shown]))
    if collect is not None:
        collect += shown
    if data.get("failures"):
        out += ["", "Failed runs (no row above):", ""]
        out += [f"- {f['what']}: `{f['error']}`" for f in data["failures"]]
    return "\n".join(out) + "\n"


RENDERERS.update(lock=render_lock, middleware=render_middleware, telemetry=render_telemetry,
                 deployments=render_deployments, shapes=render_shapes)
