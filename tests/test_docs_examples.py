"""Docs as tests: every ```python block of README.md and docs/*.md runs as pasted.

Each block runs alone (tests/_docs_runner.py), in a fork of an interpreter that
has imported FastAPI, httpx and redis-py and no otel_lock module, the way
a reader pastes it into `python -m asyncio`: top-level `await` allowed, no
name from another block. Its `redis://127.0.0.1:6379` is this test's
redis-server; it may reach nothing else (a block naming another host is
refused before it runs, a connection elsewhere fails the run). An ASGI app it
defines is started and sent one request per route: a 5xx, a hang or an error
in the log fails the block.

A block that only illustrates, needing the reader's own objects (a database,
their `locks`), is marked ```python fragment and is skipped; at most a third
of the blocks may be fragments.
"""

from __future__ import annotations

import ipaddress
import json
import re
import sys

import pytest

try:
    from ._docs_runner import Forks
    from ._markdown import PythonBlock, doc_files, fenced_blocks, python_blocks
except ImportError:
    from _docs_runner import Forks
    from _markdown import PythonBlock, doc_files, fenced_blocks, python_blocks

DOC_URL = "redis://127.0.0.1:6379"
RUN_TIMEOUT = 90.0   # seconds for one block, its app's requests included
BLOCKS = python_blocks()

# Blocks that fail as pasted, by file and index among that file's ```python blocks (fragments
# counted), each with the block's first line (so an entry left behind by an edit is found) and the
# cause. None today: a block that fails is fixed, not listed. The xfail is strict, so an entry added
# for a known failure fails the run once the block passes.
FAILING: dict[tuple[str, int], tuple[str, str]] = {}

# A URL's host: after the scheme and any user:password@, up to a port, path or the next host of a list.
REDIS_URL = re.compile(r"\b(?:rediss?|redis\+sentinel|redis\+cluster)://(?:[^@/\s\"']*@)?(?P<hosts>[^/\s\"'?]*)")
IPV4 = re.compile(r"(?<![\d.])(?:\d{1,3}\.){3}\d{1,3}(?![\d.])")
LOOPBACK_NAMES = {"127.0.0.1", "localhost", "::1", "[::1]"}


def foreign_hosts(source: str) -> list[str]:
    """Hosts named in the block other than loopback: in Redis URLs, and any IPv4 literal."""
    hosts = set()
    for match in REDIS_URL.finditer(source):
        for host_port in match["hosts"].split(","):
            host = host_port.partition("]")[0] + "]" if host_port.startswith("[") else host_port.partition(":")[0]
            if host and host not in LOOPBACK_NAMES:
                hosts.add(host)
    for literal in IPV4.findall(source):
        if not ipaddress.ip_address(literal).is_loopback:
            hosts.add(literal)
    return sorted(hosts)


def _param(block: PythonBlock):
    entry = FAILING.get((block.block.path, block.index))
    marks = [pytest.mark.xfail(strict=True, reason=entry[1])] if entry else []
    return pytest.param(block, id=block.id, marks=marks)


@pytest.mark.parametrize("block", [_param(b) for b in BLOCKS if not b.fragment])
def test_block_runs_as_pasted(block: PythonBlock, redis_url):
    hosts = foreign_hosts(block.block.source)
    assert not hosts, (f"{block.id} (line {block.block.line}) names {', '.join(hosts)}: point it at "
                       f"{DOC_URL}/0 or mark it ```python fragment")
    returncode, output = run_as_pasted(block.block.source, redis_url, block.block.path, block.block.line)
    assert returncode == 0, f"{block.id} (line {block.block.line}) failed as pasted:\n{output}"


def run_as_pasted(source: str, redis_url: str, path: str = "<block>", line: int = 0,
                  **options: float) -> tuple[int | None, str]:
    """(exit status, what it printed) of tests/_docs_runner.py on one block; the status is None on a hang."""
    port = int(redis_url.rsplit(":", 1)[1].split("/")[0])
    job = {"path": path, "line": line, "source": source.replace(DOC_URL, redis_url.rsplit("/", 1)[0]),
           "port": port, **options}
    return _RUNNER.run(job, RUN_TIMEOUT)


_RUNNER = Forks()


@pytest.fixture(scope="module", autouse=True)
def _runner_stopped_at_the_end():
    yield
    _RUNNER.close()


def test_the_xfail_list_names_blocks_that_exist():
    """An edit that moves a block makes its entry point at another one: say so, with the block found."""
    by_place = {(b.block.path, b.index): b for b in BLOCKS}
    for place, (first_line, _) in FAILING.items():
        assert place in by_place, f"FAILING names {place}, which is no longer a ```python block"
        found = by_place[place].block.source.splitlines()[0]
        assert found == first_line, f"FAILING {place} expects a block starting {first_line!r}, found {found!r}"
        assert not by_place[place].fragment, f"FAILING {place} is a fragment now: drop its entry"


def test_fragments_are_at_most_a_third_of_the_blocks():
    fragments = [b.id for b in BLOCKS if b.fragment]
    assert len(BLOCKS) >= 20, "fewer ```python blocks than the docs had: did the extraction break?"
    assert 3 * len(fragments) <= len(BLOCKS), f"{len(fragments)} of {len(BLOCKS)} blocks are fragments: {fragments}"


def test_every_python_block_is_labelled_so_the_harness_sees_it():
    """A block labelled py, python3 or pycon, or with a misspelt marker, would escape the harness."""
    for path in doc_files():
        for block in fenced_blocks(path):
            words = block.info.split()
            if words[:1] == ["python"]:
                assert words[1:] in ([], ["fragment"]), f"{block.path}:{block.line}: ```{block.info}"
            else:
                assert not re.fullmatch(r"py\w*|python\w+", words[0] if words else ""), \
                    f"{block.path}:{block.line}: ```{block.info} (use ```python or ```python fragment)"


def test_the_harness_refuses_hosts_other_than_loopback():
    assert foreign_hosts('from_url("redis://127.0.0.1:6379/0")') == []
    assert foreign_hosts('"redis+sentinel://:pw@10.0.0.1:26379,10.0.0.2/svc"') == ["10.0.0.1", "10.0.0.2"]
    assert foreign_hosts('"rediss://cache.internal:6380/0"') == ["cache.internal"]
    assert foreign_hosts('Sentinel([("10.1.2.3", 26379)])') == ["10.1.2.3"]
    assert foreign_hosts('"redis+cluster://localhost:7000,[::1]:7001"') == []


# -- the harness itself: each way a block can fail is caught --------------------------------------

APP = """
from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route

{body}
"""


def test_a_block_reaching_anything_else_than_the_test_redis_fails_even_if_it_swallows_the_error(redis_url):
    source = ("import socket\n"
              "for address in [('127.0.0.1', 6379), ('10.0.0.1', 6379)]:\n"
              "    try: socket.create_connection(address, timeout=1).close()\n"
              "    except OSError: pass\n")
    returncode, output = run_as_pasted(source, redis_url)
    assert returncode == 1 and "connect to ('127.0.0.1', 6379)" in output and "'10.0.0.1'" in output, output


def test_the_doc_url_reaches_the_test_redis(redis_url):
    source = ("import redis\nclient = redis.Redis.from_url('redis://127.0.0.1:6379/0')\n"
              "client.set('docs-harness', 'reached')\nclient.close()\n")
    assert run_as_pasted(source, redis_url) == (0, "")
    import redis
    with redis.Redis.from_url(redis_url) as client:
        assert client.get("docs-harness") == b"reached"


def test_top_level_await_runs_in_a_loop_and_plain_code_outside_one(redis_url):
    awaiting = "import asyncio\nawait asyncio.sleep(0)\nasyncio.get_running_loop()\n"
    plain = ("import asyncio\ntry:\n    asyncio.get_running_loop()\nexcept RuntimeError:\n    pass\n"
             "else:\n    raise AssertionError('a loop is running')\n")
    assert run_as_pasted(awaiting, redis_url)[0] == 0
    assert run_as_pasted(plain, redis_url)[0] == 0


def test_a_traceback_names_the_docs_line(redis_url):
    returncode, output = run_as_pasted("x = 1\nundefined_name\n", redis_url, "docs/x.md", 40)
    assert returncode == 1 and 'File "docs/x.md", line 42' in output and "NameError" in output, output


def test_an_app_answering_500_fails(redis_url):
    body = ("async def broken(request):\n    return JSONResponse({}, status_code=500)\n"
            "app = Starlette(routes=[Route('/ok', broken)])\n")
    returncode, output = run_as_pasted(APP.format(body=body), redis_url)
    assert returncode == 1 and "GET /ok answered 500" in output, output


def test_an_app_raising_in_a_handler_fails(redis_url):
    body = ("async def broken(request):\n    raise KeyError('user')\n"
            "app = Starlette(routes=[Route('/items/{item_id:int}', broken, methods=['POST'])])\n")
    returncode, output = run_as_pasted(APP.format(body=body), redis_url)
    assert returncode == 1 and "POST /items/1 raised KeyError" in output, output


def test_an_app_whose_start_up_fails_or_hangs_fails(redis_url):
    failing = ("from contextlib import asynccontextmanager\n@asynccontextmanager\nasync def life(app):\n"
               "    raise RuntimeError('no principal')\n    yield\n"
               "app = Starlette(routes=[Route('/', JSONResponse)], lifespan=life)\n")
    hanging = failing.replace("raise RuntimeError('no principal')", "import asyncio; await asyncio.Event().wait()")
    returncode, output = run_as_pasted(APP.format(body=failing), redis_url)
    assert returncode == 1 and "no principal" in output, output
    returncode, output = run_as_pasted(APP.format(body=hanging), redis_url, step_timeout=0.5)
    assert returncode == 1 and "lifespan.startup got no answer within 0.5 s" in output, output


def test_a_request_that_hangs_fails(redis_url):
    body = ("import asyncio\nasync def stuck(request):\n    await asyncio.Event().wait()\n"
            "app = Starlette(routes=[Route('/stuck', stuck)])\n")
    returncode, output = run_as_pasted(APP.format(body=body), redis_url, step_timeout=0.5)
    assert returncode == 1 and "GET /stuck got no answer within 0.5 s" in output, output


def test_a_block_that_never_ends_is_killed_and_the_next_block_runs(redis_url, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "RUN_TIMEOUT", 1.0)
    looping = "import time\nprint('started', flush=True)\nwhile True:\n    time.sleep(0.05)\n"
    returncode, output = run_as_pasted(looping, redis_url)
    assert returncode is None and "no end within 1.0 s" in output and "started" in output, output
    # As at an interpreter's exit, a thread the block left running is waited for.
    left_running = "import threading, time\nthreading.Thread(target=time.sleep, args=(3600,)).start()\n"
    assert run_as_pasted(left_running, redis_url)[0] is None
    assert run_as_pasted("print('next')\n", redis_url) == (0, "next\n")


def test_a_block_starts_with_no_otel_lock_module_and_nothing_left_by_the_block_before(redis_url):
    first = "import sys, otel_lock\nsys.modules['left_behind'] = sys\n"
    fresh = ("import sys\nloaded = [m for m in sys.modules if m.startswith('otel_lock') or m == 'left_behind']\n"
             "assert not loaded, loaded\n")
    assert run_as_pasted(first, redis_url) == (0, "")
    assert run_as_pasted(fresh, redis_url) == (0, "")


def test_an_error_in_the_log_fails(redis_url):
    returncode, output = run_as_pasted("import logging\nlogging.getLogger('shop').error('boom')\n", redis_url)
    assert returncode == 1 and "logged an error: shop: boom" in output, output


def test_a_fastapi_app_gets_a_body_and_headers_its_schema_requires(redis_url):
    source = ("from fastapi import FastAPI, Header\nfrom pydantic import BaseModel\n"
              "class Order(BaseModel):\n    product_id: int\n    note: str | None = None\n"
              "app = FastAPI()\n@app.post('/orders/{shop}', status_code=201)\n"
              "async def submit(shop: str, order: Order, x_user_id: str = Header()):\n"
              "    assert order.product_id == 1 and x_user_id == '1'\n    return {}\n")
    returncode, output = run_as_pasted(source, redis_url)
    assert returncode == 0 and "POST /orders/1 -> 201" in output, output


PLAIN_ASGI = """
from otel_lock import LockManager, LockMiddleware, locked

locks = LockManager.from_url("redis://127.0.0.1:6379/0", namespace="docs-harness")


async def plain(scope, receive, send):
    if scope["type"] == "lifespan":
        while (await receive())["type"] != "lifespan.shutdown":
            await send({{"type": "lifespan.startup.complete"}})
        await send({{"type": "lifespan.shutdown.complete"}})
        return
    await send({{"type": "http.response.start", "status": {status}, "headers": []}})
    await send({{"type": "http.response.body", "body": b"{{}}"}})

{app}
"""


def test_an_app_of_another_framework_is_sent_a_request_per_rule_and_its_500_fails(redis_url):
    ruled = ('app = LockMiddleware(plain, manager=locks, rules={"POST /api/items/{item_id}": '
             'locked("item:{path.item_id}")})')
    returncode, output = run_as_pasted(PLAIN_ASGI.format(status=500, app=ruled), redis_url)
    assert returncode == 1 and "POST /api/items/1 answered 500" in output, output
    returncode, output = run_as_pasted(PLAIN_ASGI.format(status=201, app=ruled), redis_url)
    assert returncode == 0 and "POST /api/items/1 -> 201" in output, output


def test_an_app_with_nothing_to_send_requests_to_fails(redis_url):
    returncode, output = run_as_pasted(PLAIN_ASGI.format(status=200, app="app = plain"), redis_url)
    assert returncode == 1 and "nothing to send requests to" in output, output


def test_a_block_is_the_main_module_as_a_pasted_file_would_be(redis_url):
    source = ("import sys\nclass Order:\n    pass\n"
              "assert sys.modules['__main__'].Order is Order and Order.__module__ == '__main__'\n")
    assert run_as_pasted(source, redis_url) == (0, "")
