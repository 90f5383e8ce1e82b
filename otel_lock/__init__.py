"""otel-lock: an asyncio Redis lock for Starlette/FastAPI replicas, observable with OpenTelemetry."""

__version__ = "0.1.0"

from ._errors import LockError, LockLost, LockTimeout, RedisUnavailable
from ._lock import HeldLock, LockInfo, LockManager
from ._middleware import LockMiddleware
from ._annotations import idempotent, locked

__all__ = [
    "HeldLock",
    "LockError",
    "LockInfo",
    "LockLost",
    "LockManager",
    "LockMiddleware",
    "LockTimeout",
    "RedisUnavailable",
    "__version__",
    "idempotent",
    "locked",
]
