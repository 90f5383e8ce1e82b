"""Which answers are stored, and options checked at decoration time."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
from fastapi import Depends, FastAPI, HTTPException, Request
from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route

from otel_lock import LockMiddleware, idempotent, locked
from otel_lock.asgi.idempotency._answer import FREE, STORE, UNKNOWN, verdict

try:
    from ._middleware_helpers import client_for, make_manager, problem
except ImportError:
    from _middleware_helpers import client_for, make_manager, problem

KEY = {"idempotency-key": '"k-1"'}
DOCS = Path(__file__).resolve().parent.parent / "docs" / "idempotency.md"


class Flaky:
    """Answers `first` once (status, headers), then 201: counts the handler's runs."""

    def __init__(self, status: int, headers: dict | None = None) -> None:
        self.runs = 0

        @idempotent(shared_scope=True)
        async def endpoint(request):
            self.runs += 1
            if self.runs == 1:
                return JSONResponse({"try": 1}, status_code=status, headers=headers)
            return JSONResponse({"try": self.runs}, status_code=201)
        self.fn = endpoint


async def _twice_then_again(redis_url, flaky: Flaky):
    async with make_manager(redis_url) as manager:
        app = Starlette(routes=[Route("/op", flaky.fn, methods=["POST"])])
        app.add_middleware(LockMiddleware, manager=manager)
        async with client_for(app) as client:
            return [await client.post("/op", json={}, headers=KEY) for _ in range(3)]


@pytest.mark.parametrize("status, headers", [
    (408, None), (409, None), (425, None), (429, None), (502, None), (503, None), (504, None),
    (401, {"WWW-Authenticate": "Bearer"}), (403, None),
    (200, {"Retry-After": "5"}), (202, {"Retry-After": "1"}), (400, {"Retry-After": "1"}),
    (500, {"Retry-After": "1"}),
], ids=lambda v: str(v) if isinstance(v, int) else "retry-after" if v and "Retry-After" in v else "")
async def test_answers_that_ask_for_a_retry_are_not_stored(redis_url, status, headers):
    flaky = Flaky(status, headers)
    first, retry, again = await _twice_then_again(redis_url, flaky)
    assert first.status_code == status and "idempotent-replayed" not in first.headers
    assert retry.status_code == 201 and "idempotent-replayed" not in retry.headers  # the handler ran again
    assert again.status_code == 201 and again.headers["idempotent-replayed"] == "true"  # now stored
    assert flaky.runs == 2


@pytest.mark.parametrize("status", [200, 201, 204, 400, 404, 410, 422])
async def test_final_answers_are_stored(redis_url, status):
    flaky = Flaky(status)
    first, retry, _ = await _twice_then_again(redis_url, flaky)
    assert retry.status_code == status and retry.headers["idempotent-replayed"] == "true"
    assert flaky.runs == 1


@pytest.mark.parametrize("status", [500, 501, 505])
async def test_other_5xx_leave_the_outcome_unknown(redis_url, status):
    flaky = Flaky(status)
    first, retry, _ = await _twice_then_again(redis_url, flaky)
    assert retry.status_code == 409 and problem(retry)["type"] == "idempotency-outcome-unknown"
    assert flaky.runs == 1


async def test_a_handlers_own_lock_timeout_is_not_stored(redis_url):
    # The handler takes a second lock itself and answers 409 lock-timeout with
    # Retry-After while it is busy; the client's retry must run it again.
    runs = []

    @idempotent(shared_scope=True)
    @locked("order:{path.order}", wait=0)
    async def pay(request):
        runs.append(1)
        held = await request.app.state.manager.try_lock("card:4711")
        if held is None:
            return JSONResponse({"type": "lock-timeout"}, status_code=409, headers={"Retry-After": "1"})
        await held.release()
        return JSONResponse({"paid": True}, status_code=201)

    async with make_manager(redis_url) as manager, make_manager(redis_url) as other:
        app = Starlette(routes=[Route("/orders/{order}/pay", pay, methods=["POST"])])
        app.state.manager = manager
        app.add_middleware(LockMiddleware, manager=manager)
        card = await other.try_lock("card:4711")
        async with client_for(app) as client:
            busy = await client.post("/orders/1/pay", json={}, headers=KEY)
            await card.release()
            retry = await client.post("/orders/1/pay", json={}, headers=KEY)
    assert busy.status_code == 409 and retry.status_code == 201 and "idempotent-replayed" not in retry.headers
    assert len(runs) == 2


async def test_auth_failure_from_a_fastapi_dependency_is_not_stored(redis_url):
    app = FastAPI()
    runs = []
    valid = {"expired": False}

    def session(request: Request) -> str:
        if valid["expired"]:
            raise HTTPException(401, "session expired", headers={"WWW-Authenticate": "Bearer"})
        return "alice"

    @app.post("/orders", status_code=201)
    @idempotent(principal=lambda request: "alice")
    async def orders(user: str = Depends(session)):
        runs.append(user)
        return {"user": user}

    async with make_manager(redis_url) as manager:
        app.add_middleware(LockMiddleware, manager=manager)
        async with client_for(app) as client:
            valid["expired"] = True
            rejected = await client.post("/orders", json={}, headers=KEY)
            valid["expired"] = False
            after_login = await client.post("/orders", json={}, headers=KEY)
    assert rejected.status_code == 401 and after_login.status_code == 201 and runs == ["alice"]


def test_the_docs_table_of_stored_answers_matches_the_code():
    """docs/idempotency.md's 'Which answers are stored' table is what verdict() does."""
    text = DOCS.read_text()
    section = text.split("## Which answers are stored", 1)[1].split("\n## ", 1)[0]
    expected = {"stored": STORE, "not stored": FREE, "outcome unknown": UNKNOWN}
    checked = 0
    for row in section.splitlines():
        cells = [c.strip() for c in row.strip().strip("|").split("|")]
        if not row.startswith("|") or len(cells) != 3 or cells[1] not in expected:
            continue
        statuses = [int(s) for s in re.findall(r"`(\d{3})`", cells[0])]
        retry_after = "with a `Retry-After`" in cells[0]
        for status in statuses:
            assert verdict(status, retry_after) == expected[cells[1]], (status, cells)
            checked += 1
    assert checked >= 15


# -- nonsense options fail when the route is decorated ----------------------

@pytest.mark.parametrize("options, names", [
    ({"ttl": 0.0001}, "ttl"), ({"ttl": 0}, "ttl"), ({"ttl": -1}, "ttl"), ({"ttl": math.nan}, "ttl"),
    ({"ttl": math.inf}, "ttl"), ({"ttl": "60"}, "ttl"), ({"ttl": True}, "ttl"), ({"ttl": 10**12}, "ttl"),
    ({"wait_for_inflight": -1}, "wait_for_inflight"), ({"wait_for_inflight": math.nan}, "wait_for_inflight"),
    ({"ttl": 60, "wait_for_inflight": 120}, "wait_for_inflight"),
    ({"retry_after": math.inf}, "retry_after"), ({"retry_after": -0.5}, "retry_after"),
    ({"max_stored_response": -1}, "max_stored_response"), ({"max_stored_response": 1.5}, "max_stored_response"),
    ({"max_stored_response": True}, "max_stored_response"), ({"max_stored_response": 2**40}, "max_stored_response"),
    ({"max_body": 10, "max_stored_response": 10}, "max_stored_response"),
    ({"unauthenticated_status": 200}, "unauthenticated_status"), ({"unauthenticated_status": "401"}, "unauthenticated_status"),
    ({"challenge": None}, "challenge"), ({"challenge": ""}, "challenge"), ({"challenge": "Bearer\r\nX: 1"}, "challenge"),
    ({"challenge": "B\u00e9arer"}, "challenge"), ({"challenge": 'realm="x"'}, "challenge"),
    ({"required": "yes"}, "required"), ({"retry_on_5xx": 1}, "retry_on_5xx"), ({"shared_scope": "no"}, "shared_scope"),
    ({"principal": "x-user-id"}, "principal"), ({"principal": lambda: "u"}, "principal"),
    ({"principal": lambda request: "u", "shared_scope": True}, "principal"),
], ids=lambda v: re.sub(r" at 0x[0-9a-f]+", "", repr(v)) if isinstance(v, dict) else v)  # same ids in every xdist worker
def test_nonsense_options_fail_at_decoration_time(options, names):
    with pytest.raises(ValueError, match=names):
        idempotent(**options)


def test_sensible_options_are_accepted():
    for options in ({"ttl": 1}, {"ttl": 366 * 86400}, {"ttl": 60, "wait_for_inflight": 60},
                    {"max_stored_response": 0}, {"retry_after": 0}, {"principal": lambda request, extra=None: "u"},
                    {"shared_scope": True}, {"challenge": 'Basic realm="shop", charset="UTF-8"'},
                    {"unauthenticated_status": 403, "challenge": None}):
        idempotent(**options)


def test_max_body_is_the_deprecated_name_of_max_stored_response():
    # `max_body` meant the request on LockMiddleware and the stored response here.
    with pytest.warns(DeprecationWarning, match="max_stored_response"):
        old = idempotent(max_body=1000)
    assert old == idempotent(max_stored_response=1000) and old.max_stored_response == 1000
    with pytest.raises(ValueError, match="max_stored_response"), pytest.warns(DeprecationWarning):
        idempotent(max_body=-1)


def test_middleware_principal_must_be_callable(redis_url):
    with pytest.raises(ValueError, match="principal"):
        LockMiddleware(Starlette(), manager=object(), principal="x-user-id")


async def test_a_lost_route_lock_is_outcome_unknown_not_a_free_retry(redis_url):
    # The middleware's `503 lock-lost` carries Retry-After, but the handler was cut off
    # half-way: a retry must not run it again.
    import asyncio

    entered = asyncio.Event()
    runs = []

    @idempotent(shared_scope=True)
    @locked("order:{path.order}")
    async def pay(request):
        runs.append(1)
        entered.set()
        await asyncio.Event().wait()  # charging the card... until the lease is lost

    async with make_manager(redis_url, lease=0.3) as manager, make_manager(redis_url) as operator:
        app = Starlette(routes=[Route("/orders/{order}/pay", pay, methods=["POST"])])
        app.add_middleware(LockMiddleware, manager=manager)
        async with client_for(app) as client:
            first = asyncio.create_task(client.post("/orders/1/pay", json={}, headers=KEY))
            await entered.wait()
            assert await operator.force_release("order:1")
            lost = await asyncio.wait_for(first, 10)
            retry = await asyncio.wait_for(client.post("/orders/1/pay", json={}, headers=KEY), 10)
    assert lost.status_code == 503 and problem(lost)["type"] == "lock-lost"
    assert retry.status_code == 409 and problem(retry)["type"] == "idempotency-outcome-unknown"
    assert "interrupted" in problem(retry)["detail"] and runs == [1]


async def test_app_failing_after_the_response_makes_the_stored_answer_unknown(redis_url):
    # FastAPI runs a yield dependency's exit code (the session-per-request commit)
    # after the response went out; if the commit fails, the stored 201 is a lie.
    app = FastAPI()
    runs = []

    async def session():
        yield "db"
        raise RuntimeError("commit failed")

    @app.post("/orders", status_code=201)
    @idempotent(shared_scope=True)
    async def orders(db: str = Depends(session)):
        runs.append(db)
        return {"order": len(runs)}

    async with make_manager(redis_url) as manager:
        app.add_middleware(LockMiddleware, manager=manager)
        async with client_for(app) as client:
            await client.post("/orders", json={}, headers=KEY)
            retry = await client.post("/orders", json={}, headers=KEY)
    assert retry.status_code == 409 and problem(retry)["type"] == "idempotency-outcome-unknown"
    assert runs == ["db"]


# -- records release 0.1.0 reads and writes (tests/test_versions_mixed_fleet.py runs 0.1.0 itself
# beside this code) ------------------------------------------------------------------

SECRET = "storage-test-secret"
MULTIPART = (b"--xyz\r\nContent-Disposition: form-data; name=\"f\"; filename=\"a.txt\"\r\n"
             b"Content-Type: text/plain\r\n\r\nhello\r\n--xyz--\r\n")


def _scope_id(key: str, principal: str = "s:") -> str:
    import hashlib
    import hmac
    return hmac.new(SECRET.encode(), f"{principal}\0{key}".encode(), hashlib.sha256).hexdigest()[:32]


def _old_key(key: str) -> str:
    return f"mwtest:{{idem:{_scope_id(key)}}}:idempotency"


def _fp_v1(content_type: str, body: bytes, path: str = "/charge") -> str:
    from otel_lock.asgi.idempotency._fingerprint_v1 import fingerprint_v1
    scope = {"method": "POST", "path": path, "query_string": b"", "headers": [(b"content-type", content_type.encode())]}
    return fingerprint_v1(SECRET.encode(), scope, "/charge", body)


class Charges:
    """A paid operation: counts its runs, answers 201 with the run's number."""

    def __init__(self, **options) -> None:
        self.runs = 0
        self.during: list = []          # what `look` saw while the handler ran

        @idempotent(shared_scope=True, **options)
        async def charge(request):
            self.runs += 1
            if self.look is not None:
                self.during.append(await self.look())
            return JSONResponse({"charge": self.runs}, status_code=201)
        self.fn = charge
        self.look = None

    def app(self, manager, **middleware):
        app = Starlette(routes=[Route("/charge", self.fn, methods=["POST"])])
        app.add_middleware(LockMiddleware, manager=manager, hash_secret=SECRET, **middleware)
        return app


@pytest.mark.parametrize("content_type, body", [
    ("application/json", b'{"amount": 5}'),
    ("multipart/form-data; boundary=xyz", MULTIPART),     # 0.1.0 fingerprinted multipart as raw bytes
], ids=["json", "multipart"])
async def test_a_record_written_by_0_1_0_is_replayed_to_a_byte_identical_retry(redis_url, redis_client,
                                                                             content_type, body):
    # 0.1.0 computed `fp` without scheme and host, multipart as raw bytes, and wrote no version:
    # compared with this release's fingerprint, the honest retry was a 422.
    import base64
    import json
    stored = {"state": "done", "fp": _fp_v1(content_type, body), "route": "/charge", "status": 201,
              "headers": [["content-type", "application/json"]], "body": base64.b64encode(b'{"charge":1}').decode()}
    await redis_client.set(_old_key("k-1"), json.dumps(stored), px=60_000)
    charges = Charges()
    async with make_manager(redis_url) as manager, client_for(charges.app(manager)) as client:
        retry = await client.post("/charge", content=body, headers={**KEY, "content-type": content_type})
    assert retry.status_code == 201, retry.text
    assert retry.headers["idempotent-replayed"] == "true" and retry.json() == {"charge": 1}
    assert charges.runs == 0


async def test_every_record_is_also_written_as_0_1_0_reads_it(redis_url, redis_client):
    import json
    charges = Charges()
    charges.look = lambda: redis_client.get(_old_key("k-1"))
    body = b'{"amount": 5}'
    async with make_manager(redis_url) as manager, client_for(charges.app(manager)) as client:
        first = await client.post("/charge", content=body, headers={**KEY, "content-type": "application/json"})
        current = [json.loads(await redis_client.hget(k, "d"))
                   async for k in redis_client.scan_iter(match="mwtest:idem:*:r:*")]
    old = json.loads(await redis_client.get(_old_key("k-1")))
    claim = json.loads(charges.during[0])
    assert first.status_code == 201 and charges.runs == 1
    # In flight, 0.1.0 finds its own form of the claim (so it answers 409, not runs it again) ...
    assert claim == {"state": "started", "fp": _fp_v1("application/json", body), "route": "/charge"}
    # ... and after, the answer, with the fingerprint as 0.1.0 computes it and no version.
    assert old["state"] == "done" and old["status"] == 201 and "fpv" not in old
    assert old["fp"] == claim["fp"]
    assert [(r["fpv"], r["state"], r["body"]) for r in current] == [(3, "done", old["body"])]
    assert current[0]["fp"] != old["fp"]                      # this release's own fingerprint


async def test_an_answer_that_frees_the_key_frees_it_in_both_layouts(redis_url, redis_client):
    flaky = Flaky(503)
    async with make_manager(redis_url) as manager:
        app = Starlette(routes=[Route("/op", flaky.fn, methods=["POST"])])
        app.add_middleware(LockMiddleware, manager=manager, hash_secret=SECRET)
        async with client_for(app) as client:
            busy = await client.post("/op", json={}, headers=KEY)
    assert busy.status_code == 503
    assert await redis_client.exists(_old_key("k-1")) == 0
    assert [k async for k in redis_client.scan_iter(match="mwtest:idem:*:r:*")] == []


async def test_a_0_1_0_answer_written_while_we_waited_for_the_lock_is_replayed(redis_url, redis_client):
    # A 0.1.0 replica holds the in-flight lock (the same lock in both releases) and writes its
    # answer only in its own layout; our first look came before it. Under the lock the claim must
    # see it, not claim the new layout and run the handler a second time.
    import asyncio
    import base64
    import json

    from otel_lock.asgi.idempotency import IdempotencyStore

    class Watched(IdempotencyStore):
        looked = asyncio.Event()

        async def load(self, rid, also=None):
            record = await super().load(rid, also)
            self.looked.set()
            return record

    charges = Charges(wait_for_inflight=10)
    store = Watched()
    body = b'{"amount": 5}'
    async with make_manager(redis_url) as manager, make_manager(redis_url) as old_replica:
        held = await old_replica.try_lock(f"idem:{_scope_id('k-1')}")
        async with client_for(charges.app(manager, idempotency_store=store)) as client:
            retry = asyncio.create_task(
                client.post("/charge", content=body, headers={**KEY, "content-type": "application/json"}))
            await asyncio.wait_for(store.looked.wait(), 10)
            done = {"state": "done", "fp": _fp_v1("application/json", body), "route": "/charge", "status": 201,
                    "headers": [], "body": base64.b64encode(b"first").decode()}
            await redis_client.set(_old_key("k-1"), json.dumps(done), px=60_000)
            await held.release()
            answer = await asyncio.wait_for(retry, 10)
    assert answer.status_code == 201 and answer.content == b"first", answer.text
    assert charges.runs == 0


async def test_a_record_of_an_unknown_fingerprint_version_is_neither_replayed_nor_run(redis_url, redis_client,
                                                                                      caplog):
    import json
    newer = {"state": "done", "fp": "?", "fpv": 99, "route": "/charge", "status": 201, "headers": [], "body": ""}
    await redis_client.set(_old_key("k-1"), json.dumps(newer), px=60_000)
    charges = Charges()
    async with make_manager(redis_url) as manager, client_for(charges.app(manager)) as client:
        answers = [await client.post("/charge", json={}, headers=KEY) for _ in range(2)]
    assert [a.status_code for a in answers] == [409, 409]
    assert problem(answers[0])["type"] == "idempotency-outcome-unknown" and charges.runs == 0
    assert "fingerprint version 99" in caplog.text


def test_on_a_cluster_both_layouts_are_written_in_their_own_slots_and_a_retry_is_replayed():
    # The 0.1.0 copy shares the in-flight lock's hash tag; the bounded record sits in its
    # principal's slot, here another one (the two writes are not one transaction: both happen
    # under the in-flight lock, see docs/versioning.md).
    import asyncio
    import json

    import redis.asyncio as aioredis
    from redis.crc import key_slot

    try:
        from ._deployments import deployment_url
    except ImportError:
        from _deployments import deployment_url

    import hashlib
    import hmac
    owner = hmac.new(SECRET.encode(), b"principal\0s:", hashlib.sha256).hexdigest()[:32]
    key = next(f"c-{i}" for i in range(100)
               if key_slot(_old_key(f"c-{i}").encode()) != key_slot(f"mwtest:idem:{{{owner}}}".encode()))

    async def run(url: str) -> tuple[list, dict | None, int]:
        charges = Charges()
        async with make_manager(url) as manager, client_for(charges.app(manager)) as client:
            answers = [await client.post("/charge", json={"a": 1}, headers={"idempotency-key": key})
                       for _ in range(2)]
            cluster = manager.redis
            old = await cluster.get(_old_key(key))
            records = [k async for k in cluster.scan_iter(match="mwtest:idem:*:r:*")]
        assert len(records) == 1 and key_slot(records[0]) != key_slot(_old_key(key).encode())
        return answers, json.loads(old) if old else None, charges.runs

    with deployment_url("cluster") as url:
        answers, old, runs = asyncio.run(run(url))
    assert [a.status_code for a in answers] == [201, 201] and answers[1].headers["idempotent-replayed"] == "true"
    assert old is not None and old["state"] == "done" and runs == 1


def test_records_are_stored_and_replayed_on_a_server_without_script():
    """Regression: the store registered its scripts with redis-py (SCRIPT LOAD), so on a server that
    renames SCRIPT away every idempotent request failed while the lock itself worked by EVAL."""
    import asyncio

    from otel_lock.cli._redis_server import RedisServer

    async def run(url: str) -> list:
        charges = Charges()
        async with make_manager(url) as manager, client_for(charges.app(manager)) as client:
            answers = [await client.post("/charge", json={"amount": 5}, headers=KEY) for _ in range(2)]
        return [charges.runs, *answers]

    with RedisServer(extra_args=("--rename-command", "SCRIPT", "")) as server:
        runs, first, retry = asyncio.run(run(server.url))
    assert first.status_code == 201, first.text
    assert retry.status_code == 201 and retry.headers["idempotent-replayed"] == "true"
    assert runs == 1
