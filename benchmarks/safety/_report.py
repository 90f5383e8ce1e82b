"""From one run's records to one table row, and rows to markdown."""

from __future__ import annotations

from ._overlaps import summarise, wait_overrun

COLUMNS = [
    ("library", "library"), ("fault", "fault"), ("holds", "holds"), ("overlaps", "overlaps"), ("told", "told"),
    ("fenced", "fenced"), ("unsafe", "untold & unfenced"), ("next_await", "stale told by next await"),
    ("max_overlap_ms", "max overlap ms"), ("overrun_ms", "max wait overrun ms"),
    ("commands_per_handoff", "commands / handoff"), ("failed", "timeouts / errors"), ("hung", "hung"),
]


def row(run) -> dict:
    summary = summarise(run.holds)
    overruns = [wait_overrun(a["req"], a["ret"], a["wait"], run.pauses.get(a["proc"], [])) for a in run.attempts]
    timeouts = sum(a["outcome"] == "timeout" for a in run.attempts)
    errors = [a["outcome"] for a in run.attempts if a["outcome"] not in ("acquired", "timeout")]
    has_tokens = any(h.token is not None for h in run.holds)
    return {
        "library": run.lib, "fault": run.fault.name, **summary,
        "next_await": f"{summary['stale_told_next']}/{summary['stale_holders']}" if has_tokens else "n/a",
        "max_overlap_ms": round(summary["max_overlap"] * 1000),
        "overrun_ms": round(max(overruns, default=0.0) * 1000),
        "commands": run.meter.total,
        "commands_per_handoff": round(run.meter.total / summary["handoffs"], 1) if summary["handoffs"] else None,
        "timeouts": timeouts, "errors": len(errors), "error_types": sorted(set(errors)),
        "failed": f"{timeouts} / {len(errors)}",
        "hung": run.hung,
        "release_false": sum(h.release is False for h in run.holds),
    }


def markdown(rows: list[dict]) -> str:
    lines = ["| " + " | ".join(title for _, title in COLUMNS) + " |",
             "|" + "---|" * len(COLUMNS)]
    for r in rows:
        cells = []
        for key, _ in COLUMNS:
            value = r.get(key)
            if key == "unsafe" and value:
                value = f"**{value}**"
            cells.append("–" if value is None else str(value))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
