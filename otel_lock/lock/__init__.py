"""The lock core: manager, holds, waiting, watchdog, Lua scripts, the lean connection.

It imports no Starlette; telemetry is reached through `otel_lock.telemetry._instruments`.
"""

from ._errors import LockError, LockLost, LockTimeout, RedisUnavailable
from ._held import HeldLock, LockInfo
from ._manager import LockManager
from ._redlock import RedLockManager

__all__ = ["HeldLock", "LockError", "LockInfo", "LockLost", "LockManager", "LockTimeout", "RedLockManager",
           "RedisUnavailable"]
