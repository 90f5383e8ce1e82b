"""Multipart bodies in the fingerprint: version 3 reads them with python-multipart, version 2 keeps its splitter.

Where both read a body (no preamble, no epilogue), version 3's parts are
version 2's, piece for piece (a property test); the boundary never matters;
and a body python-multipart refuses, has not seen end, or frames more
leniently than RFC 2046 is fingerprinted as its raw bytes, so only a
byte-identical retry replays it.
"""

from __future__ import annotations

import httpx
from hypothesis import given, settings
from hypothesis import strategies as st

from otel_lock.asgi.idempotency._fingerprint import canonical_body
from otel_lock.asgi.idempotency._fingerprint_v2 import multipart_parts_v2
from otel_lock.asgi.idempotency._multipart import multipart_parts

FORM = "multipart/form-data; boundary={}"
BODY = (b'--xyz\r\nContent-Disposition: form-data; name="f"; filename="a.txt"\r\n'
        b"Content-Type: text/plain\r\n\r\nhello\r\n--xyz--\r\n")

names = st.text(st.characters(codec="ascii", categories=["L", "N"]), min_size=1, max_size=8)
contents = st.binary(max_size=40).filter(lambda b: b"--" not in b and b"\r" not in b)
parts = st.lists(st.tuples(names, st.one_of(st.none(), names), contents), min_size=1, max_size=4)


def encode(boundary: str, form: list[tuple[str, str | None, bytes]]) -> bytes:
    out = b""
    for name, filename, content in form:
        disposition = f'form-data; name="{name}"' + (f"; filename={filename}" if filename else "")
        out += f"--{boundary}\r\nContent-Disposition: {disposition}\r\n\r\n".encode() + content + b"\r\n"
    return out + f"--{boundary}--\r\n".encode()


def pieces(framed: bytes) -> list[bytes]:
    found = []
    while framed:
        size = int.from_bytes(framed[:8], "big")
        found.append(framed[8:8 + size])
        framed = framed[8 + size:]
    return found


@settings(max_examples=150, deadline=None)
@given(parts)
def test_version_3_reads_the_parts_version_2_read(form):
    body = encode("b0undary", form)
    old, new = multipart_parts_v2(body, FORM.format("b0undary")), multipart_parts(body, FORM.format("b0undary"))
    assert old is not None and new is not None
    # Version 2 adds the preamble (first) and the epilogue (last); the parts between are the same bytes.
    assert pieces(new) == pieces(old)[1:-1]


@settings(max_examples=50, deadline=None)
@given(parts, st.sampled_from(["a", "----WebKitFormBoundary7MA4YWxkTrZu0gW", "x" * 70]))
def test_the_boundary_is_not_part_of_the_request(form, boundary):
    assert canonical_body(encode(boundary, form), FORM.format(boundary)) == \
        canonical_body(encode("other", form), FORM.format('"other"'))


def test_a_body_httpx_builds_is_read_by_its_parts():
    files = {"upload": ("a.txt", b"hello", "text/plain")}
    one = httpx.Request("POST", "http://t/", data={"n": "1"}, files=files)
    two = httpx.Request("POST", "http://t/", data={"n": "1"}, files=files)
    other = httpx.Request("POST", "http://t/", data={"n": "2"}, files=files)
    assert one.headers["content-type"] != two.headers["content-type"]   # two random boundaries
    canonical = [canonical_body(r.read(), r.headers["content-type"]) for r in (one, two, other)]
    assert canonical[0].startswith(b"m") and canonical[0] == canonical[1] != canonical[2]


def test_what_python_multipart_refuses_or_has_not_seen_end_is_raw_bytes():
    form = FORM.format("xyz")
    refused = {
        "truncated": BODY[:-9],
        "no close delimiter": BODY[:-4],
        "a header without a colon": BODY.replace(b"Content-Type:", b"Content-Type"),
        "a space before the colon": BODY.replace(b"Content-Type:", b"Content-Type :"),
        "a preamble": b"junk\r\n" + BODY,
        "bare LF": BODY.replace(b"\r\n", b"\n"),
    }
    for why, body in refused.items():
        assert multipart_parts(body, form) is None, why
        assert canonical_body(body, form) == b"b" + body, why
    assert multipart_parts(BODY, "multipart/form-data") is None                     # no boundary
    assert multipart_parts(BODY, FORM.format("x" * 71)) is None                      # RFC 2046: at most 70


def test_framing_python_multipart_reads_leniently_is_raw_bytes_too():
    form = FORM.format("xyz")
    lenient = {
        "an epilogue": BODY + b"trailer",
        "a part after the close delimiter": BODY + b"--xyz\r\n\r\n1\r\n--xyz--\r\n",
        "a line starting with the boundary": BODY.replace(b"hello", b"1\r\n--xyzX\r\n\r\n2"),
    }
    for why, body in lenient.items():
        assert multipart_parts(body, form) is None, why
        assert canonical_body(body, form) == b"b" + body, why
    assert multipart_parts(BODY.removesuffix(b"\r\n"), form) == multipart_parts(BODY, form)   # CRLF after close
    assert canonical_body(BODY.replace(b"hello", b"hellO"), form) != canonical_body(BODY, form)
