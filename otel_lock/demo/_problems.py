"""RFC 9457 problem+json answers of the demo shop.

Every error names its case in `type`, so a client (and a test) can tell an
out-of-stock 409 from a lock-timeout 409 without parsing prose. The body is
built by the library's own `problem_body`, so the shop's answers and the
middleware's (lock-timeout, idempotency-key-*) look the same.
"""

from __future__ import annotations

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response

from ..asgi._problem import CONTENT_TYPE, problem_body


class Problem(Exception):
    """Raised by handlers; turned into a problem+json response by `problem_handler`."""

    def __init__(self, status: int, type_: str, detail: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(detail)
        self.status, self.type, self.detail, self.headers = status, type_, detail, headers or {}


def problem_response(status: int, type_: str, detail: str, headers: dict[str, str] | None = None) -> Response:
    return Response(problem_body(status, type_, detail), status_code=status, headers=headers,
                    media_type=CONTENT_TYPE.decode())


async def problem_handler(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, Problem)
    return problem_response(exc.status, exc.type, exc.detail, exc.headers)


_HTTP_TYPES = {404: "not-found", 405: "method-not-allowed", 413: "request-too-large"}


async def http_exception_handler(request: Request, exc: Exception) -> Response:
    """Starlette's own 404/405 (unknown path, wrong method) as problem+json too."""
    assert isinstance(exc, HTTPException)
    type_ = _HTTP_TYPES.get(exc.status_code, "http-error")
    return problem_response(exc.status_code, type_, str(exc.detail), dict(exc.headers or {}))


async def unexpected_error_handler(request: Request, exc: Exception) -> Response:
    # A bug, not bad input: still answer in the same format so clients parse one shape.
    return problem_response(500, "internal-error", f"{type(exc).__name__} while handling the request")
