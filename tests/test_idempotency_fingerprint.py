"""The fingerprint covers what the handler reads, and its versions stay comparable.

Regression for "a replay to the wrong account": the same user and key with
`X-Account: A`, then `B`, got A's stored 201 and B's withdrawal never
happened. The fingerprint left out the handler's declared `Header()` and
`Cookie()` inputs and the lock key's own values; it is now version 3. A
record stored under version 2 is still compared by version 2's algorithm.
"""

from __future__ import annotations

from typing import Annotated

import pytest
from fastapi import APIRouter, Cookie, Depends, FastAPI, Header, Request
from pydantic import BaseModel

from otel_lock import LockMiddleware, idempotent, locked
from otel_lock.asgi.idempotency import _versions
from otel_lock.asgi.idempotency._fingerprint import fingerprint
from otel_lock.asgi.idempotency._fingerprint_inputs import Inputs
from otel_lock.asgi.idempotency._fingerprint_v2 import fingerprint_v2

try:
    from ._middleware_helpers import client_for, make_manager, problem
except ImportError:
    from _middleware_helpers import client_for, make_manager, problem


def user(request: Request) -> str | None:
    return request.headers.get("x-user-id")


class Withdrawal(BaseModel):
    amount: int


class Bank:
    """Withdrawals by account; each run is one real withdrawal."""

    def __init__(self) -> None:
        self.runs: list[tuple[str, int]] = []

    def withdraw(self, account: str, amount: int) -> dict:
        self.runs.append((account, amount))
        return {"account": account, "amount": amount, "run": len(self.runs)}


async def tenant(x_tenant: Annotated[str, Header()] = "main") -> str:
    return x_tenant                     # a header read by a dependency is an input too


def bank_app(bank: Bank) -> FastAPI:
    app = FastAPI()
    router = APIRouter(prefix="/v1")

    @router.post("/withdrawals", status_code=201)
    @idempotent(principal=user)
    async def withdraw(body: Withdrawal, x_account: Annotated[str, Header()],
                       branch: Annotated[str, Depends(tenant)], x_request_id: Annotated[str, Header()] = ""):
        return bank.withdraw(f"{branch}/{x_account}", body.amount)

    @router.post("/transfers", status_code=201)
    @idempotent(principal=user)
    async def transfer(body: Withdrawal, account: Annotated[str, Cookie()]):
        return bank.withdraw(account, body.amount)

    @router.post("/raw", status_code=201)
    @idempotent(principal=user)
    @locked("account:{header.x-account}")
    async def raw(request: Request):          # reads the header itself: the lock key names it
        return bank.withdraw(request.headers["x-account"], (await request.json())["amount"])

    app.include_router(router)
    return app


KEY = {"idempotency-key": '"w-1"', "x-user-id": "u1"}


async def test_the_same_key_with_another_declared_header_is_422_not_a_replay_to_the_wrong_account(redis_url):
    bank = Bank()
    async with make_manager(redis_url) as manager:
        app = bank_app(bank)
        app.add_middleware(LockMiddleware, manager=manager)
        async with client_for(app) as client:
            a = await client.post("/v1/withdrawals", json={"amount": 5}, headers={**KEY, "x-account": "A"})
            b = await client.post("/v1/withdrawals", json={"amount": 5}, headers={**KEY, "x-account": "B"})
            tenant = await client.post("/v1/withdrawals", json={"amount": 5},
                                       headers={**KEY, "x-account": "A", "x-tenant": "other"})
            retry = await client.post("/v1/withdrawals", json={"amount": 5.0},
                                      headers={**KEY, "x-account": "A", "authorization": "Bearer refreshed",
                                               "x-request-id": "attempt-2"})
    assert a.status_code == 201 and a.json()["account"] == "main/A"
    assert b.status_code == 422 and problem(b)["type"] == "idempotency-key-mismatch", b.text
    assert "main/A" not in b.text and "idempotent-replayed" not in b.headers
    assert tenant.status_code == 422, tenant.text
    # The same request, its JSON number spelled another way, its token and request id new: replayed.
    assert retry.status_code == 201 and retry.headers["idempotent-replayed"] == "true", retry.text
    assert retry.json() == a.json() and bank.runs == [("main/A", 5)]


async def test_the_same_key_with_another_declared_cookie_is_422(redis_url):
    bank = Bank()
    async with make_manager(redis_url) as manager:
        app = bank_app(bank)
        app.add_middleware(LockMiddleware, manager=manager)
        async with client_for(app) as client:
            a = await client.post("/v1/transfers", json={"amount": 5}, headers={**KEY, "cookie": "account=A; x=1"})
            b = await client.post("/v1/transfers", json={"amount": 5}, headers={**KEY, "cookie": "account=B; x=1"})
            again = await client.post("/v1/transfers", json={"amount": 5},
                                      headers={**KEY, "cookie": "x=2; account=A"})   # an undeclared cookie changed
    assert a.status_code == 201 and b.status_code == 422 and problem(b)["type"] == "idempotency-key-mismatch"
    assert again.status_code == 201 and again.headers["idempotent-replayed"] == "true"
    assert bank.runs == [("A", 5)]


async def test_a_header_the_lock_key_names_is_part_of_the_request(redis_url):
    bank = Bank()
    async with make_manager(redis_url) as manager:
        app = bank_app(bank)
        app.add_middleware(LockMiddleware, manager=manager)
        async with client_for(app) as client:
            a = await client.post("/v1/raw", json={"amount": 5}, headers={**KEY, "x-account": "A"})
            b = await client.post("/v1/raw", json={"amount": 5}, headers={**KEY, "x-account": "B"})
            again = await client.post("/v1/raw", json={"amount": 5}, headers={**KEY, "x-account": "A"})
    assert a.status_code == 201 and b.status_code == 422, b.text
    assert again.headers.get("idempotent-replayed") == "true" and bank.runs == [("A", 5)]


async def test_a_retry_of_a_record_stored_with_fingerprint_version_2_is_replayed(redis_url, monkeypatch):
    """Records written before the upgrade (fpv 2) are compared with version 2's algorithm."""
    bank = Bank()
    real_stamp = _versions.Fingerprints.stamp

    def stamp_v2(self, record):
        return {**record, "fp": self.v2, "fpv": 2}

    async with make_manager(redis_url) as manager:
        app = bank_app(bank)
        app.add_middleware(LockMiddleware, manager=manager)
        async with client_for(app) as client:
            monkeypatch.setattr(_versions.Fingerprints, "stamp", stamp_v2)     # the previous build writes
            first = await client.post("/v1/withdrawals", json={"amount": 5}, headers={**KEY, "x-account": "A"})
            monkeypatch.setattr(_versions.Fingerprints, "stamp", real_stamp)   # this one reads
            retry = await client.post("/v1/withdrawals", json={"amount": 5}, headers={**KEY, "x-account": "A"})
            other_body = await client.post("/v1/withdrawals", json={"amount": 6}, headers={**KEY, "x-account": "A"})
    assert first.status_code == 201
    assert retry.status_code == 201 and retry.headers["idempotent-replayed"] == "true", retry.text
    assert other_body.status_code == 422 and bank.runs == [("main/A", 5)]


# -- the algorithms themselves ------------------------------------------------------------

MULTIPART = (b"--xyz\r\nContent-Disposition: form-data; name=\"f\"; filename=\"a.txt\"\r\n"
             b"Content-Type: text/plain\r\n\r\nhello\r\n--xyz--\r\n")
GOLDEN_V2 = [   # computed by version 2 as it was committed (44cf3db); records in Redis carry these
    (("POST", "/charge", b"", [(b"host", b"shop.example"), (b"content-type", b"application/json")],
      b'{"amount": 7.0, "b": [1, "\\u00e9"]}'), "69715afeca4c1d634eeb201adc1e82983e3fd6f2d5741881ee7beba52a2a8099"),
    (("PUT", "/a/%41", b"tag=b&tag=a&x=1", [(b"host", b"Shop.Example.:8080")], b""),
     "dcd5835af68118447ac44f01cd183cb968db891df6e121488f691aa7e61966a8"),
    (("POST", "/up", b"", [(b"content-type", b"multipart/form-data; boundary=xyz")], MULTIPART),
     "cdd3636050fc2139e91b43f419c03416ae6f0d93a1742e75a366c1cd89143654"),
    (("POST", "/f", b"q", [(b"content-type", b"application/x-www-form-urlencoded"), (b"x-account", b"A")],
      b"a=1&b=2"), "4c9bc288b77ab33bf8f5220b5c5db52e06b964d31a0516de117e08111da3240d"),
]


def _scope(method, path, query, headers):
    return {"method": method, "path": path, "query_string": query, "headers": headers, "scheme": "https"}


@pytest.mark.parametrize("request_, digest", GOLDEN_V2)
def test_version_2_is_recomputed_exactly(request_, digest):
    method, path, query, headers, body = request_
    assert fingerprint_v2(b"golden", _scope(method, path, query, headers), "/r", body) == digest


def test_version_3_json_numbers_have_one_spelling_and_inputs_are_covered():
    scope = _scope("POST", "/w", b"", [(b"content-type", b"application/json"), (b"x-account", b"A"),
                                       (b"cookie", b"s=1; account=A")])
    inputs = Inputs(frozenset({"x-account"}), frozenset({"account"}))

    def fp(body: bytes, sc=scope, ins=inputs) -> str:
        return fingerprint(b"k", sc, "/w", body, ins.read(sc))

    assert fp(b'{"n": 7, "m": [1.50]}') == fp(b'{"m":[1.5],"n":7.0}') == fp(b'{"n": 70e-1, "m": [15E-1]}')
    assert fp(b'{"n": 7}') != fp(b'{"n": 7.5}') and fp(b'{"n": 9007199254740993}') != fp(b'{"n": 9007199254740992}')
    other = _scope("POST", "/w", b"", [(b"content-type", b"application/json"), (b"x-account", b"B"),
                                       (b"cookie", b"s=1; account=A")])
    assert fp(b"{}", other) != fp(b"{}")
    no_cookie = _scope("POST", "/w", b"", [(b"content-type", b"application/json"), (b"x-account", b"A")])
    assert fp(b"{}", no_cookie) != fp(b"{}")
    assert fp(b"{}", ins=Inputs()) != fp(b"{}")
