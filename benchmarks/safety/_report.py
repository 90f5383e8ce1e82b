"""From one run's records to one table row, and rows to markdown."""

from __future__ import annotations

from ._overlaps import summarise, wait_overrun

# The wait bound: one round trip (a generous 0.1 s on a busy 2-core machine) plus
# the socket timeout (otel-lock's from_url default).
SOCKET_TIMEOUT = 2.0
ROUND_TRIP = 0.1
# "Flat" commands per handoff: within this factor of the same library's no-fault run.
FLAT = 4.0

COLUMNS = [
    ("library", "library"), ("fault", "fault"), ("holds", "holds"), ("overlaps", "overlaps"), ("told", "told"),
    ("fenced", "fenced"), ("unsafe", "untold & unfenced"), ("next_await", "stale told by next await"),
    ("max_overlap_ms", "max overlap ms"), ("max_idle_ms", "max idle ms"), ("overrun_ms", "max wait overrun ms"),
    ("commands_per_handoff", "commands / handoff"), ("failed", "timeouts / errors"), ("hung", "hung"),
    ("misses", "targets missed"),
]


SHAPE_COLUMNS = [("shape", "shape"), ("shared_together", "shared holds together"),
                 ("permits_seen", "permit holders at most / limit")]


def row(run) -> dict:
    shape = getattr(run, "shape", "exclusive")
    summary = summarise(run.holds, run.permits if shape == "permits" else None)
    deployment = run.deployment.name
    overruns = [wait_overrun(a["req"], a["ret"], a["wait"], run.pauses.get(a["proc"], [])) for a in run.attempts]
    timeouts = sum(a["outcome"] == "timeout" for a in run.attempts)
    errors = [a["outcome"] for a in run.attempts if a["outcome"] not in ("acquired", "timeout")]
    has_tokens = any(h.token is not None for h in run.holds)
    return {
        "deployment": deployment, "library": run.lib, "fault": run.fault.name, **summary,
        "next_await": f"{summary['stale_told_next']}/{summary['stale_holders']}" if has_tokens else "n/a",
        "max_overlap_ms": round(summary["max_overlap"] * 1000),
        "max_told_after_ms": round(max(0.0, summary["max_told_after"]) * 1000),
        "max_idle_ms": round(summary["max_idle"] * 1000),
        "overrun_ms": round(max(overruns, default=0.0) * 1000),
        "commands": run.meter.total,
        "commands_per_handoff": round(run.meter.total / summary["handoffs"], 1) if summary["handoffs"] else None,
        "timeouts": timeouts, "errors": len(errors), "error_types": sorted(set(errors)),
        "failed": f"{timeouts} / {len(errors)}",
        "hung": run.hung,
        "injected": run.injected,
        "processes": len({h.proc for h in run.holds}),  # processes that held the lock at least once
        "release_false": sum(h.release is False for h in run.holds),
        "shape": shape,
        "permits": run.permits if shape == "permits" else None,
        "permits_seen": f"{summary['permit_peak']} / {run.permits}" if shape == "permits" else None,
    }


def misses(row: dict, fault, baseline: dict | None) -> list[str]:
    """The targets this row misses (see docs/safety.md, "Targets")."""
    missed = []
    if row["unsafe"]:
        missed.append("unsafe")
    if not fault.may_overlap and row["overlaps"]:
        missed.append("overlap")
    if row["fenced"] < row["overlaps"]:
        missed.append("fence")
    # "told at its next await" is the promise to a holder that was paused or cut off; a holder that runs
    # on while Redis forgets its lock (restart without persistence) is told at its next renewal
    if (fault.short or fault.long) and row["stale_told_next"] < row["stale_holders"]:
        missed.append("told")
    if row["overrun_ms"] > (SOCKET_TIMEOUT + ROUND_TRIP) * 1000:
        missed.append("wait")
    cph, base = row["commands_per_handoff"], (baseline or {}).get("commands_per_handoff")
    if cph is not None and base and cph > FLAT * base and fault.baseline_load:
        missed.append("commands")
    if row["hung"]:
        missed.append("hung")
    if row.get("permit_over_untold") or (row.get("permit_over") and not fault.may_overlap):
        missed.append("permits")
    if row.get("shape", "exclusive") != "exclusive" and row.get("token_regressions") and not fault.forgets:
        missed.append("tokens")
    return missed


def judge(rows: list[dict], faults: dict) -> None:
    """Fill in each row's `misses`, against the same library's no-fault row on its deployment (and shape) when there
    is one."""
    def where(r: dict) -> tuple[str, str, str]:
        return r.get("deployment", "single"), r["library"], r.get("shape", "exclusive")

    baselines = {where(r): r for r in rows if r["fault"] == "none"}
    for r in rows:
        r["misses"] = ", ".join(misses(r, faults[r["fault"]], baselines.get(where(r)))) or "none"


def markdown(rows: list[dict], deployments: bool = False) -> str:
    """The table; with `deployments`, a first column names each row's deployment; shape columns when any row has one."""
    shaped = any(r.get("shape", "exclusive") != "exclusive" for r in rows)
    columns = [("deployment", "deployment")] * deployments + COLUMNS[:2] + SHAPE_COLUMNS[:1] * shaped + COLUMNS[2:]
    if shaped:
        columns[-1:-1] = SHAPE_COLUMNS[1:] + [("token_regressions", "token regressions")]
    lines = ["| " + " | ".join(title for _, title in columns) + " |",
             "|" + "---|" * len(columns)]
    for r in rows:
        cells = []
        for key, _ in columns:
            value = r.get(key)
            if key == "unsafe" and value:
                value = f"**{value}**"
            cells.append("–" if value is None else str(value))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
