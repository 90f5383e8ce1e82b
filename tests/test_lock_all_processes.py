"""lock_all across OS processes: two processes naming the same keys in opposite orders never wait each other out.

Each child (`_lock_all_child.py`) has its own event loop and LockManager;
all start at one instant (a `go` pushed in Redis once every child said it is
ready). With `lock_all` both take the keys in the canonical order, so
neither ever waits on the other in a circle: no attempt times out or is
refused, and each key has one holder at a time with growing tokens. The
control stacks `lock()` by hand in the same opposite orders: there the
waits do cross, and each crossing is refused at once (`LockDeadlock`),
never waited out: proof that the first test's orders really were opposite.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

import pytest

from _proc_helpers import assert_one_holder_at_a_time

pytestmark = pytest.mark.timeout(120)

HERE = Path(__file__).resolve().parent
KEYS = ["account:1", "account:2", "account:3"]
WAIT = 30.0  # a wait nobody should come near: a crossing that is not refused shows as a LockTimeout after it


async def run(redis_client, url: str, how: str, count: int, tasks: int = 3) -> list[dict]:
    """Two children, one naming KEYS in order and one reversed, started at once; every line they printed."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(HERE.parent), os.environ.get("PYTHONPATH")]))}
    specs = [{"url": url, "keys": order, "count": count, "tasks": tasks, "how": how, "wait": WAIT}
             for order in (KEYS, KEYS[::-1])]
    procs = [await asyncio.create_subprocess_exec(sys.executable, str(HERE / "_lock_all_child.py"), json.dumps(spec),
                                                  stdout=asyncio.subprocess.PIPE, env=env) for spec in specs]
    try:
        for proc in procs:
            assert proc.stdout is not None
            line = await asyncio.wait_for(proc.stdout.readline(), 60)
            assert json.loads(line or b"{}") == {"ready": True}, line
        await redis_client.lpush("go", *["go"] * len(procs))
        outputs = await asyncio.wait_for(asyncio.gather(*(p.communicate() for p in procs)), 90)
    finally:
        for proc in procs:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
    lines = []
    for out, _ in outputs:
        said = [json.loads(line) for line in out.decode().splitlines()]
        assert said and said[-1] == {"done": True}, said[-3:]
        lines += said[:-1]
    return lines


async def test_opposite_orders_in_two_processes_never_time_out(redis_url, redis_client):
    count, tasks = 40, 3
    lines = await run(redis_client, redis_url, "lock_all", count, tasks)
    assert [line for line in lines if "refused" in line] == []
    holds = [line for line in lines if "key" in line]
    assert len(holds) == 2 * tasks * count * len(KEYS)  # every attempt held every key
    assert_one_holder_at_a_time(holds)


async def test_the_same_orders_stacked_by_hand_cross_and_are_refused_at_once(redis_url, redis_client):
    lines = await run(redis_client, redis_url, "by_hand", 40)
    refused = [line["refused"] for line in lines if "refused" in line]
    assert refused, "the opposite orders never crossed: the lock_all test above would prove nothing"
    assert set(refused) == {"LockDeadlock"}, f"crossings waited out their wait: {refused}"
    assert_one_holder_at_a_time([line for line in lines if "key" in line])
