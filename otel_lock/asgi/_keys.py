"""Key templates: `stock:{path.product_id}` -> `stock:1001`, safely.

A template is parsed once, when the route is annotated, so a typo fails at
import time instead of on the first request. Each value is percent-encoded
outside a small safe set, so no value can introduce `:`, `{`, `}`, `*`,
newlines or unicode into the key; values that are too long become a hash.
Escaped values never contain a separator (a safe-set outsider other than
`%`), and templates must put one between two placeholders: that makes the
mapping from value tuples to keys injective, so no request can forge
another one's key.

A json or form placeholder may walk every element of a list with `*`
(`{json.items.*.sku}`): such a placeholder has many values, and its
template one key per value (`_keyset` expands, folds and bounds them).

A placeholder may end in `?` (`{json.email?}`): the value when the request
has one, else the marker `%n` (no value of a request escapes to it, so every
request without one shares that lock and none can pose as one). It may name
a normaliser after `|` (`{json.email|casefold}`) for apps whose database
treats values as equal that differ in case.

`{cookie.session}` is a cookie's value as the handler reads it;
`{principal}` is the caller the middleware's (or the route's
`@idempotent`) `principal=` names, e.g. from the app's own authentication
dependency: one lock per user without a client-chosen header.
"""

from __future__ import annotations

import decimal
import hashlib
import hmac
import os
import re
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Callable, Iterator

from ._canonical import number_text

SOURCES = ("path", "query", "header", "cookie", "json", "form")
WILDCARD = "*"            # a json/form step that walks every element of a list
PRINCIPAL = "principal"   # `{principal}`: the caller, as the app's `principal=` names it (no field)
MAX_NAME = 512            # the lock core's limit on a lock name
MAX_PART = 64             # escaped values longer than this are hashed
SECRET_ENV = "OTEL_LOCK_HASH_SECRET"

_SAFE = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-._~")
_ALL_SAFE = re.compile(r"[A-Za-z0-9\-._~]{0,%d}" % MAX_PART, re.ASCII)   # the usual value: escaped, it is itself
_PLACEHOLDER = re.compile(r"\{([^{}]*)\}")
_FIELD = re.compile(r"^[A-Za-z0-9_\-]+$")
# "%h"/"%k"/"%n" can never come out of escaping ("h", "k", "n" are not hex digits),
# so a hashed value or an absent one cannot collide with an escaped one.
_HASHED, _KEYED, ABSENT = "%h", "%k", "%n"
# Normalisers a placeholder may name after `|`, applied to the value's canonical text.
NORMALISERS: dict[str, Callable[[str], str]] = {"casefold": str.casefold}


class TemplateValueError(ValueError):
    """A request lacks a value the key template needs, or the value is ill-formed (-> 400)."""


def escape(value: str) -> str:
    """Percent-encode UTF-8 bytes outside the safe set; hash the result if it is too long."""
    if _ALL_SAFE.fullmatch(value):
        return value
    raw = value.encode("utf-8", "surrogatepass")
    out = "".join(chr(b) if b in _SAFE else f"%{b:02X}" for b in raw)
    if len(out) > MAX_PART:
        return _HASHED + hashlib.sha256(raw).hexdigest()[:32]
    return out


def keyed_hash(secret: bytes, value: str) -> str:
    """HMAC of a value for `hash_parts=True`: the raw value never reaches Redis or telemetry."""
    digest = hmac.new(secret, value.encode("utf-8", "surrogatepass"), hashlib.sha256).hexdigest()
    return _KEYED + digest[:32]


def resolve_secret(explicit: str | bytes | None, fallback: str) -> bytes:
    """The HMAC secret: explicit option (middleware, then manager), else $OTEL_LOCK_HASH_SECRET, else a salt.

    The fallback must be the same on every replica (a random one would give
    each replica different keys for one value, and no exclusion), so it is
    derived from the namespace: values are still not readable, but low-entropy
    values (phone numbers) can be guessed. Set a secret when keys carry PII.
    """
    secret = explicit if explicit is not None else os.environ.get(SECRET_ENV)
    if secret is None:
        secret = "otel-lock:" + fallback
    return secret.encode() if isinstance(secret, str) else bytes(secret)


@dataclass(frozen=True)
class Part:
    """One `{source.field}` placeholder of a key template."""

    source: str             # path, query, header, cookie, json, form, principal
    field: str              # path param, query name, lower-case header name, cookie name, dotted json/form
                            # path; "" for principal
    text: str               # the placeholder as written, for error messages
    optional: bool = False  # `{json.email?}`: an absent value renders ABSENT instead of failing
    normalisers: tuple[str, ...] = ()   # `{json.email|casefold}`, applied in order

    def normalise(self, value: str) -> str:
        for name in self.normalisers:
            value = NORMALISERS[name](value)
        return value

    # Read on every request: computed once (a part never changes).
    @cached_property
    def json_path(self) -> tuple[str, ...]:
        return tuple(self.field.split("."))

    @cached_property
    def many(self) -> bool:
        """`{json.items.*.sku}`: one value per element of a list."""
        return WILDCARD in self.json_path

    @cached_property
    def _hash(self) -> int:
        return hash((self.source, self.field, self.text, self.optional, self.normalisers))

    def __hash__(self) -> int:   # a part keys the request's values: hashed once, not per lookup
        return self._hash


@dataclass(frozen=True)
class KeyTemplate:
    """A parsed template: literal pieces around placeholders, ready to render."""

    template: str
    literals: tuple[str, ...]     # len(parts) + 1 pieces
    parts: tuple[Part, ...]

    @property
    def needs_body(self) -> bool:
        return any(p.source in ("json", "form") for p in self.parts)

    def render(self, lookup: Callable[[Part], str | None], secret: bytes | None = None) -> str:
        """Build the lock name; `lookup` gives None for an absent optional value, raises TemplateValueError
        for an absent required one."""
        out = [self.literals[0]]
        for part, literal in zip(self.parts, self.literals[1:]):
            value = lookup(part)
            if value is None:
                out.append(ABSENT)
            else:
                value = part.normalise(value)
                out.append(keyed_hash(secret, value) if secret is not None else escape(value))
            out.append(literal)
        return "".join(out)


def parse_template(template: str) -> KeyTemplate:
    """Parse `prefix:{source.field}:...`; raises ValueError naming what is wrong."""
    if not isinstance(template, str) or not template:
        raise ValueError("lock key template must be a non-empty string")
    literals: list[str] = []
    parts: list[Part] = []
    pos = 0
    for m in _PLACEHOLDER.finditer(template):
        literals.append(template[pos:m.start()])
        parts.append(_parse_part(template, m.group(1), m.group(0)))
        pos = m.end()
    literals.append(template[pos:])
    for literal in literals:
        _check_literal(template, literal)
    for i, literal in enumerate(literals[1:-1], start=1):
        if not any(ch not in _SAFE_STR and ch != "%" for ch in literal):
            raise ValueError(
                f"lock key template {template!r}: {parts[i - 1].text} and {parts[i].text} must be "
                f"separated by a delimiter such as ':' (otherwise two values could run together)"
            )
    worst = sum(len(x) for x in literals) + len(parts) * MAX_PART
    if worst > MAX_NAME:
        raise ValueError(f"lock key template {template!r} can produce names longer than {MAX_NAME} characters")
    return KeyTemplate(template, tuple(literals), tuple(parts))


_SAFE_STR = frozenset(chr(b) for b in _SAFE)


def _parse_part(template: str, inner: str, text: str) -> Part:
    inner, *normalisers = inner.split("|")
    unknown = [n for n in normalisers if n not in NORMALISERS]
    if unknown:
        raise ValueError(f"lock key template {template!r}: {text} names an unknown normaliser {unknown[0]!r} "
                         f"(known: {', '.join(NORMALISERS)})")
    optional = inner.endswith("?")
    inner = inner.removesuffix("?")
    if inner == PRINCIPAL:
        return Part(PRINCIPAL, "", text, optional, tuple(normalisers))
    source, dot, field = inner.partition(".")
    if not dot or source not in SOURCES:
        raise ValueError(
            f"lock key template {template!r}: placeholder {text} must be one of "
            + ", ".join(f"{{{s}.NAME}}" for s in SOURCES) + " or {principal}"
        )
    names = field.split(".") if source in ("json", "form") else [field]
    # `*` walks a list: `{json.*.sku}` a body that is one, `{form.tags.*}` a field sent several times.
    if not all(_FIELD.match(n) or (n == WILDCARD and (i > 0 or source == "json")) for i, n in enumerate(names)):
        raise ValueError(f"lock key template {template!r}: {text} names an empty or ill-formed field"
                         + (" ('*' walks a list: write it after the list's field, e.g. {json.items.*.sku})"
                            if WILDCARD in field else ""))
    if source == "header":
        field = field.lower()
    return Part(source, field, text, optional, tuple(normalisers))


def _check_literal(template: str, literal: str) -> None:
    if "{" in literal or "}" in literal:
        raise ValueError(f"lock key template {template!r} has an unbalanced '{{' or '}}'")
    if any(not (0x20 < ord(ch) < 0x7F) for ch in literal):
        raise ValueError(f"lock key template {template!r}: literal text must be printable ASCII without spaces")
    if "*" in literal:
        # Not a forgery risk, but `otel-lock locks` and SCAN patterns treat '*' specially.
        raise ValueError(f"lock key template {template!r} must not contain '*'")


def json_value(body: Any, part: Part) -> str | None:
    """Walk a dotted path through a decoded JSON body; scalars only, numbers canonical (RFC 8785).

    None: the field is absent or null and the placeholder is optional.
    """
    return _json_text(_json_walk(body, part.json_path, part), part)


def json_values(body: Any, part: Part) -> Iterator[str | None]:
    """Every value of a `{json.items.*.sku}` placeholder, in the body's order.

    An absent or null list is no values when the placeholder is optional
    (`{json.items.*.sku?}`), else a 400; anything but a list where `*` stands
    is a 400 naming the field.
    """
    nodes: list[Any] = [body]
    path = part.json_path
    start = 0
    for i, step in enumerate(path):
        if step != WILDCARD:
            continue
        lists = [_json_walk(node, path[start:i], part, path[:start]) for node in nodes]
        nodes = []
        for found in lists:
            if found is None:
                continue   # optional and absent: no elements
            if not isinstance(found, list):
                raise TemplateValueError(f"JSON field {'.'.join(path[:i])!r} must be a list (needed by {part.text})")
            nodes.extend(found)
        start = i + 1
    return (_json_text(_json_walk(node, path[start:], part, path[:start]), part) for node in nodes)


def _json_walk(node: Any, steps: tuple[str, ...], part: Part, before: tuple[str, ...] = ()) -> Any:
    """The node at `steps`; None for an absent one of an optional placeholder."""
    for step in steps:
        if isinstance(node, dict) and step in node:
            node = node[step]
        elif isinstance(node, list) and step.isdigit() and int(step) < len(node):
            node = node[int(step)]
        elif part.optional:
            return None
        else:
            raise TemplateValueError(f"JSON body has no field {part.field!r} (needed by {part.text})")
    if node is None and not part.optional:
        where = ".".join((*before, *steps)) if part.many else part.field
        raise TemplateValueError(f"JSON field {where!r} is null (needed by {part.text})")
    return node


def _json_text(node: Any, part: Part) -> str | None:
    if node is None:
        return None
    if isinstance(node, bool):
        return "true" if node else "false"
    if isinstance(node, str):
        return node
    if isinstance(node, (int, float, decimal.Decimal)):
        return number_text(node)
    raise TemplateValueError(f"JSON field {part.field!r} must be a string or a number (needed by {part.text})")
