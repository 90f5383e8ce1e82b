"""LockDeadlock: a wait that would close a cycle of holders waiting on each other is refused at once.

In one process (tasks of two managers) and across processes (`_proc_helpers.Agent`,
each with its own LockManager), synchronised on what Redis shows (a waiter in a
lock's queue) and on what the agents report, never on sleeps.
"""

from __future__ import annotations

import asyncio
import json

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from otel_lock import LockDeadlock, LockError, LockManager

from _proc_helpers import Agents, queued, until

BOUND = 20.0   # turns a hang into a failure; every wait below is longer, so a refusal within it is "at once"
WAIT = 60.0


@pytest.fixture
async def managers(redis_url):
    made = [LockManager.from_url(redis_url) for _ in range(3)]
    yield made
    for manager in made:
        await manager.aclose()


class Holder:
    """One task: holds `first`, then (on `go`) waits for `then` inside it; what happened is in `outcome`."""

    def __init__(self, manager: LockManager, first: str, then: str | None = None) -> None:
        self.manager, self.first, self.then = manager, first, then
        self.holding, self.go, self.leave = asyncio.Event(), asyncio.Event(), asyncio.Event()
        self.outcome: object = None
        self.owner = ""
        self.task = asyncio.create_task(self._run(), name=f"holder-of-{first}")

    async def _run(self) -> None:
        async with self.manager.lock(self.first) as held:
            self.owner = held.owner
            self.holding.set()
            await self.go.wait()
            if self.then is not None:
                try:
                    async with self.manager.lock(self.then, wait=WAIT) as then:
                        self.outcome = then.token
                        await self.leave.wait()
                        return
                except LockError as exc:
                    self.outcome = exc
            await self.leave.wait()

    async def finish(self) -> object:
        self.go.set()
        self.leave.set()
        async with asyncio.timeout(BOUND):
            await self.task
        return self.outcome


async def started(*holders: Holder) -> None:
    async with asyncio.timeout(BOUND):
        for holder in holders:
            await holder.holding.wait()


async def refused(holder: Holder) -> LockDeadlock:
    async with asyncio.timeout(BOUND):
        while holder.outcome is None:
            await asyncio.sleep(0.005)
    assert isinstance(holder.outcome, LockDeadlock), holder.outcome
    return holder.outcome


async def recorded(redis, owner: str) -> None:
    """`owner`'s wait record is written (CHECK_AFTER into its wait, not when it joins the queue): only
    then is its wait a step of the cycle the next waiter closes, so that the next one is refused."""
    await until(lambda: redis.exists(f"otel-lock:waits:{owner}"), f"the wait record of {owner}")


async def test_the_second_of_two_crossed_waits_is_refused_and_the_first_proceeds(managers, redis_client):
    one, two, _ = managers
    a, b = Holder(one, "k1", "k2"), Holder(two, "k2", "k1")
    await started(a, b)
    a.go.set()
    await queued(redis_client, "k2", 1)
    await recorded(redis_client, a.owner)
    b.go.set()
    error = await refused(b)
    assert error.key == "otel-lock:{k1}"
    assert [(key, owner) for key, owner, _ in error.cycle] == [("otel-lock:{k1}", a.owner),
                                                               ("otel-lock:{k2}", b.owner)]
    assert error.cycle[0][2].startswith("holder-of-k1@") and error.cycle[1][2].startswith("holder-of-k2@")
    assert "would close a deadlock" in str(error)
    assert await redis_client.zcard("otel-lock:{k1}:q") == 0   # the refused waiter left the queue
    await b.finish()                                            # B lets go of k2: A gets it
    assert isinstance(await a.finish(), int)
    for record in await redis_client.keys("otel-lock:waits:*"):  # a record outlives its wait, as no edge
        waits_for, waiter, _, in_queue, how = json.loads(await redis_client.get(record))
        assert how == "x"  # an exclusive wait
        assert in_queue == 1 and await redis_client.zscore(waits_for + ":q", waiter) is None


async def test_a_task_asking_for_one_more_permit_than_it_holds_of_a_full_key_is_refused(managers):
    """It would wait for itself; with one of the permits held by another task, it waits (that one may let go)."""
    one, two, _ = managers
    async with one.semaphore("export", permits=2), one.semaphore("export", permits=2):
        with pytest.raises(LockDeadlock) as refused:
            async with asyncio.timeout(BOUND):
                async with one.semaphore("export", permits=2, wait=WAIT):
                    pass
        assert [key for key, _, _ in refused.value.cycle] == ["otel-lock:{export}:permits"]
    holding, leave = asyncio.Event(), asyncio.Event()

    async def other_task() -> None:
        async with two.semaphore("export", permits=2):
            holding.set()
            await leave.wait()

    other = asyncio.create_task(other_task())
    try:
        await holding.wait()
        async with one.semaphore("export", permits=2):
            with pytest.raises(LockError) as waited:
                async with one.semaphore("export", permits=2, wait=0.3):
                    pass
            assert not isinstance(waited.value, LockDeadlock), waited.value
    finally:
        leave.set()
        await other


async def test_a_plain_chain_is_not_refused(managers, redis_client):
    one, two, three = managers
    a, b, c = Holder(one, "k1", "k2"), Holder(two, "k2", "k3"), Holder(three, "k3")
    await started(a, b, c)
    a.go.set()
    await queued(redis_client, "k2", 1)
    b.go.set()
    await queued(redis_client, "k3", 1)
    await c.finish()
    assert isinstance(await b.finish(), int)
    assert isinstance(await a.finish(), int)


async def test_a_three_cycle_is_refused_to_the_waiter_that_closes_it(managers, redis_client):
    one, two, three = managers
    a, b, c = Holder(one, "k1", "k2"), Holder(two, "k2", "k3"), Holder(three, "k3", "k1")
    await started(a, b, c)
    a.go.set()
    await queued(redis_client, "k2", 1)
    await recorded(redis_client, a.owner)
    b.go.set()
    await queued(redis_client, "k3", 1)
    await recorded(redis_client, b.owner)
    c.go.set()
    error = await refused(c)
    assert [key for key, _, _ in error.cycle] == ["otel-lock:{k1}", "otel-lock:{k2}", "otel-lock:{k3}"]
    assert [owner for _, owner, _ in error.cycle] == [a.owner, b.owner, c.owner]
    await c.finish()
    assert isinstance(await b.finish(), int)
    assert isinstance(await a.finish(), int)


async def test_of_two_waits_closing_a_cycle_at_once_exactly_one_is_refused(managers):
    one, two, _ = managers
    for _ in range(30):
        a, b = Holder(one, "x", "y"), Holder(two, "y", "x")
        await started(a, b)
        a.go.set()
        b.go.set()
        async with asyncio.timeout(BOUND):
            while a.outcome is None and b.outcome is None:
                await asyncio.sleep(0.001)
        loser, winner = (a, b) if isinstance(a.outcome, LockDeadlock) else (b, a)
        assert isinstance(loser.outcome, LockDeadlock), (a.outcome, b.outcome)
        await loser.finish()
        assert isinstance(await winner.finish(), int)


async def test_a_waiter_that_holds_nothing_records_nothing(managers, redis_client):
    one, two, _ = managers
    async with one.lock("k1"):
        waiter = asyncio.create_task(two.acquire("k1", wait=WAIT))
        await queued(redis_client, "k1", 1)
        assert await redis_client.keys("otel-lock:waits:*") == []
    held = await asyncio.wait_for(waiter, BOUND)
    await held.release()


async def test_lock_all_after_lock_can_still_close_a_cycle(managers, redis_client):
    one, two, _ = managers
    a = Holder(one, "k2", "k1")       # holds k2 by hand, then waits for k1
    await started(a)
    async with two.lock("k1"):
        a.go.set()
        await queued(redis_client, "k1", 1)
        await recorded(redis_client, a.owner)
        with pytest.raises(LockDeadlock):
            async with asyncio.timeout(BOUND):
                await two.acquire_all(["k1", "k2"], wait=WAIT)   # k1 re-entered, k2 would close the cycle
    assert isinstance(await a.finish(), int)


async def test_a_deadlock_is_counted_and_named_on_the_acquire_span(redis_url, redis_client):
    reader, exporter = InMemoryMetricReader(), InMemorySpanExporter()
    tracing = TracerProvider()
    tracing.add_span_processor(SimpleSpanProcessor(exporter))
    async with LockManager.from_url(redis_url) as one, LockManager.from_url(
            redis_url, tracer_provider=tracing, meter_provider=MeterProvider(metric_readers=[reader])) as two:
        a = Holder(one, "k1", "k2")
        await started(a)

        async def b() -> None:
            with tracing.get_tracer("test").start_as_current_span("request"):
                async with two.lock("k2"):
                    a.go.set()
                    await queued(redis_client, "k2", 1)
                    await recorded(redis_client, a.owner)
                    with pytest.raises(LockDeadlock):
                        await two.acquire("k1", wait=WAIT)

        await asyncio.wait_for(b(), BOUND)
        await a.finish()
    spans = exporter.get_finished_spans()
    span = next((s for s in spans if s.name.startswith("lock acquire") and s.attributes.get("error.type") == "deadlock"),
                None)
    assert span is not None, [(s.name, dict(s.attributes)) for s in spans]
    assert span.attributes["lock.mode"] == "exclusive"
    event = next(e for e in span.events if e.name == "lock deadlock")
    assert list(event.attributes["lock.deadlock.keys"]) == ["otel-lock:{k1}", "otel-lock:{k2}"]
    points = [p for m in reader.get_metrics_data().resource_metrics[0].scope_metrics[0].metrics
              if m.name == "otel_lock.errors" for p in m.data.data_points]
    assert any(p.attributes.get("error.type") == "deadlock" and p.value == 1 for p in points)


async def test_crossed_waits_across_processes_are_refused_at_once_with_the_cycle(agents: Agents, redis_client):
    a, b = await agents.start_many(["a", "b"])
    await a.send("chain", id="a", first="k1", then="k2", wait=WAIT)
    await b.send("chain", id="b", first="k2", then="k1", wait=WAIT)
    owner_a = (await a.expect("acquired", "a"))["owner"]
    owner_b = (await b.expect("acquired", "b"))["owner"]
    await a.send("go", id="a")
    await queued(redis_client, "k2", 1)
    await recorded(redis_client, owner_a)
    await b.send("go", id="b")
    refusal = await b.expect("deadlock", "b", timeout=BOUND)   # well before either's wait of 60 s
    assert [step[:2] for step in refusal["cycle"]] == [["otel-lock:{k1}", owner_a], ["otel-lock:{k2}", owner_b]]
    await b.send("release", id="b")
    await a.expect("acquired_then", "a")
    await a.send("release", id="a")


async def test_a_chain_across_processes_is_not_refused_and_a_three_cycle_is(agents: Agents, redis_client):
    a, b, c = await agents.start_many(["a", "b", "c"])
    await c.send("hold", id="c0", key="k3")
    await c.expect("acquired", "c0")
    await a.send("chain", id="a", first="k1", then="k2", wait=WAIT)
    await b.send("chain", id="b", first="k2", then="k3", wait=WAIT)
    await a.expect("acquired", "a")
    await b.expect("acquired", "b")
    await a.send("go", id="a")
    await queued(redis_client, "k2", 1)
    await b.send("go", id="b")
    await queued(redis_client, "k3", 1)   # a chain a -> b -> c: both wait, nobody refused
    await c.send("release", id="c0")
    await b.expect("acquired_then", "b")
    await b.send("release", id="b")
    await a.expect("acquired_then", "a")
    await a.send("release", id="a")

    # now a three-cycle: a holds k1 waits k2, b holds k2 waits k3, c holds k3 waits k1
    await a.send("chain", id="a3", first="k1", then="k2", wait=WAIT)
    await b.send("chain", id="b3", first="k2", then="k3", wait=WAIT)
    await c.send("chain", id="c3", first="k3", then="k1", wait=WAIT)
    owners = [(await agent.expect("acquired", ident))["owner"] for agent, ident in ((a, "a3"), (b, "b3"), (c, "c3"))]
    await a.send("go", id="a3")
    await queued(redis_client, "k2", 1)
    await recorded(redis_client, owners[0])
    await b.send("go", id="b3")
    await queued(redis_client, "k3", 1)
    await recorded(redis_client, owners[1])
    await c.send("go", id="c3")
    refusal = await c.expect("deadlock", "c3", timeout=BOUND)
    assert [step[0] for step in refusal["cycle"]] == ["otel-lock:{k1}", "otel-lock:{k2}", "otel-lock:{k3}"]
    await c.send("release", id="c3")
    await b.expect("acquired_then", "b3")
    await b.send("release", id="b3")
    await a.expect("acquired_then", "a3")
    await a.send("release", id="a3")


async def test_lock_all_in_opposite_orders_across_processes_never_times_out(agents: Agents, redis_client):
    a, b, c = await agents.start_many(["a", "b", "c"])
    await a.send("transfers", id="t", keys=["acct:1", "acct:2"], rounds=100, log="log")
    await b.send("transfers", id="t", keys=["acct:2", "acct:1"], rounds=100, log="log")
    await c.send("transfers", id="t", keys=["acct:2", "acct:1", "acct:2"], rounds=100, log="log")
    for agent in (a, b, c):
        await agent.expect("transfers_done", "t", timeout=120)
    log = [json.loads(entry) for entry in await redis_client.lrange("log", 0, -1)]
    assert len(log) == 300
    for key in ("acct:1", "acct:2"):
        tokens = [entry[key] for entry in log]
        assert all(x < y for x, y in zip(tokens, tokens[1:]))   # strictly increasing across holders
    assert await redis_client.exists("otel-lock:{acct:1}", "otel-lock:{acct:2}") == 0  # nothing left held
    assert await redis_client.exists("otel-lock:{acct:1}:fence") == 1
