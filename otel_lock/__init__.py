"""otel-lock: an asyncio Redis lock for Starlette/FastAPI replicas, observable with OpenTelemetry."""

__version__ = "0.2.0"

from .lock import (HeldLock, HeldLocks, LockBusy, LockDeadlock, LockError, LockInfo, LockLost, LockManager, Locks,
                   LockTimeout, RedisMisconfigured, RedisUnavailable, RedLockManager)
from .asgi import LockMiddleware, idempotent, limited, locked

__all__ = [
    "HeldLock",
    "HeldLocks",
    "LockBusy",
    "LockDeadlock",
    "LockError",
    "LockInfo",
    "LockLost",
    "LockManager",
    "LockMiddleware",
    "LockTimeout",
    "Locks",
    "RedLockManager",
    "RedisMisconfigured",
    "RedisUnavailable",
    "__version__",
    "idempotent",
    "limited",
    "locked",
]
