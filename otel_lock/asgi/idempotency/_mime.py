"""MIME header values, canonical: parameters quoted or not, RFC 2231 too, are one spelling."""

from __future__ import annotations

import json
from email.message import Message as MimeHeader


def params(value: str) -> list[tuple[str, str]]:
    """MIME parameters of a header value (quoted or not, RFC 2231 too), names lower-cased, repeats kept."""
    header = MimeHeader()
    header["content-type"] = value
    found = []
    for name, param in header.get_params(header="content-type", failobj=[])[1:]:
        found.append((name.lower(), param if isinstance(param, str) else str(param[2])))
    return found


def canonical_header(name: str, value: str) -> str:
    """`name:value` of a part header: the name lower-cased, Content-Disposition and Content-Type as their
    type and sorted parameters."""
    key, text = name.lower(), value.strip(" \t")
    if key in ("content-disposition", "content-type"):
        main = text.split(";", 1)[0].strip().lower()
        text = json.dumps([main, sorted(params(text))], ensure_ascii=True)
    return f"{key}:{text}"
