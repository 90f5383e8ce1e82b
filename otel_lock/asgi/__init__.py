"""The ASGI layer: middleware, route annotations, key templates, idempotency, problem answers."""

from ._annotations import idempotent, locked
from ._middleware import LockMiddleware

__all__ = ["LockMiddleware", "idempotent", "locked"]
