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
    cases = [(7, "7"), (True, "true"), (7.0, "7.0"), (decimal.Decimal("7.50"), "7.5"), (Color.RED, "red"),
             (uuid.UUID(int=1), "00000000-0000-0000-0000-000000000001"), (datetime.date(2026, 1, 2), "2026-01-02"),
             ("07", "07")]
    for value, text in cases:
        assert render(value, part) == text
    for bad in (None, "", [1], {"a": 1}):
        with pytest.raises(TemplateValueError):
            render(bad, part)
