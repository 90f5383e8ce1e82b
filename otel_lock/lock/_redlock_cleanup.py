"""Releases a master did not answer, retried by one task per master.

A timed-out ACQUIRE may still land on its master, and a release may not
reach it. Each such (lock key, owner) is asked again until the master
answers or the lease would have ended anyway. While a master stays down,
only one probe per backoff step goes to it (starting at 50 ms, doubling to
1 s), however many callers failed meanwhile: a dead master is not flooded
with reconnects.
"""

from __future__ import annotations

import asyncio
from typing import Any

from ._errors import LockError
from ._redlock_scripts import Masters, release

BATCH = 100


class Cleanup:
    def __init__(self, masters: Masters) -> None:
        self.masters = masters
        # per master: (lock key, owner) -> (loop time to give up at, lock name)
        self._pending: list[dict[tuple[str, str], tuple[float, str]]] = [{} for _ in masters.clients]
        self._tasks: list[asyncio.Task[Any] | None] = [None for _ in masters.clients]

    def add(self, index: int, lock_key: str, owner: str, name: str, lease: float) -> None:
        give_up = asyncio.get_running_loop().time() + lease
        self._pending[index][(lock_key, owner)] = (give_up, name)
        task = self._tasks[index]
        if task is None or task.done():
            self._tasks[index] = asyncio.ensure_future(self._drain(index))

    def pending(self) -> int:
        return sum(len(p) for p in self._pending)

    async def _drain(self, index: int) -> None:
        loop = asyncio.get_running_loop()
        pending = self._pending[index]
        delay = 0.05
        while pending:
            await asyncio.sleep(delay)
            now = loop.time()
            for item in [k for k, (give_up, _) in pending.items() if give_up <= now]:
                del pending[item]  # its key has expired by itself
            items = list(pending.items())[:BATCH]
            if not items:
                return
            # the first one probes the master; the rest follow only when it answered
            answers = [await self._release(index, *items[0])]
            if not isinstance(answers[0], LockError):
                answers += await asyncio.gather(*(self._release(index, *item) for item in items[1:]))
            for (item, _), answer in zip(items, answers):
                if not isinstance(answer, LockError):
                    pending.pop(item, None)
            delay = 0.05 if not isinstance(answers[0], LockError) else min(1.0, delay * 2)

    async def _release(self, index: int, item: tuple[str, str], value: tuple[float, str]) -> Any:
        (lock_key, owner), (_, name) = item, value
        [answer] = await self.masters.call(release, (lock_key,), [owner], "release", name, only=[index])
        return answer

    def aclose(self) -> None:
        for task in self._tasks:
            if task is not None:
                task.cancel()
