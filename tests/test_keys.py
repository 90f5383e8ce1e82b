"""Key templates: parsing at decoration time, escaping, hashing, no forged keys."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from otel_lock import locked
from otel_lock.asgi._keys import MAX_NAME, MAX_PART, Part, TemplateValueError, escape, json_value, parse_template

SECRET = b"test-secret"


def render(template: str, values: dict[str, str], secret: bytes | None = None) -> str:
    return parse_template(template).render(lambda part: values[f"{part.source}.{part.field}"], secret)


@pytest.mark.parametrize("template, message", [
    ("", "non-empty"),
    ("stock:{product_id}", "must be one of"),
    ("stock:{body.id}", "must be one of"),
    ("stock:{path.}", "ill-formed"),
    ("stock:{json.a..b}", "ill-formed"),
    ("stock:{path.id", "unbalanced"),
    ("stock:path.id}", "unbalanced"),
    ("stock:{path.a}{path.b}", "separated"),
    ("stock:{path.a}x{path.b}", "separated"),
    ("stock:{path.a}%{path.b}", "separated"),
    ("stock *:{path.a}", "printable ASCII"),
    ("stock*:{path.a}", "'*'"),
    ("cart:{principal.id}", "or {principal}"),
    ("cart:{cookie.}", "ill-formed"),
    ("cart:{principal}{path.a}", "separated"),
    ("x" * MAX_NAME + ":{path.a}", "longer than"),
], ids=lambda v: v[:30] if isinstance(v, str) else v)
def test_bad_template_is_rejected_at_decoration_time(template, message):
    with pytest.raises(ValueError, match=message):
        locked(template)


def test_template_parts_and_body_need():
    tpl = parse_template("order:{header.X-User-Id}:{json.item.sku}:{query.q}")
    assert [(p.source, p.field) for p in tpl.parts] == [("header", "x-user-id"), ("json", "item.sku"), ("query", "q")]
    assert tpl.needs_body
    assert not parse_template("stock:{path.id}").needs_body


def test_principal_and_cookie_placeholders():
    tpl = parse_template("cart:{principal?|casefold}:{cookie.Session}")
    assert [(p.source, p.field, p.optional, p.normalisers) for p in tpl.parts] == [
        ("principal", "", True, ("casefold",)), ("cookie", "Session", False, ())]   # cookie names keep their case
    assert not tpl.needs_body
    assert tpl.render(lambda part: "Ann" if part.source == "principal" else "a:b") == "cart:ann:a%3Ab"
    assert tpl.render(lambda part: None if part.source == "principal" else "s") == "cart:%n:s"


def test_plain_values_stay_readable():
    assert render("stock:{path.id}", {"path.id": "1001"}) == "stock:1001"
    assert render("u:{header.x-user}", {"header.x-user": "alice.b-c_d~e"}) == "u:alice.b-c_d~e"


@pytest.mark.parametrize("value", [":", "{", "}", "*", "\n", "\r\n", " ", "%", "é", "🔒", "a:b", "}{", "\x00"])
def test_dangerous_characters_are_escaped(value):
    out = escape(value)
    assert not set(out) & set(":{}*\n\r \x00é🔒")
    assert out.isascii()


def test_long_values_are_hashed_and_bounded():
    long = "x" * 10_000
    out = escape(long)
    assert out.startswith("%h") and len(out) <= MAX_PART
    assert escape(long) == out  # deterministic across calls (and replicas)
    assert escape(long + "y") != out


def test_hash_parts_never_contains_the_raw_value():
    name = render("user:{header.x-email}", {"header.x-email": "alice@example.com"}, SECRET)
    assert "alice" not in name and "example" not in name
    assert name.startswith("user:%k")
    assert name == render("user:{header.x-email}", {"header.x-email": "alice@example.com"}, SECRET)
    assert name != render("user:{header.x-email}", {"header.x-email": "alice@example.com"}, b"other")


def test_rendered_name_never_contains_braces():
    name = render("a:{path.x}:{query.y}", {"path.x": "{x}", "query.y": "}{"})
    assert "{" not in name and "}" not in name


def test_json_values():
    body = {"item": {"sku": "A1", "qty": 2, "flag": True, "tags": ["t0", "t1"], "none": None, "obj": {}}}
    assert json_value(body, Part("json", "item.sku", "")) == "A1"
    assert json_value(body, Part("json", "item.qty", "")) == "2"
    assert json_value(body, Part("json", "item.flag", "")) == "true"
    assert json_value(body, Part("json", "item.tags.1", "")) == "t1"
    for field in ("item.none", "item.obj", "item.missing", "item.tags.9", "item.sku.x"):
        with pytest.raises(TemplateValueError):
            json_value(body, Part("json", field, ""))


values = st.text(max_size=80) | st.sampled_from(["", ":", "%", "%3A", "%h", "a:b", "x" * 200])
TEMPLATES = ["k:{path.a}:{path.b}", "{path.a}/{path.b}", "k:{path.a}x:{path.b}:y", "{path.a}|{path.b}|{path.c}"]


@settings(max_examples=300, deadline=None)
@given(template=st.sampled_from(TEMPLATES), first=st.tuples(values, values, values),
       second=st.tuples(values, values, values), hashed=st.booleans())
def test_distinct_value_tuples_never_give_the_same_key(template, first, second, hashed):
    tpl = parse_template(template)
    n = len(tpl.parts)
    first, second = first[:n], second[:n]
    secret = SECRET if hashed else None

    def key(vals):
        it = iter(vals)
        return tpl.render(lambda part: next(it), secret)

    if first != second:
        assert key(first) != key(second)
    else:
        assert key(first) == key(second)
    assert "{" not in key(first) and "}" not in key(first) and len(key(first)) <= MAX_NAME


def test_secret_resolution(monkeypatch):
    from otel_lock.asgi._keys import SECRET_ENV, resolve_secret

    monkeypatch.delenv(SECRET_ENV, raising=False)
    assert resolve_secret("explicit", "ns") == b"explicit"
    salt = resolve_secret(None, "ns")
    assert salt == resolve_secret(None, "ns") != resolve_secret(None, "other")  # same on every replica
    monkeypatch.setenv(SECRET_ENV, "from-env")
    assert resolve_secret(None, "ns") == b"from-env"
    assert resolve_secret(b"bytes", "ns") == b"bytes"


def test_typed_values_render_canonically():
    import datetime
    import decimal
    import enum
    import uuid

    from otel_lock.asgi._values import render

    class Color(enum.Enum):
        RED = "red"

    part = Part("json", "x", "{json.x}")
    cases = [(7, "7"), (True, "true"), (7.0, "7"), (decimal.Decimal("7.50"), "7.5"), (Color.RED, "red"),
             (uuid.UUID(int=1), "00000000-0000-0000-0000-000000000001"), (datetime.date(2026, 1, 2), "2026-01-02"),
             ("07", "07"), ("", "")]
    for value, text in cases:
        assert render(value, part) == text
    assert [render(x, part) for x in (float("inf"), float("-inf"), float("nan"))] == ["Infinity", "-Infinity", "NaN"]
    for bad in (None, [1], {"a": 1}, b"x", object()):
        with pytest.raises(TemplateValueError):
            render(bad, part)
    assert render(None, Part("json", "x", "{json.x?}", optional=True)) is None


# -- equal for the handler means the same key --------------------------------------------


@pytest.mark.parametrize("number, text", [
    (7, "7"), (7.0, "7"), ("7.00", "7"), ("70e-1", "7"), ("0.7E1", "7"), (-0.0, "0"), ("-0", "0"),
    (0.1, "0.1"), (1e21, "1e+21"), (1e20, "100000000000000000000"), (1.5e-7, "1.5e-7"), (1e-6, "0.000001"),
    (2**53 + 1, "9007199254740993"), ("9007199254740993.0", "9007199254740993"), (10**21, "1e+21"),
    ("1e999999999", "1e+999999999"), (-12.5, "-12.5"), (5e-324, "5e-324"),
])
def test_numbers_render_as_rfc_8785_says_and_big_integers_keep_their_digits(number, text):
    import decimal

    from otel_lock.asgi._canonical import number_text

    assert number_text(decimal.Decimal(number) if isinstance(number, str) else number) == text


def _spellings(mantissa: int, exponent: int, pad: int) -> list[str]:
    """JSON spellings of mantissa * 10**exponent: plain, with trailing zeros, and in exponent forms."""
    import decimal

    big, small = mantissa * 10**pad, exponent - pad          # the same value with `pad` more digits
    digits, sign = str(abs(big)), "-" if big < 0 else ""
    point = f"{sign}{digits[0]}.{digits[1:] or '0'}e{small + len(digits) - 1}"
    return [format(decimal.Decimal(mantissa).scaleb(exponent), "f"), format(decimal.Decimal(big).scaleb(small), "f"),
            f"{big}e{small}", f"{big}E{small:+d}", point]


@settings(max_examples=300, deadline=None)
@given(mantissa=st.integers(-10**20, 10**20), exponent=st.integers(-30, 30), pad=st.integers(0, 3))
def test_every_json_spelling_of_one_number_is_one_key(mantissa, exponent, pad):
    from otel_lock.asgi._canonical import loads

    part = Part("json", "n", "{json.n}")
    spellings = _spellings(mantissa, exponent, pad)
    keys = {render("k:{json.n}", {"json.n": json_value(loads('{"n": %s}' % s), part)}) for s in spellings}
    assert len(keys) == 1, (spellings, keys)
    as_float = float(spellings[0])
    if _exact(spellings[0], as_float):
        # A float-typed field sees the double: where it is the same value, the key is the same.
        from otel_lock.asgi._values import render as render_typed

        assert {render("k:{json.n}", {"json.n": render_typed(as_float, part)})} == keys


def _exact(spelling: str, number: float) -> bool:
    import decimal

    return decimal.Decimal(spelling) == decimal.Decimal(repr(number))


@settings(max_examples=200, deadline=None)
@given(moment=st.datetimes(min_value=__import__("datetime").datetime(1900, 1, 2),
                           max_value=__import__("datetime").datetime(2900, 1, 1)),
       minutes=st.lists(st.integers(-23 * 60, 23 * 60), min_size=1, max_size=4))
def test_one_instant_at_any_utc_offset_is_one_key(moment, minutes):
    import datetime as dt

    from pydantic import TypeAdapter

    from otel_lock.asgi._values import render as render_typed

    part = Part("json", "at", "{json.at}")
    instant = moment.replace(tzinfo=dt.timezone.utc)
    spellings = [instant.isoformat().replace("+00:00", "Z")]
    spellings += [instant.astimezone(dt.timezone(dt.timedelta(minutes=m))).isoformat() for m in minutes]
    adapter = TypeAdapter(dt.datetime)
    texts = {render_typed(adapter.validate_python(s), part) for s in spellings}
    assert len(texts) == 1 and texts.pop().endswith("Z"), spellings


def test_typed_scalars_have_one_text_per_value():
    import datetime as dt
    import ipaddress

    from pydantic import AnyUrl, HttpUrl, IPvAnyAddress, TypeAdapter

    from otel_lock.asgi._values import render as render_typed

    part = Part("json", "v", "{json.v}")
    same = [
        (dt.timedelta, ["PT1H", 3600, "01:00:00", 3600.0]),
        (dt.time, ["09:00:00Z", "10:00+01:00", "09:00:00.000000+00:00"]),
        (HttpUrl, ["HTTP://Example.COM:80/a", "http://example.com/a"]),
        (AnyUrl, ["HTTPS://Example.com/", "https://example.com"]),
        (IPvAnyAddress, ["::FFFF:1.2.3.4", "0:0:0:0:0:ffff:102:304"]),
        (ipaddress.IPv6Address, ["2001:DB8::1", "2001:0db8:0:0:0:0:0:1"]),
        (ipaddress.IPv4Address, ["10.0.0.1", "10.0.0.1"]),
    ]
    for kind, spellings in same:
        adapter = TypeAdapter(kind)
        texts = {render_typed(adapter.validate_python(s), part) for s in spellings}
        assert len(texts) == 1, (kind, texts)
    assert render_typed(dt.time(9, 0, tzinfo=dt.timezone(dt.timedelta(hours=1))), part) == "08:00:00Z"
    assert render_typed(dt.datetime(2026, 1, 1, 9, 0), part) == "2026-01-01T09:00:00"   # naive: as given


def test_optional_placeholders_render_a_marker_no_value_can_take():
    tpl = parse_template("u:{json.email?}:{path.id}")
    assert tpl.parts[0].optional and tpl.parts[0].text == "{json.email?}" and tpl.parts[0].field == "email"
    absent = tpl.render(lambda p: None if p.source == "json" else "1")
    assert absent == "u:%n:1"
    for value in ("%n", "n", "", "%", "%6E"):
        assert tpl.render(lambda p: value if p.source == "json" else "1") != absent
        assert tpl.render(lambda p: value if p.source == "json" else "1", SECRET) != \
            tpl.render(lambda p: None if p.source == "json" else "1", SECRET)
    body = {"email": None}
    assert json_value(body, tpl.parts[0]) is None and json_value({}, tpl.parts[0]) is None
    with pytest.raises(TemplateValueError):
        json_value(body, Part("json", "email", "{json.email}"))


def test_a_normaliser_applies_to_the_value_before_it_is_escaped_or_hashed():
    tpl = parse_template("u:{json.email|casefold}")
    assert tpl.parts[0].normalisers == ("casefold",) and not tpl.parts[0].optional
    names = {tpl.render(lambda p: v) for v in ("Alice@Example.com", "ALICE@example.COM", "alice@example.com")}
    assert names == {"u:alice%40example.com"}
    hashed = {tpl.render(lambda p: v, SECRET) for v in ("Straße@x", "STRASSE@X")}
    assert len(hashed) == 1
    both = parse_template("u:{json.email?|casefold}").parts[0]
    assert both.optional and both.normalisers == ("casefold",)
    with pytest.raises(ValueError, match="unknown normaliser 'lower'.*casefold"):
        locked("u:{json.email|lower}")


def test_which_declared_types_have_a_canonical_text():
    import datetime as dt
    import decimal
    import ipaddress
    import uuid
    from typing import Annotated, Any, Literal

    from pydantic import (AnyUrl, AwareDatetime, EmailStr, FutureDate, HttpUrl, IPvAnyAddress, IPvAnyNetwork,
                          NameEmail, SecretStr, conint, constr)

    from otel_lock.asgi._canonical import scalar_type

    renders = [str, int, float, bool, decimal.Decimal, uuid.UUID, dt.date, dt.datetime, dt.time, dt.timedelta,
               HttpUrl, AnyUrl, EmailStr, IPvAnyAddress, IPvAnyNetwork, ipaddress.IPv4Address, ipaddress.IPv6Network,
               AwareDatetime, FutureDate, Literal["a", 1], conint(gt=0), constr(max_length=3),
               Annotated[decimal.Decimal, "meta"]]
    assert [t for t in renders if scalar_type(t) is not True] == []
    assert [t for t in (SecretStr, NameEmail, bytes, object()) if scalar_type(t) is True] == []
    assert scalar_type(Any) is None
