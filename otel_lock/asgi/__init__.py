"""The ASGI layer: middleware, route annotations, key templates, idempotency, problem answers."""

from ._annotations import idempotent, limited, locked
from ._guard import DirectCallRefused
from ._middleware import LockMiddleware, StartupFailed
from .idempotency._principal import authenticated_user

__all__ = ["DirectCallRefused", "LockMiddleware", "StartupFailed", "authenticated_user", "idempotent", "limited", "locked"]
