"""Permits and shared holds across OS processes: limits never exceeded, crashed holders, no starved writer.

Each child (`_shapes_child.py`) has its own event loop and LockManager, and
records what it sees inside a hold in Redis counters; the test synchronises
on what the children print or on Redis state, never on sleeps.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from pathlib import Path

import pytest

from otel_lock import LockManager

pytestmark = pytest.mark.timeout(120)

HERE = Path(__file__).resolve().parent


async def _spawn(spec: dict) -> asyncio.subprocess.Process:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(HERE.parent), os.environ.get("PYTHONPATH")]))}
    return await asyncio.create_subprocess_exec(sys.executable, str(HERE / "_shapes_child.py"), json.dumps(spec),
                                                stdout=asyncio.subprocess.PIPE, env=env)


async def _run(spec: dict, processes: int, bound: float = 90.0) -> list[dict]:
    """Run `processes` children with `spec` to the end; what each printed before `done`."""
    procs = [await _spawn(spec) for _ in range(processes)]
    try:
        outputs = await asyncio.wait_for(asyncio.gather(*(p.communicate() for p in procs)), bound)
    finally:
        for proc in procs:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
    reports = []
    for out, _ in outputs:
        lines = [json.loads(line) for line in out.decode().splitlines()]
        assert lines and lines[-1] == {"done": True}, lines[-3:]
        reports.extend(lines[:-1])
    return reports


async def _first_line(proc: asyncio.subprocess.Process) -> dict:
    assert proc.stdout is not None
    line = await asyncio.wait_for(proc.stdout.readline(), 30)
    assert line, "the child ended before it reported"
    return json.loads(line)


@pytest.fixture
async def locks(redis_url):
    manager = LockManager.from_url(redis_url, namespace="t")
    yield manager
    await manager.aclose()


async def test_permits_are_never_exceeded_across_processes_and_all_are_used(redis_url, redis_client):
    reports = await _run({"do": "permits", "url": redis_url, "key": "export", "permits": 3, "count": 15,
                          "tasks": 3}, processes=4)
    assert max(r["max"] for r in reports) == 3  # reached, never passed
    tokens = [t for r in reports for t in r["tokens"]]
    assert len(tokens) == 4 * 3 * 15 and len(set(tokens)) == len(tokens)  # a token per grant
    assert int(await redis_client.get("inside")) == 0


async def test_a_killed_holders_permit_returns_at_its_lease(redis_url, locks, redis_client):
    holder = await _spawn({"do": "hold", "url": redis_url, "key": "export", "permits": 1, "lease": 1.0})
    try:
        killed = (await _first_line(holder))["token"]
        holder.send_signal(signal.SIGKILL)
        await holder.wait()
        async with locks.semaphore("export", permits=1, wait=30.0) as held:
            assert held.token > killed
            assert await redis_client.zrange(held.key, 0, -1) == [held.owner.encode()]
    finally:
        if holder.returncode is None:
            holder.kill()
            await holder.wait()


async def test_a_killed_shared_holder_lets_the_writer_in_at_its_lease(redis_url, locks):
    holder = await _spawn({"do": "hold", "url": redis_url, "key": "cat", "shared": True, "lease": 1.0})
    try:
        killed = (await _first_line(holder))["token"]
        holder.send_signal(signal.SIGKILL)
        await holder.wait()
        async with locks.lock("cat", wait=30.0) as writer:
            assert writer.token > killed
    finally:
        if holder.returncode is None:
            holder.kill()
            await holder.wait()


async def test_shared_holders_overlap_and_a_writer_overlaps_nobody(redis_url, redis_client):
    reports = await _run({"do": "rw", "url": redis_url, "key": "cat", "count": 12, "tasks": 6}, processes=3)
    assert int(await redis_client.get("breaches") or 0) == 0
    assert max(r["max_readers"] for r in reports) >= 2  # readers did share the key


async def test_a_writer_is_not_starved_by_a_stream_of_readers(redis_url, locks, redis_client):
    readers = [await _spawn({"do": "read_forever", "url": redis_url, "key": "cat", "tasks": 3}) for _ in range(3)]
    try:
        async with asyncio.timeout(30):
            while int(await redis_client.get("reads") or 0) < 30:  # the stream is flowing
                await asyncio.sleep(0.01)
        async with locks.lock("cat", wait=30.0) as writer:
            assert writer.mode == "exclusive"
            assert await redis_client.hget("t:{cat}", "owner") == writer.owner.encode()
            during = int(await redis_client.get("reads"))
        async with asyncio.timeout(30):
            while int(await redis_client.get("reads")) < during + 10:  # and the readers go on after it
                await asyncio.sleep(0.01)
    finally:
        await redis_client.set("stop", 1)
        for proc in readers:
            try:
                await asyncio.wait_for(proc.communicate(), 30)
            finally:
                if proc.returncode is None:
                    proc.kill()
                    await proc.wait()
