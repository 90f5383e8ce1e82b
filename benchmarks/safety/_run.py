"""One checker run: a deployment, N worker processes on its keys, one fault, then the records and Redis's counters.

Everything the run starts (redis-servers, sentinels, workers, proxies) it stops by pid or
handle before it returns, whatever happened.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import redis.asyncio as aioredis

from ._deployments import DEPLOYMENTS, Server  # noqa: F401 - Server: where it used to be
from ._overlaps import Hold
from ._proxy import Proxy

ROOT = Path(__file__).resolve().parents[2]
READY_TIMEOUT = 60.0
NOT_THE_LOCKS_WORK = ("info", "config", "client", "cluster", "psetex", "hello", "auth", "select", "script|load")


@dataclass
class Profile:
    name: str
    procs: int
    tasks: int
    lease: float
    wait: float
    window: float


QUICK = Profile("quick", procs=3, tasks=3, lease=1.0, wait=2.0, window=3.0)
FULL = Profile("full", procs=4, tasks=4, lease=2.0, wait=3.0, window=8.0)

SHAPES = ("exclusive", "lock_all", "rw", "permits")  # what each attempt takes (benchmarks/safety/_worker.py)
PERMITS = 2  # the limit of a `permits` run
LOCK_ALL_KEYS = 4  # a lock_all run's small key set: every attempt takes 2 or 3 of them


def shape_keys(shape: str, keys: list[str]) -> list[str]:
    """The keys a shape's workers contend for: lock_all's small set, else the deployment's keys."""
    if shape != "lock_all" or len(keys) >= LOCK_ALL_KEYS:
        return keys
    return [f"{keys[0]}-{i}" for i in range(LOCK_ALL_KEYS)]


def holds_of(proc: int, event: dict, end: float, **recorded) -> list[Hold]:
    """The Holds of one `hold` (or still open `start`) event: one per key it held."""
    parts = event.get("parts") or [[event.get("key", ""), event["token"], "exclusive"]]
    # A lock_all hold starts when its last key is held, its first ones earlier, each after a wait of its own:
    # none of its keys has a request time to measure idle by (max_idle leaves them out)
    requested = event.get("req") if len(parts) == 1 else None
    return [Hold(proc, event["task"], event["start"], end, token, key=key, mode=mode, requested=requested,
                 **recorded) for key, token, mode in parts]


class Meter:
    """Redis commands over the run from INFO commandstats of every master, summed over restarts and failovers.

    A fault that takes a master away banks its count first (`pause(url)`), and
    starts counting the one that replaces it (`begin([url])`); a replica is
    never counted, as it replays its master's writes.
    """

    def __init__(self, masters) -> None:
        self.masters = masters  # () -> the URLs of the masters now
        self.total = 0
        self._base: dict[str, int] = {}

    @staticmethod
    async def _calls(url: str) -> int:
        client = aioredis.Redis.from_url(url, socket_timeout=5)
        try:
            stats = await client.info("commandstats")
        finally:
            await client.aclose()
        # our own INFO/CONFIG/CLIENT/CLUSTER calls are not the locks' work, nor the evict fault's
        # filler (PSETEX); nor is a connection's handshake (HELLO, AUTH, SELECT, CLIENT SETNAME, SCRIPT
        # LOAD), which client-kill makes every client repeat every ~0.3 s whatever the handoff rate
        return sum(v["calls"] for k, v in stats.items()
                   if not k.removeprefix("cmdstat_").startswith(NOT_THE_LOCKS_WORK))

    async def begin(self, urls: list[str] | None = None) -> None:
        """Start counting these masters (all of them now, without URLs); one counted already is left alone."""
        for url in self.masters() if urls is None else urls:
            if url not in self._base:
                self._base[url] = await self._calls(url)

    async def pause(self, url: str | None = None) -> None:
        """Before a master goes away: bank what it counted (every master's, without a URL)."""
        for u in list(self._base) if url is None else [url]:
            base = self._base.pop(u, None)
            if base is not None:
                with contextlib.suppress(Exception):
                    self.total += await self._calls(u) - base

    async def end(self) -> None:
        await self.pause()


@dataclass
class WorkerProc:
    index: int
    proc: asyncio.subprocess.Process
    proxy: Proxy | None
    stderr: object
    holding: set[int] = field(default_factory=set)
    open: dict[int, dict] = field(default_factory=dict)  # task -> its `start` event, until `hold`
    done: bool = False
    killed_at: float | None = None

    @property
    def pid(self) -> int:
        return self.proc.pid


class Run:
    """The state one fault injector acts on, and the records the workers send."""

    def __init__(self, lib: str, profile: Profile, fault, deployment: str = "single", shape: str = "exclusive",
                 permits: int = PERMITS) -> None:
        self.lib, self.profile, self.fault = lib, profile, fault
        self.shape, self.permits = shape, permits
        self.deployment = DEPLOYMENTS[deployment](fault)
        # a failover must fit in the window, with time to work on after it
        self.window = max(profile.window, fault.min_window)
        self.lease = max(profile.lease, fault.min_lease)
        self.workers: list[WorkerProc] = []
        self.holds: list[Hold] = []
        self.attempts: list[dict] = []
        self.pauses: dict[int, list[tuple[float, float]]] = {}
        self.readers: list[asyncio.Task] = []
        self.stop = 0.0
        self.hung = 0
        self._spawned = 0
        self.injected = 0  # failovers, migrations, master kills the fault carried out (what it claims happened)
        self.meter: Meter | None = None
        self._background: set[asyncio.Task] = set()

    # -- what injectors use ------------------------------------------------------

    @property
    def server(self) -> Server:
        """The one Redis of a single-Redis run (the faults that crash it or proxy to it)."""
        return self.deployment.server

    def live(self) -> list[WorkerProc]:
        return [w for w in self.workers if w.killed_at is None and not w.done]

    def holders(self) -> list[WorkerProc]:
        return [w for w in self.live() if w.holding]

    def waiters(self) -> list[WorkerProc]:
        return [w for w in self.live() if not w.holding]

    def background(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def pause(self, worker: WorkerProc, begin: float, end: float) -> None:
        self.pauses.setdefault(worker.index, []).append((begin, end))

    async def kill(self, worker: WorkerProc) -> None:
        worker.killed_at = time.monotonic()
        with contextlib.suppress(ProcessLookupError):
            worker.proc.send_signal(signal.SIGKILL)
        await worker.proc.wait()

    async def spawn(self, go: bool = True) -> WorkerProc:
        # taken before the first await: spawns run concurrently, and each process needs its own index
        # (holds of one (process, task) are never compared with each other)
        index = self._spawned
        self._spawned += 1
        proxy = await Proxy("127.0.0.1", self.server.port).start() if self.fault.proxy else None
        config = {"lib": self.lib, "url": proxy.url if proxy else self.deployment.url,
                  "keys": shape_keys(self.shape, self.deployment.keys), "shape": self.shape, "permits": self.permits,
                  "tasks": self.profile.tasks, "lease": self.lease, "wait": self.profile.wait,
                  "options": self.fault.options or {}, **self.fault.worker(self.lease)}
        stderr = tempfile.TemporaryFile()  # the libraries log every lost lease; shown only if a worker crashes
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "benchmarks.safety._worker", json.dumps(config), cwd=ROOT, env=env,
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=stderr, limit=1 << 24)
        worker = WorkerProc(index, proc, proxy, stderr)
        self.workers.append(worker)
        line = await asyncio.wait_for(proc.stdout.readline(), READY_TIMEOUT)
        if json.loads(line or "{}").get("ev") != "ready":
            raise RuntimeError(f"worker {index} did not start ({self.lib})")
        self.readers.append(asyncio.create_task(self._read(worker)))
        if go:
            self.go(worker)
        return worker

    def go(self, worker: WorkerProc) -> None:
        worker.proc.stdin.write((json.dumps({"stop": self.stop}) + "\n").encode())

    # -- records -------------------------------------------------------------------

    async def _read(self, worker: WorkerProc) -> None:
        while line := await worker.proc.stdout.readline():
            self._event(worker, json.loads(line))

    def _event(self, worker: WorkerProc, event: dict) -> None:
        kind = event.pop("ev")
        if kind == "start":
            worker.holding.add(event["task"])
            worker.open[event["task"]] = event
        elif kind == "hold":
            worker.holding.discard(event["task"])
            worker.open.pop(event["task"], None)
            self.holds += holds_of(worker.index, event, event["end"], lost_at=event["lost_at"],
                                   release=event["release"], marks=[tuple(m) for m in event["marks"]],
                                   stall=event["stall"])
            self.attempts.append({"proc": worker.index, "req": event["req"], "ret": event["start"],
                                  "wait": self.profile.wait, "outcome": "acquired"})
        elif kind == "attempt":
            self.attempts.append({"proc": worker.index, **event})
        elif kind == "pause":
            self.pause(worker, event["a"], event["b"])
        elif kind == "done":
            worker.done = True

    def _close_open_holds(self) -> None:
        """A killed holder held until it died: its hold ends at the kill, untold."""
        for worker in self.workers:
            end = worker.killed_at or time.monotonic()
            for start in worker.open.values():
                self.holds += holds_of(worker.index, start, end, release="killed")
            worker.open.clear()

    # -- the run -------------------------------------------------------------------

    async def execute(self) -> None:
        """One run, bounded as a whole: a run that outlives its bound counts as hung, and is torn down."""
        bound = READY_TIMEOUT + self.window + self.profile.wait + self.lease + 60.0
        try:
            async with asyncio.timeout(bound):
                await self._execute()
        except TimeoutError:
            print(f"run {self.lib} / {self.fault.name}: not done within {bound:.0f} s, torn down", file=sys.stderr,
                  flush=True)
            self.hung += 1
            await self._teardown()
        self._close_open_holds()

    async def _execute(self) -> None:
        try:
            await self.deployment.start()
            self.meter = Meter(self.deployment.masters)
            self.stop = float("inf")  # set before "go"
            await asyncio.gather(*(self.spawn(go=False) for _ in range(self.profile.procs)))
            await self.meter.begin()
            begin = time.monotonic() + 0.1
            self.stop = begin + self.window
            for worker in self.workers:
                self.go(worker)
            await asyncio.sleep(0.1)
            injector = asyncio.create_task(self.fault.inject(self))
            await asyncio.sleep(max(0.0, self.stop - time.monotonic()))
            injector.cancel()
            # Never awaited bare: a fault's clean-up that hangs must not hang the run, and the run's own
            # bound (a cancellation of this task) must not be swallowed with the injector's.
            await asyncio.wait([injector], timeout=10.0)
            await self.fault.heal(self)
            await self._drain()
            await self.meter.end()
        finally:
            await self._teardown()

    async def _drain(self) -> None:
        """Workers finish their last attempt (bounded by wait); one still running after that is hung."""
        bound = self.profile.wait + self.lease + 5.0
        # replacements still starting (a killed holder's) are workers too: wait for them first
        if self._background:
            await asyncio.wait(list(self._background), timeout=READY_TIMEOUT)
        procs = [w for w in self.workers if w.killed_at is None]
        done, pending = await asyncio.wait([asyncio.create_task(w.proc.wait()) for w in procs], timeout=bound)
        for task in pending:
            task.cancel()
        for worker in procs:
            if worker.proc.returncode is None:
                self.hung += 1
                await self.kill(worker)
        await asyncio.gather(*self.readers, return_exceptions=True)

    async def _teardown(self) -> None:
        for task in self._background:
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        for worker in self.workers:
            if worker.proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    worker.proc.send_signal(signal.SIGCONT)
                    worker.proc.send_signal(signal.SIGKILL)
                await worker.proc.wait()
            if worker.proxy is not None:
                await worker.proxy.aclose()
            if worker.proc.returncode and worker.killed_at is None:
                worker.stderr.seek(0)
                tail = worker.stderr.read().decode(errors="replace")[-3000:]
                print(f"worker {worker.index} ({self.lib}) exited with {worker.proc.returncode}:\n{tail}",
                      file=sys.stderr)
            worker.stderr.close()
        for task in self.readers:
            task.cancel()
        await asyncio.gather(*self.readers, return_exceptions=True)
        await self.deployment.stop()
