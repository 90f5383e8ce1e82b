"""`wait_replicas`: an acquire or renewal counts only once N replicas have it.

Redis replicates asynchronously, so a lock written to a master that dies a
moment later may be missing on the replica that Sentinel promotes: a second
caller then takes it while the first still works. `WAIT n timeout` after the
write closes that window. WAIT covers the writes *of the connection it runs
on*, so it is sent on the same connection as the script, in one round trip:
a redis-py pipeline, or the lean connection's `execute_many`.

An acquire that fewer replicas acknowledge in time is released again (on the
same master) and reported as RedisUnavailable; a renewal that fewer replicas
acknowledge does not extend the holder's validity (it counts as a failed
renewal and is retried), so what the holder believes is never longer than
what a promoted replica knows.
"""

from __future__ import annotations

from typing import Any, Sequence

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, RedisError

from . import _scripts
from ._connection import Connection
from ._options import check_seconds


class TooFewReplicas(RedisConnectionError):
    """WAIT timed out with fewer replicas than asked for (a RedisUnavailable to callers)."""


async def with_wait(client: Any, commands: list[tuple[Any, ...]], replicas: int, timeout_ms: int) -> list[Any]:
    """Run `commands` then `WAIT replicas timeout_ms` on one connection; errors come back in place."""
    calls = [*commands, ("WAIT", replicas, timeout_ms)]
    if isinstance(client, Connection):
        return await client.execute_many(calls)
    pipe = client.pipeline(transaction=False)
    for call in calls:
        pipe.execute_command(*call)
    answers: list[Any] = await pipe.execute(raise_on_error=False)
    return answers


def check_acks(acked: Any, replicas: int, timeout_ms: int) -> None:
    if isinstance(acked, Exception):
        raise acked
    if int(acked) < replicas:
        raise TooFewReplicas(f"only {int(acked)} of {replicas} replica(s) acknowledged the write "
                             f"within {timeout_ms} ms")


class Replicated(_scripts.Script):
    """The ACQUIRE script followed by WAIT; a hold that too few replicas acknowledged is released."""

    def __init__(self, script: _scripts.Script, replicas: int, timeout_ms: int) -> None:
        super().__init__(script.source)
        self.replicas, self.timeout_ms = replicas, timeout_ms

    async def __call__(self, client: Any, keys: Sequence[str], args: Sequence[object]) -> Any:
        call = ("EVALSHA", self.sha, len(keys), *keys, *args)
        answer, acked = await with_wait(client, [call], self.replicas, self.timeout_ms)
        if isinstance(answer, NoScriptError):
            if not await _scripts.load(client, self):
                call = _scripts.eval_instead(call, self)
            answer, acked = await with_wait(client, [call], self.replicas, self.timeout_ms)
        if isinstance(answer, Exception):
            raise answer
        if answer[0] == 1:
            try:
                check_acks(acked, self.replicas, self.timeout_ms)
            except TooFewReplicas:
                await self._undo(client, keys, args)
                raise
        return answer

    @staticmethod
    async def _undo(client: Any, keys: Sequence[str], args: Sequence[object]) -> None:
        """Release what this call took: the whole hold of a private owner, else one level of depth."""
        # ACQUIRE's ARGV: owner, waiter, lease_ms, reenter, queue_ms, ctx, fence_ttl_ms, channel
        release_all = "1" if args[3] == "0" else "0"
        try:
            await _scripts.release(client, keys, [args[0], args[6], release_all])
        except (RedisError, OSError):
            pass  # the caller's RedisUnavailable path releases it in the background


def check_replicas(redis: Any, replicas: int, timeout: float) -> tuple[int, float]:
    """`WAIT replicas timeout` must end before the socket timeout, or the wait itself would look like an outage."""
    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 0:
        raise ValueError(f"wait_replicas must be a whole number >= 0, not {replicas!r}")
    timeout = check_seconds("wait_replicas_timeout", timeout, allow_zero=False)
    if timeout < 0.001:
        raise ValueError(f"wait_replicas_timeout must be at least 0.001 s, not {timeout!r}")
    pool = getattr(redis, "connection_pool", None)
    socket_timeout = getattr(pool, "connection_kwargs", {}).get("socket_timeout")
    if replicas and socket_timeout and timeout >= socket_timeout:
        raise ValueError(f"wait_replicas_timeout ({timeout} s) must be shorter than the client's socket "
                         f"timeout ({socket_timeout} s)")
    return replicas, timeout
