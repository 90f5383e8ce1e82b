"""One contending process: M tasks (threads for a sync library) take the key in a loop and report every hold.

    python -m benchmarks.safety._worker '{"lib": "otel-lock", "url": ..., "keys": ["safety"], "tasks": 4, ...}'

It prints "ready", waits for a "go" line with the monotonic stop time, then
writes one JSON event per line: `start` the moment a task holds the lock (so the
parent knows who holds, to stop or kill it), `hold` when the hold is over,
`attempt` for an acquire that timed out or failed, and `pause` for every
interval in which this process blocked its own event loop (the parent does not
count those against the wait bound). Times are time.monotonic(): one clock for
every process on a Linux machine.

`shape` (otel-lock only) says what an attempt takes: `exclusive` (one key,
the default), `lock_all` (2 or 3 of the keys, named in a random order),
`rw` (one key, shared 70% of the time, else exclusive) or `permits` (a
permit of one key, at most `permits` at once). Then `start` and `hold` carry
`parts`: [key, token, mode] for each key held.
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
import threading
import time

from ._libs import LIBS

BODY_STEPS = 3  # awaits in a hold's body, each a little "database call"
STEP = (0.001, 0.003)
LONG_STEP = (0.005, 0.015)  # a long hold: slow async work (never blocking), awaits of 5-15 ms
RETRY_AFTER_ERROR = 0.05
SHARED_SHARE = 0.7  # rw: the share of attempts that ask for a shared hold

_out = threading.Lock()


def emit(ev: str, **fields) -> None:
    line = json.dumps({"ev": ev, **fields}) + "\n"
    with _out:
        sys.stdout.write(line)
        sys.stdout.flush()


class Worker:
    def __init__(self, config: dict) -> None:
        self.config = config
        self.stop = 0.0
        self.holding = 0  # tasks of this process holding the lock right now
        self.rng = random.Random()

    def make_lib(self):
        return LIBS[self.config["lib"]](self.config["url"], self.config["lease"], **self.config.get("options", {}))

    def pick_key(self) -> str:
        """The key of this attempt: the run's one key, or one of the keys a Cluster run spreads over its nodes."""
        return self.rng.choice(self.config["keys"])

    async def take(self, wait: float):
        """One attempt of the run's shape: (held or None, the keys asked for, the mode asked for)."""
        shape = self.config.get("shape", "exclusive")
        if shape == "lock_all":
            keys = self.rng.sample(self.config["keys"], min(len(self.config["keys"]), self.rng.choice((2, 3))))
            return await self.lib.acquire_all(wait, keys), keys, "exclusive"
        key = self.pick_key()
        if shape == "rw" and self.rng.random() < SHARED_SHARE:
            return await self.lib.acquire_shared(wait, key), [key], "shared"
        if shape == "permits":
            return await self.lib.acquire_permit(wait, key, self.config["permits"]), [key], "permit"
        return await self.lib.acquire(wait, key), [key], "exclusive"

    def stall_after_acquire(self) -> float:
        stall = self.config.get("hold_stall")  # [probability, shortest, longest]
        if stall and self.rng.random() < stall[0]:
            return self.rng.uniform(stall[1], stall[2])
        return 0.0

    def body_steps(self) -> list[float]:
        """How long each await of a hold's body lasts: a few ms, or (now and then) a long hold."""
        long_hold = self.config.get("long_hold")  # [probability, shortest, longest]
        if long_hold and self.rng.random() < long_hold[0]:
            total, steps = self.rng.uniform(long_hold[1], long_hold[2]), []
            while sum(steps) < total:
                steps.append(self.rng.uniform(*LONG_STEP))
            return steps
        return [self.rng.uniform(*STEP) for _ in range(BODY_STEPS)]

    def block(self, seconds: float) -> None:
        """Block this thread (the whole event loop, for an async library) and say so."""
        begin = time.monotonic()
        time.sleep(seconds)
        if not self.lib.sync:
            emit("pause", a=begin, b=time.monotonic())

    # -- async libraries -------------------------------------------------------

    async def run_async(self) -> None:
        self.lib = self.make_lib()
        tasks = [asyncio.create_task(self.contend_async(i)) for i in range(self.config["tasks"])]
        if self.config.get("wait_stall"):
            staller = asyncio.create_task(self.stall_while_waiting())
        await asyncio.gather(*tasks)
        if self.config.get("wait_stall"):
            staller.cancel()
        await self.lib.close()

    async def contend_async(self, task: int) -> None:
        wait = self.config["wait"]
        shaped = self.config.get("shape", "exclusive") != "exclusive"
        while time.monotonic() < self.stop:
            req = time.monotonic()
            try:
                held, keys, mode = await self.take(wait)
            except Exception as exc:  # noqa: BLE001 - every failure is a recorded outcome
                emit("attempt", task=task, req=req, ret=time.monotonic(), wait=wait, outcome=type(exc).__name__)
                await asyncio.sleep(RETRY_AFTER_ERROR)
                continue
            ret = time.monotonic()
            if held is None:
                emit("attempt", task=task, req=req, ret=ret, wait=wait, outcome="timeout")
                continue
            parts = (held.parts or [[key, held.token, mode] for key in keys]) if shaped else None
            await self.hold_async(task, keys[0], held, req, ret, parts)

    async def hold_async(self, task: int, key: str, held, req: float, start: float, parts: list | None) -> None:
        self.holding += 1
        steps = self.body_steps()
        shape = {"parts": parts} if parts is not None else {}
        # `plan`: how long the body will run, so that a fault can wait for a hold that will outlast it
        emit("start", task=task, key=key, req=req, start=start, token=held.token, plan=sum(steps), **shape)
        lost_at: list[float] = []
        watcher = None
        if held.lost is not None:
            watcher = asyncio.create_task(held.lost.wait())
            watcher.add_done_callback(lambda t: t.cancelled() or lost_at.append(time.monotonic()))
        marks = []
        stall = self.stall_after_acquire()
        if stall:
            self.block(stall)
        for step in steps:
            await asyncio.sleep(step)
            marks.append((time.monotonic(), bool(held.lost is not None and held.lost.is_set())))
        end = time.monotonic()
        self.holding -= 1
        try:
            release = await self.lib.release(held)
        except Exception as exc:  # noqa: BLE001
            release = type(exc).__name__
        if watcher is not None:
            if not lost_at and held.lost.is_set():
                await asyncio.sleep(0)  # let the watcher note the time it saw the loss
            watcher.cancel()
        emit("hold", task=task, key=key, req=req, start=start, end=end, token=held.token,
             lost_at=lost_at[0] if lost_at else None, release=release, marks=marks, stall=stall, **shape)

    async def stall_while_waiting(self) -> None:
        """Block the loop now and then while this process's tasks wait (and none holds)."""
        probability, shortest, longest = self.config["wait_stall"]
        while True:
            await asyncio.sleep(self.rng.uniform(0.1, 0.4))
            if self.holding == 0 and self.rng.random() < probability:
                self.block(self.rng.uniform(shortest, longest))

    # -- sync libraries (one thread per task) -----------------------------------

    def run_sync(self) -> None:
        self.lib = self.make_lib()
        threads = [threading.Thread(target=self.contend_sync, args=(i,)) for i in range(self.config["tasks"])]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        self.lib.close()

    def contend_sync(self, task: int) -> None:
        wait = self.config["wait"]
        while time.monotonic() < self.stop:
            key = self.pick_key()
            req = time.monotonic()
            try:
                held = self.lib.acquire(wait, key)
            except Exception as exc:  # noqa: BLE001
                emit("attempt", task=task, req=req, ret=time.monotonic(), wait=wait, outcome=type(exc).__name__)
                time.sleep(RETRY_AFTER_ERROR)
                continue
            start = time.monotonic()
            if held is None:
                emit("attempt", task=task, req=req, ret=start, wait=wait, outcome="timeout")
                continue
            emit("start", task=task, key=key, req=req, start=start, token=None)
            stall = self.stall_after_acquire()
            if stall:
                self.block(stall)
            marks = []
            for step in self.body_steps():
                time.sleep(step)
                marks.append((time.monotonic(), False))
            end = time.monotonic()
            try:
                release = self.lib.release(held)
            except Exception as exc:  # noqa: BLE001
                release = type(exc).__name__
            emit("hold", task=task, key=key, req=req, start=start, end=end, token=None, lost_at=None, release=release,
                 marks=marks, stall=stall)


def main() -> None:
    config = json.loads(sys.argv[1])
    worker = Worker(config)
    emit("ready")
    worker.stop = json.loads(sys.stdin.readline())["stop"]
    if LIBS[config["lib"]].sync:
        worker.run_sync()
    else:
        asyncio.run(worker.run_async())
    emit("done")


if __name__ == "__main__":
    main()
