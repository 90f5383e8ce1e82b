"""A stored answer is replayed only to the same caller for the same request.

The fingerprint covers the concrete path and query (not only the route
template and body), and the principal is named by the app, never guessed
from a client address or an unnamed header.
"""

from __future__ import annotations

import logging

import pytest
from fastapi import Depends, FastAPI, HTTPException, Query
from starlette.applications import Starlette
from starlette.authentication import AuthCredentials, AuthenticationBackend, SimpleUser
from starlette.middleware import Middleware
from starlette.middleware.authentication import AuthenticationMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from otel_lock import LockMiddleware, idempotent
from otel_lock.asgi.idempotency._fingerprint import canonical_target

try:
    from ._middleware_helpers import client_for, make_manager, problem
except ImportError:
    from _middleware_helpers import client_for, make_manager, problem

KEY = {"idempotency-key": '"k-1"'}


def bank() -> tuple[FastAPI, list]:
    """A FastAPI bank: withdrawals per account, with a dry-run flag and a tags list."""
    app = FastAPI()
    runs: list = []

    @app.post("/accounts/{account}/withdraw")
    @idempotent(shared_scope=True)
    async def withdraw(account: str, amount: int, dry_run: bool = False,
                       tag: list[str] | None = Query(None)):
        runs.append((account, dry_run))
        return {"account": account, "amount": amount, "dry_run": dry_run, "run": len(runs)}

    return app, runs


# -- the fingerprint covers the concrete path and query -------------------


async def test_same_key_on_another_account_is_422_not_a_replay(redis_url):
    app, runs = bank()
    async with make_manager(redis_url) as manager:
        app.add_middleware(LockMiddleware, manager=manager)
        async with client_for(app) as client:
            a = await client.post("/accounts/A/withdraw?amount=10", json={}, headers=KEY)
            b = await client.post("/accounts/B/withdraw?amount=10", json={}, headers=KEY)
    assert a.status_code == 200
    assert b.status_code == 422 and problem(b)["type"] == "idempotency-key-mismatch"
    assert "idempotent-replayed" not in b.headers and runs == [("A", False)]


async def test_same_key_with_another_query_flag_is_422(redis_url):
    app, runs = bank()
    async with make_manager(redis_url) as manager:
        app.add_middleware(LockMiddleware, manager=manager)
        async with client_for(app) as client:
            dry = await client.post("/accounts/A/withdraw?amount=10&dry_run=true", json={}, headers=KEY)
            real = await client.post("/accounts/A/withdraw?amount=10&dry_run=false", json={}, headers=KEY)
    assert dry.json()["dry_run"] is True
    assert real.status_code == 422 and problem(real)["type"] == "idempotency-key-mismatch"
    assert runs == [("A", True)]


async def test_same_request_spelled_differently_is_still_a_replay(redis_url):
    # Percent-encoding of the path, parameter order and `+` vs `%20` do not
    # change what the handler receives, so a retry spelled that way replays.
    app, runs = bank()
    async with make_manager(redis_url) as manager:
        app.add_middleware(LockMiddleware, manager=manager)
        async with client_for(app) as client:
            first = await client.post("/accounts/A%20B/withdraw?amount=10&tag=x+y", json={}, headers=KEY)
            retry = await client.post("/accounts/A%20B/withdraw?tag=x%20y&amount=10", json={}, headers=KEY)
            encoded = await client.post("/accounts/%41%20B/withdraw?amount=10&tag=x+y", json={}, headers=KEY)
    assert first.status_code == retry.status_code == encoded.status_code == 200
    assert retry.headers["idempotent-replayed"] == encoded.headers["idempotent-replayed"] == "true"
    assert runs == [("A B", False)]


async def test_repeated_query_values_in_another_order_are_another_request(redis_url):
    app, runs = bank()
    async with make_manager(redis_url) as manager:
        app.add_middleware(LockMiddleware, manager=manager)
        async with client_for(app) as client:
            await client.post("/accounts/A/withdraw?amount=1&tag=a&tag=b", json={}, headers=KEY)
            swapped = await client.post("/accounts/A/withdraw?amount=1&tag=b&tag=a", json={}, headers=KEY)
    assert swapped.status_code == 422 and len(runs) == 1


@pytest.mark.parametrize("one, other, same", [
    ({"path": "/a", "query_string": b"x=1&y=2"}, {"path": "/a", "query_string": b"y=2&x=1"}, True),
    ({"path": "/a", "query_string": b"x=a+b"}, {"path": "/a", "query_string": b"x=a%20b"}, True),
    ({"path": "/a", "query_string": b"x=%FF"}, {"path": "/a", "query_string": b"x=%FE"}, False),
    ({"path": "/a", "query_string": b"x=1"}, {"path": "/a", "query_string": b"x=1&x=1"}, False),
    ({"path": "/a", "query_string": b"x="}, {"path": "/a", "query_string": b""}, False),
    ({"path": "/a/b", "query_string": b""}, {"path": "/a", "query_string": b"b"}, False),
], ids=["order", "plus-space", "undecodable-bytes", "repeated", "blank-vs-absent", "path-vs-query"])
def test_canonical_target(one, other, same):
    assert (canonical_target(one) == canonical_target(other)) is same


# -- no implicit principal ----------------------------------------------------

SESSIONS = {"s-alice": "alice", "s-bob": "bob"}  # server-side sessions: cookie -> user


class CookieSessions(AuthenticationBackend):
    async def authenticate(self, conn):
        user = SESSIONS.get(conn.cookies.get("session", ""))
        return (AuthCredentials(["authenticated"]), SimpleUser(user)) if user else None


def by_user(request: Request) -> str | None:
    """The recipe of docs/idempotency.md: the user an authentication middleware set."""
    return request.user.username if request.user.is_authenticated else None


def account_app(manager, **middleware_options) -> tuple[Starlette, list]:
    runs: list = []

    @idempotent()
    async def me(request: Request) -> JSONResponse:
        runs.append(request.user.username)
        return JSONResponse({"user": request.user.username, "iban": f"DE-{request.user.username}"})

    # Authentication outside LockMiddleware: scope["user"] is set when the gate runs.
    app = Starlette(routes=[Route("/me/payout", me, methods=["POST"])], middleware=[
        Middleware(AuthenticationMiddleware, backend=CookieSessions()),
        Middleware(LockMiddleware, manager=manager, **middleware_options),
    ])
    return app, runs


async def test_cookie_sessions_behind_one_proxy_never_share_stored_answers(redis_url):
    async with make_manager(redis_url) as manager:
        app, runs = account_app(manager, principal=by_user)
        proxy = {**KEY, "x-forwarded-for": "10.0.0.1"}  # both users come through one proxy address
        async with client_for(app) as client:
            alice = await client.post("/me/payout", json={}, headers={**proxy, "cookie": "session=s-alice"})
            bob = await client.post("/me/payout", json={}, headers={**proxy, "cookie": "session=s-bob"})
            alice_retry = await client.post("/me/payout", json={}, headers={**proxy, "cookie": "session=s-alice"})
            bob_retry = await client.post("/me/payout", json={}, headers={**proxy, "cookie": "session=s-bob"})
            anonymous = await client.post("/me/payout", json={}, headers=proxy)
    assert alice.json()["iban"] == "DE-alice" and bob.json()["iban"] == "DE-bob"
    assert "idempotent-replayed" not in bob.headers
    assert alice_retry.json() == alice.json() and alice_retry.headers["idempotent-replayed"] == "true"
    assert bob_retry.json() == bob.json() and bob_retry.headers["idempotent-replayed"] == "true"
    assert anonymous.status_code == 401 and problem(anonymous)["type"] == "idempotency-principal-missing"
    assert runs == ["alice", "bob"]


async def test_no_principal_configured_is_a_loud_500_naming_the_setting(redis_url, caplog):
    async with make_manager(redis_url) as manager:
        app, runs = account_app(manager)
        async with client_for(app) as client:
            with caplog.at_level(logging.ERROR, logger="otel_lock.idempotency"):
                answers = [await client.post("/me/payout", json={}, headers={**KEY, "cookie": f"session={s}"})
                           for s in ("s-alice", "s-bob")]
    for answer in answers:
        assert answer.status_code == 500
        body = problem(answer)
        assert body["type"] == "idempotency-principal-not-configured"
        assert "principal=" in body["detail"] and "shared_scope=True" in body["detail"]
    logged = [r.getMessage() for r in caplog.records if "principal=" in r.getMessage()]
    assert len(logged) == 1 and "/me/payout" in logged[0]  # once per route, naming it
    assert runs == []


async def test_shared_scope_is_an_explicit_opt_in(redis_url):
    async with make_manager(redis_url) as manager:
        runs = []

        @idempotent(shared_scope=True)
        async def publish(request: Request) -> JSONResponse:
            runs.append(1)
            return JSONResponse({"published": len(runs)})

        app = Starlette(routes=[Route("/publish", publish, methods=["POST"])])
        app.add_middleware(LockMiddleware, manager=manager, principal=lambda request: 1 / 0)
        async with client_for(app) as client:
            one = await client.post("/publish", json={}, headers={**KEY, "x-user-id": "a"})
            other = await client.post("/publish", json={}, headers={**KEY, "x-user-id": "b"})
    # The route's own choice wins over the middleware's principal (which would fail).
    assert one.status_code == 200 and other.headers["idempotent-replayed"] == "true" and runs == [1]


async def test_route_principal_wins_over_the_middleware_principal(redis_url):
    async with make_manager(redis_url) as manager:
        runs = []

        @idempotent(principal=lambda request: request.headers["x-tenant"])
        async def order(request: Request) -> JSONResponse:
            runs.append(request.headers["x-tenant"])
            return JSONResponse({"n": len(runs)})

        app = Starlette(routes=[Route("/o", order, methods=["POST"])])
        app.add_middleware(LockMiddleware, manager=manager, principal=lambda request: "everyone")
        async with client_for(app) as client:
            for tenant in ("t1", "t2", "t1"):
                await client.post("/o", json={}, headers={**KEY, "x-tenant": tenant})
    assert runs == ["t1", "t2"]


async def test_async_principal_and_request_body_are_available(redis_url):
    async def from_body(request: Request) -> str:
        return (await request.json())["customer"]

    async with make_manager(redis_url) as manager:
        runs = []

        @idempotent(principal=from_body)
        async def pay(request: Request) -> JSONResponse:
            runs.append(1)
            return JSONResponse({"n": len(runs)})

        app = Starlette(routes=[Route("/pay", pay, methods=["POST"])])
        app.add_middleware(LockMiddleware, manager=manager)
        async with client_for(app) as client:
            first = await client.post("/pay", json={"customer": "c1"}, headers=KEY)
            retry = await client.post("/pay", json={"customer": "c1"}, headers=KEY)
    assert first.status_code == 200 and retry.headers["idempotent-replayed"] == "true" and runs == [1]


def _raises(request):
    raise KeyError("x-session")


def _rejects(request):
    raise HTTPException(403, "not your account", headers={"X-Reason": "tenant"})


@pytest.mark.parametrize("principal, status, type_", [
    (_raises, 500, "idempotency-principal-error"),
    (_rejects, 403, "idempotency-principal-rejected"),
    (lambda request: None, 401, "idempotency-principal-missing"),
    (lambda request: "", 401, "idempotency-principal-missing"),
    (lambda request: object(), 500, "idempotency-principal-error"),
    (lambda request: request.user, 500, "idempotency-principal-error"),  # no AuthenticationMiddleware
], ids=["raises", "http-exception", "none", "empty", "not-a-string", "auth-middleware-missing"])
async def test_a_principal_that_cannot_name_the_caller_fails_closed(redis_url, caplog, principal, status, type_):
    runs = []
    app = FastAPI()

    @app.post("/pay")
    @idempotent(principal=principal)
    async def pay():
        runs.append(1)
        return {}

    async with make_manager(redis_url) as manager:
        app.add_middleware(LockMiddleware, manager=manager)
        async with client_for(app) as client:
            with caplog.at_level(logging.ERROR, logger="otel_lock.idempotency"):
                answer = await client.post("/pay", json={}, headers=KEY)
    assert answer.status_code == status and problem(answer)["type"] == type_
    assert runs == []
    if status == 500:
        assert any("/pay" in r.getMessage() for r in caplog.records)  # the log names the route
    if status == 403:
        assert answer.headers["x-reason"] == "tenant"


async def test_a_principal_from_a_fastapi_dependency_style_check(redis_url):
    # FastAPI's dependencies run after the gate; a principal reads what an
    # outer authentication layer verified (here: a bearer token table).
    tokens = {"Bearer t-alice": "alice", "Bearer t-bob": "bob"}

    def verified_token(request: Request) -> str | None:
        return tokens.get(request.headers.get("authorization", ""))

    app = FastAPI()
    runs = []

    def current_user(request: Request) -> str:
        user = verified_token(request)
        if user is None:
            raise HTTPException(401, "bad token")
        return user

    @app.post("/orders")
    @idempotent(principal=verified_token)
    async def orders(user: str = Depends(current_user)):
        runs.append(user)
        return {"user": user}

    async with make_manager(redis_url) as manager:
        app.add_middleware(LockMiddleware, manager=manager)
        async with client_for(app) as client:
            for token in ("t-alice", "t-bob", "t-alice", "t-mallory"):
                await client.post("/orders", json={}, headers={**KEY, "authorization": f"Bearer {token}"})
    assert runs == ["alice", "bob"]


def test_gate_check_names_the_route_for_a_startup_walk(redis_url):
    from otel_lock.asgi.idempotency import IdempotencyGate

    gate = IdempotencyGate(manager=None, secret=b"s")
    with pytest.raises(ValueError, match=r"/api/orders.*principal="):
        gate.check(idempotent(), "/api/orders")
    gate.check(idempotent(shared_scope=True), "/api/orders")
    IdempotencyGate(manager=None, secret=b"s", principal=by_user).check(idempotent(), "/api/orders")
    with pytest.raises(ValueError, match="principal"):
        IdempotencyGate(manager=None, secret=b"s", principal="x-user-id")


async def test_rules_use_the_middleware_principal(redis_url):
    runs = []

    async def order(request: Request) -> JSONResponse:
        runs.append(request.headers["x-tenant"])
        return JSONResponse({"tenant": request.headers["x-tenant"]}, status_code=201)

    async with make_manager(redis_url) as manager:
        app = Starlette(routes=[Route("/orders", order, methods=["POST"])])
        app.add_middleware(LockMiddleware, manager=manager, rules={"POST /orders": idempotent()},
                           principal=lambda request: request.headers.get("x-tenant"))
        async with client_for(app) as client:
            answers = [await client.post("/orders", json={}, headers={**KEY, "x-tenant": t}) for t in ("a", "b", "a")]
    assert runs == ["a", "b"] and answers[2].headers["idempotent-replayed"] == "true"
    assert answers[1].json() == {"tenant": "b"}


async def test_http_exception_headers_that_are_not_latin1_do_not_break_the_answer(redis_url):
    def rejects(request):
        raise HTTPException(403, "nope", headers={"X-Why": "tenant é ✓"})

    app = FastAPI()

    @app.post("/pay")
    @idempotent(principal=rejects)
    async def pay():
        return {}

    async with make_manager(redis_url) as manager:
        app.add_middleware(LockMiddleware, manager=manager)
        async with client_for(app) as client:
            answer = await client.post("/pay", json={}, headers=KEY)
    assert answer.status_code == 403 and problem(answer)["type"] == "idempotency-principal-rejected"
