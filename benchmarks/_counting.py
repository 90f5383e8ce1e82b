"""Client-side counts of Redis round trips and top-level commands.

Redis' own counters (INFO commandstats, total_commands_processed) also count
the commands a Lua script runs, so they cannot tell one EVALSHA doing five
things from five round trips. We count what the client sends by wrapping
redis-py's connection methods once per process; every library measured here
talks to Redis through redis-py, so the same wrapper sees all of them.
"""

from __future__ import annotations

import resource
import time

import redis.asyncio.connection as aconn
import redis.connection as sconn


class Counts:
    round_trips = 0  # one per write of packed commands (a pipeline is one)
    commands = 0  # top-level commands, as the client sent them
    stamps: list[float] | None = None  # monotonic time of each round trip, when asked for

    @classmethod
    def snapshot(cls) -> dict:
        return {"round_trips": cls.round_trips, "commands": cls.commands}


def sleeps() -> int:
    """How often this process has gone to sleep waiting (voluntary context switches): one per wake-up it needed."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw


def _wrap_async() -> None:
    cls = aconn.AbstractConnection
    send, pack_one = cls.send_packed_command, cls.pack_command

    async def send_packed_command(self, command, check_health=True):
        Counts.round_trips += 1
        if Counts.stamps is not None:
            Counts.stamps.append(time.monotonic())
        return await send(self, command, check_health)

    def pack_command(self, *args):
        # asyncio's pack_commands() calls pack_command() once per command
        Counts.commands += 1
        return pack_one(self, *args)

    cls.send_packed_command, cls.pack_command = send_packed_command, pack_command


def _wrap_sync() -> None:
    cls = sconn.AbstractConnection
    send, send_one, pack_many = cls.send_packed_command, cls.send_command, cls.pack_commands

    def send_packed_command(self, command, check_health=True):
        Counts.round_trips += 1
        if Counts.stamps is not None:
            Counts.stamps.append(time.monotonic())
        return send(self, command, check_health)

    def send_command(self, *args, **kwargs):
        Counts.commands += 1
        return send_one(self, *args, **kwargs)

    def pack_commands(self, commands):
        commands = list(commands)
        Counts.commands += len(commands)
        return pack_many(self, commands)

    cls.send_packed_command, cls.send_command, cls.pack_commands = send_packed_command, send_command, pack_commands


def _wrap_otel_lock() -> None:
    """otel-lock's hot path has its own pipelined connection beside redis-py."""
    try:
        from otel_lock.lock._connection import Connection
    except ImportError:
        return
    one, many = Connection.execute, Connection.execute_many

    def _note(n: int) -> None:
        Counts.round_trips += 1
        Counts.commands += n
        if Counts.stamps is not None:
            Counts.stamps.append(time.monotonic())

    async def execute(self, *args):
        _note(1)
        return await one(self, *args)

    async def execute_many(self, commands):
        _note(len(commands))
        return await many(self, commands)

    Connection.execute, Connection.execute_many = execute, execute_many


_installed = False


def install() -> None:
    global _installed
    if not _installed:
        _wrap_async()
        _wrap_sync()
        _wrap_otel_lock()
        _installed = True


def bursts(stamps: list[float], gap: float) -> list[list[float]]:
    """Group round-trip times into bursts separated by more than `gap` seconds (one per watchdog tick)."""
    groups: list[list[float]] = []
    for t in sorted(stamps):
        if groups and t - groups[-1][-1] <= gap:
            groups[-1].append(t)
        else:
            groups.append([t])
    return groups
