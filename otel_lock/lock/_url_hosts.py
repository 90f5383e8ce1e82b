"""What `redis+sentinel://` and `redis+cluster://` URLs share: credentials, then a list of hosts.

    scheme://[[user]:password@]host1[:port][,host2[:port]...]/path

The password and user are the Redis server's; hosts may be IPv6 in brackets.
Anything that does not fit is a ValueError that names the problem, shows the
expected form, and never echoes the password.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from urllib.parse import unquote, urlsplit

_HOST = re.compile(r"^(?:\[(?P<v6>[0-9A-Fa-f:.]+)\]|(?P<name>[^\s:\[\]/@,]+))(?::(?P<port>[0-9]+))?$")


@dataclass(frozen=True)
class HostsUrl:
    hosts: tuple[tuple[str, int], ...]
    username: str | None
    password: str | None
    path: str


class UrlForm:
    """One URL scheme: its name in messages, its default port and the form shown on errors."""

    def __init__(self, scheme: str, what: str, default_port: int, form: str) -> None:
        self.scheme, self.what, self.default_port, self.form = scheme, what, default_port, form

    def error(self, url: str, problem: str) -> ValueError:
        return ValueError(f"bad {self.what} URL {redact(url)!r}: {problem}; expected {self.form}")

    def parse(self, url: str) -> HostsUrl:
        parts = urlsplit(url)
        if parts.scheme != self.scheme:
            raise self.error(url, f"the scheme must be {self.scheme}://")
        if parts.query or parts.fragment:
            raise self.error(url, "query strings and fragments are not accepted (pass options as keyword arguments)")
        userinfo, at, hostlist = parts.netloc.rpartition("@")
        username = password = None
        if at:
            user, colon, secret = userinfo.partition(":")
            username = unquote(user) or None
            password = unquote(secret) if colon else None
            if password is None and username is not None:
                raise self.error(url, "give the password as ':password@' (or 'user:password@')")
        hosts = []
        for item in hostlist.split(","):
            match = _HOST.match(item.strip())
            if not match:
                raise self.error(url, f"{item!r} is not a host[:port]")
            port = int(match["port"] or self.default_port)
            if not 0 < port < 65536:
                raise self.error(url, f"port {port} is out of range")
            hosts.append((match["v6"] or match["name"], port))
        return HostsUrl(tuple(hosts), username, password, parts.path)


def redact(url: str) -> str:
    head, sep, tail = url.rpartition("@")
    return f"{head.split('://')[0]}://***@{tail}" if sep else url
