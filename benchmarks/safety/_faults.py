"""The faults, each injected for real while the workers contend.

Stall lengths are fractions of the lease L. "Short" stalls stay under
L minus the renewal interval (L/3), so a renewing lock must show no overlap;
"long" ones outlast L, so overlaps are expected and each must be fenced. The
only other fault that may let two holders overlap is a Redis that comes back
empty; kills, cuts, short stalls and a restart with AOF must not.
"""

from __future__ import annotations

import asyncio
import random
import signal
import time
from dataclasses import dataclass

import redis.asyncio as aioredis

SHORT = (0.25, 0.55)  # x lease: under lease - renewal interval (2/3 L), with room for a round trip
LONG = (1.3, 1.6)  # x lease: past the lease


@dataclass
class Fault:
    name: str
    what: str
    hold_stall: tuple | None = None  # (probability per hold, shortest, longest) in x lease
    wait_stall: tuple | None = None  # (probability per check, shortest, longest) in x lease
    aof: bool = False
    proxy: bool = False
    sync_ok: bool = True  # meaningful for a sync library (threads) too
    act: object = None  # async fn(run, rng) injecting the fault until cancelled
    short: bool = False  # stalls under lease - renewal interval
    long: bool = False  # stalls past the lease: overlaps expected, each stale holder fenced and told at its next await
    forgets: bool = False  # Redis loses the lock (restart without persistence): overlaps expected, each fenced

    @property
    def may_overlap(self) -> bool:
        """Only a stall past the lease or a Redis that forgot the lock may let two holders overlap."""
        return self.long or self.forgets

    def worker(self, profile) -> dict:
        # every run: 5% of holds are long (0.2-0.5 L of async work), so a fault can land inside a hold
        config = {"long_hold": [0.05, 0.2 * profile.lease, 0.5 * profile.lease]}
        if self.hold_stall:
            p, a, b = self.hold_stall
            config["hold_stall"] = [p, a * profile.lease, b * profile.lease]
        if self.wait_stall:
            p, a, b = self.wait_stall
            config["wait_stall"] = [p, a * profile.lease, b * profile.lease]
        return config

    async def inject(self, run) -> None:
        if self.act is not None:
            await self.act(run, random.Random())

    async def heal(self, run) -> None:
        """After the window: let every stopped process and stalled proxy go, so the run can drain."""
        for worker in run.workers:
            if worker.killed_at is None and worker.proc.returncode is None:
                worker.proc.send_signal(signal.SIGCONT)
            if worker.proxy is not None:
                worker.proxy.forward()
        if run.server.process is None:
            await asyncio.to_thread(run.server.start)
            await run.meter.begin()


def _span(rng, lease: float, bounds) -> float:
    return rng.uniform(bounds[0] * lease, bounds[1] * lease)


async def _next_holder(run, rng, timeout: float = 2.0):
    """A worker process that holds the lock now (the parent learns it from the workers' events)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        holders = run.holders()
        if holders:
            return rng.choice(holders)
        await asyncio.sleep(0.005)
    return None


def sigstop(bounds):
    async def act(run, rng) -> None:
        while True:
            await asyncio.sleep(rng.uniform(0.2, 0.5) * run.profile.lease)
            worker = await _next_holder(run, rng)
            if worker is None:
                continue
            begin = time.monotonic()
            worker.proc.send_signal(signal.SIGSTOP)
            try:
                await asyncio.sleep(_span(rng, run.profile.lease, bounds))
            finally:
                worker.proc.send_signal(signal.SIGCONT)
                run.pause(worker, begin, time.monotonic())
    return act


def sigkill(holder: bool):
    async def act(run, rng) -> None:
        while True:
            await asyncio.sleep(rng.uniform(0.4, 0.8) * run.profile.lease)
            if holder:
                worker = await _next_holder(run, rng)
            else:
                waiters = run.waiters()
                worker = rng.choice(waiters) if waiters else None
            if worker is None:
                continue
            await run.kill(worker)
            run.background(run.spawn())  # keep the contention up (a replacement starts in ~0.5 s)
    return act


async def restart(run, rng) -> None:
    """Crash Redis (SIGKILL) twice per window, down for 0.2 s, back on the same port."""
    for _ in range(2):
        await asyncio.sleep(run.profile.window / 3)
        await run.meter.pause()
        run.server.crash()
        await asyncio.sleep(0.2)
        await asyncio.to_thread(run.server.start)
        await run.meter.begin()


def proxy_stall(bounds):
    async def act(run, rng) -> None:
        while True:
            await asyncio.sleep(rng.uniform(0.2, 0.5) * run.profile.lease)
            worker = await _next_holder(run, rng)
            if worker is None:
                continue
            worker.proxy.stall()
            try:
                await asyncio.sleep(_span(rng, run.profile.lease, bounds))
            finally:
                worker.proxy.forward()
    return act


async def proxy_cut(run, rng) -> None:
    while True:
        await asyncio.sleep(rng.uniform(0.15, 0.3) * run.profile.lease)
        worker = await _next_holder(run, rng)
        if worker is None:
            continue
        worker.proxy.cut()
        await asyncio.sleep(0.1)
        worker.proxy.forward()


async def client_kill(run, rng) -> None:
    """CLIENT KILL every normal and pub/sub connection (but ours) every ~0.3 s."""
    while True:
        await asyncio.sleep(rng.uniform(0.2, 0.4))
        client = aioredis.Redis.from_url(run.server.url, socket_timeout=5)
        try:
            await client.execute_command("CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes")
            await client.execute_command("CLIENT", "KILL", "TYPE", "pubsub", "SKIPME", "yes")
        finally:
            await client.aclose()


FAULTS = {f.name: f for f in [
    Fault("none", "no fault"),
    Fault("stall-hold-short", "10% of holds block their loop 0.25-0.55 L right after acquiring",
          hold_stall=(0.1, *SHORT), short=True),
    Fault("stall-hold-long", "10% of holds block their loop 1.3-1.6 L right after acquiring",
          hold_stall=(0.1, *LONG), long=True),
    Fault("stall-wait-short", "a process whose tasks all wait blocks its loop 0.25-0.55 L",
          wait_stall=(0.5, *SHORT), sync_ok=False, short=True),
    Fault("stall-wait-long", "a process whose tasks all wait blocks its loop 1.3-1.6 L",
          wait_stall=(0.3, *LONG), sync_ok=False, long=True),
    Fault("sigstop-short", "SIGSTOP a holder process for 0.25-0.55 L, then SIGCONT", act=sigstop(SHORT), short=True),
    Fault("sigstop-long", "SIGSTOP a holder process for 1.3-1.6 L, then SIGCONT", act=sigstop(LONG), long=True),
    Fault("sigkill-holder", "SIGKILL a holder process every 0.4-0.8 L (a new one starts)", act=sigkill(True)),
    Fault("sigkill-waiter", "SIGKILL a process that holds nothing every 0.4-0.8 L (a new one starts)",
          act=sigkill(False)),
    Fault("restart-aof", "crash (SIGKILL) and restart Redis with AOF (fsync always) twice, 0.2 s down",
          act=restart, aof=True),
    Fault("restart-noaof", "crash (SIGKILL) and restart Redis without persistence twice, 0.2 s down", act=restart,
          forgets=True),
    Fault("proxy-stall-short", "stall the holder's TCP proxy 0.25-0.55 L", act=proxy_stall(SHORT), proxy=True,
          short=True),
    Fault("proxy-stall-long", "stall the holder's TCP proxy 1.3-1.6 L", act=proxy_stall(LONG), proxy=True, long=True),
    Fault("proxy-cut", "cut the holder's connections every 0.15-0.3 L, refused for 0.1 s", act=proxy_cut,
          proxy=True),
    Fault("client-kill", "CLIENT KILL TYPE normal and TYPE pubsub every 0.2-0.4 s", act=client_kill),
]}

QUICK_SET = ["none", "stall-hold-short", "stall-hold-long", "stall-wait-long", "sigstop-short", "sigstop-long",
             "sigkill-holder", "sigkill-waiter", "restart-aof", "restart-noaof", "proxy-stall-long", "proxy-cut",
             "client-kill"]
