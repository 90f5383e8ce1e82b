"""The shared clocks behind the middleware's per-request deadlines (`_deadlines`).

A `TimeBound` must behave as `asyncio.timeout` does: reached, it raises
TimeoutError and takes its cancellation back; a cancellation from elsewhere
stays one. A clock keeps one timer for many deadlines, so a deadline that
falls due sooner than the one it is armed for must still fire, and ended
deadlines must leave nothing behind.
"""

from __future__ import annotations

import asyncio
import gc
import weakref

import pytest
import uvloop

from otel_lock.asgi._deadlines import Deadline, TimeBound

KIND = 30.0   # the kind's usual length: long, never reached in these tests unless a test says so


async def test_a_bound_reached_raises_timeout_error_and_leaves_the_task_uncancelled():
    with pytest.raises(TimeoutError):
        with TimeBound(KIND, 0.05):
            await asyncio.Event().wait()
    task = asyncio.current_task()
    assert task is not None and task.cancelling() == 0
    await asyncio.sleep(0)   # no cancellation left pending for the next await


async def test_a_sooner_deadline_behind_a_later_one_fires_and_the_later_one_stays():
    release = asyncio.Event()

    async def long_wait() -> str:
        with TimeBound(KIND):
            await release.wait()
        return "released"

    long_task = asyncio.create_task(long_wait())
    await asyncio.sleep(0)   # its deadline is pending: the clock is armed KIND seconds ahead
    with pytest.raises(TimeoutError):   # started after, due much sooner: the clock re-arms for it
        with TimeBound(KIND, 0.05):
            await asyncio.Event().wait()
    assert not long_task.done()
    release.set()
    assert await long_task == "released"


async def test_a_cancellation_from_elsewhere_stays_a_cancellation():
    entered = asyncio.Event()

    async def bounded() -> None:
        with TimeBound(KIND):
            entered.set()
            await asyncio.Event().wait()

    task = asyncio.create_task(bounded())
    await entered.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_a_bound_reached_while_the_task_is_also_cancelled_elsewhere_is_a_cancellation():
    async def bounded() -> None:
        with TimeBound(KIND, 0.05):
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:   # ours: now somebody else cancels too, before the exit
                task = asyncio.current_task()
                assert task is not None
                task.cancel()
                await asyncio.sleep(0)

    with pytest.raises(asyncio.CancelledError):
        await asyncio.create_task(bounded())


async def test_restart_pushes_the_deadline_and_ending_leaves_nothing_pending():
    with TimeBound(KIND) as bound:
        first = bound.when
        await asyncio.sleep(0.01)
        bound.restart()
        assert bound.when > first
        assert bound in bound.clock.pending
    assert bound not in bound.clock.pending


async def test_many_short_bounds_on_one_clock_leave_it_empty_and_armed_once():
    clock = Deadline(KIND).clock
    for _ in range(1000):
        with TimeBound(KIND):
            await asyncio.sleep(0)
    assert clock.pending == set()
    armed = clock.armed
    with TimeBound(KIND):   # a later deadline on an armed clock: the same timer serves it
        assert clock.armed == armed


class Recorded(Deadline):
    def __init__(self, length: float) -> None:
        super().__init__(length)
        self.calls = 0
        self.reached = asyncio.Event()

    def fire(self) -> None:
        self.calls += 1
        self.reached.set()


async def test_a_plain_deadline_fires_once():
    recorded = Recorded(KIND)
    recorded.start(0.02)
    await recorded.reached.wait()
    await asyncio.sleep(0.05)
    assert recorded.calls == 1 and recorded not in recorded.clock.pending


@pytest.mark.parametrize("new_loop", [asyncio.new_event_loop, uvloop.new_event_loop], ids=["asyncio", "uvloop"])
def test_each_loop_has_its_own_clock_and_bounds_fire_on_each(new_loop):
    async def reached() -> bool:
        try:
            with TimeBound(KIND, 0.02):
                await asyncio.Event().wait()
        except TimeoutError:
            return True
        return False

    clocks = []
    for _ in range(2):   # a clock armed on a closed loop must not serve the next loop
        with asyncio.Runner(loop_factory=new_loop) as runner:
            assert runner.run(reached())
            clocks.append(runner.run(_clock_of(KIND)))
    assert clocks[0] is not clocks[1]


@pytest.mark.parametrize("new_loop", [asyncio.new_event_loop, uvloop.new_event_loop], ids=["asyncio", "uvloop"])
def test_a_closed_loop_is_not_kept_alive_by_its_clocks(new_loop):
    async def bounded() -> None:
        with TimeBound(KIND):   # leaves the clock armed KIND seconds ahead when the loop closes
            await asyncio.sleep(0)

    with asyncio.Runner(loop_factory=new_loop) as runner:
        runner.run(bounded())
        loop = weakref.ref(runner.get_loop())
    gc.collect()
    assert loop() is None


async def _clock_of(length: float):
    return Deadline(length).clock
