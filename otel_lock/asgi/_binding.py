"""Key values as the handler receives them, for every way FastAPI and Pydantic bind them.

At start-up each placeholder of a route's template is tied to what the
handler gets (`RouteBinding`), or the start-up fails naming the route and
the fix (`Unbindable`):

- a declared path, query or header parameter, by any name it is bound with
  (its alias, `validation_alias`, each of its `AliasChoices`, its Python
  name), or a field of a parameter model;
- a field of the declared JSON body, `{json.a.b}`, through models by any
  name of their fields, lists by index, dicts by key;
- a field of the declared form, `{form.name}`, and an upload's metadata,
  `{form.upload.filename}`, `.content_type`, `.size`;
- anything the route does not declare (and every placeholder of a Starlette
  route): the raw request value.

Per request, declared values go through FastAPI's own validation
(`request_params_to_args`, `request_body_to_args`), so `{"pid": "07"}`,
`{"pid": 7}` and `{"productId": 7}` are the one int 7 the handler sees. A
value FastAPI would reject is `INVALID`: the request is not locked and
FastAPI answers its own 422. The same binding reads the values from a
handler's arguments when it is called directly (`call_values`).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import decimal
import enum
import json
import types
import typing
import uuid
from dataclasses import dataclass
from typing import Any, Mapping
from urllib.parse import parse_qsl

from ._keys import KeyTemplate, Part, TemplateValueError, json_value
from ._types import Message, Scope

INVALID: Any = object()   # the framework will answer 422: do not lock
_MISSING: Any = object()
FILE_ATTRS = ("filename", "content_type", "size")


class Unbindable(ValueError):
    """A placeholder names nothing the handler can receive as one value (a start-up error)."""


class Unrenderable(ValueError):
    """A direct call of a guarded handler: its arguments do not carry every value of the key."""


def render(value: Any, part: Part) -> str:
    """The text of a typed value in a key; the same value always renders the same."""
    if isinstance(value, enum.Enum):
        value = value.value
    if value is None or value is _MISSING:
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


@dataclass(frozen=True)
class Bound:
    """Where one placeholder's value comes from."""

    part: Part
    field: Any = None                # FastAPI's ModelField validated for it; None: the raw request value
    body: bool = False               # `field` is a body field (validated with the whole body)
    steps: tuple[str, ...] = ()      # into the validated value: model fields, list indexes, dict keys
    argument: str | None = None      # the handler's own argument that holds the value, if it is one


class RouteBinding:
    """How one route's handler receives each value of one key template."""

    def __init__(self, template: KeyTemplate, dependant: Any = None, embed: bool = False) -> None:
        self.template = template
        own = _Declared(dependant, top_only=True) if dependant is not None else None
        declared = _Declared(dependant) if dependant is not None else None
        self.body_fields: list[Any] = declared.body if declared is not None else []
        self.embed = embed or _embedded(self.body_fields)
        self.form = any(_is_form(f) for f in self.body_fields)
        self.request_argument: str | None = getattr(dependant, "request_param_name", None)
        self.bounds = tuple(self._bind(part, declared, own) for part in template.parts)

    # -- start-up -------------------------------------------------------------

    def _bind(self, part: Part, declared: _Declared | None, own: _Declared | None) -> Bound:
        if declared is None:
            return Bound(part)
        if part.source in ("path", "query", "header"):
            return _bind_param(part, declared, own)
        return self._bind_body(part, own)

    def _bind_body(self, part: Part, own: _Declared | None) -> Bound:
        if not self.body_fields:
            return Bound(part)   # no declared body: the handler reads the raw request itself
        if part.source == "json" and self.form:
            raise Unbindable(f"{part.text} reads a JSON body, but the route's body is a form (Form()/File()): "
                             f"write {{form.{part.field}}}")
        if part.source == "form" and not self.form:
            raise Unbindable(f"{part.text} reads a form, but the route's body is JSON: write {{json.{part.field}}}")
        steps = list(part.json_path)
        if len(self.body_fields) == 1 and not self.embed:
            field = self.body_fields[0]     # the body is this one parameter (a model, a dict, ...)
        else:
            field = _field_named(self.body_fields, steps[0], part.source)
            if field is None:
                names = ", ".join(sorted(_param_names(f, "json")[0] for f in self.body_fields))
                raise Unbindable(f"{part.text}: the route's body has no field {steps[0]!r} (its fields: {names})")
            steps.pop(0)
        _check_optional(field.name, field.field_info, part)
        _check_path(_annotation(field), tuple(steps), part)
        argument = field.name if own is not None and any(f is field for f in own.body) else None
        return Bound(part, field, body=True, steps=tuple(steps), argument=argument)

    def call_problem(self) -> str | None:
        """Why the key cannot be read from the handler's arguments (None: it can)."""
        if self.request_argument is not None:
            return None
        missing = [b.part.text for b in self.bounds if b.argument is None]
        if not missing:
            return None
        return (f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not among the handler's own "
                f"parameters: declare {'it' if len(missing) == 1 else 'them'} as parameters of the handler, or "
                f"add a `request: Request` parameter")

    # -- per request ------------------------------------------------------------

    async def request_values(self, scope: Scope, body: bytes) -> dict[Part, str] | Any:
        """The rendered values, or INVALID; raises TemplateValueError (400) for absent raw values."""
        found: dict[Part, str] = {}
        validated: Any = _MISSING
        raw = _Raw(scope, body)
        for bound in self.bounds:
            if bound.field is None:
                found[bound.part] = await raw.value(bound.part)
                continue
            if bound.body:
                if validated is _MISSING:
                    validated = await self._validate_body(scope, body)
                if validated is INVALID:
                    return INVALID
                value = _walk(validated.get(bound.field.name, _MISSING), bound.steps)
            else:
                value = _validate_param(bound.field, scope)
                if value is INVALID:
                    return INVALID
                value = _walk(value, bound.steps)
            found[bound.part] = render(value, bound.part)
        return found

    async def call_values(self, arguments: Mapping[str, Any]) -> dict[Part, str]:
        """The rendered values from a handler's arguments; raises Unrenderable if they lack one."""
        if all(b.argument is not None and b.argument in arguments for b in self.bounds):
            return {b.part: render(_walk(arguments[b.argument or ""], b.steps), b.part) for b in self.bounds}
        request = _request_among(arguments)
        if request is None:
            raise Unrenderable(self.call_problem() or "the handler's arguments do not carry the key's values")
        body = await request.body() if any(p.source in ("json", "form") for p in self.template.parts) else b""
        values = await self.request_values(request.scope, body)
        if values is INVALID:
            raise TemplateValueError("a value of the lock key is not valid for the handler's declared types")
        result: dict[Part, str] = values
        return result

    async def _validate_body(self, scope: Scope, body: bytes) -> Any:
        from fastapi.dependencies.utils import request_body_to_args

        if self.form:
            return await _validate_form(self.body_fields, self.embed, scope, body)
        document = _json_body(scope, body)
        if document is INVALID:
            return INVALID
        values, errors = await request_body_to_args(body_fields=self.body_fields, received_body=document,
                                                    embed_body_fields=self.embed)
        return INVALID if errors else values


# -- what a FastAPI route declares ---------------------------------------------------


class _Declared:
    """The declared fields of a dependant (and its sub-dependencies unless top_only)."""

    def __init__(self, dependant: Any, top_only: bool = False) -> None:
        self.params: dict[str, list[Any]] = {"path": [], "query": [], "header": []}
        self.body: list[Any] = []
        stack, seen = [dependant], set()
        while stack:
            current = stack.pop(0)
            if current is None or id(current) in seen:
                continue
            seen.add(id(current))
            self.params["path"].extend(current.path_params)
            self.params["query"].extend(current.query_params)
            self.params["header"].extend(current.header_params)
            self.body.extend(f for f in current.body_params if all(f is not b for b in self.body))
            if not top_only:
                stack.extend(current.dependencies)


def _bind_param(part: Part, declared: _Declared, own: _Declared | None) -> Bound:
    for field in declared.params[part.source]:
        model = _model_of(_annotation(field))
        if model is not None:
            # A parameter model (`Annotated[Filters, Query()]`): the placeholder names one of its fields.
            name = _model_field(model, part.field, part.source)
            if name is None:
                continue
            steps: tuple[str, ...] = (name,)
        elif part.field in _param_names(field, part.source):
            steps = ()
            _check_optional(field.name, field.field_info, part)
            _check_path(_annotation(field), steps, part)   # one value, not a list of them
        else:
            continue
        argument = field.name if own is not None and any(f is field for f in own.params[part.source]) else None
        return Bound(part, field, steps=steps, argument=argument)
    return Bound(part)   # not declared: the raw request value (the handler may read it from `request`)


def _param_names(field: Any, source: str) -> list[str]:
    """Every name a client may send for a field, then its Python name (header names lower-cased)."""
    info = field.field_info
    names = [field.alias or field.name]
    names += _info_names(info)
    if source == "header" and getattr(info, "convert_underscores", True):
        names += [n.replace("_", "-") for n in names]
    names.append(field.name)
    if source == "header":
        names = [n.lower() for n in names]
    return list(dict.fromkeys(names))


def _info_names(info: Any) -> list[str]:
    names: list[str] = []
    alias = getattr(info, "alias", None)
    if isinstance(alias, str):
        names.append(alias)
    validation = getattr(info, "validation_alias", None)
    if isinstance(validation, str):
        names.append(validation)
    for choice in getattr(validation, "choices", None) or ():
        if isinstance(choice, str):
            names.append(choice)
    return names


def _field_named(fields: list[Any], step: str, source: str) -> Any:
    by_name = [f for f in fields if f.name == step]
    if by_name:
        return by_name[0]
    return next((f for f in fields if step in _param_names(f, source)), None)


def _is_form(field: Any) -> bool:
    from fastapi import params

    return isinstance(field.field_info, params.Form)


def _embedded(fields: list[Any]) -> bool:
    if len({f.name for f in fields}) > 1:
        return True
    if not fields:
        return False
    info = fields[0].field_info
    return bool(getattr(info, "embed", False)) or (_is_form(fields[0]) and _model_of(_annotation(fields[0])) is None)


def _annotation(field: Any) -> Any:
    return getattr(field.field_info, "annotation", None)


def _check_optional(name: str, info: Any, part: Part) -> None:
    required = info.is_required() if hasattr(info, "is_required") else True
    if not required and getattr(info, "default", None) is None and getattr(info, "default_factory", None) is None:
        raise Unbindable(f"{part.text} names {name!r}, which is optional with no default: the key would have no "
                         f"value when it is absent; make it required or give it a default")


# -- the static walk through the declared types ---------------------------------------


def _model_of(annotation: Any) -> type[Any] | None:
    from pydantic import BaseModel

    annotation = _strip(annotation)
    return annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None


def _strip(annotation: Any) -> Any:
    """`Annotated[X, ...]` -> X; `X | None` -> X (one arm)."""
    while True:
        origin = typing.get_origin(annotation)
        if origin is typing.Annotated:
            annotation = typing.get_args(annotation)[0]
            continue
        if origin in (typing.Union, types.UnionType):
            arms = [a for a in typing.get_args(annotation) if a is not type(None)]
            if len(arms) == 1:
                annotation = arms[0]
                continue
        return annotation


def _model_field(model: type[Any], step: str, source: str = "json") -> str | None:
    """The Python name of the model field called `step` by name, alias or validation alias."""
    fields: dict[str, Any] = getattr(model, "model_fields", {})
    if step in fields:
        return step
    for name, info in fields.items():
        names = _info_names(info)
        if step in (n.lower() for n in names) if source == "header" else step in names:
            return name
    return None


def _check_path(annotation: Any, steps: tuple[str, ...], part: Part) -> None:
    """Raise Unbindable unless `steps` lead through `annotation` to one scalar value."""
    node = _strip(annotation)
    for i, step in enumerate(steps):
        node = _child(node, step, part, steps[:i])
        if node is _MISSING:
            return   # dynamic from here (Any, a union, a dict of anything): checked per request
    _check_leaf(node, part)


def _child(node: Any, step: str, part: Part, before: tuple[str, ...]) -> Any:
    """The declared type of `node`'s member `step`; _MISSING where only the request can tell."""
    where = ".".join((part.field.split(".")[0], *before)) if before else "the field"
    model = _model_of(node)
    if model is not None:
        return _model_child(model, step, part)
    if dataclasses.is_dataclass(node) and isinstance(node, type):
        hints = typing.get_type_hints(node)
        if step not in hints:
            raise Unbindable(f"{part.text}: {node.__name__} has no field {step!r}")
        return _strip(hints[step])
    if _is_upload(node):
        if step not in FILE_ATTRS:
            raise Unbindable(f"{part.text}: an uploaded file has {', '.join(FILE_ATTRS)}, not {step!r}")
        return {"filename": str, "content_type": str, "size": int}[step]
    return _container_child(node, step, part, where)


def _model_child(model: type[Any], step: str, part: Part) -> Any:
    name = _model_field(model, step)
    if name is None:
        if model.model_config.get("extra") == "allow":
            return _MISSING
        known = ", ".join(_describe(n, i) for n, i in model.model_fields.items())
        raise Unbindable(f"{part.text}: {model.__name__} has no field {step!r} (its fields: {known})")
    info = model.model_fields[name]
    _check_optional(name, info, part)
    return _strip(info.annotation)


def _container_child(node: Any, step: str, part: Part, where: str) -> Any:
    origin = typing.get_origin(node) or node
    if origin in (list, tuple, set, frozenset) or _is_sequence(origin):
        if not step.isdigit():
            raise Unbindable(f"{part.text}: {where} is a list: index it with a number, e.g. .0")
        args = [a for a in typing.get_args(node) if a is not Ellipsis]
        return _strip(args[0]) if len(args) == 1 or (args and origin is not tuple) else _MISSING
    if origin in (dict, typing.Mapping) or _is_mapping(origin):
        pair = typing.get_args(node)
        return _strip(pair[1]) if len(pair) == 2 else _MISSING
    if node in (bytes, decimal.Decimal, uuid.UUID) or _is_scalar_type(node):
        raise Unbindable(f"{part.text}: {where} is a single value, it has no field {step!r}")
    return _MISSING


def _is_upload(node: Any) -> bool:
    from starlette.datastructures import UploadFile

    return isinstance(node, type) and issubclass(node, UploadFile)


def _check_leaf(node: Any, part: Part) -> None:
    if _is_upload(node):
        raise Unbindable(f"{part.text} names an uploaded file: key on its metadata, "
                         f"{{{part.source}.{part.field}.filename}}, .content_type or .size")
    if node is bytes:
        raise Unbindable(f"{part.text} names bytes (a file's content): key on a form field or on a File's "
                         f"metadata (declare it as UploadFile and use {{{part.source}.{part.field}.filename}})")
    model = _model_of(node)
    origin = typing.get_origin(node) or node
    if model is not None or origin in (list, tuple, set, frozenset, dict) or (
            isinstance(origin, type) and dataclasses.is_dataclass(origin)):
        raise Unbindable(f"{part.text} names an object or a list, not one value: name one of its fields "
                         f"(e.g. {{{part.source}.{part.field}.<field>}} or .0 for a list's first item)")


def _is_sequence(origin: Any) -> bool:
    import collections.abc as abc

    return isinstance(origin, type) and issubclass(origin, abc.Sequence) and not issubclass(origin, (str, bytes))


def _is_mapping(origin: Any) -> bool:
    import collections.abc as abc

    return isinstance(origin, type) and issubclass(origin, abc.Mapping)


def _is_scalar_type(node: Any) -> bool:
    return isinstance(node, type) and issubclass(node, (enum.Enum, dt.date, dt.time, str, int, float))


def _describe(name: str, info: Any) -> str:
    aliases = [n for n in _info_names(info) if n != name]
    return f"{name} ({', '.join(aliases)})" if aliases else name


# -- per request: validation and the walk through the validated values -------------------


def _validate_param(field: Any, scope: Scope) -> Any:
    from fastapi.dependencies.utils import request_params_to_args

    source = field.field_info.in_.value
    values, errors = request_params_to_args([field], _mapping(scope, source))
    return INVALID if errors else values.get(field.name)


def _mapping(scope: Scope, source: str) -> Any:
    if source == "path":
        return scope.get("path_params", {})
    if source == "query":
        from starlette.datastructures import QueryParams

        return QueryParams(scope.get("query_string", b""))
    from starlette.datastructures import Headers

    return Headers(scope=scope)


def _json_body(scope: Scope, body: bytes) -> Any:
    """The body as FastAPI hands it to validation: JSON for JSON (or no) content types, else bytes."""
    if not body:
        return None
    content_type = _content_type(scope)
    if content_type:
        main, _, sub = content_type.partition("/")
        if main != "application" or not (sub == "json" or sub.endswith("+json")):
            return body
    try:
        return json.loads(body)
    except (ValueError, RecursionError):
        return INVALID


def _content_type(scope: Scope) -> str:
    for key, value in scope.get("headers", []):
        if key.lower() == b"content-type":
            return str(value.decode("latin-1").split(";")[0].strip().lower())
    return ""


async def _validate_form(fields: list[Any], embed: bool, scope: Scope, body: bytes) -> Any:
    from fastapi.dependencies.utils import request_body_to_args

    try:
        form = await _form(scope, body)
    except Exception:   # a malformed form: FastAPI answers it (400/422)
        return INVALID
    try:
        values, errors = await request_body_to_args(body_fields=fields, received_body=form, embed_body_fields=embed)
        if errors:
            return INVALID
        # Upload metadata is all a key may use; read it before the form's files are closed.
        return {name: _detach(value) for name, value in values.items()}
    finally:
        await form.close()


def _detach(value: Any) -> Any:
    from starlette.datastructures import UploadFile

    if isinstance(value, UploadFile):
        return {"filename": value.filename, "content_type": value.content_type, "size": value.size}
    if isinstance(value, list):
        return [_detach(v) for v in value]
    return value


async def _form(scope: Scope, body: bytes) -> Any:
    from starlette.requests import Request

    sent = False

    async def receive() -> Message:
        nonlocal sent
        chunk, sent = (b"" if sent else body), True
        return {"type": "http.request", "body": chunk, "more_body": False}

    return await Request(scope, receive).form()


def _walk(node: Any, steps: tuple[str, ...]) -> Any:
    for step in steps:
        node = _step(node, step)
        if node is _MISSING:
            break
    return node


def _step(node: Any, step: str) -> Any:
    if node is _MISSING or node is None:
        return _MISSING
    if isinstance(node, Mapping):
        return node.get(step, _MISSING)
    if isinstance(node, (list, tuple)):
        return node[int(step)] if step.isdigit() and int(step) < len(node) else _MISSING
    model_fields = getattr(type(node), "model_fields", None)
    if isinstance(model_fields, dict):
        name = _model_field(type(node), step)
        if name is not None:
            return getattr(node, name, _MISSING)
        extra = getattr(node, "model_extra", None) or {}
        return extra.get(step, _MISSING)
    if step in FILE_ATTRS and hasattr(node, "filename") and hasattr(node, "file"):
        return getattr(node, step)   # an UploadFile passed to a direct call
    if dataclasses.is_dataclass(node):
        return getattr(node, step, _MISSING)
    return _MISSING


def _request_among(arguments: Mapping[str, Any]) -> Any:
    from starlette.requests import Request

    return next((v for v in arguments.values() if isinstance(v, Request)), None)


class _Raw:
    """The raw request values of placeholders the route does not declare."""

    def __init__(self, scope: Scope, body: bytes) -> None:
        self.scope, self.body = scope, body
        self._json: Any = _MISSING
        self._form: Any = _MISSING

    async def value(self, part: Part) -> str:
        if part.source == "json":
            return json_value(self._document(), part)
        if part.source == "form":
            return await self._form_value(part)
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
                raise TemplateValueError("the request body is not valid JSON") from None
        return self._json

    async def _form_value(self, part: Part) -> str:
        if self._form is _MISSING:
            try:
                form = await _form(self.scope, self.body)
            except Exception as error:
                raise TemplateValueError(f"the request body is not a form ({error})") from None
            try:
                self._form = [(key, _detach(value)) for key, value in form.multi_items()]
            finally:
                await form.close()
        steps = part.json_path
        values = [v for k, v in self._form if k == steps[0]]
        return render(_walk(_single(values, f"form field {steps[0]!r}", part), steps[1:]), part)


def _single(values: list[Any], what: str, part: Part) -> Any:
    if not values:
        raise TemplateValueError(f"{what} is missing (needed by {part.text})")
    if len(values) > 1:
        raise TemplateValueError(f"{what} was sent more than once (needed by {part.text})")
    return values[0]
