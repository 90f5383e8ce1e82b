"""Idempotency records are bounded, may live on their own Redis, and Redis failures are answers.

Every test runs real redis-server processes: some with `maxmemory` and an
evicting policy or `noeviction`, one with a password, one at `maxclients`.
"""

from __future__ import annotations

import asyncio
import logging

import pytest
import redis.asyncio as aioredis
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from otel_lock import LockMiddleware, idempotent, locked
from otel_lock.asgi.idempotency import IdempotencyStore
from otel_lock.asgi.idempotency._store import MIB
from otel_lock.cli._redis_server import RedisServer

try:
    from ._middleware_helpers import NAMESPACE, client_for, make_manager, problem
    from ._proc_helpers import until
except ImportError:
    from _middleware_helpers import NAMESPACE, client_for, make_manager, problem
    from _proc_helpers import until


def user(request: Request) -> str | None:
    return request.headers.get("x-user-id")


class Shop:
    """Orders (small answers) and reports (`size` bytes each), counting the handler's runs per user."""

    def __init__(self, size: int = 900 * 1024, max_stored_response: int = MIB) -> None:
        self.runs: dict[str, int] = {}
        self.size = size
        annotation = idempotent(principal=user, max_stored_response=max_stored_response)

        async def order(request: Request) -> JSONResponse:
            self._ran(request)
            return JSONResponse({"order": self.runs[request.headers["x-user-id"]]}, status_code=201)

        async def report(request: Request) -> Response:
            self._ran(request)
            return Response(b"r" * self.size, status_code=201, media_type="application/octet-stream")

        async def busy(request: Request) -> JSONResponse:
            self._ran(request)
            return JSONResponse({"later": True}, status_code=503, headers={"Retry-After": "1"})

        async def stock(request: Request) -> JSONResponse:
            return JSONResponse({"sku": request.path_params["sku"]})

        self.routes = [Route("/orders", annotation(order), methods=["POST"]),
                       Route("/reports", annotation(report), methods=["POST"]),
                       Route("/busy", annotation(busy), methods=["POST"]),
                       Route("/stock/{sku}", locked("stock:{path.sku}")(stock), methods=["POST"])]

    def _ran(self, request: Request) -> None:
        who = request.headers["x-user-id"]
        self.runs[who] = self.runs.get(who, 0) + 1

    def app(self, manager, store: IdempotencyStore | None = None) -> Starlette:
        app = Starlette(routes=self.routes)
        app.add_middleware(LockMiddleware, manager=manager, idempotency_store=store)
        return app


def headers(who: str, key: str) -> dict:
    return {"x-user-id": who, "idempotency-key": f'"{key}"'}


async def usage(client: aioredis.Redis, namespace: str = NAMESPACE) -> dict:
    """The total usage the store keeps (records, bytes)."""
    raw = await client.hgetall(f"{namespace}:idem:{{total}}:usage")
    return {k.decode(): int(v) for k, v in raw.items() if k in (b"records", b"bytes")}


# -- caps per principal and in total -----------------------------------------------------------


async def test_a_principal_over_its_record_cap_gets_429_and_no_one_else_does(redis_url):
    shop = Shop()
    store = IdempotencyStore(max_records_per_principal=3)
    async with make_manager(redis_url) as manager:
        async with client_for(shop.app(manager, store)) as client:
            mallory = [await client.post("/orders", json={}, headers=headers("mallory", f"m{i}")) for i in range(5)]
            retry = await client.post("/orders", json={}, headers=headers("mallory", "m0"))
            alice = [await client.post("/orders", json={}, headers=headers("alice", f"a{i}")) for i in range(3)]
    assert [r.status_code for r in mallory] == [201, 201, 201, 429, 429]
    refused = mallory[3]
    assert problem(refused)["type"] == "idempotency-quota-exceeded" and int(refused.headers["retry-after"]) >= 1
    assert retry.headers["idempotent-replayed"] == "true"        # her stored answers are still hers
    assert [r.status_code for r in alice] == [201, 201, 201]
    assert shop.runs == {"mallory": 3, "alice": 3}               # a refused request never ran


async def test_a_principal_over_its_byte_cap_is_refused_before_the_handler_runs(redis_url):
    # Refused while the room left is less than the route's largest storable answer:
    # the handler never runs for an answer that could not be replayed.
    shop = Shop(size=300 * 1024, max_stored_response=400 * 1024)
    store = IdempotencyStore(max_bytes_per_principal=2 * MIB)
    async with make_manager(redis_url) as manager:
        async with client_for(shop.app(manager, store)) as client:
            answers = [await client.post("/reports", headers=headers("mallory", f"r{i}")) for i in range(8)]
            retries = [await client.post("/reports", headers=headers("mallory", f"r{i}")) for i in range(8)]
            other = await client.post("/reports", headers=headers("bob", "r0"))
    statuses = [r.status_code for r in answers]
    stored = statuses.count(201)
    assert 2 <= stored < 8 and statuses == [201] * stored + [429] * (8 - stored)
    assert all(r.headers.get("idempotent-replayed") == "true" for r in retries[:stored])
    assert other.status_code == 201 and shop.runs == {"mallory": stored, "bob": 1}


async def test_an_answer_that_no_longer_fits_is_stored_as_not_replayable_never_rerun(redis_url):
    # Concurrent claims all fit, their answers do not: the ones past the cap become
    # tombstones (409 on retry), never a second run.
    release = asyncio.Event()
    entered: list = []
    runs = []

    @idempotent(principal=user)
    async def report(request: Request) -> Response:
        runs.append(1)
        entered.append(1)
        await release.wait()
        return Response(b"x" * 600 * 1024, status_code=201)

    store = IdempotencyStore(max_bytes_per_principal=4 * MIB)
    async with make_manager(redis_url) as manager:
        app = Starlette(routes=[Route("/r", report, methods=["POST"])])
        app.add_middleware(LockMiddleware, manager=manager, idempotency_store=store)
        async with client_for(app) as client:
            first = [asyncio.create_task(client.post("/r", headers=headers("m", f"k{i}"))) for i in range(6)]
            async def all_entered() -> bool:
                return len(entered) == 6

            await until(all_entered, "every request in its handler")
            release.set()
            answers = [await t for t in first]
            retries = [await client.post("/r", headers=headers("m", f"k{i}")) for i in range(6)]
    assert [a.status_code for a in answers] == [201] * 6 and len(runs) == 6
    replayed = [r for r in retries if r.headers.get("idempotent-replayed") == "true"]
    not_stored = [r for r in retries if r.status_code == 409]
    assert replayed and not_stored and len(replayed) + len(not_stored) == 6
    assert all(problem(r)["type"] == "idempotency-response-not-stored" for r in not_stored)
    assert len(runs) == 6


async def test_the_total_cap_answers_507_for_everyone(redis_url):
    shop = Shop()
    store = IdempotencyStore(max_records=3)
    async with make_manager(redis_url) as manager:
        async with client_for(shop.app(manager, store)) as client:
            answers = [await client.post("/orders", json={}, headers=headers(who, "k"))
                       for who in ("a", "b", "c", "d")]
            replay = await client.post("/orders", json={}, headers=headers("a", "k"))
    assert [r.status_code for r in answers] == [201, 201, 201, 507]
    assert problem(answers[3])["type"] == "idempotency-storage-full" and answers[3].headers["retry-after"]
    assert replay.headers["idempotent-replayed"] == "true" and "d" not in shop.runs


async def test_answers_that_are_not_stored_give_their_room_back(redis_url, redis_client):
    shop = Shop()
    store = IdempotencyStore(max_records_per_principal=2, max_records=2)
    async with make_manager(redis_url) as manager:
        async with client_for(shop.app(manager, store)) as client:
            busy = [await client.post("/busy", json={}, headers=headers("m", f"b{i}")) for i in range(10)]
            assert await usage(redis_client) == {"records": 0, "bytes": 0}
            orders = [await client.post("/orders", json={}, headers=headers("m", f"o{i}")) for i in range(2)]
            assert (await usage(redis_client))["records"] == 2
    assert [r.status_code for r in busy] == [503] * 10
    assert [r.status_code for r in orders] == [201, 201]


async def test_expired_records_leave_the_counts(redis_url, redis_client):
    shop = Shop()
    annotation = idempotent(principal=user, ttl=1)

    async def order(request: Request) -> JSONResponse:
        return JSONResponse({}, status_code=201)

    store = IdempotencyStore(max_records_per_principal=2, max_records=10)
    store._bucket_ms = 200   # count expiries to a fifth of a second here (a minute in production)
    async with make_manager(redis_url) as manager:
        app = Starlette(routes=[Route("/o", annotation(order), methods=["POST"])])
        app.add_middleware(LockMiddleware, manager=manager, idempotency_store=store)
        async with client_for(app) as client:
            first = [await client.post("/o", json={}, headers=headers("m", f"k{i}")) for i in range(3)]

            async def room_again() -> bool:
                answer = await client.post("/o", json={}, headers=headers("m", "later"))
                return answer.status_code == 201

            assert [r.status_code for r in first] == [201, 201, 429]
            await until(room_again, "room again once the records expired", timeout=10, every=0.05)
    assert (await usage(redis_client))["records"] == 1
    assert shop.runs == {}


async def test_the_shared_scope_has_no_per_principal_cap_only_the_total(redis_url):
    runs = []

    @idempotent(shared_scope=True)
    async def hook(request: Request) -> JSONResponse:
        runs.append(1)
        return JSONResponse({}, status_code=201)

    store = IdempotencyStore(max_records_per_principal=2, max_records=5)
    async with make_manager(redis_url) as manager:
        app = Starlette(routes=[Route("/hook", hook, methods=["POST"])])
        app.add_middleware(LockMiddleware, manager=manager, idempotency_store=store)
        async with client_for(app) as client:
            answers = [await client.post("/hook", headers={"idempotency-key": f"k{i}"}) for i in range(6)]
    assert [r.status_code for r in answers] == [201] * 5 + [507] and len(runs) == 5


def test_store_options_are_checked():
    for options in ({"max_records": 0}, {"max_bytes": -1}, {"max_records_per_principal": 1.5},
                    {"max_bytes_per_principal": True}, {"namespace": ""}, {"namespace": "a{b}"}):
        with pytest.raises(ValueError, match=next(iter(options))):
            IdempotencyStore(**options)
    with pytest.raises(ValueError, match="IdempotencyStore"):
        LockMiddleware(Starlette(), idempotency_store="redis://x")


# -- records on their own Redis ----------------------------------------------------------------


async def test_records_on_their_own_redis_never_touch_the_locks_redis(redis_url, redis_client):
    shop = Shop()
    with RedisServer() as records_server:
        store = IdempotencyStore.from_url(records_server.url, namespace="records")
        records = aioredis.Redis.from_url(records_server.url)
        try:
            async with make_manager(redis_url) as manager:
                async with client_for(shop.app(manager, store)) as client:
                    first = await client.post("/orders", json={}, headers=headers("alice", "k"))
                    retry = await client.post("/orders", json={}, headers=headers("alice", "k"))
                    # The locks' Redis holds only the in-flight lock's own keys, no record.
                    locks_keys = [k async for k in redis_client.scan_iter(match="*idem*")
                                  if not k.startswith(f"{NAMESPACE}:{{idem:".encode())]
                    record_keys = [k async for k in records.scan_iter(match="records:idem:*")]
                    listed = await manager.held_locks()
        finally:
            await records.aclose()
            await store.aclose()
    assert first.status_code == 201 and retry.headers["idempotent-replayed"] == "true"
    assert locks_keys == [] and len(record_keys) == 5      # record, 2 usage keys per principal and total
    assert listed == []


async def test_record_keys_beside_the_locks_do_not_look_like_locks(redis_url):
    shop = Shop()
    async with make_manager(redis_url) as manager, make_manager(redis_url) as other:
        held = await other.try_lock("stock:9")
        async with client_for(shop.app(manager)) as client:
            await client.post("/orders", json={}, headers=headers("alice", "k"))
        listed = await manager.held_locks()
        await held.release()
    assert [info.key for info in listed] == [f"{NAMESPACE}:{{stock:9}}"]


# -- memory limits: one principal's answers never evict another's record or a lock -------------


@pytest.mark.parametrize("policy", ["allkeys-lru", "volatile-lru", "noeviction"])
async def test_one_principals_big_answers_never_evict_anothers_record_or_a_lock(policy, caplog):
    # Regression test: one principal storing 60 answers of 900 KB evicted another user's completed
    # record (her retry ran the handler again) and a held lock; under noeviction another user's
    # @locked request got a plain 500. With the default store, on the same Redis as the locks:
    shop = Shop()
    caplog.set_level(logging.WARNING, "otel_lock.idempotency")
    with RedisServer(extra_args=("--maxmemory", "48mb", "--maxmemory-policy", policy)) as server:
        async with make_manager(server.url) as manager, make_manager(server.url) as other:
            held = await other.acquire("payroll", lease=60)
            async with client_for(shop.app(manager)) as client:
                alice = await client.post("/orders", json={}, headers=headers("alice", "order-1"))
                mallory = [await client.post("/reports", headers=headers("mallory", f"r{i}")) for i in range(60)]
                alice_retry = await client.post("/orders", json={}, headers=headers("alice", "order-1"))
                bob_stock = await client.post("/stock/1")
            still_held = not held.lost.is_set() and [i.key for i in await manager.held_locks()] == \
                [f"{NAMESPACE}:{{payroll}}"]
            await held.release()
            info = await other.redis.info()
    statuses = [r.status_code for r in mallory]
    assert alice.status_code == 201 and alice_retry.headers["idempotent-replayed"] == "true"
    assert shop.runs["alice"] == 1                               # her retry never ran the handler again
    assert 5 <= statuses.count(201) < 60 and set(statuses) == {201, 429}
    assert bob_stock.status_code == 200 and still_held
    assert info["evicted_keys"] == 0
    warned = any("maxmemory-policy" in r.getMessage() for r in caplog.records)
    assert warned == (policy != "noeviction")


async def test_the_total_cap_stays_below_half_the_servers_maxmemory():
    with RedisServer(extra_args=("--maxmemory", "40mb", "--maxmemory-policy", "noeviction")) as server:
        async with make_manager(server.url) as manager:
            store = IdempotencyStore(max_bytes=1024 * MIB, max_bytes_per_principal=64 * MIB)
            app = Shop().app(manager, store)
            async with client_for(app) as client:
                await client.post("/orders", json={}, headers=headers("a", "k"))
    assert store.caps.bytes == 20 * MIB and store.caps.bytes_per_principal == 20 * MIB


# -- Redis failures of the record store are problem+json answers ---------------------------------


async def _records_answer(redis_url, store: IdempotencyStore, path: str = "/orders") -> tuple:
    shop = Shop()
    async with make_manager(redis_url) as manager:
        async with client_for(shop.app(manager, store)) as client:
            answer = await client.post(path, json={}, headers=headers("alice", "k"))
            stock = await client.post("/stock/1")
    return answer, stock, shop


async def test_a_full_record_store_under_noeviction_is_a_503_with_retry_after(redis_url):
    with RedisServer(extra_args=("--maxmemory", "8mb", "--maxmemory-policy", "noeviction")) as server:
        filler = aioredis.Redis.from_url(server.url)
        try:
            with pytest.raises(Exception, match="OOM|maxmemory"):
                for i in range(1000):
                    await filler.set(f"other-app:{i}", b"x" * 100_000)
            store = IdempotencyStore.from_url(server.url, max_bytes=None, max_bytes_per_principal=None)
            answer, stock, shop = await _records_answer(redis_url, store)
            await filler.flushall()
            async with make_manager(redis_url) as manager:
                async with client_for(Shop().app(manager, store)) as client:
                    later = await client.post("/orders", json={}, headers=headers("alice", "k"))
        finally:
            await filler.aclose()
            await store.aclose()
    assert answer.status_code == 503 and problem(answer)["type"] == "redis-unavailable"
    assert int(answer.headers["retry-after"]) >= 1 and shop.runs == {}
    assert stock.status_code == 200                       # the locks have their own Redis
    assert later.status_code == 201


async def test_a_record_store_at_maxclients_is_a_503(redis_url):
    with RedisServer(extra_args=("--maxclients", "3")) as server:
        hogs = []
        try:
            while True:   # take every connection the server allows (the rest are refused)
                hog = aioredis.Redis.from_url(server.url, single_connection_client=True)
                try:
                    await hog.ping()
                except Exception:
                    await hog.aclose()
                    break
                hogs.append(hog)
            store = IdempotencyStore.from_url(server.url)
            answer, stock, shop = await _records_answer(redis_url, store)
        finally:
            for hog in hogs:
                await hog.aclose()
            await store.aclose()
    assert hogs and answer.status_code == 503 and problem(answer)["type"] == "redis-unavailable"
    assert answer.headers["retry-after"] and stock.status_code == 200 and shop.runs == {}


# (A password sent to a Redis 7 without one is accepted: its default user is `nopass`.)
@pytest.mark.parametrize("case", ["no-password", "wrong-password", "no-such-db", "acl"])
async def test_a_misconfigured_record_store_is_a_500_that_names_the_fix(redis_url, case, caplog):
    with RedisServer() as server:
        admin = aioredis.Redis.from_url(server.url)
        url = server.url
        if case in ("no-password", "wrong-password", "acl"):
            await admin.config_set("requirepass", "s3cret")
        if case == "acl":
            await admin.execute_command("ACL", "SETUSER", "app", "on", ">apppw", "~*", "+@all", "-evalsha", "-eval")
            url = f"redis://app:apppw@127.0.0.1:{server.port}/0"
        if case == "wrong-password":
            url = f"redis://:nope@127.0.0.1:{server.port}/0"
        if case == "no-such-db":
            url = f"redis://127.0.0.1:{server.port}/99"
        store = IdempotencyStore.from_url(url)
        try:
            answer, stock, shop = await _records_answer(redis_url, store)
        finally:
            await store.aclose()
            await admin.aclose()
    body = problem(answer)
    assert answer.status_code == 500 and body["type"] == "redis-misconfigured", body
    expected = {"no-password": "password", "wrong-password": "password", "no-such-db": "database", "acl": "ACL"}[case]
    assert expected in body["detail"] and "s3cret" not in body["detail"] and "retry-after" not in answer.headers
    assert stock.status_code == 200 and shop.runs == {}
    assert any("misconfigured" in r.getMessage() or expected in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("fault", ["oom", "no-password"])
async def test_the_shared_redis_failing_is_a_problem_answer_never_text_plain(fault):
    # Records next to the locks (the default store): whichever call fails first, the
    # record's or the in-flight lock's, the answer is problem+json (503 when it is transient).
    shop = Shop()
    args = ("--maxmemory", "8mb", "--maxmemory-policy", "noeviction") if fault == "oom" else ()
    with RedisServer(extra_args=args) as server:
        admin = aioredis.Redis.from_url(server.url)
        url = server.url
        try:
            if fault == "oom":
                with pytest.raises(Exception, match="OOM|maxmemory"):
                    for i in range(1000):
                        await admin.set(f"other-app:{i}", b"x" * 100_000)
            else:
                await admin.config_set("requirepass", "s3cret")
            async with make_manager(url) as manager:
                async with client_for(shop.app(manager)) as client:
                    answer = await client.post("/orders", json={}, headers=headers("alice", "k"))
        finally:
            await admin.aclose()
    body = problem(answer)
    if fault == "oom":
        assert answer.status_code == 503 and answer.headers["retry-after"], body
    else:
        assert answer.status_code in (500, 503) and body["type"] in ("redis-misconfigured", "redis-error",
                                                                      "redis-unavailable"), body
    assert shop.runs == {}
