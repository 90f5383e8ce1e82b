"""Idempotency-Key: the table in docs/idempotency.md's "Behaviour" section, against a real Redis."""

from __future__ import annotations

import asyncio
import json

import pytest
from fastapi import FastAPI, Header
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel
from starlette.applications import Starlette
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from otel_lock import LockMiddleware, idempotent, locked
from otel_lock.asgi.idempotency._fingerprint import canonical_body
from otel_lock.asgi.idempotency._key import IdempotencyKeyError, parse_key

try:
    from ._middleware_helpers import NAMESPACE, client_for, counter_points, disconnecting_call, make_manager, metered, problem
except ImportError:
    from _middleware_helpers import NAMESPACE, client_for, counter_points, disconnecting_call, make_manager, metered, problem

# One provider for the module: the telemetry cache is keyed by provider identity.
PROVIDER, READER = metered()
KEY = {"idempotency-key": '"order-1"'}


def caller(request) -> str:
    """The tests' principal: a (trusted, in tests) X-User-Id, one user when absent."""
    return request.headers.get("x-user-id", "tester")


class Orders:
    """A handler (`.fn`, a fresh function to annotate) that counts how often its body really ran."""

    def __init__(self, status: int = 201) -> None:
        self.runs = 0

        async def orders(request):
            self.runs += 1
            body = await request.json()
            return JSONResponse({"order": self.runs, "got": body}, status_code=status,
                                headers={"location": f"/orders/{self.runs}", "set-cookie": "session=abc",
                                         "x-internal": "no"})
        self.fn = orders


def app_for(manager, handler, annotation=None, path="/orders", **options) -> Starlette:
    endpoint = (annotation or idempotent())(getattr(handler, "fn", handler))
    app = Starlette(routes=[Route(path, endpoint, methods=["POST"]),
                            Route("/other", idempotent()(Orders().fn), methods=["POST"])])
    app.add_middleware(LockMiddleware, manager=manager, **{"principal": caller, **options})
    return app


# -- the header -------------------------------------------------------------------

@pytest.mark.parametrize("raw, key", [
    (b'"abc"', "abc"), (b'  "a b"  ', "a b"), (b'"q\\"uote\\\\"', 'q"uote\\'),
    (b"8e03978e-40d5-43e8-bc93-6894a57f9324", "8e03978e-40d5-43e8-bc93-6894a57f9324"),
    (b'"' + b"x" * 255 + b'"', "x" * 255),
])
def test_valid_keys(raw, key):
    assert parse_key([(b"idempotency-key", raw)]) == key


@pytest.mark.parametrize("raw", [
    b'""', b'"' + b"x" * 256 + b'"', b'"abc', b'"a"b"', b'"a";p=1', b'"\\n"', '"é"'.encode("latin-1"),
    b'"tab\there"', b"a b", b"a,b", b"", b"x" * 256, b"caf\xe9",
], ids=repr)
def test_ill_formed_keys(raw):
    with pytest.raises(IdempotencyKeyError):
        parse_key([(b"idempotency-key", raw)])


def test_key_sent_twice_is_ill_formed():
    with pytest.raises(IdempotencyKeyError, match="more than once"):
        parse_key([(b"idempotency-key", b'"a"'), (b"idempotency-key", b'"a"')])


def test_canonical_json_ignores_key_order_and_whitespace():
    assert canonical_body(b'{"b": 1, "a": [1, 2]}', "application/json") == \
        canonical_body(b'{"a":[1,2],\n "b":1}', "application/json")
    assert canonical_body(b"a=1&b=2", "application/x-www-form-urlencoded") == b"ba=1&b=2"


# -- the table ----------------------------------------------------------------------

async def test_missing_and_ill_formed_keys_give_400(redis_url):
    async with make_manager(redis_url) as manager:
        handler = Orders()
        app = app_for(manager, handler)
        async with client_for(app) as client:
            missing = await client.post("/orders", json={})
            bad = await client.post("/orders", json={}, headers={"idempotency-key": '"unterminated'})
    assert missing.status_code == 400 and problem(missing)["type"] == "idempotency-key-missing"
    assert bad.status_code == 400 and problem(bad)["type"] == "idempotency-key-invalid"
    assert handler.runs == 0


async def test_optional_key_runs_normally_without_one(redis_url):
    async with make_manager(redis_url) as manager:
        handler = Orders()
        app = app_for(manager, handler, idempotent(required=False))
        async with client_for(app) as client:
            for _ in range(2):
                assert (await client.post("/orders", json={})).status_code == 201
    assert handler.runs == 2


async def test_retry_replays_status_body_and_allowed_headers_only(redis_url):
    async with make_manager(redis_url) as manager:
        handler = Orders()
        app = app_for(manager, handler)
        async with client_for(app) as client:
            first = await client.post("/orders", json={"sku": "A", "qty": 1}, headers=KEY)
            retry = await client.post("/orders", content=b'{ "qty" : 1, "sku" : "A" }',
                                      headers={**KEY, "content-type": "application/json"})
    assert handler.runs == 1
    assert first.status_code == retry.status_code == 201
    assert retry.json() == first.json()
    assert retry.headers["idempotent-replayed"] == "true" and "idempotent-replayed" not in first.headers
    assert retry.headers["location"] == "/orders/1" and retry.headers["content-type"] == "application/json"
    assert "set-cookie" not in retry.headers and "x-internal" not in retry.headers


async def test_set_cookie_and_authorization_never_reach_redis(redis_url, redis_client):
    async with make_manager(redis_url) as manager:
        app = app_for(manager, Orders())
        async with client_for(app) as client:
            await client.post("/orders", json={}, headers={**KEY, "authorization": "Bearer sekrit"})
    keys = await redis_client.keys(f"{NAMESPACE}:*")
    stored = b"".join([await redis_client.get(k) or b"" for k in keys if (await redis_client.type(k)) == b"string"])
    assert b"session=abc" not in stored and b"sekrit" not in stored and b"order-1" not in b"".join(keys)


async def test_changed_payload_or_route_gives_422(redis_url):
    async with make_manager(redis_url) as manager:
        handler = Orders()
        app = app_for(manager, handler)
        async with client_for(app) as client:
            await client.post("/orders", json={"qty": 1}, headers=KEY)
            changed = await client.post("/orders", json={"qty": 2}, headers=KEY)
            other_route = await client.post("/other", json={"qty": 1}, headers=KEY)
    assert changed.status_code == 422 and problem(changed)["type"] == "idempotency-key-mismatch"
    assert other_route.status_code == 422
    assert handler.runs == 1


async def test_another_principal_is_never_served_the_first_response(redis_url):
    async with make_manager(redis_url) as manager:
        handler = Orders()
        app = app_for(manager, handler)
        async with client_for(app) as client:
            alice = await client.post("/orders", json={}, headers={**KEY, "x-user-id": "alice"})
            bob = await client.post("/orders", json={}, headers={**KEY, "x-user-id": "bob"})
    assert handler.runs == 2
    assert alice.json()["order"] == 1 and bob.json()["order"] == 2
    assert "idempotent-replayed" not in bob.headers


async def test_custom_principal(redis_url):
    principal = idempotent(principal=lambda request: request.headers.get("x-user-id"))
    async with make_manager(redis_url) as manager:
        handler = Orders()
        app = app_for(manager, handler, principal)
        async with client_for(app) as client:
            a = await client.post("/orders", json={}, headers={**KEY, "x-user-id": "a"})
            a_again = await client.post("/orders", json={}, headers={**KEY, "x-user-id": "a"})
            b = await client.post("/orders", json={}, headers={**KEY, "x-user-id": "b"})
    assert handler.runs == 2 and a_again.json() == a.json() and b.json() != a.json()


async def test_twenty_concurrent_duplicates_run_the_handler_once(redis_url):
    entered, go = asyncio.Event(), asyncio.Event()
    runs = 0

    async def slow_order(request):
        nonlocal runs
        runs += 1
        entered.set()
        await go.wait()
        return JSONResponse({"order": runs}, status_code=201)

    async with make_manager(redis_url) as manager:
        app = app_for(manager, slow_order)
        async with client_for(app) as client:
            tasks = [asyncio.create_task(client.post("/orders", json={"sku": "A"}, headers=KEY)) for _ in range(20)]
            await entered.wait()
            done: set = set()
            while len(done) < 19:  # everyone but the runner is answered while it runs
                finished, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
                done = {t for t in tasks if t.done()}
            go.set()
            responses = [await t for t in tasks]
            retry = await client.post("/orders", json={"sku": "A"}, headers=KEY)
    assert runs == 1
    statuses = sorted(r.status_code for r in responses)
    assert statuses == [201] + [409] * 19
    busy = [r for r in responses if r.status_code == 409]
    assert all(problem(r)["type"] == "idempotency-request-in-flight" and r.headers["retry-after"] for r in busy)
    assert retry.status_code == 201 and retry.headers["idempotent-replayed"] == "true"


async def test_wait_for_inflight_waits_and_replays(redis_url):
    entered, go = asyncio.Event(), asyncio.Event()

    async def slow_order(request):
        entered.set()
        await go.wait()
        return JSONResponse({"done": True}, status_code=201)

    async with make_manager(redis_url) as manager:
        app = app_for(manager, slow_order, idempotent(wait_for_inflight=10))
        async with client_for(app) as client:
            first = asyncio.create_task(client.post("/orders", json={}, headers=KEY))
            await entered.wait()
            second = asyncio.create_task(client.post("/orders", json={}, headers=KEY))
            await asyncio.sleep(0)  # let it start waiting; correctness does not depend on it
            go.set()
            first, second = await first, await second
    assert first.status_code == second.status_code == 201
    assert second.headers.get("idempotent-replayed") == "true"


async def test_handler_raised_is_outcome_unknown_and_not_rerun(redis_url):
    runs = 0

    async def failing(request):
        nonlocal runs
        runs += 1
        raise RuntimeError("charged the card, then crashed")

    async with make_manager(redis_url) as manager:
        app = app_for(manager, failing)
        async with client_for(app) as client:
            first = await client.post("/orders", json={}, headers=KEY)
            retries = [await client.post("/orders", json={}, headers=KEY) for _ in range(2)]
    assert first.status_code == 500 and runs == 1
    for retry in retries:
        assert retry.status_code == 409 and problem(retry)["type"] == "idempotency-outcome-unknown"
        assert "failed" in problem(retry)["detail"]


async def test_5xx_is_outcome_unknown_unless_retry_on_5xx(redis_url):
    async with make_manager(redis_url) as manager:
        strict, lenient = Orders(status=500), Orders(status=500)
        app = Starlette(routes=[
            Route("/strict", idempotent()(strict.fn), methods=["POST"]),
            Route("/lenient", idempotent(retry_on_5xx=True)(lenient.fn), methods=["POST"]),
        ])
        app.add_middleware(LockMiddleware, manager=manager, principal=caller)
        async with client_for(app) as client:
            for path in ("/strict", "/lenient"):
                for _ in range(2):
                    last = await client.post(path, json={}, headers={"idempotency-key": path})
            strict_retry = await client.post("/strict", json={}, headers={"idempotency-key": "/strict"})
    assert strict.runs == 1 and problem(strict_retry)["type"] == "idempotency-outcome-unknown"
    assert lenient.runs == 2 and last.status_code == 500


async def test_streamed_and_oversized_responses_are_tombstoned(redis_url):
    runs = {"stream": 0, "big": 0}

    async def stream(request):
        runs["stream"] += 1
        return StreamingResponse(iter([b"a", b"b"]))

    async def big(request):
        runs["big"] += 1
        return Response(b"x" * 2000)

    async with make_manager(redis_url) as manager:
        app = Starlette(routes=[
            Route("/stream", idempotent()(stream), methods=["POST"]),
            Route("/big", idempotent(max_stored_response=1000)(big), methods=["POST"]),
        ])
        app.add_middleware(LockMiddleware, manager=manager, principal=caller)
        async with client_for(app) as client:
            for path in ("/stream", "/big"):
                first = await client.post(path, headers={"idempotency-key": path})
                retry = await client.post(path, headers={"idempotency-key": path})
                assert first.status_code == 200 and first.content in (b"ab", b"x" * 2000)
                assert retry.status_code == 409 and problem(retry)["type"] == "idempotency-response-not-stored"
    assert runs == {"stream": 1, "big": 1}


async def test_a_crashed_first_attempt_is_outcome_unknown(redis_url, redis_client):
    entered = asyncio.Event()

    async def hangs(request):
        entered.set()
        await asyncio.Event().wait()

    async with make_manager(redis_url) as manager:
        app = app_for(manager, hangs)
        async with client_for(app) as client:
            first = asyncio.create_task(client.post("/orders", json={}, headers=KEY))
            await entered.wait()
            # The replica "dies": its lock lease runs out, its record says started.
            for key in await redis_client.keys(f"{NAMESPACE}:{{idem:*}}"):
                await redis_client.delete(key)
            retry = await client.post("/orders", json={}, headers=KEY)
            first.cancel()
            await asyncio.gather(first, return_exceptions=True)
    assert retry.status_code == 409 and problem(retry)["type"] == "idempotency-outcome-unknown"


async def test_busy_business_lock_does_not_burn_the_key(redis_url):
    handler = Orders()
    async with make_manager(redis_url) as manager, make_manager(redis_url) as other:
        app = app_for(manager, locked("sku:{path.sku}", wait=0)(handler.fn), path="/orders/{sku}")
        held = await other.try_lock("sku:A")
        async with client_for(app) as client:
            busy = await client.post("/orders/A", json={}, headers=KEY)
            await held.release()
            later = await client.post("/orders/A", json={}, headers=KEY)
    assert busy.status_code == 409 and problem(busy)["type"] == "lock-timeout"
    assert later.status_code == 201 and handler.runs == 1 and "idempotent-replayed" not in later.headers


async def test_redis_down_gives_503(fresh_redis):
    async with make_manager(fresh_redis.url, socket_timeout=0.5) as manager:
        handler = Orders()
        app = app_for(manager, handler)
        fresh_redis.stop()
        async with client_for(app) as client:
            down = await client.post("/orders", json={}, headers=KEY)
            fresh_redis.start()
            back = await client.post("/orders", json={}, headers=KEY)
    assert down.status_code == 503 and down.headers["retry-after"] and handler.runs == 1
    assert back.status_code == 201


async def test_outcomes_are_counted_by_route_without_keys(redis_url):
    before = counter_points(READER, "otel_lock.idempotency.requests")
    async with make_manager(redis_url, meter_provider=PROVIDER) as manager:
        app = app_for(manager, Orders(), path="/counted/{shop}")
        async with client_for(app) as client:
            await client.post("/counted/1", json={}, headers=KEY)                   # stored
            await client.post("/counted/1", json={}, headers=KEY)                   # replayed
            await client.post("/counted/1", json={"x": 1}, headers=KEY)             # mismatch
            await client.post("/counted/2", json={})                                 # missing_key
            await client.post("/counted/2", json={}, headers={"idempotency-key": "a b"})  # invalid_key
    after = counter_points(READER, "otel_lock.idempotency.requests")
    delta = {dict(k)["idempotency.outcome"]: v - before.get(k, 0) for k, v in after.items()
             if dict(k)["http.route"] == "/counted/{shop}"}
    assert delta == {"stored": 1, "replayed": 1, "mismatch": 1, "missing_key": 1, "invalid_key": 1}
    assert all(set(dict(k)) == {"http.route", "idempotency.outcome"} for k in after)


class Order(BaseModel):  # module level: FastAPI resolves the string annotations here
    product_id: str
    quantity: int = 1


async def test_fastapi_order_endpoint_with_idempotent_and_locked(redis_url):
    runs = []
    app = FastAPI()

    @app.post("/api/orders", status_code=201)
    @idempotent(principal=lambda request: request.headers.get("x-user-id"))
    @locked("order:user:{header.x-user-id}")
    async def submit(order: Order, x_user_id: str = Header()):
        runs.append(order)
        return {"order_id": len(runs), "product_id": order.product_id}

    async with make_manager(redis_url) as manager:
        app.add_middleware(LockMiddleware, manager=manager, principal=caller)
        async with client_for(app) as client:
            headers = {**KEY, "x-user-id": "u1"}
            first = await client.post("/api/orders", json={"product_id": "p1", "quantity": 1}, headers=headers)
            retry = await client.post("/api/orders", json={"quantity": 1, "product_id": "p1"}, headers=headers)
            invalid = await client.post("/api/orders", json={"product_id": []},
                                        headers={"idempotency-key": '"k2"', "x-user-id": "u1"})
    assert first.status_code == 201 and retry.status_code == 201 and len(runs) == 1
    assert retry.headers["idempotent-replayed"] == "true" and retry.json() == first.json()
    assert invalid.status_code == 422  # FastAPI's validation, stored like any 4xx


key_values = st.one_of(
    st.text(alphabet=st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=300),
    st.builds(lambda s: '"' + s + '"', st.text(alphabet=st.characters(min_codepoint=0x20, max_codepoint=0x7E),
                                                max_size=300)),
)
bodies = st.binary(max_size=300) | st.builds(
    lambda v: json.dumps(v).encode(),
    st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=10),
                 lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=5), c, max_size=3),
                 max_leaves=10))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(keys=st.lists(key_values, min_size=1, max_size=2), body=bodies, repeat=st.booleans())
async def test_arbitrary_keys_and_bodies_never_give_5xx(redis_url, keys, body, repeat):
    async def echo(request):
        return Response(await request.body(), status_code=200)

    async with make_manager(redis_url) as manager:
        app = Starlette(routes=[Route("/e", idempotent()(echo), methods=["POST"])])
        app.add_middleware(LockMiddleware, manager=manager, principal=caller)
        async with client_for(app) as client:
            headers = [("idempotency-key", k) for k in keys]
            for _ in range(2 if repeat else 1):
                response = await asyncio.wait_for(client.post("/e", content=body, headers=headers), 10)
                assert response.status_code < 500, response.text


@pytest.mark.parametrize("spec", ["2.3", "2.4"], ids=["disconnect-message", "send-raises"])
async def test_client_gone_mid_response_is_outcome_unknown(redis_url, spec):
    streaming, gone = asyncio.Event(), asyncio.Event()
    runs = 0

    async def endless(request):
        nonlocal runs
        runs += 1

        async def body():
            while True:
                yield b"tick"
                streaming.set()
                await asyncio.sleep(0.01)
        return StreamingResponse(body())

    async with make_manager(redis_url) as manager:
        app = app_for(manager, endless)
        call = asyncio.create_task(disconnecting_call(app, "/orders", gone, spec, method="POST", body=b"{}",
                                                      headers=[(b"idempotency-key", b'"order-1"')]))
        await streaming.wait()
        gone.set()
        await asyncio.wait_for(call, 10)
        async with client_for(app) as client:
            retry = await client.post("/orders", content=b"{}", headers=KEY)
    assert runs == 1
    assert retry.status_code == 409 and problem(retry)["type"] == "idempotency-outcome-unknown"


async def test_an_oserror_from_the_handler_is_not_mistaken_for_redis(redis_url):
    async def missing_file(request):
        raise FileNotFoundError("/data/report.pdf")

    async with make_manager(redis_url) as manager:
        app = app_for(manager, missing_file)
        async with client_for(app) as client:
            response = await client.post("/orders", json={}, headers=KEY)
            retry = await client.post("/orders", json={}, headers=KEY)
    assert response.status_code == 500 and "redis" not in response.text
    assert problem(retry)["type"] == "idempotency-outcome-unknown"


async def test_an_oserror_of_the_app_is_its_failure_not_a_client_gone(redis_url):
    """Regression: any OSError (a database's ConnectionRefusedError, SMTP, `asyncio.timeout`'s TimeoutError) was taken
    for the client going away: a `retry_on_5xx` attempt was never run again (409 "interrupted" for ever), and a
    background task failing after the answer left that answer to be replayed as if the work had happened."""
    from starlette.background import BackgroundTask

    runs = {"refused": 0, "mailed": 0}

    async def database_down(request):
        runs["refused"] += 1
        raise ConnectionRefusedError(111, "the database refused the connection")

    def send_mail():
        runs["mailed"] += 1
        raise ConnectionResetError(104, "the mail server went away")

    async def order_then_mail(request):
        return JSONResponse({"ok": True}, status_code=201, background=BackgroundTask(send_mail))

    async with make_manager(redis_url) as manager:
        app = Starlette(routes=[
            Route("/retried", idempotent(retry_on_5xx=True)(database_down), methods=["POST"]),
            Route("/mailed", idempotent()(order_then_mail), methods=["POST"]),
        ])
        app.add_middleware(LockMiddleware, manager=manager, principal=caller)
        async with client_for(app) as client:
            retried = [await client.post("/retried", json={}, headers={"idempotency-key": '"r"'}) for _ in range(2)]
            first = await client.post("/mailed", json={}, headers={"idempotency-key": '"m"'})  # then the task fails
            replay = await client.post("/mailed", json={}, headers={"idempotency-key": '"m"'})
    assert runs == {"refused": 2, "mailed": 1}
    assert [r.status_code for r in retried] == [500, 500] and first.status_code == 201
    assert replay.status_code == 409 and problem(replay)["type"] == "idempotency-outcome-unknown"
    assert replay.headers.get("idempotent-replayed") is None


async def test_a_different_payload_racing_the_first_claim_gets_422_not_409(redis_url, monkeypatch):
    """Regression: a request with another payload that came between the first one's taking the key and its writing
    the record got 409 in flight (about one in six sent at once); 422 is checked before 409."""
    import contextvars

    from otel_lock.asgi.idempotency._gate import IdempotentRequest
    from otel_lock.asgi.idempotency._store import IdempotencyStore

    claiming, second_looked = asyncio.Event(), asyncio.Event()
    busy_here = contextvars.ContextVar("busy_here", default=False)
    real_claim, real_load, real_busy = IdempotencyStore.claim, IdempotencyStore.load, IdempotentRequest._busy

    async def claim(self, *args, **kwargs):
        claiming.set()
        await second_looked.wait()  # the first request holds the key; its record is written only now
        return await real_claim(self, *args, **kwargs)

    async def load(self, *args, **kwargs):
        record = await real_load(self, *args, **kwargs)
        if busy_here.get() and record is None:
            second_looked.set()
        return record

    async def busy(self):
        busy_here.set(True)
        return await real_busy(self)

    monkeypatch.setattr(IdempotencyStore, "claim", claim)
    monkeypatch.setattr(IdempotencyStore, "load", load)
    monkeypatch.setattr(IdempotentRequest, "_busy", busy)
    orders = Orders()
    async with make_manager(redis_url) as manager:
        app = app_for(manager, orders)
        async with client_for(app) as client, asyncio.timeout(20):
            first = asyncio.create_task(client.post("/orders", json={"qty": 1}, headers=KEY))
            await claiming.wait()
            second = await client.post("/orders", json={"qty": 2}, headers=KEY)
            assert (await first).status_code == 201
    assert second.status_code == 422 and problem(second)["type"] == "idempotency-key-mismatch"
    assert orders.runs == 1


async def test_no_key_or_principal_on_spans(redis_url):
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(exporter))
    secret_key = "key-4711-secret"
    async with make_manager(redis_url, tracer_provider=tracer_provider) as manager:
        app = app_for(manager, Orders().fn, idempotent(principal=lambda r: r.headers.get("x-user-id")))
        async with client_for(app) as client:
            headers = {"idempotency-key": f'"{secret_key}"', "x-user-id": "alice@example.com"}
            # Lock spans are children of the request's span (an ASGI instrumentation's, in an app).
            with tracer_provider.get_tracer("test").start_as_current_span("request"):
                await client.post("/orders", json={}, headers=headers)
                await client.post("/orders", json={}, headers=headers)
    spans = exporter.get_finished_spans()
    assert spans, "the idempotency lock is traced"
    text = repr([(s.name, dict(s.attributes), [(e.name, dict(e.attributes)) for e in s.events]) for s in spans])
    assert secret_key not in text and "alice" not in text
