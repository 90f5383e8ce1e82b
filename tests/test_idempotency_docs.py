"""docs/idempotency.md: every Python snippet runs as pasted, and the first one behaves as described."""

from __future__ import annotations

import re
from pathlib import Path

try:
    from ._middleware_helpers import client_for
except ImportError:
    from _middleware_helpers import client_for

DOC = Path(__file__).resolve().parent.parent / "docs" / "idempotency.md"
SNIPPETS = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)


def test_every_snippet_runs_as_pasted():
    assert len(SNIPPETS) >= 2
    for source in SNIPPETS:
        exec(compile(source, str(DOC), "exec"), {"__name__": "docs_snippet"})


async def test_the_first_example_scopes_keys_to_the_session_user(redis_url):
    source = SNIPPETS[0].replace("redis://127.0.0.1:6379/0", redis_url)
    namespace: dict = {"__name__": "docs_snippet"}
    exec(compile(source, str(DOC), "exec"), namespace)
    headers = {"idempotency-key": '"8e03978e"', "cookie": "session=s-3f9a"}
    try:
        async with client_for(namespace["app"]) as client:
            first = await client.post("/api/orders", json={"product_id": "p1"}, headers=headers)
            retry = await client.post("/api/orders", json={"product_id": "p1"}, headers=headers)
            stranger = await client.post("/api/orders", json={"product_id": "p1"},
                                         headers={"idempotency-key": '"8e03978e"'})
    finally:
        await namespace["locks"].aclose()
    assert first.status_code == 201 and first.json() == {"user": "alice", "product_id": "p1"}
    assert retry.headers["idempotent-replayed"] == "true"
    assert stranger.status_code == 401


def test_token_recipe_verifies_the_signature():
    import hashlib
    import hmac

    from starlette.requests import Request

    namespace: dict = {"__name__": "docs_snippet"}
    exec(compile(SNIPPETS[1], str(DOC), "exec"), namespace)
    good = hmac.new(namespace["TOKEN_SECRET"], b"alice", hashlib.sha256).hexdigest()

    def request(auth: str) -> Request:
        return Request({"type": "http", "headers": [(b"authorization", auth.encode())]})

    assert namespace["token_subject"](request(f"Bearer alice.{good}")) == "alice"
    assert namespace["token_subject"](request(f"Bearer mallory.{good}")) is None
    assert namespace["token_subject"](request("Bearer alice")) is None
