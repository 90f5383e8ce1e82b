"""README.md's FastAPI example, as a served app for the schemathesis run (tests/test_openapi_schemathesis.py).

Pasted from the README with what it needs to run as an app, each marked `# added:`.
The README's `caller` reads `request.user.identity`, which exists only behind an
authentication middleware and only for an authenticated user; its handlers are
`...`, which FastAPI would answer 500 for (None is not a dict). Run with
`REDIS_URL=redis://... python -m uvicorn readme_fastapi_app:app`.
"""

import os

from fastapi import FastAPI
from pydantic import BaseModel
from starlette.authentication import AuthCredentials, AuthenticationBackend, SimpleUser  # added
from starlette.middleware.authentication import AuthenticationMiddleware  # added
from starlette.requests import Request

from otel_lock import LockManager, LockMiddleware, idempotent, locked

locks = LockManager.from_url(os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0"), namespace="shop")  # added: env
app = FastAPI()


def caller(request: Request) -> str | None:
    """Whose Idempotency-Keys these are: set by your authentication middleware, never a raw header."""
    return request.user.identity if request.user.is_authenticated else None  # added: the anonymous case


app.add_middleware(LockMiddleware, manager=locks, principal=caller)


class BearerUser(SimpleUser):  # added: older Starlette (0.40) gives SimpleUser no `identity`
    @property
    def identity(self) -> str:
        return self.username


class BearerUsers(AuthenticationBackend):  # added: `Authorization: Bearer <user>` stands for a real verifier
    async def authenticate(self, conn):
        scheme, _, user = conn.headers.get("authorization", "").partition(" ")
        return (AuthCredentials(["authenticated"]), BearerUser(user)) if scheme == "Bearer" and user else None


app.add_middleware(AuthenticationMiddleware, backend=BearerUsers())  # added: outside LockMiddleware


class Order(BaseModel):
    product_id: int
    quantity: int = 1


@app.post("/api/stock/{product_id}/deduct")
@locked("stock:{path.product_id}", wait=2.0)     # 409 + Retry-After when busy
async def deduct(product_id: int) -> dict:
    return {"product_id": product_id}  # added: a body


@app.post("/api/orders")
@idempotent(ttl=86400)                           # Idempotency-Key: "..." (sf-string); replayed, 409, 422
@locked("stock:{json.product_id}")
async def submit(order: Order) -> dict:
    return order.model_dump()  # added: a body
