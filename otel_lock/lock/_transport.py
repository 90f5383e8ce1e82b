"""`Transport`: everything the manager core asks of a topology, on one event loop.

The core (`_core.py`, `_ending.py`, `_watchdog.py`, `_server_watch.py`)
takes, releases and renews locks the same way on every topology; what a
call costs on the wire is the transport's business. There are two:

- `_script_transport.ScriptTransport`: one Redis, a Sentinel master or a Cluster
  (the scripts of `_scripts.py` over a link of `_topology.py`);
- `_quorum.QuorumTransport`: a RedLock quorum of independent masters.

This base class names every member the core uses, so a new topology is one
subclass, and `mypy --strict` checks the core's calls against it (as httpx's
transports implement one `AsyncBaseTransport`). A transport belongs to one
process and event loop (`_runtime.py` makes one per loop).
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, AsyncGenerator, Awaitable, Callable, Coroutine, TypeAlias

from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster

from ._background import Background

if TYPE_CHECKING:
    from ._attempt import Acquisition, Reply
    from ._errors import LockError
    from ._held import Lease, LockInfo
    from ._server_checks import ServerReport

RedisClient: TypeAlias = "Redis | RedisCluster"
Send: TypeAlias = Callable[..., Awaitable[Any]]  # one command to one server, its reply


class Transport(ABC):
    """Locks on one topology for one event loop: take, re-enter, release, renew, check, list."""

    _background: Background  # the runtime's clean-up tasks (undo, release, pass-on)

    @property
    @abstractmethod
    def records(self) -> RedisClient:
        """A redis-py client of this loop: the Idempotency-Key records, errors' server names, `manager.redis`."""

    # -- a lock's life ---------------------------------------------------------

    @abstractmethod
    def take(self, request: Acquisition) -> Coroutine[Any, Any, Reply | None]:
        """The lock within `request.wait` (LockTimeout), or at once (None when busy) with wait=0."""

    @abstractmethod
    async def reenter(self, lease: Lease) -> int | None:
        """One more level of a held lock: the depth, or None when it was lost meanwhile."""

    @abstractmethod
    async def release(self, lease: Lease, *, whole: bool) -> int:
        """-1 when the lock was no longer this owner's, else the depth left (0: released)."""

    def send_release(self, lease: Lease, *, whole: bool,
                     on_orphan: Callable[[Any], None] | None = None) -> asyncio.Future[Any] | None:
        """RELEASE on the wire now, its raw reply's future (read by `release_answer`); None: use `release()`.

        The hand-over's fast path: no task, no shield. `on_orphan` gets the
        reply (or the error) if the future was cancelled first.
        """
        return None

    def release_answer(self, lease: Lease, seconds: float, reply: Any) -> int | LockError:
        """What a `send_release` reply means: the depth left (as `release()`), or the caller's error; recorded."""
        raise NotImplementedError(f"{type(self).__name__}.send_release() never sends: nothing to read")

    @abstractmethod
    def release_when_back(self, lease: Lease) -> None:
        """A release the server(s) did not answer: retried in the background until they do, or the lease ends."""

    @abstractmethod
    def lost(self, lease: Lease) -> None:
        """A hold was declared lost: undo what is left of it (a quorum's stray grants)."""

    @abstractmethod
    async def renew(self, leases: list[Lease]) -> list[bool | BaseException]:
        """The watchdog's batch: per lease True (renewed), False (lost) or the error (retried)."""

    # -- first use and the server watch ------------------------------------------

    @abstractmethod
    async def check_model(self, key: str, model: int, ttl: int, lock_key: str, name: str) -> int | None:
        """Claim the namespace for data model `model`: None when it is ours, else the model holding it."""

    @abstractmethod
    async def servers(self) -> list[tuple[str, Send]]:
        """(address, send one command) for every server the locks live on."""

    @abstractmethod
    async def server_reports(self, namespace: str, require_noeviction: bool) -> list[ServerReport]:
        """The server checks (`_server_checks.py`) of every server that answers."""

    @abstractmethod
    def poll_instead(self, why: str | None) -> None:
        """No wake-up can reach this manager (no channel rights): waiters poll; `why` is warned once."""

    # -- operators, figures, the end ------------------------------------------------

    @abstractmethod
    async def force_release(self, redis_key: str, name: str) -> tuple[bool, str]:
        """(released, the owner it had, "" if unknown): an operator's last resort."""

    @abstractmethod
    def held_pages(self, pattern: str, page: int) -> AsyncGenerator[list[LockInfo], None]:
        """The locks held, a page at a time."""

    @abstractmethod
    def figures(self) -> tuple[int, int]:
        """(connections in use, replies awaited): read by a metrics reader on its own thread."""

    def background(self, work: Coroutine[Any, Any, Any]) -> asyncio.Future[Any]:
        """Run clean-up work that must finish even if its caller is cancelled (closed with the runtime)."""
        return self._background.add(work)

    @abstractmethod
    async def aclose(self) -> None:
        """Stop the subscriber and clean-ups, close the connections this transport opened."""
