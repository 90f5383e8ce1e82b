"""The lock core: manager, holds, waiting, watchdog, Lua scripts, the lean connection.

It imports no Starlette; telemetry is reached through `otel_lock.telemetry._instruments`.
"""

from ._errors import (LockBusy, LockDeadlock, LockError, LockLost, LockTimeout, RedisMisconfigured,
                      RedisUnavailable)
from ._held import HeldLock, LockInfo
from ._manager import LockManager
from ._multi import HeldLocks
from ._protocol import Locks
from ._redlock import RedLockManager

__all__ = ["HeldLock", "HeldLocks", "LockBusy", "LockDeadlock", "LockError", "LockInfo", "LockLost", "LockManager",
           "LockTimeout", "Locks", "RedLockManager", "RedisMisconfigured", "RedisUnavailable"]
