"""A loopback TCP proxy in front of Redis, one per worker process, that can stall or cut its traffic.

Stalling holds the bytes in both directions (the client and Redis see silence,
as behind a congested link); cutting aborts every connection and refuses new
ones until `forward()`.
"""

from __future__ import annotations

import asyncio
import contextlib


class Proxy:
    def __init__(self, host: str, port: int) -> None:
        self.target = (host, port)
        self._open = asyncio.Event()
        self._open.set()
        self._cut = False
        self._writers: set[asyncio.StreamWriter] = set()
        self._tasks: set[asyncio.Task] = set()
        self._server: asyncio.Server | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    async def start(self) -> "Proxy":
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    def stall(self) -> None:
        self._open.clear()

    def cut(self) -> None:
        self._cut = True
        for writer in list(self._writers):
            writer.transport.abort()
        self._writers.clear()

    def forward(self) -> None:
        self._cut = False
        self._open.set()

    async def _accept(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        if self._cut:
            client_w.transport.abort()
            return
        try:
            up_r, up_w = await asyncio.open_connection(*self.target)
        except OSError:
            client_w.transport.abort()
            return
        self._writers.update((client_w, up_w))
        pipes = [asyncio.create_task(self._pipe(client_r, up_w)), asyncio.create_task(self._pipe(up_r, client_w))]
        self._tasks.update(pipes)
        try:
            await asyncio.wait(pipes, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in pipes:
                task.cancel()
            await asyncio.gather(*pipes, return_exceptions=True)
            self._tasks.difference_update(pipes)
            for writer in (client_w, up_w):
                self._writers.discard(writer)
                writer.transport.abort()

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError):
            while data := await reader.read(65536):
                await self._open.wait()
                writer.write(data)
                await writer.drain()

    async def aclose(self) -> None:
        self.cut()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
