"""Clean-up that must outlive its caller: undo a late reply, release when Redis is back, pass a grant on.

Each task is kept referenced until it ends (asyncio keeps only weak references),
its failure is logged rather than lost, and `aclose()` cancels what is left and
waits for it, so none touches a client after the client closed.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Awaitable

log = logging.getLogger("otel_lock")


class Background:
    def __init__(self, what: str) -> None:
        self._what = what
        self._tasks: set[asyncio.Future[Any]] = set()

    def add(self, work: Awaitable[Any]) -> asyncio.Future[Any]:
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Future[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("otel-lock: background %s failed: %s", self._what, task.exception())

    async def aclose(self) -> None:
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
