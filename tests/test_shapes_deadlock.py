"""Deadlocks through a shared hold or a permit: refused at once, as through an exclusive hold.

Task A holds k1 (exclusively, shared, or a permit of it) and waits for k2;
task B holds k2 and then waits for k1, which A's hold keeps from it: a cycle
of holders waiting on each other, which `LockDeadlock` promises to refuse at
once instead of both waiting out `wait`. What blocks a wait depends on its
kind: an exclusive wait is stuck if any holder is (it needs them all gone),
a permit wait only if every permit holder is (one leaving is enough), so a
permit held by somebody outside the cycle is no deadlock and is not refused.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from otel_lock import LockDeadlock, LockManager, LockTimeout

WAIT = 2.0  # both would wait this long without detection; a refusal comes in a round trip or two


@pytest.fixture
async def managers(redis_url):
    one = LockManager.from_url(redis_url, namespace="t")
    two = LockManager.from_url(redis_url, namespace="t")
    yield one, two
    await one.aclose()
    await two.aclose()


async def outcome_of(hold) -> str:
    """"held", or the error the wait ended in (LockDeadlock, LockTimeout)."""
    try:
        async with hold:
            return "held"
    except (LockDeadlock, LockTimeout) as exc:
        return type(exc).__name__


async def recorded(client, n: int) -> None:
    """Until `n` waits have been checked and recorded (their `t:waits:*` records), none refused."""
    while len(await client.keys("t:waits:*")) < n:
        await asyncio.sleep(0.005)


async def crossed(one: LockManager, two: LockManager, a_holds: Callable, b_waits: Callable) -> dict[str, str]:
    """A holds k1 (`a_holds`) then waits for k2; B holds k2, then waits for k1 (`b_waits`): what each got."""
    a_in, b_in, a_waits = asyncio.Event(), asyncio.Event(), asyncio.Event()
    outcome: dict[str, str] = {}

    async def a() -> None:
        async with a_holds(one):
            a_in.set()
            await b_in.wait()
            a_waits.set()
            outcome["a"] = await outcome_of(one.lock("k2", wait=WAIT))

    async def b() -> None:
        async with two.lock("k2"):
            b_in.set()
            await a_in.wait()
            await a_waits.wait()
            await asyncio.sleep(0)  # let A's request go out first: B's closes the cycle
            outcome["b"] = await outcome_of(b_waits(two))

    async with asyncio.timeout(WAIT * 3):
        await asyncio.gather(a(), b())
    return outcome


def refused_once(outcome: dict[str, str]) -> None:
    assert sorted(outcome.values()) == ["LockDeadlock", "held"], f"{outcome}: nobody was refused"


async def test_through_an_exclusive_hold_one_is_refused(managers):
    refused_once(await crossed(*managers, lambda m: m.lock("k1"), lambda m: m.lock("k1", wait=WAIT)))


async def test_an_exclusive_holder_waited_for_by_a_shared_request_is_in_the_cycle(managers):
    refused_once(await crossed(*managers, lambda m: m.lock("k1"), lambda m: m.lock("k1", shared=True, wait=WAIT)))


async def test_a_shared_holder_waited_for_by_an_exclusive_request_is_in_the_cycle(managers):
    refused_once(await crossed(*managers, lambda m: m.lock("k1", shared=True), lambda m: m.lock("k1", wait=WAIT)))


async def test_a_permit_holder_waited_for_by_a_permit_request_is_in_the_cycle(managers):
    refused_once(await crossed(*managers, lambda m: m.semaphore("k1", permits=1),
                               lambda m: m.semaphore("k1", permits=1, wait=WAIT)))


async def test_a_permit_also_held_outside_the_cycle_is_no_deadlock(managers, redis_client):
    """k1 has 2 permits: A's and C's. A waits for k2, B holds k2 and waits for a permit: C will give one back.

    Not refused (no false positive): B gets C's permit, lets k2 go, and A goes on."""
    one, two = managers
    c_in, a_in, b_in, c_go = asyncio.Event(), asyncio.Event(), asyncio.Event(), asyncio.Event()
    outcome: dict[str, str] = {}

    async def c() -> None:
        async with one.semaphore("k1", permits=2):
            c_in.set()
            await c_go.wait()

    async def a() -> None:
        await c_in.wait()
        async with one.semaphore("k1", permits=2):
            a_in.set()
            await b_in.wait()
            async with one.lock("k2", wait=WAIT * 5):
                outcome["a"] = "held"

    async def b() -> None:
        async with two.lock("k2"):
            b_in.set()
            await a_in.wait()  # both permits are held now: B's wait is a real one
            async with two.semaphore("k1", permits=2, wait=WAIT * 5):
                outcome["b"] = "held"

    async def release_c_once_both_waits_are_checked() -> None:
        await recorded(redis_client, 2)  # A's and B's waits: both checked, none refused
        c_go.set()

    async with asyncio.timeout(WAIT * 4):
        await asyncio.gather(a(), b(), c(), release_c_once_both_waits_are_checked())
    assert outcome == {"a": "held", "b": "held"}


@pytest.mark.parametrize("b_first", [False, True], ids=["holders wait first", "B waits first"])
async def test_every_permit_holder_in_the_cycle_is_a_deadlock(managers, redis_client, b_first):
    """k1 has 2 permits, both held by tasks that then wait for k2; B holds k2 and waits for a permit.

    Whichever wait comes last closes the cycle and is refused: B's (it follows both holders back to
    itself), or the second holder's (through B to the permits, one of them its own, the other held by a
    holder already on its walk)."""
    one, two = managers
    both_in, b_in = asyncio.Barrier(3), asyncio.Event()
    outcome: dict[str, str] = {}

    async def holder(name: str) -> None:
        async with one.semaphore("k1", permits=2):
            await both_in.wait()
            await b_in.wait()
            await recorded(redis_client, 1 if b_first else 0)
            outcome[name] = await outcome_of(one.lock("k2", wait=WAIT))

    async def b() -> None:
        await both_in.wait()
        async with two.lock("k2"):
            b_in.set()
            await recorded(redis_client, 0 if b_first else 2)
            outcome["b"] = await outcome_of(two.semaphore("k1", permits=2, wait=WAIT))

    async with asyncio.timeout(WAIT * 4):
        await asyncio.gather(holder("a1"), holder("a2"), b())
    assert "LockTimeout" not in outcome.values(), outcome
    assert list(outcome.values()).count("LockDeadlock") == 1, outcome


@pytest.mark.parametrize("shared_waits_first", [False, True], ids=["holder waits first", "shared waiter first"])
async def test_a_shared_wait_behind_an_exclusive_waiter_is_in_the_cycle(managers, redis_url, redis_client,
                                                                       shared_waits_first):
    """B holds k1 shared and waits for k2; C (holding nothing) queues for k1 exclusively; A holds k2 and asks
    for k1 shared. A is not let in beside B: C is queued first and goes first, once B has left, which B does
    only once A lets k2 go. One of A and B is refused, whichever closes the cycle."""
    one, two = managers
    three = LockManager.from_url(redis_url, namespace="t")
    a_in, b_in, c_queued, first_waits = asyncio.Event(), asyncio.Event(), asyncio.Event(), asyncio.Event()
    outcome: dict[str, str] = {}

    async def a() -> None:
        async with one.lock("k2"):
            a_in.set()
            await c_queued.wait()
            if not shared_waits_first:
                await first_waits.wait()
            outcome["a"] = await outcome_of(one.lock("k1", shared=True, wait=WAIT))

    async def b() -> None:
        async with two.lock("k1", shared=True):
            b_in.set()
            await c_queued.wait()
            if shared_waits_first:
                await first_waits.wait()
            outcome["b"] = await outcome_of(two.lock("k2", wait=WAIT))

    async def c() -> None:
        await b_in.wait()
        async with three.lock("k1", wait=WAIT * 3):
            outcome["c"] = "held"

    async def order() -> None:
        await asyncio.gather(a_in.wait(), b_in.wait())
        while await redis_client.zcard("t:{k1}:q") < 1:
            await asyncio.sleep(0.005)
        c_queued.set()
        await recorded(redis_client, 1)  # the first of A and B waits; then the other closes the cycle
        first_waits.set()

    try:
        async with asyncio.timeout(WAIT * 4):
            await asyncio.gather(a(), b(), c(), order())
    finally:
        await three.aclose()
    assert outcome["c"] == "held"
    closer = "b" if shared_waits_first else "a"
    assert (outcome[closer], outcome["b" if closer == "a" else "a"]) == ("LockDeadlock", "held"), outcome


async def test_a_shared_wait_behind_an_exclusive_waiter_on_a_plain_chain_is_no_deadlock(managers, redis_url,
                                                                                      redis_client):
    """The same queue without the cycle: B holds k1 shared and waits for nothing; A (holding k2) waits for k1
    shared behind C. A chain, not a cycle: nobody is refused, and A gets k1 after C."""
    one, two = managers
    three = LockManager.from_url(redis_url, namespace="t")
    b_in, b_go = asyncio.Event(), asyncio.Event()
    order: list[str] = []

    async def b() -> None:
        async with two.lock("k1", shared=True):
            b_in.set()
            await b_go.wait()

    async def c() -> None:
        await b_in.wait()
        async with three.lock("k1", wait=WAIT * 3):
            order.append("c")

    async def a() -> None:
        await b_in.wait()
        while await redis_client.zcard("t:{k1}:q") < 1:  # C is queued first
            await asyncio.sleep(0.005)
        async with one.lock("k2"):
            async with one.lock("k1", shared=True, wait=WAIT * 3):
                order.append("a")

    async def release_b_once_a_is_checked() -> None:
        await recorded(redis_client, 1)  # A's wait checked and recorded, not refused
        b_go.set()

    try:
        async with asyncio.timeout(WAIT * 4):
            await asyncio.gather(a(), b(), c(), release_b_once_a_is_checked())
    finally:
        await three.aclose()
    assert order == ["c", "a"]
