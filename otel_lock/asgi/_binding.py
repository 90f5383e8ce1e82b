"""Key values as the handler receives them, for every way FastAPI and Pydantic bind them.

At start-up each placeholder of a route's template is tied to what the
handler gets (`RouteBinding`), or the start-up fails naming the route and
the fix (`Unbindable`):

- a declared path, query, header or cookie parameter, by any name it is bound with
  (its alias, `validation_alias`, each of its `AliasChoices`, its Python
  name), or a field of a parameter model;
- a field of the declared JSON body, `{json.a.b}`, through models by any
  name of their fields, lists by index, dicts by key;
- a field of the declared form, `{form.name}`, and an upload's metadata,
  `{form.upload.filename}`, `.content_type`, `.size`;
- anything the route does not declare (and every placeholder of a Starlette
  route): the raw request value;
- `{principal}`: the caller the middleware resolved for this request.

Per request, declared values go through FastAPI's own validation
(`request_params_to_args`, `request_body_to_args`), so `{"pid": "07"}`,
`{"pid": 7}` and `{"productId": 7}` are the one int 7 the handler sees. A
value FastAPI would reject is `INVALID`: the request is not locked and
FastAPI answers its own 422. The same binding reads the values from a
handler's arguments when it is called directly (`call_values`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Mapping

from ._declared import MISSING, Unbindable, check_optional, check_path, info_names, model_field, model_of
from ._keys import PRINCIPAL, Part, TemplateValueError
from ._keyset import KeySet, Value
from ._values import RawValues, detach, parse_form, principal_value, render, render_each, walk, walk_each
from ._types import Scope

__all__ = ["INVALID", "RouteBinding", "Unbindable", "Unrenderable", "render"]

INVALID: Any = object()   # the framework will answer 422: do not lock


class Unrenderable(ValueError):
    """A direct call of a guarded handler: its arguments do not carry every value of the key."""


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

    def __init__(self, template: KeySet, dependant: Any = None, embed: bool = False,
                 json_without_content_type: bool = True, form_limits: Mapping[str, int] | None = None) -> None:
        self.template = template
        self.json_without_content_type = json_without_content_type  # as the route's FastAPI reads a body
        self.form_limits: Mapping[str, int] = form_limits or {}     # the route's own, over the app's and routers'
        own = _Declared(dependant, top_only=True) if dependant is not None else None
        declared = _Declared(dependant) if dependant is not None else None
        self.body_fields: list[Any] = declared.body if declared is not None else []
        self.embed = embed or _embedded(self.body_fields)
        self.form = any(_is_form(f) for f in self.body_fields)
        self.request_argument: str | None = getattr(dependant, "request_param_name", None)
        self.bounds = tuple(self._bind(part, declared, own) for part in template.parts)

    # -- start-up -------------------------------------------------------------

    def _bind(self, part: Part, declared: _Declared | None, own: _Declared | None) -> Bound:
        if declared is None or part.source == PRINCIPAL:
            return Bound(part)
        if part.source in ("path", "query", "header", "cookie"):
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
                names = ", ".join(sorted(param_names(f, "json")[0] for f in self.body_fields))
                raise Unbindable(f"{part.text}: the route's body has no field {steps[0]!r} (its fields: {names})")
            steps.pop(0)
        check_optional(field.name, field.field_info, part)
        check_path(_annotation(field), tuple(steps), part)
        argument = field.name if own is not None and any(f is field for f in own.body) else None
        return Bound(part, field, body=True, steps=tuple(steps), argument=argument)

    def call_problem(self) -> str | None:
        """Why the key cannot be read from the handler's arguments (None: it can)."""
        if self.request_argument is not None:
            return None
        missing = [b.part.text for b in self.bounds if b.argument is None and b.part.source != PRINCIPAL]
        if not missing:
            return None
        return (f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not among the handler's own "
                f"parameters: declare {'it' if len(missing) == 1 else 'them'} as parameters of the handler, or "
                f"add a `request: Request` parameter")

    # -- per request ------------------------------------------------------------

    async def request_values(self, scope: Scope, body: bytes) -> dict[Part, Value] | Any:
        """The rendered values, or INVALID; raises TemplateValueError (400) for absent raw values."""
        found: dict[Part, Value] = {}
        validated: Any = MISSING
        raw = RawValues(scope, body)
        for bound in self.bounds:
            if bound.field is None:
                found[bound.part] = await raw.value(bound.part)
                continue
            if bound.body:
                if validated is MISSING:
                    validated = await self._validate_body(scope, body)
                if validated is INVALID:
                    return INVALID
                value = validated.get(bound.field.name, MISSING)
            else:
                value = _validate_param(bound.field, scope)
                if value is INVALID:
                    return INVALID
            found[bound.part] = _rendered(value, bound)
        return found

    async def call_values(self, arguments: Mapping[str, Any]) -> dict[Part, Value]:
        """The rendered values from a handler's arguments; raises Unrenderable if they lack one."""
        if all(b.part.source == PRINCIPAL or b.argument is not None and b.argument in arguments for b in self.bounds):
            return {b.part: principal_value(b.part) if b.part.source == PRINCIPAL
                    else _rendered(arguments[b.argument or ""], b) for b in self.bounds}
        request = _request_among(arguments)
        if request is None:
            raise Unrenderable(self.call_problem() or "the handler's arguments do not carry the key's values")
        body = await request.body() if any(p.source in ("json", "form") for p in self.template.parts) else b""
        values = await self.request_values(request.scope, body)
        if values is INVALID:
            raise TemplateValueError("a value of the lock key is not valid for the handler's declared types")
        result: dict[Part, Value] = values
        return result

    async def _validate_body(self, scope: Scope, body: bytes) -> Any:
        from fastapi.dependencies.utils import request_body_to_args

        if self.form:
            return await _validate_form(self.body_fields, self.embed, scope, body,
                                        _form_limits(scope, self.form_limits))
        document = _json_body(scope, body, self.json_without_content_type)
        if document is INVALID:
            return INVALID
        values, errors = await request_body_to_args(body_fields=self.body_fields, received_body=document,
                                                    embed_body_fields=self.embed)
        return INVALID if errors else values


def _rendered(value: Any, bound: Bound) -> Value:
    """The text of a validated value at the placeholder's steps (one per element for `*`)."""
    if bound.part.many:
        return render_each(walk_each(value, bound.steps, bound.part), bound.part)
    return render(walk(value, bound.steps), bound.part)


# -- what a FastAPI route declares ---------------------------------------------------


class _Declared:
    """The declared fields of a dependant (and its sub-dependencies unless top_only)."""

    def __init__(self, dependant: Any, top_only: bool = False) -> None:
        self.params: dict[str, list[Any]] = {"path": [], "query": [], "header": [], "cookie": []}
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
            self.params["cookie"].extend(current.cookie_params)
            self.body.extend(f for f in current.body_params if all(f is not b for b in self.body))
            if not top_only:
                stack.extend(current.dependencies)


def _bind_param(part: Part, declared: _Declared, own: _Declared | None) -> Bound:
    for field in declared.params[part.source]:
        model = model_of(_annotation(field))
        if model is not None:
            # A parameter model (`Annotated[Filters, Query()]`): the placeholder names one of its fields.
            name = model_field(model, part.field, part.source)
            if name is None:
                continue
            steps: tuple[str, ...] = (name,)
            info = model.model_fields[name]
            check_optional(name, info, part)
            check_path(info.annotation, (), part)
        elif part.field in param_names(field, part.source):
            steps = ()
            check_optional(field.name, field.field_info, part)
            check_path(_annotation(field), steps, part)   # one value, not a list of them
        else:
            continue
        argument = field.name if own is not None and any(f is field for f in own.params[part.source]) else None
        return Bound(part, field, steps=steps, argument=argument)
    return Bound(part)   # not declared: the raw request value (the handler may read it from `request`)


def param_names(field: Any, source: str) -> list[str]:
    """Every name a client may send for a field, then its Python name (header names lower-cased)."""
    info = field.field_info
    names = [field.alias or field.name]
    names += info_names(info)
    if source == "header" and getattr(info, "convert_underscores", True):
        names += [n.replace("_", "-") for n in names]
    names.append(field.name)
    if source == "header":
        names = [n.lower() for n in names]
    return list(dict.fromkeys(names))


def _field_named(fields: list[Any], step: str, source: str) -> Any:
    by_name = [f for f in fields if f.name == step]
    if by_name:
        return by_name[0]
    return next((f for f in fields if step in param_names(f, source)), None)


def _is_form(field: Any) -> bool:
    from fastapi import params

    return isinstance(field.field_info, params.Form)


def _embedded(fields: list[Any]) -> bool:
    if len({f.name for f in fields}) > 1:
        return True
    if not fields:
        return False
    info = fields[0].field_info
    return bool(getattr(info, "embed", False)) or (_is_form(fields[0]) and model_of(_annotation(fields[0])) is None)


def _annotation(field: Any) -> Any:
    return getattr(field.field_info, "annotation", None)


# -- per request: validation and the walk through the validated values -------------------


def _validate_param(field: Any, scope: Scope) -> Any:
    from fastapi.dependencies.utils import request_params_to_args

    source = field.field_info.in_.value
    if source == "path":
        # The router matched it, so it is there under its alias: FastAPI's own steps for a value
        # that is present come down to this one call (6% of a `@locked` request's instructions, measured).
        value = scope.get("path_params", {}).get(field.alias)
        if isinstance(value, str):
            validated, errors = field.validate(value, {}, loc=("path", field.alias))
            return INVALID if errors else validated
    values, errors = request_params_to_args([field], _mapping(scope, source))
    return INVALID if errors else values.get(field.name)


def _mapping(scope: Scope, source: str) -> Any:
    if source == "path":
        return scope.get("path_params", {})
    if source == "query":
        from starlette.datastructures import QueryParams

        return QueryParams(scope.get("query_string", b""))
    if source == "cookie":
        from starlette.requests import HTTPConnection

        return HTTPConnection(scope).cookies
    from starlette.datastructures import Headers

    return Headers(scope=scope)


def _json_body(scope: Scope, body: bytes, without_content_type: bool = True) -> Any:
    """The body as FastAPI hands it to validation: JSON for JSON content types (and none, unless the route is
    strict about it: FastAPI's `strict_content_type`, on by default), else bytes, which FastAPI answers 422."""
    if not body:
        return None
    content_type = _content_type(scope)
    if not content_type and not without_content_type:
        return body
    if content_type:
        main, _, sub = content_type.partition("/")
        if main != "application" or not (sub == "json" or sub.endswith("+json")):
            return body
    try:
        return json.loads(body)
    except (ValueError, RecursionError):
        return INVALID


def json_without_content_type(route: Any) -> bool:
    """Does this FastAPI route read a body sent without Content-Type as JSON? Not when `strict_content_type`
    (FastAPI's default since it has the setting); always before it."""
    strict = getattr(route, "strict_content_type", None)
    if strict is None:
        return True
    return not bool(getattr(strict, "value", strict))  # a DefaultPlaceholder holds its value


def _content_type(scope: Scope) -> str:
    for key, value in scope.get("headers", []):
        if key.lower() == b"content-type":
            return str(value.decode("latin-1").split(";")[0].strip().lower())
    return ""


def form_limits(route: Any) -> Mapping[str, int]:
    """A FastAPI route's own form limits (`form_limits=` on the route); none on FastAPIs without them."""
    limits = getattr(route, "form_limits", None)
    return dict(limits) if isinstance(limits, Mapping) else {}


def _form_limits(scope: Scope, own: Mapping[str, int]) -> Mapping[str, int]:
    """The limits FastAPI parses this request's form with: the app's and routers' (which their routing put
    in `scope["fastapi"]["form_limits"]`), the route's own over them. Parsed with Starlette's defaults
    instead, a form FastAPI accepts (1,500 fields where the app allows 5,000) was judged invalid, left
    unlocked, and its handler refused to run (500 lock-binding-mismatch)."""
    fastapi_scope = scope.get("fastapi")
    inherited = fastapi_scope.get("form_limits") if isinstance(fastapi_scope, dict) else None
    return {**(inherited if isinstance(inherited, Mapping) else {}), **own}


async def _validate_form(fields: list[Any], embed: bool, scope: Scope, body: bytes,
                         limits: Mapping[str, int]) -> Any:
    from fastapi.dependencies.utils import request_body_to_args

    try:
        form = await parse_form(scope, body, limits)
    except Exception:   # a malformed form: FastAPI answers it (400/422)
        return INVALID
    try:
        values, errors = await request_body_to_args(body_fields=fields, received_body=form, embed_body_fields=embed)
        if errors:
            return INVALID
        # Upload metadata is all a key may use; read it before the form's files are closed.
        return {name: detach(value) for name, value in values.items()}
    finally:
        await form.close()


def _request_among(arguments: Mapping[str, Any]) -> Any:
    from starlette.requests import Request

    return next((v for v in arguments.values() if isinstance(v, Request)), None)

