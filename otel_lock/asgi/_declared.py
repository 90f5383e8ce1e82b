"""The declared types a key's placeholders walk through, checked at start-up.

`check_path` follows a placeholder's steps through a FastAPI field's
annotation (models by any name of their fields, lists by index, dicts by
key, an upload's metadata) and raises `Unbindable` unless they end at one
value of a type with a canonical text (`_canonical.scalar_type`); where
only the request can tell (`Any`, a union of models, a model that allows
extra fields) it stops checking. A value that may be absent (a default of
None, a JSON field that may be null) needs an optional placeholder,
`{json.email?}`.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import decimal
import enum
import types
import typing
import uuid
from typing import Any

from ._canonical import scalar_type
from ._keys import WILDCARD, Part

MISSING: Any = object()
FILE_ATTRS = ("filename", "content_type", "size")


class Unbindable(ValueError):
    """A placeholder names nothing the handler can receive as one value (a start-up error)."""


def info_names(info: Any) -> list[str]:
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


def check_optional(name: str, info: Any, part: Part) -> None:
    """Unbindable if the value may be absent (default None, or null in JSON) and the placeholder is not `?`."""
    if part.optional:
        return
    required = info.is_required() if hasattr(info, "is_required") else True
    why = None
    if not required and getattr(info, "default", None) is None and getattr(info, "default_factory", None) is None:
        why = "its default is None"
    elif part.source == "json" and _nullable(getattr(info, "annotation", None)):
        why = "it may be null"
    if why is not None:
        marked = part.text[:-1].split("|")[0] + "?" + "".join("|" + n for n in part.normalisers) + "}"
        raise Unbindable(f"{part.text} names {name!r}, which may have no value ({why}): write {marked} to lock "
                         f"on it when there is one (requests without it share one lock), or make it required")


def _nullable(annotation: Any) -> bool:
    while typing.get_origin(annotation) is typing.Annotated:
        annotation = typing.get_args(annotation)[0]
    if annotation is None or annotation is type(None):
        return True
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return any(_nullable(a) for a in typing.get_args(annotation))
    return False



def model_of(annotation: Any) -> type[Any] | None:
    from pydantic import BaseModel

    annotation = strip(annotation)
    return annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None


def strip(annotation: Any) -> Any:
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


def model_field(model: type[Any], step: str, source: str = "json") -> str | None:
    """The Python name of the model field called `step` by name, alias or validation alias."""
    fields: dict[str, Any] = getattr(model, "model_fields", {})
    if step in fields:
        return step
    for name, info in fields.items():
        names = info_names(info)
        if step in (n.lower() for n in names) if source == "header" else step in names:
            return name
    return None


def check_path(annotation: Any, steps: tuple[str, ...], part: Part) -> None:
    """Raise Unbindable unless `steps` lead through `annotation` to one scalar value."""
    node = strip(annotation)
    for i, step in enumerate(steps):
        node = _child(node, step, part, steps[:i])
        if node is MISSING:
            return   # dynamic from here (Any, a union, a dict of anything): checked per request
    _check_leaf(node, part)


def _child(node: Any, step: str, part: Part, before: tuple[str, ...]) -> Any:
    """The declared type of `node`'s member `step`; MISSING where only the request can tell."""
    where = ".".join((part.field.split(".")[0], *before)) if before else "the field"
    if step == WILDCARD:
        return _elements(node, part, before[-1] if before else part.field.split(".")[0])
    model = model_of(node)
    if model is not None:
        return _model_child(model, step, part)
    if dataclasses.is_dataclass(node) and isinstance(node, type):
        hints = typing.get_type_hints(node)
        if step not in hints:
            raise Unbindable(f"{part.text}: {node.__name__} has no field {step!r}")
        return strip(hints[step])
    if _is_upload(node):
        if step not in FILE_ATTRS:
            raise Unbindable(f"{part.text}: an uploaded file has {', '.join(FILE_ATTRS)}, not {step!r}")
        return {"filename": str, "content_type": str, "size": int}[step]
    return _container_child(node, step, part, where)


def _model_child(model: type[Any], step: str, part: Part) -> Any:
    name = model_field(model, step)
    if name is None:
        if model.model_config.get("extra") == "allow":
            return MISSING
        known = ", ".join(_describe(n, i) for n, i in model.model_fields.items())
        raise Unbindable(f"{part.text}: {model.__name__} has no field {step!r} (its fields: {known})")
    info = model.model_fields[name]
    check_optional(name, info, part)
    return strip(info.annotation)


def _container_child(node: Any, step: str, part: Part, where: str) -> Any:
    origin = typing.get_origin(node) or node
    if origin in (list, tuple, set, frozenset) or _is_sequence(origin):
        if not step.isdigit():
            raise Unbindable(f"{part.text}: {where} is a list: index it with a number, e.g. .0")
        args = [a for a in typing.get_args(node) if a is not Ellipsis]
        return strip(args[0]) if len(args) == 1 or (args and origin is not tuple) else MISSING
    if origin in (dict, typing.Mapping) or _is_mapping(origin):
        pair = typing.get_args(node)
        return strip(pair[1]) if len(pair) == 2 else MISSING
    if node in (bytes, decimal.Decimal, uuid.UUID) or _is_scalar_type(node):
        raise Unbindable(f"{part.text}: {where} is a single value, it has no field {step!r}")
    return MISSING


def _elements(node: Any, part: Part, where: str) -> Any:
    """The declared type of a list's elements, for a `*` step; Unbindable if it is not a list."""
    origin = typing.get_origin(node) or node
    if origin in (list, tuple, set, frozenset) or _is_sequence(origin):
        args = [a for a in typing.get_args(node) if a is not Ellipsis]
        return strip(args[0]) if len(args) == 1 or (args and origin is not tuple) else MISSING
    if node is Any or node is object or typing.get_origin(node) in (typing.Union, types.UnionType):
        return MISSING   # only the request can tell
    name = getattr(node, "__name__", None) or repr(node)
    raise Unbindable(f"{part.text}: '*' walks a list, but {where} is declared as {name}")


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
    model = model_of(node)
    origin = typing.get_origin(node) or node
    if model is not None or origin in (list, tuple, set, frozenset, dict) or (
            isinstance(origin, type) and dataclasses.is_dataclass(origin)):
        if part.source not in ("json", "form"):  # only a body's values take steps (.field, .0, .*)
            raise Unbindable(f"{part.text} names a {part.source} parameter that is a list or an object, not one "
                             "value, and a key part is one value: take the locks in the handler "
                             "(`async with locks.lock_all([f\"item:{i}\" for i in ids])`), or send the values "
                             "in a JSON body and name each one ({json.ids.*})")
        raise Unbindable(f"{part.text} names an object or a list, not one value: name one of its fields "
                         f"(e.g. {{{part.source}.{part.field}.<field>}} or .0 for a list's first item)")
    arms = [a for a in typing.get_args(node) if a is not type(None)] \
        if typing.get_origin(node) in (typing.Union, types.UnionType) else [node]
    for arm in arms:
        if model_of(arm) is None and scalar_type(strip(arm)) is False:
            raise Unbindable(_unrenderable(strip(arm), part))


def _unrenderable(node: Any, part: Part) -> str:
    name = getattr(node, "__name__", None) or repr(node)
    if name in ("SecretStr", "SecretBytes"):
        return (f"{part.text} names a secret ({name}): a lock key is written to Redis, logs and telemetry; key on "
                f"another field, or declare it as str and set hash_parts=True")
    if name == "NameEmail":
        return f"{part.text} names a NameEmail: declare the field as EmailStr (or str) to key on the address"
    return (f"{part.text} names a {name} value, which has no canonical text in a lock key: declare it as str, int, "
            f"Decimal, UUID, a date or time, an Enum or a Literal, or key on one of its fields")


def _is_sequence(origin: Any) -> bool:
    import collections.abc as abc

    return isinstance(origin, type) and issubclass(origin, abc.Sequence) and not issubclass(origin, (str, bytes))


def _is_mapping(origin: Any) -> bool:
    import collections.abc as abc

    return isinstance(origin, type) and issubclass(origin, abc.Mapping)


def _is_scalar_type(node: Any) -> bool:
    return isinstance(node, type) and issubclass(node, (enum.Enum, dt.date, dt.time, str, int, float))


def _describe(name: str, info: Any) -> str:
    aliases = [n for n in info_names(info) if n != name]
    return f"{name} ({', '.join(aliases)})" if aliases else name
