"""Key values as the handler will receive them.

For a FastAPI route, a placeholder that names a declared parameter (path,
query, header) or a JSON body field is run through FastAPI's own validation
of that field (`request_params_to_args`, `request_body_to_args`), so `07`,
`+7` and `7.0` are the one int 7 the handler sees, while a `str` field keeps
`"07"` apart from `"7"`. A value FastAPI would reject is `INVALID`: the
request is not locked and FastAPI answers its own 422. Placeholders naming
nothing declared (and every placeholder of a Starlette route) use the raw
request value; Starlette path convertors have already typed `{id:int}`.
"""

from __future__ import annotations

import datetime as dt
import decimal
import enum
import json
import uuid
from typing import Any
from urllib.parse import parse_qsl

from ._keys import Part, TemplateValueError, json_value
from ._types import Scope

INVALID = object()   # the framework will answer 422: do not lock
_MISSING = object()


def render(value: Any, part: Part) -> str:
    """The text of a typed value in a key; the same value always renders the same."""
    if isinstance(value, enum.Enum):
        value = value.value
    if value is None:
        raise TemplateValueError(f"{part.text} is missing")
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        text = value
    elif isinstance(value, (int, uuid.UUID)):
        text = str(value)
    elif isinstance(value, float):
        text = repr(value)
    elif isinstance(value, decimal.Decimal):
        text = str(value.normalize()) if value.is_finite() else str(value)
    elif isinstance(value, (dt.date, dt.time)):
        text = value.isoformat()
    else:
        raise TemplateValueError(f"{part.text} must be a string or a number, not {type(value).__name__}")
    if text == "":
        raise TemplateValueError(f"{part.text} is empty")
    return text


class TypedFields:
    """The declared fields of one FastAPI route (its dependant, sub-dependencies included)."""

    def __init__(self, dependant: Any, embed_body: bool) -> None:
        self.params: dict[tuple[str, str], Any] = {}
        self.body_fields: list[Any] = []
        self.embed_body = embed_body
        stack, seen = [dependant], set()
        while stack:
            current = stack.pop(0)
            if current is None or id(current) in seen:
                continue
            seen.add(id(current))
            for source, fields in (("path", current.path_params), ("query", current.query_params),
                                   ("header", current.header_params)):
                for field in fields:
                    if _plain_param(field):
                        self.params.setdefault((source, _alias(field, source)), field)
            self.body_fields.extend(current.body_params)
            stack.extend(current.dependencies)

    def field(self, part: Part) -> Any:
        """FastAPI's declared field for a path, query or header placeholder, or None."""
        return self.params.get((part.source, part.field))


def _alias(field: Any, source: str) -> str:
    alias = getattr(field, "validation_alias", None) or field.alias
    alias = alias if isinstance(alias, str) else field.alias
    return alias.lower() if source == "header" else alias


def _plain_param(field: Any) -> bool:
    """A scalar or list parameter; parameter models (`Annotated[Model, Query()]`) are left raw."""
    from pydantic import BaseModel

    annotation = getattr(field.field_info, "annotation", None)
    return not (isinstance(annotation, type) and issubclass(annotation, BaseModel))


class Values:
    """One request's key values; typed where the route declares the field."""

    def __init__(self, scope: Scope, body: bytes, typed: TypedFields | None) -> None:
        self.scope, self.body, self.typed = scope, body, typed
        self._json: Any = _MISSING
        self._body_values: Any = _MISSING

    async def get(self, part: Part) -> Any:
        """The rendered value, or INVALID; raises TemplateValueError (400) for absent values."""
        if part.source == "json":
            return await self._json_part(part)
        field = self.typed.field(part) if self.typed is not None else None
        if field is None:
            return self._raw(part)
        from fastapi.dependencies.utils import request_params_to_args

        values, errors = request_params_to_args([field], self._mapping(part.source))
        if errors:
            return INVALID
        return render(values.get(field.name), part)

    def _mapping(self, source: str) -> Any:
        if source == "path":
            return self.scope.get("path_params", {})
        if source == "query":
            from starlette.datastructures import QueryParams

            return QueryParams(self.scope.get("query_string", b""))
        from starlette.datastructures import Headers

        return Headers(scope=self.scope)

    def _raw(self, part: Part) -> str:
        if part.source == "path":
            params = self.scope.get("path_params", {})
            if part.field not in params:
                raise TemplateValueError(f"the route has no path parameter {part.field!r} (needed by {part.text})")
            return render(params[part.field], part)
        if part.source == "query":
            found = [v for k, v in parse_qsl(self.scope.get("query_string", b"").decode("latin-1"),
                                              keep_blank_values=True) if k == part.field]
            return render(_single(found, f"query parameter {part.field!r}", part), part)
        found = [v.decode("latin-1") for k, v in self.scope.get("headers", [])
                 if k.decode("latin-1").lower() == part.field]
        return render(_single(found, f"header {part.field!r}", part), part)

    def _document(self) -> Any:
        if self._json is _MISSING:
            try:
                self._json = json.loads(self.body)
            except (ValueError, RecursionError):
                self._json = INVALID
        return self._json

    async def _json_part(self, part: Part) -> Any:
        doc = self._document()
        typed = self.typed
        if typed is not None and typed.body_fields:
            if doc is INVALID:
                return INVALID  # FastAPI answers 422 for a body that is not JSON
            values = await self._validated_body(doc, typed)
            if values is INVALID:
                return INVALID
            found = _walk_typed(values, part, typed)
            if found is not _MISSING:
                return render(found, part)
        if doc is INVALID:
            raise TemplateValueError("the request body is not valid JSON")
        return json_value(doc, part)

    async def _validated_body(self, doc: Any, typed: TypedFields) -> Any:
        if self._body_values is _MISSING:
            from fastapi.dependencies.utils import request_body_to_args

            values, errors = await request_body_to_args(body_fields=typed.body_fields, received_body=doc,
                                                        embed_body_fields=typed.embed_body)
            self._body_values = INVALID if errors else values
        return self._body_values


def _walk_typed(values: dict[str, Any], part: Part, typed: TypedFields) -> Any:
    steps = list(part.json_path)
    fields = typed.body_fields
    if len(fields) == 1 and not typed.embed_body:
        node = values.get(fields[0].name, _MISSING)     # the body is this one parameter
    else:
        by_alias = {_alias(f, "json"): f.name for f in fields}
        name = by_alias.get(steps.pop(0))
        node = values.get(name, _MISSING) if name is not None else _MISSING
    for step in steps:
        node = _step(node, step)
        if node is _MISSING:
            break
    return node


def _step(node: Any, step: str) -> Any:
    if node is _MISSING or node is None:
        return _MISSING
    if isinstance(node, dict):
        return node.get(step, _MISSING)
    if isinstance(node, (list, tuple)):
        return node[int(step)] if step.isdigit() and int(step) < len(node) else _MISSING
    model_fields = getattr(type(node), "model_fields", None)
    if isinstance(model_fields, dict):
        for name, info in model_fields.items():
            if step in (name, info.alias, info.validation_alias):
                return getattr(node, name, _MISSING)
    return _MISSING


def _single(values: list[str], what: str, part: Part) -> str:
    if not values:
        raise TemplateValueError(f"{what} is missing (needed by {part.text})")
    if len(values) > 1:
        raise TemplateValueError(f"{what} was sent more than once (needed by {part.text})")
    return values[0]
