"""Values: the text of a typed value in a key, the walk into a validated value, raw request values.

`render` gives every typed value its canonical text (`_canonical`: `7`
for `7.0`, datetimes in UTC, enum values); `walk` follows a placeholder's steps into what FastAPI validated
or a handler received; `RawValues` reads the placeholders a route does not
declare (and every placeholder of a Starlette route) straight from the
request.
"""

from __future__ import annotations

import contextvars
import dataclasses
from typing import Any, Iterable, Iterator, Mapping
from urllib.parse import parse_qsl

from ._canonical import NotCanonical, loads_as_handler, scalar_text
from ._declared import FILE_ATTRS, MISSING, model_field

from ._keys import PRINCIPAL, WILDCARD, Part, TemplateValueError, json_value, json_values
from ._keyset import Each, Value
from ._types import Message, Scope

# The caller of the request being protected (`{principal}`), set once it is resolved; None: nobody.
CALLER: contextvars.ContextVar[str | None] = contextvars.ContextVar("otel_lock_principal", default=None)


def principal_value(part: Part) -> str | None:
    """`{principal}`: the resolved caller; a required one is always there (the middleware answered 401 else)."""
    value = CALLER.get()
    if value is None and not part.optional:
        raise TemplateValueError(f"{part.text} is missing: the request has no identified caller")
    return value


def cookie_value(scope: Scope, part: Part) -> str | None:
    """A cookie as the handler reads it (Starlette's `request.cookies`)."""
    from starlette.requests import HTTPConnection

    value = HTTPConnection(scope).cookies.get(part.field)
    if value is None and not part.optional:
        raise TemplateValueError(f"cookie {part.field!r} is missing (needed by {part.text})")
    return value


def render(value: Any, part: Part) -> str | None:
    """The canonical text of a typed value in a key; None for an absent value of an optional placeholder."""
    if value is None or value is MISSING:
        if part.optional:
            return None
        raise TemplateValueError(f"{part.text} is missing")
    try:
        return scalar_text(value)
    except NotCanonical:
        raise TemplateValueError(f"{part.text} must be a string or a number, not {type(value).__name__}") from None


def render_each(values: Iterable[Any], part: Part) -> Each:
    """The texts of a `*` placeholder's values, one per element, rendered as they are read."""
    return Each(render(value, part) for value in values)


def walk_each(node: Any, steps: tuple[str, ...], part: Part) -> Iterator[Any]:
    """The values at a path with `*` steps: every element's, flattened (a set's in any order: keys are sorted).

    Lazily, element by element. An absent or null list is no values for an
    optional placeholder; anything but a list where `*` stands is a
    TemplateValueError (400) naming it.
    """
    star = steps.index(WILDCARD) if WILDCARD in steps else len(steps)
    found = walk(node, steps[:star])
    if star == len(steps):
        yield found
        return
    if found is MISSING or found is None:
        if part.optional:
            return
        raise TemplateValueError(f"{part.text}: the list before '*' is missing or null")
    if not isinstance(found, (list, tuple, set, frozenset)):
        raise TemplateValueError(f"{part.text}: '*' walks a list, but the request has a {type(found).__name__} there")
    for element in found:
        yield from walk_each(element, steps[star + 1:], part)


def walk(node: Any, steps: tuple[str, ...]) -> Any:
    for step in steps:
        node = _step(node, step)
        if node is MISSING:
            break
    return node


def _step(node: Any, step: str) -> Any:
    if node is MISSING or node is None:
        return MISSING
    if isinstance(node, Mapping):
        return node.get(step, MISSING)
    if isinstance(node, (list, tuple)):
        return node[int(step)] if step.isdigit() and int(step) < len(node) else MISSING
    model_fields = getattr(type(node), "model_fields", None)
    if isinstance(model_fields, dict):
        name = model_field(type(node), step)
        if name is not None:
            return getattr(node, name, MISSING)
        extra = getattr(node, "model_extra", None) or {}
        return extra.get(step, MISSING)
    if step in FILE_ATTRS and hasattr(node, "filename") and hasattr(node, "file"):
        return getattr(node, step)   # an UploadFile passed to a direct call
    if dataclasses.is_dataclass(node):
        return getattr(node, step, MISSING)
    return MISSING


class RawValues:
    """The raw request values of placeholders the route does not declare."""

    def __init__(self, scope: Scope, body: bytes) -> None:
        self.scope, self.body = scope, body
        self._json: Any = MISSING
        self._form: Any = MISSING

    async def value(self, part: Part) -> Value:
        if part.many:
            if part.source == "json":
                return Each(json_values(self._document(), part))
            return render_each(walk_each(await self._form_values(part), part.json_path[1:], part), part)
        if part.source == PRINCIPAL:
            return principal_value(part)
        if part.source == "cookie":
            return cookie_value(self.scope, part)
        if part.source == "json":
            return json_value(self._document(), part)
        if part.source == "form":
            return await self._form_value(part)
        if part.source == "path":
            params = self.scope.get("path_params", {})
            if part.field not in params:
                if part.optional:
                    return None
                raise TemplateValueError(f"the route has no path parameter {part.field!r} (needed by {part.text})")
            return render(params[part.field], part)
        if part.source == "query":
            found = [v for k, v in parse_qsl(self.scope.get("query_string", b"").decode("latin-1"),
                                              keep_blank_values=True) if k == part.field]
            return _text(_single(found, f"query parameter {part.field!r}", part), part)
        found = [v.decode("latin-1") for k, v in self.scope.get("headers", [])
                 if k.decode("latin-1").lower() == part.field]
        return _text(_single(found, f"header {part.field!r}", part), part)

    def _document(self) -> Any:
        if self._json is MISSING:
            try:
                self._json = loads_as_handler(self.body)
            except (ValueError, RecursionError):
                raise TemplateValueError("the request body is not valid JSON") from None
        return self._json

    async def _form_values(self, part: Part) -> list[Any]:
        """Every value sent for the form field `part` names first."""
        if self._form is MISSING:
            try:
                form = await parse_form(self.scope, self.body)
            except Exception as error:
                raise TemplateValueError(f"the request body is not a form ({error})") from None
            try:
                self._form = [(key, detach(value)) for key, value in form.multi_items()]
            finally:
                await form.close()
        return [v for k, v in self._form if k == part.json_path[0]]

    async def _form_value(self, part: Part) -> str | None:
        steps = part.json_path
        values = await self._form_values(part)
        return render(walk(_single(values, f"form field {steps[0]!r}", part), steps[1:]), part)


def _text(value: Any, part: Part) -> str | None:
    """A raw query or header value: nothing declared it, so an empty one is no value (absent)."""
    if value == "":
        if part.optional:
            return None
        raise TemplateValueError(f"{part.text} is empty")
    return render(value, part)


def _single(values: list[Any], what: str, part: Part) -> Any:
    if not values:
        if part.optional:
            return MISSING
        raise TemplateValueError(f"{what} is missing (needed by {part.text})")
    if len(values) > 1:
        raise TemplateValueError(f"{what} was sent more than once (needed by {part.text})")
    return values[0]


def detach(value: Any) -> Any:
    from starlette.datastructures import UploadFile

    if isinstance(value, UploadFile):
        return {"filename": value.filename, "content_type": value.content_type, "size": value.size}
    if isinstance(value, list):
        return [detach(v) for v in value]
    return value


async def parse_form(scope: Scope, body: bytes, limits: Mapping[str, int] | None = None) -> Any:
    """The form as Starlette parses it; `limits` (max_fields, max_files, max_part_size) as the route's are."""
    from starlette.requests import Request

    sent = False

    async def receive() -> Message:
        nonlocal sent
        chunk, sent = (b"" if sent else body), True
        return {"type": "http.request", "body": chunk, "more_body": False}

    return await Request(scope, receive).form(**(limits or {}))
