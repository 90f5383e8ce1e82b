"""One text per value: the canonical forms lock keys and idempotency fingerprints share.

Two spellings the handler cannot tell apart must give one key and one
fingerprint. Numbers follow RFC 8785 (JSON Canonicalization Scheme): `7`,
`7.0`, `7.00` and `70e-1` are all `7`, laid out by ECMAScript's
Number-to-String rules (`1e+21`, `1.5e-7`). One deliberate difference: a
number is taken as the exact decimal it spells, never rounded to a double,
so integers beyond 2**53 keep every digit (`9007199254740993` stays itself)
and two values only a double would merge stay two. Aware datetimes and times
are written in UTC (`09:00Z` and `10:00+01:00` are one instant); a naive
one has no zone to convert from and is written as given.
"""

from __future__ import annotations

import datetime as dt
import decimal
import enum
import ipaddress
import json
import typing
import uuid
from typing import Any

_UTC = dt.timezone.utc


class NotCanonical(ValueError):
    """A value of a type with no canonical text."""


def number_text(value: int | float | decimal.Decimal) -> str:
    """The RFC 8785 text of a number, exact: `7.0` -> `7`, `1E2` -> `100`, `0.000001` -> `0.000001`.

    A float that JSON cannot carry (inf, NaN: a float field accepts `1e400`)
    gets ECMAScript's text for it, `Infinity`, `-Infinity`, `NaN`.
    """
    if isinstance(value, float):
        number = decimal.Decimal(repr(value))      # the shortest digits that round-trip, as ECMAScript uses
    elif isinstance(value, int):
        return str(value) if abs(value) < 10**21 else number_text(decimal.Decimal(value))
    else:
        number = value
    if not number.is_finite():
        # Not JSON, but a float field accepts `1e400` as inf: ECMAScript's text, not a 400 to the client.
        return "NaN" if number.is_nan() else "-Infinity" if number.is_signed() else "Infinity"
    if number.is_zero():
        return "0"                                   # -0 too, as RFC 8785 says
    sign, digit_tuple, exponent = number.as_tuple()
    assert isinstance(exponent, int)
    digits = "".join(map(str, digit_tuple))
    trimmed = digits.rstrip("0")                     # 7.00 is 7: the same value, fewer digits
    exponent += len(digits) - len(trimmed)
    digits = trimmed
    k = len(digits)
    n = k + exponent                                 # value = 0.digits * 10**n
    minus = "-" if sign else ""
    if k <= n <= 21:
        return minus + digits + "0" * (n - k)
    if 0 < n <= 21:
        return minus + digits[:n] + "." + digits[n:]
    if -6 < n <= 0:
        return minus + "0." + "0" * -n + digits
    mantissa = digits if k == 1 else digits[0] + "." + digits[1:]
    return f"{minus}{mantissa}e{'+' if n - 1 >= 0 else '-'}{abs(n - 1)}"


def datetime_text(value: dt.datetime) -> str:
    """ISO 8601; an aware value in UTC with `Z`, so one instant has one text."""
    if value.utcoffset() is None:
        return value.isoformat()
    return value.astimezone(_UTC).replace(tzinfo=None).isoformat() + "Z"


def time_text(value: dt.time) -> str:
    """ISO 8601; a time with a fixed offset in UTC with `Z` (`10:00+01:00` -> `09:00:00Z`)."""
    offset = value.utcoffset()
    if offset is None:
        return value.isoformat()
    moment = dt.datetime.combine(dt.date(2000, 1, 3), value.replace(tzinfo=None)) - offset
    return moment.time().isoformat() + "Z"


def timedelta_text(value: dt.timedelta) -> str:
    """A duration as its number of seconds (`PT1H`, `3600` and `01:00:00` are all `3600`)."""
    seconds = decimal.Decimal(value.days * 86400 + value.seconds) + decimal.Decimal(value.microseconds) / 10**6
    return number_text(seconds)


_IP = (ipaddress.IPv4Address, ipaddress.IPv6Address, ipaddress.IPv4Network, ipaddress.IPv6Network,
       ipaddress.IPv4Interface, ipaddress.IPv6Interface)
_NUMBERS = (int, float, decimal.Decimal)


def scalar_text(value: Any) -> str:
    """The canonical text of one validated value; NotCanonical for a value of no scalar type."""
    if isinstance(value, enum.Enum):
        value = value.value
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return str(value)                            # an EmailStr, a constrained str: a str
    if isinstance(value, _NUMBERS):
        return number_text(value)
    if isinstance(value, dt.datetime):
        return datetime_text(value)
    if isinstance(value, dt.date):
        return value.isoformat()
    if isinstance(value, dt.time):
        return time_text(value)
    if isinstance(value, dt.timedelta):
        return timedelta_text(value)
    if isinstance(value, (uuid.UUID, *_IP)) or _is_url(type(value)):
        return str(value)                            # already canonical: lower-case hex, compressed IPv6, Pydantic's URL
    raise NotCanonical(f"a {type(value).__name__} has no canonical text")


# Pydantic's marker types whose validated values are standard ones.
_PYDANTIC_SCALARS = ("EmailStr", "IPvAnyAddress", "IPvAnyInterface", "IPvAnyNetwork", "AwareDatetime",
                     "NaiveDatetime", "PastDatetime", "FutureDatetime", "PastDate", "FutureDate")
_SCALAR_TYPES = (str, bool, *_NUMBERS, dt.date, dt.time, dt.timedelta, uuid.UUID, enum.Enum, *_IP)


def scalar_type(annotation: Any) -> bool | None:
    """True: values of this declared type render canonically; False: they cannot; None: only a value can tell."""
    if annotation is Any or annotation is object:
        return None
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        return all(isinstance(v, (*_SCALAR_TYPES, type(None))) for v in typing.get_args(annotation))
    if origin is typing.Annotated:
        return scalar_type(typing.get_args(annotation)[0])
    if not isinstance(annotation, type):
        return None
    if issubclass(annotation, _SCALAR_TYPES) or _is_url(annotation):
        return True
    module = getattr(annotation, "__module__", "")
    return annotation.__name__ in _PYDANTIC_SCALARS and module.startswith("pydantic") or False


def _is_url(cls: type) -> bool:
    return any(base.__name__ in ("_BaseUrl", "Url", "_BaseMultiHostUrl", "MultiHostUrl")
               and base.__module__.startswith(("pydantic", "pydantic_core")) for base in cls.__mro__)


def _refuse(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def loads(body: bytes | str) -> Any:
    """Decode JSON keeping every number exact (Decimal for fractions); NaN and infinities refused."""
    return json.loads(body, parse_float=decimal.Decimal, parse_constant=_refuse)


def loads_as_handler(body: bytes | str) -> Any:
    """Decode JSON as a handler's `request.json()` has it: fractions as floats (7.0000000000000001 is 7.0,
    one resource for it, so one key), integers exact; NaN and infinities refused."""
    return json.loads(body, parse_constant=_refuse)


def dumps(document: Any) -> str:
    """RFC 8785 text of a decoded document: keys sorted by UTF-16 code units, no whitespace, numbers canonical."""
    if isinstance(document, dict):
        items = sorted(document.items(), key=lambda item: item[0].encode("utf-16-be"))
        return "{" + ",".join(_string(k) + ":" + dumps(v) for k, v in items) + "}"
    if isinstance(document, list):
        return "[" + ",".join(dumps(v) for v in document) + "]"
    if isinstance(document, str):
        return _string(document)
    if document is None or isinstance(document, bool):
        return json.dumps(document)
    if isinstance(document, (int, float, decimal.Decimal)):
        return number_text(document)
    raise NotCanonical(f"{type(document).__name__} is not a JSON value")


def _string(text: str) -> str:
    # RFC 8785 escapes only what JSON requires; ensure_ascii=False keeps the rest as is.
    # Lone surrogates (from \\ud800 escapes) survive as escapes, so two different strings stay two.
    return json.dumps(text, ensure_ascii=False)
