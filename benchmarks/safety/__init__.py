"""The lock safety checker: N processes x M tasks on one key, real faults, every overlap classified.

    python -m benchmarks.safety --quick   # otel-lock, the CI fault set, ~1 minute
    python -m benchmarks.safety --full    # every fault, otel-lock and its peers; rewrites docs/safety.md

See docs/safety.md for what each column means.
"""

from ._faults import FAULTS, QUICK_SET
from ._run import FULL, QUICK, Profile, Run

__all__ = ["FAULTS", "FULL", "QUICK", "QUICK_SET", "Profile", "Run", "check"]


async def check(libs: list[str], faults: list[str], profile: Profile, say=print) -> list[dict]:
    """Run every (library, fault) pair, one after the other; one row each."""
    from ._libs import LIBS
    from ._report import judge, row

    rows = []
    for fault_name in faults:
        fault = FAULTS[fault_name]
        for lib in libs:
            if LIBS[lib].sync and not fault.sync_ok:
                continue
            run = Run(lib, profile, fault)
            await run.execute()
            rows.append(row(run))
            r = rows[-1]
            say(f"{lib:18} {fault_name:18} holds={r['holds']:5} overlaps={r['overlaps']:4} told={r['told']:4} "
                f"fenced={r['fenced']:4} UNSAFE={r['unsafe']:4} overrun={r['overrun_ms']}ms "
                f"cmds/handoff={r['commands_per_handoff']} failed={r['failed']} hung={r['hung']}")
    judge(rows, FAULTS)
    return rows
