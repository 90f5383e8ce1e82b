"""The inputs a handler reads besides target and body: its declared headers and cookies, its lock key's.

A FastAPI route declares them (`x_account: Annotated[str, Header()]`,
`session: Annotated[str, Cookie()]`, in the handler or any dependency); a
lock key names them (`{header.x-account}`). Two requests that differ in one
of them are two requests, so their values are part of the fingerprint.
Credentials are not: `Authorization` and `Proxy-Authorization` name the
principal, which already scopes the key, and a token refreshed between two
tries must not turn a retry into a 422. Neither are the Idempotency-Key and
the headers that name an attempt rather than a request (W3C trace context,
`X-Request-ID`): a retry carries new ones by design.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .._canonical import dumps
from .._types import Scope

_NOT_INPUTS = frozenset({"authorization", "proxy-authorization", "idempotency-key",
                         "traceparent", "tracestate", "baggage", "x-request-id"})


@dataclass(frozen=True)
class Inputs:
    """Header names (lower-case) and cookie names whose values the handler reads."""

    headers: frozenset[str] = frozenset()
    cookies: frozenset[str] = frozenset()

    def read(self, scope: Scope) -> bytes:
        """This request's values of them, canonical: each header's values in the order sent, each cookie's."""
        sent: list[tuple[bytes, bytes]] = scope.get("headers", [])
        headers = {name: [v.decode("latin-1").strip(" \t") for k, v in sent if k.decode("latin-1").lower() == name]
                   for name in self.headers}
        cookies: dict[str, Any] = {}
        if self.cookies:
            from starlette.requests import cookie_parser

            jar: dict[str, str] = {}
            for key, value in sent:
                if key.lower() == b"cookie":
                    jar.update(cookie_parser(value.decode("latin-1")))
            cookies = {name: jar.get(name) for name in self.cookies}
        return dumps({"h": headers, "c": cookies}).encode("utf-8", "surrogatepass")


_CACHE: dict[int, tuple[Any, Inputs]] = {}


def inputs_of(scope: Scope, template: Any = None) -> Inputs:
    """The inputs of the route FastAPI matched (`scope["route"]`) and of the lock key `template`."""
    route = scope.get("route")
    dependant = getattr(route, "dependant", None)
    declared = _declared(dependant) if dependant is not None else Inputs()
    parts = getattr(template, "parts", ())
    headers = {p.field for p in parts if p.source == "header"} - _NOT_INPUTS
    cookies = {p.field for p in parts if p.source == "cookie"}
    if not headers and not cookies:
        return declared
    return Inputs(declared.headers | headers, declared.cookies | cookies)


def _declared(dependant: Any) -> Inputs:
    cached = _CACHE.get(id(dependant))
    if cached is not None and cached[0] is dependant:
        return cached[1]
    from .._binding import param_names

    headers: set[str] = set()
    cookies: set[str] = set()
    stack, seen = [dependant], set()
    while stack:
        current = stack.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        for field in getattr(current, "header_params", ()):
            headers.update(_names(field, "header", param_names))
        for field in getattr(current, "cookie_params", ()):
            cookies.update(_names(field, "cookie", param_names))
        stack.extend(getattr(current, "dependencies", ()))
    inputs = Inputs(frozenset(headers - _NOT_INPUTS), frozenset(cookies))
    _CACHE[id(dependant)] = (dependant, inputs)
    return inputs


def _names(field: Any, source: str, param_names: Any) -> list[str]:
    """The names a client sends for a parameter, or for each field of a parameter model."""
    from .._declared import info_names, model_of

    model = model_of(getattr(field.field_info, "annotation", None))
    if model is None:
        return list(param_names(field, source)) if source == "header" else [field.alias or field.name]
    names = []
    for name, info in model.model_fields.items():
        spelled = [*info_names(info), name]
        names += [n.replace("_", "-").lower() for n in spelled] + [n.lower() for n in spelled] \
            if source == "header" else spelled
    return names
