"""One benchmark worker process: set up, say "ready", wait for the start line, run, print JSON.

The parent starts every worker, waits until all are ready, then sends each the
same monotonic start/stop times (CLOCK_MONOTONIC is system-wide on Linux, so
hold intervals recorded in different processes can be compared directly).

    python -m benchmarks._worker '{"mode": "contend", "lib": "otel-lock", ...}'
"""

from __future__ import annotations

import asyncio
import contextlib
import cProfile
import itertools
import json
import sys
import threading
import time

from . import _counting
from ._adapters import ADAPTERS

WARMUP_CYCLES = 200


def _send(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def _await_start() -> tuple[float, float]:
    line = sys.stdin.readline()
    msg = json.loads(line)
    return msg["start"], msg["stop"]


class _Window:
    """Counters and CPU time at the start and at the stop of the measured window."""

    def __init__(self, stop: float) -> None:
        self.begin = self._now()
        self.end: dict | None = None
        self._timer = threading.Timer(max(0.0, stop - time.monotonic()), self._close)
        self._timer.daemon = True
        self._timer.start()

    @staticmethod
    def _now() -> dict:
        return {"cpu": time.process_time(), "t": time.monotonic(), "sleeps": _counting.sleeps(), **_counting.Counts.snapshot()}

    def _close(self) -> None:
        self.end = self._now()

    def delta(self) -> dict:
        self._timer.join()
        return {k: self.end[k] - self.begin[k] for k in self.begin}


def _sleep_until(t: float) -> None:
    time.sleep(max(0.0, t - time.monotonic()))


# -- (a) uncontended cycles -------------------------------------------------

async def _cycle_async(adapter, key: str, stop: float) -> list[float]:
    durations = []
    clock = time.perf_counter
    while time.monotonic() < stop:
        t0 = clock()
        async with adapter.lock(key, 5.0):
            pass
        durations.append(clock() - t0)
    return durations


def _cycle_sync(adapter, key: str, stop: float) -> list[float]:
    durations = []
    clock = time.perf_counter
    while time.monotonic() < stop:
        t0 = clock()
        with adapter.lock(key, 5.0):
            pass
        durations.append(clock() - t0)
    return durations


# -- (b), (d) contention ----------------------------------------------------

def _warm_keys(keys: list[str], wid: int) -> list[str]:
    """One private key per contended key, in the same hash slot (a cluster node's connection is then open)."""
    from redis.crc import key_slot

    out = []
    for key in keys:
        slot = key_slot(key.encode())
        out.append(next(k for i in itertools.count() if key_slot((k := f"warm:{wid}:{i}").encode()) == slot))
    return out


# A worker with several keys takes them in turn, starting at its own offset, so every key is contended
# by all workers over time; a record is (worker, requested, entered, left, key index).

async def _contend_async(adapter, keys: list[str], wid: int, warmed: list, go: asyncio.Event, window: dict,
                         out: list, hold_other: bool = False) -> None:
    # warm-up on private keys first, so connections are open before the clock starts
    for warm in _warm_keys(keys, wid):
        async with adapter.lock(warm, 5.0):
            pass
    # `hold_other`: hold a key of its own through the run, so that every wait is a wait by a holder
    # (otel-lock's deadlock check runs for those only)
    async with adapter.lock(f"bench:own:{wid}", 5.0) if hold_other else contextlib.nullcontext():
        warmed[0] -= 1
        if warmed[0] == 0:
            warmed[1].set()
        await go.wait()
        await _contend_loop(adapter, keys, wid, window, out)


async def _contend_loop(adapter, keys: list[str], wid: int, window: dict, out: list) -> None:
    stop = window["stop"]
    mono = time.monotonic
    counter = 0
    turn = wid
    while (req := mono()) < stop:
        index = turn % len(keys)
        turn += 1
        try:
            async with adapter.lock(keys[index], min(stop - req, 10.0)):
                enter = mono()
                counter += 1  # the critical section: a local increment
                leave = mono()
        except adapter.timeouts:
            continue
        if enter < stop:
            out.append((wid, req, enter, leave, index))


def _contend_sync(adapter, keys: list[str], wid: int, warmed: threading.Semaphore, go: threading.Event,
                  window: dict, out: list) -> None:
    for warm in _warm_keys(keys, wid):
        with adapter.lock(warm, 5.0):
            pass
    warmed.release()
    go.wait()
    stop = window["stop"]
    mono = time.monotonic
    counter = 0
    turn = wid
    while (req := mono()) < stop:
        index = turn % len(keys)
        turn += 1
        try:
            with adapter.lock(keys[index], min(stop - req, 10.0)):
                enter = mono()
                counter += 1
                leave = mono()
        except adapter.timeouts:
            continue
        if enter < stop:
            out.append((wid, req, enter, leave, index))


def _adapter(spec: dict):
    # options (e.g. wait_replicas) go to the lock's manager; only otel-lock's adapters take any
    return ADAPTERS[spec["lib"]](spec["url"], **(spec.get("options") or {}))


async def _run_async(spec: dict) -> dict:
    adapter = _adapter(spec)
    await adapter.open()
    key, mode = spec["key"], spec["mode"]
    records: list = []
    go, shared = asyncio.Event(), {}
    if mode == "cycle":
        for _ in range(WARMUP_CYCLES):
            async with adapter.lock(key, 5.0):
                pass
    else:
        base, n = spec["worker_base"], spec["tasks"]
        warmed = [n, asyncio.Event()]
        waiters = asyncio.gather(*(_contend_async(adapter, spec.get("keys") or [key], base + i, warmed, go,
                                                  shared, records, bool(spec.get("hold_other")))
                                   for i in range(n)))
        await warmed[1].wait()
    loop = asyncio.get_running_loop()
    _send({"ready": True})
    start, stop = await loop.run_in_executor(None, _await_start)
    await asyncio.sleep(max(0.0, start - time.monotonic()))
    profiler = cProfile.Profile() if spec.get("profile") else None
    if profiler:
        profiler.enable()
    window = _Window(stop)
    result: dict = {}
    if mode == "cycle":
        result["durations"] = await _cycle_async(adapter, key, stop)
    else:
        shared["stop"] = stop
        go.set()
        await waiters
        result["records"] = records
    if profiler:
        profiler.disable()
        profiler.dump_stats(spec["profile"])
    result["window"] = window.delta()
    await adapter.close()
    return result


def _run_sync(spec: dict) -> dict:
    adapter = _adapter(spec)
    adapter.open()
    key, mode = spec["key"], spec["mode"]
    records: list = []
    threads: list[threading.Thread] = []
    go, shared = threading.Event(), {}
    if mode == "cycle":
        for _ in range(WARMUP_CYCLES):
            with adapter.lock(key, 5.0):
                pass
    else:
        # a sync lock blocks its thread, so each waiter is a thread
        base, n = spec["worker_base"], spec["tasks"]
        warmed = threading.Semaphore(0)
        threads = [
            threading.Thread(target=_contend_sync,
                             args=(adapter, spec.get("keys") or [key], base + i, warmed, go, shared, records),
                             daemon=True)
            for i in range(n)
        ]
        for t in threads:
            t.start()
        for _ in range(n):
            warmed.acquire()
    _send({"ready": True})
    start, stop = _await_start()
    shared["stop"] = stop
    _sleep_until(start)
    window = _Window(stop)
    result: dict = {}
    if mode == "cycle":
        result["durations"] = _cycle_sync(adapter, key, stop)
    else:
        go.set()
        for t in threads:
            t.join()
        result["records"] = records
    result["window"] = window.delta()
    adapter.close()
    return result


def main() -> None:
    spec = json.loads(sys.argv[1])
    if spec.get("count"):
        _counting.install()
    if spec.get("telemetry"):
        from ._otel_modes import install

        install(spec["telemetry"])
    if spec["mode"] in ("held", "ring", "many"):
        from importlib import import_module

        result = import_module(f"benchmarks._{spec['mode']}").run(spec, _send, _await_start)
    elif ADAPTERS[spec["lib"]].sync:
        result = _run_sync(spec)
    else:
        result = asyncio.run(_run_async(spec))
    _send({"result": result})


if __name__ == "__main__":
    main()
