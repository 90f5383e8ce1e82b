"""LockMiddleware end to end against a real Redis: outcomes, release on every path, exclusion."""

from __future__ import annotations

import asyncio
import json
from urllib.parse import quote

import pytest
import starlette
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.background import BackgroundTask
from starlette.responses import FileResponse, JSONResponse, PlainTextResponse, StreamingResponse
from starlette.routing import Route

from otel_lock import LockLost, LockMiddleware, locked

try:
    from ._middleware_helpers import client_for, counter_points, disconnecting_call, empty_then_silent, lock_key, make_manager, metered, problem
except ImportError:
    from _middleware_helpers import client_for, counter_points, disconnecting_call, empty_then_silent, lock_key, make_manager, metered, problem


def app_with(manager, *routes, **options) -> Starlette:
    app = Starlette(routes=list(routes))
    app.add_middleware(LockMiddleware, manager=manager, **options)
    return app


def info():
    """A fresh handler per route: annotations live on the function object."""
    async def lock_info(request: Request):
        held = request.state.lock
        return JSONResponse({"key": held.key, "owner": held.owner, "token": held.token, "depth": held.depth})
    return lock_info


async def owner_of(redis_client, name: str):
    return await redis_client.hget(lock_key(name), "owner")


async def test_request_state_lock_carries_token_owner_depth(redis_url):
    async with make_manager(redis_url) as manager:
        app = app_with(manager, Route("/s/{pid}", locked("stock:{path.pid}")(info()), methods=["POST"]))
        async with client_for(app) as client:
            first = (await client.post("/s/1")).json()
            second = (await client.post("/s/1")).json()
    assert first["key"] == lock_key("stock:1") and first["depth"] == 1 and first["owner"]
    assert second["token"] > first["token"]  # fencing tokens only grow


async def test_missing_or_ill_formed_values_give_400(redis_url, redis_client):
    handler = locked("u:{header.x-user-id}:{query.sku}:{json.order.qty}")(info())
    async with make_manager(redis_url) as manager:
        app = app_with(manager, Route("/o", handler, methods=["POST"]))
        async with client_for(app) as client:
            cases = [
                dict(json={"order": {"qty": 1}}, params={"sku": "a"}),                        # header absent
                dict(json={"order": {"qty": 1}}, params={"sku": "a"}, headers={"x-user-id": ""}),
                dict(json={"order": {"qty": 1}}, headers={"x-user-id": "u"}),                  # query absent
                dict(json={"order": {"qty": 1}}, params=[("sku", "a"), ("sku", "b")], headers={"x-user-id": "u"}),
                dict(json={"order": {}}, params={"sku": "a"}, headers={"x-user-id": "u"}),     # json field absent
                dict(content=b"{not json", params={"sku": "a"}, headers={"x-user-id": "u"}),
                dict(json=[1, 2], params={"sku": "a"}, headers={"x-user-id": "u"}),
            ]
            for case in cases:
                response = await client.post("/o", **case)
                assert response.status_code == 400, (case, response.text)
                assert problem(response)["type"] == "lock-key-invalid"
            ok = await client.post("/o", json={"order": {"qty": 2}}, params={"sku": "a:b"}, headers={"x-user-id": "u"})
    assert ok.status_code == 200
    assert ok.json()["key"] == lock_key("u:u:a%3Ab:2")
    assert await owner_of(redis_client, "u:u:a%3Ab:2") is None


async def test_json_body_is_replayed_to_the_handler_unchanged(redis_url):
    async def echo(request):
        return JSONResponse({"raw": (await request.body()).decode(), "key": request.state.lock.key})

    body = b'{ "sku" : "A-1",\n "note": "\\u00e9" }'
    async with make_manager(redis_url) as manager:
        app = app_with(manager, Route("/o", locked("sku:{json.sku}")(echo), methods=["POST"]))
        async with client_for(app) as client:
            response = await client.post("/o", content=body, headers={"content-type": "application/json"})
    assert response.json() == {"raw": body.decode(), "key": lock_key("sku:A-1")}


async def test_body_above_max_body_gives_413(redis_url):
    async def chunks():
        for _ in range(10):
            yield b"x" * 100

    async with make_manager(redis_url) as manager:
        app = app_with(manager, Route("/o", locked("sku:{json.sku}")(info()), methods=["POST"]), max_body=500)
        async with client_for(app) as client:
            declared = await client.post("/o", content=b"x" * 501)
            streamed = await client.post("/o", content=chunks())   # no Content-Length: counted while read
            bad = await client.post("/o", content=b"{}", headers={"content-length": "abc"})
    assert declared.status_code == 413 and problem(declared)["type"] == "request-too-large"
    assert streamed.status_code == 413
    assert bad.status_code == 400


async def test_busy_lock_gives_409_with_retry_after(redis_url):
    handler = locked("stock:{path.pid}", wait=0)(info())
    custom = locked("job:{path.pid}", wait=0, status=423, retry_after=7)(info())
    async with make_manager(redis_url) as manager, make_manager(redis_url) as other:
        app = app_with(manager, Route("/s/{pid}", handler, methods=["POST"]), Route("/j/{pid}", custom, methods=["POST"]))
        held = await other.try_lock("stock:1")
        job = await other.try_lock("job:1")
        async with client_for(app) as client:
            busy = await client.post("/s/1")
            free = await client.post("/s/2")
            custom_busy = await client.post("/j/1")
        await held.release()
        await job.release()
    assert busy.status_code == 409 and busy.headers["retry-after"] == "1"
    assert problem(busy)["type"] == "lock-timeout"
    assert "stock:{path.pid}" in problem(busy)["detail"]  # names the template, not the key
    assert free.status_code == 200
    assert custom_busy.status_code == 423 and custom_busy.headers["retry-after"] == "7"


async def test_concurrent_same_key_requests_exclude_each_other(redis_url, redis_client):
    async def increment(request):
        value = int(await redis_client.get("counter") or 0)
        await asyncio.sleep(0)  # a yield point where a second writer would interleave
        await redis_client.set("counter", value + 1)
        return JSONResponse({"value": value + 1})

    async with make_manager(redis_url) as manager:
        app = app_with(manager, Route("/inc", locked("counter", wait=30)(increment), methods=["POST"]))
        async with client_for(app) as client:
            responses = await asyncio.gather(*(client.post("/inc") for _ in range(20)))
    assert [r.status_code for r in responses] == [200] * 20
    assert int(await redis_client.get("counter")) == 20
    assert sorted(r.json()["value"] for r in responses) == list(range(1, 21))


async def test_lock_is_released_when_the_handler_raises(redis_url, redis_client):
    async def boom(request):
        raise RuntimeError("handler failed")

    async with make_manager(redis_url) as manager:
        app = app_with(manager, Route("/b", locked("boom")(boom), methods=["POST"]))
        async with client_for(app) as client:
            response = await client.post("/b")
    assert response.status_code == 500
    assert await owner_of(redis_client, "boom") is None


async def test_streaming_response_holds_the_lock_until_the_last_chunk(redis_url, redis_client):
    first_sent, finish = asyncio.Event(), asyncio.Event()

    async def stream(request):
        async def body():
            yield b"first,"
            first_sent.set()
            await finish.wait()
            yield b"last"
        return StreamingResponse(body())

    async with make_manager(redis_url) as manager:
        app = app_with(manager, Route("/stream", locked("stream")(stream)))
        async with client_for(app) as client:
            request = asyncio.create_task(client.get("/stream"))
            await first_sent.wait()
            assert await owner_of(redis_client, "stream") is not None
            finish.set()
            response = await request
    assert response.text == "first,last"
    assert await owner_of(redis_client, "stream") is None


@pytest.mark.parametrize("spec", ["2.3", "2.4"], ids=["disconnect-message", "send-raises"])
async def test_client_disconnect_releases_the_lock(redis_url, redis_client, spec):
    streaming, disconnect = asyncio.Event(), asyncio.Event()

    async def endless(request):
        async def body():
            while True:
                yield b"tick"
                streaming.set()
                await asyncio.sleep(0.01)
        return StreamingResponse(body())

    async with make_manager(redis_url) as manager:
        app = app_with(manager, Route("/endless", locked("endless")(endless)))
        call = asyncio.create_task(disconnecting_call(app, "/endless", disconnect, spec))
        await streaming.wait()
        assert await owner_of(redis_client, "endless") is not None
        disconnect.set()
        await asyncio.wait_for(call, 10)
    assert await owner_of(redis_client, "endless") is None


async def test_lease_lost_before_the_response_gives_503(redis_url, redis_client):
    entered = asyncio.Event()

    async def slow(request):
        entered.set()
        await asyncio.Event().wait()  # until the lost lease cancels us

    async with make_manager(redis_url, lease=0.3) as manager:
        app = app_with(manager, Route("/slow", locked("slow")(slow), methods=["POST"]))
        async with client_for(app) as client:
            request = asyncio.create_task(client.post("/slow"))
            await entered.wait()
            await redis_client.delete(lock_key("slow"))  # someone else's hands on our lock
            response = await asyncio.wait_for(request, 10)
    assert response.status_code == 503 and problem(response)["type"] == "lock-lost"
    assert "retry-after" in response.headers


async def test_lease_lost_mid_stream_aborts_the_response(redis_url, redis_client):
    first_sent = asyncio.Event()

    async def stream(request):
        async def body():
            yield b"partial"
            first_sent.set()
            await asyncio.Event().wait()
        return StreamingResponse(body())

    sent = []

    receive = empty_then_silent()

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.4"}, "method": "GET", "path": "/s",
             "root_path": "", "query_string": b"", "headers": [], "scheme": "http", "http_version": "1.1"}
    async with make_manager(redis_url, lease=0.3) as manager:
        app = LockMiddleware(Starlette(routes=[Route("/s", locked("s")(stream))]), manager=manager)
        call = asyncio.create_task(app(scope, receive, send))
        await first_sent.wait()
        await redis_client.delete(lock_key("s"))
        with pytest.raises(LockLost):
            await asyncio.wait_for(call, 10)
    assert sent[0]["status"] == 200 and not any(m.get("more_body") is False for m in sent)


async def test_redis_down_gives_503_then_service_resumes(fresh_redis):
    async with make_manager(fresh_redis.url, socket_timeout=0.5) as manager:
        app = app_with(manager, Route("/s/{pid}", locked("stock:{path.pid}")(info()), methods=["POST"]))
        async with client_for(app) as client:
            assert (await client.post("/s/1")).status_code == 200
            fresh_redis.stop()
            down = await client.post("/s/1")
            fresh_redis.start()
            back = await client.post("/s/1")
    assert down.status_code == 503 and down.headers["retry-after"] == "1"
    assert problem(down)["type"] == "redis-unavailable"
    assert back.status_code == 200


async def test_fail_open_runs_the_handler_and_counts_the_error(fresh_redis):
    provider, reader = metered()
    ran = []

    async def handler(request):
        ran.append(getattr(request.state, "lock", None))
        return JSONResponse({"ok": True})

    async with make_manager(fresh_redis.url, socket_timeout=0.5, meter_provider=provider) as manager:
        app = app_with(manager, Route("/f", locked("fo", fail_open=True)(handler), methods=["POST"]))
        fresh_redis.stop()
        async with client_for(app) as client:
            response = await client.post("/f")
    assert response.status_code == 200 and ran == [None]
    errors = counter_points(reader, "otel_lock.errors")
    assert any(dict(attrs).get("error.type") == "redis_unavailable" and dict(attrs).get("lock.name") == "fo"
               for attrs in errors)


async def test_metric_label_is_the_template_not_the_key(redis_url):
    provider, reader = metered()
    async with make_manager(redis_url, meter_provider=provider) as manager:
        app = app_with(manager, Route("/s/{pid}", locked("stock:{path.pid}")(info()), methods=["POST"]))
        async with client_for(app) as client:
            for pid in ("1", "2", "secret-ish"):
                await client.post(f"/s/{pid}")
    data = reader.get_metrics_data()
    names = {point.attributes.get("lock.name")
             for rm in data.resource_metrics for sm in rm.scope_metrics for m in sm.metrics
             for point in m.data.data_points if "lock.name" in point.attributes}
    assert names == {"stock:{path.pid}"}


async def test_hash_parts_keeps_raw_values_out_of_redis(redis_url, redis_client):
    async with make_manager(redis_url) as manager:
        handler = locked("user:{header.x-email}", hash_parts=True)(info())
        app = app_with(manager, Route("/u", handler, methods=["POST"]), hash_secret="s3cret")
        async with client_for(app) as client:
            key = (await client.post("/u", headers={"x-email": "alice@example.com"})).json()["key"]
    assert "alice" not in key and key.startswith(lock_key("user:%k")[:-1])


async def test_non_http_scopes_pass_straight_through(redis_url):
    seen = []

    async def raw(scope, receive, send):
        seen.append(scope["type"])

    async with make_manager(redis_url) as manager:
        app = LockMiddleware(raw, manager=manager, rules={"GET /x": locked("x")})
        await app({"type": "lifespan"}, None, None)
        await app({"type": "websocket", "path": "/x"}, None, None)
    assert seen == ["lifespan", "websocket"]


header_values = st.binary(max_size=40).filter(lambda b: b"\r" not in b and b"\n" not in b)
json_scalars = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20)
json_bodies = st.builds(
    lambda doc: json.dumps(doc).encode(),
    st.dictionaries(st.sampled_from(["sku", "other", "{", ":"]),
                    json_scalars | st.lists(json_scalars, max_size=2) | st.dictionaries(st.text(max_size=3),
                                                                                          json_scalars, max_size=2),
                    max_size=3))


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(pid=st.text(min_size=1, max_size=30), user=st.none() | header_values,
       body=st.binary(max_size=200) | json_bodies)
async def test_arbitrary_input_never_gives_5xx(redis_url, pid, user, body):
    handler = locked("p:{path.pid}:{header.x-user}:{json.sku}", wait=1)(info())
    async with make_manager(redis_url) as manager:
        app = app_with(manager, Route("/p/{pid}", handler, methods=["POST"]))
        async with client_for(app) as client:
            headers = [] if user is None else [(b"x-user", user)]
            request = client.post("/p/" + quote(pid, safe=""), content=body, headers=headers)
            response = await asyncio.wait_for(request, 10)
    assert response.status_code < 500, response.text


# Starlette < 0.48's FileResponse never sends http.response.pathsend: nothing to test there.
_PATHSEND = pytest.param("pathsend", marks=pytest.mark.skipif(
    tuple(int(p) for p in starlette.__version__.split(".")[:2]) < (0, 48),
    reason="Starlette < 0.48 sends no http.response.pathsend"))


@pytest.mark.parametrize("kind", ["body", _PATHSEND])
@pytest.mark.parametrize("release_after", ["app", "response"])
async def test_background_tasks_run_under_the_lock_unless_release_after_response(redis_url, redis_client,
                                                                                  tmp_path, kind, release_after):
    in_background, finish = asyncio.Event(), asyncio.Event()
    seen_during_background = []

    async def background():
        seen_during_background.append(await owner_of(redis_client, "bg"))
        in_background.set()
        await finish.wait()

    file = tmp_path / "f.txt"
    file.write_bytes(b"file body")

    async def handler(request):
        tasks = BackgroundTask(background)
        if kind == "pathsend":
            return FileResponse(file, background=tasks)
        return PlainTextResponse("body", background=tasks)

    sent = []

    receive = empty_then_silent()

    async def send(message):
        sent.append(message["type"])

    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.4"}, "method": "GET", "path": "/bg",
             "root_path": "", "query_string": b"", "headers": [], "scheme": "http", "http_version": "1.1",
             "extensions": {"http.response.pathsend": {}} if kind == "pathsend" else {}}
    async with make_manager(redis_url) as manager:
        app = LockMiddleware(Starlette(routes=[Route("/bg", locked("bg", release_after=release_after)(handler))]),
                             manager=manager)
        call = asyncio.create_task(app(scope, receive, send))
        await in_background.wait()
        finish.set()
        await call
        owner_after = await owner_of(redis_client, "bg")
    # Default: held until the app call returns; "response": let go once the last body message is out.
    assert (seen_during_background[0] is None) == (release_after == "response")
    assert owner_after is None
    assert sent[-1] == ("http.response.pathsend" if kind == "pathsend" else "http.response.body")


async def test_a_handler_relocking_the_same_key_reenters(redis_url):
    async with make_manager(redis_url) as manager:
        async def nested(request):
            async with manager.lock("stock:9") as inner:
                outer = request.state.lock
                return JSONResponse({"depth": inner.depth, "same_token": inner.token == outer.token})

        app = app_with(manager, Route("/s/{pid}", locked("stock:{path.pid}")(nested), methods=["POST"]))
        async with client_for(app) as client:
            response = await client.post("/s/9")
    assert response.json() == {"depth": 2, "same_token": True}


async def test_answers_of_the_middleware_carry_the_route_template_for_http_metrics(redis_url):
    """HTTP instrumentations read scope["route"].path_format; the router never ran for a 409."""
    seen = []
    async with make_manager(redis_url) as manager, make_manager(redis_url) as other:
        inner = app_with(manager, Route("/s/{pid}", locked("stock:{path.pid}", wait=0)(info()), methods=["POST"]))

        async def outer(scope, receive, send):  # stands in for an ASGI instrumentation
            await inner(scope, receive, send)
            if scope["type"] == "http":
                seen.append(scope["route"].path_format)

        held = await other.try_lock("stock:1")
        async with client_for(outer) as client:
            busy = await client.post("/s/1")
        await held.release()
    assert busy.status_code == 409
    assert seen == ["/s/{pid}"]


async def test_routes_are_found_behind_a_middleware_that_hides_its_app(redis_url):
    def opaque(app):
        async def middleware(scope, receive, send):   # a closure: no `.app` to walk through
            await app(scope, receive, send)
        return middleware

    async with make_manager(redis_url) as manager:
        starlette_app = Starlette(routes=[Route("/s/{pid}", locked("stock:{path.pid}")(info()), methods=["POST"])])
        starlette_app.add_middleware(LockMiddleware, manager=manager)
        starlette_app.add_middleware(opaque)
        starlette_app.user_middleware.reverse()   # LockMiddleware outside the opaque one
        async with client_for(starlette_app) as client:
            response = await client.post("/s/4")
    assert response.status_code == 200 and response.json()["key"] == lock_key("stock:4")
