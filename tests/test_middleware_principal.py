"""The caller from the app's own authentication: `principal=Depends(...)`, `{principal}` and `{cookie.x}` keys.

Written as FastAPI apps are (OAuth2PasswordBearer, `CurrentUser =
Annotated[User, Depends(get_current_user)]`, routers), served by two app
instances on one real Redis. (No `from __future__ import annotations`: the
app's `CurrentUser` alias is local to `shop_app`, as FastAPI must see it.)
"""

import asyncio
from dataclasses import dataclass, field
from typing import Annotated

from fastapi import APIRouter, Cookie, Depends, FastAPI, Header, HTTPException, status
from fastapi.security import OAuth2PasswordBearer
from starlette.applications import Starlette
from starlette.authentication import AuthCredentials, AuthenticationBackend, SimpleUser
from starlette.middleware import Middleware
from starlette.middleware.authentication import AuthenticationMiddleware
from starlette.responses import JSONResponse
from starlette.routing import Route

from otel_lock import LockMiddleware, idempotent, locked
from otel_lock.asgi import authenticated_user

try:
    from ._middleware_helpers import NAMESPACE, client_for, make_manager, problem, run_lifespan
except ImportError:
    from _middleware_helpers import NAMESPACE, client_for, make_manager, problem, run_lifespan

TOKENS = {"token-ann": "ann", "token-bob": "bob"}
ANN = {"authorization": "Bearer token-ann"}
BOB = {"authorization": "Bearer token-bob"}


@dataclass
class User:
    id: str


@dataclass
class Shop:
    """What the requests of both replicas did."""

    inside: asyncio.Event = field(default_factory=asyncio.Event)
    leave: asyncio.Event = field(default_factory=asyncio.Event)
    checkouts: list[str] = field(default_factory=list)
    token_checks: int = 0


def shop_app(manager, shop: Shop) -> FastAPI:
    oauth2_scheme = OAuth2PasswordBearer(tokenUrl="login/access-token")

    async def get_current_user(token: Annotated[str, Depends(oauth2_scheme)]) -> User:
        shop.token_checks += 1
        if token not in TOKENS:
            raise HTTPException(status.HTTP_403_FORBIDDEN, "Could not validate credentials")
        return User(TOKENS[token])

    CurrentUser = Annotated[User, Depends(get_current_user)]

    def current_user_id(user: CurrentUser) -> str:
        return user.id

    router = APIRouter(prefix="/orders", tags=["orders"])

    @router.post("/checkout")
    @locked("checkout:{principal}", wait=0)
    async def checkout(user: CurrentUser):
        shop.checkouts.append(user.id)
        if user.id == "ann" and not shop.leave.is_set():
            shop.inside.set()
            await shop.leave.wait()
        return {"user": user.id}

    @router.post("/charges", status_code=201)
    @idempotent()
    async def charge(user: CurrentUser, amount: int):
        shop.checkouts.append(user.id)
        return {"user": user.id, "amount": amount, "run": len(shop.checkouts)}

    app = FastAPI()
    app.state.get_current_user = get_current_user
    app.include_router(router)
    app.add_middleware(LockMiddleware, manager=manager, principal=Depends(current_user_id))
    return app


async def test_one_users_checkouts_exclude_each_other_across_replicas_and_two_users_do_not(redis_url):
    shop = Shop()
    async with make_manager(redis_url) as one, make_manager(redis_url) as two:
        async with client_for(shop_app(one, shop)) as replica_1, client_for(shop_app(two, shop)) as replica_2:
            first = asyncio.create_task(replica_1.post("/orders/checkout", headers=ANN))
            await asyncio.wait_for(shop.inside.wait(), 10)          # ann's checkout holds checkout:ann
            again = await replica_2.post("/orders/checkout", headers=ANN)
            other = await replica_2.post("/orders/checkout", headers=BOB)
            shop.leave.set()
            done = await first
            after = await replica_2.post("/orders/checkout", headers=ANN)
    assert again.status_code == 409 and problem(again)["type"] == "lock-timeout"
    assert other.status_code == 200 and other.json() == {"user": "bob"}
    assert done.status_code == 200 and after.status_code == 200
    assert shop.checkouts == ["ann", "bob", "ann"]


async def test_a_request_the_apps_authentication_rejects_gets_its_answer_and_never_holds_the_lock(
        redis_url, redis_client):
    shop = Shop()
    async with make_manager(redis_url) as one, make_manager(redis_url) as two:
        async with client_for(shop_app(one, shop)) as replica_1, client_for(shop_app(two, shop)) as replica_2:
            first = asyncio.create_task(replica_1.post("/orders/checkout", headers=ANN))
            await asyncio.wait_for(shop.inside.wait(), 10)
            held = sorted(k.decode() for k in await redis_client.keys(f"{NAMESPACE}:{{checkout*}}"))
            anonymous = await replica_2.post("/orders/checkout")                       # no token
            forged = await replica_2.post("/orders/checkout", headers={"authorization": "Bearer nope"})
            shop.leave.set()
            await first
            anonymous_alone = await replica_2.post("/orders/checkout")
            left = await redis_client.keys(f"{NAMESPACE}:{{checkout*}}")
    # OAuth2PasswordBearer's own 401 (with its challenge) and get_current_user's own 403, not a 409:
    # they never queued for the lock ann holds.
    assert anonymous.status_code == 401 and anonymous.headers["www-authenticate"] == "Bearer"
    assert problem(anonymous)["detail"] == "Not authenticated"
    assert forged.status_code == 403 and problem(forged)["detail"] == "Could not validate credentials"
    assert anonymous_alone.status_code == 401
    assert held == [f"{NAMESPACE}:{{checkout:ann}}"] and left == [] and shop.checkouts == ["ann"]


async def test_the_idempotency_scope_follows_the_dependencys_user_across_replicas(redis_url):
    shop = Shop()
    key = {"idempotency-key": '"charge-1"'}
    async with make_manager(redis_url) as one, make_manager(redis_url) as two:
        async with client_for(shop_app(one, shop)) as replica_1, client_for(shop_app(two, shop)) as replica_2:
            ann = await replica_1.post("/orders/charges?amount=5", headers={**ANN, **key})
            bob = await replica_2.post("/orders/charges?amount=5", headers={**BOB, **key})
            ann_again = await replica_2.post("/orders/charges?amount=5", headers={**ANN, **key})
            nobody = await replica_2.post("/orders/charges?amount=5", headers=key)
    assert ann.status_code == 201 and ann.json()["user"] == "ann"
    # The same key of another user is another record: run for bob, never ann's answer replayed to him.
    assert bob.status_code == 201 and bob.json()["user"] == "bob" and "idempotent-replayed" not in bob.headers
    assert ann_again.headers.get("idempotent-replayed") == "true" and ann_again.json() == ann.json()
    assert nobody.status_code == 401 and nobody.headers["www-authenticate"] == "Bearer"
    assert shop.checkouts == ["ann", "bob"]


async def test_the_principal_dependency_honours_the_apps_dependency_overrides(redis_url):
    shop = Shop()
    async with make_manager(redis_url) as manager:
        app = shop_app(manager, shop)
        app.dependency_overrides[app.state.get_current_user] = lambda: User("bob")
        async with client_for(app) as client:
            answer = await client.post("/orders/checkout")   # no token: the override answers
    assert answer.status_code == 200 and answer.json() == {"user": "bob"} and shop.checkouts == ["bob"]


async def test_an_optional_principal_locks_the_anonymous_together_and_each_user_apart(redis_url, redis_client):
    seen: list[str] = []

    def optional_user(authorization: Annotated[str | None, Depends(OAuth2PasswordBearer("t", auto_error=False))]):
        return TOKENS.get(authorization or "")

    app = FastAPI()

    @app.post("/carts")
    @locked("cart:{principal?}")
    async def cart(request_id: int):
        seen.extend(k.decode() for k in await redis_client.keys(f"{NAMESPACE}:{{cart*}}"))
        return {}

    async with make_manager(redis_url) as manager:
        app.add_middleware(LockMiddleware, manager=manager, principal=Depends(optional_user))
        async with client_for(app) as client:
            assert (await client.post("/carts?request_id=1")).status_code == 200
            assert (await client.post("/carts?request_id=2", headers=BOB)).status_code == 200
    assert seen == [f"{NAMESPACE}:{{cart:%n}}", f"{NAMESPACE}:{{cart:bob}}"]


async def test_the_openapi_of_a_per_caller_lock_documents_its_401(redis_url):
    async with make_manager(redis_url) as manager:
        app = shop_app(manager, Shop())
        assert (await run_lifespan(app))[0]["type"] == "lifespan.startup.complete"
        async with client_for(app) as client:
            paths = (await client.get("/openapi.json")).json()["paths"]
    answers = paths["/orders/checkout"]["post"]["responses"]
    assert "WWW-Authenticate" in answers["401"]["headers"] and "409" in answers


async def test_a_principal_key_without_a_principal_fails_the_start_up_naming_the_fix(redis_url):
    app = FastAPI()

    @app.post("/checkout")
    @locked("checkout:{principal}")
    async def checkout():
        return {}

    async with make_manager(redis_url) as manager:
        app.add_middleware(LockMiddleware, manager=manager)
        messages = await run_lifespan(app)
    assert messages[0]["type"] == "lifespan.startup.failed"
    message = messages[0]["message"]
    assert "{principal}" in message and "/checkout" in message and "principal=Depends(" in message


async def test_starlette_authentication_middleware_gives_the_principal(redis_url):
    class Tokens(AuthenticationBackend):
        async def authenticate(self, conn):
            user = TOKENS.get(conn.headers.get("authorization", "").removeprefix("Bearer "))
            return (AuthCredentials(["authenticated"]), SimpleUser(user)) if user else None

    entered, leave = asyncio.Event(), asyncio.Event()

    @locked("checkout:{principal}", wait=0)
    async def checkout(request):
        if request.user.username == "ann" and not leave.is_set():
            entered.set()
            await leave.wait()
        return JSONResponse({"user": request.user.username})

    async with make_manager(redis_url) as manager:
        app = Starlette(routes=[Route("/checkout", checkout, methods=["POST"])], middleware=[
            Middleware(AuthenticationMiddleware, backend=Tokens()),
            Middleware(LockMiddleware, manager=manager, principal=authenticated_user)])
        async with client_for(app) as client:
            first = asyncio.create_task(client.post("/checkout", headers=ANN))
            await asyncio.wait_for(entered.wait(), 10)
            again = await client.post("/checkout", headers=ANN)
            other = await client.post("/checkout", headers=BOB)
            nobody = await client.post("/checkout")
            leave.set()
            assert (await first).status_code == 200
    assert again.status_code == 409 and other.json() == {"user": "bob"}
    assert nobody.status_code == 401 and problem(nobody)["type"] == "lock-principal-missing"


# -- {cookie.x} ---------------------------------------------------------------------------


def cart_app(manager, entered: asyncio.Event, leave: asyncio.Event) -> FastAPI:
    app = FastAPI()

    @app.post("/cart/checkout")
    @locked("cart:{cookie.session}", wait=0)
    async def checkout(session: Annotated[str, Cookie()]):
        if session == "s-1" and not leave.is_set():
            entered.set()
            await leave.wait()
        return {"session": session}

    app.add_middleware(LockMiddleware, manager=manager)
    return app


async def test_a_cookie_keyed_lock_excludes_one_session_across_replicas_not_two(redis_url):
    entered, leave = asyncio.Event(), asyncio.Event()
    async with make_manager(redis_url) as one, make_manager(redis_url) as two:
        async with client_for(cart_app(one, entered, leave)) as replica_1, \
                client_for(cart_app(two, entered, leave)) as replica_2:
            first = asyncio.create_task(replica_1.post("/cart/checkout", headers={"cookie": "session=s-1"}))
            await asyncio.wait_for(entered.wait(), 10)
            again = await replica_2.post("/cart/checkout", headers={"cookie": "session=s-1"})
            other = await replica_2.post("/cart/checkout", headers={"cookie": "session=s-2"})
            missing = await replica_2.post("/cart/checkout")
            leave.set()
            assert (await first).status_code == 200
    assert again.status_code == 409 and problem(again)["type"] == "lock-timeout"
    assert other.status_code == 200 and other.json() == {"session": "s-2"}
    assert missing.status_code == 422   # FastAPI's own answer for its missing Cookie(): nothing locked


async def test_a_raw_cookie_on_a_starlette_route_is_read_as_request_cookies_does(redis_url, redis_client):
    seen: list[str] = []

    @locked("cart:{cookie.session}")
    async def checkout(request):
        seen.extend(k.decode() for k in await redis_client.keys(f"{NAMESPACE}:{{cart*}}"))
        return JSONResponse({})

    async with make_manager(redis_url) as manager:
        app = Starlette(routes=[Route("/cart", checkout, methods=["POST"])],
                        middleware=[Middleware(LockMiddleware, manager=manager)])
        async with client_for(app) as client:
            ok = await client.post("/cart", headers={"cookie": "theme=dark; session=a:b"})
            missing = await client.post("/cart", headers={"cookie": "theme=dark"})
    assert ok.status_code == 200 and seen == [f"{NAMESPACE}:{{cart:a%3Ab}}"]
    assert missing.status_code == 400 and "cookie 'session' is missing" in problem(missing)["detail"]


async def test_an_optional_cookie_parameter_needs_an_optional_placeholder_at_start_up(redis_url):
    app = FastAPI()

    @app.post("/cart")
    @locked("cart:{cookie.session}")
    async def checkout(session: Annotated[str | None, Cookie()] = None):
        return {}

    async with make_manager(redis_url) as manager:
        app.add_middleware(LockMiddleware, manager=manager)
        messages = await run_lifespan(app)
    assert messages[0]["type"] == "lifespan.startup.failed"
    assert "{cookie.session?}" in messages[0]["message"]


# -- how the dependency is resolved ------------------------------------------------------


async def test_one_resolution_serves_the_key_and_the_record_and_its_yield_dependencies_close_first(redis_url):
    events: list[str] = []

    async def get_db():
        events.append("db open")
        yield "db"
        events.append("db closed")

    async def get_current_user(token: Annotated[str, Depends(OAuth2PasswordBearer("t"))],
                               db: Annotated[str, Depends(get_db)]) -> User:
        events.append("token checked")
        return User(TOKENS[token])

    def current_user_id(user: Annotated[User, Depends(get_current_user)]) -> str:
        return user.id

    app = FastAPI()

    @app.post("/checkout", status_code=201)
    @locked("checkout:{principal}")
    @idempotent()
    async def checkout(user: Annotated[User, Depends(get_current_user)]):
        events.append(f"handler of {user.id}")
        return {"user": user.id}

    async with make_manager(redis_url) as manager:
        app.add_middleware(LockMiddleware, manager=manager, principal=Depends(current_user_id))
        async with client_for(app) as client:
            answer = await client.post("/checkout", headers={**ANN, "idempotency-key": '"k"'})
    assert answer.status_code == 201
    # Ours: the key and the record share one resolution, whose session closed before the lock was
    # taken; then FastAPI's own for the handler (it runs twice, written once).
    assert events == ["db open", "token checked", "db closed",
                      "db open", "token checked", "handler of ann", "db closed"]


async def test_a_principal_dependency_whose_inputs_fastapi_rejects_is_422(redis_url):
    def tenant_user(x_tenant: Annotated[int, Header()]) -> str:
        return f"tenant-{x_tenant}"

    app = FastAPI()

    @app.post("/checkout")
    @locked("checkout:{principal}")
    async def checkout():
        return {}

    async with make_manager(redis_url) as manager:
        app.add_middleware(LockMiddleware, manager=manager, principal=Depends(tenant_user))
        async with client_for(app) as client:
            missing = await client.post("/checkout")
            wrong = await client.post("/checkout", headers={"x-tenant": "abc"})
            fine = await client.post("/checkout", headers={"x-tenant": "7"})
    assert missing.status_code == wrong.status_code == 422
    assert problem(missing)["type"] == "lock-principal-rejected"
    assert fine.status_code == 200


async def test_authenticated_user_without_an_authentication_middleware_fails_closed(redis_url, caplog):
    @locked("checkout:{principal}")
    async def checkout(request):
        return JSONResponse({})

    async with make_manager(redis_url) as manager:
        app = Starlette(routes=[Route("/checkout", checkout, methods=["POST"])],
                        middleware=[Middleware(LockMiddleware, manager=manager, principal=authenticated_user)])
        async with client_for(app) as client:
            answer = await client.post("/checkout", headers=ANN)
    assert answer.status_code == 500 and problem(answer)["type"] == "lock-principal-error"
    assert "AuthenticationMiddleware outside LockMiddleware" in caplog.text
