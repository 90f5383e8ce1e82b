"""docs/middleware.md: every Python snippet of its own sections runs as pasted, and starts cleanly."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

try:
    from ._middleware_helpers import client_for, run_lifespan
except ImportError:
    from _middleware_helpers import client_for, run_lifespan

DOC = Path(__file__).resolve().parent.parent / "docs" / "middleware.md"
# The section on atomic scripts has its own test (tests/test_demo_app.py).
OWN = DOC.read_text().split("## When a lock, when a script", 1)[0]
SNIPPETS = re.findall(r"```python\n(.*?)```", OWN, flags=re.S)
URL = "redis://127.0.0.1:6379/0"


def run(source: str, redis_url: str) -> dict:
    """Run a snippet as the module a user would paste it into (frameworks look their module up)."""
    import sys
    import types

    module = types.ModuleType("docs_snippet")
    sys.modules["docs_snippet"] = module
    exec(compile(source.replace(URL, redis_url), str(DOC), "exec"), module.__dict__)
    return module.__dict__


@pytest.mark.parametrize("index", range(len(SNIPPETS)))
async def test_every_snippet_runs_as_pasted_and_its_app_starts(redis_url, index):
    assert URL in SNIPPETS[index]
    namespace = run(SNIPPETS[index], redis_url)
    try:
        messages = await run_lifespan(namespace["app"])
    finally:
        if "locks" in namespace:   # a manager the app's lifespan owns is closed by it
            await namespace["locks"].aclose()
    assert messages[0]["type"] == "lifespan.startup.complete", messages


async def test_the_fastapi_example_locks_the_typed_value(redis_url):
    namespace = run(SNIPPETS[0], redis_url)
    try:
        async with client_for(namespace["app"]) as client:
            first = await client.post("/api/stock/07/deduct")
            second = await client.post("/api/stock/+7/deduct")
    finally:
        await namespace["locks"].aclose()
    assert first.status_code == 200 and first.json()["left"] == 0
    assert second.status_code == 409


async def test_the_session_example_commits_under_the_lock(redis_url):
    import asyncio

    source = next(s for s in SNIPPETS if "get_session" in s)
    namespace = run(source, redis_url)
    try:
        async with client_for(namespace["app"]) as client:
            answers = await asyncio.gather(client.post("/api/stock/p1/buy"), client.post("/api/stock/p1/buy"))
    finally:
        await namespace["locks"].aclose()
    assert sorted(a.status_code for a in answers) == [200, 409]
    assert namespace["DATABASE"] == {"p1": 0}


async def test_the_several_keys_example_transfers_both_ways_and_sells_each_sku_once(redis_url):
    import asyncio

    source = next(s for s in SNIPPETS if "lock_all" in s or "json.lines.*.sku" in s)
    namespace = run(source, redis_url)
    try:
        async with client_for(namespace["app"]) as client:
            transfers = await asyncio.gather(*(client.post("/api/transfers", json={"from_id": a, "to_id": b,
                                                                                  "amount": 10})
                                               for a, b in [(1, 2), (2, 1)] * 5))
            carts = await asyncio.gather(*(client.post("/api/checkout", json={"lines": [
                {"SKU": "apple", "qty": 2}, {"SKU": "pear", "qty": 1}]})
                for _ in range(3)))
            empty = await client.post("/api/checkout", json={"lines": []})
            export = await client.post("/api/exports", headers={"x-tenant": "t3"})
            price = await client.put("/api/catalogue/9", params={"price": 99})
            read = await client.get("/api/catalogue/9")
    finally:
        await namespace["locks"].aclose()
    assert [t.status_code for t in transfers] == [200] * 10 and namespace["BALANCES"] == {1: 100, 2: 100}
    assert sorted(transfers[0].json()["tokens"]) == ["account:1", "account:2"]
    assert [c.json()["sold"] for c in carts].count(True) == 1 and namespace["STOCK"] == {"apple": 1, "pear": 4}
    assert empty.status_code == 422
    assert export.json() == {"tenant": "t3"} and price.status_code == 200 and read.json() == {"price": 99}
