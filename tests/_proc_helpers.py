"""Helpers for the multi-process and fault tests of the lock core.

`Agent` runs this file as a child process with its own event loop and its own
`LockManager.from_url(url)`. The parent drives it with one JSON command per
line on stdin and reads one JSON event per line from stdout, so tests
synchronise on what the child reports (acquired, lost, ...), never on sleeps.
`TcpProxy` sits between a client and Redis and can stall or cut the traffic.
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
from pathlib import Path

from benchmarks._sentinel_set import until as _until
from benchmarks.safety._proxy import TcpProxy  # noqa: F401  (tests import it from here)

HERE = Path(__file__).resolve()
ROOT = HERE.parent.parent

# Generous bounds: they only turn a hang into a failure, they are not timings.
DEADLINE = 20.0


# -- parent side -------------------------------------------------------------


class AgentError(AssertionError):
    pass


class Agent:
    """A child process holding one LockManager; see `_child` for the commands."""

    def __init__(self, name: str, proc: asyncio.subprocess.Process, stderr) -> None:
        self.name = name
        self.proc = proc
        self.pid = proc.pid
        self._stderr = stderr
        self._events: list[dict] = []

    @classmethod
    async def start(cls, name: str, url: str, **options) -> "Agent":
        stderr = tempfile.TemporaryFile()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        proc = await asyncio.create_subprocess_exec(
            sys.executable, str(HERE), json.dumps({"url": url, "name": name, "options": options}),
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=stderr, env=env,
        )
        agent = cls(name, proc, stderr)
        try:
            await agent.expect("ready")
        except BaseException:
            await agent.close()  # not handed to anyone who would close it: its process, pipes and file go now
            raise
        return agent

    async def send(self, op: str, **fields) -> None:
        self.proc.stdin.write((json.dumps({"op": op, **fields}) + "\n").encode())
        await self.proc.stdin.drain()

    async def expect(self, ev: str | tuple[str, ...], id: str | None = None, timeout: float = DEADLINE) -> dict:
        """The first not yet consumed event `ev` (or any of several) for `id`, reading more lines as needed."""
        wanted = (ev,) if isinstance(ev, str) else ev

        def match(event: dict) -> bool:
            return event["ev"] in wanted and (id is None or event.get("id") == id)

        try:
            async with asyncio.timeout(timeout):
                while True:
                    for event in self._events:
                        if event["ev"] == "error":
                            raise AgentError(f"agent {self.name} failed: {event}; stderr:\n{self.stderr()}")
                        if match(event):
                            self._events.remove(event)
                            return event
                    line = await self.proc.stdout.readline()
                    if not line:
                        await self.proc.wait()
                        raise AgentError(f"agent {self.name} exited ({self.proc.returncode}) while we waited "
                                         f"for {ev!r}; events {self._events}; stderr:\n{self.stderr()}")
                    self._events.append(json.loads(line))
        except TimeoutError:
            raise AgentError(f"agent {self.name} did not report {ev!r} ({id}) within {timeout}s; "
                             f"events {self._events}; stderr:\n{self.stderr()}") from None

    def pending_events(self) -> list[dict]:
        return list(self._events)

    def stderr(self) -> str:
        self._stderr.seek(0)
        return self._stderr.read().decode(errors="replace")[-4000:]

    def signal(self, sig: int) -> None:
        os.kill(self.pid, sig)

    async def close(self) -> None:
        """Ask politely, then SIGKILL; always reap the process (no ResourceWarning)."""
        if self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGCONT)
            with contextlib.suppress(Exception):
                await self.send("exit")
            try:
                async with asyncio.timeout(5):
                    await self.proc.wait()
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    self.proc.kill()
                await self.proc.wait()
        self.proc.stdin.close()
        with contextlib.suppress(Exception):
            await self.proc.stdin.wait_closed()
        self._stderr.close()


class Agents:
    """Starts agents and closes every one of them, whatever the test did."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.all: list[Agent] = []

    async def start(self, name: str, url: str | None = None, **options) -> Agent:
        agent = await Agent.start(name, url or self.url, **options)
        self.all.append(agent)
        return agent

    async def start_many(self, names: list[str], **options) -> list[Agent]:
        """Start several at once (they import in parallel); none is leaked if one fails."""
        started = await asyncio.gather(*(Agent.start(n, self.url, **options) for n in names),
                                       return_exceptions=True)
        self.all.extend(a for a in started if isinstance(a, Agent))
        for result in started:
            if isinstance(result, BaseException):
                raise result
        return list(started)

    async def close(self) -> None:
        await asyncio.gather(*(a.close() for a in self.all))


async def until(predicate, what: str, timeout: float = DEADLINE, every: float = 0.005):
    """Poll an async predicate (Redis state) until it holds; fail instead of hanging."""
    return await _until(predicate, what, timeout, every)


# -- a TCP proxy that can stall or cut -------------------------------------------


NS = "otel-lock"


async def run_holders(spec: dict, processes: int, bound: float = 60.0) -> list[dict]:
    """Run `processes` copies of `_holder_child.py` with `spec`; every hold they report."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    procs = [await asyncio.create_subprocess_exec(sys.executable, str(HERE.parent / "_holder_child.py"),
                                                  json.dumps(spec), stdout=asyncio.subprocess.PIPE, env=env)
             for _ in range(processes)]
    try:
        outputs = await asyncio.wait_for(asyncio.gather(*(p.communicate() for p in procs)), bound)
    finally:
        for proc in procs:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
    holds = []
    for out, _ in outputs:
        lines = [json.loads(line) for line in out.decode().splitlines()]
        assert lines and lines[-1] == {"done": True}, lines[-3:]
        holds.extend(lines[:-1])
    return holds


def assert_one_holder_at_a_time(holds: list[dict]) -> None:
    """Per key: no two hold intervals overlap, and a later holder has a higher fencing token."""
    by_key: dict[str, list[dict]] = {}
    for hold in holds:
        by_key.setdefault(hold["key"], []).append(hold)
    for key_holds in by_key.values():
        key_holds.sort(key=lambda h: h["start"])
        for before, after in zip(key_holds, key_holds[1:]):
            assert before["end"] <= after["start"], (before, after)  # no two holders at once
            assert before["token"] < after["token"], (before, after)  # and the later one is fenced above


def keys(name: str) -> tuple[str, str, str]:
    """The lock's hash, queue and waiter keys in the default namespace."""
    lock = f"{NS}:{{{name}}}"
    return lock, lock + ":q", lock + ":w"


async def queued(redis, name: str, n: int) -> None:
    """Wait until `n` callers are in the lock's Redis queue."""
    async def check():
        return await redis.zcard(keys(name)[1]) == n
    await until(check, f"{n} queued on {name}")


async def entered_instead_of_queueing(agent: "Agent", redis, name: str, id: str) -> dict | None:
    """After `agent`'s waiter `id` was handed a grant it read too late: its 'acquired' event if it entered on it.

    A waiter that does not trust the stale grant asks Redis again and, the lock
    being someone else's, joins the queue again: that is the event waited
    for (never a quiet period), and an 'acquired' that came first is returned.
    """
    entering = asyncio.ensure_future(agent.expect("acquired", id))
    requeued = asyncio.ensure_future(queued(redis, name, 1))
    try:
        await asyncio.wait({entering, requeued}, return_when=asyncio.FIRST_COMPLETED)
        if entering.done():
            return entering.result()
        requeued.result()  # a waiter that neither entered nor queued again fails here, after DEADLINE
    finally:
        for task in (entering, requeued):
            task.cancel()
        await asyncio.gather(entering, requeued, return_exceptions=True)
    early = [e for e in agent.pending_events() if e["ev"] == "acquired" and e.get("id") == id]
    return early[0] if early else None


# -- child side --------------------------------------------------------------


def _emit(ev: str, **fields) -> None:
    sys.stdout.write(json.dumps({"ev": ev, **fields}) + "\n")
    sys.stdout.flush()


def _attempt_recorder():
    """A span processor that keeps `lock.attempts` of each finished acquire span, by owner."""
    from opentelemetry.sdk.trace import SpanProcessor

    class AttemptRecorder(SpanProcessor):
        def __init__(self) -> None:
            self.attempts: dict[str, int] = {}

        def on_end(self, span) -> None:
            attrs = span.attributes or {}
            if span.name.startswith("lock acquire") and "lock.owner" in attrs:
                self.attempts[attrs["lock.owner"]] = attrs.get("lock.attempts", 0)

    return AttemptRecorder()


async def _child(config: dict) -> None:
    """The agent's loop. Commands (JSON lines on stdin) and the events they report:

    hold {id, key, wait?, lease?, cancel_on_lost?, owner?}: `async with lock()`
        -> acquired {token, owner, t, attempts}, lost {t}, releasing {t}, exited {t},
           or locklost / timeout / unavailable / cancelled
    release {id}: leave the body of hold `id`;  cancel {id}: cancel its task
    chain {id, first, then, wait?}: in one task, hold `first` (-> acquired); on `go {id}` wait for `then`
        inside it -> acquired_then {token}, deadlock {cycle}, or timeout; `release {id}` leaves both
    transfers {id, keys, rounds, log}: `rounds` times lock_all(keys), appending its tokens to the Redis
        list `log` under the locks -> transfers_done, or timeout
    rmw {id, key, counter, use_lock, tasks, iterations} -> rmw_done {intervals}
    fair {id, key, log, total, tasks} -> fair_done {counts}
    block {id, key}: block the event loop in a sync BLPOP on `key` -> blocking
    exit
    Times `t` are time.monotonic(), one clock for every process on the machine.
    """
    from opentelemetry.sdk.trace import TracerProvider

    from otel_lock import LockDeadlock, LockLost, LockManager, LockTimeout, RedisUnavailable

    recorder = _attempt_recorder()
    provider = TracerProvider()
    provider.add_span_processor(recorder)
    tracer = provider.get_tracer("otel-lock test agent")
    locks = LockManager.from_url(config["url"], tracer_provider=provider, **config["options"])
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    release: dict[str, asyncio.Event] = {}
    go: dict[str, asyncio.Event] = {}
    tasks: dict[str, asyncio.Task] = {}

    async def hold_lock(ident: str, key: str, options: dict) -> None:
        async with locks.lock(key, **options) as held:
            _emit("acquired", id=ident, token=held.token, owner=held.owner, t=time.monotonic(),
                  attempts=recorder.attempts.get(held.owner))
            watcher = asyncio.create_task(held.lost.wait())
            done, _ = await asyncio.wait([watcher, asyncio.create_task(release[ident].wait())],
                                         return_when=asyncio.FIRST_COMPLETED)
            if watcher in done:
                _emit("lost", id=ident, t=time.monotonic())
                # keep "holding" (the body still runs) until told to leave
                await release[ident].wait()
            _emit("releasing", id=ident, t=time.monotonic())
        _emit("exited", id=ident, t=time.monotonic())

    async def hold(cmd: dict) -> None:
        ident = cmd["id"]
        release[ident] = asyncio.Event()
        options = {k: cmd[k] for k in ("wait", "lease", "cancel_on_lost", "owner") if k in cmd}
        try:
            # Under a recording span, like a request: acquire spans exist only inside a trace.
            with tracer.start_as_current_span(f"hold {ident}"):
                await hold_lock(ident, cmd["key"], options)
        except LockLost as exc:
            _emit("locklost", id=ident, message=str(exc), t=time.monotonic())
        except LockTimeout:
            _emit("timeout", id=ident)
        except RedisUnavailable as exc:
            _emit("unavailable", id=ident, message=str(exc))
        except asyncio.CancelledError:
            _emit("cancelled", id=ident)
            raise

    async def chain(cmd: dict) -> None:
        ident = cmd["id"]
        release[ident], go[ident] = asyncio.Event(), asyncio.Event()
        async with locks.lock(cmd["first"]) as held:
            _emit("acquired", id=ident, token=held.token, owner=held.owner, t=time.monotonic())
            await go[ident].wait()
            try:
                async with locks.lock(cmd["then"], wait=cmd.get("wait", 60.0)) as then:
                    _emit("acquired_then", id=ident, token=then.token, owner=then.owner)
                    await release[ident].wait()
                    return
            except LockDeadlock as exc:
                _emit("deadlock", id=ident, cycle=[list(step) for step in exc.cycle], key=exc.key, message=str(exc))
            except LockTimeout:
                _emit("timeout", id=ident)
            await release[ident].wait()

    async def transfers(cmd: dict) -> None:
        try:
            for _ in range(cmd["rounds"]):
                async with locks.lock_all(cmd["keys"], wait=30.0) as held:
                    await locks.redis.rpush(cmd["log"], json.dumps(held.tokens))
        except LockTimeout:
            _emit("timeout", id=cmd["id"])
            return
        _emit("transfers_done", id=cmd["id"])

    async def rmw(cmd: dict) -> None:
        """Non-atomic GET, pause, SET of a counter, under the lock or not."""
        intervals: list[tuple[float, float]] = []

        async def worker() -> None:
            for _ in range(cmd["iterations"]):
                if cmd["use_lock"]:
                    async with locks.lock(cmd["key"], wait=60):
                        enter = time.monotonic()
                        await _bump(locks.redis, cmd["counter"])
                        intervals.append((enter, time.monotonic()))
                else:
                    await _bump(locks.redis, cmd["counter"])

        await asyncio.gather(*(worker() for _ in range(cmd["tasks"])))
        _emit("rmw_done", id=cmd["id"], intervals=intervals)

    async def fair(cmd: dict) -> None:
        """Tasks take the lock until `total` acquisitions are logged; the log is the order."""
        counts = {}

        async def worker(wid: str) -> None:
            counts[wid] = 0
            while True:
                async with locks.lock(cmd["key"], wait=60) as held:
                    if await locks.redis.llen(cmd["log"]) >= cmd["total"]:
                        return
                    await locks.redis.rpush(cmd["log"], f"{wid} {held.token}")
                    counts[wid] += 1

        await asyncio.gather(*(worker(f"{config['name']}/{i}") for i in range(cmd["tasks"])))
        _emit("fair_done", id=cmd["id"], counts=counts)

    def run(cmd: dict, coro) -> None:
        task = tasks[cmd["id"]] = asyncio.create_task(coro)
        task.add_done_callback(lambda t: t.cancelled() or t.exception() is None
                               or _emit("error", id=cmd["id"], message=repr(t.exception())))

    _emit("ready", pid=os.getpid())
    while line := await reader.readline():
        cmd = json.loads(line)
        op = cmd["op"]
        if op == "exit":
            break
        if op == "hold":
            run(cmd, hold(cmd))
        elif op == "block":
            # Sync code that blocks the event loop (until the parent pushes to a Redis list).
            import redis as sync_redis
            client = sync_redis.Redis.from_url(config["url"])
            _emit("blocking", id=cmd["id"])
            client.blpop([cmd["key"]], timeout=DEADLINE)
            client.close()
        elif op == "chain":
            run(cmd, chain(cmd))
        elif op == "transfers":
            run(cmd, transfers(cmd))
        elif op == "go":
            go[cmd["id"]].set()
        elif op == "release":
            release[cmd["id"]].set()
        elif op == "cancel":
            tasks[cmd["id"]].cancel()
        elif op == "rmw":
            run(cmd, rmw(cmd))
        elif op == "fair":
            run(cmd, fair(cmd))
        else:
            _emit("error", message=f"unknown op {op!r}")
    for task in tasks.values():
        task.cancel()
    await asyncio.gather(*tasks.values(), return_exceptions=True)
    await locks.aclose()


async def _bump(redis, counter: str) -> None:
    value = int(await redis.get(counter) or 0)
    # A real pause between read and write: without the lock, other processes
    # interleave here and updates are lost.
    await asyncio.sleep(0.001)
    await redis.set(counter, value + 1)


if __name__ == "__main__":
    asyncio.run(_child(json.loads(sys.argv[1])))


def link_of(locks, waiting: bool = False):
    """A manager's link on the current loop (what scripts go over), or its wake-up subscriber: wiring checks."""
    transport = locks._runtimes.here().transport
    return transport.waiting if waiting else transport.link
