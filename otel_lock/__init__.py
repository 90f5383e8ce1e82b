"""otel-lock: an asyncio Redis lock for Starlette/FastAPI replicas, observable with OpenTelemetry."""

__version__ = "0.1.0"

from .lock import HeldLock, LockError, LockInfo, LockLost, LockManager, LockTimeout, RedisUnavailable, RedLockManager
from .asgi import LockMiddleware, idempotent, locked

__all__ = [
    "HeldLock",
    "LockError",
    "LockInfo",
    "LockLost",
    "LockManager",
    "LockMiddleware",
    "LockTimeout",
    "RedLockManager",
    "RedisUnavailable",
    "__version__",
    "idempotent",
    "locked",
]
