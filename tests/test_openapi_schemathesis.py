"""The published OpenAPI against the answers, with schemathesis: 0 5xx, 0 schema violations.

Two apps, each served by uvicorn in its own process on a real Redis: the demo
shop (a Starlette app whose document is written by hand and completed by the
middleware's answers) and README.md's FastAPI example (FastAPI's document,
completed by the middleware). Every operation gets schema-valid requests
(and, for the answers to bad input, schema-invalid ones); each answer must be
documented, status, headers, content type and body. Bounded: a few hundred
requests in all.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (content_type_conformance, negative_data_rejection,
                                               response_headers_conformance, response_schema_conformance,
                                               status_code_conformance)

from otel_lock.cli._redis_server import free_port, stop_process
from otel_lock.cli._replicas import Replicas

HERE = Path(__file__).resolve().parent
CONFORMANCE = [not_a_server_error, status_code_conformance, content_type_conformance,
               response_headers_conformance, response_schema_conformance]
EXAMPLES = {GenerationMode.POSITIVE: 25, GenerationMode.NEGATIVE: 10}


@pytest.fixture(scope="module")
def demo(redis_server):
    with Replicas(redis_server.url, count=1, namespace="schemathesis", job_interval=0) as started:
        url = started.urls[0]
        with httpx.Client() as client:   # something to sell, so that orders and deductions can succeed
            for product in ("p1", "p2", "A"):
                assert client.put(f"{url}/api/stock/{product}", json={"stock": 1000}).status_code == 200
        yield url


@pytest.fixture(scope="module")
def readme_app(redis_server, tmp_path_factory):
    port = free_port()
    env = {**os.environ, "REDIS_URL": redis_server.url, "PYTHONPATH": str(HERE)}
    log = tmp_path_factory.mktemp("readme-app") / "uvicorn.log"
    with open(log, "wb") as out:
        process = subprocess.Popen([sys.executable, "-m", "uvicorn", "readme_fastapi_app:app", "--port", str(port),
                                    "--log-level", "warning"], env=env, cwd=HERE, stdout=out, stderr=out)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_for(url + "/openapi.json", process, log)
        yield url
    finally:
        stop_process(process)


def _wait_for(url: str, process: subprocess.Popen, log: Path, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the app exited: {log.read_text(errors='replace')}")
        try:
            if httpx.get(url, timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    raise RuntimeError(f"{url} did not answer within {timeout} s")


def run_schemathesis(url: str, headers: dict[str, str] | None = None, known: dict[str, dict] | None = None,
                     negative_fixed: dict[str, dict] | None = None) -> dict[str, int]:
    """Every operation, positive and negative; raises on the first failed check. Returns answers seen.

    `known`: per operation ("POST /api/orders"), fixed parts (`body=`, `path_parameters=`) of an extra
    positive run, so that requests also reach the handler's success path. `negative_fixed`: parts the
    negative run keeps valid (what it then gets wrong is the rest). A request with an
    Idempotency-Key is sent twice: the retry's answer (a replay, a 409, ...) must conform too.
    """
    schema = schemathesis.openapi.from_url(url + "/openapi.json")
    seen: dict[str, int] = {}
    for result in schema.get_all_operations():
        operation = result.ok()
        name = f"{operation.method.upper()} {operation.path}"
        runs = [(GenerationMode.POSITIVE, EXAMPLES[GenerationMode.POSITIVE], {}),
                (GenerationMode.NEGATIVE, EXAMPLES[GenerationMode.NEGATIVE], (negative_fixed or {}).get(name, {}))]
        fixed = (known or {}).get(name)
        if fixed is not None:
            runs.append((GenerationMode.POSITIVE, EXAMPLES[GenerationMode.POSITIVE], fixed))
        for mode, examples, parts in runs:
            if mode is GenerationMode.NEGATIVE and not any(
                    (operation.path_parameters, operation.query, operation.headers, operation.body)):
                continue  # nothing to get wrong
            checks = CONFORMANCE + ([negative_data_rejection] if mode is GenerationMode.NEGATIVE else [])

            @given(case=operation.as_strategy(generation_mode=mode, **parts))
            @settings(max_examples=examples, deadline=None, database=None, derandomize=True,
                      phases=[Phase.generate], suppress_health_check=list(HealthCheck))
            def check(case):
                sends = 2 if "Idempotency-Key" in (case.headers or {}) else 1
                for _ in range(sends):
                    response = case.call(base_url=url, headers=headers, timeout=10)
                    case.validate_response(response, checks=_without_fastapis_own(response, checks),
                                           headers=headers, transport_kwargs={"base_url": url})
                    answer = f"{case.method} {response.status_code}"
                    seen[answer] = seen.get(answer, 0) + 1
                    if response.headers.get("idempotent-replayed"):
                        seen["replayed"] = seen.get("replayed", 0) + 1

            check()
    return seen


def _without_fastapis_own(response, checks: list) -> list:
    """FastAPI answers a body it cannot decode with a 400 it does not document (not the middleware's)."""
    if response.status_code == 400 and response.content == b'{"detail":"There was an error parsing the body"}':
        return [not_a_server_error]
    return checks


def test_the_demo_publishes_its_openapi(demo):
    document = httpx.get(demo + "/openapi.json").json()
    assert document["openapi"].startswith("3.1")
    orders = document["paths"]["/api/orders"]["post"]
    assert {"201", "400", "401", "409", "422", "429", "503", "507"} <= set(orders["responses"])
    assert "WWW-Authenticate" in orders["responses"]["401"]["headers"]
    assert [p["name"] for p in orders["parameters"] if p["in"] == "header"] == ["X-User-Id", "Idempotency-Key"]


def test_schemathesis_finds_no_5xx_and_no_schema_violation_in_the_demo(demo):
    seen = run_schemathesis(demo, known={
        "POST /api/orders": {"body": {"product_id": "p1", "quantity": 1}},
        "POST /api/stock/{product_id}/deduct": {"path_parameters": {"product_id": "p2"}},
    })
    assert sum(seen.values()) >= 200, seen
    assert not [answer for answer in seen if answer[-3:].startswith("5")], seen
    assert seen.get("POST 201") and seen.get("replayed"), seen   # orders went through, and were replayed


def test_schemathesis_finds_no_5xx_and_no_schema_violation_in_the_readme_example(readme_app):
    # Pydantic's lax mode takes `true` for an int: what the negative runs get wrong is the middleware's
    # part (the Idempotency-Key) and the path, not the body FastAPI validates on its own terms.
    valid_body = {"POST /api/orders": {"body": {"product_id": 7, "quantity": 1}}}
    signed_in = run_schemathesis(readme_app, headers={"Authorization": "Bearer alice"}, known=valid_body,
                                 negative_fixed=valid_body)
    anonymous = run_schemathesis(readme_app, negative_fixed=valid_body)
    assert sum(signed_in.values()) + sum(anonymous.values()) >= 100
    assert signed_in.get("POST 200") and signed_in.get("replayed") and anonymous.get("POST 401"), (signed_in, anonymous)
