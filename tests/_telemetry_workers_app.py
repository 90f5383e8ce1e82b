"""A locked app whose telemetry is set up at import: served by several worker processes in tests/test_telemetry_processes.py.

Under gunicorn ``--preload`` the import (and `setup()`) happens in the master,
before the workers are forked; without it, and under ``uvicorn --workers``,
in each worker. No lock is taken at import, so the only acquisitions are the
test's requests. Each answer says which process served it and under which
``service.instance.id``.
"""

from __future__ import annotations

import os

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from otel_lock import LockManager, telemetry

installed = telemetry.setup("workers", flush_on_signal=False)
locks = LockManager.from_url(os.environ["OTEL_LOCK_TEST_REDIS_URL"], namespace="workers")


async def take(request: Request) -> JSONResponse:
    async with locks.lock("work"):
        pass
    assert installed.resource is not None
    return JSONResponse({"pid": os.getpid(), "instance": installed.resource.attributes["service.instance.id"]})


app = installed.instrument_app(Starlette(routes=[
    Route("/take", take, methods=["POST"]),
    Route("/metrics", telemetry.metrics_endpoint),
]))
