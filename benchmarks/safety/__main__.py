"""`python -m benchmarks.safety --quick|--full [--deployment ...]`: run the checker, print the table.

`--full` on a single Redis (the default) rewrites docs/safety.md's peer
comparison; `--full --deployment all` rewrites its per-deployment table.
`--shape lock_all,rw,permits` runs the shapes beyond the mutex instead of
the exclusive lock (otel-lock, and its controls `unlocked` and
`otel-lock-loose`); with `--full` it rewrites docs/safety.md's shapes table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

from benchmarks._report import update_docs
from otel_lock.cli._redis_server import use_server

from . import DEPLOYMENTS, FAULTS, FULL, FULL_SETS, PERMITS, QUICK, QUICK_SETS, SHAPES, check
from ._faults import FAILOVER_LEASE, FAILOVER_WINDOW, LONG, SHORT
from ._libs import ANY_DEPLOYMENT, COMPARED, LIBS, SHAPED
from ._report import judge, markdown

DOCS = Path(__file__).resolve().parents[2] / "docs" / "safety.md"


def _commit() -> str:
    """The last commit that changed the lock (otel_lock/), and whether the tree differs from it."""
    out = subprocess.run(["git", "log", "-1", "--format=%h", "--", "otel_lock"], capture_output=True, text=True,
                         cwd=DOCS.parent.parent)
    dirty = subprocess.run(["git", "status", "--porcelain", "--", "otel_lock"], capture_output=True, text=True,
                           cwd=DOCS.parent.parent).stdout.strip()
    return (out.stdout.strip() or "unknown") + (" (otel_lock/ modified)" if dirty else "")


def write_docs(run: dict, block: str = "safety") -> None:
    """Put a run's table into docs/safety.md between the block's markers, labelled with commit and set-up."""
    p = run["profile"]
    several = any(r.get("deployment", "single") != "single" for r in run["rows"])
    failover = (f" (a failover run: L = {FAILOVER_LEASE:g} s, {FAILOVER_WINDOW:g} s, 3 keys, 40% of the holds "
                f"0.5–0.9 L)"
                if several else "")
    header = (f"otel-lock at commit `{run['commit']}` (the last commit that changed `otel_lock/`), {run['date']}: "
              f"{p['procs']} processes x {p['tasks']} tasks, lease L = {p['lease']} s, wait {p['wait']} s, "
              f"{p['window']} s per run{failover}; short stalls {'–'.join(map(str, run['stalls']['short']))} L, "
              f"long {'–'.join(map(str, run['stalls']['long']))} L.\n\n")
    update_docs(DOCS, block, header + markdown(run["rows"], deployments=several))


def main(argv: list[str] | None = None) -> int:
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]  # a run that hangs shows how far it got
    parser = argparse.ArgumentParser(prog="python -m benchmarks.safety", description=__doc__)
    size = parser.add_mutually_exclusive_group(required=True)
    size.add_argument("--quick", action="store_true", help="otel-lock on the CI fault set, ~1 minute")
    size.add_argument("--full", action="store_true", help="every fault and library; rewrites docs/safety.md")
    size.add_argument("--render", type=Path, metavar="JSON",
                      help="no run: judge the rows of a saved --json again and write them into docs/safety.md")
    parser.add_argument("--deployment", default="single", choices=[*DEPLOYMENTS, "all"],
                        help="where the lock runs (default: single); all: each in turn, otel-lock only")
    parser.add_argument("--libs", help=f"comma-separated, of {', '.join(LIBS)}")
    parser.add_argument("--faults", help=f"comma-separated, of {', '.join(FAULTS)}")
    parser.add_argument("--json", type=Path, help="also write the rows as JSON here")
    parser.add_argument("--block", default="safety",
                        help="the docs/safety.md block --render writes (default: safety; "
                             "safety-deployments: the per-deployment table; safety-shapes: the shapes' table)")
    parser.add_argument("--shape", default="exclusive",
                        help=f"comma-separated, of {', '.join(SHAPES)} (default: exclusive, the mutex)")
    parser.add_argument("--permits", type=int, default=PERMITS, help=f"the limit of a permits run (default {PERMITS})")
    args = parser.parse_args(argv)
    shapes = args.shape.split(",")
    for shape in shapes:
        if shape not in SHAPES:
            parser.error(f"unknown shape {shape!r}; choose from {', '.join(SHAPES)}")
    if args.permits < 1:
        parser.error(f"--permits must be at least 1, not {args.permits}")
    if args.deployment in ("redlock", "all") and {"rw", "permits"} & set(shapes):
        parser.error("RedLockManager offers no shared holds or permits (one exclusive owner per quorum round): "
                     "on redlock choose from exclusive, lock_all")
    shaped = shapes != ["exclusive"]

    if args.render:
        run = json.loads(args.render.read_text())
        judge(run["rows"], FAULTS)
        write_docs(run, args.block)
        print(markdown(run["rows"], deployments=args.block != "safety"))
        return 0

    profile = FULL if args.full else QUICK
    deployments = list(DEPLOYMENTS) if args.deployment == "all" else [args.deployment]
    peers = args.full and deployments == ["single"]
    libs = args.libs.split(",") if args.libs else (COMPARED if peers and not shaped else ["otel-lock"])
    for name in libs:
        if name not in LIBS:
            parser.error(f"unknown library {name!r}; choose from {', '.join(LIBS)}")
        if shaped and name not in SHAPED:
            parser.error(f"{name!r} has no shapes beyond the mutex; with --shape choose from {', '.join(SHAPED)}")
        if deployments != ["single"] and name not in ANY_DEPLOYMENT:
            parser.error(f"{name!r} runs on a single Redis only; on {args.deployment} choose from "
                         f"{', '.join(ANY_DEPLOYMENT)}")
    given = args.faults.split(",") if args.faults else None
    for name in given or []:
        if name not in FAULTS:
            parser.error(f"unknown fault {name!r}; choose from {', '.join(FAULTS)}")
        if not set(FAULTS[name].where) & set(deployments):
            parser.error(f"fault {name!r} does not apply to {args.deployment}; it runs on "
                         f"{', '.join(FAULTS[name].where)}")
    sets = FULL_SETS if args.full else QUICK_SETS

    # $OTEL_LOCK_REDIS_SERVER (redis-7.4, valkey-9, ...) becomes `redis-server` for every deployment
    server = use_server()
    print(f"server: {server.name} ({server.version()})")
    began = time.monotonic()
    run = {"commit": _commit(), "server": server.version(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "profile": profile.__dict__, "stalls": {"short": list(SHORT), "long": list(LONG)}, "rows": []}
    for deployment in deployments:
        faults = [f for f in given if deployment in FAULTS[f].where] if given else sets[deployment]
        for shape in shapes:
            run["rows"] += asyncio.run(check(libs, faults, profile, deployment=deployment, shape=shape,
                                             permits=args.permits))
    several = deployments != ["single"]
    print()
    print(markdown(run["rows"], deployments=several))
    print(f"{len(run['rows'])} runs in {time.monotonic() - began:.0f} s ({profile.name}: {profile.procs} processes x "
          f"{profile.tasks} tasks, lease {profile.lease} s, wait {profile.wait} s, {profile.window} s per run)")
    if args.json:
        args.json.write_text(json.dumps(run, indent=1))
    if args.full and shaped and args.deployment == "single":
        write_docs(run, "safety-shapes")
    elif args.full and not (args.libs or args.faults) and args.deployment in ("single", "all"):
        write_docs(run, "safety" if args.deployment == "single" else "safety-deployments")
    unsafe = sum(r["unsafe"] for r in run["rows"] if r["library"] == "otel-lock")
    return 1 if unsafe else 0


if __name__ == "__main__":
    sys.exit(main())
