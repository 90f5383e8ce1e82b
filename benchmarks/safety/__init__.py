"""The lock safety checker: N processes x M tasks on shared keys, real faults, every overlap classified.

    python -m benchmarks.safety --quick   # otel-lock on one Redis, the CI fault set, ~1 minute
    python -m benchmarks.safety --full    # every fault, otel-lock and its peers; rewrites docs/safety.md
    python -m benchmarks.safety --full --deployment all   # otel-lock on single, Sentinel, Cluster, RedLock(3)

See docs/safety.md for what each column means.
"""

from ._deployments import DEPLOYMENTS
from ._faults import FAULTS, FULL_SETS, QUICK_SET, QUICK_SETS
from ._run import FULL, PERMITS, QUICK, SHAPES, Profile, Run

__all__ = ["DEPLOYMENTS", "FAULTS", "FULL", "FULL_SETS", "PERMITS", "QUICK", "QUICK_SET", "QUICK_SETS", "SHAPES",
           "Profile", "Run", "check"]


async def check(libs: list[str], faults: list[str], profile: Profile, say=print,
                deployment: str = "single", shape: str = "exclusive", permits: int = PERMITS) -> list[dict]:
    """Run every (library, fault) pair on one deployment and shape, one after the other; one row each."""
    from ._libs import LIBS
    from ._report import judge, row

    rows = []
    for fault_name in faults:
        fault = FAULTS[fault_name]
        if deployment not in fault.where:
            continue
        for lib in libs:
            if LIBS[lib].sync and not fault.sync_ok:
                continue
            run = Run(lib, profile, fault, deployment, shape, permits)
            await run.execute()
            rows.append(row(run))
            r = rows[-1]
            say(f"{deployment:8} {shape:9} {lib:18} {fault_name:21} holds={r['holds']:5} overlaps={r['overlaps']:4} "
                f"told={r['told']:4} fenced={r['fenced']:4} UNSAFE={r['unsafe']:4} overrun={r['overrun_ms']}ms "
                f"cmds/handoff={r['commands_per_handoff']} failed={r['failed']} hung={r['hung']} injected={r['injected']}"
                + (f" shared-together={r['shared_together']} permits={r['permits_seen']} "
                   f"regressions={r['token_regressions']}" if shape != "exclusive" else ""))
    judge(rows, FAULTS)
    return rows
