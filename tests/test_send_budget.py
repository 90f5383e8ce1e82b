"""The send budget: time blocked in `send` counts against `send_timeout`; only the budget's own cut is SendTimeout.

The server side is a `send` that blocks until told (a client that does not
read); the real socket case is in test_middleware_socket.py.
"""

from __future__ import annotations

import asyncio

import pytest

from otel_lock.asgi._request import BoundedSend, SendTimeout

BUDGET = 0.2


def blocking_send(released: asyncio.Event, sent: list):
    async def send(message) -> None:
        sent.append(message["type"])
        await released.wait()
    return send


async def test_a_send_blocked_past_the_budget_is_cut_off_and_the_task_is_not_left_cancelled():
    sent: list = []
    bounded = BoundedSend(blocking_send(asyncio.Event(), sent), BUDGET)
    with pytest.raises(SendTimeout):
        await bounded({"type": "http.response.start"})
    task = asyncio.current_task()
    assert task is not None and task.cancelling() == 0   # our cancel was taken back
    await asyncio.sleep(0)   # and no cancellation is pending for the task's next await
    with pytest.raises(SendTimeout):   # the budget is spent: the next send is refused at once
        await bounded({"type": "http.response.body"})
    assert sent == ["http.response.start"]


async def test_sends_that_return_at_once_are_never_cut():
    released = asyncio.Event()
    released.set()
    sent: list = []
    bounded = BoundedSend(blocking_send(released, sent), BUDGET)
    for _ in range(100):
        await bounded({"type": "http.response.body", "more_body": True})
    await asyncio.sleep(BUDGET * 2)   # past the budget, with no send in progress: nothing to cut
    await bounded({"type": "http.response.body"})
    assert len(sent) == 101


async def test_the_budget_is_shared_by_the_sends_of_one_response():
    """Each send blocks for 0.6 of the budget: alone, either would pass; together the second is cut.

    In the serial job: the sends' durations are sleeps, which a busy machine stretches."""
    sent: list = []

    async def slow_send(message) -> None:
        sent.append(message["type"])
        await asyncio.sleep(0.6)

    bounded = BoundedSend(slow_send, 1.0)
    await bounded({"type": "http.response.start"})
    with pytest.raises(SendTimeout):
        await bounded({"type": "http.response.body"})
    assert sent == ["http.response.start", "http.response.body"]


async def test_a_cancellation_from_elsewhere_stays_a_cancellation():
    """The request's own task cancelled (the server's, a timeout around the app): CancelledError, not SendTimeout."""
    started = asyncio.Event()
    bounded = BoundedSend(blocking_send(asyncio.Event(), []), 60.0)

    async def respond() -> None:
        started.set()
        await bounded({"type": "http.response.start"})

    task = asyncio.create_task(respond())
    await started.wait()
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
