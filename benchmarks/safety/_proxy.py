"""A loopback TCP proxy in front of Redis that can stall or cut its traffic (the checker's and the tests').

`stall()` holds the bytes in both directions (client and Redis see silence, as
behind a congested link), `stall_replies()` forwards requests but holds Redis'
replies (the command runs, the caller never hears of it), `stall_subscribers()`
holds what Redis sends to connections that subscribed, `stall_commands()`
holds the replies of every other connection open now, `cut()` aborts every
connection and refuses new ones, `forward()` returns to normal.

Byte-exact, for the connection tests: `cut_replies_after(n)` lets n more
reply bytes through, then resets every connection (a reset in the middle of
a reply; new connections work), `hold_replies_after(n)` holds what follows
them until `release()`; `sent` and `replied` count the bytes forwarded, so a
test can tell that nothing was sent.
"""

from __future__ import annotations

import asyncio
import contextlib
import re


# A (S)SUBSCRIBE command (its first argument), not the word inside another one (ACL DRYRUN user SUBSCRIBE ...).
_SUBSCRIBE = re.compile(rb"\*\d+\r\n\$(9|10)\r\nS?SUBSCRIBE\r\n", re.IGNORECASE)


class TcpProxy:
    """Loopback proxy to host:port; see the module docstring for what each method holds back."""

    def __init__(self, host: str, port: int) -> None:
        self.target = (host, port)
        self._requests = asyncio.Event()
        self._replies = asyncio.Event()
        self._subscribers: list[asyncio.Event] = []  # per-connection reply gates of subscribers
        self._gates: list[asyncio.Event] = []  # every connection's reply gate
        self.forward()
        self._pairs: set[tuple[asyncio.StreamWriter, asyncio.StreamWriter]] = set()
        self._tasks: set[asyncio.Task] = set()
        self._server: asyncio.Server | None = None
        self.port = 0
        self.accepted = 0  # connections so far: a client reconnecting to retry shows here
        self.sent = 0      # request bytes forwarded to Redis, all connections together
        self.replied = 0   # reply bytes forwarded to clients
        self._budget: int | None = None  # reply bytes still let through before cutting or holding
        self._cut_at_budget = False
        self._released = asyncio.Event()
        self._released.set()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    async def start(self) -> "TcpProxy":
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    def stall(self) -> None:
        self._requests.clear()
        self._replies.clear()

    def stall_replies(self) -> None:
        self._replies.clear()

    @property
    def subscriptions(self) -> int:
        """Connections that sent SUBSCRIBE so far (a subscriber reconnecting shows here)."""
        return len(self._subscribers)

    def stall_subscribers(self) -> None:
        for gate in self._subscribers:
            gate.clear()

    def stall_commands(self) -> None:
        for gate in self._gates:
            if gate not in self._subscribers:
                gate.clear()

    def forward(self) -> None:
        self._cut = False
        self._requests.set()
        self._replies.set()
        for gate in self._gates:
            gate.set()

    def cut(self) -> None:
        self._cut = True
        self._reset_all()

    def cut_replies_after(self, count: int) -> None:
        """Let `count` more reply bytes through, then reset every connection (new ones work again)."""
        self._budget, self._cut_at_budget = count, True

    def hold_replies_after(self, count: int) -> None:
        """Let `count` more reply bytes through, then hold the rest until `release()`."""
        self._budget, self._cut_at_budget = count, False
        self._released.clear()

    def release(self) -> None:
        self._budget = None
        self._released.set()

    def _reset_all(self) -> None:
        for pair in list(self._pairs):
            for writer in pair:
                writer.transport.abort()
        self._pairs.clear()

    async def _accept(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        self.accepted += 1
        if self._cut:
            client_w.transport.abort()
            return
        try:
            up_r, up_w = await asyncio.open_connection(*self.target)
        except OSError:
            client_w.transport.abort()
            return
        pair = (client_w, up_w)
        self._pairs.add(pair)
        gate = asyncio.Event()
        gate.set()
        self._gates.append(gate)
        pipes = [asyncio.create_task(self._pipe(client_r, up_w, self._requests, subscriber_gate=gate)),
                 asyncio.create_task(self._pipe(up_r, client_w, self._replies, gate, replies=True))]
        self._tasks.update(pipes)
        try:
            await asyncio.wait(pipes, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in pipes:
                task.cancel()
            await asyncio.gather(*pipes, return_exceptions=True)
            self._tasks.difference_update(pipes)
            self._pairs.discard(pair)
            for writer in pair:
                writer.transport.abort()

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *gates: asyncio.Event,
                    subscriber_gate: asyncio.Event | None = None, replies: bool = False) -> None:
        with contextlib.suppress(OSError):
            while data := await reader.read(65536):
                if subscriber_gate is not None and _SUBSCRIBE.search(data):
                    self._subscribers.append(subscriber_gate)
                for gate in gates:
                    await gate.wait()  # stalled: hold the bytes, the peer sees silence
                if replies:
                    if not await self._reply(writer, data):
                        return
                    continue
                self.sent += len(data)
                writer.write(data)
                await writer.drain()

    async def _reply(self, writer: asyncio.StreamWriter, data: bytes) -> bool:
        """Forward reply bytes within the budget; False once the budget has reset every connection."""
        while data:
            budget = self._budget
            if budget is None or budget > 0:
                head = data if budget is None else data[:budget]
                data = data[len(head):]
                if budget is not None:
                    self._budget = budget - len(head)
                self.replied += len(head)
                writer.write(head)
                await writer.drain()
            elif self._cut_at_budget:
                self._budget = None
                self._reset_all()
                return False
            else:
                await self._released.wait()
        return True

    async def aclose(self) -> None:
        self.release()
        self.cut()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


Proxy = TcpProxy
