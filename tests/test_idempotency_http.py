"""Idempotency and HTTP answers: what a retry is the same request as, and answers that follow the RFCs.

Tenants by Host, multipart uploads with a fresh boundary, replayed 204/304,
the 401 challenge, problem `type` URIs, and keys that could be spelled two ways.
"""

from __future__ import annotations

import asyncio
import json
from urllib.parse import urljoin, urlsplit

import pytest
from fastapi import FastAPI, File, Form, Header, UploadFile
from hypothesis import given, settings
from hypothesis import strategies as st
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from otel_lock import LockMiddleware, idempotent, locked
from otel_lock.asgi._problem import TYPE_BASE
from otel_lock.asgi.idempotency import KEY_PATTERN, IdempotencyKeyError, parse_key
from otel_lock.asgi.idempotency._fingerprint import authority, canonical_body, multipart_parts

try:
    from ._middleware_helpers import client_for, make_manager, problem
except ImportError:
    from _middleware_helpers import client_for, make_manager, problem

KEY = {"idempotency-key": '"k-1"'}


def user(request: Request) -> str | None:
    return request.headers.get("x-user-id")


# -- the authority is part of the request ------------------------------------------------


def tenant_shop() -> tuple[FastAPI, list]:
    """One app serving every tenant by Host; the principal is the user id, the same name in each tenant."""
    app = FastAPI()
    runs: list = []

    @app.post("/orders", status_code=201)
    @idempotent(principal=user)
    async def orders(request: Request, x_user_id: str = Header()):
        runs.append(request.headers["host"])
        return {"tenant": request.headers["host"], "order": len(runs)}

    return app, runs


async def test_same_key_and_body_on_another_tenant_is_422_never_a_replay(redis_url):
    app, runs = tenant_shop()
    headers = {**KEY, "x-user-id": "1"}
    async with make_manager(redis_url) as manager:
        app.add_middleware(LockMiddleware, manager=manager)
        async with client_for(app) as client:
            acme = await client.post("https://acme.saas.example/orders", json={"sku": "A"}, headers=headers)
            globex = await client.post("https://globex.saas.example/orders", json={"sku": "A"}, headers=headers)
            plain_http = await client.post("http://acme.saas.example/orders", json={"sku": "A"}, headers=headers)
            acme_again = await client.post("https://acme.saas.example/orders", json={"sku": "A"}, headers=headers)
    assert acme.status_code == 201 and acme.json()["tenant"] == "acme.saas.example"
    assert globex.status_code == 422 and problem(globex)["type"] == "idempotency-key-mismatch"
    assert "acme" not in globex.text and "idempotent-replayed" not in globex.headers
    assert plain_http.status_code == 422          # another scheme is another target URI
    assert acme_again.headers["idempotent-replayed"] == "true" and acme_again.json() == acme.json()
    assert runs == ["acme.saas.example"]


async def test_one_host_spelled_differently_or_on_another_port_is_still_a_replay(redis_url):
    # RFC 3986 6.2.2-6.2.3: host case and a trailing dot do not make another host; the port
    # is left out (replicas of one service reached on different ports).
    app, runs = tenant_shop()
    headers = {**KEY, "x-user-id": "1"}
    async with make_manager(redis_url) as manager:
        app.add_middleware(LockMiddleware, manager=manager)
        async with client_for(app) as client:
            first = await client.post("https://acme.saas.example/orders", json={}, headers=headers)
            spelled = [await client.post("https://acme.saas.example/orders", json={},
                                         headers={**headers, "host": host})
                       for host in ("ACME.saas.example", "acme.saas.example:443", "acme.saas.example.",
                                    "acme.saas.example:8443")]
            other_host = await client.post("https://acme.saas.example.org/orders", json={}, headers=headers)
    assert first.status_code == 201 and len(runs) == 1
    assert [r.headers.get("idempotent-replayed") for r in spelled] == ["true"] * 4
    assert other_host.status_code == 422


@pytest.mark.parametrize("scope, expected", [
    ({"scheme": "https", "headers": [(b"host", b"Shop.Example:443")]}, b"https://shop.example"),
    ({"scheme": "HTTP", "headers": [(b"host", b"shop.example.:8080")]}, b"http://shop.example"),
    ({"scheme": "http", "headers": [(b"host", b"[::1]:8000")]}, b"http://[::1]"),
    ({"scheme": "http", "headers": [(b"host", b"[::1]")]}, b"http://[::1]"),
    ({"scheme": "http", "headers": [], "server": ("10.0.0.1", 8000)}, b"http://10.0.0.1"),
    ({"scheme": "http", "headers": [], "server": None}, b"http://"),
])
def test_scheme_and_host_are_normalised_as_rfc_3986_says(scope, expected):
    assert authority(scope) == expected


# -- multipart bodies by their parts -------------------------------------------------------


def upload_shop() -> tuple[FastAPI, list]:
    app = FastAPI()
    runs: list = []

    @app.post("/uploads", status_code=201)
    @idempotent(principal=user)
    async def upload(title: str = Form(), file: UploadFile = File()):
        content = await file.read()
        runs.append((title, file.filename, content))
        return {"title": title, "name": file.filename, "size": len(content), "run": len(runs)}

    return app, runs


async def test_identical_multipart_retry_with_a_new_boundary_replays(redis_url):
    app, runs = upload_shop()
    headers = {**KEY, "x-user-id": "alice"}
    files = {"file": ("invoice.pdf", b"%PDF-1.7 ...", "application/pdf")}
    async with make_manager(redis_url) as manager:
        app.add_middleware(LockMiddleware, manager=manager)
        async with client_for(app) as client:
            # httpx draws a new random boundary for every request, as browsers and SDKs do.
            first = await client.post("/uploads", data={"title": "Q3"}, files=files, headers=headers)
            retry = await client.post("/uploads", data={"title": "Q3"}, files=files, headers=headers)
    assert first.status_code == 201 and retry.headers["idempotent-replayed"] == "true"
    assert retry.json() == first.json() and len(runs) == 1


@pytest.mark.parametrize("changed", [
    {"data": {"title": "Q4"}},
    {"files": {"file": ("invoice.pdf", b"%PDF-1.7 .!.", "application/pdf")}},
    {"files": {"file": ("receipt.pdf", b"%PDF-1.7 ...", "application/pdf")}},
    {"files": {"file": ("invoice.pdf", b"%PDF-1.7 ...", "application/octet-stream")}},
    {"files": {"attachment": ("invoice.pdf", b"%PDF-1.7 ...", "application/pdf")}},
], ids=["field-value", "file-content", "filename", "part-content-type", "part-name"])
async def test_a_multipart_body_with_another_part_is_422(redis_url, changed):
    app, runs = upload_shop()
    headers = {**KEY, "x-user-id": "alice"}
    original = {"data": {"title": "Q3"}, "files": {"file": ("invoice.pdf", b"%PDF-1.7 ...", "application/pdf")}}
    async with make_manager(redis_url) as manager:
        app.add_middleware(LockMiddleware, manager=manager)
        async with client_for(app) as client:
            await client.post("/uploads", **original, headers=headers)
            other = await client.post("/uploads", **{**original, **changed}, headers=headers)
    assert other.status_code == 422 and problem(other)["type"] == "idempotency-key-mismatch"
    assert "idempotent-replayed" not in other.headers and len(runs) == 1


def _multipart(boundary: str, parts: list[tuple[str, str]], preamble: str = "", epilogue: str = "") -> bytes:
    body = preamble + "".join(f"--{boundary}\r\n{head}\r\n\r\n{content}\r\n" for head, content in parts)
    return (body + f"--{boundary}--\r\n{epilogue}").encode()


def test_multipart_parts_do_not_depend_on_the_boundary_or_header_spelling():
    parts = [('Content-Disposition: form-data; name="a"', "1"),
             ('Content-Disposition: form-data; name="f"; filename="x.txt"\r\nContent-Type: text/plain', "hi\r\n\r\nthere")]
    spelled = [("content-disposition: form-data; name=a", "1"),
               ('Content-Type: TEXT/plain\r\nContent-Disposition: form-data; filename="x.txt"; name="f"',
                "hi\r\n\r\nthere")]
    a = _multipart("aaaaBoundary1", parts)
    b = _multipart("----WebKitFormBoundaryZz9", spelled)
    assert canonical_body(a, "multipart/form-data; boundary=aaaaBoundary1") == \
        canonical_body(b, 'multipart/form-data; boundary="----WebKitFormBoundaryZz9"')
    # The boundary is case-sensitive: lower-casing it does not find the parts (raw bytes then).
    assert multipart_parts(a, "multipart/form-data; boundary=aaaaboundary1") is None


@pytest.mark.parametrize("body", [
    b"--b\r\nContent-Disposition: form-data; name=\"a\"\r\n\r\n1\r\n",           # no close delimiter
    b"--b\r\nno colon here\r\n\r\n1\r\n--b--\r\n",                                 # a header without a colon
    b"garbage--b\r\n\r\n1\r\n--b--\r\n",                                            # no CRLF before the first
    b"--b\r\n\r\n1\r\n--bX\r\n\r\n2\r\n--b--\r\n",                                  # a boundary-like line inside
    b"--b--\r\n--b\r\n\r\n1\r\n--b--\r\n",                                          # a part after the close
], ids=["truncated", "bad-header", "bad-start", "boundary-prefix", "after-close"])
def test_ill_formed_multipart_is_fingerprinted_as_raw_bytes(body):
    assert multipart_parts(body, "multipart/form-data; boundary=b") is None
    assert canonical_body(body, "multipart/form-data; boundary=b") == b"b" + body


def test_distinct_multipart_bodies_never_collide():
    base = [('Content-Disposition: form-data; name="a"', "1"), ('Content-Disposition: form-data; name="b"', "2")]
    variants = [base, base[::-1], [base[0]], [(base[0][0], "1 "), base[1]],
                [(base[0][0] + "\r\nX-Extra: 1", "1"), base[1]]]
    seen = {canonical_body(_multipart("q", v), "multipart/form-data; boundary=q") for v in variants}
    seen.add(canonical_body(_multipart("q", base, preamble="hello\r\n"), "multipart/form-data; boundary=q"))
    seen.add(canonical_body(_multipart("q", base, epilogue="bye"), "multipart/form-data; boundary=q"))
    assert len(seen) == len(variants) + 2


# -- replays follow RFC 9110 ------------------------------------------------------------


async def _record_replay(app, path: str, headers, method: str = "POST") -> list:
    """Drive the app over raw ASGI and keep every message it sends (a server adds nothing here)."""
    sent: list = []

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "scheme": "http",
             "path": path, "raw_path": path.encode(), "root_path": "", "query_string": b"",
             "headers": [(b"host", b"test"), *headers], "client": ("127.0.0.1", 5000), "server": ("test", 80),
             "app": app}
    await app(scope, receive, send)
    return sent


@pytest.mark.parametrize("status, extra", [(204, {}), (304, {"ETag": '"v7"'}), (205, {})])
async def test_replayed_204_304_205_are_framed_as_rfc_9110_says(redis_url, status, extra):
    runs = []

    @idempotent(shared_scope=True)
    async def answer(request):
        runs.append(1)
        return Response(status_code=status, headers=extra)

    async with make_manager(redis_url) as manager:
        app = Starlette(routes=[Route("/op", answer, methods=["POST"])])
        app.add_middleware(LockMiddleware, manager=manager)
        headers = [(b"idempotency-key", b'"k-1"')]
        first = await _record_replay(app, "/op", headers)
        replay = await _record_replay(app, "/op", headers)
    assert runs == [1]
    start = next(m for m in replay if m["type"] == "http.response.start")
    names = [name.lower() for name, _ in start["headers"]]
    assert start["status"] == status and (b"idempotent-replayed", b"true") in start["headers"]
    body = b"".join(m.get("body", b"") for m in replay if m["type"] == "http.response.body")
    assert body == b""
    first_names = [name.lower() for name, _ in next(m for m in first if m["type"] == "http.response.start")["headers"]]
    if status == 205:
        assert (b"content-length", b"0") in start["headers"]
    else:
        assert b"content-length" not in names, start["headers"]   # RFC 9110 8.6
        assert b"content-length" not in first_names                 # as the first answer had none
    if status == 304:
        assert (b"etag", b'"v7"') in start["headers"]


async def test_a_replay_sends_only_allow_listed_headers_even_from_a_tampered_record(redis_url, redis_client):
    @idempotent(shared_scope=True)
    async def answer(request):
        return JSONResponse({"ok": True}, status_code=201, headers={"Location": "/o/1", "Set-Cookie": "s=1"})

    async with make_manager(redis_url) as manager:
        app = Starlette(routes=[Route("/op", answer, methods=["POST"])])
        app.add_middleware(LockMiddleware, manager=manager)
        async with client_for(app) as client:
            await client.post("/op", headers=KEY)
            (key,) = [k async for k in redis_client.scan_iter(match="*:idem:*:r:*")]
            record = json.loads(await redis_client.hget(key, "d"))
            record["headers"] += [["Set-Cookie", "stolen=1"], ["Authorization", "Bearer x"], ["X-Debug", "1"]]
            await redis_client.hset(key, "d", json.dumps(record))
            replay = await client.post("/op", headers=KEY)
    assert replay.status_code == 201 and replay.headers["location"] == "/o/1"
    assert not {"set-cookie", "authorization", "x-debug"} & set(replay.headers)


# -- the 401 carries a challenge ----------------------------------------------------------


async def _first_answer(redis_url, annotation, headers=None):
    @annotation
    async def orders(request):
        return JSONResponse({}, status_code=201)

    async with make_manager(redis_url) as manager:
        app = Starlette(routes=[Route("/orders", orders, methods=["POST"])])
        app.add_middleware(LockMiddleware, manager=manager)
        async with client_for(app) as client:
            return await client.post("/orders", json={}, headers={**KEY, **(headers or {})})


async def test_a_missing_principal_is_a_401_with_a_challenge(redis_url):
    answer = await _first_answer(redis_url, idempotent(principal=user))
    assert answer.status_code == 401 and answer.headers["www-authenticate"] == "Bearer"
    assert problem(answer)["type"] == "idempotency-principal-missing"


async def test_the_app_chooses_the_challenge_or_the_status(redis_url):
    basic = await _first_answer(redis_url, idempotent(principal=user, challenge='Basic realm="shop"'))
    forbidden = await _first_answer(redis_url, idempotent(principal=user, unauthenticated_status=403,
                                                          challenge=None))
    assert basic.status_code == 401 and basic.headers["www-authenticate"] == 'Basic realm="shop"'
    assert forbidden.status_code == 403 and "www-authenticate" not in forbidden.headers


async def test_a_401_raised_by_the_principal_gets_a_challenge_unless_it_has_one(redis_url):
    def bare(request):
        raise HTTPException(401, "token expired")

    def own(request):
        raise HTTPException(401, "token expired", headers={"WWW-Authenticate": 'Bearer error="invalid_token"'})

    bare_answer = await _first_answer(redis_url, idempotent(principal=bare, challenge='Bearer realm="api"'))
    own_answer = await _first_answer(redis_url, idempotent(principal=own))
    assert bare_answer.headers["www-authenticate"] == 'Bearer realm="api"'
    assert own_answer.headers.get_list("www-authenticate") == ['Bearer error="invalid_token"']


# -- problem types are absolute URIs, the same on every route ---------------------------


async def test_every_problem_type_is_one_absolute_uri_whatever_the_path(redis_url):
    @idempotent(shared_scope=True)
    @locked("sku:{path.sku}", wait=0)
    async def deep(request):
        return JSONResponse({}, status_code=201)

    @idempotent(principal=user)
    async def shallow(request):
        return JSONResponse({}, status_code=201)

    async with make_manager(redis_url) as manager, make_manager(redis_url) as other:
        app = Starlette(routes=[Route("/a/b/c/{sku}/buy", deep, methods=["POST"]),
                                Route("/x", shallow, methods=["POST"])])
        app.add_middleware(LockMiddleware, manager=manager)
        held = await other.try_lock("sku:1")
        async with client_for(app) as client:
            answers = {
                "deep-invalid": await client.post("/a/b/c/1/buy", headers={"idempotency-key": "a b"}),
                "shallow-invalid": await client.post("/x", headers={"idempotency-key": "a b"}),
                "deep-missing": await client.post("/a/b/c/1/buy"),
                "lock-timeout": await client.post("/a/b/c/1/buy", headers=KEY),
                "unauthenticated": await client.post("/x", headers=KEY),
            }
        await held.release()
    for name, response in answers.items():
        body = response.json()
        assert response.headers["content-type"] == "application/problem+json", name
        type_uri = body["type"]
        assert urlsplit(type_uri).scheme == "tag" and type_uri.startswith(TYPE_BASE), (name, type_uri)
        # Absolute: resolving it against the request's URL gives the same URI on every path.
        assert urljoin(str(response.request.url), type_uri) == type_uri
    assert answers["deep-invalid"].json()["type"] == answers["shallow-invalid"].json()["type"]
    assert answers["lock-timeout"].json()["type"] == TYPE_BASE + "lock-timeout"


# -- one key, one spelling ----------------------------------------------------------------


@pytest.mark.parametrize("raw", [
    b"order-1\n", b"order-1\r", b"order-1\r\n", b"order-1\x00", b"order-1\x0b", b"order-1\x0c", b'"order-1"\n',
    b"\norder-1", b"order-1\x85", b"order-\xe91", b'"order-1\x7f"', b"order 1",
], ids=repr)
def test_control_and_whitespace_tricks_are_rejected(raw):
    with pytest.raises(IdempotencyKeyError):
        parse_key([(b"idempotency-key", raw)])


async def test_a_key_ending_in_lf_never_runs_the_handler_a_second_time(redis_url):
    # Regression test: a bare key ending in LF was accepted as a different key (the handler ran
    # twice) by servers that pass it through. Driven over raw ASGI, as such a server would.
    runs = []

    @idempotent(shared_scope=True)
    async def order(request):
        runs.append(1)
        return JSONResponse({"order": len(runs)}, status_code=201)

    async with make_manager(redis_url) as manager:
        app = Starlette(routes=[Route("/o", order, methods=["POST"])])
        app.add_middleware(LockMiddleware, manager=manager)
        statuses = []
        for raw in (b"order-1", b"order-1\n", b"order-1\r\n", b"\torder-1 ", b'"order-1"', b' "order-1"\t'):
            sent = await _record_replay(app, "/o", [(b"idempotency-key", raw)])
            statuses.append(next(m["status"] for m in sent if m["type"] == "http.response.start"))
    assert runs == [1]
    assert statuses == [201, 400, 400, 201, 201, 201]   # blanks around a value are stripped: the same key


def _sf(key: str) -> str:
    return '"' + key.replace("\\", "\\\\").replace('"', '\\"') + '"'


@settings(max_examples=400, deadline=None)
@given(st.one_of(st.text(max_size=40), st.binary(max_size=40).map(lambda b: b.decode("latin-1")),
                 st.from_regex(KEY_PATTERN, fullmatch=True)))
def test_a_key_has_one_spelling_and_the_published_pattern_says_exactly_what_is_accepted(value):
    import re

    raw = value.encode("latin-1", "replace")
    try:
        key = parse_key([(b"idempotency-key", raw)])
    except IdempotencyKeyError:
        key = None
    text = raw.decode("latin-1")
    assert (key is not None) == bool(re.fullmatch(KEY_PATTERN, text.strip(" \t")))
    if key is not None:
        # The only spellings of a key: itself as a bare token, or its sf-string.
        assert text.strip(" \t") in {key, _sf(key)}
